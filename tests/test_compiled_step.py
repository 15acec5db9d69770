"""The compiled stage (:mod:`grpo_exporter.step.program`, :mod:`grpo_exporter.runtime.compilation`): the same
readings as the eager step on random, heavy-tailed, all-masked and non-finite inputs; a compiler that fails
falls back to eager, counted; no step waits on compilation."""

from __future__ import annotations

import dataclasses
import math
import re
import threading

import pytest
import torch

from grpo_exporter import catalog
from grpo_exporter.bench import monitor_step, new_monitor, workload
from grpo_exporter.catalog import COMPILE_FALLBACKS
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import histogram
from grpo_exporter.inputs import StepInputs
from grpo_exporter.runtime.compilation import CompiledStages
from grpo_exporter.step import ROLLOUT_BLOCKS, UPDATE_BLOCKS, compute_step_carrying
from grpo_exporter.step import program as step_program
from monitor_helpers import registry_value

CFG = MetricsConfig(group_size=16)


def _stages(w: workload.Workload) -> dict[str, tuple[dict, tuple]]:
    rollout = {"rewards": w.rewards, "correct": w.correct, "truncated": w.truncated, "rollout_logprobs": w.rollout,
               "old_logprobs": w.old, "loss_mask": w.mask, "completion_lengths": w.lengths,
               "completion_ids": w.completion_ids}
    update = {"logprobs": w.new, "old_logprobs": w.old, "ref_logprobs": w.ref, "entropy": w.entropy,
              "advantages": w.advantages, "loss_mask": w.mask, "on_policy": True,
              "grad_norm_pre_clip": torch.ones(()), "max_grad_norm": 1.0, "policy_version": 7,
              "rollout_policy_version": 5}
    return {"rollout": (rollout, ROLLOUT_BLOCKS), "update": (update, UPDATE_BLOCKS)}


#: the two size classes a trace tells apart (N x T below 2^16: bool masks; above: the large-tensor path), each
#: traced at its first size and run at both: one program serves every N and T of its class
CLASSES = {"small": (10_000, 30_000), "large": (60_000, 250_000)}


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], tuple[step_program.Program, step_program.Runner]]:
    """One program per stage and size class, traced at the class's first size, compiled once for the module."""
    out = {}
    for name, (first, _) in CLASSES.items():
        for stage, (fields, blocks) in _stages(workload.make(first)).items():
            out[name, stage] = _compiled_program(StepInputs(**fields), blocks)
    return out


def _compiled_program(x: StepInputs, blocks: tuple) -> tuple[step_program.Program, step_program.Runner]:
    """The stage's program traced on ``x`` and compiled (on one compiler thread)."""
    sig = step_program.signature(blocks, x, {}, False)
    program = step_program.trace(blocks, CFG, sig, step_program.leaves(x, {}), x.device)
    return program, step_program.compile_program(program, {"compile_threads": 1})


def _assert_same_readings(got: dict, eager: dict) -> None:
    """A compiled stage's readings against the eager stage's: the same keys, counts and histogram buckets
    exact, every other value within :func:`_close`."""
    assert set(got) == set(eager)
    for key, value in eager.items():
        if "_bucket" in key or "_total" in key:
            assert got[key] == value, key
        else:
            assert got[key] == _close(value, key), key


def _variants(w: workload.Workload, kind: str) -> workload.Workload:
    g = torch.Generator().manual_seed(3)
    if kind == "heavy":  # log-ratios and gaps with Cauchy tails: ratios far outside the clip, weights huge
        noise = torch.distributions.Cauchy(0.0, 0.5).sample(w.new.shape)
        return workload.Workload(**{**w.__dict__, "new": w.old + noise.clamp(-60, 60),
                                    "rollout": w.old + torch.randn(w.old.shape, generator=g).abs() * 0.3})
    if kind == "masked":  # every loss token masked off: the per-token readings are absent
        return workload.Workload(**{**w.__dict__, "mask": torch.zeros_like(w.mask)})
    if kind == "nonfinite":  # NaN and inf on loss tokens (the witnessed counts need the eager step)
        new, ent = w.new.clone(), w.entropy.clone()
        new[0, 0], new[3, 1], ent[2, 0] = math.nan, math.inf, math.nan
        return workload.Workload(**{**w.__dict__, "new": new, "entropy": ent})
    return w


