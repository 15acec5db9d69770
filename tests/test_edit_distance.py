"""The in-group edit distance (seed 第 2 篇 §2): exact on small groups, bounded by its pair cap and time budget on
long completions, published by the monitor's worker thread."""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.edit_distance import (
    MAX_PAIRS,
    MIN_PAIRS,
    median_normalized_edit_distance,
    pair_cap,
    rows_to_groups,
)


def levenshtein(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def reference(groups: list[list[list[int]]]) -> float:
    return statistics.median(
        levenshtein(g[i], g[j]) / max(len(g[i]), len(g[j]))
        for g in groups for i in range(len(g)) for j in range(i + 1, len(g))
    )


def test_small_groups_are_exact():
    rng = random.Random(1)
    groups = [[[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(6)] for _ in range(3)]
    groups.append([[1, 2, 3]])  # a group of one has no pair
    median, pairs = median_normalized_edit_distance(groups)
    assert pairs == 3 * 15
    assert median == pytest.approx(reference(groups))
    assert median_normalized_edit_distance([[[1]], []]) == (None, 0)


def test_the_pair_cap_shrinks_as_one_over_t_squared():
    assert pair_cap(1024, 0.02) == 122  # 2e6 word operations / (1024 x 16)
    assert pair_cap(2048, 0.02) == 30  # a quarter at twice the width
    assert pair_cap(256, 0.02) == MAX_PAIRS  # short completions: a sample of 128 pairs is enough for a median
    assert pair_cap(8192, 0.02) == MIN_PAIRS


def test_long_completions_stop_at_the_cap_and_the_budget():
    rng = random.Random(2)
    base = [rng.randrange(50) for _ in range(4096)]
    groups = [[[t if rng.random() > 0.3 else rng.randrange(50) for t in base] for _ in range(16)] for _ in range(4)]
    capped, pairs = median_normalized_edit_distance(groups, max_pairs=pair_cap(4096, 0.02), seed=3)
    assert pairs == pair_cap(4096, 0.02) < 4 * 120
    # the draw is a random sample of the pairs: its median is close to the full one (~0.4 here)
    full = median_normalized_edit_distance([g[:6] for g in groups])[0]
    assert capped == pytest.approx(full, abs=0.05)
    _, one = median_normalized_edit_distance(groups, budget_s=0.0)
    assert one == 1  # the budget is checked after every pair: spent, the draw stops


def test_the_monitor_publishes_the_median_from_its_worker():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5], [9, 9, 9, 9], [1, 2, 0, 0]])
    lengths = torch.tensor([4, 4, 4, 2])
    with GRPOMonitor(run="ed", group_size=4, port=None, guard="off", close_linger_s=0.0) as mon:
        mon.observe_rollout(0, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), completion_ids=ids,
                            completion_lengths=lengths)
        mon.wait_for_workers()
        got = mon.metrics()["grpo_edit_distance_median_ratio"]
    rows = [ids[i, : lengths[i]].tolist() for i in range(4)]
    assert got == pytest.approx(reference([rows]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
def test_the_worker_thread_runs_at_the_lowest_priority():
    """On cores training keeps busy the job takes only what training leaves (nice 19 for its thread only)."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with GRPOMonitor(run="nice", group_size=4, port=None, guard="off", close_linger_s=0.0) as mon:
        job = mon._stages.edit_worker._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert job.result(timeout=10) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the training thread's: untouched


def test_carried_rows_give_the_token_lists_and_the_median_of_the_int_ids():
    """The worker reads the rows as they travelled (fp64, padded): token ids up to 2^53 exactly, each row cut at
    its length, grouped by group index; the median equals the one of the int token lists."""
    gen = random.Random(3)
    width, rows = 40, [[gen.randrange(2**40) for _ in range(gen.randrange(1, 41))] for _ in range(12)]
    groups = [[rows[i] for i in range(12) if i % 3 == g] for g in range(3)]
    ids = torch.zeros(12, width, dtype=torch.float64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    lengths = torch.tensor([float(len(r)) for r in rows], dtype=torch.float64)
    carried = rows_to_groups(ids.reshape(-1), lengths, torch.arange(12, dtype=torch.float64) % 3, width)
    assert sorted(carried) == sorted(groups)
    assert median_normalized_edit_distance(carried)[0] == pytest.approx(reference(groups), abs=0)
