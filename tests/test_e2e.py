"""End to end through the real stack: every demo scenario trains for real on the CPU, scraped by one real
Prometheus with the time-scaled generated rules, paging through one real Alertmanager into the demo's
receiver; each run has its own ``run`` label and exporter port.

* every fault pages its expected alert, with its layer, within PAGE_WITHIN_S of injection (or within the
  PAGE_WITHIN_STEPS steps the demo's pace makes in that time, on a machine that trains slower), and nothing
  pages for a run before its fault is injected;
* while a layer-1 alert fires for a run, no page of layers 2-4 for that run is delivered (the inhibition),
  also for runs where a layer-1 fault is injected together with a layer-3 or a layer-2 fault whose alert does
  fire in Prometheus behind the layer-1 one;
* the healthy scenarios, on the permutation task (many right answers), on the reverse task (one right
  answer that the policy learns: convergence, mostly all-correct groups), three seeds each, and on the
  multi-turn permutation task (a tool's reply inside each completion, off the loss mask), two seeds, and with a
  mixture-of-experts policy (its bf16 engine routes some tokens differently, a steady level), two seeds, for
  HEALTHY_STEPS steps, deliver no page at all (nothing even fires in Prometheus), and no exporter is ever seen
  down.

Runs go through a pool of CONCURRENT trainers (one process: the tiny steps are bound by the GIL, ~12 steps/s
for one trainer alone), longest first; a run that has trained hands its end (close, the target kept visible,
retired) to a thread beside the trainers, so its slot trains the next run at once; the whole module takes ~7 min
on 2 cores.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.demo.scenarios import SCENARIOS, STEPS_PER_SECOND, Scenario
from grpo_exporter.demo.stack import Page, Stack
from grpo_exporter.demo.task import FIRST_SYMBOL, decode
from grpo_exporter.demo.trainer import DemoConfig, Trainer, warm_snapshot
from grpo_exporter.mixin.config import RUNBOOKS
from grpo_exporter.recorder.reading_doc import for_page
from grpo_exporter.recorder.reading_source import load, page_of
from services import prometheus_query

HEALTHY_SEEDS = {"healthy": (0, 1, 2), "healthy-reverse": (0, 1, 2), "healthy-tool": (0, 1), "healthy-moe": (0, 1)}
# the permutation task (many right answers) and the reverse task (one right answer, learned: groups converge
# to identical correct completions, mostly all-correct): three seeds each, no alert may fire
HEALTHY_STEPS = {"healthy": 150, "healthy-reverse": 300, "healthy-tool": 150, "healthy-moe": 150}
PAGE_WITHIN_S = 60.0  # after injection, for every fault (50 min at production time scale)
# or within the steps the demo's pace makes in that time, when the machine trains slower than the pace (a
# slow disease such as the entropy collapse develops over steps, not seconds)
PAGE_WITHIN_STEPS = int(PAGE_WITHIN_S * STEPS_PER_SECOND)
QUIET_AFTER_S = 8.0  # training goes on after the page: an inhibited page would have arrived by then
# One process trains ~12 steps/s alone (a step holds the GIL ~83 ms here) and serves the scrapes (one a second
# per exporter, ~4 ms each). GRPOStepCadenceSlowerThanConfigured (info) fires below half the 2 steps/s pace
# over 72 s: five at once asked 10 steps/s, ran each at ~1.2 here and below 1.0 on CI (two healthy runs paged
# it); three ask 6 steps/s (~60% of the GIL, the same throughput as five that cannot keep up) and keep the pace
CONCURRENT = 3
DOWNSTREAM = ("2-reward", "3-samples", "4-diversity", "1-optimizer")
# a layer-1 fault injected together with a downstream one, in one run: (gate, downstream scenario) -> the gate's
# alert, the downstream alert that fires in Prometheus and must reach nobody, its layer, seconds to train on
COMBOS = {
    ("mask-bug", "stale-rollouts"): ("GRPOLossMaskMismatch", "GRPORolloutsStale", "3-samples", 35.0),
    ("exp-before-clamp", "advantage-bug"): ("GRPONonFiniteValues", "GRPOAdvantageAboveBound", "2-reward", 20.0),
}


@dataclass
class Run:
    scenario: str  # the scenario whose expected alert the run waits for
    seed: int
    also: tuple[str, ...] = ()  # more scenarios injected at the same step
    train_after_s: float = 0.0  # train at least this long after injection
    injected_at: float | None = None
    ended_at: float | None = None
    steps: int = 0
    step_ends: list[float] = field(default_factory=list)  # monotonic time at the end of each step
    error: BaseException | None = None
    reading: dict | None = None  # the rollouts the expected page linked, fetched from that link while it served
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = "e2e-" + "+".join((self.scenario, *self.also)) + f"-{self.seed}"


# a closed run's target stays configured (up = 0) this long: longer than the demo's GRPOExporterDown `for` (10 s)
END_VISIBLE_S = 13.0


def _monitor(run: Run) -> GRPOMonitor:
    cfg = SCENARIOS[run.scenario].config(run.seed)
    return GRPOMonitor(run=run.label, port=0, guard="off", edit_distance_groups=0, close_linger_s=10.0,
                       decode=decode, **cfg.monitor_settings())


def _end(run: Run, mon: GRPOMonitor, stack: Stack) -> None:
    """A normal end: close() marks the run finished and waits for Prometheus to scrape that; the target then
    stays configured (up = 0) for a while: nothing may page (GRPOExporterDown, GRPOTrainingStalled). Run beside
    the trainers (it waits, it does not train), so a trainer's slot goes to the next run at once."""
    try:
        port = mon.port or 0
        mon.close()
        time.sleep(END_VISIBLE_S)
        stack.retire_target(port)
    except BaseException as exc:  # reported by the test, with the run
        run.error = exc


