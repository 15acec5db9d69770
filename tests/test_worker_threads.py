"""The monitor's own threads (edit-distance job, flight-recorder writer) never run a torch operator in
parallel: their code reads serially, and their initializer sets their OpenMP thread count to 1. An operator
that went parallel there would start a second OpenMP thread team in the training process; libgomp then counts
more threads than cores and makes every team, training's own included, sleep between parallel regions instead
of spinning: measured on 2 cores, the monitor's step at 256K loss tokens went from 13 to 22-25 ms for the rest
of the process. A new team shows as new threads of the process, not started by Python, while the job runs."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from grpo_exporter.bench import monitor_step, new_monitor
from grpo_exporter.bench.workload import make
from grpo_exporter.recorder.flight import FlightRecorder
from grpo_exporter.runtime.background import EditDistanceWorker, _openmp_runtime, worker_thread

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")


@pytest.fixture(autouse=True)
def two_torch_threads():
    """Other tests leave torch at one thread, where nothing goes parallel and these tests could not fail."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _native_threads() -> set[int]:
    """Threads of the process that Python did not start (an OpenMP team's are such)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def _counting(original, grown: list[int]):
    """``original``, recording how many native threads appeared while it ran."""

    def job(*args, **kwargs):
        before = _native_threads()
        try:
            return original(*args, **kwargs)
        finally:
            grown.append(len(_native_threads() - before))

    return job


def test_a_parallel_operator_on_another_thread_shows_as_new_threads():
    """The probe itself: a dtype copy of 64K values on a fresh thread adds the threads of a new team."""
    torch.ones(1 << 17).mul(2)  # the main thread's team exists already
    grown: list[int] = []
    values = torch.rand(1 << 16, dtype=torch.float64)
    thread = threading.Thread(target=_counting(lambda: values.long(), grown))
    thread.start()
    thread.join()
    assert grown[0] >= 1


def test_a_worker_thread_runs_torch_operators_serially_and_leaves_training_alone():
    """``worker_thread`` (the pools' initializer) sets this thread's OpenMP thread count to 1, so even an operator
    large enough to go parallel starts no team there, while the training thread keeps its count and every
    other thread torch's default."""
    if _openmp_runtime() is None:
        pytest.skip("no OpenMP runtime loaded: torch runs another parallel backend")
    torch.ones(1 << 17).mul(2)
    values = torch.rand(1 << 16, dtype=torch.float64)
    seen: dict[str, int] = {}
    grown: list[int] = []

    def job() -> None:
        worker_thread()
        seen["worker"] = torch.get_num_threads()
        values.long()

    thread = threading.Thread(target=_counting(job, grown))
    thread.start()
    thread.join()
    assert seen["worker"] == 1
    assert grown == [0]
    assert torch.get_num_threads() == 2
    other = threading.Thread(target=lambda: seen.setdefault("other", torch.get_num_threads()))
    other.start()
    other.join()
    assert seen["other"] == 2


def test_the_monitor_threads_start_no_thread_team(tmp_path, monkeypatch):
    """T = 1024: the edit-distance job's rows are 64 x 1024 ids (a dtype copy of them went parallel), and a NaN
    reward makes every step anomalous, so the recorder writes incidents of 16 rows x 1024 tokens."""
    ed_jobs: list[int] = []
    writes: list[int] = []
    monkeypatch.setattr(EditDistanceWorker, "_run", _counting(EditDistanceWorker._run, ed_jobs))
    monkeypatch.setattr(FlightRecorder, "_write", _counting(FlightRecorder._write, writes))
    w = make(250_000)
    bad = dataclasses.replace(w, rewards=w.rewards.clone().index_fill_(0, torch.tensor([1]), float("nan")))
    torch.ones(1 << 17).mul(2)
    mon = new_monitor(recorder_dir=str(tmp_path))
    try:
        for step in range(4):
            monitor_step(mon, bad if step >= 1 else w, step)
            mon.wait_for_workers()
        mon.flush()
        mon.wait_for_workers()
    finally:
        mon.close()
    assert w.t == 1024
    assert len(ed_jobs) >= 3
    assert writes
    assert ed_jobs == [0] * len(ed_jobs)
    assert writes == [0] * len(writes)
