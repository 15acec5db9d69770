"""The compiled step against the eager one (``compile_step="auto"`` vs ``"off"``), in one run: the same metric
set (the monitor without its edit-distance job) on the bench's synthetic step, timed in interleaved rounds next
to the one-pass floor, after the compiler thread made every program the step needs.

Also counted: stage calls served compiled per step (a step below ``compile_min_positions`` stays eager, by
design), fallbacks and recompiles during the timed rounds (a compiled call that would recompile is refused and
counted, so recompiles are fallbacks of reason ``recompile``), the first compilation's wall time (on the
compiler thread: what a training run does not wait for), and what one step launches: aten operators, and the
compiled programs' fused kernels (on a GPU, a kernel launch each), and the passes over (N, T) of each step:
the eager step's at the dispatcher (:func:`~grpo_exporter.bench.probes.passes`), the compiled step's as its
kernels' loop nests and extern operators (:func:`~grpo_exporter.bench.kernel_passes.compiled_passes`).
"""

from __future__ import annotations

import functools
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_exporter.bench import _timed, _times, monitor_step, new_monitor
from grpo_exporter.bench.kernel_passes import compiled_passes
from grpo_exporter.bench.naive import floor_step
from grpo_exporter.bench.probes import passes
from grpo_exporter.bench.workload import Workload, make
from grpo_exporter.runtime.monitor import GRPOMonitor

#: inductor's CPU kernels record a profiler event each (a flag check when no profiler runs): what
#: :func:`launches` counts; a GPU's kernels are recorded without it
KERNEL_PROFILE = {"cpp.enable_kernel_profile": True}
WARM_STEPS = 4  # steps before timing: on_policy alternates, so two update signatures, each served once compiled


@dataclass(frozen=True)
class CompiledResult:
    loss_tokens: int
    n: int
    t: int
    shape: str
    eager_s: float
    compiled_s: float
    floor_s: float
    compiled_calls: float  # stage calls served by a compiled program per timed step
    stage_calls: int  # stage calls per step with (N, T) tensors at or above compile_min_positions
    fallbacks: dict[str, int]  # during the timed rounds, by reason
    compiles: int
    first_compile_s: float | None
    eager_operators: int
    compiled_operators: int
    kernels: int  # fused kernels of the compiled programs launched in one step
    eager_passes: int  # passes over (N, T) of one step (probes.passes)
    compiled_passes: int | None  # the same, compiled (kernel_passes; None off a CPU: Triton kernels not parsed)
    floor_passes: int

    @property
    def recompiles(self) -> int:
        """Compiled calls refused during the timed rounds because they would have recompiled."""
        return self.fallbacks.get("recompile", 0)

    @property
    def speedup(self) -> float:
        """eager / compiled: above 1 the compiled step is faster."""
        return self.eager_s / self.compiled_s

    @property
    def vs_floor(self) -> float:
        return self.compiled_s / self.floor_s


