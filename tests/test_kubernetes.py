"""The Kubernetes path works as written: the manifests pass the Kubernetes and Prometheus Operator schemas,
follow the config (namespace, pod labels, scrape job, step seconds, the Prometheus selector labels, the scrape's
TLS and basic-auth Secrets, the pods' namespaces), leave the namespace out of the folder `kubectl delete -f`
reads, and the AlertmanagerConfig, merged into an Alertmanager config the way the operator merges it, routes our
alerts in a real Alertmanager and mutes along the signal chain; kube-prometheus-stack's InfoInhibitor, which
would mute our info alerts, is named with its fix."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest
import yaml

import k8s_schemas
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.dashboards import dashboard_files
from grpo_exporter.mixin.kubernetes import HEADER, NAMESPACE_FILE, info_inhibitor_note, manifests, retire_old_files
from services import Webhook, alertmanager, post_json, wait_for
from stand_ins import HTTPStandIn

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "deploy" / "kubernetes"
README = COMMITTED / "README.md"
MINE = MixinConfig(namespace="rl-team", pod_labels={"app.kubernetes.io/name": "qwen-grpo"}, selector='job="grpo-train"',
                   serving_label="example.org/metrics", prometheus_selector_labels={"release": "prom"},
                   step_seconds=600, exporter_port=9100)


@pytest.mark.parametrize("path", sorted(COMMITTED.rglob("*.yaml")), ids=lambda p: str(p.relative_to(COMMITTED)))
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
    assert docs[NAMESPACE_FILE]["kind"] == "Namespace"
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


def test_the_namespace_is_not_in_the_folder_kubectl_deletes():
    """`kubectl delete -f deploy/kubernetes/` reads the folder's own files only: none of them is the Namespace,
    which lies in namespace/ (applied only when asked), so deleting the manifests leaves the namespace."""
    top = [yaml.safe_load(p.read_text()) for p in COMMITTED.glob("*.yaml")]
    assert top
    assert all(d["kind"] != "Namespace" for d in top)
    assert not (COMMITTED / "00-namespace.yaml").exists()
    namespace = yaml.safe_load((COMMITTED / NAMESPACE_FILE).read_text())
    assert namespace["kind"] == "Namespace"
    assert namespace["metadata"]["name"] == "grpo"
    assert NAMESPACE_FILE.startswith("namespace/")
    docs = manifests(MINE, {})
    assert [n for n, d in docs.items() if d["kind"] == "Namespace"] == [NAMESPACE_FILE]
    assert all("/" not in n for n in docs if n != NAMESPACE_FILE)


def test_the_readme_creates_the_namespace_before_applying_and_never_deletes_recursively():
    lines = [line.strip() for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
             for line in block.splitlines()]
    kubectl = [line for line in lines if line.startswith("kubectl") and "deploy/kubernetes" in line]
    assert kubectl.index("kubectl apply -f deploy/kubernetes/namespace/") < \
        kubectl.index("kubectl apply -f deploy/kubernetes/") < kubectl.index("kubectl delete -f deploy/kubernetes/")
    assert lines.index("kubectl create namespace rl-team") < lines.index("kubectl apply -f deploy/kubernetes/")
    # the scrape's Secrets exist before the PodMonitor that names them
    secrets = [i for i, line in enumerate(lines) if "create secret" in line]
    assert secrets
    assert max(secrets) < lines.index("kubectl apply -f deploy/kubernetes/")
    assert not [line for line in kubectl if re.search(r"\s(-R|--recursive)\b", line)]


def test_regenerating_removes_the_old_namespace_file_but_not_a_hand_written_one(tmp_path):
    old = tmp_path / "00-namespace.yaml"
    old.write_text(HEADER + "apiVersion: v1\nkind: Namespace\nmetadata: {name: grpo}\n")
    assert [p for p, _ in retire_old_files(tmp_path, MixinConfig())] == [old]
    assert not old.exists()
    old.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: grpo}\n")  # someone's own file stays
    assert retire_old_files(tmp_path, MixinConfig()) == []
    assert old.exists()
    service = tmp_path / "service.yaml"
    service.write_text(HEADER + "kind: Service\n")
    assert retire_old_files(tmp_path, MixinConfig()) == []
    assert service.exists()
    removed = retire_old_files(tmp_path, MixinConfig(pod_namespaces=["rl-team"]))
    assert [p for p, _ in removed] == [service]
    assert "pod_namespaces" in removed[0][1]


def _endpoint(c: MixinConfig) -> dict[str, Any]:
    monitor = manifests(c, {})["podmonitor.yaml"]
    k8s_schemas.validate(monitor)
    endpoint: dict[str, Any] = monitor["spec"]["podMetricsEndpoints"][0]
    return endpoint


SECURED = {"namespace": "rl-team",
           "scrape_tls_ca": {"name": "grpo-exporter-ca", "key": "ca.crt"},
           "scrape_basic_auth_username": {"name": "grpo-exporter-scrape", "key": "username"},
           "scrape_basic_auth_password": {"name": "grpo-exporter-scrape", "key": "password"}}


def test_the_pod_monitor_scrapes_https_and_basic_auth_exactly_when_configured():
    plain = _endpoint(MixinConfig())
    assert not {"scheme", "tlsConfig", "basicAuth"} & set(plain)
    both = _endpoint(MixinConfig(**SECURED))
    assert both["scheme"] == "https"
    # verified against the CA for the Service's name (pods are scraped by IP); never insecureSkipVerify
    assert both["tlsConfig"] == {"ca": {"secret": {"name": "grpo-exporter-ca", "key": "ca.crt"}},
                                 "serverName": "grpo-exporter.rl-team.svc"}
    assert both["basicAuth"] == {"username": {"name": "grpo-exporter-scrape", "key": "username"},
                                 "password": {"name": "grpo-exporter-scrape", "key": "password"}}
    assert {k: v for k, v in both.items() if k not in ("scheme", "tlsConfig", "basicAuth")} == plain
    tls = _endpoint(MixinConfig(scrape_tls_ca=SECURED["scrape_tls_ca"], scrape_tls_server_name="metrics.example.org"))
    assert tls["tlsConfig"]["serverName"] == "metrics.example.org"
    assert "basicAuth" not in tls
    auth = _endpoint(MixinConfig(scrape_basic_auth_username=SECURED["scrape_basic_auth_username"],
                                 scrape_basic_auth_password=SECURED["scrape_basic_auth_password"]))
    assert "basicAuth" in auth
    assert not {"scheme", "tlsConfig"} & set(auth)


def test_the_schema_checks_the_scrape_credentials():
    """The CRD schema holds the fields we write: a password given as a value is refused."""
    monitor = manifests(MixinConfig(**SECURED), {})["podmonitor.yaml"]
    monitor["spec"]["podMetricsEndpoints"][0]["basicAuth"]["password"] = "hunter2"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'object'"):
        k8s_schemas.validate(monitor)
    monitor = manifests(MixinConfig(**SECURED), {})["podmonitor.yaml"]
    monitor["spec"]["podMetricsEndpoints"][0]["tlsConfig"]["ca"]["secret"]["value"] = "-----BEGIN"
    with pytest.raises(jsonschema.ValidationError, match="value"):
        k8s_schemas.validate(monitor)


@pytest.mark.parametrize(("given", "named"), [
    ({"scrape_tls_ca": {"name": "Grpo_CA", "key": "ca.crt"}}, "scrape_tls_ca.name"),
    ({"scrape_tls_ca": {"name": "grpo-ca", "key": "ca crt"}}, "scrape_tls_ca.key"),
    ({"scrape_tls_ca": {"name": "grpo-ca"}}, "scrape_tls_ca.key"),
    ({"scrape_tls_ca": "grpo-ca"}, "scrape_tls_ca"),
    ({"scrape_basic_auth_username": {"name": "a", "key": "u"},
      "scrape_basic_auth_password": {"name": "a", "key": "p", "value": "hunter2"}}, "scrape_basic_auth_password.value"),
    ({"scrape_basic_auth_username": {"name": "a", "key": "u"}},
     "scrape_basic_auth_username and scrape_basic_auth_password: expected both or neither"),
    ({"scrape_tls_server_name": "grpo.example.org"}, "scrape_tls_server_name: set only with scrape_tls_ca"),
    ({"pod_namespaces": ["rl-team", "RL"]}, "pod_namespaces: expected Kubernetes namespaces"),
    ({"pod_namespaces": ["rl-team", "rl-team"]}, "pod_namespaces: expected each namespace once"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_scrape_settings_are_refused_by_name(given, named):
    with pytest.raises(pydantic.ValidationError, match=re.escape(named)):
        MixinConfig.model_validate(given)


def test_pod_namespaces_select_pods_elsewhere_and_drop_the_service():
    assert "namespaceSelector" not in manifests(MixinConfig(), {})["podmonitor.yaml"]["spec"]
    c = MixinConfig(namespace="grpo-monitoring", pod_namespaces=["rl-team", "rl-research"])
    docs = manifests(c, {})
    monitor = docs["podmonitor.yaml"]
    k8s_schemas.validate(monitor)
    assert monitor["metadata"]["namespace"] == "grpo-monitoring"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["rl-team", "rl-research"]}
    # a Service selects its own namespace's pods only: none would be found
    assert "service.yaml" not in docs
    rules = [r for g in docs["prometheusrule.yaml"]["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert {r["labels"]["namespace"] for r in rules} == {"grpo-monitoring"}  # the namespace the routing matches
    own = manifests(MixinConfig(namespace="rl-team", pod_namespaces=["rl-team"]), {})
    assert "service.yaml" in own
    assert own["podmonitor.yaml"]["spec"]["namespaceSelector"] == {"matchNames": ["rl-team"]}


def test_the_info_inhibitor_note_names_every_info_alert_and_the_fix():
    rules = [r for g in manifests(MINE, {})["prometheusrule.yaml"]["spec"]["groups"] for r in g["rules"]]
    info = [r["alert"] for r in rules if r.get("labels", {}).get("severity") == "info"]
    assert {"GRPOEngineLogprobGapCleanLevelHigh", "GRPOKLToReferenceZero",
            "GRPOStepCadenceSlowerThanConfigured"} <= set(info)
    note = info_inhibitor_note(MINE)
    assert "\n" not in note
    assert all(name in note for name in info)
    assert "namespace rl-team" in note
    assert "defaultRules.disabled.InfoInhibitor: true" in note
    assert info_inhibitor_note(MixinConfig(severities=dict.fromkeys(info, "warning"))) == ""  # none to mute
    readme = README.read_text()
    pitfalls = readme[readme.index("## Pitfalls"):]
    for key in ("defaultRules.disabled.InfoInhibitor", "alertmanager.config.inhibit_rules",
                "--set defaultRules.disabled.InfoInhibitor=true", "alertname = InfoInhibitor"):
        assert key in pitfalls, key


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
    assert "receivers.pager and receivers.default and receivers.watchdog have no integration" in done.stderr
    rule = yaml.safe_load((tmp_path / "k8s" / "prometheusrule.yaml").read_text())
    assert any("[50m]" in r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])
    config.write_text("selector: 'cluster=\"a\"'\n")
    done = subprocess.run([sys.executable, "-m", "grpo_exporter.cli", "kubernetes", "--config", str(config),
                           "--out", str(tmp_path / "k8s2")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert 'selector: the Kubernetes manifests need a job="NAME" matcher' in done.stderr


def test_the_command_retires_the_old_namespace_file_and_notes_the_info_inhibitor(tmp_path):
    out = tmp_path / "k8s"
    out.mkdir()
    (out / "00-namespace.yaml").write_text(HEADER + "apiVersion: v1\nkind: Namespace\nmetadata: {name: grpo}\n")
    done = subprocess.run([sys.executable, "-m", "grpo_exporter.cli", "kubernetes", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert not (out / "00-namespace.yaml").exists()
    assert f"removed {out / '00-namespace.yaml'}: the Namespace is now {NAMESPACE_FILE}" in done.stderr
    assert (out / NAMESPACE_FILE).read_text() == (COMMITTED / NAMESPACE_FILE).read_text()
    assert info_inhibitor_note(MixinConfig()) + "\n" in done.stderr


def _operator_integrations(receiver: dict[str, Any], secrets: dict[tuple[str, str], str]) -> dict[str, Any]:
    """A receiver's webhook and Slack configs as the operator writes them, each Secret reference read from
    ``secrets`` ((name, key) -> value) as the operator reads the Secret."""
    def read(ref: dict[str, str]) -> str:
        return secrets[(ref["name"], ref["key"])]

    snake = {"sendResolved": "send_resolved", "titleLink": "title_link"}
    out: dict[str, Any] = {}
    if receiver.get("webhookConfigs"):
        out["webhook_configs"] = [{"url": read(w["urlSecret"]), "send_resolved": w["sendResolved"]}
                                  for w in receiver["webhookConfigs"]]
    if receiver.get("slackConfigs"):
        out["slack_configs"] = [{"api_url": read(one["apiURL"]),
                                 **{snake.get(k, k): v for k, v in one.items() if k != "apiURL"}}
                                for one in receiver["slackConfigs"]]
    return out


def operator_merge(resource: dict[str, Any], secrets: dict[tuple[str, str], str]) -> dict[str, Any]:
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
    receivers = [{"name": prefix + r["name"], **_operator_integrations(r, secrets)} for r in spec["receivers"]]
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
    """Through the operator's merge, with every secret read from a Secret (the manifest carries none): a critical
    pages the pager's webhook, a warning reaches Slack in our words, a muted or foreign alert goes nowhere."""
    hook, slack = Webhook(), HTTPStandIn()
    try:
        c = MixinConfig.model_validate({"time_scale": 0.02, "receivers": {
            "pager": {"webhook": {}}, "default": {"slack": {"channel": "#grpo"}}}})
        docs = manifests(c, {})
        k8s_schemas.validate(docs["alertmanagerconfig.yaml"])
        text = yaml.safe_dump(docs["alertmanagerconfig.yaml"])
        assert "127.0.0.1" not in text
        assert "url: " not in text
        secrets = {("grpo-alertmanager", "pager-webhook-url"): f"{hook.url}/pager",
                   ("grpo-alertmanager", "default-slack-api-url"): f"{slack.url}/slack"}
        rules = [r for g in docs["prometheusrule.yaml"]["spec"]["groups"] for r in g["rules"]]
        path = tmp_path / "alertmanager.yml"
        path.write_text(yaml.safe_dump(operator_merge(docs["alertmanagerconfig.yaml"], secrets)))
        with alertmanager(path, tmp_path) as url:
            post_json(f"{url}/api/v2/alerts", [
                _firing(rules, "GRPOLossMaskMismatch", "A"),
                _firing(rules, "GRPOESSDrop", "A"),       # behind run A's layer-1 gate: muted
                _firing(rules, "GRPOESSDrop", "B"),
                _firing(rules, "GRPORewardCliff", "C", namespace=False),  # not this namespace's: not ours to route
            ])
            wait_for("the page and the Slack message", lambda: hook.alerts() and slack.under("/slack"), timeout=20)
            time.sleep(3)  # past group_wait (1 s): a muted or unrouted alert, posted with the rest, would have come
            got = {(p, a["labels"]["alertname"], a["labels"]["run"]) for p, a in hook.alerts()}
            assert got == {("/pager", "GRPOLossMaskMismatch", "A")}
            [message] = [m.body for m in slack.under("/slack")]
            assert message["channel"] == "#grpo"
            assert message["attachments"][0]["title"] == "[FIRING:1] GRPOESSDrop · layer 3-samples · run B"
    finally:
        hook.close()
        slack.close()


