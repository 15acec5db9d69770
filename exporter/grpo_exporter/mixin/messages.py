"""What a page says: the title and body every receiver sends, as Alertmanager templates (Go text/template over
the notification of one alert group), generated here so that Slack, PagerDuty, email and Opsgenie say the same.

A group is one alert of one run. The title names the alert, its layer and the run; the body says the alert's
summary, then each alert of the group (at most :data:`SHOWN`) by its description (the value against its
baseline, and where the flight recorder wrote the run's latest incident), then once whether to stop training
(the alert table's column for that alert under this config's severities: :func:`stop_advice`), the runbook
(absolute: ``runbook_url``) and, with ``grafana_url`` set, the run's dashboard over the hour before the alert
began. A person reads it on a phone: every link opens as it is. An alert that is not ours (another rule routed to
the same receiver) gets no advice and no dashboard, only what it says of itself.
"""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.alerts import alerts
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import OPTIMIZER

STOP = {
    "gate": "**stop**: every step trains on a gradient that is not what you think; fix, then resume from the "
            "last checkpoint before the first evidence",
    "bound": "**stop**: the advantage or reward is broken by construction; fix before the next step",
    "escalated": "**stop** and look: your `severities` made this alert critical; keep no checkpoint from after it "
                 "until you know why",
    "liveness": "no training to stop: the process is hung, gone, or unseen",
    "warning": "no: look before you keep the next checkpoint",
    "info": "no: a state of the run, said once",
    "heartbeat": "no: the alerting path's heartbeat, always firing",
}
#: the dashboard that answers an alert's question: layer-1 faults on the crash triage, the rest on training health
TRIAGE_LAYERS = (Layer.GRADIENT.value, OPTIMIZER)
TRIAGE_DASHBOARD = "grpo-crash-triage"
HEALTH_DASHBOARD = "grpo-training-health"
#: how far before the alert's start the dashboard link opens (Go duration in nanoseconds: one hour)
LOOKBACK_NS = 3600 * 10**9
#: the dashboard link's condition: an alert of ours (a layer) about a run (a liveness alert of a target may have none)
RUN_OF_OURS = "{{ if and .Labels.layer .Labels.run }}"
#: alerts of one group a message lists (a page of 50 identical lines is read as none; services cap the length)
SHOWN = 5


def stop_kind(layer: str, severity: str, default: str = "critical") -> str:
    """The key of :data:`STOP` for an alert of ``layer`` at ``severity`` (its ``default`` severity before the
    config's ``severities``): a liveness page has no training to stop; a layer-1 critical is a gate (every step is
    wrong), a layer-2 critical a broken advantage or reward, an alert the config made critical an escalation."""
    if severity == "none":
        return "heartbeat"
    if layer == Layer.LIVENESS.value:
        return "info" if severity == "info" else "liveness"
    if severity == "critical":
        return {Layer.GRADIENT.value: "gate", Layer.REWARD.value: "bound"}.get(layer, "escalated") \
            if default == "critical" else "escalated"
    return "warning" if severity == "warning" else "info"


def stop_advice(layer: str, severity: str, default: str = "critical") -> str:
    """The alert table's "stop training?" column (Markdown)."""
    return STOP[stop_kind(layer, severity, default)]


def plain(text: str) -> str:
    """A :data:`STOP` text as a phone shows it: no Markdown."""
    return text.replace("**stop**", "STOP").replace("`", "")


def _stop_template(c: MixinConfig) -> str:
    """``Stop training? ...`` for ``.`` (one alert), chosen by its name: each alert's kind under this config's
    severities, as the alert table says; nothing for an alert that is not ours."""
    names: dict[str, list[str]] = {}
    for alert in alerts(c):
        kind = stop_kind(str(alert.layer), c.severities.get(alert.name, alert.severity), alert.severity)
        names.setdefault(kind, []).append(f'"{alert.name}"')
    branches = [f"if eq .Labels.alertname {' '.join(listed)} }}}}Stop training? {plain(STOP[kind])}\n"
                for kind, listed in names.items()]
    return "{{ " + "{{ else ".join(branches) + "{{ end }}"


def dashboard_template(c: MixinConfig) -> str:
    """The Grafana link of ``.`` (one alert of ours): its layer's dashboard with the alert's job and run selected,
    from an hour before the alert began to now (to ten minutes after it ended, once resolved). Empty without
    ``grafana_url``."""
    if not c.grafana_url:
        return ""
    base = c.grafana_url.rstrip("/")
    triage = " ".join(f'(eq .Labels.layer "{layer}")' for layer in TRIAGE_LAYERS)
    uid = f"{{{{ if or {triage} }}}}{TRIAGE_DASHBOARD}{{{{ else }}}}{HEALTH_DASHBOARD}{{{{ end }}}}"
    until = '{{ if eq .Status "resolved" }}{{ (.EndsAt.Add 600000000000).Unix }}000{{ else }}now{{ end }}'
    return (f"{base}/d/{uid}?var-job={{{{ .Labels.job | urlquery }}}}&var-run={{{{ .Labels.run | urlquery }}}}"
            f"&from={{{{ (.StartsAt.Add -{LOOKBACK_NS}).Unix }}}}000&to={until}")


