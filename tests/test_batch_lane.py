"""The background lane stops while a test that keeps time runs (tests/batch_lane.py), its promtool with it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import batch_lane


def _state(pid: int) -> str:
    """The process' scheduler state (R, S, T for stopped, ...), from /proc."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _sleeper() -> int:
    """A child in the worker's process group, as a promtool run would be; its pid."""
    return subprocess.Popen(["sleep", "30"]).pid  # ended with its worker group below


def _wait_for(states: set[str], pids: list[int]) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = [_state(pid) for pid in pids]
        if set(now) <= states:
            break
        time.sleep(0.05)
    return now


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_paused_stops_the_workers_and_their_children_and_resumes_them():
    child = batch_lane.submit(f"test-lane-child-{time.monotonic_ns()}", _sleeper).result(timeout=60)
    workers = batch_lane.worker_pids()
    assert workers
    pids = [*workers, child]
    try:
        with batch_lane.paused():
            assert _wait_for({"T"}, pids) == ["T"] * len(pids)
        assert "T" not in _wait_for({"R", "S"}, pids)
    finally:
        subprocess.run(["kill", str(child)], check=False)
