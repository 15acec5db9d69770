"""Dashboards as code: drift, structure, catalogue coverage, and every query against a real Prometheus that
scrapes a live GRPOMonitor."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch

from batches import make_batch
from grpo_exporter import GRPOMonitor
from grpo_exporter.catalog import CATALOG, family_of
from grpo_exporter.checks import mask_table
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.dashboards import build, dashboard_files, specs, training_health
from grpo_exporter.mixin.not_shown import NOT_SHOWN
from grpo_exporter.mixin.render import rules_outputs
from grpo_exporter.mixin.rules import recording_rules
from monitor_helpers import rollout_kwargs, update_kwargs
from services import prometheus, prometheus_query

ROOT = Path(__file__).resolve().parents[1]
RECORDED = re.compile(r"\brun:[a-z0-9_]+:[a-z0-9_]+")


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p["targets"]]


@pytest.mark.parametrize("folder", ["dashboards", "exporter/grpo_exporter/mixin/packaged_dashboards"])
def test_committed_dashboards_equal_the_builder(folder):
    """The repository's dashboards and the ones the package ships (``grpo-exporter kubernetes`` without the SDK)."""
    built = dashboard_files(MixinConfig())
    assert sorted(p.name for p in (ROOT / folder).glob("*.json")) == sorted(built)
    for name, text in built.items():
        committed = (ROOT / folder / name).read_text()
        assert committed == text, f"{folder}/{name} drifted: run `make generate`"


