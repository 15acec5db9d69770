"""Per-prompt solve-rate history: the p behind the zero-variance prediction E[p^G+(1-p)^G] (seed 第 3 篇 §1).

A fixed-size table on the tensors' device, indexed by ``prompt_id`` modulo its size, updated in place with
no host sync. The table follows the batches from device to device (a rollout on another device moves it
there once), so no rollout ever fails for where its tensors live.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_exporter.functional.groups import Groups
from grpo_exporter.inputs import InputError, StepInputs, describe


class SolveRates:
    """Exponentially weighted solve rate per prompt slot, and the running solve rate of recent batches
    (the estimate of a prompt never seen)."""

    def __init__(self, slots: int, prior: float, halflife: float) -> None:
        self.slots = slots
        self.keep = 0.5 ** (1.0 / halflife)
        self.table: Tensor | None = None
        self.overall: Tensor = torch.tensor(prior, dtype=torch.float64)

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
        if self.table is None:
            self.table = torch.full((self.slots,), math.nan, device=device)
        elif self.table.device != device:
            self.table = self.table.to(device)
        self.overall = self.overall.to(device)
        return prompt_ids.long().remainder(self.slots)

    def prior(self, slots: Tensor) -> Tensor:
        """Each prompt's estimate *before* this batch: its own history, or the running solve rate when
        unseen (on the device, no host sync)."""
        assert self.table is not None
        estimate = self.table[slots]
        return torch.where(torch.isnan(estimate), self.overall.to(estimate.dtype), estimate)

    def update(self, slots: Tensor, prior: Tensor, correct: Tensor, groups: Groups | None) -> None:
        """Move each prompt's estimate toward its group's solve rate in this batch, and the running rate
        toward the batch's. Prompts sharing a slot share an estimate."""
        assert self.table is not None
        if groups is not None:
            rate = (groups.count(correct).double() / groups.sizes().clamp(min=1))[groups.index]
            estimate = self.keep * prior.double() + (1.0 - self.keep) * rate
            self.table.index_put_((slots,), estimate.to(self.table.dtype))
        self.overall = self.keep * self.overall + (1.0 - self.keep) * correct.double().mean()
