"""The production rules at production cadence: a real exporter replayed through promtool at steps of 20 s,
2 min and 10 min with 30 s scrapes and the rules evaluated every minute (tests/replay.py), the rules generated for
that cadence (``step_seconds``).

Every scenario asserts the exact set of alerts that fired over the whole replay, each in exactly one
episode (no flapping), each first firing no earlier than its ``for`` after the fault's onset and within a
bound after it. Healthy runs, a normal end, the gap between two runs and one noisy batch must page nothing.
At 2 min and 10 min steps a fleet of runs, one fault each, makes every alert fire for its run
(rules/tests/*.test.yml checks every alert just before and after its `for` at 1-minute steps).

The replays the selected tests read start when collection ends, in the suite's background lane
(tests/batch_lane.py), two at a time; these tests run last and read them (the ``outcomes`` fixture). The
scenarios of one cadence are replayed side by side, CASES_PER_REPLAY to a promtool run, each on its own runs and
targets (the rules are per run; promtool's cost is mostly evaluations x rules); each test asserts the
expectations of its own scenario, read from its own runs.
"""

from __future__ import annotations

import subprocess
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import batch_lane
from grpo_exporter.mixin.config import MixinConfig
from replay import (
    SCRAPE_S,
    Expect,
    Knobs,
    Scenario,
    Segment,
    Timeline,
    after,
    case_run,
    failed_cases,
    healthy,
    promtool_cases,
    promtool_test,
    replay,
)

CADENCES = {"20s": 20.0, "2min": 120.0, "10min": 600.0}
# a fault's alert must first fire within an hour plus this many typical steps of its onset (at least 2 h)
LATENCY_STEPS = 16


@dataclass(frozen=True)
class Case:
    segments: tuple[Segment, ...]
    hours: float
    expect: tuple[tuple[str, float] | tuple[str, float, float], ...] = ()  # (alert, onset h[, within h])


def near_clip(step: int, hours: float) -> Knobs:
    """Healthy, with pre-clip norms near max_grad_norm: ~30% of steps clipped, never 'every step'."""
    return replace(healthy(step, hours), grad_norm=4.5)


def clean_engine(step: int, hours: float) -> Knobs:
    """Healthy, with an engine that matches the trainer to float32 rounding (a gap of ~1e-7)."""
    return replace(near_clip(step, hours), engine_gap=1e-7)


def bf16(step: int, hours: float) -> Knobs:
    """Healthy, with a bf16 rollout engine: its gap is noise at the level of real bf16 stacks (mean ~0.016
    nats, heavy-tailed, TRL #5312 / #6789), above the seed's 0.01 line."""
    return replace(near_clip(step, hours), bf16_engine=True)


def fp8(step: int, hours: float) -> Knobs:
    """Healthy, with an FP8 (W8A8) rollout engine: noisier than bf16 (mean |gap| ~0.05 nats, k3 ~0.004, NeMo-RL's
    healthy FP8 gen-KL 0.0014-0.0050), as FP8 rollouts of large MoE models run."""
    return replace(near_clip(step, hours), fp8_engine=True)


def from_start(**fault: object) -> Scenario:
    """A bf16 run with ``fault`` on its engine from the first step."""
    return lambda step, hours: replace(bf16(step, hours), **fault)


def entropy_decline(step: int, hours: float) -> Knobs:
    """From hour 3, over 8 h: entropy falls 1.0 -> 0.25 and the groups, one by one, come to repeat one answer
    (distinct completions 8 -> 3 of 8): pass@1 holds at 0.5, pass@G falls linearly towards it (0.91 -> 0.5),
    half of it by hour 7."""
    fall = min(1.0, max(0.0, (hours - 3) / 8))
    return Knobs(solve=0.5, entropy=1.0 - 0.75 * fall, same_answer=fall, distinct=1.0 - 0.6 * fall)