@pytest.mark.parametrize("spec", specs(MixinConfig()), ids=lambda s: s.uid)
def test_structure(spec):
    d = build(spec)
    assert d["uid"] == spec.uid
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "job", "run"]
    for p in panels(d):
        assert p["title"], p["id"]
        assert p["description"], p["id"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert ref_ids, p["title"]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_rows_follow_the_signal_chain():
    titles = [p["title"] for p in build(training_health(MixinConfig()))["panels"] if p["type"] == "row"]
    assert [t[:1] for t in titles[1:]] == ["1", "1", "2", "3", "4"]  # layer 1's probability path, then its router
    for title, word in zip(titles[1:], ("gradient", "experts", "reward", "samples", "question"), strict=True):
        assert word in title


def test_thresholds_come_from_the_mixin_config():
    def gap_steps(c: MixinConfig) -> list:
        d = build(training_health(c))
        panel = next(p for p in panels(d) if p["title"].startswith("Do trainer and rollout engine agree"))
        return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    assert gap_steps(MixinConfig()) == [None, 0.001, 0.01]
    assert gap_steps(MixinConfig(engine_gap_healthy_nats=0.002, engine_gap_stop_nats=0.02)) == [None, 0.002, 0.02]


def test_every_metric_exists_and_every_catalogue_metric_is_shown_or_excused():
    recorded = {r["record"]: r["expr"] for r in recording_rules(MixinConfig())}
    shown: set[str] = set()
    for spec in specs(MixinConfig()):
        d = build(spec)
        text = "\n".join(exprs(d) + [v.get("query", "") if isinstance(v.get("query"), str) else ""
                                     for v in d["templating"]["list"]])
        for name in RECORDED.findall(text):
            assert name in recorded, f"{spec.uid}: {name} is never recorded"
            text += "\n" + recorded[name]
        for name in RECORDED.findall(text):  # recording rules built on recording rules
            text += "\n" + recorded[name]
        for name in set(re.findall(r"\b(grpo_[a-z0-9_]+)", RECORDED.sub("", text))):
            shown.add(family_of(name).name)  # KeyError: not in the catalogue
    catalogue = {m.name for m in CATALOG}
    assert set(NOT_SHOWN) <= catalogue
    assert catalogue - shown - set(NOT_SHOWN) == set(), "neither shown nor listed in NOT_SHOWN"


def test_every_query_runs_on_a_real_prometheus_fed_by_a_monitor(tmp_path):
    fast = MixinConfig(time_scale=0.01)
    for name, text in rules_outputs(fast).items():
        (tmp_path / name).write_text(text)
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text('grpo_engine_logprob_gap_mean_nats: 0.0004\ngrpo_pass_at_k_ratio{k="8"}: 0.6\n')
    # Prometheus stops before the exporter closes: nobody is left to scrape the end, so no linger
    with GRPOMonitor(run="dash", group_size=8, port=0, guard="off", log_ratio_clamp=20.0, moe_experts=8,
                     reference_baseline=str(baseline), close_linger_s=0.0, recorder_dir=tmp_path / "incidents") as mon:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [grpo-recording.rules.yml, grpo-alerts.rules.yml]\n"
            f"scrape_configs:\n- job_name: grpo\n  static_configs: [{{targets: ['127.0.0.1:{mon.port}']}}]\n"
        )
        stop = threading.Event()
        fed: list[int] = []
        mon.publish_check(mask_table([1, 2], [1, 1], [0, 1], ["prompt", "completion"]))  # preflight, before training

        def train() -> None:  # training goes on while someone reads the dashboards, as in real life
            model = torch.nn.Linear(4, 3)
            step = 0
            while not stop.is_set():
                x = make_batch(step % 4).inputs()
                rollout = rollout_kwargs(x)
                rollout["tool_mask"] = torch.zeros_like(rollout["loss_mask"])  # multi-turn, one turn so far
                experts = torch.randint(0, 8, (*rollout["loss_mask"].shape, 3, 2),
                                        generator=torch.Generator().manual_seed(step))
                rollout |= {"routed_experts": experts, "rollout_routed_experts": experts.roll(1, dims=0),
                            "routing_replay": False}  # an MoE model
                if step == 3:  # one NaN reward: the flight recorder writes an incident (the evidence panel)
                    rollout["rewards"] = rollout["rewards"].clone().index_fill_(0, torch.tensor([5]), float("nan"))
                mon.observe_rollout(step, **rollout, prompt_ids=torch.arange(48) // 8, tool_calls=60, tool_failures=3,
                                    dropped_stale_total=2 * step, generated_groups=9, filtered_all_correct_groups=2,
                                    filtered_all_incorrect_groups=1)
                mon.observe_update(step, **update_kwargs(x), policy_version=step + 1, rollout_policy_version=step)
                model(torch.randn(5, 4)).square().sum().backward()
                mon.clip_grad_norm_(model.parameters(), 0.5)
                mon.observe_retrieval(step, torch.randn(48, 6), torch.arange(48) // 8)
                mon.observe_regression(step, torch.rand(64) < 0.9)
                step += 1
                fed.append(step)
                stop.wait(0.3)

        trainer = threading.Thread(target=train, daemon=True)
        try:
            with prometheus(config, tmp_path) as base:
                trainer.start()
                time.sleep(16)  # a few dozen steps across ~16 scrapes and rule evaluations
                assert len(fed) >= 24
                empty: list[str] = []
                for spec in specs(MixinConfig()):
                    for panel in panels(build(spec)):
                        series = 0
                        for target in panel["targets"]:
                            expr = (target["expr"].replace("$__rate_interval", "10s").replace("$__range", "1m")
                                    .replace("$job", "grpo").replace("$run", "dash"))
                            answer = prometheus_query(base, expr)
                            assert answer["status"] == "success", (panel["title"], expr, answer)
                            series += len(answer["data"]["result"])
                        if series == 0:
                            empty.append(f"{spec.uid}: {panel['title']}")
                assert empty == []
        finally:
            stop.set()
            if trainer.is_alive():
                trainer.join(timeout=10)


def test_every_panel_query_is_filtered_by_job_and_run():
    """Each series selector of every panel (raw, recorded, ALERTS) carries the dashboard's $job and $run: a
    single-run board never shows another run (recorded series used to ignore the variables)."""
    from grpo_exporter.mixin.panels import _SELECTOR, scoped

    selectors = 0
    for spec in specs(MixinConfig()):
        for row in spec.rows:
            for panel in row.panels:
                for query in panel.queries:
                    for match in _SELECTOR.finditer(query.expr):
                        selectors += 1
                        assert match[2] is not None, (panel.title, query.expr)
                        assert 'job=~"$job"' in match[2], (panel.title, query.expr)
                        assert 'run=~"$run"' in match[2], (panel.title, query.expr)
    assert selectors > 40
    assert scoped("run:x:window_ratio > 1") == 'run:x:window_ratio{job=~"$job",run=~"$run"} > 1'
    assert scoped('grpo_y{bound="upper"}[5m]') == 'grpo_y{bound="upper",job=~"$job",run=~"$run"}[5m]'
    assert scoped('grpo_ref{metric="grpo_z"}') == 'grpo_ref{metric="grpo_z",job=~"$job",run=~"$run"}'
