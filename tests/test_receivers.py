"""The receivers deliver, through a real Alertmanager, to local stand-ins of Slack, PagerDuty (Events v2), Opsgenie,
an SMTP server and a webhook: each gets the payload its service accepts, one notification per alert group, the
resolved message, and a page a person can act on from a phone (alert, run and layer in the title; the value
against its baseline, whether to stop training, the incident, an absolute runbook link and a dashboard link with
the run and the hour before the alert selected). Secrets are read from files and never written into the
generated file."""

from __future__ import annotations

import datetime as dt
import subprocess
import time
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

import k8s_schemas
from grpo_exporter.mixin.config import PROJECT_URL, RUNBOOKS, MixinConfig
from grpo_exporter.mixin.kubernetes import manifests
from grpo_exporter.mixin.messages import STOP, _stop_template, plain, stop_advice, stop_kind
from grpo_exporter.mixin.receiver_configs import notes
from grpo_exporter.mixin.render import alertmanager_output
from grpo_exporter.mixin.rules import alerts
from services import alertmanager, binary, post_json, wait_for
from stand_ins import HTTPStandIn, SMTPStandIn

GRAFANA = "https://grafana.example.org"
SECRETS = {"pager-slack-api-url": None, "pager-pagerduty-routing-key": "R0UT1NGKEY0000000000000000000000",
           "default-opsgenie-api-key": "0pS-K3Y", "default-email-auth-password": "smtp-s3cret"}
INCIDENT = ("Flight recorder: incident incident-s000000005-20261130T170348Z-r0 (first anomalous step 5) in "
            "/data/grpo-incidents; read it with `grpo-exporter inspect`.")


def _config(api: HTTPStandIn, smtp: SMTPStandIn, secrets: Path) -> MixinConfig:
    return MixinConfig.model_validate({
        "time_scale": 0.02, "grafana_url": GRAFANA, "secrets_dir": str(secrets),
        "receivers": {
            "pager": {"slack": {"channel": "#grpo-pages"}, "pagerduty": {"url": f"{api.url}/v2/enqueue"}},
            "default": {"opsgenie": {"api_url": f"{api.url}/opsgenie/"},
                        "email": {"to": "oncall@example.org", "from": "grpo@example.org",
                                  "smarthost": smtp.smarthost, "auth_username": "grpo", "require_tls": False}},
            "watchdog": {"webhook": {"url": f"{api.url}/watchdog"}},
        },
    })


def _alert(name: str, run: str, starts: dt.datetime, ends: dt.datetime, **labels: str) -> dict[str, Any]:
    """An alert as Prometheus sends it: the generated rule's labels and annotations, its description as the rule
    renders it for run ``run`` (a value against its baseline, then the incident)."""
    rule = next(a.rule(MixinConfig()) for a in alerts(MixinConfig()) if a.name == name)
    where = f"Run {run}" + (f" rank {labels['rank']}" if "rank" in labels else "")
    return {"labels": {"alertname": name, "job": "grpo", "run": run, **rule["labels"], **labels},
            "annotations": {"summary": rule["annotations"]["summary"],
                            "description": f"{where}: 0.31 against a baseline of 0. {INCIDENT}",
                            "runbook_url": rule["annotations"]["runbook_url"]},
            "startsAt": starts.isoformat(), "endsAt": ends.isoformat()}


def _dashboard(uid: str, run: str, starts: dt.datetime) -> str:
    start_ms = int((starts - dt.timedelta(hours=1)).timestamp()) * 1000
    return f"{GRAFANA}/d/{uid}?var-job=grpo&var-run={urllib.parse.quote_plus(run)}&from={start_ms}&to=now"


FOREIGN = {"labels": {"alertname": "NodeDown", "severity": "critical", "instance": "node-7"},
           "annotations": {"summary": "Node node-7 is down."}}


