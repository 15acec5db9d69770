"""``grpo-exporter bench``: the monitor's per-step cost against naive code and the one-pass floor, measured in
one run (interleaved rounds, medians; ratios are what carry between machines). docs/benchmarks.md holds a table
it printed and the command.

Per size, one full training step of the monitor is one ``observe_rollout``, four ``observe_update``
micro-batches and the end of the step (the framework's pre-clip grad norm); the edit-distance worker it starts
runs off the step and is timed apart (``worker``). ``recorder``: the same step with the flight recorder on
(healthy steps: it keeps spread rows, no host read; an incident is written off the step); ``anomalous``: with
the recorder on and one NaN reward in every step, so that each step is judged anomalous and its offending rows
are scored and picked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import generate_latest

from grpo_exporter.bench.naive import EPS_HIGH, EPS_LOW, floor_step, naive_core_step, naive_step
from grpo_exporter.bench.probes import counting, minor_faults, operators, passes, rss_bytes
from grpo_exporter.bench.worker import WorkerCost
from grpo_exporter.bench.workload import MICRO_BATCHES, G, Workload, make
from grpo_exporter.runtime.monitor import GRPOMonitor

SIZES = (10_000, 64_000, 256_000, 1_000_000, 4_000_000)
FRAMEWORK_SIZES = (64_000, 1_000_000)  # the framework-shaped step (bench.workload), at the targets' ends
FIXED_SHAPE = (640, 16)  # loss tokens and T of the fixed-cost step: 64 x 16, next to no per-token work


@dataclass(frozen=True)
class SizeResult:
    loss_tokens: int
    n: int
    t: int
    monitor_s: float
    naive_s: float
    floor_s: float
    worker_s: float
    operators: int
    host_reads: int
    from_python: int
    render_s: float
    exposition_bytes: int
    recorder_s: float = 0.0  # the step with the flight recorder on
    recorder_host_reads: int = 0
    anomalous_s: float = 0.0  # the step with the recorder on, every step anomalous (a NaN reward)
    anomalous_host_reads: int = 0
    naive_core_s: float = 0.0  # the naive code on the seed's core metrics only
    same_set_s: float = 0.0  # the monitor's step with its edit-distance job and reading set off: the naive code's set
    unread_s: float = 0.0  # the monitor's step with its reading set off (reading_rows=0)
    page_faults: float = 0.0  # minor page faults of the process during the monitor step (median)
    syncs: int | None = None  # CUDA: synchronising calls per step (set_sync_debug_mode("warn"))
    update_sync_error: str = ""  # CUDA: what "error" mode around the micro-batch updates raised
    shape: str = "bench"  # the workload's shape (bench.workload.SHAPES)
    fixed_s: float = 0.0  # the same metric set on a 64 x 16 step, timed in the same rounds: the step's fixed cost
    passes: int = 0  # passes over (N, T) tensors in one step of the same metric set (probes.passes)
    floor_passes: int = 0

    @property
    def fixed_vs_floor(self) -> float:
        """The fixed cost over the floor: what the same metric set costs over the floor before any per-token
        work, a lower bound of ``same_set_s / floor_s`` for any implementation with this fixed cost."""
        return self.fixed_s / self.floor_s

    @property
    def same_set_vs_floor(self) -> float:
        """The same metric set over the floor: what the floor target (<= 10x) reads."""
        return self.same_set_s / self.floor_s

    @property
    def vs_naive(self) -> float:
        """naive / monitor on the same metric set (the monitor without its edit-distance job, which the naive
        code has no counterpart of): above 1 the monitor is faster."""
        return self.naive_s / self.same_set_s

    @property
    def vs_naive_core(self) -> float:
        """naive on the core metrics / monitor (on its whole metric set): the conservative ratio."""
        return self.naive_core_s / self.monitor_s

    @property
    def vs_recorder(self) -> float:
        """recorder on / off: 1 = free."""
        return self.recorder_s / self.monitor_s

    @property
    def vs_reading(self) -> float:
        """the monitor's step (its reading set on, the default) / the same with it off: 1 = free."""
        return self.monitor_s / self.unread_s

    @property
    def vs_anomalous(self) -> float:
        """recorder on, anomalous step / off."""
        return self.anomalous_s / self.monitor_s

    @property
    def vs_floor(self) -> float:
        """monitor / floor."""
        return self.monitor_s / self.floor_s


@dataclass(frozen=True)
class LongRun:
    steps: int
    rss_early_bytes: int
    rss_late_bytes: int
    series_early: int
    series_late: int