def slow_collapse(shape: str) -> Scenario:
    """A collapse over 8 h from hour 4: a share of the groups that grows to 0.8 repeat one answer (pass@G falls
    by about a third), entropy falls 1.0 -> 0.4 and the distinct share with it, while pass@1 rises 0.45 -> 0.55
    (the reward keeps rising). ``shape``: how the fall goes, ``linear``, ``early`` (fast first: half of it by
    6.3 h) or ``late`` (fast last: half by 9.7 h)."""
    def fall(hours: float) -> float:
        x = min(1.0, max(0.0, (hours - 4) / 8))
        return {"linear": x, "early": 1 - (1 - x) ** 2, "late": x * x}[shape]

    return lambda step, hours: Knobs(solve=0.45 + 0.1 * min(1.0, hours / 12), entropy=1.0 - 0.6 * fall(hours),
                                     same_answer=0.8 * fall(hours), distinct=1.0 - 0.6 * fall(hours), grad_norm=4.5)


def unsolved_narrow(step: int, hours: float) -> Knobs:
    """A healthy run whose unsolved prompts narrow onto one wrong answer: from hour 4, over 8 h, entropy falls
    1.0 -> 0.4 and the distinct share with it, and every group that solves nothing comes to repeat one wrong
    completion, while pass@1 rises 0.45 -> 0.55 as in :func:`slow_collapse` and no prompt loses its solution
    (pass@G holds)."""
    x = min(1.0, max(0.0, (hours - 4) / 8))
    return Knobs(solve=0.45 + 0.1 * min(1.0, hours / 12), entropy=1.0 - 0.6 * x, distinct=1.0 - 0.6 * x,
                 wrong_repeat=x, grad_norm=4.5)


def learning(step: int, hours: float) -> Knobs:
    """A healthy run that learns for 12 h: pass@1 0.3 -> 0.8, entropy 1.0 -> 0.5, no group repeats an answer."""
    x = min(1.0, hours / 12)
    return Knobs(solve=0.3 + 0.5 * x, entropy=1.0 - 0.5 * x, grad_norm=4.5)


def one_step(at_hours: float, cadence_s: float, **fault: object) -> Scenario:
    """``fault`` on exactly one step: the first at or after ``at_hours``."""
    target = round(at_hours * 3600 / cadence_s)
    return lambda step, hours: replace(near_clip(step, hours), **fault) if step == target else near_clip(step, hours)


def phase_hours(cadence_s: float) -> float:
    """Hours per phase of a scenario (a fault starts at 5 phases). At 10-min steps the run's anchors (20 steps)
    and a baseline (20 steps, 100 min back) need ~5 h; at 2 min they need ~1.5 h and at 20 s the rules sit on
    their floors (1 h baselines) after ~200 steps: shorter phases replay the same story in fewer steps."""
    return 0.4 if cadence_s < 60 else 0.5 if cadence_s < 300 else 1.0


