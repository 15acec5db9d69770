"""A receiver's integrations as Alertmanager configures them: ``alertmanager.yml``'s ``*_configs`` (secrets read from
files) and the Prometheus Operator's ``*Configs`` (secrets read from Kubernetes Secrets), each saying what
:mod:`~grpo_exporter.mixin.messages` writes in the form its service shows best: Slack a titled message linked to
the runbook, PagerDuty an Events v2 event with the runbook and dashboard as links, email a subject with a plain
and an HTML body, Opsgenie an alert whose priority follows the severity. Every one is told when the alert
resolves. :func:`notes` is what the generators say about them on stderr.
"""

from __future__ import annotations

from typing import Any

from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.messages import (
    body_template,
    first_dashboard_template,
    first_runbook_template,
    html_body_template,
    subject_template,
    title_template,
)
from grpo_exporter.mixin.receivers import Email, Opsgenie, PagerDuty, Receiver, Slack, Webhook

SOURCE = "grpo-exporter"
PAGERDUTY_SEVERITY = ('{{ if eq .CommonLabels.severity "critical" }}critical{{ else if eq .CommonLabels.severity '
                      '"warning" }}warning{{ else }}info{{ end }}')
OPSGENIE_PRIORITY = ('{{ if eq .CommonLabels.severity "critical" }}P1{{ else if eq .CommonLabels.severity '
                     '"warning" }}P3{{ else }}P5{{ end }}')
SLACK_COLOR = '{{ if eq .Status "firing" }}danger{{ else }}good{{ end }}'


def _details(c: MixinConfig) -> dict[str, str]:
    """The fields a service shows beside the message (PagerDuty's custom details, Opsgenie's details)."""
    details = {"run": "{{ .CommonLabels.run }}", "layer": "{{ .CommonLabels.layer }}",
               "firing": "{{ .Alerts.Firing | len }}", "runbook": first_runbook_template()}
    if c.grafana_url:
        details["dashboard"] = first_dashboard_template(c)
    return details


def _links(c: MixinConfig) -> list[tuple[str, str]]:
    """(href, text) of the links a service shows beside the message, never empty: the runbooks' page and Grafana
    itself for an alert without its own (another tool's, or a target's that names no run)."""
    links = [(first_runbook_template(c.runbook_url), "Runbook")]
    if c.grafana_url:
        links.append((first_dashboard_template(c, c.grafana_url), "Dashboard"))
    return links


def _message(c: MixinConfig, one: Slack | PagerDuty | Email | Opsgenie) -> dict[str, Any]:
    """The fields that carry the message, in alertmanager.yml's names."""
    title, body = title_template(), body_template(c)
    if isinstance(one, Slack):
        return {"title": title, "title_link": first_runbook_template(), "text": body, "color": SLACK_COLOR}
    if isinstance(one, PagerDuty):  # an incident's summary is set once: no firing/resolved state in it
        links = _links(c)
        return {"description": subject_template(), "severity": PAGERDUTY_SEVERITY, "client": SOURCE,
                "client_url": links[-1][0], "details": {**_details(c), "summary": body},
                "links": [{"href": href, "text": text} for href, text in links]}
    if isinstance(one, Opsgenie):
        return {"message": subject_template(), "description": body, "priority": OPSGENIE_PRIORITY, "source": SOURCE,
                "tags": "grpo,{{ .CommonLabels.layer }}", "details": _details(c)}
    return {"headers": {"Subject": title}, "text": body, "html": html_body_template(c)}


def _plain_settings(one: Slack | PagerDuty | Email | Opsgenie) -> dict[str, Any]:
    """The integration's own settings other than its secret, in alertmanager.yml's names."""
    if isinstance(one, Email):
        return {"to": one.to, "from": one.from_, "smarthost": one.smarthost, "require_tls": one.require_tls,
                **({"auth_username": one.auth_username} if one.auth_username else {})}
    if isinstance(one, Slack):
        return {"channel": one.channel} if one.channel else {}
    if isinstance(one, PagerDuty):
        return {"url": one.url} if one.url else {}
    return {"api_url": one.api_url} if one.api_url else {}


def integrations(c: MixinConfig, name: str, receiver: Receiver) -> dict[str, list[dict[str, Any]]]:
    """``{"slack_configs": [...], ...}`` of receiver ``name`` for alertmanager.yml. A webhook without ``url`` (set
    for Kubernetes only) is left out: :func:`notes` says so."""
    out: dict[str, list[dict[str, Any]]] = {}
    for one in receiver.integrations:
        if not _delivers(one, kubernetes=False):
            continue
        if isinstance(one, Webhook):
            out["webhook_configs"] = [{"url": one.url, "send_resolved": one.send_resolved}]
            continue
        secret = {f"{one.SECRET}_file": one.secret_file(name, c.secrets_dir)} if one.has_secret() else {}
        out[f"{one.KIND}_configs"] = [{"send_resolved": one.send_resolved, **_plain_settings(one), **secret,
                                       **_message(c, one)}]
    return out