def new_monitor(**settings: Any) -> GRPOMonitor:
    return GRPOMonitor(run="bench", group_size=G, clip_eps=(EPS_LOW, EPS_HIGH), port=None, close_linger_s=0,
                       guard="off", **settings)


def monitor_step(mon: GRPOMonitor, w: Workload, step: int, update_sync: str | None = None) -> None:
    """One training step as a loop hands it to the monitor; ``update_sync`` (CUDA): the
    ``torch.cuda.set_sync_debug_mode`` around the micro-batch ``observe_update`` calls, which must never
    synchronise ("error" raises on the first that does)."""
    mon.observe_rollout(step, rewards=w.rewards, correct=w.correct, truncated=w.truncated,
                        rollout_logprobs=w.rollout, old_logprobs=w.old, loss_mask=w.mask,
                        completion_lengths=w.lengths, completion_ids=w.completion_ids,
                        completion_mask=w.completion_mask, prompt_ids=w.prompt_ids)
    for k in range(MICRO_BATCHES):
        s = w.rows(k)
        logprobs, entropy = w.micro_batch(k)
        with _sync_debug(update_sync):
            mon.observe_update(step, logprobs=logprobs, old_logprobs=w.old[s], advantages=w.advantages[s],
                               loss_mask=w.mask[s], entropy=entropy, ref_logprobs=w.ref[s],
                               on_policy=step % 2 == 0)
    mon.observe_update(step, grad_norm_pre_clip=torch.ones((), device=w.old.device), max_grad_norm=1.0)
    mon.end_step()


@contextlib.contextmanager
def _sync_debug(mode: str | None) -> Iterator[None]:
    if mode is None:
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def synchronizations(mon: GRPOMonitor, w: Workload, step: int) -> tuple[int, str]:
    """On CUDA: (synchronising calls in one whole step, counted with set_sync_debug_mode("warn") - the
    step's transfers; what "error" mode around the micro-batch observe_update calls raised, "" if nothing)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _sync_debug("warn"):
            monitor_step(mon, w, step)
    syncs = sum(1 for c in caught if "synchroniz" in str(c.message).lower())
    strict = GRPOMonitor(run="bench-sync", group_size=G, clip_eps=(EPS_LOW, EPS_HIGH), port=None,
                         close_linger_s=0, guard="off", strict=True)  # contained, an error would only be counted
    try:
        monitor_step(strict, w, step, update_sync="error")
        raised = ""
    except RuntimeError as exc:
        raised = str(exc).splitlines()[0][:200]
    finally:
        strict.close()
    return syncs, raised


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Monitors:
    """The workloads and monitors one size is measured with: ``mon`` (the default monitor), ``recording`` and
    ``anomalous`` (the flight recorder, on a healthy and on an anomalous batch), ``same_set`` (without the
    edit-distance job), ``fixed`` (a tiny batch: the fixed cost). :meth:`close` closes them all."""

    def __init__(self, loss_tokens: int, device: torch.device, shape: str) -> None:
        self.w = make(loss_tokens, device, shape=shape)
        self.tiny = make(FIXED_SHAPE[0], device, width=FIXED_SHAPE[1])
        rewards = self.w.rewards
        self.bad = dataclasses.replace(
            self.w, rewards=rewards.clone().index_fill_(0, torch.tensor([1], device=rewards.device), float("nan")))
        self.records = tempfile.TemporaryDirectory(prefix="grpo-bench-recorder-")
        self.fixed = new_monitor(edit_distance_groups=0)
        self.mon = new_monitor()
        self.recording = new_monitor(recorder_dir=self.records.name)
        self.same_set = new_monitor(edit_distance_groups=0, reading_rows=0)
        self.anomalous = new_monitor(recorder_dir=self.records.name)
        self.unread = new_monitor(reading_rows=0)

    def close(self) -> None:
        for monitor in (self.mon, self.recording, self.same_set, self.anomalous, self.fixed, self.unread):
            monitor.close()
        self.records.cleanup()


def _timed_rounds(m: _Monitors, rounds: int) -> dict[str, float]:
    """Median seconds of each timed part over ``rounds`` (after two warm-up rounds); the monitors take turns
    going first, so none always runs on a cold cache."""
    w = m.w
    times: dict[str, list[float]] = {}
    for r in range(rounds + 2):
        step = r + 1
        sample: dict[str, float] = {}
        runs = [("monitor", m.mon, w, "worker"), ("recorder", m.recording, w, "_"),
                ("anomalous", m.anomalous, m.bad, "_"), ("same_set", m.same_set, w, "_"), ("unread", m.unread, w, "_")]
        for key, monitor, work, after in runs[r % 5:] + runs[: r % 5]:
            faults = minor_faults()
            sample[key] = _timed(functools.partial(monitor_step, monitor, work, step))
            if key == "monitor":
                sample["faults"] = minor_faults() - faults
            sample[after] = _timed(monitor.wait_for_workers)
        sample |= {
            "naive": _timed(lambda: naive_step(w)),
            "naive_core": _timed(lambda: naive_core_step(w)),
            "floor": _timed(lambda: floor_step(w)),
            "fixed": _timed(functools.partial(monitor_step, m.fixed, m.tiny, step)),
        }
        if r >= 2:
            for key, value in sample.items():
                times.setdefault(key, []).append(value)
    return {k: statistics.median(v) for k, v in times.items()}


def _counted(m: _Monitors, step: int) -> dict[str, Any]:
    """The deterministic readings, from ``step`` on: operators, passes over (N, T), host reads and tensors from
    Python data, synchronisations (CUDA), the exposition's render time and size."""
    w = m.w
    found: dict[str, Any] = {"syncs": None, "update_sync_error": ""}
    found["operators"] = operators(functools.partial(monitor_step, m.mon, w, step))
    m.mon.wait_for_workers()
    found["passes"] = passes(functools.partial(monitor_step, m.same_set, w, step + 1), w.n * w.t)
    found["floor_passes"] = passes(lambda: floor_step(w), w.n * w.t)
    with counting(w.old.device) as counts:
        monitor_step(m.mon, w, step + 2)
    m.mon.wait_for_workers()
    with counting(w.old.device) as recorded:
        monitor_step(m.recording, w, step + 2)
    m.recording.wait_for_workers()
    with counting(w.old.device) as judged:
        monitor_step(m.anomalous, m.bad, step + 2)
    m.anomalous.wait_for_workers()
    if w.old.device.type == "cuda":
        found["syncs"], found["update_sync_error"] = synchronizations(m.mon, w, step + 3)
        m.mon.wait_for_workers()
    found |= {"host_reads": counts.host_reads, "from_python": counts.from_python,
              "recorder_host_reads": recorded.host_reads, "anomalous_host_reads": judged.host_reads}
    found["render_s"] = statistics.median([_timed(lambda: generate_latest(m.mon.registry)) for _ in range(20)])
    found["exposition_bytes"] = len(generate_latest(m.mon.registry))
    return found


