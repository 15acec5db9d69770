"""What a page says: the title and body every receiver sends, as Alertmanager templates (Go text/template over
the notification of one alert group), generated here so that Slack, PagerDuty, email and Opsgenie say the same.

The title names the alert, the run and the layer; the body, per alert, its summary and description (the value
against its baseline, and where the flight recorder wrote the run's latest incident), whether to stop training
(the alert table's column: :func:`stop_advice`), the runbook (absolute: ``runbook_url``) and, with ``grafana_url``
set, the run's dashboard over the hour before the alert began. A person reads it on a phone: every link opens
as it is.
"""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig

STOP = {
    "gate": "**stop**: every step trains on a gradient that is not what you think; fix, then resume from the "
            "last checkpoint before the first evidence",
    "bound": "**stop**: the advantage or reward is broken by construction; fix before the next step",
    "liveness": "no training to stop: the process is hung, gone, or unseen",
    "warning": "no: look before you keep the next checkpoint",
    "info": "no: a state of the run, said once",
}
#: the dashboard that answers an alert's question: layer-1 faults on the crash triage, the rest on training health
TRIAGE_LAYERS = (Layer.GRADIENT.value, "1-optimizer")
TRIAGE_DASHBOARD = "grpo-crash-triage"
HEALTH_DASHBOARD = "grpo-training-health"
#: how far before the alert's start the dashboard link opens (Go duration in nanoseconds: one hour)
LOOKBACK_NS = 3600 * 10**9


def stop_kind(layer: str, severity: str) -> str:
    """The key of :data:`STOP` for an alert of ``layer`` and ``severity``: liveness pages have no training to
    stop, a layer-1 critical is a gate (every step is wrong), another critical a broken advantage or reward."""
    if layer == Layer.LIVENESS.value:
        return "liveness" if severity == "critical" else "info"
    if severity == "critical":
        return "gate" if layer == Layer.GRADIENT.value else "bound"
    return severity if severity in STOP else "info"


def stop_advice(layer: str, severity: str) -> str:
    """The alert table's "stop training?" column (Markdown)."""
    return STOP[stop_kind(layer, severity)]


def _plain(text: str) -> str:
    return text.replace("**stop**", "STOP")


def _stop_template() -> str:
    """The stop advice of ``.`` (one alert), chosen from its labels exactly as :func:`stop_kind` does."""
    said = {kind: _plain(text) for kind, text in STOP.items()}
    liveness = f'{{{{ if eq .Labels.severity "critical" }}}}{said["liveness"]}{{{{ else }}}}{said["info"]}{{{{ end }}}}'
    critical = (f'{{{{ if eq .Labels.layer "{Layer.GRADIENT.value}" }}}}{said["gate"]}'
                f'{{{{ else }}}}{said["bound"]}{{{{ end }}}}')
    return (f'{{{{ if eq .Labels.layer "{Layer.LIVENESS.value}" }}}}{liveness}'
            f'{{{{ else if eq .Labels.severity "critical" }}}}{critical}'
            f'{{{{ else if eq .Labels.severity "warning" }}}}{said["warning"]}'
            f'{{{{ else }}}}{said["info"]}{{{{ end }}}}')


def dashboard_template(c: MixinConfig) -> str:
    """The Grafana link of ``.`` (one alert): its layer's dashboard with the alert's job and run selected, from an
    hour before the alert began to now (to ten minutes after it ended, once resolved). Empty without
    ``grafana_url``."""
    if not c.grafana_url:
        return ""
    base = c.grafana_url.rstrip("/")
    triage = " ".join(f'(eq .Labels.layer "{layer}")' for layer in TRIAGE_LAYERS)
    uid = f"{{{{ if or {triage} }}}}{TRIAGE_DASHBOARD}{{{{ else }}}}{HEALTH_DASHBOARD}{{{{ end }}}}"
    until = '{{ if eq .Status "resolved" }}{{ (.EndsAt.Add 600000000000).Unix }}000{{ else }}now{{ end }}'
    return (f"{base}/d/{uid}?var-job={{{{ .Labels.job | urlquery }}}}&var-run={{{{ .Labels.run | urlquery }}}}"
            f"&from={{{{ (.StartsAt.Add -{LOOKBACK_NS}).Unix }}}}000&to={until}")


def title_template() -> str:
    """``[FIRING:2] GRPOLossMaskMismatch · run a · layer 1-gradient``: what, which run, which layer."""
    return ('[{{ .Status | toUpper }}{{ if eq .Status "firing" }}:{{ .Alerts.Firing | len }}{{ end }}] '
            "{{ .GroupLabels.alertname }}{{ with .CommonLabels.run }} · run {{ . }}{{ end }}"
            "{{ with .CommonLabels.layer }} · layer {{ . }}{{ end }}")


def body_template(c: MixinConfig) -> str:
    """Per alert of the group: summary, description, stop advice, runbook and dashboard links, one per line."""
    dashboard = dashboard_template(c)
    return (
        "{{ range .Alerts }}"
        '{{ if eq .Status "resolved" }}RESOLVED: {{ end }}{{ .Annotations.summary }}\n'
        "{{ .Annotations.description }}\n"
        f"Stop training? {_stop_template()}\n"
        "Runbook: {{ .Annotations.runbook_url }}\n"
        + (f"Dashboard: {dashboard}\n" if dashboard else "")
        + "\n{{ end }}"
    )


def first_runbook_template() -> str:
    """The runbook of the group's first alert (a group is one alert name: they share it)."""
    return "{{ (index .Alerts 0).Annotations.runbook_url }}"


def first_dashboard_template(c: MixinConfig) -> str:
    """The dashboard link of the group's first alert, or empty without ``grafana_url``."""
    dashboard = dashboard_template(c)
    return f"{{{{ with index .Alerts 0 }}}}{dashboard}{{{{ end }}}}" if dashboard else ""