def subject_template() -> str:
    """``GRPOLossMaskMismatch · layer 1-gradient · run a``: what, which layer, which run (the layer before the
    run: a service that cuts a long title keeps it); the target instead of the run when there is none (a
    liveness alert of a target that never served a run)."""
    return ("{{ .CommonLabels.alertname }}{{ with .CommonLabels.layer }} · layer {{ . }}{{ end }}"
            "{{ with .CommonLabels.run }} · run {{ . }}{{ else }}{{ with .CommonLabels.instance }} · {{ . }}{{ end }}"
            "{{ end }}")


def title_template() -> str:
    """The subject after the group's state, ``[FIRING:2] ...`` or ``[RESOLVED] ...``, for services where each
    notification is a new message (Slack, email)."""
    return ('[{{ .Status | toUpper }}{{ if eq .Status "firing" }}:{{ .Alerts.Firing | len }}{{ end }}] '
            + subject_template())


#: the template pieces both bodies say: the group's summary, each of its first SHOWN alerts (what it says of
#: itself, marked once resolved), and how many were left out
SUMMARY = "{{ with .CommonAnnotations.summary }}{{ . }}{{ else }}{{ (index .Alerts 0).Annotations.summary }}{{ end }}"
EACH_SHOWN = f"{{{{ range $i, $alert := .Alerts }}}}{{{{ if lt $i {SHOWN} }}}}"
SAYS = ('{{ if eq .Status "resolved" }}RESOLVED: {{ end }}'
        "{{ or .Annotations.description .Annotations.summary .Labels.alertname }}")
MORE = f"{{{{ if gt (len .Alerts) {SHOWN} }}}}({SHOWN} of {{{{ len .Alerts }}}} alerts shown)"


def body_template(c: MixinConfig) -> str:
    """The summary; each alert's description (at most :data:`SHOWN`); then the stop advice, the runbook and the
    dashboard of the group's first alert, one per line."""
    dashboard = dashboard_template(c)
    return (
        f"{SUMMARY}\n{EACH_SHOWN}- {SAYS}\n{{{{ end }}}}{{{{ end }}}}{MORE}\n{{{{ end }}}}"
        "{{ with index .Alerts 0 }}"
        + _stop_template(c)
        + "{{ with .Annotations.runbook_url }}Runbook: {{ . }}\n{{ end }}"
        + (f"{RUN_OF_OURS}Dashboard: {dashboard}\n{{{{ end }}}}" if dashboard else "")
        + "{{ end }}"
    )


def html_body_template(c: MixinConfig) -> str:
    """:func:`body_template` for an HTML mail part (Alertmanager renders it with html/template, which escapes
    every value): the same lines, the links as links."""
    dashboard = dashboard_template(c)
    return (
        f"<p><b>{SUMMARY}</b></p>\n<ul>\n{EACH_SHOWN}<li>{SAYS}</li>\n{{{{ end }}}}{{{{ end }}}}</ul>\n"
        f"{MORE}<br>\n{{{{ end }}}}"
        "{{ with index .Alerts 0 }}<p>"
        + _stop_template(c).replace("\n", "<br>\n")
        + '{{ with .Annotations.runbook_url }}<a href="{{ . }}">Runbook</a><br>\n{{ end }}'
        + (f'{RUN_OF_OURS}<a href="{dashboard}">Dashboard</a><br>\n{{{{ end }}}}' if dashboard else "")
        + "</p>{{ end }}"
    )


def first_runbook_template(otherwise: str = "") -> str:
    """The runbook of the group's first alert (a group is one alert name: they share it); ``otherwise`` for an
    alert without one (another tool's)."""
    return f"{{{{ with (index .Alerts 0).Annotations.runbook_url }}}}{{{{ . }}}}{{{{ else }}}}{otherwise}{{{{ end }}}}"


def first_dashboard_template(c: MixinConfig, otherwise: str = "") -> str:
    """The dashboard link of the group's first alert, empty without ``grafana_url``; ``otherwise`` for an alert that
    is not ours or names no run."""
    dashboard = dashboard_template(c)
    if not dashboard:
        return ""
    return f"{{{{ with index .Alerts 0 }}}}{RUN_OF_OURS}{dashboard}{{{{ else }}}}{otherwise}{{{{ end }}}}{{{{ end }}}}"
