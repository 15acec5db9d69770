"""Rules and pages: generated files, promtool checks and unit tests, conventions, catalogue coverage, and a
real Alertmanager that routes by severity and inhibits layers 2-4 behind a layer-1 fault."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from grpo_exporter.catalog import Layer, family_of
from grpo_exporter.mixin.alerts.liveness import WATCHDOG
from grpo_exporter.mixin.config import RUNBOOKS, MixinConfig
from grpo_exporter.mixin.receivers import webhooks
from grpo_exporter.mixin.render import alertmanager_output, rules_outputs
from grpo_exporter.mixin.rules import OPTIMIZER, alerts, recording_rules
from services import Webhook, alertmanager, binary, post_json

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "rules"
TESTS = sorted((RULES / "tests").glob("*.test.yml"))
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def test_committed_files_equal_the_generator():
    for name, text in rules_outputs(MixinConfig()).items():
        assert (RULES / name).read_text() == text, f"rules/{name} drifted: run `grpo-exporter rules`"
    assert ALERTMANAGER.read_text() == alertmanager_output(MixinConfig()), "alertmanager.yml drifted"


def test_promtool_check_rules_is_clean():
    done = run(binary("promtool"), "check", "rules", *map(str, sorted(RULES.glob("*.rules.yml"))))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == 2


@pytest.mark.parametrize("test_file", TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(test_file):
    done = subprocess.run(
        [binary("promtool"), "test", "rules", test_file.name], cwd=test_file.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_tests_fix_the_group_order():
    """Prometheus evaluates groups independently; promtool picks a random order per step unless told, which
    makes alerts on recorded series fire one evaluation early or late at random."""
    for path in TESTS:
        assert yaml.safe_load(path.read_text())["group_eval_order"] == ["grpo-recording", "grpo-alerts"], path


#: the dead man's switch fires all the time: never silent, no value to state, severity "none"
ALWAYS_FIRING = {WATCHDOG}


def test_every_alert_is_tested_before_and_after_for_and_silent_when_healthy():
    names = {a.name for a in alerts(MixinConfig())}
    fired, silent_before, silent_healthy = set(), set(), set()
    for path in TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            checks = group.get("alert_rule_test", [])
            for check in checks:
                name = check["alertname"]
                if check["exp_alerts"]:
                    fired.add(name)
                    earlier = [c for c in checks if c["alertname"] == name and not c["exp_alerts"]]
                    if earlier:
                        silent_before.add(name)
                    for alert in check["exp_alerts"]:
                        assert {"severity", "layer", "family"} <= set(alert["exp_labels"]), name
                        assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}, name
                elif path.name == "healthy.test.yml":
                    silent_healthy.add(name)
    assert names - fired == set(), "alerts without a firing test"
    assert names - silent_before - ALWAYS_FIRING == set(), "alerts without a silent check before `for` elapses"
    assert names - silent_healthy - ALWAYS_FIRING == set(), "alerts not checked in the healthy scenario"


def test_alert_conventions():
    doc = yaml.safe_load((RULES / "grpo-alerts.rules.yml").read_text())
    rules = doc["groups"][0]["rules"]
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    anchors = {heading.lower() for heading in re.findall(r"^## (GRPO\w+)", runbooks, flags=re.M)}
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"GRPO[A-Z][A-Za-z0-9]+", name), name
        assert rule["for"], name
        if name in ALWAYS_FIRING:
            assert rule["labels"]["severity"] == "none", name
            assert rule["expr"] == "vector(1)", name
        else:
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["labels"]["layer"] in {layer.value for layer in Layer} | {OPTIMIZER}, name
        annotations = rule["annotations"]
        assert annotations["summary"], name
        assert "{{" not in annotations["summary"], name
        if name not in ALWAYS_FIRING:
            assert "$value" in annotations["description"], f"{name}: the description must state the current value"
        assert annotations["runbook_url"] == f"{RUNBOOKS}#{name.lower()}", name
        assert name.lower() in anchors, f"{name}: no runbook section"
    assert len(anchors) == len(rules)
    assert f"| {len(rules)} `GRPO...` alerts" in (RULES / "README.md").read_text(), "rules/README.md: alert count"


def test_every_metric_an_expression_uses_is_in_the_catalogue():
    """Raw metrics in every expression and description template exist in the catalogue (as samples), and
    every recorded series used is recorded."""
    recorded = {r["record"] for r in recording_rules(MixinConfig())}
    text = "\n".join(
        line
        for n in ("grpo-recording.rules.yml", "grpo-alerts.rules.yml")
        for line in (RULES / n).read_text().splitlines()
        if not line.startswith("#")
    )
    used_recorded = set(re.findall(r"\brun:[a-z0-9_]+:[a-z0-9_]+", text))
    assert used_recorded - recorded == set(), "used but never recorded"
    raw = set(re.findall(r"\b(grpo_[a-z0-9_]+)", re.sub(r"\brun:[a-z0-9_]+:[a-z0-9_]+", "", text)))
    assert len(raw) > 20, "too few metrics found: the check would be vacuous"
    for name in raw:
        family_of(name)  # KeyError when the catalogue has no such sample


def test_time_scale_shrinks_every_window():
    fast = MixinConfig(time_scale=0.02)
    text = "\n".join(rules_outputs(fast).values())
    assert "[6s]" in text  # 5m rate window
    assert "offset 12s" in text  # 10m baseline offset
    assert "for: 2s" in text  # 2m for
    assert "[5m]" not in text


def test_overrides_and_unknown_alert_names():
    c = MixinConfig(for_seconds={"GRPORolloutsStale": 3600}, severities={"GRPORolloutsStale": "info"})
    rule = next(a.rule(c) for a in alerts(c) if a.name == "GRPORolloutsStale")
    assert rule["for"] == "1h"
    assert rule["labels"]["severity"] == "info"
    with pytest.raises(ValueError, match="GRPONoSuchAlert"):
        alerts(MixinConfig(severities={"GRPONoSuchAlert": "info"}))


def test_amtool_check_config():
    done = run(binary("amtool"), "check-config", str(ALERTMANAGER))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def _alert(name: str, run_id: str, layer: Layer | str, severity: str, family: str) -> dict:
    now = dt.datetime.now(dt.UTC)
    return {
        "labels": {"alertname": name, "run": run_id, "job": "grpo", "layer": str(layer), "severity": severity,
                   "family": family},
        "annotations": {"summary": name, "description": f"{name} for {run_id}", "runbook_url": "docs/runbooks.md"},
        "startsAt": now.isoformat(),
        "endsAt": (now + dt.timedelta(hours=1)).isoformat(),
    }


def test_alertmanager_routes_and_inhibits_along_the_signal_chain(tmp_path):
    hook = Webhook()
    try:
        config = MixinConfig(
            time_scale=0.02, receivers=webhooks(pager=f"{hook.url}/pager", default=f"{hook.url}/default")
        )
        path = tmp_path / "alertmanager.yml"
        path.write_text(alertmanager_output(config))
        with alertmanager(path, tmp_path) as url:
            post_json(f"{url}/api/v2/alerts", [
                _alert("GRPOEngineLogprobGapCritical", "A", Layer.GRADIENT, "critical", "engine_logprob_gap"),
                _alert("GRPOESSDrop", "A", Layer.SAMPLES, "warning", "ess"),
                _alert("GRPOESSDrop", "B", Layer.SAMPLES, "warning", "ess"),
                _alert("GRPOEngineLogprobGapCritical", "C", Layer.GRADIENT, "critical", "engine_logprob_gap"),
                _alert("GRPOEngineLogprobGapWarning", "C", Layer.GRADIENT, "warning", "engine_logprob_gap"),
                # a layer-1 gate mutes the optimizer family too
                _alert("GRPOGradNormSpike", "A", "1-optimizer", "warning", "grad_norm"),
                # a layer-1 warning and the optimizer family mute nothing: a warning never mutes a critical
                _alert("GRPOEngineLogprobGapWarning", "D", Layer.GRADIENT, "warning", "engine_logprob_gap"),
                _alert("GRPOGradNormSpike", "D", "1-optimizer", "warning", "grad_norm"),
                _alert("GRPORewardCliff", "D", Layer.REWARD, "critical", "reward_cliff"),
                _alert("GRPOESSDrop", "D", Layer.SAMPLES, "warning", "ess"),
                # one advantage bug pages once: over its bound mutes its inconsistent groups, of its own run only
                _alert("GRPOAdvantageAboveBound", "E", Layer.REWARD, "critical", "advantage_bound"),
                _alert("GRPOAdvantageInconsistent", "E", Layer.REWARD, "critical", "advantage_bound"),
                _alert("GRPOAdvantageInconsistent", "F", Layer.REWARD, "critical", "advantage_bound"),
            ])
            deadline = time.monotonic() + 20
            want = {("/pager", "GRPOEngineLogprobGapCritical", "A"), ("/default", "GRPOESSDrop", "B"),
                    ("/pager", "GRPOEngineLogprobGapCritical", "C"), ("/default", "GRPOEngineLogprobGapWarning", "D"),
                    ("/default", "GRPOGradNormSpike", "D"), ("/pager", "GRPORewardCliff", "D"),
                    ("/default", "GRPOESSDrop", "D"), ("/pager", "GRPOAdvantageAboveBound", "E"),
                    ("/pager", "GRPOAdvantageInconsistent", "F")}
            while time.monotonic() < deadline:
                got = {(p, a["labels"]["alertname"], a["labels"]["run"]) for p, a in hook.alerts()}
                if want <= got:
                    break
                time.sleep(0.2)
            time.sleep(3)  # longer than group_wait and group_interval: anything inhibited would have arrived
            got = {(p, a["labels"]["alertname"], a["labels"]["run"]) for p, a in hook.alerts()}
            assert want <= got, got
            assert ("/default", "GRPOESSDrop", "A") not in got  # layer 3 behind a layer-1 fault of the same run
            assert not [g for g in got if g[1:] == ("GRPOEngineLogprobGapWarning", "C")]  # critical mutes its warning
            assert ("/default", "GRPOGradNormSpike", "A") not in got  # a gate mutes the optimizer family
            assert got == want
    finally:
        hook.close()


def test_mixin_config_file_must_be_a_mapping(tmp_path):
    path = tmp_path / "mixin.yml"
    path.write_text("- selector\n")
    with pytest.raises(ValueError, match=r"mixin\.yml: expected a YAML mapping of MixinConfig settings, got list"):
        MixinConfig.load(path)
    path.write_text('selector: \'job="train"\'\n')
    assert MixinConfig.load(path).selector == 'job="train"'
