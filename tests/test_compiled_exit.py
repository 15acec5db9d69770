"""The compiled step never aborts or delays an exit, never makes ``close()`` wait on compilations not started, and
never costs the call that queues a program more than its eager step (:mod:`grpo_exporter.runtime.compilation`).

A compiler thread left inside a torch operator while the interpreter finalizes aborted the process (exit status
134, "terminate called without an active exception": ``pthread_exit`` unwinding through torch's ``noexcept``
``gil_scoped_release`` destructor). Before the exit hook, 5 of 6 exits right after the first observe aborted on a
warm compile cache, 2 of 6 that raised in training; each exit case below runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from grpo_exporter.bench import workload
from grpo_exporter.inputs import StepInputs
from grpo_exporter.runtime import background, compilation
from grpo_exporter.runtime.background import DaemonExecutor, Interrupted
from grpo_exporter.runtime.compilation import CompiledStages
from grpo_exporter.step import program as step_program
from test_compiled_step import CFG, _stages

#: a monitor with compile_step="auto" observes one rollout, waits ``delay`` seconds (the compiler thread is then
#: importing, tracing, compiling, or, with ``busy``, inside torch operators for good) and ends as ``mode`` says
SCRIPT = textwrap.dedent("""
    import json, sys, threading, time, torch
    import grpo_exporter.step.program as program
    from grpo_exporter import GRPOMonitor

    mode, delay, busy = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "busy"
    if busy:
        def held(*args, **kwargs):  # the compiler thread inside torch operators until the process ends
            x = torch.ones(128, 128)
            while True:
                x = (x @ x).clamp_(-1, 1)
        program.trace = held
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 256, generator=g)
    mon = GRPOMonitor(run="exit", group_size=4, port=None, close_linger_s=0, compile_step=mode.split("-")[0],
                      compile_min_positions=0)
    start = time.perf_counter()
    mon.observe_rollout(0, rewards=torch.rand(64, generator=g), old_logprobs=old, rollout_logprobs=old + 0.01,
                        loss_mask=torch.ones(64, 256, dtype=torch.bool))
    first = time.perf_counter() - start
    time.sleep(delay)
    threads = [t.name for t in threading.enumerate()]
    if mode.endswith("close"):
        start = time.perf_counter()
        mon.close()
        print(json.dumps({"close": time.perf_counter() - start}), flush=True)
    print(json.dumps({"first": first, "threads": threads}), flush=True)
    if mode.endswith("raise"):
        raise RuntimeError("the training failed")
""")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One inductor cache for every run of the module: the later runs compile on a warm cache, as a restarted
    training does (where the aborts were found)."""
    return str(tmp_path_factory.mktemp("inductor-cache"))


def _exit(cache: str, mode: str, delay: float, busy: bool = False) -> tuple[int, str, list[dict]]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(delay), "busy" if busy else "real"],
                          capture_output=True, text=True, timeout=120, check=False, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, done.stderr, lines


@pytest.mark.parametrize("mode", ["auto", "auto-close", "auto-raise"])
def test_an_exit_inside_torch_operators_ends_cleanly(cache_dir: str, mode: str) -> None:
    """The compiler thread is inside torch operators for good (a trace that never ends): without the exit hook
    nearly every such exit aborted; with it the process ends as the script says, at once."""
    for delay in (0.1, 0.6):
        start = time.monotonic()
        rc, err, _ = _exit(cache_dir, mode, delay, busy=True)
        assert rc == (1 if mode.endswith("raise") else 0), err[-3000:]
        assert "terminate called" not in err
        assert "Interrupted" not in err  # nothing said of the interrupted compilation
        assert time.monotonic() - start < 60


@pytest.mark.parametrize("mode", ["auto", "auto-close", "auto-raise"])
def test_an_exit_right_after_the_first_observe_ends_cleanly(cache_dir: str, mode: str) -> None:
    """The real compiler thread, caught at exit importing dynamo, tracing or compiling (delays spread over its
    phases; the module's later runs on a warm cache)."""
    for delay in (0.3, 1.2):
        rc, err, lines = _exit(cache_dir, mode, delay)
        assert rc == (1 if mode.endswith("raise") else 0), err[-3000:]
        assert "terminate called" not in err
        assert "Interrupted" not in err
        assert "grpo-exporter-compile" in lines[-1]["threads"]  # the compiler thread ran at the exit
        if mode.endswith("close"):
            assert lines[0]["close"] < compilation.CLOSE_TIMEOUT_S + 5.0  # was 15-30 s: every queued compilation


def _four_signatures() -> list[tuple[tuple, StepInputs, bool]]:
    """Stage calls of four signatures: the rollout and the update, with and without failed inputs."""
    out = []
    for fields, blocks in _stages(workload.make(10_000)).values():
        for failed in (False, True):
            out.append((blocks, StepInputs(**fields), failed))
    return out


