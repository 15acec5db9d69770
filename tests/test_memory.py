"""Bounded memory: 10,000 observe calls keep the series count constant and the RSS growth bounded.

The soak runs in a fresh process: in the suite's shared process the allocator's state after a thousand other
tests (arenas, torch's caches) moves the RSS by tens of MiB on its own, which says nothing about the monitor."""

from __future__ import annotations

import gc
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import torch

from grpo_exporter import GRPOMonitor


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def series(mon: GRPOMonitor) -> int:
    return sum(len(family.samples) for family in mon.registry.collect())


def soak() -> dict[str, object]:
    """10,002 observe calls on one monitor: the series counts and RSS after 500 and 3334 steps, and its counters."""
    torch.set_num_threads(1)
    n, t, g = 16, 6, 4
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(n, t, dtype=torch.bool)
    old = torch.full((n, t), -1.0)
    with GRPOMonitor(
        run="soak", group_size=g, port=None, guard="off", solve_rate_slots=500, max_reward_components=2,
        edit_distance_groups=2,
    ) as mon:
        counts, rss = [], []
        # 3 calls a step: 10,002 observe calls; every group brings a new prompt, so history must stay bounded
        for step in range(3334):
            correct = torch.rand(n, generator=gen) < 0.5
            mon.observe_rollout(
                step, rewards=correct.float(), correct=correct, loss_mask=mask, completion_lengths=torch.full((n,), t),
                old_logprobs=old, rollout_logprobs=old, completion_ids=torch.randint(0, 9, (n, t), generator=gen),
                prompt_ids=torch.arange(n) // g + step * (n // g),
                reward_components={"a": correct.float(), "b": correct.float(), f"c{step}": correct.float()},
            )
            mon.observe_update(step, logprobs=old + 0.01, old_logprobs=old, advantages=torch.randn(n, generator=gen),
                               loss_mask=mask, on_policy=step % 4 == 0)
            mon.observe_update(step, logprobs=old, old_logprobs=old, advantages=torch.randn(n, generator=gen),
                               loss_mask=mask, on_policy=step % 4 == 0)
            if step in (500, 3333):
                mon.flush()
                mon.wait_for_workers()
                gc.collect()
                counts.append(series(mon))
                rss.append(rss_bytes())
        metrics = mon.metrics()
        return {"counts": counts, "rss": rss, "steps": metrics["grpo_steps_total"],
                "dropped": metrics["grpo_dropped_reward_components_total"]}


def test_ten_thousand_observe_calls():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        found = pool.submit(soak).result(timeout=600)
    counts, rss = found["counts"], found["rss"]
    assert counts[0] == counts[1], counts
    assert rss[1] - rss[0] < 32 * 2**20, f"RSS grew {(rss[1] - rss[0]) / 2**20:.1f} MiB"
    assert found["steps"] == 3334
    assert found["dropped"] == 3334
