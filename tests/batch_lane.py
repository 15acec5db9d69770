"""The suite's background lane: the deterministic replays (the cadence replays, the world sweep's training) start
when collection ends, in two worker processes at the lowest CPU priority (nice 19), and their tests, collected
last, read the results.

Why: on the 2-core CI machine many tests leave a core idle (the end-to-end fleet is bound by one GIL, others wait
on Prometheus, Alertmanager or a subprocess). The replays are pure CPU with no clock in them, so they soak up that
idle time without slowing a test that keeps time (the kernel serves a nice-19 process only when nothing else
wants the core). What a replay computes does not depend on when it runs: the results are those of running it in
the test itself.

A module takes part by defining ``start_in_background(items)`` (its selected tests): conftest.py calls it once,
after collection; it submits its jobs with :func:`submit`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

WORKERS = 2  # one per core of the CI machine
_pool: ProcessPoolExecutor | None = None
_futures: dict[str, Future[Any]] = {}


def _lowest_priority() -> None:
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


def shutdown() -> None:
    """End the lane: jobs no test read are cancelled (a deselected or failed run leaves some)."""
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    _futures.clear()
