"""The world sweep: tiny GRPO worlds unlike ours (grpo_exporter.demo.worlds), each trained for real with a real
GRPOMonitor, scraped every 30 s at its cadence, and judged by the production rules (generated for that cadence
only: ``MixinConfig(step_seconds=...)``) inside promtool, as tests/replay.py does for simulated runs.

A world's class comes from the trainer's own pass@1 and pass@G, never from the exporter. The verdict: nothing
at warning or critical fires on a healthy world; on a collapsing one only layer 4 may. The info notice
(GRPOEngineLogprobGapCleanLevelHigh) may fire once on any world whose engine is bf16.

``python tests/worlds.py --worlds 200 --out docs/worlds.md`` runs the larger sweep (worlds 0..N-1, one
process per core) and writes the table; tests/test_worlds.py runs a fixed sample of it in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_lane import LANE_WAIT_S
from grpo_exporter import GRPOMonitor, MonitorConfig
from grpo_exporter.demo.trainer import Trainer
from grpo_exporter.demo.worlds import CADENCES, COLLAPSE_INDEX, Trajectory, World, collapse_world, world
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.render import rules_outputs
from replay import EPISODE_RULES, EVAL_S, JOB, SCRAPE_S, Timeline, _encode, _exposed, rule_metric_names

TAIL_S = 1800  # scrapes after the run's end (its target down): a normal end pages nothing
PROMTOOL_WORLDS = 12  # worlds of one cadence judged by one promtool run (a larger sweep runs several)
NOTICES = {"GRPOEngineLogprobGapCleanLevelHigh"}


@dataclass
class Replayed:
    """One world after the replay: its measurements and the alerts that fired (alert -> episodes)."""

    trajectory: Trajectory
    fired: dict[str, int]
    fault: str | None = None  # a control world: the fault injected half-way ("switch=value")

    @property
    def world(self) -> World:
        return self.trajectory.world


Fault = tuple[str, object]  # a demo Faults switch and the value it takes half-way through a world


def _label(fault: Fault | None) -> str | None:
    return None if fault is None else f"{fault[0]}={fault[1]}"


def _series(w: World, keep: set[str], scrapes: int, fault: Fault | None) -> tuple[dict[str, list[float | None]],
                                                                                   Trajectory]:
    """Train ``w`` with a monitor (``fault`` switched on half-way); the scrape series of its run (target
    ``w.name``) and its measurements."""
    torch.set_num_threads(1)  # one training process per core
    instance = f"{w.name}:9887"
    timeline = Timeline(scrapes)
    c = w.config()
    config = MonitorConfig(run=w.name, port=None, guard="off", close_linger_s=0.0, **c.monitor_settings())
    cadence = w.cadence_s
    up = f'up{{instance="{instance}",job="{JOB}"}}'
    with GRPOMonitor(config=config) as mon:
        trainer = Trainer(c, mon)
        trajectory = Trajectory(w, trainer.warm_start())
        for step in range(w.steps):
            if fault is not None and step == w.steps // 2:
                setattr(trainer.faults, *fault)
            r = trainer.step(step)
            trajectory.pass_at_1.append(r.correct)
            trajectory.pass_at_group.append(r.pass_at_group)
            trajectory.grad_norms.append(r.peak_grad_norm)
            mon.wait_for_workers(timeout=LANE_WAIT_S)
            clock = step * cadence
            state = _exposed(mon, keep, clock, instance) | {up: 1.0}
            for i in range(math.ceil(clock / SCRAPE_S), min(scrapes, math.ceil((clock + cadence) / SCRAPE_S))):
                timeline.put(i, state)
        last_clock = (w.steps - 1) * cadence
    end = w.steps * cadence
    final = _exposed(mon, keep, last_clock, instance) | {up: 1.0}  # closed: grpo_run_finished 1, one scrape
    timeline.put(math.ceil(end / SCRAPE_S), final)
    for i in range(math.ceil(end / SCRAPE_S) + 1, scrapes):
        timeline.series[up][i] = 0.0
    print(f"trained {w.name}: {trajectory.kind}", file=sys.stderr, flush=True)
    return timeline.series, trajectory


def _scrapes(cadence: str, worlds: Iterable[World]) -> int:
    return int((max(w.steps for w in worlds) * CADENCES[cadence] + TAIL_S) // SCRAPE_S)


def _job(args: tuple[World, set[str], int, Fault | None]) -> tuple[dict[str, list[float | None]], Trajectory]:
    return _series(*args)


def _fired(mixin: MixinConfig, timeline: Timeline, folder: Path) -> dict[str, dict[str, int]]:
    """run -> alert -> separate firing episodes, read by promtool from Prometheus' own ALERTS series: the test
    expects none, and its failure lists what fired."""
    for file, text in rules_outputs(mixin).items():
        (folder / file).write_text(text)
    (folder / "replay-episodes.rules.yml").write_text(yaml.safe_dump(EPISODE_RULES, sort_keys=False))
    end = timeline.scrapes * SCRAPE_S
    doc = {
        "rule_files": [*sorted(rules_outputs(mixin)), "replay-episodes.rules.yml"],
        "evaluation_interval": f"{EVAL_S}s",
        "group_eval_order": ["grpo-recording", "grpo-alerts", "replay-episodes"],
        "tests": [{
            "name": "worlds",
            "interval": f"{SCRAPE_S}s",
            "input_series": [{"series": k, "values": _encode(v)} for k, v in sorted(timeline.series.items())],
            "promql_expr_test": [{
                "expr": f"sum by (alertname, run) (sum_over_time(replay:alert_starts[{end}s]))",
                "eval_time": f"{end}s",
                "exp_samples": [],
            }],
        }],
    }
    path = folder / "worlds.test.yml"
    path.write_text(yaml.safe_dump(doc, width=1 << 30, sort_keys=False))
    done = subprocess.run(["promtool", "test", "rules", path.name], cwd=folder, capture_output=True, text=True,
                          timeout=2400)
    text = done.stdout + done.stderr
    if done.returncode == 0:
        return {}
    got = re.search(r"got: (.*)", text)
    if got is None:
        raise RuntimeError(f"promtool failed without a result:\n{text[-3000:]}")
    fired: dict[str, dict[str, int]] = {}
    for alert, run, value in re.findall(r'\{alertname="([^"]+)", run="([^"]+)"\} ([0-9.eE+-]+)', got.group(1)):
        fired.setdefault(run, {})[alert] = round(float(value))
    return fired


def alert_labels(mixin: MixinConfig) -> dict[str, dict[str, str]]:
    """alert -> its labels (severity, layer)."""
    return {r["alert"]: r["labels"] for doc in rules_outputs(mixin).values()
            for g in yaml.safe_load(doc)["groups"] for r in g["rules"] if "alert" in r}


#: how a sweep hands a world's training to a pool: (the world's name, :func:`_job`'s argument) -> its future
Submit = Callable[[str, tuple[World, set[str], int, Fault | None]], Future]


def sweep(worlds: Sequence[World], faults: dict[str, Fault] | None = None, processes: int | None = None,
          folder: Path | None = None, submit: Submit | None = None, save: Path | None = None) -> list[Replayed]:
    """Train and replay ``worlds`` (``faults``: world name -> a demo Faults switch and the value it takes
    half-way), one promtool run per cadence and PROMTOOL_WORLDS worlds; returns each world with what fired.
    ``submit``: where each world trains (default: a pool of ``processes``, one per core); ``save``: a folder
    the trained batches are written to, so that :func:`rejudge` replays them through changed rules."""
    faults = faults or {}
    out: list[Replayed] = []
    with contextlib.ExitStack() as owned:
        if submit is None:
            pool = owned.enter_context(ProcessPoolExecutor(processes or min(len(worlds), os.cpu_count() or 1)))
            submit = lambda _, job: pool.submit(_job, job)  # noqa: E731
        for i, (mixin, scrapes, jobs) in enumerate(submit_sweep(worlds, faults, submit)):
            timeline = Timeline(scrapes)
            trajectories = []
            for job in jobs:
                series, trajectory = job.result()
                timeline.series.update(series)
                trajectories.append(trajectory)
            labels = [_label(faults.get(t.world.name)) for t in trajectories]
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                batch = (mixin.step_seconds, scrapes, timeline.series, trajectories, labels)
                (save / f"batch-{i:03d}.pickle").write_bytes(pickle.dumps(batch))
            out += _judged(mixin, timeline, trajectories, labels, folder)
    return sorted(out, key=lambda r: (r.world.index, r.world.name))


def _judged(mixin: MixinConfig, timeline: Timeline, trajectories: list[Trajectory], labels: list[str | None],
            folder: Path | None) -> list[Replayed]:
    with tempfile.TemporaryDirectory() as tmp:
        fired = _fired(mixin, timeline, Path(folder or tmp))
    return [Replayed(t, fired.get(t.world.name, {}), label) for t, label in zip(trajectories, labels, strict=True)]


def rejudge(saved: Path) -> list[Replayed]:
    """The batches a :func:`sweep` saved, judged again by the rules as they are now (the exporter's in-process
    judgements, such as the grad-norm spike, are those of the training run)."""
    out: list[Replayed] = []
    for path in sorted(saved.glob("batch-*.pickle")):
        step_seconds, scrapes, series, trajectories, labels = pickle.loads(path.read_bytes())
        timeline = Timeline(scrapes)
        timeline.series.update(series)
        out += _judged(MixinConfig(step_seconds=step_seconds), timeline, trajectories, labels, None)
    return sorted(out, key=lambda r: (r.world.index, r.world.name))


def submit_sweep(worlds: Sequence[World], faults: dict[str, Fault], submit: Submit
                 ) -> list[tuple[MixinConfig, int, list[Future]]]:
    """Every world's training handed to ``submit``, in promtool batches: (the cadence's rules, scrapes, jobs)."""
    batches = []
    by_cadence = {c: [w for w in worlds if w.cadence == c] for c in CADENCES}
    for cadence, group in by_cadence.items():
        mixin = MixinConfig(step_seconds=CADENCES[cadence])
        keep = rule_metric_names(mixin)
        for i in range(0, len(group), PROMTOOL_WORLDS):
            chunk = group[i : i + PROMTOOL_WORLDS]
            scrapes = _scrapes(cadence, chunk)
            batches.append((mixin, scrapes, [submit(w.name, (w, keep, scrapes, faults.get(w.name))) for w in chunk]))
    return batches


def pages(r: Replayed, labels: dict[str, dict[str, str]]) -> dict[str, int]:
    """The alerts that fired on ``r`` at warning or critical (not the info notice)."""
    return {a: n for a, n in r.fired.items() if labels[a]["severity"] != "info"}


def verdict(r: Replayed, labels: dict[str, dict[str, str]]) -> str | None:
    """Why ``r`` fails the sweep, or None: a healthy world pages nothing; a collapsing one pages layer 4 at
    most; one whose trainer measured a gradient explosion (``unstable``) pages the optimizer family at most; a
    degrading one (pass@1 fell: the run crashed at its own task) pages, at any layer; a notice fires once at
    most."""
    paged = pages(r, labels)
    notices = {a: n for a, n in r.fired.items() if a not in paged}
    if any(n > 1 for n in notices.values()):
        return f"a notice repeated: {notices}"
    if r.fault is not None:
        return None if paged else f"the control fault {r.fault} paged nothing"
    t = r.trajectory
    if t.kind == "degrading":
        return None if paged else "degrading (pass@1 fell), paged nothing"
    allowed = (("4-",) if t.kind == "collapsing" else ()) + (("1-optimizer",) if t.unstable else ())
    wrong = {a: n for a, n in paged.items() if not labels[a]["layer"].startswith(allowed or ("-",))}
    if wrong and not allowed:
        return f"healthy, paged {paged}"
    if wrong:
        where = " and ".join({"4-": "layer 4", "1-optimizer": "the optimizer family"}[a] for a in allowed)
        return f"{t.kind}{', unstable' if t.unstable else ''}, paged outside {where}: {wrong}"
    return None


def table(results: Sequence[Replayed], labels: dict[str, dict[str, str]]) -> str:
    """Markdown: one row per world (axes, the trainer's own pass@1 / pass@G early -> late, class, alerts)."""
    rows = ["| world | family | warm start | G | length | engine | cadence | pass@1 | pass@G | class | fired |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        w, t = r.world, r.trajectory
        (p1e, pge), (p1l, pgl) = t.early, t.late
        fired = ", ".join(f"{a}" + (f" x{n}" if n > 1 else "") for a, n in sorted(r.fired.items())) or "-"
        kind = (t.kind + (", unstable" if t.unstable else "")) if r.fault is None else f"fault: {r.fault}"
        engine = w.precision + (f" (trainer {w.trainer}" + (f", old log-probs {w.old_logprob_rows} row a pass"
                                                             if w.old_logprob_rows else "") + ")"
                                if w.trainer != "fp32" or w.old_logprob_rows else "")
        rows.append(f"| {w.index} | {w.family} | {w.warm} ({t.warm_accuracy:.2f}) | {w.group_size} | {w.length} | "
                    f"{engine} | {w.cadence} | {p1e:.2f} → {p1l:.2f} | {pge:.2f} → {pgl:.2f} | {kind} | "
                    f"{fired} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, default=200, help="worlds 0..N-1 (default 200)")
    parser.add_argument("--processes", type=int, default=None, help="training processes (default: one per core)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--only", type=str, default=None, help="comma-separated world indices instead of 0..N-1 "
                        f"(from {COLLAPSE_INDEX}: the conflict family's worlds)")
    parser.add_argument("--conflict", type=int, default=0, help="also the conflict family's worlds 0..N-1 "
                        f"(indices {COLLAPSE_INDEX}..: a family that drifts to collapse)")
    parser.add_argument("--save", type=Path, default=None, help="also write the trained batches to this folder")
    parser.add_argument("--rejudge", type=Path, default=None, help="train nothing: judge the batches a --save "
                        "wrote by the rules as they are now")
    args = parser.parse_args(argv)
    indices = [int(i) for i in args.only.split(",")] if args.only else list(range(args.worlds))
    indices += [COLLAPSE_INDEX + i for i in range(args.conflict)]
    worlds = [collapse_world(i - COLLAPSE_INDEX) if i >= COLLAPSE_INDEX else world(i) for i in indices]
    results = (rejudge(args.rejudge) if args.rejudge is not None
               else sweep(worlds, processes=args.processes, save=args.save))
    labels = alert_labels(MixinConfig())
    failures = [(r, v) for r in results if (v := verdict(r, labels)) is not None]
    classes = {k: sum(r.trajectory.kind == k for r in results) for k in ("healthy", "collapsing", "degrading")}
    unstable = sum(r.trajectory.unstable for r in results)
    summary = (f"{len(results)} worlds: {classes['healthy']} healthy, {classes['collapsing']} collapsing, "
               f"{classes['degrading']} degrading "
               f"({unstable} of them unstable: a gradient explosion the trainer measured); "
               f"{len(failures)} failing the verdict")
    text = table(results, labels)
    print(text)
    print(summary)
    for r, v in failures:
        print(f"FAIL {r.world.name}: {v}")
    if args.out is not None:
        only = f" --only {args.only}" if args.only else ""
        conflict = f" --conflict {args.conflict}" if args.conflict else ""
        command = f".venv/bin/python tests/worlds.py --worlds {args.worlds}{only}{conflict} --out {args.out}"
        spans = [f"worlds {args.only}" if args.only else f"worlds 0-{args.worlds - 1}" if args.worlds else "",
                 f"conflict worlds 0-{args.conflict - 1}" if args.conflict else ""]
        span = " and ".join(s for s in spans if s)
        head = (f"# The world sweep, {span}\n\nMade by `{command}` (docs/worlds.md says what "
                "the axes, classes and verdict are). pass@1 and pass@G are the trainer's own, over the first and "
                "the last fifth of the steps; fired: every alert that fired, with its episodes.\n\n")
        failing = "".join(f"- {r.world.name}: {v}\n" for r, v in failures)
        args.out.write_text(head + f"**{summary}.**\n\n" + (failing + "\n" if failing else "") + text + "\n")
    return 1 if failures else 0


__all__ = ["Replayed", "alert_labels", "pages", "rejudge", "submit_sweep", "sweep", "table", "verdict", "world"]

if __name__ == "__main__":
    raise SystemExit(main())