def cases(cadence_s: float) -> dict[str, Case]:
    """The scenarios at one cadence."""
    u = phase_hours(cadence_s)
    steps = cadence_s / 3600  # hours per step
    notice = ("GRPOEngineLogprobGapCleanLevelHigh", 0.0, 25 * steps + 0.2)  # after the 20 rollouts of the clean gap
    short = max(1.0, 32 * steps)
    decline_onset = 3 + 8 * (2 / 3)  # entropy crosses 0.5x its early window (1.0) at 0.5
    found = {
        "healthy-end-gap-next-run": Case(
            (Segment("a", near_clip, 5 * u), Segment("b", healthy, 4 * u, start_s=7 * u * 3600, seed=1)), 12 * u),
        "noisy-batch": Case((Segment("a", one_step(5 * u, cadence_s, verifier_zero=True), 9 * u),), 10 * u),
        # repeating one answer also empties the groups of reward variance: layer 3 sees it too, each once
        # the seed's collapse pages in its first half (GRPOPolicyCollapseOnset), entropy's own alarm later
        "slow-entropy-collapse": Case((Segment("a", entropy_decline, 15.0),), 16.0,
                                      (("GRPOPolicyCollapseOnset", 3.0, 4.0),
                                       ("GRPODiversityCollapse", 3.0, 12.0),
                                       ("GRPOEntropyCollapse", decline_onset),
                                       ("GRPOZeroVarianceAbovePrediction", 3.0, 11.0),
                                       ("GRPOFewGroupsCarrySignal", 3.0, 11.0))),
        # a spike beyond anything healthy (extreme: 1000 against a median of 4.5) pages at once; a lone 22x one,
        # sudden but moving nothing else (a heavy-tailed healthy loop's), is recorded and pages nothing
        "one-step-grad-spike": Case((Segment("a", one_step(5 * u, cadence_s, grad_norm=1000.0), 8 * u),), 9 * u,
                                    (("GRPOGradNormSpike", 5 * u),)),
        "lone-grad-spike": Case((Segment("a", one_step(5 * u, cadence_s, grad_norm=100.0), 8 * u),), 9 * u),
        "clip-storm": Case((Segment("a", after(5 * u, near_clip, clip_share=1.0), 8 * u),), 9 * u,
                           (("GRPOClipFractionHigh", 5 * u),)),
        "stale-rollouts": Case((Segment("a", after(5 * u, near_clip, staleness=6), 8 * u),), 9 * u,
                               (("GRPORolloutsStale", 5 * u),)),
        # layer 1 below the fixed lines: another probability path, measured against the run's own noise
        "engine-gap-1000x": Case((Segment("a", after(5 * u, clean_engine, engine_gap=1e-4), 8 * u),), 9 * u,
                                 (("GRPOEngineLogprobGapWarning", 5 * u),)),
        "onpolicy-ratio-drift": Case((Segment("a", after(5 * u, near_clip, onpolicy_noise=0.01), 8 * u),), 9 * u,
                                     (("GRPOOnPolicyRatioDrift", 5 * u),)),
        # the engines people run: bf16 noise above the seed's line pages nothing (one notice); real engine faults
        # page layer-1 critical within 10 steps, from the start or of the jump
        # (a day at 20 s steps is 4320 steps: there the healthy bf16 run is the phases' length, see _params)
        "bf16-healthy-24h": Case((Segment("a", bf16, 23.5),), 24.0, (notice,)),
        "bf16-stale-weights": Case((Segment("a", after(5 * u, bf16, engine_logit_sd=1.0), 8 * u),), 9 * u,
                                   (notice, ("GRPOEngineLogprobGapCritical", 5 * u, 10 * steps),
                                    ("GRPOEngineLogprobGapWarning", 5 * u, 12 * steps + 0.2))),
        # an FP8 engine's noisier level pages nothing either; stale weights behind it still page
        "fp8-healthy": Case((Segment("a", fp8, 9 * u),), 10 * u, (notice,)),
        "fp8-stale-weights": Case((Segment("a", after(5 * u, fp8, engine_logit_sd=1.0), 8 * u),), 9 * u,
                                  (notice, ("GRPOEngineLogprobGapCritical", 5 * u, 10 * steps),
                                   ("GRPOEngineLogprobGapWarning", 5 * u, 12 * steps + 0.2))),
        # a fault from the first step needs only the notice's 20 rollouts and the critical's 10 steps
        "top-p-from-start": Case((Segment("a", from_start(engine_shift=0.111), short),), short + 0.2,
                                 (notice, ("GRPOEngineLogprobGapCritical", 0.0, 10 * steps))),
        "temperature-from-start": Case((Segment("a", from_start(engine_temperature=0.5), short),), short + 0.2,
                                       (notice, ("GRPOEngineLogprobGapCritical", 0.0, 10 * steps))),
        "process-dies": Case((Segment("a", near_clip, 5 * u, closed=False),), 7 * u,
                             (("GRPOTrainingStalled", 5 * u), ("GRPOExporterDown", 5 * u))),
    }
    if cadence_s >= 120:
        # a slow collapse over 8 h from hour 4 with fewer groups a step than the collapse window needs: the trend
        # and long windows hold them. At 2-min steps, 8 groups a step page the linear fall by 9 h (6.6-7.9 h over
        # 3 random draws: half-way at 8 h), 4 groups at G = 16 the early-fast fall by 8 h (half of its fall is at
        # 6.3 h); a run that learns for 20 h with 4 groups a step at G = 16 (pass@G near 1) pages nothing
        # (docs/runbooks.md#grpopolicycollapseonset has the table, 10-min steps included)
        found["slow-collapse-learning-4-groups"] = Case(
            (Segment("a", learning, 19.5, prompts=4, group_size=16),), 20.0)
        if cadence_s >= 300:
            # at 10-min steps the groups that repeat one wrong completion page the first half: 8 groups a step the
            # linear fall by 8 h, 16 the fast-last one by its half-way (9.7 h); unsolved prompts that narrow onto
            # one wrong answer while pass@G holds page nothing for 20 h
            found["slow-collapse-linear-8-groups"] = Case(
                (Segment("a", slow_collapse("linear"), 9.5, prompts=8),), 10.0,
                (("GRPOPolicyCollapseOnset", 4.0, 4.0),))
            found["slow-collapse-late-16-groups"] = Case(
                (Segment("a", slow_collapse("late"), 10.0),), 10.5,
                (("GRPOPolicyCollapseOnset", 4.0, 5.7),))
            found["unsolved-prompts-narrow-8-groups"] = Case(
                (Segment("a", unsolved_narrow, 19.5, prompts=8),), 20.0)
        else:
            found["slow-collapse-linear-8-groups"] = Case(
                (Segment("a", slow_collapse("linear"), 9.5, prompts=8),), 10.0,
                (("GRPOPolicyCollapseOnset", 4.0, 5.0), ("GRPODiversityCollapse", 4.0, 6.0)))
            found["slow-collapse-early-4-groups"] = Case(
                (Segment("a", slow_collapse("early"), 8.5, prompts=4, group_size=16),), 9.0,
                (("GRPOPolicyCollapseOnset", 4.0, 4.0), ("GRPODiversityCollapse", 4.0, 5.0)))
    if cadence_s < 60:
        found["bf16-healthy"] = Case((Segment("a", bf16, 9 * u),), 10 * u, (notice,))
        # the slow collapse's first half at 20 s steps (its whole 16 h would be 2880 steps of replay)
        found["slow-entropy-collapse-first-half"] = Case(
            (Segment("a", entropy_decline, 7.5),), 8.0,
            (("GRPOPolicyCollapseOnset", 3.0, 4.0), ("GRPODiversityCollapse", 3.0, 5.0),
             ("GRPOZeroVarianceAbovePrediction", 3.0, 5.0)))
    return found