@pytest.fixture(scope="module")
def delivered(tmp_path_factory):
    """Alertmanager with every integration, sent five critical groups (one alert of run a on seven ranks, the same
    alert of run b, a stall of run d, a reward cliff of run f, and another tool's NodeDown), a warning of run c and
    a notice of run e, which later resolve; yields the stand-ins and what was sent."""
    api, smtp = HTTPStandIn(), SMTPStandIn()
    tmp_path = tmp_path_factory.mktemp("receivers")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    values = {**SECRETS, "pager-slack-api-url": f"{api.url}/slack/T000/B000/XXXX"}
    for key, value in values.items():
        (secrets / key).write_text(value)  # as docs/receivers.md says: no newline (0.25 sends it to Opsgenie)
    config = _config(api, smtp, secrets)
    path = tmp_path / "alertmanager.yml"
    path.write_text(alertmanager_output(config))
    starts = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(minutes=3)
    later = starts + dt.timedelta(hours=2)
    firing = [*(_alert("GRPOLossMaskMismatch", "a", starts, later, rank=str(rank)) for rank in range(7)),
              _alert("GRPOLossMaskMismatch", "run b/2", starts, later),
              _alert("GRPOTrainingStalled", "d", starts, later),
              _alert("GRPORewardCliff", "f", starts, later),
              FOREIGN | {"startsAt": starts.isoformat(), "endsAt": later.isoformat()},
              _alert("GRPOESSDrop", "c", starts, later),  # run a's would be muted by its layer-1 gate
              _alert("GRPOKLToReferenceZero", "e", starts, later)]
    try:
        with alertmanager(path, tmp_path) as url:
            post_json(f"{url}/api/v2/alerts", firing)
            wait_for("a first notification from every integration", lambda: (len(api.under("/slack")) >= 5
                     and len(api.under("/v2/enqueue")) >= 5 and len(api.under("/opsgenie")) >= 2
                     and len(smtp.received()) >= 2) or None, timeout=30)
            time.sleep(7)  # past group_interval (6 s): a second notification of a group would have come; none may
            first = {"slack": api.under("/slack"), "pagerduty": api.under("/v2/enqueue"),
                     "opsgenie": api.under("/opsgenie"), "email": smtp.received()}
            now = dt.datetime.now(dt.UTC)
            post_json(f"{url}/api/v2/alerts", [a | {"endsAt": now.isoformat()} for a in firing])
            wait_for("the resolved messages", lambda: (len(api.under("/slack")) >= 10
                     and len(api.under("/v2/enqueue")) >= 10 and len(api.under("/opsgenie")) >= 4
                     and len(smtp.received()) >= 4) or None, timeout=30)
            yield {"first": first, "api": api, "smtp": smtp, "starts": starts, "file": path.read_text(),
                   "values": values, "config": config, "log": (tmp_path / "alertmanager.log").read_text()}
    finally:
        api.close()
        smtp.close()


def _slack(messages: list[Any]) -> dict[str, dict[str, Any]]:
    """Slack attachments by subject (the title after its ``[STATE]``)."""
    return {m.body["attachments"][0]["title"].split("] ", 1)[1]: m.body["attachments"][0] for m in messages}