def measure_size(loss_tokens: int, rounds: int, device: torch.device, shape: str = "bench") -> SizeResult:
    m = _Monitors(loss_tokens, device, shape)
    quiet = logging.getLogger("grpo_exporter")
    was_disabled, quiet.disabled = quiet.disabled, True  # the anomalous monitor's incident line is no result
    try:
        median = _timed_rounds(m, rounds)
        found = _counted(m, rounds + 3)
    finally:
        m.close()
        quiet.disabled = was_disabled
    w = m.w
    return SizeResult(
        loss_tokens=w.loss_tokens, n=w.n, t=w.t, monitor_s=median["monitor"], naive_s=median["naive"],
        floor_s=median["floor"], worker_s=median["worker"], recorder_s=median["recorder"],
        anomalous_s=median["anomalous"], naive_core_s=median["naive_core"], same_set_s=median["same_set"],
        unread_s=median["unread"],
        page_faults=median["faults"], fixed_s=median["fixed"], shape=shape, **found,
    )


def long_run(steps: int, device: torch.device) -> LongRun:
    """RSS and series after ``steps`` small steps (the flatness check, not a speed one)."""
    w = make(2_000, device, seed=1)
    mon = new_monitor()
    early = max(1, steps // 10)
    rss_early = series_early = 0
    try:
        for step in range(1, steps + 1):
            monitor_step(mon, w, step)
            if step == early:
                mon.wait_for_workers()
                rss_early, series_early = rss_bytes(), _series(mon)
        mon.wait_for_workers()
        rss_late, series_late = rss_bytes(), _series(mon)
    finally:
        mon.close()
    return LongRun(steps, rss_early, rss_late, series_early, series_late)


def _series(mon: GRPOMonitor) -> int:
    return sum(len(family.samples) for family in mon.registry.collect())


def run(sizes: Sequence[int] = SIZES, rounds: int = 15, long_steps: int = 10_000,
        device: str | torch.device = "cpu", warm_allocator: bool = True,
        framework_sizes: Sequence[int] = FRAMEWORK_SIZES) -> tuple[list[SizeResult], LongRun]:
    """Every size of the bench-shaped step, then every size of ``framework_sizes`` framework-shaped
    (:mod:`grpo_exporter.bench.workload`), then the long run."""
    dev = torch.device(device)
    if warm_allocator:
        warm_malloc()
    shaped = [(size, "bench") for size in sizes] + [(size, "framework") for size in framework_sizes]
    return [measure_size(size, rounds, dev, shape) for size, shape in shaped], long_run(long_steps, dev)


def warm_malloc() -> None:
    """Bring glibc's malloc to the state of a training process: free one 30 MiB block. glibc starts with a 128
    KiB mmap threshold and raises it (and its trim threshold, to twice that) to the size of each larger block
    freed, up to 32 MiB; a process that trains has freed activations that large long before its monitor runs.
    A process that only runs the bench has not, and gives memory back to the system after nearly every step
    (the bench's page-fault column shows which state a run was in; ``--cold-allocator`` skips this)."""
    block = torch.empty(30 << 20, dtype=torch.uint8)
    block.fill_(0)
    del block


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _shape(r: SizeResult) -> str:
    return f"{r.n} x {r.t}" + (f", {r.shape}" if r.shape != "bench" else "")


def table(results: Sequence[SizeResult], long: LongRun, workers: Sequence[WorkerCost] = ()) -> str:
    """The bench's report as markdown."""
    lines = [
        "| loss tokens | N x T | monitor step | same metric set | naive | naive, core | floor "
        "| naive / monitor, same metric set | naive, core / monitor step | monitor step / floor | worker after step "
        "| aten ops / step | host reads / step | tensors from Python data / step | scrape render | exposition "
        "| recorder on / off | host reads, recorder on | anomalous step, recorder on / off | host reads, anomalous "
        "| page faults / step | reading set on / off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.loss_tokens:,} | {_shape(r)} | {r.monitor_s * 1e3:.1f} ms | {r.same_set_s * 1e3:.1f} ms "
            f"| {r.naive_s * 1e3:.1f} ms | {r.naive_core_s * 1e3:.1f} ms "
            f"| {r.floor_s * 1e3:.2f} ms | {r.vs_naive:.2f}x | {r.vs_naive_core:.2f}x | {r.vs_floor:.0f}x "
            f"| {r.worker_s * 1e3:.1f} ms "
            f"| {r.operators} | {r.host_reads} | {r.from_python} | {r.render_s * 1e3:.2f} ms "
            f"| {r.exposition_bytes / 1024:.1f} KiB | {r.vs_recorder:.2f}x | {r.recorder_host_reads} "
            f"| {r.vs_anomalous:.2f}x | {r.anomalous_host_reads} | {r.page_faults:,.0f} | {r.vs_reading:.2f}x |"
        )
    lines += [
        "",
        "| loss tokens | N x T | same metric set / floor | fixed cost (64 x 16 step) | fixed cost / floor "
        "| passes over (N, T): same metric set | passes: floor | passes / floor's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.loss_tokens:,} | {_shape(r)} | {_times(r.same_set_vs_floor)} | {r.fixed_s * 1e3:.2f} ms "
        f"| {_times(r.fixed_vs_floor)} | {r.passes} | {r.floor_passes} | {_times(r.passes / max(r.floor_passes, 1))} |"
        for r in results
    ]
    lines.append("")
    lines.append(
        f"After {long.steps:,} steps: RSS {long.rss_late_bytes / 2**20:.1f} MiB (at step {max(1, long.steps // 10):,}: "
        f"{long.rss_early_bytes / 2**20:.1f} MiB), series {long.series_late} (at step {max(1, long.steps // 10):,}: "
        f"{long.series_early}; the run's baselines and anchors appear once warmed up)."
    )
    cuda = [r for r in results if r.syncs is not None]
    if cuda:
        lines += ["", "| loss tokens | synchronising calls per step (sync debug \"warn\") "
                  "| micro-batch observe_update under sync debug \"error\" |", "|---|---|---|"]
        lines += [f"| {r.loss_tokens:,} | {r.syncs} | {r.update_sync_error or 'no synchronisation'} |" for r in cuda]
    if workers:
        lines += ["", "| edit-distance job, T | every pair | pairs | with the default budget (0.02 s, pair cap) "
                  "| pairs |", "|---|---|---|---|---|"]
        lines += [f"| {c.width} | {c.full_s * 1e3:.1f} ms | {c.full_pairs} | {c.budgeted_s * 1e3:.1f} ms "
                  f"| {c.budgeted_pairs} |" for c in workers]
    return "\n".join(lines)