def launches(run: Callable[[], Any]) -> tuple[int, int]:
    """(aten operators, inductor kernels) that ``run()`` launches: the profiler's ``aten::`` events, and its
    events of compiled kernels (CPU: ``cpp_fused_*`` events, recorded when compiled with the option
    :data:`KERNEL_PROFILE`; CUDA: the
    device's kernel events)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
    events = prof.events()
    operators = sum(1 for e in events if e.name.startswith("aten::"))
    kernels = sum(1 for e in events if "cpp_fused" in e.name
                  or (e.device_type == DeviceType.CUDA and e.name.startswith(("triton_", "cpp_fused"))))
    return operators, kernels


def _monitor(compile_step: str, min_positions: int | None) -> GRPOMonitor:
    threshold = {} if min_positions is None else {"compile_min_positions": min_positions}
    mon = new_monitor(edit_distance_groups=0, compile_step=compile_step, **threshold)
    mon.compilation.options |= KERNEL_PROFILE
    return mon


def _stage_calls(mon: GRPOMonitor, w: Workload) -> int:
    """Stage calls of one step whose token tensors reach the compile threshold: the rollout, and the update
    (the monitor computes it once a step, on its micro-batches stitched)."""
    return 2 * (w.n * w.t >= mon.compilation.min_positions)


def measure(loss_tokens: int, rounds: int, device: torch.device, shape: str = "bench",
            min_positions: int | None = None) -> CompiledResult:
    """One size: warm up (the compiler thread makes every program the step needs), then ``rounds`` interleaved
    rounds of the eager step, the compiled step and the floor; medians. ``min_positions``: the compiled
    monitor's ``compile_min_positions`` (None: the default, under which a small step stays eager)."""
    w = make(loss_tokens, device, shape=shape)
    eager, compiled = _monitor("off", min_positions), _monitor("auto", min_positions)
    try:
        for step in range(1, WARM_STEPS + 1):
            monitor_step(compiled, w, step)
            compiled.compilation.wait()
            monitor_step(eager, w, step)
        state = compiled.compilation
        before, served = Counter(state.fallbacks), state.compiled_steps
        times: dict[str, list[float]] = {"eager": [], "compiled": [], "floor": []}
        for r in range(rounds):
            step = WARM_STEPS + 1 + r
            runs: list[tuple[str, Callable[[], Any]]] = [
                ("eager", functools.partial(monitor_step, eager, w, step)),
                ("compiled", functools.partial(monitor_step, compiled, w, step)),
                ("floor", lambda: floor_step(w)),
            ]
            for key, fn in runs[r % 3:] + runs[: r % 3]:
                times[key].append(_timed(fn))
        fallbacks = dict(state.fallbacks - before)
        served = state.compiled_steps - served
        step = WARM_STEPS + rounds + 1
        eager_ops, _ = launches(functools.partial(monitor_step, eager, w, step))
        compiled_ops, kernels = launches(functools.partial(monitor_step, compiled, w, step))
        elements = w.n * w.t
        eager_passes = passes(functools.partial(monitor_step, eager, w, step + 1), elements)
        served_before = state.compiled_steps
        counted = compiled_passes(functools.partial(monitor_step, compiled, w, step + 1), elements)
        # None: a Triton kernel's loops are not parsed, and a stage computed eagerly is not the program's
        all_compiled = state.compiled_steps - served_before == _stage_calls(compiled, w)
        compiled_pass_count = counted if device.type == "cpu" and all_compiled else None
        result = CompiledResult(
            loss_tokens=w.loss_tokens, n=w.n, t=w.t, shape=shape,
            eager_s=statistics.median(times["eager"]), compiled_s=statistics.median(times["compiled"]),
            floor_s=statistics.median(times["floor"]), compiled_calls=served / max(rounds, 1),
            stage_calls=_stage_calls(compiled, w), fallbacks=fallbacks, compiles=state.compiles,
            first_compile_s=state.first_compile_s, eager_operators=eager_ops, compiled_operators=compiled_ops,
            kernels=kernels, eager_passes=eager_passes, compiled_passes=compiled_pass_count,
            floor_passes=passes(lambda: floor_step(w), elements),
        )
    finally:
        eager.close()
        compiled.close()
    return result


def run(sizes: Sequence[tuple[int, str]], rounds: int, device: torch.device) -> list[CompiledResult]:
    return [measure(size, rounds, device, shape) for size, shape in sizes]


def table(results: Sequence[CompiledResult]) -> str:
    """The compiled-vs-eager report as markdown."""
    lines = [
        "| loss tokens | N x T | eager step | compiled step | floor | eager / compiled | compiled / floor "
        "| eager / floor | stage calls compiled / step | fallbacks in timed rounds | recompiles | compilations "
        "| first compilation | aten ops / step: eager | aten ops / step: compiled | fused kernels / step "
        "| passes over (N, T): eager | passes: compiled | passes: floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shape = f"{r.n} x {r.t}" + (f", {r.shape}" if r.shape != "bench" else "")
        fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(r.fallbacks.items())) or "0"
        first = "-" if r.first_compile_s is None else f"{r.first_compile_s:.1f} s"
        lines.append(
            f"| {r.loss_tokens:,} | {shape} | {r.eager_s * 1e3:.1f} ms | {r.compiled_s * 1e3:.1f} ms "
            f"| {r.floor_s * 1e3:.2f} ms | {r.speedup:.2f}x | {_times(r.vs_floor)} | {_times(r.eager_s / r.floor_s)} "
            f"| {r.compiled_calls:.1f} of {r.stage_calls} | {fallbacks} | {r.recompiles} | {r.compiles} | {first} "
            f"| {r.eager_operators} | {r.compiled_operators} | {r.kernels} | {r.eager_passes} "
            f"| {'-' if r.compiled_passes is None else r.compiled_passes} | {r.floor_passes} |"
        )
    return "\n".join(lines)