def test_the_generated_file_passes_amtool_and_carries_no_secret(delivered):
    text = delivered["file"]
    for value in delivered["values"].values():
        assert value not in text
    assert "api_url_file:" in text
    assert "routing_key_file:" in text
    assert "api_key_file:" in text
    assert "auth_password_file:" in text
    path = Path(delivered["config"].secrets_dir).parent / "check.yml"
    path.write_text(text)
    done = subprocess.run([binary("amtool"), "check-config", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "template" not in delivered["log"].lower()  # no notification failed to render


def test_slack_gets_one_message_per_group_that_a_phone_can_act_on(delivered):
    slack = _slack(delivered["first"]["slack"])
    assert len(delivered["first"]["slack"]) == 5  # seven ranks of run a are one group; b, d, f, NodeDown one each
    page = slack["GRPOLossMaskMismatch · layer 1-gradient · run a"]
    assert page["title"] == "[FIRING:7] GRPOLossMaskMismatch · layer 1-gradient · run a"
    assert page["title_link"] == f"{RUNBOOKS}#grpolossmaskmismatch"
    assert page["color"] == "danger"
    assert delivered["first"]["slack"][0].body["channel"] == "#grpo-pages"
    dashboard = _dashboard("grpo-crash-triage", "a", delivered["starts"])
    lines = page["text"].splitlines()
    assert lines[0] == "The loss mask disagrees with the completions."
    assert lines[1:6] == [f"- Run a rank {rank}: 0.31 against a baseline of 0. {INCIDENT}" for rank in range(5)]
    assert lines[6:] == [
        "(5 of 7 alerts shown)",
        "Stop training? STOP: every step trains on a gradient that is not what you think; fix, then resume from the "
        "last checkpoint before the first evidence",
        f"Runbook: {RUNBOOKS}#grpolossmaskmismatch",
        f"Dashboard: {dashboard}",
    ]
    other = slack["GRPOLossMaskMismatch · layer 1-gradient · run run b/2"]["text"]
    assert f"Dashboard: {_dashboard('grpo-crash-triage', 'run b/2', delivered['starts'])}" in other
    assert len(delivered["api"].under("/slack")) == 10  # one resolved message a group
    resolved = _slack(delivered["api"].under("/slack")[5:])
    assert {a["title"].split("]")[0] for a in resolved.values()} == {"[RESOLVED"}
    assert {a["color"] for a in resolved.values()} == {"good"}
    assert "- RESOLVED: Run a rank 0: 0.31" in resolved["GRPOLossMaskMismatch · layer 1-gradient · run a"]["text"]


def test_another_tools_alert_gets_no_advice_and_no_broken_link(delivered):
    """An alert that is not ours, routed to the same receiver, says what it says of itself: no stop advice, no
    runbook or dashboard line."""
    page = _slack(delivered["first"]["slack"])["NodeDown · node-7"]  # no run: the target names it
    assert page["title"] == "[FIRING:1] NodeDown · node-7"
    assert page["text"] == "Node node-7 is down.\n- Node node-7 is down.\n"
    events = {e.body["payload"]["summary"]: e.body for e in delivered["first"]["pagerduty"]}
    assert events["NodeDown · node-7"]["links"] == [{"href": RUNBOOKS, "text": "Runbook"},
                                                    {"href": GRAFANA, "text": "Dashboard"}]  # never an empty href


def test_pagerduty_gets_events_v2_with_the_routing_key_from_its_file(delivered):
    assert len(delivered["first"]["pagerduty"]) == 5
    events = {e.body["payload"]["summary"]: e.body for e in delivered["first"]["pagerduty"]}
    event = events["GRPOLossMaskMismatch · layer 1-gradient · run a"]  # an incident's summary holds no state
    assert event["routing_key"] == SECRETS["pager-pagerduty-routing-key"]
    assert event["event_action"] == "trigger"
    assert event["payload"]["severity"] == "critical"
    details = event["payload"]["custom_details"]
    assert details["run"] == "a"
    assert details["layer"] == "1-gradient"
    assert details["firing"] == "7"
    assert "Stop training? STOP" in details["summary"]
    dashboard = _dashboard("grpo-crash-triage", "a", delivered["starts"])
    assert event["links"] == [{"href": f"{RUNBOOKS}#grpolossmaskmismatch", "text": "Runbook"},
                              {"href": dashboard, "text": "Dashboard"}]
    assert event["client_url"] == dashboard
    later = [e.body for e in delivered["api"].under("/v2/enqueue")[5:]]
    assert len(later) == 5
    assert {e["event_action"] for e in later} == {"resolve"}
    assert {e["dedup_key"] for e in later} == {e["dedup_key"] for e in events.values()}


def test_warnings_go_to_opsgenie_and_email_not_to_the_pager(delivered):
    first = delivered["first"]
    assert {title.split(" ·")[0] for title in _slack(first["slack"])} == {
        "GRPOLossMaskMismatch", "GRPOTrainingStalled", "GRPORewardCliff", "NodeDown"}
    assert len(first["opsgenie"]) == 2
    assert len(first["email"]) == 2
    [created] = [r for r in first["opsgenie"] if "run c" in r.body["message"]]
    assert created.path == "/opsgenie/v2/alerts"
    assert created.headers["Authorization"] == f"GenieKey {SECRETS['default-opsgenie-api-key']}"
    assert created.body["message"] == "GRPOESSDrop · layer 3-samples · run c"
    assert created.body["priority"] == "P3"
    assert "Stop training? no: look before you keep the next checkpoint" in created.body["description"]
    assert _dashboard("grpo-training-health", "c", delivered["starts"]) in created.body["description"]
    closed = [r.path for r in delivered["api"].under("/opsgenie") if r.path.endswith("/close?identifierType=alias")]
    assert len(closed) == 2

    [mail] = [m for m in first["email"] if "run c" in m.message["Subject"]]
    assert mail.sender == "grpo@example.org"
    assert mail.recipients == ["oncall@example.org"]
    assert mail.credentials == f"grpo\0{SECRETS['default-email-auth-password']}"
    assert mail.message["Subject"] == "[FIRING:1] GRPOESSDrop · layer 3-samples · run c"
    body = mail.message.get_body(("plain",)).get_content()
    assert f"Runbook: {RUNBOOKS}#grpoessdrop" in body
    html = mail.message.get_body(("html",)).get_content()
    dashboard = _dashboard("grpo-training-health", "c", delivered["starts"])
    assert f'<a href="{RUNBOOKS}#grpoessdrop">Runbook</a>' in html
    assert f'<a href="{dashboard}">Dashboard</a>' in html
    assert "Stop training? no: look before you keep the next checkpoint<br>" in html
    resolved = [m.message["Subject"] for m in delivered["smtp"].received()[2:]]
    assert sorted(resolved) == ["[RESOLVED] GRPOESSDrop · layer 3-samples · run c",
                                "[RESOLVED] GRPOKLToReferenceZero · layer 2-reward · run e"]


def test_every_page_says_whether_to_stop_as_the_alert_table_does(delivered):
    """The template's choice, by alert name, is the table's for every kind a page can carry."""
    first = delivered["first"]
    said = {title: page["text"] for title, page in _slack(first["slack"]).items() if not title.startswith("NodeDown")}
    said |= {r.body["message"]: r.body["description"] for r in first["opsgenie"]}
    rules = {a.name: a.rule(MixinConfig()) for a in alerts(MixinConfig())}
    assert len(said) == 6
    kinds = set()
    for title, text in said.items():
        labels = rules[title.split(" ·")[0]]["labels"]
        kinds.add(stop_kind(labels["layer"], labels["severity"]))
        assert f"Stop training? {plain(stop_advice(labels['layer'], labels['severity']))}\n" in text, title
    assert kinds == set(STOP) - {"escalated", "heartbeat"}


def _advised(stop_template: str, name: str) -> str:
    """The advice the generated template gives alert ``name`` (its branch of ``{{ if eq .Labels.alertname ... }}``)."""
    for branch in stop_template.split("{{ ")[1:]:
        condition, _, text = branch.partition("}}")
        if f'"{name}"' in condition:
            return text.strip().removeprefix("Stop training? ")
    return ""


def test_an_escalated_alert_is_advised_as_the_table_says():
    """Under `severities`, the advice follows the alert's own layer and its new severity: a layer-3 alert made
    critical is no broken reward, a stall made a warning still has no training to stop; an alert not ours gets
    none."""
    config = MixinConfig(severities={"GRPOESSDrop": "critical", "GRPOTrainingStalled": "warning",
                                     "GRPOOnPolicyRatioDrift": "critical", "GRPOTruncationSurge": "critical"})
    stop = _stop_template(config)
    assert _advised(stop, "GRPOESSDrop") == plain(STOP["escalated"])
    # a layer-1 or layer-2 warning made critical is no gate and no broken reward either: the config escalated it
    assert _advised(stop, "GRPOOnPolicyRatioDrift") == plain(STOP["escalated"])
    assert _advised(stop, "GRPOTruncationSurge") == plain(STOP["escalated"])
    assert _advised(stop, "GRPOTrainingStalled") == plain(STOP["liveness"])
    assert _advised(stop, "GRPOLossMaskMismatch") == plain(STOP["gate"])
    assert _advised(stop, "NodeDown") == ""
    assert _advised(_stop_template(MixinConfig()), "GRPOESSDrop") == plain(STOP["warning"])


def test_the_generators_name_every_secret_file_and_a_missing_dashboard_link():
    config = MixinConfig.model_validate({"receivers": {
        "pager": {"pagerduty": {}}, "default": {"webhook": {"url_secret": {"name": "hooks", "key": "chat"}}},
        "watchdog": {"slack": {}, "webhook": {"url": "https://user:pa55@hooks.example.org/ping?token=abc"}}}})
    plain_notes = notes(config, kubernetes=False)
    # a webhook given only its Kubernetes Secret is no integration of alertmanager.yml
    assert plain_notes[0].startswith("WARNING: receivers.default have no integration")
    assert ("note: Alertmanager reads /etc/alertmanager/secrets/pager-pagerduty-routing-key "
            "(receivers.pager.pagerduty): create it, readable by Alertmanager only") in plain_notes
    assert any("receivers.default.webhook has no url" in line for line in plain_notes)
    assert any("receivers.watchdog has slack: GRPOWatchdog always fires" in line for line in plain_notes)
    assert any("receivers.watchdog.webhook.url is written into alertmanager.yml as it is" in line
               for line in plain_notes)
    assert "note: grafana_url is not set: pages carry no dashboard link" in plain_notes
    assert "webhook_configs" not in yaml.safe_load(alertmanager_output(config))["receivers"][1]
    kubernetes = notes(config, kubernetes=True)
    assert not kubernetes[0].startswith("WARNING")
    assert ("note: the AlertmanagerConfig reads the routing key of receivers.pager.pagerduty from key "
            "pager-pagerduty-routing-key of Secret grpo-alertmanager (namespace grpo): create it before applying"
            ) in kubernetes
    assert any("reads the webhook's URL of receivers.default.webhook from key chat of Secret hooks" in line
               for line in kubernetes)


@pytest.mark.parametrize(("receiver", "problem"), [
    ({"slack": {"api_url_file": "https://hooks.slack.com/services/T/B/X"}}, "expected the absolute path"),
    ({"pagerduty": {"routing_key_file": "secrets/pd"}}, "expected the absolute path"),
    ({"email": {"to": "not an address", "from": "a@b.org", "smarthost": "smtp:25"}}, "expected mail addresses"),
    ({"email": {"to": "a@b.org", "from": "grpo alerts", "smarthost": "smtp:25"}}, "expected mail addresses"),
    ({"email": {"to": "a@b.org", "from": "a@b.org", "smarthost": "smtp:99999"}}, "expected host:port"),
    ({"email": {"to": "a@b.org", "from": "a@b.org", "smarthost": "smtp:25", "auth_password_file": "/s/p"}},
     "expected auth_username with them"),
    ({"slack": {"channel": "grpo pages"}}, "String should match pattern"),
    ({"slack": {"api_url": "https://hooks.slack.com/x"}}, "Extra inputs are not permitted"),
])
def test_a_receiver_that_could_never_deliver_is_refused(receiver, problem):
    with pytest.raises(pydantic.ValidationError, match=problem):
        MixinConfig.model_validate({"receivers": {"pager": receiver}})


def test_receivers_that_deliver_are_taken():
    """IPv6 smarthosts, named addresses, channel IDs and absolute secret files pass."""
    config = MixinConfig.model_validate({"receivers": {"pager": {
        "email": {"to": "On call <a@b.org>, c@d.org", "from": "a@b.org", "smarthost": "[::1]:25"},
        "slack": {"channel": "C0123ABCD", "api_url_file": "/run/secrets/slack"}}}})
    assert config.receivers.pager.slack is not None
    assert config.receivers.pager.slack.secret_file("pager", config.secrets_dir) == "/run/secrets/slack"


def test_the_default_runbooks_are_the_projects_home():
    """Pages link the runbooks of the project's home unless told otherwise: the one URL pyproject.toml names."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["urls"]["Homepage"] == PROJECT_URL
    assert f"{PROJECT_URL}/blob/main/docs/runbooks.md" == RUNBOOKS == MixinConfig().runbook_url
    assert (Path(__file__).parents[1] / "docs" / "runbooks.md").is_file()


def test_the_alertmanager_config_takes_every_integration_by_secret_reference():
    """Every integration in the operator's schema, each secret a Secret key (default names, or one given), no value."""
    config = MixinConfig.model_validate({"grafana_url": GRAFANA, "receivers": {
        "pager": {"pagerduty": {"routing_key_secret": {"name": "pd", "key": "routing"}}, "slack": {}},
        "default": {"opsgenie": {}, "email": {"to": "a@example.org", "from": "b@example.org",
                                              "smarthost": "smtp.example.org:587", "auth_username": "b"}},
        "watchdog": {"webhook": {"url": "https://hc-ping.com/not-in-the-manifest"}}}})
    resource = manifests(config, {})["alertmanagerconfig.yaml"]
    k8s_schemas.validate(resource)
    receivers = {r["name"]: r for r in resource["spec"]["receivers"]}
    assert receivers["pager"]["pagerdutyConfigs"][0]["routingKey"] == {"name": "pd", "key": "routing"}
    assert receivers["pager"]["slackConfigs"][0]["apiURL"] == {"name": "grpo-alertmanager",
                                                                "key": "pager-slack-api-url"}
    assert receivers["default"]["opsgenieConfigs"][0]["apiKey"]["key"] == "default-opsgenie-api-key"
    assert receivers["default"]["emailConfigs"][0]["authPassword"]["key"] == "default-email-auth-password"
    assert receivers["default"]["emailConfigs"][0]["headers"][0]["key"] == "Subject"
    assert receivers["watchdog"]["webhookConfigs"] == [{"sendResolved": True, "urlSecret": {
        "name": "grpo-alertmanager", "key": "watchdog-webhook-url"}}]
    assert "hc-ping" not in yaml.safe_dump(resource)
