"""The suite's background lane: the deterministic replays (the cadence replays, the world sweep's training) start
when collection ends, in two worker processes at the lowest CPU priority (nice 19), and their tests, collected
last, read the results.

Why: on the 2-core CI machine many tests leave a core idle (many wait on Prometheus, Alertmanager or a
subprocess). The replays are pure CPU whose results no clock enters, so they soak up that idle time. What a
replay computes does not depend on when it runs: the results are those of running it in the test itself (its
only waits on the clock, for a monitor's worker threads, allow LANE_STOP_S, longer than any stop).

Tests that keep time (marked ``keeps_time``: a training paced at 2 steps/s whose rules judge that pace, a page
due within two minutes) run with the lane stopped (:func:`paused`, SIGSTOP to each worker's process group, so a
promtool it started stops too), whatever the scheduler does with nice 19. On CI, beside both workers, a healthy
end-to-end run fell below half its pace and paged GRPOStepCadenceSlowerThanConfigured (it trained five runs at
once then, more than one GIL can pace).

A module takes part by defining ``start_in_background(items)`` (its selected tests): conftest.py calls it once,
after collection; it submits its jobs with :func:`submit`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

WORKERS = 2  # one per core of the CI machine
# workers left running while a keeps_time test runs: none. With one left running (the fleet holds one core,
# one GIL at ~60% of it), a clean run here paged GRPOTrainingStalled on three healthy e2e runs at once: their
# steps' timestamps went 18 s (the demo's 15 min) without a new sample. Nothing explained it but the worker
# beside them, so the lane stops whole: ~4 min of one core lost, against a run that must not page
KEEP_WHILE_PAUSED = 0
# a lane job's own waits on the wall clock (a monitor's wait for its worker threads) must outlast a stop: the
# e2e fleet stops the lane ~8 minutes, and a 10 s wait under way then ran out (a replay raised TimeoutError)
LANE_STOP_S = 3600.0
_pool: ProcessPoolExecutor | None = None
_futures: dict[str, Future[Any]] = {}


def _lowest_priority() -> None:
    os.setpgrp()  # a group of its own, so that paused() stops the promtool it runs with it
    _die_with_parent()  # out of the terminal's group, Ctrl-C no longer reaches it
    os.nice(19)  # children (promtool) inherit it
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


def _signal_workers(signum: int, pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)


@contextlib.contextmanager
def paused(keep: int = KEEP_WHILE_PAUSED) -> Iterator[None]:
    """All but ``keep`` of the lane's workers stopped (with their children) for the block, resumed after it:
    their jobs' results do not change (no clock enters them), they only come later."""
    stopped = worker_pids()[keep:]
    _signal_workers(signal.SIGSTOP, stopped)
    try:
        yield
    finally:
        _signal_workers(signal.SIGCONT, stopped)


def shutdown() -> None:
    """End the lane: jobs no test read are cancelled (a deselected or failed run leaves some)."""
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    _futures.clear()
