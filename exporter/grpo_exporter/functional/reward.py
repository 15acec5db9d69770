"""Layer 2, "does the reward measure what I think?": reward components, advantage size, length by outcome.

Seed sections: 2.2 (the (G-1)/sqrt(G) bound; above it is a data or reward bug), the warning "monitor reward
range, sigma and every component *before* normalisation", 4.1 (split length by correctness) and 4.3 (split
the reward by component).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def advantage_check(
    advantages: Tensor, loss_mask: Tensor | None, groups: Groups, bounds: Tensor, rtol: float
) -> AdvantageCheck:
    """Max |A| and the number of sequences above their group's normalisation bound (with relative slack
    ``rtol`` for rounding and the eps in std + eps)."""
    abs_a, exists = sequence_abs_advantage(advantages, loss_mask)
    limit = bounds[groups.index] * (1.0 + rtol) + 1e-6
    over = exists & (abs_a.double() > limit)
    return AdvantageCheck(masked_max(abs_a, exists), over.sum())


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