def _train(run: Run, mon: GRPOMonitor, stack: Stack, warm: dict[str, object], ends: ThreadPoolExecutor) -> None:
    scenario = SCENARIOS[run.scenario]
    expected = scenario.expected_alerts[0] if scenario.expected_alerts else None
    try:
        trainer = Trainer(scenario.config(run.seed), mon)
        trainer.restore(warm)
        quiet_until = None
        while True:
            start = time.monotonic()
            if expected is None and run.steps == HEALTHY_STEPS[run.scenario]:
                break
            if expected is not None and run.steps == scenario.inject_at:
                for name in (run.scenario, *run.also):
                    SCENARIOS[name].inject(trainer)
                run.injected_at = time.monotonic()
            trainer.step(run.steps)
            run.steps += 1
            run.step_ends.append(time.monotonic())
            if run.injected_at is not None:
                now = time.monotonic()
                page = next((p for p in stack.pages if p.run == run.label and p.alert == expected), None)
                if quiet_until is None and page is not None:
                    quiet_until = max(now + QUIET_AFTER_S, run.injected_at + run.train_after_s)
                    run.reading = _read(page)
                given_up = (now - run.injected_at > PAGE_WITHIN_S + 5
                            and run.steps - scenario.inject_at > PAGE_WITHIN_STEPS + 10)
                if (quiet_until is not None and now > quiet_until) or given_up:
                    break
            time.sleep(max(0.0, 1 / STEPS_PER_SECOND - (time.monotonic() - start)))
        run.ended_at = time.monotonic()
        ends.submit(_end, run, mon, stack)
    except BaseException as exc:  # reported by the test, with the run
        run.error = exc


def _read(page: Page) -> dict | None:
    """The rollouts a page links, as ``grpo-exporter read`` fetches them (None: the page has no link)."""
    if not page.reading:
        return None
    return for_page(load(page.reading), *page_of(page.reading))


