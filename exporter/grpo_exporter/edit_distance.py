"""In-group token edit distance, computed on the host with rapidfuzz (C speed), off the training thread.

Seed 第 2 篇 §2: exact de-duplication misses "same structure, a few numbers changed"; the median normalised
edit distance between completions of the same prompt falls earlier.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rapidfuzz.distance import Levenshtein
from rapidfuzz.process import cdist


def median_normalized_edit_distance(groups: Sequence[Sequence[Sequence[int]]]) -> float | None:
    """Median over every pair (i < j) inside each group of Levenshtein(a, b) / max(len(a), len(b)), in 0..1;
    None when no group has two completions."""
    distances: list[float] = []
    for group in groups:
        if len(group) < 2:
            continue
        matrix = cdist(group, group, scorer=Levenshtein.normalized_distance, workers=1)
        distances += [float(matrix[i, j]) for i in range(len(group)) for j in range(i + 1, len(group))]
    return statistics.median(distances) if distances else None


def rows_to_groups(ids: list[float], lengths: list[float], group: list[float], width: int) -> list[list[list[int]]]:
    """Rebuild token lists per group from the flattened carried rows (ids row-major, padded to ``width``)."""
    by_group: dict[int, list[list[int]]] = {}
    for row, (length, g) in enumerate(zip(lengths, group, strict=True)):
        tokens = [int(t) for t in ids[row * width : row * width + int(length)]]
        by_group.setdefault(int(g), []).append(tokens)
    return list(by_group.values())
