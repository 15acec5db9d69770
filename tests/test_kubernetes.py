"""The Kubernetes path works as written: the manifests pass the Kubernetes and Prometheus Operator schemas,
follow the config (namespace, pod labels, scrape job, step seconds, the Prometheus selector labels), and the
AlertmanagerConfig, merged into an Alertmanager config the way the operator merges it, routes our alerts in a
real Alertmanager and mutes along the signal chain."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import k8s_schemas
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.dashboards import dashboard_files
from grpo_exporter.mixin.kubernetes import manifests
from services import Webhook, alertmanager, post_json

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "deploy" / "kubernetes"
MINE = MixinConfig(namespace="rl-team", pod_labels={"app.kubernetes.io/name": "qwen-grpo"}, selector='job="grpo-train"',
                   serving_label="example.org/metrics", prometheus_selector_labels={"release": "prom"},
                   step_seconds=600, exporter_port=9100)


@pytest.mark.parametrize("path", sorted(COMMITTED.glob("*.yaml")), ids=lambda p: p.name)
def test_committed_manifests_pass_the_schemas(path):
    k8s_schemas.validate(yaml.safe_load(path.read_text()))


def test_the_schemas_reject_what_kubectl_would():
    """The validation can fail: a snake_case key in the operator's camelCase schema, a matcher as a string."""
    docs = {p.name: yaml.safe_load(p.read_text()) for p in COMMITTED.glob("*.yaml")}
    bad = docs["alertmanagerconfig.yaml"]
    bad["spec"]["route"]["group_by"] = bad["spec"]["route"].pop("groupBy")
    with pytest.raises(jsonschema.ValidationError, match="group_by"):
        k8s_schemas.validate(bad)
    bad = docs["alertmanagerconfig.yaml"]
    bad["spec"]["route"] = {"receiver": "pager", "routes": [{"receiver": "pager", "matchers": ['severity="x"']}]}
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'object'"):
        k8s_schemas.validate(bad)
    bad = docs["service.yaml"]
    bad["spec"]["ports"][0]["port"] = "9887"
    with pytest.raises(jsonschema.ValidationError):
        k8s_schemas.validate(bad)


def test_manifests_follow_the_config():
    docs = manifests(MINE, dashboard_files(MINE))
    for doc in docs.values():
        k8s_schemas.validate(doc)
        assert doc["metadata"].get("namespace", doc["metadata"]["name"]) == "rl-team"
    assert docs["00-namespace.yaml"]["kind"] == "Namespace"
    assert min(docs) == "00-namespace.yaml"  # kubectl apply -f takes the folder's files in order
    monitor, service = docs["podmonitor.yaml"]["spec"], docs["service.yaml"]["spec"]
    serving = {"app.kubernetes.io/name": "qwen-grpo", "example.org/metrics": "true"}
    assert monitor["selector"]["matchLabels"] == serving == service["selector"]
    assert service["ports"][0]["port"] == 9100
    relabel = monitor["podMetricsEndpoints"][0]["relabelings"]
    assert relabel == [{"action": "replace", "targetLabel": "job", "replacement": "grpo-train"}]
    for name in ("podmonitor.yaml", "prometheusrule.yaml", "alertmanagerconfig.yaml"):
        assert docs[name]["metadata"]["labels"]["release"] == "prom"
    rules = [r for g in docs["prometheusrule.yaml"]["spec"]["groups"] for r in g["rules"]]
    assert all(r["labels"]["namespace"] == "rl-team" for r in rules if "alert" in r)
    assert all('job="grpo-train"' in r["expr"] for r in rules if r.get("alert") == "GRPOTrainingStalled")
    # sized for 10-minute steps: the rate window is 5 steps
    assert any("[50m]" in r["expr"] for r in rules)


def test_a_selector_without_a_job_is_refused_by_name():
    c = MixinConfig(selector='cluster="a"')
    with pytest.raises(ValueError, match=r'selector: the Kubernetes manifests need a job="NAME" matcher'):
        manifests(c, {})