def _warm(config: DemoConfig) -> dict[str, object]:
    torch.set_num_threads(1)
    return warm_snapshot(config)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[list[Run], list[Page], set[tuple[str, str, str]], set[str]]:
    torch.set_num_threads(1)
    runs = [Run(name, seed) for name in HEALTHY_STEPS for seed in HEALTHY_SEEDS[name]]
    faults = sorted((s for s in SCENARIOS.values() if s.expected_alerts), key=lambda s: -s.inject_at)
    runs += [Run(s.name, s.seed) for s in faults]
    for (gate, downstream), (_, _, _, after_s) in COMBOS.items():
        runs.append(Run(gate, SCENARIOS[gate].seed, also=(downstream,), train_after_s=after_s))
    # a warm start is deterministic per task (its kind and tool call), model (dense or MoE) and seed: shared by its
    # runs, made two at a time
    starts = sorted({(*_start(SCENARIOS[r.scenario]), r.seed) for r in runs})
    configs = [next(s for s in SCENARIOS.values() if _start(s) == tuple(start[:-1])).config(start[-1])
               for start in starts]
    with ProcessPoolExecutor(2) as pool:
        warm = dict(zip(starts, pool.map(_warm, configs), strict=True))
    with contextlib.ExitStack() as exits:
        # every exporter is up, and scraped, from the start (a run waiting for its turn publishes only its
        # info), so "up" is never absent while runs come and go
        monitors = [exits.enter_context(_monitor(run)) for run in runs]
        stack = exits.enter_context(Stack(workdir=tmp_path_factory.mktemp("stack"),
                                          targets=tuple(mon.port or 0 for mon in monitors)))
        began = time.monotonic()
        with ThreadPoolExecutor(len(runs)) as ends, ThreadPoolExecutor(CONCURRENT) as pool:
            for run, mon in zip(runs, monitors, strict=True):
                s = SCENARIOS[run.scenario]
                pool.submit(_train, run, mon, stack, warm[(*_start(s), run.seed)], ends)
        pages = stack.pages
        fired = _fired_in_prometheus(stack.prometheus_url)
        liveness = {f[1] for f in fired if f[1] in ("GRPOExporterDown", "GRPOTrainingStalled")}
        print(f"\nthe fleet trained {sum(r.steps for r in runs)} steps in {time.monotonic() - began:.0f} s")
    for run in runs:  # the measured latencies (pytest -s): the numbers behind PAGE_WITHIN_S
        expected = SCENARIOS[run.scenario].expected_alerts
        hit = next((p for p in pages if p.run == run.label and expected and p.alert == expected[0]), None)
        latency = "-"
        if hit and run.injected_at:
            steps = sum(t <= hit.received_at for t in run.step_ends) - SCENARIOS[run.scenario].inject_at
            latency = f"{hit.received_at - run.injected_at:5.1f} s, {steps:3d} steps"
        print(f"{run.label:32} steps {run.steps:4d}  {_pace(run)}  page after injection {latency}")
    failed = [(r.label, r.error) for r in runs if r.error is not None]
    assert not failed, failed
    return runs, pages, fired, liveness


def _start(s: Scenario) -> tuple[str, int, int]:
    """What decides a scenario's warm start besides its seed: the task, its tool call, the experts per layer."""
    return s.task, s.tool_at, s.experts


def _pace(run: Run) -> str:
    """The run's slowest pace over any 72 s (the demo's 1 h window), against the STEPS_PER_SECOND it aims at:
    GRPOStepCadenceSlowerThanConfigured fires below half of it."""
    ends = run.step_ends
    window = min(72.0, ends[-1] - ends[0]) if len(ends) > 1 else 0.0
    rates = [sum(1 for t in ends[i:] if t <= ends[i] + window) / window for i in range(len(ends))
             if window > 0 and ends[i] + window <= ends[-1]]
    pause = max((b - a for a, b in itertools.pairwise(ends)), default=float("nan"))
    return (f"slowest {min(rates, default=float('nan')):.2f} of {STEPS_PER_SECOND:g} steps/s, "
            f"longest step {pause:.1f} s")


