"""The compiled stages in a training that uses ``torch.compile`` itself (:mod:`grpo_exporter.step.dynamo_frames`):
torch's FX-tracing state is process-wide, so a trace on the exporter's thread must never make the training's
compiled calls raise. Each case runs in a fresh process, as a training does (a frame compiled by one test would
count as the training's in every later one)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, threading, torch
    import grpo_exporter.step.program as program
    from grpo_exporter.bench import monitor_step, new_monitor, workload

    tracing, answered = threading.Event(), threading.Event()
    real = program.run_blocks

    def held(*args, **kwargs):  # the first trace waits, with torch's FX-tracing flag set, for the training's call
        if not tracing.is_set():
            tracing.set()
            answered.wait(60)
        return real(*args, **kwargs)

    program.run_blocks = held
    w = workload.make(10_000)
    trainer = torch.compile(lambda x: (x.sin() * 2).sum())  # the training's own compiled function
    x = torch.linspace(0, 1, 8)
    mon = new_monitor(edit_distance_groups=0, compile_step="auto", compile_min_positions=0)
    first = None
    if sys.argv[1] == "before":  # the training's compiled code ran before the exporter's first program
        trainer(x)
        answered.set()
    for step in range(4):
        monitor_step(mon, w, step)
        if sys.argv[1] == "during" and first is None:
            assert tracing.wait(60)
            first = float(trainer(x))  # the training's first compiled call, while a program is traced
            answered.set()
        mon.compilation.wait(600)
        trainer(x)
    state = mon.compilation
    print(json.dumps({"compiles": state.compiles, "steps": state.compiled_steps, "foreign": state.foreign,
                      "fallbacks": dict(state.fallbacks), "first": first,
                      "expected": float((x.sin() * 2).sum())}))
    assert mon.compilation.close()
""")


def _run(case: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_training_that_compiled_its_own_code_first_gets_no_program() -> None:
    got = _run("before")
    assert got["compiles"] == 0
    assert got["steps"] == 0
    assert "torch.compile" in got["foreign"]
    assert got["fallbacks"] == {"compiler": 1}  # said once, then the eager step serves silently


def test_the_trainings_compiled_call_during_a_trace_runs_and_never_raises() -> None:
    """The training's first compiled call comes while the exporter traces a program (torch's FX-tracing flag
    set, process-wide): it runs uncompiled, with the right value, instead of raising; its next call compiles,
    and from then on the exporter makes no new program (the ones made still serve)."""
    got = _run("during")
    assert got["first"] == got["expected"]
    assert "torch.compile" in got["foreign"]
    assert got["compiles"] >= 1  # the programs queued before the training's first compiled frame
    assert got["steps"] >= 1
    assert got["fallbacks"]["compiler"] == 1
