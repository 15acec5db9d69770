"""Deploy targets: every Prometheus config passes promtool, every Alertmanager config amtool, and the
Kubernetes manifests parse and carry the generated rules and dashboards unchanged."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from grpo_exporter.metric_docs import series_per_run
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.dashboards import dashboard_files
from grpo_exporter.mixin.kubernetes import manifest_files
from grpo_exporter.mixin.rules import rule_files
from grpo_exporter.runtime.monitor_config import MonitorConfig
from services import binary

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


PROMETHEUS_CONFIGS = sorted(p for p in DEPLOY.rglob("prometheus.yml") if "grafana" not in p.parts)


@pytest.mark.parametrize("config", PROMETHEUS_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_promtool_check_config(config):
    done = subprocess.run([binary("promtool"), "check", "config", config.name], cwd=config.parent,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@pytest.mark.parametrize("config", sorted(DEPLOY.rglob("alertmanager*.yml")), ids=lambda p: p.name)
def test_amtool_check_config(config):
    done = subprocess.run([binary("amtool"), "check-config", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_manifests_are_generated_and_carry_the_rules_unchanged():
    c = MixinConfig()
    for name, text in manifest_files(c, dashboard_files(c)).items():
        assert (DEPLOY / "kubernetes" / name).read_text() == text, f"{name} drifted: run `grpo-exporter kubernetes`"
    docs = {p.name: yaml.safe_load(p.read_text()) for p in (DEPLOY / "kubernetes").glob("*.yaml")}
    # the Namespace lies in namespace/, which `kubectl delete -f deploy/kubernetes/` does not read
    assert {d["kind"] for d in docs.values()} == {"PrometheusRule", "AlertmanagerConfig", "ConfigMap", "Service",
                                                  "PodMonitor"}
    committed_groups = [g for n in ("grpo-recording.rules.yml", "grpo-alerts.rules.yml")
                        for g in yaml.safe_load((ROOT / "rules" / n).read_text())["groups"]]
    # the same rules, each alert labelled with the namespace the AlertmanagerConfig routes
    carried = docs["prometheusrule.yaml"]["spec"]["groups"]
    for group in carried:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"].pop("namespace") == "grpo"
    assert carried == committed_groups
    assert committed_groups == [g for doc in rule_files(c).values() for g in doc["groups"]]
    data = docs["dashboards-configmap.yaml"]["data"]
    for name in data:
        assert data[name] == (ROOT / "dashboards" / name).read_text()
    service, monitor = docs["service.yaml"], docs["podmonitor.yaml"]
    assert service["spec"]["ports"][0]["port"] == 9887
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # only the serving rank's pod is a target: the other ranks serve nothing and would page for ever
    assert monitor["spec"]["selector"]["matchLabels"]["grpo-exporter/serving"] == "true"
    assert service["spec"]["selector"]["grpo-exporter/serving"] == "true"


def test_compose_mounts_the_generated_files():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana"}
    for service in services.values():
        assert re.search(r":v?\d+\.\d+\.\d+$", service["image"]), service["image"]  # pinned tags
    mounts = [v.split(":")[0] for s in services.values() for v in s.get("volumes", [])]
    for mount in mounts:
        assert (DEPLOY / mount).exists(), mount


def test_scale_page_states_the_series_count_of_the_code():
    count = sum(series_per_run(MonitorConfig(run="r", group_size=16)).values())
    assert f"**{count}**" in (ROOT / "docs" / "scale.md").read_text()
