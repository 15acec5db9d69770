"""Layer 2, "does the reward measure what I think?": reward components, advantage size, length by outcome.

Seed sections: 2.2 (the (G-1)/sqrt(G) bound; above it is a data or reward bug), the warning "monitor reward
range, sigma and every component *before* normalisation", 4.1 (split length by correctness) and 4.3 (split
the reward by component).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.groups import Groups, group_stats
from grpo_exporter.functional.histogram import histograms
from grpo_exporter.functional.histogram_host import Quantiles
from grpo_exporter.functional.reading import Extreme, Ratio, count, filled, finite, fraction, masked_max


class RewardStats(NamedTuple):
    mean: Ratio
    group_std_mean: Ratio
    group_range_mean: Ratio


def reward_stats(values: Tensor, groups: Groups) -> RewardStats:
    """Mean of finite rewards, and the means over groups of the within-group population std and range (groups
    with a finite reward; the others add 0 to every sum)."""
    stats = group_stats(values, groups)
    return RewardStats(
        fraction(stats.sum.sum(), stats.count.sum()),
        fraction(stats.population_std.sum(), stats.exists.sum()),
        fraction(stats.range.sum(), stats.exists.sum()),
    )


def sequence_abs_advantage(advantages: Tensor, loss_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-sequence |A| (max over finite loss tokens for (N, T) advantages) and whether it exists."""
    if advantages.dim() == 1:
        return advantages.float().abs(), torch.isfinite(advantages)
    valid = finite(advantages)
    if loss_mask is not None:
        valid = valid & loss_mask
    per_seq = filled(advantages.abs(), valid, -1.0).amax(dim=1)
    return per_seq.clamp(min=0.0), count(valid, 1) > 0


class AdvantageCheck(NamedTuple):
    abs_max: Extreme
    over_bound: Tensor


def over_bound(abs_a: Tensor, exists: Tensor, groups: Groups, bounds: Tensor, rtol: float) -> Tensor:
    """(N,) the sequences whose |A| (:func:`sequence_abs_advantage`) is above their group's bound, with relative
    slack ``rtol`` for rounding and the eps in std + eps: the step's count and the flight recorder's rows."""
    return exists & (abs_a.double() > bounds[groups.index] * (1.0 + rtol) + 1e-6)


def advantage_check(
    advantages: Tensor, loss_mask: Tensor | None, groups: Groups, bounds: Tensor, rtol: float
) -> AdvantageCheck:
    """Max |A| and the number of sequences above their group's bound (:func:`over_bound`)."""
    abs_a, exists = sequence_abs_advantage(advantages, loss_mask)
    return AdvantageCheck(masked_max(abs_a, exists), over_bound(abs_a, exists, groups, bounds, rtol).sum())


class LengthStats(NamedTuple):
    """Per subset (row i): the sum (fp64) and count of its lengths, (k,) each, and its quantiles."""

    totals: Tensor
    counts: Tensor
    quantiles: list[Quantiles]


def length_stats(
    completion_lengths: Tensor, members: Sequence[Tensor], quantiles: Sequence[float]
) -> LengthStats:
    """Sum, count and quantiles of the completion lengths (tokens) of each ``members`` (N,) bool subset (the
    outcomes: all, correct, incorrect), in one pass: one histogram stack, one read of its quantiles. Any
    non-negative per-completion integer reads alike (the turns of a multi-turn completion)."""
    chosen = torch.stack(list(members))
    lengths = completion_lengths.double()
    totals = torch.where(chosen, lengths, 0.0).sum(dim=1)
    counts = count(chosen, dim=1)
    h = histograms(completion_lengths, chosen)
    qs = tuple(quantiles)
    return LengthStats(totals, counts, [Quantiles(h, qs, row=i) for i in range(chosen.shape[0])])


class NoiseSignal(NamedTuple):
    """Groups whose advantage comes from reward noise (seed 第 4 篇 2.2): how many of how many, and, over the
    groups whose correctness ties while their reward varies, each component's share of the reward variance."""

    noise_groups: Ratio
    tied_variance: dict[str, Ratio]


def noise_signal(
    rewards: Tensor,
    groups: Groups,
    range_fraction: float,
    scale: float | None,
    sigma_normalised: bool,
    correct: Tensor | None = None,
    components: Mapping[str, Tensor] | None = None,
) -> NoiseSignal:
    """What sigma-normalisation makes of a tiny spread (seed 第 4 篇 2.2: "一组回答总分都在 0.5000、唯一一条
    0.5001 ... 除以之后仍可能得到接近 3 的 advantage"; watch the range, sigma and each component *before*
    normalisation, "只看前者，看不出模型正在追逐一丁点分数噪声").

    A noise group: its total reward varies (range > 0) but by less than ``range_fraction`` x the reward's scale
    (``scale``, or the batch's own range of finite rewards when None), and its advantage is divided by its own
    sigma (``sigma_normalised``: advantage_norm unbiased or population), so the noise enters the update at full
    size. Without sigma (Dr. GRPO's none, or a batch-wide std) a tiny spread stays a tiny advantage: no group
    counts. Denominator: the batch's groups with a finite reward.

    ``tied_variance``: with ``correct`` and ``components``, over the groups whose completions are all correct or
    all incorrect yet whose total reward varies, component c's summed within-group (population) variance over
    every component's (shares that add up to 1; the components as handed, TRL's unweighted): which component
    supplies the advantage the verifier cannot. Absent when no component varies there.
    """
    stats = group_stats(rewards, groups)
    valid = torch.isfinite(rewards)
    noisy = torch.zeros_like(stats.exists)
    if sigma_normalised:
        if scale is None:
            x = rewards.double()
            top = torch.where(valid, x, -torch.inf).amax() if x.numel() else x.new_zeros(())
            bottom = torch.where(valid, x, torch.inf).amin() if x.numel() else x.new_zeros(())
            reach = torch.where(valid.any(), top - bottom, 0.0)
        else:
            reach = torch.tensor(float(scale), dtype=torch.float64, device=rewards.device)
        noisy = stats.exists & (stats.range > 0) & (stats.range < range_fraction * reach)
    shares: dict[str, Ratio] = {}
    if correct is not None and components:
        right = groups.count(correct & valid)
        tied = stats.exists & (stats.range > 0) & ((right == 0) | (right == stats.count))
        parts = {name: torch.where(tied, group_stats(values, groups).population_std.square(), 0.0).sum()
                 for name, values in components.items()}
        total = torch.stack(list(parts.values())).sum()
        shares = {name: fraction(part, total) for name, part in parts.items()}
    return NoiseSignal(fraction(count(noisy), count(stats.exists)), shares)