def a_day_at_ten_minutes(step: int, hours: float) -> Knobs:
    """One run of 24 h at 10-minute steps with every fault of the replay acceptance in turn: a one-step grad
    spike beyond anything healthy at 4 h (a lone 22x one at 12 h, recorded, pages nothing), a clip storm 5-7 h,
    stale rollouts 9-11 h, one noisy batch at 13 h, then from 14 h a slow
    collapse (over 8 h entropy x 1.0 -> 0.25 and the groups one by one come to repeat one answer: pass@G falls from its
    best while pass@1 holds); a normal end at 23.5 h."""
    k = near_clip(step, hours)
    if round(hours * 6) == 24:
        k = replace(k, grad_norm=1000.0)
    if round(hours * 6) == 72:
        k = replace(k, grad_norm=100.0)
    if 5 <= hours < 7:
        k = replace(k, clip_share=1.0)
    if 9 <= hours < 11:
        k = replace(k, staleness=6)
    if round(hours * 6) == 78:
        k = replace(k, verifier_zero=True)
    fall = min(1.0, max(0.0, (hours - 14) / 8))
    return replace(k, entropy=k.entropy * (1 - 0.75 * fall), same_answer=fall, distinct=1.0 - 0.6 * fall)


def _a_day(folder: Path) -> subprocess.CompletedProcess[str]:
    mixin = MixinConfig(step_seconds=600.0)
    timeline = replay(mixin, 600.0, [Segment("day", a_day_at_ten_minutes, 23.5)], 24.0)
    collapse = 18.4  # hours: entropy crosses half of its early window (~0.99)
    within = 3 * 3600.0  # the 20-step trend mean lags a slow decline by ~1.7 h; `for` adds an hour
    expect = [Expect("GRPOGradNormSpike", 4 * 3600.0, within), Expect("GRPOClipFractionHigh", 5 * 3600.0, within),
              Expect("GRPORolloutsStale", 9 * 3600.0, within),
              # the collapse pages in its first half (by 18 h), then again when entropy halves
              Expect("GRPOPolicyCollapseOnset", 14 * 3600.0, 4 * 3600.0),
              Expect("GRPODiversityCollapse", 14 * 3600.0, 10 * 3600.0),
              Expect("GRPOEntropyCollapse", collapse * 3600, within + 3600),
              # repeating one answer empties the groups of reward variance: layer 3 pages it too, once each
              Expect("GRPOZeroVarianceAbovePrediction", 14 * 3600.0, 10 * 3600.0),
              Expect("GRPOFewGroupsCarrySignal", 14 * 3600.0, 10 * 3600.0)]
    return promtool_test(mixin, timeline, expect, folder, "a-day-at-10min")