#: kube-prometheus-stack's default inhibition for its InfoInhibitor alert (`alertmanager.config.inhibit_rules`)
CHART_INFO_INHIBITION = {"source_matchers": ["alertname = InfoInhibitor"], "target_matchers": ["severity = info"],
                         "equal": ["namespace"]}


def test_the_chart_info_inhibitor_mutes_our_info_alerts_until_the_documented_matcher(tmp_path):
    """The pitfall and the README's second fix, in a real Alertmanager: the chart's inhibition mutes our info
    alert in a namespace where only the InfoInhibitor fires; with the README's ``namespace != "rl-team"`` added
    to its targets ours is delivered and another namespace's info alert stays muted."""
    excluded = 'namespace != "rl-team"'
    assert excluded in README.read_text()
    rules = [r for g in manifests(MINE, {})["prometheusrule.yaml"]["spec"]["groups"] for r in g["rules"]]
    ours = _firing(rules, "GRPOKLToReferenceZero", "A")
    theirs = {**ours, "labels": {"alertname": "CPUThrottlingHigh", "severity": "info", "namespace": "other"}}
    inhibitors = [{**ours, "labels": {"alertname": "InfoInhibitor", "severity": "none", "namespace": ns}}
                  for ns in ("rl-team", "other")]
    hook = Webhook()
    try:
        for name, target, want in (("chart", [], set()), ("fixed", [excluded], {"GRPOKLToReferenceZero"})):
            inhibition = {**CHART_INFO_INHIBITION,
                          "target_matchers": [*CHART_INFO_INHIBITION["target_matchers"], *target]}
            config = {"route": {"receiver": "hook", "group_by": ["alertname", "namespace"], "group_wait": "1s",
                                "group_interval": "1s"},
                      "receivers": [{"name": "hook", "webhook_configs": [{"url": f"{hook.url}/{name}"}]}],
                      "inhibit_rules": [inhibition]}
            (tmp_path / name).mkdir()
            path = tmp_path / name / "alertmanager.yml"
            path.write_text(yaml.safe_dump(config))
            with alertmanager(path, tmp_path / name) as url:
                # the InfoInhibitor fires before (and as long as) the info alerts, as the chart's rule does
                for alerts, wanted in ((inhibitors, {"InfoInhibitor"}), ([ours, theirs], {"InfoInhibitor", *want})):
                    post_json(f"{url}/api/v2/alerts", alerts)
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline and wanted - {
                            a["labels"]["alertname"] for p, a in hook.alerts() if p == f"/{name}"}:
                        time.sleep(0.2)
                time.sleep(3)  # past group_wait (1 s): a muted alert, posted with the rest, would have come
            got = {a["labels"]["alertname"] for p, a in hook.alerts() if p == f"/{name}"}
            assert got == {"InfoInhibitor", *want}, name
    finally:
        hook.close()
