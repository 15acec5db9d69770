"""The background lane stops while a test that keeps time runs (tests/batch_lane.py), its promtool runs with it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import batch_lane


def _state(pid: int) -> str:
    """The process' scheduler state (R, S, D, T for stopped, ...), from /proc."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(states: set[str], pids: list[int]) -> list[str]:
    deadline = time.monotonic() + 10
    now = [_state(pid) for pid in pids]
    while time.monotonic() < deadline and not set(now) <= states:
        time.sleep(0.05)
        now = [_state(pid) for pid in pids]
    return now


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_paused_stops_workers_and_their_process_groups_and_resumes_them():
    # starts the workers when no module submitted a job; queued behind the lane's jobs, never read
    batch_lane.submit(f"test-lane-{time.monotonic_ns()}", os.getpid)
    workers = batch_lane.worker_pids()
    assert workers
    # each worker leads a group of its own (its initializer makes it, just after the fork), so the group's stop
    # reaches the promtool it runs
    deadline = time.monotonic() + 10
    while [os.getpgid(pid) for pid in workers] != workers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [os.getpgid(pid) for pid in workers] == workers
    with batch_lane.paused():  # a keeps_time test: all but KEEP_WHILE_PAUSED stop
        stopped = workers[batch_lane.KEEP_WHILE_PAUSED :]
        assert _wait_for({"T"}, stopped) == ["T"] * len(stopped)
        assert "T" not in [_state(pid) for pid in workers[: batch_lane.KEEP_WHILE_PAUSED]]
    assert "T" not in _wait_for({"R", "S", "D"}, workers)
    with batch_lane.paused(keep=1):
        assert _wait_for({"T"}, workers[1:]) == ["T"] * len(workers[1:])
        assert _state(workers[0]) != "T"
    assert "T" not in _wait_for({"R", "S", "D"}, workers)
