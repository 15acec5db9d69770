"""In-group token edit distance, computed on the host with rapidfuzz (C speed), off the training thread.

Seed 第 2 篇 (diversity monitoring) §2: exact de-duplication misses "same structure, a few numbers changed"; the median
normalised edit distance between completions of the same prompt falls earlier.

Cost: rapidfuzz's bit-parallel Levenshtein takes ~len(a) x ceil(len(b) / 64) word operations per pair, so a
group of 16 completions of 4096 tokens (120 pairs) is ~3e7 operations, a quarter of a second on one core, on
the cores training uses. Two bounds keep it off training's back: the pairs of one rollout are drawn in a seeded
random order and capped at ``pair_cap`` (:func:`pair_cap`: at most 128, and the work the budget buys: fewer
pairs as T grows, as 1/T^2), and the worker stops drawing once ``budget_s`` of wall time has passed. The median
is over the pairs computed: an unbiased sample of the sampled groups' pairs.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence

from rapidfuzz.distance import Levenshtein
from torch import Tensor

WORD_OPS_PER_SECOND = 1e8  # conservative single-core rate of the bit-parallel kernel (measured ~3e8 on CI)
MIN_PAIRS = 8
YIELD_EVERY_S = 0.001
MAX_PAIRS = 128  # a median of 128 random pairs is within ~0.1 standard deviations of the groups' median


def pair_cap(width: int, budget_s: float) -> int:
    """Pairs one rollout may compute at completion width ``width``: the work ``budget_s`` buys at
    WORD_OPS_PER_SECOND, at least MIN_PAIRS (a median of fewer says little), at most MAX_PAIRS."""
    per_pair = max(1, width) * math.ceil(max(1, width) / 64)
    return min(MAX_PAIRS, max(MIN_PAIRS, int(budget_s * WORD_OPS_PER_SECOND / per_pair)))


def median_normalized_edit_distance(
    groups: Sequence[Sequence[Sequence[float]]], budget_s: float = math.inf, max_pairs: int | None = None,
    seed: int = 0,
) -> tuple[float | None, int]:
    """(median over pairs (i < j) inside each group of Levenshtein(a, b) / max(len(a), len(b)) in 0..1 or None
    when no group has two completions, pairs computed). With ``max_pairs`` or a finite ``budget_s`` the pairs
    are drawn in a random order (``seed``) and the draw stops at the cap or when the budget is spent."""
    pairs = [(g, i, j) for g, group in enumerate(groups) for i in range(len(group)) for j in range(i + 1, len(group))]
    if max_pairs is not None or math.isfinite(budget_s):
        random.Random(seed).shuffle(pairs)
    if max_pairs is not None:
        pairs = pairs[:max_pairs]
    start = last_yield = time.perf_counter()
    distances: list[float] = []
    for g, i, j in pairs:
        distances.append(Levenshtein.normalized_distance(groups[g][i], groups[g][j]))
        now = time.perf_counter()
        if now - start > budget_s:
            break
        if now - last_yield > YIELD_EVERY_S:  # hand the GIL back: training waits at most ~1 ms for this thread
            time.sleep(0)
            last_yield = time.perf_counter()
    return (statistics.median(distances) if distances else None), len(distances)


def rows_to_groups(ids: Tensor, lengths: Tensor, group: Tensor, width: int) -> list[list[list[float]]]:
    """Token lists per group from the carried rows (CPU tensors: ids row-major, padded to ``width``). The ids
    stay the fp64 values they travelled as: fp64 holds every token id exactly, and Levenshtein compares
    elements by value, so 17.0 and 17 are the same token (converting them to int would hold the GIL ~3x as
    long). Only serial reads (``tolist`` of row slices): this runs on the worker thread, where no operator may
    go parallel (:func:`grpo_exporter.runtime.background.serial_operators` says why)."""
    rows = ids.reshape(-1, width)
    by_group: dict[int, list[list[float]]] = {}
    for row, (length, g) in enumerate(zip(lengths.tolist(), group.tolist(), strict=True)):
        by_group.setdefault(int(g), []).append(rows[row, : int(length)].tolist())
    return list(by_group.values())