def test_a_day_of_ten_minute_steps_pages_each_fault_once(outcomes):
    """The replay acceptance in one run: 144 steps of a real exporter, 30 s scrapes, 24 h; healthy stretches,
    the noisy batch and the normal end page nothing, each fault pages exactly once."""
    done = outcomes["day"].result()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _params() -> list[tuple[str, str]]:
    """Every scenario at every cadence, except the longest ones at 20 s steps (2700 steps of replay: covered
    at 2 min and 10 min, and the 20 s suite has the short faults)."""
    return [(cadence, scenario) for cadence, cadence_s in CADENCES.items()
            for scenario, case in cases(cadence_s).items() if not (cadence_s < 60 and case.hours > 12)]


# cases of one cadence replayed side by side in one promtool run (each on its own runs and targets): promtool's
# cost is mostly evaluations x rules, so six cases cost about two alone
CASES_PER_REPLAY = 6


def _batches() -> dict[str, tuple[str, ...]]:
    """key -> the scenarios it replays together: per cadence, the longest first, CASES_PER_REPLAY at a time."""
    out = {}
    for cadence, cadence_s in CADENCES.items():
        found = cases(cadence_s)
        names = sorted((s for c, s in _params() if c == cadence), key=lambda s: -found[s].hours)
        for i in range(0, len(names), CASES_PER_REPLAY):
            out[f"cases/{cadence}/{i // CASES_PER_REPLAY}"] = tuple(names[i : i + CASES_PER_REPLAY])
    return out


