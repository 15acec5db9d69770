"""Where the generated files deploy: the Kubernetes names and labels, and the Alertmanager receivers.

Part of ``MixinConfig`` (one YAML file configures the rules, the dashboards and these). A setting that two
generated files must agree on lives here once: the PodMonitor's pod selector and the pods' labels, the scrape
job and the rules' ``selector``, the namespace of every manifest and of every alert the AlertmanagerConfig
routes. The scrape's TLS and basic-auth credentials are Secret references (``{name, key}``), never values: the
manifests stay safe to commit.
"""

from __future__ import annotations

import re
from typing import Annotated, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from grpo_exporter.mixin.receivers import DNS_SUBDOMAIN, Receivers, SecretRef, absolute_dir
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
        "grpo", pattern=DNS_LABEL, description="Kubernetes: the namespace of every manifest (create it once, with "
        "`kubectl create namespace` or namespace/namespace.yaml: deleting the manifests leaves it), of the "
        "training pods the PodMonitor selects (unless `pod_namespaces` names others), and the `namespace` label "
        "every alert carries so that the operator's AlertmanagerConfig, which matches only alerts of its own "
        "namespace, routes them",
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
    pod_namespaces: list[str] = Field(
        default_factory=list, description="Kubernetes: the namespaces of the training pods when they are not "
        "(only) in `namespace`: the PodMonitor selects pods there (`namespaceSelector.matchNames`; a Prometheus "
        "with `ignoreNamespaceSelectors: true` ignores it). [] selects `namespace` only. A Service is namespaced "
        "and selects pods of its own namespace only, so none is written unless the pods are all in `namespace`; "
        "the scrape Secrets stay in `namespace`, and the alerts keep its name as their `namespace` label",
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
    scrape_tls_ca: SecretRef | None = Field(
        None, description="Kubernetes: the Secret key (`{name, key}`, a Secret in `namespace`) holding the PEM "
        "certificate of the CA that signed the exporter's certificate. Set it when the training serves HTTPS "
        "(`tls_cert`, `tls_key`): the PodMonitor then scrapes with `scheme: https` and verifies the certificate "
        "against this CA and `scrape_tls_server_name` (never skipping verification). Unset: plain HTTP",
    )
    scrape_tls_server_name: str | None = Field(
        None, pattern=DNS_SUBDOMAIN, description="Kubernetes: the DNS name Prometheus expects in the exporter's "
        "certificate (its subjectAltName). Pods are scraped by IP, which a certificate rarely names, so the check "
        "uses this name; unset, the Service's name `grpo-exporter.<namespace>.svc`. Only with `scrape_tls_ca`",
    )
    scrape_basic_auth_username: SecretRef | None = Field(
        None, description="Kubernetes: the Secret key (`{name, key}`, in `namespace`) holding the user the "
        "PodMonitor sends with HTTP basic auth: the exporter's `basic_auth_user`. With "
        "`scrape_basic_auth_password`; both unset, no credentials are sent",
    )
    scrape_basic_auth_password: SecretRef | None = Field(
        None, description="Kubernetes: the Secret key (`{name, key}`, in `namespace`) holding that user's "
        "password in plain text (the exporter keeps only its hash, `basic_auth_password_hash`). With "
        "`scrape_basic_auth_username`; use it with `scrape_tls_ca`, or the password crosses the network in clear",
    )

    # ---- Alertmanager receivers (grpo-exporter rules, grpo-exporter kubernetes) ----
    receivers: Receivers = Field(
        default_factory=Receivers, description="Alertmanager: the integrations of the `pager` (critical), "
        "`default` (every other alert) and `watchdog` (the dead man's switch) receivers: `slack`, `pagerduty`, "
        "`email`, `opsgenie`, `webhook`, one of each at most (docs/receivers.md). A receiver with none shows its "
        "alerts in Alertmanager's UI and API only, and the generators say so on stderr",
    )
    secrets_dir: Annotated[str, AfterValidator(absolute_dir)] = Field(
        "/etc/alertmanager/secrets", description="alertmanager.yml: the folder Alertmanager reads "
        "each secret from, one file each, named `<receiver>-<integration>-<field>` (`pager-slack-api-url`) unless "
        "the integration's `*_file` names another",
    )
    kubernetes_secret: str = Field(
        "grpo-alertmanager", pattern=DNS_SUBDOMAIN, description="Kubernetes: the Secret (in `namespace`) the "
        "AlertmanagerConfig reads each secret from, keys named as the files of `secrets_dir`, unless the "
        "integration's `*_secret` names another",
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

    @field_validator("pod_namespaces")
    @classmethod
    def _pod_namespaces(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.match(DNS_LABEL, name):
                raise ValueError(f"pod_namespaces: expected Kubernetes namespaces (lowercase a-z, 0-9 and '-', at "
                                 f"most 63), got {name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"pod_namespaces: expected each namespace once, got {names!r}")
        return names

    @model_validator(mode="after")
    def _scrape_credentials(self) -> Self:
        if self.scrape_tls_server_name is not None and self.scrape_tls_ca is None:
            raise ValueError("scrape_tls_server_name: set only with scrape_tls_ca (it names what the CA vouches "
                             "for; without a CA the scrape is plain HTTP)")
        if (self.scrape_basic_auth_username is None) != (self.scrape_basic_auth_password is None):
            raise ValueError("scrape_basic_auth_username and scrape_basic_auth_password: expected both or neither")
        return self

    @property
    def serving_selector(self) -> dict[str, str]:
        """The labels that select the one serving pod."""
        return {**self.pod_labels, self.serving_label: "true"}

    @property
    def tls_server_name(self) -> str:
        """The name the scrape verifies in the exporter's certificate: the setting, or the Service's name."""
        return self.scrape_tls_server_name or f"grpo-exporter.{self.namespace}.svc"

    @property
    def pods_in_own_namespace(self) -> bool:
        """Whether every training pod is in ``namespace`` (what a namespaced Service can select)."""
        return self.pod_namespaces in ([], [self.namespace])
