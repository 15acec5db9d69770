"""Where the generated files deploy: the Kubernetes names and labels, and the Alertmanager receivers.

Part of ``MixinConfig`` (one YAML file configures the rules, the dashboards and these). A setting that two
generated files must agree on lives here once: the PodMonitor's pod selector and the pods' labels, the scrape
job and the rules' ``selector``, the namespace of every manifest and of every alert the AlertmanagerConfig
routes.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from grpo_exporter.serving.settings import DEFAULT_PORT

#: a Kubernetes namespace: an RFC 1123 DNS label
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
#: a Kubernetes label key: an optional DNS-subdomain prefix and a name of at most 63 characters
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _labels(field: str, labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        if not LABEL_KEY.match(key):
            raise ValueError(f"{field}: expected Kubernetes label keys ([prefix/]name, name at most 63 of "
                             f"[A-Za-z0-9-_.]), got {key!r}")
        if not LABEL_VALUE.match(value):
            raise ValueError(f"{field}: expected Kubernetes label values (at most 63 of [A-Za-z0-9-_.]), got "
                             f"{value!r} for {key!r}")
    return labels


class DeploySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- Kubernetes (grpo-exporter kubernetes) ----
    namespace: str = Field(
        "grpo", pattern=DNS_LABEL, description="Kubernetes: the namespace of every manifest (a Namespace manifest "
        "creates it), of the training pods the PodMonitor selects, and the `namespace` label every alert carries "
        "so that the operator's AlertmanagerConfig, which matches only alerts of its own namespace, routes them",
    )
    pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"app": "grpo-trainer"}, description="Kubernetes: labels of your training pods "
        "that the PodMonitor and the Service select (with `serving_label`)",
    )
    serving_label: str = Field(
        "grpo-exporter/serving", description="Kubernetes: a label set to \"true\" on the one pod whose process "
        "serves the metrics (rank 0's; the master replica of a multi-node job). The other ranks serve nothing: "
        "as targets they would never answer and page GRPOExporterDown",
    )
    prometheus_selector_labels: dict[str, str] = Field(
        default_factory=lambda: {"release": "kube-prometheus-stack"}, description="Kubernetes: labels put on the "
        "PodMonitor, the PrometheusRule and the AlertmanagerConfig so that your Prometheus and Alertmanager "
        "resources select them. kube-prometheus-stack selects `release: <its Helm release name>` by default "
        "(`kubectl get prometheus -A -o yaml | grep -A3 ruleSelector` shows yours); {} when yours select everything",
    )
    scrape_interval_s: int = Field(
        15, ge=1, description="Kubernetes: the PodMonitor's scrape interval (keep it at most a quarter of "
        "`rate_window_s`, so a rate window holds several scrapes)",
    )
    exporter_port: int = Field(
        DEFAULT_PORT, ge=1, le=65535, description="Kubernetes: the container port your training serves "
        "(GRPOMonitor(port=...)); the pod's container port must be named `metrics`",
    )

    # ---- Alertmanager receivers (grpo-exporter rules, grpo-exporter kubernetes) ----
    pager_webhook_url: str | None = Field(
        None, description="Alertmanager: the webhook critical alerts go to (your pager's). Unset, the `pager` "
        "receiver has no integration: the alerts are shown in Alertmanager's UI and API only, and the generator "
        "says so on stderr",
    )
    default_webhook_url: str | None = Field(
        None, description="Alertmanager: the webhook every other alert goes to (a chat channel's). Unset, as "
        "`pager_webhook_url`",
    )

    watchdog_webhook_url: str | None = Field(
        None, description="Alertmanager: the dead man's switch GRPOWatchdog (always firing) is sent to, every "
        "`watchdog_repeat_interval_s` (healthchecks.io, Dead Man's Snitch, PagerDuty's heartbeat...): when the pings "
        "stop, the alerting path itself is broken. Unset, the `watchdog` receiver has no integration"
    )
    watchdog_repeat_interval_s: int = Field(
        300, ge=60, le=3600, description="Alertmanager: how often GRPOWatchdog is re-sent (not scaled by "
        "time_scale): give the dead man's switch a grace of about three times this"
    )

    @field_validator("pod_labels", "prometheus_selector_labels")
    @classmethod
    def _label_maps(cls, labels: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        return _labels(str(info.field_name), labels)

    @field_validator("serving_label")
    @classmethod
    def _serving(cls, key: str) -> str:
        _labels("serving_label", {key: "true"})
        return key

    @property
    def serving_selector(self) -> dict[str, str]:
        """The labels that select the one serving pod."""
        return {**self.pod_labels, self.serving_label: "true"}

    @property
    def unset_receivers(self) -> list[str]:
        """The receivers with no webhook, by name."""
        return [name for name, url in (("pager", self.pager_webhook_url), ("default", self.default_webhook_url))
                if not url]
