"""The background lane runs its workers in the idle scheduling class, each in a process group of its own
(tests/batch_lane.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import batch_lane


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_run_in_the_idle_class_at_the_lowest_priority_in_groups_of_their_own():
    # starts the workers when no module submitted a job; queued behind the lane's jobs, never read
    batch_lane.submit(f"test-lane-{time.monotonic_ns()}", os.getpid)
    workers = batch_lane.worker_pids()
    assert workers
    # the initializer runs just after the fork: wait for it
    deadline = time.monotonic() + 10
    while ([os.sched_getscheduler(pid) for pid in workers] != [os.SCHED_IDLE] * len(workers)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert [os.sched_getscheduler(pid) for pid in workers] == [os.SCHED_IDLE] * len(workers)
    assert [os.getpgid(pid) for pid in workers] == workers  # Ctrl-C on the terminal's group never reaches them
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in workers] == [19] * len(workers)
