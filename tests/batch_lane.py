"""The suite's background lane: the deterministic replays (the cadence replays, the world sweep's training) start
when collection ends, in two worker processes at the lowest CPU priority (nice 19), and their tests, collected
last, read the results.

Why: on the 2-core CI machine many tests leave a core idle (many wait on Prometheus, Alertmanager or a
subprocess). The replays are pure CPU with no clock in them, so they soak up that idle time. What a replay
computes does not depend on when it runs: the results are those of running it in the test itself.

Tests that keep time (marked ``keeps_time``: a training paced at 2 steps/s whose rules judge that pace, a page
due within two minutes) run with the lane stopped (:func:`paused`, SIGSTOP to each worker's process group, so a
promtool it started stops too). Nice 19 alone did not protect them: on CI a healthy end-to-end run fell below
half its pace beside the lane and paged GRPOStepCadenceSlowerThanConfigured, which nice 19 would have prevented
wherever the kernel honours it.

A module takes part by defining ``start_in_background(items)`` (its selected tests): conftest.py calls it once,
after collection; it submits its jobs with :func:`submit`.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

WORKERS = 2  # one per core of the CI machine
_pool: ProcessPoolExecutor | None = None
_futures: dict[str, Future[Any]] = {}


def _lowest_priority() -> None:
    os.setpgrp()  # a group of its own, so that paused() stops the promtool it runs with it
    os.nice(19)  # children (promtool) inherit it
    torch.set_num_threads(1)


def pool() -> ProcessPoolExecutor:
    """The lane's workers (forked at the first submit, before the tests start their threads)."""
    global _pool
    if _pool is None:
        _pool = ProcessPoolExecutor(min(WORKERS, os.cpu_count() or 1), initializer=_lowest_priority)
    return _pool


def submit(key: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` in the lane, once per ``key`` (its future on later calls)."""
    if key not in _futures:
        _futures[key] = pool().submit(fn, *args)
    return _futures[key]


def worker_pids() -> list[int]:
    """The lane's worker processes (none before the first submit or after shutdown)."""
    return list((_pool._processes or {}) if _pool is not None else ())  # the executor keeps them by pid


def _signal_workers(signum: int) -> None:
    for pid in worker_pids():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The lane stopped (its workers and their children) for the block, resumed after it: its jobs' results do
    not change (no clock in them), they only come later."""
    _signal_workers(signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_workers(signal.SIGCONT)


def shutdown() -> None:
    """End the lane: jobs no test read are cancelled (a deselected or failed run leaves some)."""
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    _futures.clear()
