"""The suite's background lane: the deterministic replays (the cadence replays, the world sweep's training) start
when collection ends, in two worker processes under the idle scheduling class (SCHED_IDLE: they run only on a
core nothing else wants), and their tests, collected last, read the results.

Why: on the 2-core CI machine many tests leave a core idle (many wait on Prometheus, Alertmanager or a
subprocess; the end-to-end fleet, paced at the demo's 2 steps/s, holds ~0.6 of one core for ~8 minutes). The
replays are pure CPU whose results no clock enters, so they soak up that idle time. What a replay computes does
not depend on when it runs: the results are those of running it in the test itself (its only waits on the
clock, for a monitor's worker threads, allow LANE_WAIT_S: an idle-class worker gets no CPU at all while both
cores are busy).

Tests that keep time (the fleet's pace, the demo's page within two minutes) run beside the lane. The lane used
to stop for them (SIGSTOP): at nice 19 alone, one worker left running beside the fleet once coincided with three
healthy runs paging GRPOTrainingStalled (cause not found). Under SCHED_IDLE, both workers running through the
whole fleet, every run kept its pace (slowest 2.00 of 2 steps/s over any 72 s, longest step 0.7 s) and the
three modules took 519 s against ~850 s with the lane stopped.

A module takes part by defining ``start_in_background(items)`` (its selected tests): conftest.py calls it once,
after collection; it submits its jobs with :func:`submit`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

WORKERS = 2  # one per core of the CI machine
# a lane job's own waits on the wall clock (a monitor's wait for its worker threads): an idle-class worker gets
# no CPU while the suite's own tests hold both cores, and a 10 s wait then ran out (a replay raised TimeoutError)
LANE_WAIT_S = 3600.0
_pool: ProcessPoolExecutor | None = None
_futures: dict[str, Future[Any]] = {}


def _lowest_priority() -> None:
    os.setpgrp()  # a group of its own: out of the terminal's group, Ctrl-C no longer reaches it
    _die_with_parent()  # so it dies with pytest
    os.nice(19)
    # the idle class (children, promtool, inherit it): any runnable task of the suite's own preempts the lane
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    torch.set_num_threads(1)


def _die_with_parent() -> None:
    """SIGKILL this worker when the pytest process ends, however it ends (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def pool() -> ProcessPoolExecutor:
    """The lane's workers (forked at the first submit, before the tests start their threads)."""
    global _pool
    if _pool is None:
        _pool = ProcessPoolExecutor(min(WORKERS, os.cpu_count() or 1), initializer=_lowest_priority)
    return _pool


def submit(key: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn(*args)`` in the lane, once per ``key`` (its future on later calls). With ``GRPO_LANE_LOG`` set to a
    file, each job appends ``key start end`` (Unix seconds) to it: the numbers to order the jobs by."""
    if key not in _futures:
        log = os.environ.get("GRPO_LANE_LOG")
        _futures[key] = pool().submit(_logged, log, key, fn, *args) if log else pool().submit(fn, *args)
    return _futures[key]


def _logged(log: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
    start = time.time()
    try:
        return fn(*args)
    finally:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"{key} {start:.1f} {time.time():.1f}\n")


def worker_pids() -> list[int]:
    """The lane's worker processes (none before the first submit or after shutdown)."""
    return list((_pool._processes or {}) if _pool is not None else ())  # the executor keeps them by pid


def shutdown() -> None:
    """End the lane: jobs no test read are cancelled (a deselected or failed run leaves some)."""
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    _futures.clear()