def _delivers(one: Slack | PagerDuty | Email | Opsgenie | Webhook, kubernetes: bool) -> bool:
    """Whether the integration is written for the target: a webhook without ``url`` only in Kubernetes."""
    return kubernetes or not isinstance(one, Webhook) or bool(one.url)


def _secret_notes(c: MixinConfig, kubernetes: bool) -> list[str]:
    """Where each integration's secret must be, or why it is not written."""
    said = []
    for name, receiver in c.receivers.by_name().items():
        for one in receiver.integrations:
            if kubernetes and one.has_secret():
                ref = one.secret_ref(name, c.kubernetes_secret)
                value = "the webhook's URL" if isinstance(one, Webhook) else f"the {one.SECRET.replace('_', ' ')}"
                said.append(f"note: the AlertmanagerConfig reads {value} of receivers.{name}.{one.KIND} from key "
                            f"{ref.key} of Secret {ref.name} (namespace {c.namespace}): create it before applying")
            elif isinstance(one, Webhook) and not one.url:
                said.append(f"note: receivers.{name}.webhook has no url (url_secret is for Kubernetes): "
                            "alertmanager.yml leaves it out")
            elif isinstance(one, Webhook):
                said.append(f"note: receivers.{name}.webhook.url is written into alertmanager.yml as it is "
                            "(Alertmanager 0.25 reads no webhook URL from a file): where the URL is itself a "
                            "credential (a ping URL, a token in its path or query), write the file outside version "
                            "control (--alertmanager-out)")
            elif not isinstance(one, Webhook) and one.has_secret():
                said.append(f"note: Alertmanager reads {one.secret_file(name, c.secrets_dir)} (receivers.{name}."
                            f"{one.KIND}): create it, readable by Alertmanager only")
    return said


def notes(c: MixinConfig, kubernetes: bool) -> list[str]:
    """What a generator says on stderr about the receivers it wrote (``kubernetes``: the AlertmanagerConfig, else
    alertmanager.yml): receivers that page nobody, where each secret must be, integrations left out, links a page
    will lack."""
    said = []
    silent = [name for name, receiver in c.receivers.by_name().items()
              if not any(_delivers(one, kubernetes) for one in receiver.integrations)]
    if silent:
        said.append(f"WARNING: {' and '.join(f'receivers.{name}' for name in silent)} have no integration: those "
                    "alerts are shown in Alertmanager's UI and API only and page nobody. Set them in a --config "
                    "file (docs/receivers.md).")
    chatty = [one.KIND for one in c.receivers.watchdog.integrations if not isinstance(one, Webhook)]
    if chatty:
        said.append(f"note: receivers.watchdog has {', '.join(chatty)}: GRPOWatchdog always fires, so it is sent "
                    f"there every watchdog_repeat_interval_s ({c.watchdog_repeat_interval_s} s) for good; a dead "
                    "man's switch is a webhook to a service that calls when the pings stop")
    said += _secret_notes(c, kubernetes)
    if any(receiver.integrations for receiver in c.receivers.by_name().values()) and not c.grafana_url:
        said.append("note: grafana_url is not set: pages carry no dashboard link")
    return said


def _pairs(mapping: dict[str, str]) -> list[dict[str, str]]:
    """A mapping in the operator's form: a list of ``{key, value}``."""
    return [{"key": key, "value": value} for key, value in mapping.items()]


CAMEL = {"send_resolved": "sendResolved", "title_link": "titleLink", "client_url": "clientURL",
         "api_url": "apiURL", "require_tls": "requireTLS", "auth_username": "authUsername"}
SECRET_KEYS = {"slack": "apiURL", "pagerduty": "routingKey", "opsgenie": "apiKey", "email": "authPassword",
               "webhook": "urlSecret"}


def _operator_one(c: MixinConfig, name: str, one: Slack | PagerDuty | Email | Opsgenie | Webhook) -> dict[str, Any]:
    """One integration of receiver ``name`` in the operator's schema, its secret a Secret key."""
    ref = one.secret_ref(name, c.kubernetes_secret)
    secret = {SECRET_KEYS[one.KIND]: ref.model_dump()} if one.has_secret() else {}
    if isinstance(one, Webhook):
        return {"sendResolved": one.send_resolved, **secret}
    plain = {"send_resolved": one.send_resolved, **_plain_settings(one), **_message(c, one)}
    if "details" in plain:
        plain["details"] = _pairs(plain["details"])
    if "headers" in plain:
        plain["headers"] = _pairs(plain["headers"])
    if "links" in plain:
        plain["pagerDutyLinkConfigs"] = [{"href": link["href"], "alt": link["text"]} for link in plain.pop("links")]
    return {CAMEL.get(key, key): value for key, value in plain.items()} | secret


def operator_integrations(c: MixinConfig, name: str, receiver: Receiver) -> dict[str, list[dict[str, Any]]]:
    """``{"slackConfigs": [...], ...}`` of receiver ``name`` for the AlertmanagerConfig: every secret a
    Kubernetes Secret key (``kubernetes_secret`` unless the integration's ``*_secret`` names another)."""
    return {f"{one.KIND}Configs": [_operator_one(c, name, one)] for one in receiver.integrations}