@pytest.mark.parametrize("kind", ["random", "heavy", "masked", "nonfinite"])
@pytest.mark.parametrize(("size_class", "size"), [(c, s) for c, sizes in CLASSES.items() for s in sizes])
def test_compiled_readings_equal_eager(compiled, kind: str, size_class: str, size: int) -> None:
    w = _variants(workload.make(size, seed=size + len(kind)), kind)
    late = 0
    for stage, (fields, blocks) in _stages(w).items():
        x = StepInputs(**fields)
        program, runner = compiled[size_class, stage]
        args = step_program.leaves(x, {})
        assert program.admits(args), "one trace serves every N and T of the class (no recompile by size)"
        tags = {t for b in blocks for t in b.tags}
        eager = compute_step_carrying(x, CFG, {}, True, blocks=blocks).metrics
        try:
            with torch.inference_mode():
                got = step_program.run(program, runner, args, tags).metrics
        except step_program.LateCounts:
            late += 1  # the caller computes this step eagerly
            continue
        if kind != "masked":
            assert len(eager) > 60  # the stage's per-token families are there to compare
        _assert_same_readings(got, eager)
    assert (late > 0) == (kind == "nonfinite")


def test_the_scatter_form_of_histogram_counts_reads_the_same(monkeypatch) -> None:
    """Off a CPU a traced stage counts histogram keys by an accumulating scatter (it fuses there, as atomic
    adds) instead of ``grpo_exporter::bincount``. No GPU runs this suite, so the CPU traces and compiles that
    form too (inductor lowers it to its scatter fallback): the same readings as the eager step."""
    monkeypatch.setattr(histogram, "counted_by_bincount", lambda device: False)
    programs = {}
    for kind in ("random", "heavy"):
        w = _variants(workload.make(60_000, seed=11 + len(kind)), kind)
        for stage, (fields, blocks) in _stages(w).items():
            x = StepInputs(**fields)
            args = step_program.leaves(x, {})
            if stage not in programs:
                programs[stage] = _compiled_program(x, blocks)
                targets = {str(n.target) for n in programs[stage][0].graph.graph.nodes if n.op == "call_function"}
                assert any("scatter_add" in t for t in targets)
                assert not any("grpo_exporter.bincount" in t for t in targets)
            program, runner = programs[stage]
            eager = compute_step_carrying(x, CFG, {}, True, blocks=blocks).metrics
            with torch.inference_mode():
                got = step_program.run(program, runner, args, {t for b in blocks for t in b.tags}).metrics
            _assert_same_readings(got, eager)