def _cases(folder: Path, cadence: str, scenarios: tuple[str, ...]) -> dict[str, list[str]]:
    """Replay ``scenarios`` side by side, each on its own runs and targets, in a timeline as long as the
    longest: a case's target is gone after its own end (stale, as a finished job's target leaves discovery).
    Returns scenario -> what promtool reports as failed for it."""
    cadence_s = CADENCES[cadence]
    mixin = MixinConfig(step_seconds=cadence_s)
    within = max(3600.0, LATENCY_STEPS * cadence_s) + 3600
    found = cases(cadence_s)
    timeline = Timeline(int(max(found[s].hours for s in scenarios) * 3600 // SCRAPE_S))
    expect: dict[str, list[Expect]] = {}
    for scenario in scenarios:
        case = found[scenario]
        segments = [replace(seg, run=case_run(scenario, seg.run), instance=case_run(scenario, seg.instance))
                    for seg in case.segments]
        for key, values in replay(mixin, cadence_s, segments, case.hours).series.items():
            timeline.series[key] = values + [None] * (timeline.scrapes - len(values))
        expect[scenario] = [Expect(e[0], e[1] * 3600, e[2] * 3600 if len(e) > 2 else within) for e in case.expect]
    done = promtool_cases(mixin, timeline, expect, folder, f"cases-{cadence}")
    return failed_cases(done, scenarios)


@pytest.mark.parametrize(("cadence", "scenario"), _params())
def test_rules_at_production_cadence(cadence, scenario, outcomes):
    key = next(k for k, names in _batches().items() if k.split("/")[1] == cadence and scenario in names)
    failed = outcomes[key].result().get(scenario, [])
    assert failed == [], "\n".join(failed)


def test_a_case_that_fails_fails_alone():
    """Several cases share a promtool run: each reads only the failures of its own runs' expressions, and a
    promtool failure that names no expression fails every case of the run."""
    expr = ('expr: "sum by (alertname) (sum_over_time(replay:alert_starts{run=~\\"{case}/.*\\"}[9h]) or '
            'sum_over_time(replay:alert_starts{run=\\"\\",instance=~\\"{case}/.*\\"}[9h]))", time: 9h,\n'
            '        exp: {alertname="GRPOClipFractionHigh"} 1E+00\n        got: nil\n')
    out = "Unit Testing:  cases-2min.test.yml\n  FAILED:\n    " + expr.replace("{case}", "clip-storm")
    done = subprocess.CompletedProcess([], 1, out, "")
    failed = failed_cases(done, ["clip-storm", "stale-rollouts", "storm"])
    assert list(failed) == ["clip-storm"]
    assert "got: nil" in failed["clip-storm"][0]
    assert failed_cases(subprocess.CompletedProcess([], 0, "  SUCCESS\n", ""), ["clip-storm"]) == {}
    broken = failed_cases(subprocess.CompletedProcess([], 1, "", "error loading rules"), ["a", "b"])
    assert set(broken) == {"a", "b"}
    assert "error loading rules" in broken["a"][0]


def _shorter_step(folder: Path) -> subprocess.CompletedProcess[str]:
    mixin = MixinConfig()
    timeline = replay(mixin, 600.0, [Segment("a", near_clip, 8.0)], 9.0)
    expect = [Expect("GRPOStepCadenceSlowerThanConfigured", 0.0, 4 * 3600.0)]
    return promtool_test(mixin, timeline, expect, folder, "misconfigured-cadence")


def test_rules_left_at_a_shorter_step_say_so(outcomes):
    """Rules generated for 1-minute steps on a run of 10-minute steps: their windows often hold no step. The
    healthy run pages nothing, and the info alert says the cadence is slower than configured."""
    done = outcomes["shorter-step"].result()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# one run per fault, each on its own target, all in one replay: (run, fault knobs, monitor settings) -> the
# alerts that must fire for that run, each once; side effects that are true signals are listed with them, and
# those whose firing depends on timing end in "?" (allowed, not required)
FAULT_RUNS: dict[str, tuple[dict[str, object], dict[str, object], tuple[str, ...]]] = {
    "gap-critical": ({"engine_gap": 0.05}, {}, ("GRPOEngineLogprobGapCritical", "GRPOEngineLogprobGapWarning")),
    "ratio-clipped": ({"onpolicy_noise": 0.5}, {}, ("GRPORatioClippedBeforeUpdate", "GRPOOnPolicyRatioDrift")),
    "nonfinite": ({"nan_token": True}, {}, ("GRPONonFiniteValues",)),
    "loss-mask": ({"mask_padding": True}, {}, ("GRPOLossMaskMismatch",)),
    "fuse": ({"log_ratio_sd": 0.1}, {"log_ratio_clamp": 0.25}, ("GRPOLogRatioFuseBlowing",)),
    "clipped-every-step": ({"grad_norm": 20.0}, {}, ("GRPOGradClippingEveryStep",)),
    "advantage-bound": ({"advantage_scale": 3.0}, {}, ("GRPOAdvantageAboveBound",)),
    # every reward 0: no group has reward variance any more, beyond any prediction
    "verifier-zero": ({"verifier_zero": True}, {},
                      ("GRPORewardCliff", "GRPOZeroVarianceAbovePrediction", "GRPOFewGroupsCarrySignal")),
    "truncation": ({"truncated": 0.2}, {}, ("GRPOTruncationSurge",)),
    # log ratios spread wide: a few tokens carry the weight, and most lie outside the clip range
    "ess-drop": ({"log_ratio_sd": 1.5}, {}, ("GRPOESSDrop", "GRPOClipFractionHigh")),
    "lower-clip": ({"lower_only": 0.3}, {}, ("GRPOLowerClipDominant",)),
    # each group repeats one completion, its answer included: pass@G falls to pass@1 (the seed's collapse;
    # identical completions while pass@G holds are a learned task), and groups lose reward variance
    "identical-completions": ({"distinct": 0.125, "same_answer": 1.0}, {},
                              ("GRPODiversityCollapse", "GRPOZeroVarianceAbovePrediction?",
                               "GRPOFewGroupsCarrySignal?")),
    # correctness falls while a format component pays for the loss: the total holds; the sudden fall also
    # leaves more all-wrong groups than the prompts' histories predict, until the histories catch up
    "reward-hack": ({"solve": 0.15, "format_pays": 1.0}, {},
                    ("GRPORewardHackSuspected", "GRPOZeroVarianceAbovePrediction?")),
    "long-incorrect": ({"longer_incorrect": 3}, {}, ("GRPOLengthGrowthIncorrectOnly",)),
    "long-correct": ({"longer_correct": 3}, {}, ("GRPOLengthHack",)),
    # each group repeats one answer, token for token: pass@G falls to pass@1, below the base model's, and groups
    # lose variance (and their distinct completions: GRPODiversityCollapse may page it too)
    "below-base": ({"same_answer": 1.0}, {"reference_baseline": {'grpo_pass_at_k_ratio{k="8"}': 0.6}},
                   ("GRPOPassAtGBelowBase", "GRPOZeroVarianceAbovePrediction", "GRPOFewGroupsCarrySignal",
                    "GRPODiversityCollapse?")),
    "template-collapse": ({"retrieval": 0.07}, {}, ("GRPORetrievalNearChance",)),
    # the mastered prompts fail again (forgetting behind a full batch): 0.95 -> 0.6 on the held set
    "forgetting": ({"regression": 0.6}, {}, ("GRPOMasteredPromptsRegressed",)),
    # a DAPO loop (dynamic sampling from the first step) whose pool is suddenly mastered: nearly every group
    # all-correct, several times the generation to fill a batch that still looks full
    "pool-shrinking": ({"solve": 0.99}, {}, ("GRPODynamicSamplingPoolShrinking",)),
    # a run that masters its pool (solve 0.9: ~44% of groups all-correct or all-wrong) whose format component
    # gains a 0.002-wide jitter: sigma makes the jitter of every tied group a full-size advantage
    "reward-noise": ({"format_jitter": 0.002}, {}, ("GRPOAdvantageFromRewardNoise",)),
    # a KL penalty (beta 0.04) that stops acting: the KL to the reference goes from 0.05 to 2 nats per token
    "kl-runaway": ({"kl_ref": 2.0}, {"kl_coef": 0.04}, ("GRPOKLToReferenceRunaway",)),
}
#: the loop a fault run trains in, from its first step (not a fault): its knobs over near_clip's
LOOPS: dict[str, dict[str, object]] = {"pool-shrinking": {"dynamic_sampling": True}, "kl-runaway": {"kl_ref": 0.05},
                                       "reward-noise": {"solve": 0.9}}


def _fleet(folder: Path, cadence: str) -> subprocess.CompletedProcess[str]:
    cadence_s = CADENCES[cadence]
    u = phase_hours(cadence_s)
    mixin = MixinConfig(step_seconds=cadence_s)
    segments, expect = [], []
    within = max(3600.0, LATENCY_STEPS * cadence_s) + 3600
    may_fire = []
    for i, (run, (knobs, settings, alerts)) in enumerate(FAULT_RUNS.items()):
        loop = LOOPS.get(run, {})
        base = (lambda step, hours, loop=loop: replace(near_clip(step, hours), **loop)) if loop else near_clip
        segments.append(Segment(run, after(5 * u, base, **knobs), 8 * u, seed=i, instance=f"{run}:9887",
                                monitor=settings))
        expect += [Expect(alert, 5 * u * 3600, within, run) for alert in alerts if not alert.endswith("?")]
        may_fire += [(alert[:-1], run) for alert in alerts if alert.endswith("?")]
    timeline = replay(mixin, cadence_s, segments, 9 * u)
    return promtool_test(mixin, timeline, expect, folder, f"faults-{cadence}", may_fire)


@pytest.mark.parametrize("cadence", ["2min", "10min"])
def test_every_fault_pages_once_at_production_cadence(cadence, outcomes):
    """Twenty-one runs side by side, one fault each from the fifth phase on: each pages its alert (and only the alerts
    listed), once, no earlier than its `for` after the onset. 20 s steps are left out: there the rules sit on their
    floors (5 min windows, 1 h baselines), which rules/tests/*.test.yml check for every alert at 1 min steps."""
    done = outcomes[f"fleet/{cadence}"].result()
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


# ---- the replays run side by side: each is a Python replay of a real exporter, then a promtool run ----

def _key(item: pytest.Item) -> str | None:
    """The replay a collected test of this module reads, or None."""
    params = getattr(item, "callspec", None)
    name = getattr(item, "originalname", item.name)
    if name == "test_rules_at_production_cadence" and params is not None:
        cadence, scenario = params.params["cadence"], params.params["scenario"]
        return next(k for k, names in _batches().items() if k.split("/")[1] == cadence and scenario in names)
    if name == "test_every_fault_pages_once_at_production_cadence" and params is not None:
        return f"fleet/{params.params['cadence']}"
    return {"test_a_day_of_ten_minute_steps_pages_each_fault_once": "day",
            "test_rules_left_at_a_shorter_step_say_so": "shorter-step"}.get(name)


def _cost(key: str) -> float:
    """Replayed steps x runs, to start the longest replays first."""
    kind, *rest = key.split("/")
    if kind == "cases":
        found = cases(CADENCES[rest[0]])
        return sum(found[s].hours * 3600 / CADENCES[rest[0]] for s in _batches()[key])
    if kind == "fleet":
        return len(FAULT_RUNS) * 9 * phase_hours(CADENCES[rest[0]]) * 3600 / CADENCES[rest[0]]
    return 150.0


def _run(key: str, folder: str) -> subprocess.CompletedProcess[str] | dict[str, list[str]]:
    """One replay and its promtool run, in a worker process."""
    torch.set_num_threads(1)
    kind, *rest = key.split("/")
    path = Path(folder)
    if kind == "cases":
        return _cases(path, rest[0], _batches()[key])
    if kind == "fleet":
        return _fleet(path, *rest)
    return _a_day(path) if kind == "day" else _shorter_step(path)


def _run_in_temp(key: str) -> subprocess.CompletedProcess[str] | dict[str, list[str]]:
    with tempfile.TemporaryDirectory(prefix=f"grpo-cadence-{key.replace('/', '-')}-") as folder:
        return _run(key, folder)


def start_in_background(items: list[pytest.Item]) -> dict[str, Future[Any]]:
    """Every replay the selected tests of this module read, in the suite's background lane (tests/batch_lane.py:
    two at a time, one per core of the CI machine, at the lowest priority), the longest first. conftest.py
    calls it after collection; the ``outcomes`` fixture asks again (each replay is submitted once). An error in
    one replay is raised by its own test."""
    keys = sorted({k for item in items if (k := _key(item)) is not None}, key=_cost, reverse=True)
    return {k: batch_lane.submit(f"cadence/{k}", _run_in_temp, k) for k in keys}


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest) -> dict[str, Future[Any]]:
    """The replays this module's selected tests read (started in the background lane when collection ended)."""
    return start_in_background([item for item in request.session.items if item.module is request.module])
