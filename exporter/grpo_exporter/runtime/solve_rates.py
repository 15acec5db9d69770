"""Per-prompt solve-rate history: the prediction behind the zero-variance share (seed 第 3 篇 (signal health) §1).

A group of G samples of a prompt with solve rate p is all-correct or all-wrong with probability p^G + (1-p)^G.
p is never known, and that function is convex: plugging in a *mean* p (of the batch, or of a prompt's noisy
history) predicts far fewer zero-variance groups than prompts of spread difficulty give (the seed's averaging
trap: p ~ Beta(0.3, 0.3), G = 16 gives 0.43, p = 0.5 gives 3e-5). So each prompt's p is a distribution:

* the population: a Beta(a0, b0) fitted by moments to the groups seen lately (the mean of k/n and the unbiased
  mean of k(k-1)/(n(n-1)) estimate E[p] and E[p^2]); an unseen prompt is predicted by averaging over it;
* a prompt seen before: the Beta posterior Beta(a0 + hits, b0 + misses) from its own discounted history.

The prediction is the Beta-binomial probability of k = 0 or k = G. Tables live on the tensors' device,
indexed by ``prompt_id`` modulo their size, updated in place with no host sync; they follow the batches from
device to device (a rollout on another device moves them there once). The population's two moments live on
the host: three sums per rollout travel with its one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_exporter.functional.groups import Groups
from grpo_exporter.functional.samples import beta_binomial_extremes
from grpo_exporter.inputs import InputError, StepInputs, describe

_MAX_CONCENTRATION = 1e4  # a0 + b0 when the population has (almost) no spread: p known to ~1%
_MIN_SHAPE = 1e-3


class SolveRates:
    """Discounted hits and trials per prompt slot (on the device), and the discounted moments of the population's
    solve rates (on the host).

    ``table`` (slots, 2): the discounted hits and trials of each slot, updated in place by each rollout.
    ``mean`` and ``second``: E[p] and E[p^2] of the population, Python floats: a rollout's groups add their
    terms (:meth:`moment_terms`, three sums on the device) to the step's one transfer, and the host moves the
    moments with them (:meth:`update`); the population's Beta is then host arithmetic, no operator (this runs
    on every rollout, on tensors of a few hundred values, where the operator count is the cost)."""

    def __init__(self, slots: int, prior: float, halflife: float) -> None:
        self.slots = slots
        self.keep = 0.5 ** (1.0 / halflife)
        self.table: Tensor | None = None
        # before any batch: a Beta of concentration 2 around the configured prior (a0 = 2p, b0 = 2(1-p)),
        # whose second moment is a0 (a0 + 1) / ((a0 + b0)(a0 + b0 + 1))
        a0 = 2.0 * prior
        self.mean, self.second = prior, a0 * (a0 + 1.0) / 6.0

    def slots_of(self, inputs: StepInputs, prompt_ids: Tensor | None) -> Tensor | None:
        """This batch's table slots (None without ``prompt_ids`` and ``correct``)."""
        if prompt_ids is None or inputs.correct is None:
            return None
        if not isinstance(prompt_ids, Tensor) or prompt_ids.shape != inputs.correct.shape or (
            prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool
        ):
            raise InputError(
                "prompt_ids", f"an integer tensor of shape {tuple(inputs.correct.shape)} like `correct`",
                describe(prompt_ids),
            )
        device = inputs.device
        if prompt_ids.device != device:
            raise InputError("prompt_ids", f"device {device} like `correct`", f"device {prompt_ids.device}")
        if self.table is None or (self.table.is_meta and device.type != "meta"):
            # a table on the meta device (a dry run's) holds no history to move: it starts afresh
            self.table = torch.zeros(self.slots, 2, dtype=torch.float64, device=device)
        elif self.table.device != device:
            self.table = self.table.to(device)
        return (prompt_ids if prompt_ids.dtype == torch.int64 else prompt_ids.long()).remainder(self.slots)

    def population(self) -> tuple[float, float]:
        """(a0, b0): the Beta with the population's mean and second moment (method of moments)."""
        m = min(max(self.mean, 1e-6), 1.0 - 1e-6)
        variance = max(self.second - m * m, m * (1.0 - m) / (_MAX_CONCENTRATION + 1.0))
        concentration = min(max(m * (1.0 - m) / variance - 1.0, 2.0 * _MIN_SHAPE), _MAX_CONCENTRATION)
        return max(m * concentration, _MIN_SHAPE), max((1.0 - m) * concentration, _MIN_SHAPE)

    def predict(self, slots: Tensor, groups: Groups) -> Tensor:
        """(2, N) per sample: the predicted probabilities that its group is all-correct and all-wrong, from its
        prompt's posterior *before* this batch (fp64, on the device, no host sync); their sum is the
        zero-variance prediction."""
        assert self.table is not None
        a0, b0 = self.population()
        hits, trials = self.table[slots].unbind(1)
        size = float(groups.size) if groups.size is not None else groups.sizes()[groups.index]
        return beta_binomial_extremes(hits + a0, (trials - hits).add_(b0), size)

    @staticmethod
    def moment_terms(correct: Tensor, groups: Groups) -> Tensor:
        """(3,) fp64 on the device: over this batch's groups of two or more, the sums of k/n and of the unbiased
        k(k-1)/(n(n-1)), and their number (groups of one say nothing about E[p^2])."""
        hits = groups.count(correct).double()
        sizes = groups.sizes().double()
        pairs = sizes >= 2
        share = hits / sizes.clamp(min=1.0)
        second = share * (hits - 1.0) / (sizes - 1.0).clamp(min=1.0)
        return torch.where(pairs, torch.stack([share, second, pairs.double()]), 0.0).sum(dim=1)

    def update(self, slots: Tensor, correct: Tensor, groups: Groups, terms: Sequence[float] | None) -> None:
        """Discount each prompt's history and add this batch's outcomes (prompts sharing a slot share it); move
        the population moments toward this batch's groups by their :meth:`moment_terms`, read on the host
        (None: the step brought none back; the moments stay)."""
        assert self.table is not None
        counts = torch.stack([groups.count(correct), groups.sizes()], dim=1).double()  # (bins, 2)
        # every member of a group carries its group's counts; index_put_ keeps one write per slot
        self.table.index_put_((slots,), self.table[slots].mul_(self.keep).add_(counts[groups.index]))
        if terms is not None and terms[2] > 0:
            step = 1.0 - self.keep
            self.mean += step * (terms[0] / terms[2] - self.mean)
            self.second += step * (terms[1] / terms[2] - self.second)