def _recording(monkeypatch: pytest.MonkeyPatch, hold: threading.Event) -> list[str]:
    """Trace, compile and dynamo's import patched to say on which thread they ran; the trace waits for ``hold``
    and then fails (no compilation needed)."""
    calls: list[str] = []

    def trace(*args, **kwargs):
        calls.append(f"trace@{threading.current_thread().name}")
        hold.wait(30)
        raise RuntimeError("stopped by the test")

    def imported() -> None:
        calls.append(f"import@{threading.current_thread().name}")

    monkeypatch.setattr(step_program, "trace", trace)
    monkeypatch.setattr(compilation, "import_dynamo", imported)
    return calls


def test_close_drops_the_queued_compilations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four signatures queued, the first one's trace in progress: close() cancels the three not started and
    waits only for the phase in progress (its bound, while the test holds it); released, the thread ends at once
    without starting another job."""
    hold = threading.Event()
    calls = _recording(monkeypatch, hold)
    stages = CompiledStages(CFG, "auto", 0)
    for blocks, x, failed in _four_signatures():
        assert stages.compute(blocks, x, {}, failed) is None
    assert len(stages._pending) == 4
    deadline = time.monotonic() + 30
    while "trace@grpo-exporter-compile" not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    assert stages.close(timeout_s=0.3) is False  # the held trace: close() returns after its bound
    assert time.monotonic() - start < 2.0
    assert len(stages._pending) == 1  # the three queued ones were dropped
    hold.set()
    assert stages.close(timeout_s=10) is True
    assert calls.count("trace@grpo-exporter-compile") == 1  # no queued job started after close
    assert not stages._pending
    blocks, x, failed = _four_signatures()[0]
    assert stages.compute(blocks, x, {}, failed) is None  # closed: eager, nothing queued
    assert not stages._pending


def test_close_returns_at_once_with_compilations_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default bound: four signatures queued, each trace 0.5 s; close() returns within about one (dynamo
    imported before: a first job's import, a second, is a phase close() waits for)."""
    compilation.import_dynamo()

    def slow(*args, **kwargs):
        time.sleep(0.5)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(step_program, "trace", slow)
    stages = CompiledStages(CFG, "auto", 0)
    for blocks, x, failed in _four_signatures():
        stages.compute(blocks, x, {}, failed)
    start = time.monotonic()
    assert stages.close() is True
    assert time.monotonic() - start < 1.5  # was 4 x 0.5 s and more: every queued job ran
    assert stages.fallbacks["compiler"] <= 1


def test_only_the_compiler_thread_imports_and_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call that queues a program does no import, trace or compilation work: each runs on the compiler
    thread, after the queuing call returned (importing dynamo on the training thread made the first observe of
    compile_step="auto" cost 0.76 s against eager's 0.007 s; docs/benchmarks.md has the measurements)."""
    hold = threading.Event()
    calls = _recording(monkeypatch, hold)
    stages = CompiledStages(CFG, "auto", 0)
    blocks, x, failed = _four_signatures()[0]
    assert stages.compute(blocks, x, {}, failed) is None
    hold.set()
    assert stages.wait(30)
    assert calls == ["import@grpo-exporter-compile", "trace@grpo-exporter-compile"]
    assert stages.close()


def test_the_exit_hook_interrupts_a_job_inside_torch_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the exit hook does, in process: queued jobs dropped, the one in progress interrupted at its next
    Python line, the thread ended within the bound."""
    inside = threading.Event()

    def busy(*args, **kwargs):
        inside.set()
        y = torch.ones(64, 64)
        while True:
            y = (y @ y).clamp_(-1, 1)

    monkeypatch.setattr(step_program, "trace", busy)
    stages = CompiledStages(CFG, "auto", 0)
    for blocks, x, failed in _four_signatures():
        stages.compute(blocks, x, {}, failed)
    assert inside.wait(30)
    assert stages.stop(time.monotonic() + background.EXIT_TIMEOUT_S)
    assert not stages._pending
    assert stages.compiles == 0
    assert not stages.fallbacks["compiler"]  # an interrupted job is no failure of the compiler


def test_a_daemon_executor_cancels_the_queued_calls_and_interrupts_the_running_one() -> None:
    started, release = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while True:
            time.sleep(0.001)

    pool = DaemonExecutor("test-executor")
    running = pool.submit(spin)
    queued = [pool.submit(release.set) for _ in range(3)]
    assert started.wait(10)
    assert pool.shutdown(0.05, cancel_futures=True) is False  # spin() still runs
    assert all(f.cancelled() for f in queued)
    assert pool.interrupt()
    pool.thread.join(5)
    assert not pool.thread.is_alive()
    assert isinstance(running.exception(), Interrupted)
    assert not release.is_set()
    assert not pool.interrupt()  # nothing runs any more
