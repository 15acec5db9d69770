"""Docs and rules agree (issue 58): every regime in which a runbook section says its alert stays silent is held
by a named promtool test in rules/tests, or the alert says why no rule test can hold it (never silent, or the
exporter decides: the rule then sees no series or a counter at 0). Renaming or dropping such a test, or adding an
alert without one, fails here; promtool runs the tests themselves in tests/test_rules.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.rules import alerts
from grpo_exporter.reference.alert_table import silent_when

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = ROOT / "docs" / "runbooks.md"
TESTS = sorted((ROOT / "rules" / "tests").glob("*.test.yml"))

_END = "A normal end (close() marked the run finished) and the time between runs page nothing"
_BF16 = "a bf16 engine's noise above the line pages nothing; the notice holds until the level is recorded"

#: alert -> the promtool test groups that check it stays silent in a regime of its runbook's "Silent when"
SILENT_TESTS: dict[str, tuple[str, ...]] = {
    "GRPOExporterDown": (
        _END,
        "GRPOExporterDown pages a static target's crash for the lookback (6 h) at most, a discovered pod's while the "
        "pod is a target",
    ),
    "GRPOExporterNeverAnswered": (
        "GRPOExporterNeverAnswered for an announced target Prometheus cannot reach; a crash and an end are not it",
        "GRPOExporterNeverAnswered stops once the announcement is older than the lookback (a file left behind)",
    ),
    "GRPOTargetServesNoGRPOMetrics": (
        "GRPOTargetServesNoGRPOMetrics for a dead run's announcement where another run now serves; not between runs",
        "GRPOTargetServesNoGRPOMetrics is silent on a static target of a server of your own for the lookback after "
        "its last run, then pages",
    ),
    "GRPOTrainingStalled": (_END,),
    "GRPOStepCadenceSlowerThanConfigured": (
        "GRPOStepCadenceSlowerThanConfigured stays silent once the run stalls (GRPOTrainingStalled covers it) or ends",
    ),
    "GRPOEngineLogprobGapCritical": (
        _BF16,
        "GRPOEngineLogprobGapCritical stays silent on a gap within 5x its accepted level (4x and above 0.01 is the "
        "Warning's)",
    ),
    "GRPORoutingReplayFellBack": (
        "GRPORoutingReplayFellBack names the layers whose replay fell back",
        "an MoE engine's routing mismatch that is only high pages nothing (bf16 or FP8, replay off)",
    ),
    "GRPORoutingMismatchRising": (
        "an MoE engine's routing mismatch that is only high pages nothing (bf16 or FP8, replay off)",
        "GRPORoutingReplayFellBack names the layers whose replay fell back",
        "one MoE layer's router out of sync pages while the model's share stays within its line (replay off)",
    ),
    "GRPOEngineLogprobGapWarning": (
        _BF16,
        "GRPOEngineLogprobGapCritical from the first step, with no baseline, when the gap is systematic (top-p)",
        "GRPOEngineLogprobGapWarning from the run's own clean gap (1000x it, still far below 0.001)",
    ),
    "GRPOEngineLogprobGapCleanLevelHigh": (_BF16,),
    "GRPORatioClippedBeforeUpdate": (
        "GRPOOnPolicyRatioDrift (inside the clip band, far outside the run's own recomputation noise)",
        "GRPORatioClippedBeforeUpdate stays silent with no update flagged on_policy (its counters stay 0)",
    ),
    "GRPOOnPolicyRatioDrift": (
        "GRPOOnPolicyRatioDrift stays silent below its floor (an exact recomputation, then one rounding step)",
        "GRPOOnPolicyRatioDrift stays silent on a run whose probability path was wrong from its first step (its "
        "noise baseline holds the fault)",
    ),
    "GRPOLogRatioFuseBlowing": (
        "GRPOLogRatioFuseBlowing stays silent while its window holds fewer than 2 steps (rules generated for a "
        "shorter step)",
    ),
    "GRPOGradNormSpike": (
        "GRPOGradNormSpike pages the first confirmed spike, even of one step between two scrapes; a lone one is "
        "recorded only",
    ),
    "GRPOGradClippingEveryStep": (
        "GRPOGradClippingEveryStep",
        "GRPOGradClippingEveryStep stays silent on fewer than 10 optimizer steps in its window, and on a 2x error of "
        "a norm just under the line",
    ),
    "GRPOAdvantageFormUnexpected": (
        "GRPOAdvantageFormUnexpected fires for a known form other than the configured one, never for unknown",
    ),
    "GRPORewardCliff": (
        "GRPORewardCliff stays silent on a run that never had reward (baseline below 0.05), and on one noisy batch",
    ),
    "GRPORewardHackSuspected": (
        "GRPORewardHackSuspected (the run names its correctness component, e.g. TRL's verifier \"accuracy\")",
        "GRPORewardHackSuspected stays silent early in training where format rises and correctness is flat",
    ),
    "GRPOTruncationSurge": (
        "GRPOTruncationSurge",
        "GRPOTruncationSurge stays silent below 5% truncated, whatever its multiple of the baseline",
    ),
    "GRPOLengthGrowthIncorrectOnly": (
        "GRPOLengthGrowthIncorrectOnly silent on a few incorrect completions (how many samples decide)",
        "GRPOLengthGrowthIncorrectOnly and GRPOLengthHack stay silent before a trailing baseline exists (20 steps "
        "in its window), then page a growth from the first step",
    ),
    "GRPOLengthHack": (
        "GRPOLengthHack silent on a few correct completions (how many samples decide)",
        "GRPOLengthGrowthIncorrectOnly and GRPOLengthHack stay silent before a trailing baseline exists (20 steps "
        "in its window), then page a growth from the first step",
    ),
    "GRPOAdvantageFromRewardNoise": (
        "GRPOAdvantageFromRewardNoise stays silent below its line, and on a 0/1 verifier alone",
        "GRPOAdvantageFromRewardNoise stays silent while its rate window holds fewer than 2 steps (rules generated "
        "for a shorter step)",
    ),
    "GRPOKLToReferenceRunaway": (
        "GRPOKLToReferenceRunaway stays silent on the early drift of a constrained run, and without a penalty",
        "GRPOKLToReferenceRunaway compares with the trend window 20 steps back from step 20, holding the steps "
        "since the start until step 40",
    ),
    "GRPOKLToReferenceZero": (
        "GRPOKLToReferenceZero stays silent on the first step's exact 0, on a KL that moves, and without a penalty",
    ),
    "GRPOESSDrop": ("GRPOESSDrop stays silent on one batch of odd weights",),
    "GRPOZeroVarianceAbovePrediction": (
        "GRPOZeroVarianceAbovePrediction stays silent before the run's early window is complete (the prediction "
        "still learns the solve rates)",
        "GRPOZeroVarianceAbovePrediction stays silent on a handful of groups",
        "GRPOZeroVarianceAbovePrediction stays silent while a policy learns faster than its history (the excess is "
        "all-correct)",
        "GRPOZeroVarianceAbovePrediction stays silent when the observed share matches the prediction, however high",
    ),
    "GRPOFewGroupsCarrySignal": (
        "GRPOFewGroupsCarrySignal stays silent on fewer than 64 groups in the window",
        "GRPOFewGroupsCarrySignal stays silent at 80% zero-variance groups",
        "GRPOFewGroupsCarrySignal stays silent on a learned task (95% all-correct, as predicted)",
    ),
    "GRPOLowerClipDominant": (
        "GRPOLowerClipDominant stays silent in a solved task, where the upper clip is out of reach",
        "GRPOLowerClipDominant stays silent on a handful of negative tokens",
    ),
    "GRPOClipFractionHigh": (
        "GRPOClipFractionHigh",
        "GRPOClipFractionHigh stays silent on fewer than 200 signed tokens in the window, and on one batch",
    ),
    "GRPORolloutsStale": ("GRPORolloutsStale stays silent on a single stale step",),
    "GRPODynamicSamplingPoolShrinking": (
        "GRPODynamicSamplingPoolShrinking stays silent while most generated groups are still kept",
        "GRPODynamicSamplingPoolShrinking stays silent on a run that starts filtering most groups and stays there",
        "GRPODynamicSamplingPoolShrinking stays silent before the early window is complete (no anchor of the kept "
        "share)",
    ),
    "GRPOEntropyCollapse": ("GRPOEntropyCollapse stays silent on a task being learned (entropy halves, pass@G rises)",),
    "GRPOPolicyCollapseOnset": (
        "GRPOPolicyCollapseOnset stays silent on a task being learned: entropy falls by half, pass@1 rises, pass@G "
        "holds",
        "GRPOPolicyCollapseOnset stays silent when pass@1 falls as far as pass@G (a run getting worse at "
        "everything: not the collapse's signature)",
        "GRPOPolicyCollapseOnset stays silent while entropy holds above its alarm line (pass@G falling alone is "
        "GRPODiversityCollapse's to judge)",
        "GRPOPolicyCollapseOnset at 4 groups a step is judged over the long window; silent at 1 group a step (no "
        "window holds 100 groups) and without pass@1",
        "GRPOPolicyCollapseOnset pages a slow fall early where the prompts that lose their solution repeat one wrong "
        "completion; silent where unsolved prompts narrow onto one wrong answer while pass@G holds",
    ),
    "GRPODiversityCollapse": (
        "GRPODiversityCollapse stays silent on convergence (pass@1 rose, pass@G holds)",
        "GRPODiversityCollapse stays silent on a task solved from the warm start (pass@1 0.9 cannot rise 0.1; "
        "pass@G 1)",
        "GRPODiversityCollapse stays silent on a one-group dip of pass@G at 4 groups a step (G=16; its sampling "
        "error, not a fall)",
        "GRPODiversityCollapse stays silent on a fall within the long window's sampling error (pass@G 0.85 -> 0.78 "
        "at 4 groups a step)",
        "GRPODiversityCollapse stays silent when pass@1 falls as far as pass@G (a run worse at everything for a "
        "while, not the collapse)",
    ),
    "GRPOPassAtGBelowBase": ("GRPOPassAtGBelowBase stays silent with no reference run",),
    "GRPOMasteredPromptsRegressed": (
        "GRPOMasteredPromptsRegressed stays silent on a drop within the set's noise",
        "GRPOMasteredPromptsRegressed stays silent on a large set's drop below the minimum",
        "GRPOMasteredPromptsRegressed stays silent before its early window is complete (3 evaluations)",
    ),
}

#: alert -> why no rule test can hold its "Silent when" (the exporter decides, or it is never silent)
NOT_A_RULE_REGIME: dict[str, str] = {
    "GRPOWatchdog": "never silent: it fires all the time",
    "GRPONonFiniteValues": "never silent: one NaN on a loss token is a bug",
    "GRPOLossMaskMismatch": "never silent: a wrong mask is a bug",
    "GRPOAdvantageAboveBound": "never silent; the bound of each advantage form is the exporter's",
    "GRPOAdvantageInconsistent": "the exporter reads only complete groups of a group-centred form",
    "GRPOParamUpdateJump": "the exporter judges each update against its last 50",
    "GRPOLossOnToolTokens": "without a tool_mask the exporter counts nothing",
    "GRPOCompletionLengthCountsToolTokens": "without a tool_mask the exporter counts nothing",
    "GRPORetrievalNearChance": "without observe_retrieval there is no series",
}


def _groups() -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for path in TESTS:
        if path.name == "healthy.test.yml":
            continue
        for group in yaml.safe_load(path.read_text())["tests"]:
            assert group["name"] not in groups, f"two promtool tests named {group['name']!r}"
            groups[group["name"]] = group
    return groups


def test_every_alert_has_its_silent_regimes_tested_or_says_why_not():
    names = {a.name for a in alerts(MixinConfig())}
    assert set(SILENT_TESTS) & set(NOT_A_RULE_REGIME) == set()
    assert names - set(SILENT_TESTS) - set(NOT_A_RULE_REGIME) == set(), "alerts without a silent-regime test"
    assert set(SILENT_TESTS) | set(NOT_A_RULE_REGIME) <= names, "entries for alerts that no longer exist"


def _series(check: dict) -> set[frozenset]:
    """The alerts one promtool check expects, each as its set of labels."""
    return {frozenset(a["exp_labels"].items()) for a in check.get("exp_alerts") or []}


def test_the_named_tests_exist_and_check_their_alert_silent():
    """Each named test checks its alert at some evaluation where it must not fire (not at all, or not for one of
    the series it fires for elsewhere in the test): a test that only shows it firing holds no silent regime."""
    groups = _groups()
    for alert, tests in SILENT_TESTS.items():
        for name in tests:
            assert name in groups, f"{alert}: no promtool test named {name!r}"
            checks = [c for c in groups[name].get("alert_rule_test", []) if c["alertname"] == alert]
            assert checks, f"{alert}: {name!r} does not check it"
            every = set().union(*(_series(c) for c in checks))
            silent = [c for c in checks if _series(c) < every or not _series(c)]
            assert silent, f"{alert}: {name!r} never checks it silent"


def test_never_silent_in_the_runbook_is_never_silent_here():
    quiet = silent_when(RUNBOOKS.read_text(encoding="utf-8"))
    never = {alert for alert, text in quiet.items() if text.startswith("never")}
    assert never <= set(NOT_A_RULE_REGIME), never - set(NOT_A_RULE_REGIME)
    assert never.isdisjoint(SILENT_TESTS)
