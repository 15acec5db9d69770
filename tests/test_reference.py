"""The generated reference pages (alerts, framework matrix, configuration) are committed as generated, and what
they state follows from the code: the matrix's needs are the inputs of the metrics each alert reads, and the
alert table's mutes are the inhibitions a real Alertmanager applies (tests/test_rules.py routes them)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from grpo_exporter import GRPOMonitor, catalog
from grpo_exporter.keywords import RolloutFields, UpdateFields
from grpo_exporter.mixin.alerts import alerts
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.rules import rule_files
from grpo_exporter.reference import reference_pages
from grpo_exporter.reference.alert_table import mutes
from grpo_exporter.reference.frameworks import GROUPS, MODES, NEEDS
from grpo_exporter.runtime.monitor_config import MonitorConfig

ROOT = Path(__file__).resolve().parents[1]
# read by an alert to judge, never its trigger: the run's lifecycle, step counts, anchors and baselines
CONTEXT = {"grpo_steps_total", "grpo_run_anchor", "grpo_reference_baseline", "grpo_run_info", "grpo_run_finished",
           "grpo_last_step_timestamp_seconds", "grpo_groups_total", "grpo_optimizer_steps_total",
           "grpo_completions_total", "grpo_update_tokens_total", "grpo_kl_penalty_coefficient",
           "grpo_reward_component_role"}


def test_committed_reference_pages_are_generated():
    pages = reference_pages(MixinConfig(), (ROOT / "docs" / "runbooks.md").read_text(encoding="utf-8"))
    for name, text in pages.items():
        assert (ROOT / "docs" / name).read_text(encoding="utf-8") == text, \
            f"docs/{name} drifted: run `grpo-exporter reference`"


def _metrics_read(expr: str, recorded: dict[str, list[str]], seen: tuple[str, ...] = ()) -> set[str]:
    out: set[str] = set()
    for token in re.findall(r"[a-z_:0-9]+", expr):
        if token in recorded and token not in seen:
            for inner in recorded[token]:
                out |= _metrics_read(inner, recorded, (*seen, token))
        elif token.startswith("grpo_"):
            family = re.sub(r"_(bucket|sum|count)$", "", token)
            out.add(family if family in catalog.BY_NAME else token)
    return out


def test_the_matrix_needs_are_the_inputs_of_what_each_alert_reads():
    """Every alert has needs; each group it needs holds an input of a metric it reads, and every input that a
    metric it triggers on needs (all alternatives of an `a|b` entry) lies in one of its groups, or is
    computed by the monitor from them."""
    c = MixinConfig()
    recorded: dict[str, list[str]] = {}
    for doc in rule_files(c).values():
        for group in doc["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    recorded.setdefault(rule["record"], []).append(rule["expr"])
    assert set(NEEDS) == {a.name for a in alerts(c)}
    settings = set(MonitorConfig.model_fields)  # set on the monitor, whatever the framework
    # the monitor computes these from what a group holds (clip_grad_norm_ samples the parameters each step)
    derived = {"zero_variance_prob": "verdicts", "all_incorrect_prob": "verdicts", "on_policy": "ratios",
               "params_before": "params", "params_after": "params"}
    for alert in alerts(c):
        read = _metrics_read(alert.expr, recorded) - CONTEXT
        inputs = {alt for m in read if m in catalog.BY_NAME for entry in catalog.BY_NAME[m].inputs
                  for alt in entry.split("|")}
        # a series split by outcome exists only where correctness is given
        inputs |= {"correct" for m in read if m in catalog.BY_NAME
                   and "outcome" in {label.name for label in catalog.BY_NAME[m].labels}}
        covered = {i for g in NEEDS[alert.name] for i in GROUPS[g]}
        for group in NEEDS[alert.name]:
            assert set(GROUPS[group]) & (inputs | {i for i, g in derived.items() if g == group}) \
                or any(derived.get(i) == group for i in inputs), (alert.name, group)
        for m in read & set(catalog.BY_NAME):
            for entry in catalog.BY_NAME[m].inputs:
                options = set(entry.split("|"))
                assert options & covered or any(derived.get(o) in NEEDS[alert.name] for o in options) \
                    or options <= {"loss_mask"} | settings, (alert.name, m, entry)


def test_every_group_names_what_the_monitor_takes():
    """Each input of a group is a keyword of a GRPOMonitor method or a setting; each mode names known groups."""
    keywords = {name for _, method in inspect.getmembers(GRPOMonitor, inspect.isfunction)
                for name in inspect.signature(method).parameters} | set(RolloutFields.__annotations__) \
        | set(UpdateFields.__annotations__)
    # the catalogue names observe_regression(correct=) and observe_retrieval(scores=) regression_correct, ...
    keywords |= {f"{name.removeprefix('observe_')}_{param}" for name, method in
                 inspect.getmembers(GRPOMonitor, inspect.isfunction) if name.startswith("observe_")
                 for param in inspect.signature(method).parameters}
    for group, inputs in GROUPS.items():
        assert set(inputs) <= keywords | set(MonitorConfig.model_fields), group
    for mode, groups in MODES.items():
        assert set(groups) <= set(GROUPS), mode


def test_every_framework_mode_of_the_matrix_is_held_to_a_real_run():
    """Each framework column of docs/frameworks.md is checked against what its adapter publishes on the
    framework's own code (tests/test_*trl*.py, tests/frameworks/check_*.py: ``assert_*_as_documented``), so
    the matrix cannot claim a mode the adapter does not give. "your own loop" is every group, as passed."""
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (*ROOT.glob("tests/test_*.py"),
                                                              *ROOT.glob("tests/frameworks/check_*.py")))
    calls = [sources[m.end():m.end() + 300] for m in re.finditer(r"_as_documented\(", sources)]
    held = {mode for mode in MODES for call in calls if f'"{mode}"' in call}
    assert set(MODES) - {"your own loop"} <= held, sorted(set(MODES) - {"your own loop"} - held)


def test_a_gate_mutes_downstream_and_a_warning_mutes_nothing():
    muted = mutes(MixinConfig())
    assert "GRPOESSDrop" in muted["GRPOLossMaskMismatch"]
    assert "GRPOGradNormSpike" in muted["GRPOEngineLogprobGapCritical"]
    assert muted["GRPOEngineLogprobGapCritical"] >= {"GRPOEngineLogprobGapWarning", "GRPORewardCliff"}
    assert not muted["GRPOEngineLogprobGapWarning"]
    assert not muted["GRPOGradNormSpike"]
    assert "GRPOExporterDown" not in {m for targets in muted.values() for m in targets}