def test_a_failing_compiler_falls_back_to_eager_counted(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(step_program, "compile_program", broken)
    w = workload.make(10_000)
    stages = CompiledStages(CFG, "auto", 0)
    fields, blocks = _stages(w)["update"]
    x = StepInputs(**fields)
    assert stages.compute(blocks, x, {}, False) is None  # eager serves while the compiler works
    assert stages.wait(60)
    assert stages.fallbacks["compiler"] == 1
    sig = step_program.signature(blocks, x, {}, False)
    assert "no C++ compiler" in stages.refused[sig]
    assert stages.compute(blocks, x, {}, False) is None  # the signature stays eager, asks nothing more
    assert stages.fallbacks["compiler"] == 1
    assert not stages._pending
    stages.close()


def test_no_step_waits_on_compilation(monkeypatch) -> None:
    release = threading.Event()
    real = step_program.trace

    def slow(*args, **kwargs):
        release.wait(30)  # the compiler is busy for as long as the test says
        return real(*args, **kwargs)

    monkeypatch.setattr(step_program, "trace", slow)
    w = workload.make(10_000)
    stages = CompiledStages(CFG, "auto", 0)
    fields, blocks = _stages(w)["update"]
    x = StepInputs(**fields)
    for _ in range(3):  # every call returns at once (eager), the compiler still at work
        assert stages.compute(blocks, x, {}, False) is None
    assert stages.fallbacks["pending"] == 3
    assert stages.compiles == 0
    release.set()
    assert stages.wait(300)
    assert stages.compiles == 1
    assert not stages.refused
    result = stages.compute(blocks, x, {}, False)
    assert result is not None
    assert stages.compiled_steps == 1
    eager = compute_step_carrying(x, CFG, {}, True, blocks=blocks).metrics
    assert set(result.metrics) == set(eager)
    assert stages.close()  # the compiler thread ended


def test_close_waits_for_the_compiler_thread_within_a_bound(monkeypatch) -> None:
    """close() waits for a compilation in progress at most its timeout (2 s by default), and says whether it
    ended; one not started yet is dropped (tests/test_compiled_exit.py: what an exit does)."""
    started, release = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        started.set()
        release.wait(30)
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(step_program, "trace", held)
    stages = CompiledStages(CFG, "auto", 0)
    fields, blocks = _stages(workload.make(10_000))["update"]
    assert stages.compute(blocks, StepInputs(**fields), {}, False) is None
    assert started.wait(30)  # the trace is in progress (a compilation not started yet is dropped by close())
    assert stages.close(timeout_s=0.2) is False  # the compilation is held: close() returns after its bound
    release.set()
    assert stages.close(timeout_s=30) is True
    assert stages.fallbacks["compiler"] == 1


def test_off_and_small_steps_stay_eager() -> None:
    w = workload.make(10_000)
    fields, blocks = _stages(w)["update"]
    x = StepInputs(**fields)
    assert CompiledStages(CFG, "off", 0).compute(blocks, x, {}, False) is None
    small = CompiledStages(CFG, "auto", x.loss_mask.numel() + 1)
    assert small.compute(blocks, x, {}, False) is None
    assert not small._pending
    assert small._executor is None  # no compiler thread is started


def _close(value: float, key: str = "") -> object:
    """The compiled step's tolerance: rel 1e-4; a chi-square reading is E[w^2] - 1, a difference of terms near
    1 (healthy runs sit near 0), so it is held to 1e-8 of those terms instead."""
    return pytest.approx(value, rel=1e-4, abs=1e-8 if "chi_square" in key else 1e-9)


def _published(mon) -> dict[str, float]:
    out = {}
    for family in mon.registry.collect():
        for sample in family.samples:
            timing = sample.name.startswith(("grpo_observe_duration", "grpo_exporter_")) or "timestamp" in sample.name
            if sample.name.startswith("grpo_") and not timing:  # the training's readings, not the exporter's own
                out[sample.name + repr(sorted(sample.labels.items()))] = sample.value
    return out


def test_a_monitor_publishes_the_same_with_its_compiled_stages() -> None:
    """The monitor's own path: a step eager while the programs compile, then compiled steps, published alike."""
    w = workload.make(10_000)
    compiled = new_monitor(edit_distance_groups=0, compile_step="auto", compile_min_positions=0)
    eager = new_monitor(edit_distance_groups=0)
    try:
        for step in range(4):  # on_policy alternates by step: two update signatures
            for mon in (compiled, eager):
                monitor_step(mon, w, step)
            assert compiled.compilation.wait(600)
        before = compiled.compilation.compiled_steps
        for step in range(4, 6):
            for mon in (compiled, eager):
                monitor_step(mon, w, step)
        assert compiled.compilation.compiled_steps - before == 4  # two rollouts, two updates
        assert not compiled.compilation.refused
        state = compiled.compilation
        # compiled while warming up: the rollouts of steps 1-3 and the updates of steps 2-3; then 4
        assert registry_value(compiled, "grpo_exporter_compiled_stage_calls_total") == state.compiled_steps == 9
        assert state.fallbacks["pending"] >= 3  # the first rollout and the two updates' first calls
        for reason in COMPILE_FALLBACKS:
            published = registry_value(compiled, catalog.key("grpo_exporter_compiled_fallbacks_total", reason=reason))
            assert (published or 0.0) == state.fallbacks[reason], reason
        assert registry_value(eager, "grpo_exporter_compiled_stage_calls_total") is None
        got, want = _published(compiled), _published(eager)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == _close(value, key), key
    finally:
        compiled.close()
        eager.close()


def _bf16(w: workload.Workload) -> workload.Workload:
    def half(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16)

    return dataclasses.replace(w, new=half(w.new), old=half(w.old), rollout=half(w.rollout), ref=half(w.ref),
                               entropy=half(w.entropy))


def _with_grad(w: workload.Workload) -> workload.Workload:
    def live(t: torch.Tensor) -> torch.Tensor:
        return t.clone().requires_grad_()

    return dataclasses.replace(w, new=live(w.new), old=live(w.old), rollout=live(w.rollout))


def _strided_fp16(w: workload.Workload) -> workload.Workload:
    return dataclasses.replace(w, rollout=w.rollout.t().contiguous().t(), old=w.old.to(torch.float16))


#: worlds a real loop hands over that the bench step is not: a bf16 trainer and engine; a framework's loop
#: (separate micro-batch outputs, T - 3, a multi-turn loss mask with tool spans); N and T that change every step
#: (a batch's longest completion sets T); log-probs that still need grad (each recompiled before leaves()
#: detached them); a column-major engine tensor and fp16 old log-probs
WORLDS = {
    "bf16": lambda: [_bf16(workload.make(10_000))] * 5,
    "requires grad": lambda: [_with_grad(workload.make(10_000))] * 5,
    "strided, fp16": lambda: [_strided_fp16(workload.make(10_000))] * 5,
    "framework": lambda: [workload.make(10_000, shape="framework")] * 5,
    "changing N and T": lambda: [workload.make(10_000, seed=s, width=t)
                                 for s, t in enumerate((256, 200, 256, 173, 310, 97, 411))],
}


@pytest.mark.parametrize("world", list(WORLDS))
def test_other_worlds_publish_the_same_compiled_without_recompiling(world: str) -> None:
    compiled = new_monitor(edit_distance_groups=0, compile_step="auto", compile_min_positions=0)
    eager = new_monitor(edit_distance_groups=0)
    try:
        for step, w in enumerate(WORLDS[world]()):
            for mon in (compiled, eager):
                monitor_step(mon, w, step)
            assert compiled.compilation.wait(600)
        state = compiled.compilation
        assert state.compiles == 3  # rollout, update on and off policy: one program each, whatever the sizes
        assert set(state.fallbacks) == {"pending"}
        assert state.compiled_steps >= 5
        got, want = _published(compiled), _published(eager)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == _close(value, key), key
    finally:
        compiled.close()
        eager.close()


def test_groups_by_id_and_reward_components_publish_the_same_compiled() -> None:
    """G = 4 with groups given by shuffled ids (not contiguous), and named reward components: a signature the
    bench step never has."""
    from grpo_exporter.bench import EPS_HIGH, EPS_LOW
    from grpo_exporter.runtime.monitor import GRPOMonitor

    w = workload.make(20_000)
    groups = torch.randperm(w.n, generator=torch.Generator().manual_seed(1)) // 4
    components = {"format": torch.rand(w.n, generator=torch.Generator().manual_seed(2)), "correct": w.correct.double()}

    def monitor(**settings: object) -> GRPOMonitor:
        return GRPOMonitor(run="bench", group_size=4, clip_eps=(EPS_LOW, EPS_HIGH), port=None, close_linger_s=0,
                           guard="off", edit_distance_groups=0, **settings)

    compiled, eager = monitor(compile_step="auto", compile_min_positions=0), monitor()
    try:
        for step in range(4):
            for mon in (compiled, eager):
                mon.observe_rollout(step, rewards=w.rewards, correct=w.correct, rollout_logprobs=w.rollout,
                                    old_logprobs=w.old, loss_mask=w.mask, completion_lengths=w.lengths,
                                    group_ids=groups, reward_components=components)
                mon.observe_update(step, logprobs=w.new, old_logprobs=w.old, advantages=w.advantages,
                                   loss_mask=w.mask, entropy=w.entropy, on_policy=False)
                mon.end_step()
            assert compiled.compilation.wait(600)
        assert compiled.compilation.compiles == 2
        assert compiled.compilation.compiled_steps == 6  # both stages of steps 1-3
        got, want = _published(compiled), _published(eager)
        assert set(got) == set(want)
        assert any("component" in key for key in want)
        for key, value in want.items():
            assert got[key] == _close(value, key), key
    finally:
        compiled.close()
        eager.close()


def test_every_fallback_reason_is_a_value_of_the_published_label() -> None:
    """The reasons the compiled stages count are the catalogue's values of the fallback counter's label (a
    reason outside them would fail to publish)."""
    import inspect

    from grpo_exporter.runtime import compilation

    said = set(re.findall(r'_fallback\("(\w+)"', inspect.getsource(compilation)))
    assert said == set(COMPILE_FALLBACKS)