def test_the_command_takes_step_seconds_and_warns_of_unset_receivers(tmp_path):
    config = tmp_path / "mine.yml"
    config.write_text('selector: \'job="grpo-train"\'\nnamespace: rl-team\n')
    done = subprocess.run([sys.executable, "-m", "grpo_exporter.cli", "kubernetes", "--config", str(config),
                           "--step-seconds", "600", "--out", str(tmp_path / "k8s")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "pager_webhook_url and default_webhook_url not set" in done.stderr
    rule = yaml.safe_load((tmp_path / "k8s" / "prometheusrule.yaml").read_text())
    assert any("[50m]" in r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])
    config.write_text("selector: 'cluster=\"a\"'\n")
    done = subprocess.run([sys.executable, "-m", "grpo_exporter.cli", "kubernetes", "--config", str(config),
                           "--out", str(tmp_path / "k8s2")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert 'selector: the Kubernetes manifests need a job="NAME" matcher' in done.stderr


def operator_merge(resource: dict[str, Any]) -> dict[str, Any]:
    """The Alertmanager config the Prometheus Operator writes for one AlertmanagerConfig under its default
    matcher strategy (OnNamespace): receivers renamed ``<namespace>/<name>/<receiver>``, the resource's route a
    sub-route of the global one with a ``namespace`` matcher and ``continue: true``, and the ``namespace``
    matcher on both sides of every inhibition (pkg/alertmanager/amcfg.go of the operator)."""
    namespace, name = resource["metadata"]["namespace"], resource["metadata"]["name"]
    spec, prefix, ns = resource["spec"], f"{namespace}/{name}/", f'namespace="{namespace}"'

    def matchers(items: list[dict[str, str]]) -> list[str]:
        return [f'{m["name"]}{m.get("matchType", "=")}"{m["value"]}"' for m in items]

    def route(r: dict[str, Any]) -> dict[str, Any]:
        snake = {"groupBy": "group_by", "groupWait": "group_wait", "groupInterval": "group_interval",
                 "repeatInterval": "repeat_interval"}
        out: dict[str, Any] = {snake[k]: v for k, v in r.items() if k in snake}
        out["receiver"] = prefix + r["receiver"]
        out["matchers"] = matchers(r.get("matchers", []))
        if r.get("routes"):
            out["routes"] = [route(sub) for sub in r["routes"]]
        return out

    top = route(spec["route"]) | {"continue": True}
    top["matchers"] = [ns, *top["matchers"]]
    receivers = [{"name": prefix + r["name"],
                  **({"webhook_configs": [{"url": w["url"], "send_resolved": w["sendResolved"]}
                                          for w in r["webhookConfigs"]]} if r.get("webhookConfigs") else {})}
                 for r in spec["receivers"]]
    return {
        "route": {"receiver": "null", "group_wait": "0s", "routes": [top]},
        "receivers": [{"name": "null"}, *receivers],
        "inhibit_rules": [{"source_matchers": [ns, *matchers(rule["sourceMatch"])],
                           "target_matchers": [ns, *matchers(rule["targetMatch"])], "equal": rule["equal"]}
                          for rule in spec["inhibitRules"]],
    }


def _firing(rules: list[dict[str, Any]], alert: str, run: str, namespace: bool = True) -> dict[str, Any]:
    """An alert as Prometheus sends it for one of the PrometheusRule's rules: its labels, the run's."""
    labels = next(r["labels"] for r in rules if r.get("alert") == alert)
    if not namespace:
        labels = {k: v for k, v in labels.items() if k != "namespace"}
    now = dt.datetime.now(dt.UTC)
    return {"labels": {"alertname": alert, "job": "grpo", "run": run, **labels},
            "annotations": {"summary": alert}, "startsAt": now.isoformat(),
            "endsAt": (now + dt.timedelta(hours=1)).isoformat()}


def test_the_alertmanager_config_routes_our_alerts_through_the_operator(tmp_path):
    hook = Webhook()
    try:
        c = MixinConfig(time_scale=0.02, pager_webhook_url=f"{hook.url}/pager",
                        default_webhook_url=f"{hook.url}/default")
        docs = manifests(c, {})
        k8s_schemas.validate(docs["alertmanagerconfig.yaml"])
        rules = [r for g in docs["prometheusrule.yaml"]["spec"]["groups"] for r in g["rules"]]
        path = tmp_path / "alertmanager.yml"
        path.write_text(yaml.safe_dump(operator_merge(docs["alertmanagerconfig.yaml"])))
        with alertmanager(path, tmp_path) as url:
            post_json(f"{url}/api/v2/alerts", [
                _firing(rules, "GRPOLossMaskMismatch", "A"),
                _firing(rules, "GRPOESSDrop", "A"),       # behind run A's layer-1 gate: muted
                _firing(rules, "GRPOESSDrop", "B"),
                _firing(rules, "GRPORewardCliff", "C", namespace=False),  # not this namespace's: not ours to route
            ])
            want = {("/pager", "GRPOLossMaskMismatch", "A"), ("/default", "GRPOESSDrop", "B")}
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not want <= {
                    (p, a["labels"]["alertname"], a["labels"]["run"]) for p, a in hook.alerts()}:
                time.sleep(0.2)
            time.sleep(3)  # past group_wait and group_interval: a muted or unrouted alert would have arrived
            got = {(p, a["labels"]["alertname"], a["labels"]["run"]) for p, a in hook.alerts()}
            assert got == want
    finally:
        hook.close()
