"""Prompt groups as dense segment indices, and per-group reductions without host syncs.

A group is the G completions sampled for one prompt. Counting groups with ``torch.unique`` would put the
count on the host; instead every group gets a dense index into a fixed number of bins known from shapes
alone (N // G for contiguous groups, N for arbitrary ids), and empty bins are simply ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, overload

import torch
from torch import Tensor

from grpo_exporter.config import AdvantageNorm
from grpo_exporter.functional.constants import cached_constant

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Groups:
    """``index`` (N,) int64 group of each completion in [0, bins); ``bins`` is a host-known upper bound.
    ``size``: set for contiguous groups of that many members (``index`` = arange(N) // size), whose per-group
    reductions are a reshape and one reduction along it (one operator, where a scatter takes two to five).

    One grouping serves one computation (a stage of one step): the counts and statistics it takes are
    remembered per input tensor, since several metrics count the same outcomes (sizes, hits) or read the same
    reward statistics, and each is a few operators to dozens."""

    index: Tensor
    bins: int
    size: int | None = None
    _memo: dict[object, tuple[Tensor | None, Any]] = field(default_factory=dict, repr=False)

    def remembered(self, kind: str, of: Tensor | None, make: Callable[[], T]) -> T:
        """``make()``, taken once per ``kind`` and input tensor object ``of`` for this grouping."""
        key = (kind, id(of))
        known = self._memo.get(key)
        if known is not None and known[0] is of:
            return known[1]
        made = make()
        self._memo[key] = (of, made)  # holding ``of`` keeps its id from being reused
        return made

    def sum(self, values: Tensor) -> Tensor:
        """Per-bin sum of (N,) ``values`` (accumulated in the values' dtype; pass fp64/int64 for exactness)."""
        if self.size is not None:
            return values.reshape(self.bins, self.size).sum(dim=1)
        return torch.zeros(self.bins, dtype=values.dtype, device=values.device).index_add_(0, self.index, values)

    def count(self, mask: Tensor) -> Tensor:
        """Per-bin count (int64) of True (non-zero) entries of (N,) ``mask`` (remembered for this very tensor
        object: pass the same tensor, not a fresh ``.bool()`` of it)."""
        size = self.size
        if size is not None:  # a bool sum is int64
            return self.remembered("count", mask, lambda: _bools(mask).reshape(self.bins, size).sum(dim=1))
        return self.remembered("count", mask, lambda: self.sum(_bools(mask).to(torch.int64)))

    def amax(self, values: Tensor, valid: Tensor) -> Tensor:
        """Per-bin max over ``valid`` entries (fp64); -inf for bins without one."""
        src = torch.where(valid, values if values.dtype == torch.float64 else values.double(), -math.inf)
        if self.size is not None:
            return src.reshape(self.bins, self.size).amax(dim=1)
        out = torch.full((self.bins,), -math.inf, dtype=torch.float64, device=values.device)
        return out.scatter_reduce_(0, self.index, src, reduce="amax")

    def amin(self, values: Tensor, valid: Tensor) -> Tensor:
        """Per-bin min over ``valid`` entries (fp64); +inf for bins without one."""
        if self.size is not None:
            wide = values if values.dtype == torch.float64 else values.double()
            return torch.where(valid, wide, math.inf).reshape(self.bins, self.size).amin(dim=1)
        return -self.amax(-values.double(), valid)

    def sizes(self) -> Tensor:
        """Members per bin (int64; 0 for unused bins). Shared: never modify it in place."""
        if self.size is not None:
            return _filled(self.bins, self.size, self.index.device)
        return self.remembered("sizes", None, lambda: self.sum(torch.ones_like(self.index)))


def _bools(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def contiguous_groups(n: int, group_size: int, device: torch.device | str = "cpu") -> Groups:
    """Groups of ``group_size`` consecutive completions (the usual GRPO layout); ``n`` must be a multiple.
    The index is built once per (n, group_size, device) and shared (read-only)."""
    return Groups(_contiguous_index(n, group_size, torch.device(device)), n // group_size, group_size)


@cached_constant(maxsize=16)
def _contiguous_index(n: int, group_size: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device) // group_size


@cached_constant(maxsize=16)
def _filled(bins: int, size: int, device: torch.device) -> Tensor:
    return torch.full((bins,), size, dtype=torch.int64, device=device)


def groups_from_ids(group_ids: Tensor) -> Groups:
    """Dense group indices from arbitrary integer ids, by a stable sort; no host sync."""
    order = torch.argsort(group_ids, stable=True)
    sorted_ids = group_ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.int64)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).to(torch.int64)
    dense_sorted = starts.cumsum(0) - 1
    index = torch.empty_like(dense_sorted).scatter_(0, order, dense_sorted)
    return Groups(index, group_ids.numel())


class GroupStats(NamedTuple):
    """Per-bin statistics of one reward vector over its finite entries (fp64; ``count`` int64). A bin without
    a finite entry has sum, mean, both stds and range 0, so sums over bins need no mask."""

    count: Tensor  # type: ignore[assignment]  # a field, shadowing tuple.count
    sum: Tensor
    mean: Tensor
    population_std: Tensor
    unbiased_std: Tensor
    range: Tensor
    exists: Tensor


def group_stats(values: Tensor, groups: Groups) -> GroupStats:
    """Count, mean, population and unbiased std, and range (max - min) of finite ``values`` per group
    (remembered by ``groups`` for this very tensor: the reward blocks and the zero-variance count share them)."""
    return groups.remembered("stats", values, lambda: _group_stats(values, groups))


def _group_stats(values: Tensor, groups: Groups) -> GroupStats:
    valid = torch.isfinite(values)
    x = torch.where(valid, values.double(), 0.0)
    count = groups.count(valid)
    exists = count > 0
    safe = count.clamp(min=1).double()
    total = groups.sum(x)
    mean = total / safe
    dev = torch.where(valid, x - mean[groups.index], 0.0)
    ss = groups.sum(dev * dev)
    population = (ss / safe).sqrt()
    unbiased = (ss / (count - 1).clamp(min=1).double()).sqrt()
    spread = torch.where(exists, groups.amax(x, valid) - groups.amin(x, valid), 0.0)
    return GroupStats(count, total, mean, population, unbiased, spread, exists)


def group_normalized_advantages(
    rewards: Tensor, groups: Groups, norm: AdvantageNorm = "unbiased", eps: float = 1e-4
) -> Tensor:
    """GRPO advantages A_i = (r_i - mean_g) / (std_g + eps), r_i - mean_g for ``norm="none"`` (Dr. GRPO), or
    (r_i - mean_g) / (std_batch + eps) for ``norm="batch"`` (unbiased std of every reward, TRL's
    ``scale_rewards="batch"``).

    Zero-variance groups get A = 0. Seed §二: binary rewards at p = 0.9 with population std give +0.33 for
    the correct majority and -3.00 for the lone incorrect answer.
    """
    stats = group_stats(rewards, groups)
    centred = rewards.double() - stats.mean[groups.index]
    if norm == "none":
        return centred.float()
    if norm == "batch":
        batch_std = rewards.double().std() if rewards.numel() > 1 else rewards.double().new_zeros(())
        return torch.where(batch_std > 0, centred / (batch_std + eps), 0.0).float()
    std = (stats.unbiased_std if norm == "unbiased" else stats.population_std)[groups.index]
    return torch.where(std > 0, centred / (std + eps), 0.0).float()


@overload
def advantage_bound(group_size: int, norm: AdvantageNorm) -> float: ...
@overload
def advantage_bound(group_size: Tensor, norm: AdvantageNorm) -> Tensor: ...
def advantage_bound(group_size: int | Tensor, norm: AdvantageNorm) -> float | Tensor:
    """Largest |A| sigma-normalisation can give in a group of G (seed §2.2).

    The extreme is one minority against G-1: unbiased std gives (G-1)/sqrt(G) (G=16: 3.75, G=8: 2.47),
    population std gives sqrt(G-1). Without std the bound is (G-1)/G x the group's reward range, see
    :func:`advantage_bounds`. Accepts an int (float out) or a tensor of group sizes.
    """
    if norm not in ("unbiased", "population"):
        raise ValueError(f"advantage_bound: norm={norm!r} has no bound per group size; use advantage_bounds()")
    if isinstance(group_size, Tensor):
        g = group_size.double()
        return (g - 1) / g.sqrt() if norm == "unbiased" else (g - 1).clamp(min=0).sqrt()
    return (group_size - 1) / math.sqrt(group_size) if norm == "unbiased" else math.sqrt(group_size - 1)


def advantage_bounds(rewards: Tensor | None, groups: Groups, norm: AdvantageNorm, group_size: int = 1) -> Tensor:
    """Per-group |A| bound (fp64, one per bin) for the configured normalisation.

    ``group_size``: the rollout's G. A group seen with fewer members is a fragment of a rollout group (an
    update micro-batch that split it): it is judged with G members, and under ``none`` normalisation,
    whose bound needs the whole group's reward range, not at all (bound +inf). Never the bound of a fragment.
    """
    sizes = groups.sizes()
    if norm not in ("unbiased", "population", "none"):  # a batch statistic or a per-token shaping: no group bound
        return torch.full((groups.bins,), math.inf, dtype=torch.float64, device=sizes.device)
    if norm != "none":
        return advantage_bound(sizes.clamp(min=group_size), norm)
    if rewards is None:
        return torch.full((groups.bins,), math.inf, dtype=torch.float64, device=sizes.device)
    g = sizes.clamp(min=1).double()
    bound = group_stats(rewards, groups).range * (g - 1) / g
    return torch.where(sizes < group_size, math.inf, bound)