def _fired_in_prometheus(url: str) -> set[tuple[str, str, str]]:
    """(run, alert, layer) of every alert that fired in Prometheus during the suite, delivered or not."""
    answer = prometheus_query(url, 'max by (run, alertname, layer) (max_over_time(ALERTS{alertstate="firing"}[30m]))')
    assert answer["status"] == "success", answer
    return {(m["metric"].get("run", ""), m["metric"]["alertname"], m["metric"]["layer"])
            for m in answer["data"]["result"]}


NOTICE = "GRPOEngineLogprobGapCleanLevelHigh"  # info: the run's clean bf16 gap sits above the seed's line


def _firing(pages: list[Page], run: Run) -> list[Page]:
    """The run's firing pages; a notice (info, the run's setup stated once) is no page."""
    return [p for p in pages if p.run == run.label and p.status == "firing" and p.severity != "info"]


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.expected_alerts])
def test_fault_pages_its_alert_and_layer(fleet, name):
    runs, pages, _, _ = fleet
    run = next(r for r in runs if r.scenario == name and not r.also)
    scenario = SCENARIOS[name]
    assert run.injected_at is not None, run
    mine = _firing(pages, run)
    assert [p for p in mine if p.received_at < run.injected_at] == [], ("paged before the fault", _pace(run))
    hits = [p for p in mine if p.alert == scenario.expected_alerts[0]]
    assert hits, (name, [(p.alert, p.layer) for p in mine])
    page = hits[0]
    assert page.layer == scenario.layer
    assert page.receiver == ("pager" if page.severity == "critical" else "default"), page
    assert page.runbook == f"{RUNBOOKS}#{page.alert.lower()}"
    assert page.reading.startswith("http://127.0.0.1:")
    assert f"/reading?alert={page.alert}&" in page.reading
    assert f"FIRING {page.alert} layer={page.layer}" in page.line()
    late_s = page.received_at - run.injected_at
    late_steps = sum(t <= page.received_at for t in run.step_ends) - scenario.inject_at
    assert late_s < PAGE_WITHIN_S or late_steps <= PAGE_WITHIN_STEPS, (late_s, late_steps)
    if scenario.layer == "1-gradient" and page.severity == "critical":
        downstream = [(p.alert, p.layer) for p in mine if p.layer in DOWNSTREAM]
        assert downstream == [], "a layer-1 gate fired: its run's layer 2-4 and optimizer pages must be inhibited"


def _rows(run: Run, kind: str) -> list[dict]:
    """The rows of ``kind`` in the newest window of the reading set the run's page linked."""
    assert run.reading is not None, "the page linked no reading set"
    return run.reading["windows"][0]["rows"][kind]


def _run(fleet, name: str) -> Run:
    return next(r for r in fleet[0] if r.scenario == name and not r.also)


def test_the_reward_hack_page_brings_the_hacked_answers(fleet):
    """The reading set a GRPORewardHackSuspected page links (seed: 人工阅读 reward 最高和增长最快的样本, read the
    highest-reward and fastest-rising samples by hand): its top rows are the hack, well-formed answers opening
    with the paid symbol, paid by the format component (2x a correct answer) while the verifier says wrong."""
    run = _run(fleet, "reward-hack")
    paid = chr(ord("a"))  # the demo's decode writes FIRST_SYMBOL as "a"
    assert FIRST_SYMBOL == 4
    for kind in ("highest_reward", "rising_component"):
        rows = _rows(run, kind)
        hacked = [r for r in rows if r["reward_components"] == {"correctness": 0.0, "format": 1.0}
                  and r["reward"] >= 2.0 and r["completion"].startswith(paid) and r["completion"].endswith("<eos>")]
        assert rows, kind
        assert len(hacked) >= len(rows) / 2, (kind, rows)
    assert "truncated" not in run.reading["windows"][0]["rows"]  # only what this page needs


