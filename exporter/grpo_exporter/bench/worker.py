"""The edit-distance worker's cost per rollout, apart from the step (it runs off the training thread): every
pair of a rollout's groups against the default budget (time and pair cap)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from grpo_exporter.bench.workload import G
from grpo_exporter.edit_distance import median_normalized_edit_distance, pair_cap


@dataclass(frozen=True)
class WorkerCost:
    """One rollout's edit-distance job (4 groups of G completions of ``width`` tokens): every pair, against
    the default budget (time and pair cap)."""

    width: int
    full_s: float
    full_pairs: int
    budgeted_s: float
    budgeted_pairs: int


def worker_cost(width: int, budget_s: float = 0.02) -> WorkerCost:
    gen = random.Random(width)
    base = [gen.randrange(1000) for _ in range(width)]
    groups = [[[t if gen.random() > 0.3 else gen.randrange(1000) for t in base] for _ in range(G)] for _ in range(4)]
    start = time.perf_counter()
    _, full_pairs = median_normalized_edit_distance(groups)
    full_s = time.perf_counter() - start
    start = time.perf_counter()
    _, pairs = median_normalized_edit_distance(groups, budget_s, pair_cap(width, budget_s))
    return WorkerCost(width, full_s, full_pairs, time.perf_counter() - start, pairs)