def test_the_truncation_page_brings_answers_cut_short(fleet):
    """The reading set a GRPOTruncationSurge page links: truncated completions, cut at the new maximum length (3
    tokens) before their end-of-sequence, beside a control of the same window."""
    run = _run(fleet, "truncation")
    rows = _rows(run, "truncated")
    assert rows
    assert all(r["truncated"] and r["length"] == 3 and "<eos>" not in r["completion"] and len(r["completion"]) == 3
               for r in rows), rows
    assert _rows(run, "control")


def test_the_collapse_page_brings_groups_of_identical_answers(fleet):
    """The reading set a GRPOEntropyCollapse page links: groups whose completions became one completion, copied
    across the group, and the groups of lowest entropy."""
    run = _run(fleet, "entropy-collapse")
    group = SCENARIOS["entropy-collapse"].config(run.seed).group_size
    repeated = _rows(run, "repeated_groups")
    assert repeated
    assert repeated[0]["copies"] >= group / 2, repeated
    assert all(r["completion"].endswith("<eos>") for r in repeated)
    low = _rows(run, "lowest_entropy_groups")
    assert low
    assert low[0]["group_entropy_nats"] < 0.1, low


@pytest.mark.parametrize(("gate", "downstream"), list(COMBOS))
def test_layer_one_mutes_a_downstream_alert_that_fires(fleet, gate, downstream):
    runs, pages, fired, _ = fleet
    run = next(r for r in runs if r.scenario == gate and r.also == (downstream,))
    gate_alert, downstream_alert, downstream_layer, _ = COMBOS[gate, downstream]
    mine = _firing(pages, run)
    assert (gate_alert, "1-gradient") in [(p.alert, p.layer) for p in mine]
    assert (run.label, downstream_alert, downstream_layer) in fired, "the downstream alert fired in Prometheus"
    leaked = [(p.alert, p.layer, round(p.received_at - (run.ended_at or 0), 1)) for p in mine if p.layer in DOWNSTREAM]
    assert leaked == [], "and reached nobody (seconds after the run's end shown)"


@pytest.mark.parametrize(("task", "seed"), [(task, seed) for task in HEALTHY_STEPS for seed in HEALTHY_SEEDS[task]])
def test_healthy_run_delivers_no_page(fleet, task, seed):
    runs, pages, fired, _ = fleet
    run = next(r for r in runs if r.scenario == task and r.seed == seed)
    assert run.steps == HEALTHY_STEPS[task]
    mine = [(p.alert, p.status, p.severity, p.receiver) for p in pages if p.run == run.label]
    assert [m for m in mine if m[0] != NOTICE] == [], ("a healthy bf16 run pages nothing", _pace(run))
    assert [f for f in fired if f[0] == run.label and f[1] != NOTICE] == [], "nothing even fired in Prometheus"
    # the bf16 engine's clean gap: ~0.015 nats on the permutation task (the notice, said once), ~0.005 on reverse
    notices = [m for m in mine if m[:2] == (NOTICE, "firing")]
    assert notices in ([], [(NOTICE, "firing", "info", "default")])
    if task == "healthy":
        assert notices, "the permutation task's bf16 gap sits above the seed's line: one notice"


def test_every_page_belongs_to_a_run_and_no_normal_end_pages(fleet):
    """Every run ends with close() while its target stays configured (up = 0) longer than GRPOExporterDown's
    `for`: neither it nor GRPOTrainingStalled may fire (before, a down target always paged)."""
    runs, pages, _, liveness = fleet
    labels = {r.label for r in runs}
    assert [p.line() for p in pages if p.run not in labels] == []
    # a stall page names the runs' own pace: a trainer that stopped stepping, or a Prometheus that saw no step
    assert liveness == set(), {r.label: _pace(r) for r in runs if any(p.run == r.label for p in pages)}
