"""Where a page goes: the integrations of Alertmanager's three receivers (``pager`` for criticals, ``default`` for
the rest, ``watchdog`` for the dead man's switch), configured once for ``alertmanager.yml`` and the Kubernetes
AlertmanagerConfig alike.

A secret (Slack's incoming-webhook URL, PagerDuty's routing key, Opsgenie's API key, the SMTP password, a
webhook URL in Kubernetes) is never written into a generated file. Alertmanager reads it from a file
(``alertmanager.yml``: ``<secrets_dir>/<receiver>-<integration>-<field>`` unless ``*_file`` names another) or the
operator from a key of a Kubernetes Secret (``<kubernetes_secret>``, key ``<receiver>-<integration>-<field>``
unless ``*_secret`` names another). One naming scheme: a Secret mounted as a folder is that folder of files.

Microsoft Teams is not offered: Alertmanager 0.25 (Debian bookworm's, which the tests run) has no Teams
integration, and the one that reads its URL from a file came with 0.28; docs/receivers.md says how to reach
Teams through a webhook meanwhile.
"""

from __future__ import annotations

import re
from email.utils import getaddresses
from typing import Annotated, ClassVar, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

#: a Kubernetes object name (RFC 1123 subdomain) and a Secret key
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]{1,253}$"
ReceiverName = Literal["pager", "default", "watchdog"]


def absolute_path(path: str) -> str:
    """A path Alertmanager reads whatever its working directory; never a URL or key pasted in its place."""
    if "://" in path or not path.startswith("/") or any(c.isspace() for c in path):
        raise ValueError("expected the absolute path of a file holding the secret (the secret itself goes into "
                         "that file, never into this config), got something else")
    return path


def absolute_dir(path: str) -> str:
    """A folder Alertmanager reads whatever its working directory."""
    if not path.startswith("/") or any(c.isspace() for c in path):
        raise ValueError("expected an absolute folder path")
    return path


def addresses(text: str) -> str:
    """One or more mail addresses, comma-separated (``Name <a@b>`` allowed)."""
    found = getaddresses([text])
    if not found or any("@" not in address or " " in address for _, address in found):
        raise ValueError("expected mail addresses (a@example.org, comma-separated)")
    return text


HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


def host_port(text: str) -> str:
    """``host:port`` or ``[v6]:port``, port 1..65535."""
    found = HOST_PORT.match(text)
    if found is None or not 0 < int(found[2]) < 65536:
        raise ValueError("expected host:port (an IPv6 address in brackets, port 1-65535)")
    return text


SecretFile = Annotated[str, AfterValidator(absolute_path)]


class SecretRef(BaseModel):
    """A key of a Kubernetes Secret in the manifests' namespace."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(pattern=DNS_SUBDOMAIN, description="the Secret's name")
    key: str = Field(pattern=SECRET_KEY, description="the key holding the value")


class Integration(BaseModel):
    """One integration of a receiver; ``SECRET`` names its secret field (``<SECRET>_file``, ``<SECRET>_secret``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    KIND: ClassVar[str]
    SECRET: ClassVar[str]
    send_resolved: bool = Field(True, description="also say when the alert resolves")

    def has_secret(self) -> bool:
        """Whether this integration reads a secret at all (an email without ``auth_username`` does not)."""
        return True

    def secret_name(self, receiver: str) -> str:
        """The default file name and Secret key: ``pager-slack-api-url``."""
        return f"{receiver}-{self.KIND}-{self.SECRET.replace('_', '-')}"

    def secret_file(self, receiver: str, secrets_dir: str) -> str:
        """The file alertmanager.yml reads the secret from: ``*_file``, else ``<secrets_dir>/<secret_name>``."""
        given: str | None = getattr(self, f"{self.SECRET}_file")
        return given or f"{secrets_dir.rstrip('/')}/{self.secret_name(receiver)}"

    def secret_ref(self, receiver: str, secret: str) -> SecretRef:
        """The Secret key the AlertmanagerConfig reads it from: ``*_secret``, else ``secret``'s ``secret_name``."""
        given: SecretRef | None = getattr(self, f"{self.SECRET}_secret")
        return given or SecretRef(name=secret, key=self.secret_name(receiver))


class Slack(Integration):
    KIND = "slack"
    SECRET = "api_url"
    api_url_file: SecretFile | None = Field(None, description="file holding the incoming-webhook URL")
    api_url_secret: SecretRef | None = Field(None, description="Kubernetes: the Secret key holding it")
    channel: str | None = Field(None, pattern=r"^[#@]?[A-Za-z0-9][A-Za-z0-9._-]{0,79}$", description="channel "
                                "(`#name`, `@user` or an ID; the webhook's own when unset)")


class PagerDuty(Integration):
    KIND = "pagerduty"
    SECRET = "routing_key"
    routing_key_file: SecretFile | None = Field(None, description="file holding the Events v2 routing "
                                                "(integration) key")
    routing_key_secret: SecretRef | None = Field(None, description="Kubernetes: the Secret key holding it")
    url: str | None = Field(None, pattern=r"^https?://", description="Events v2 API URL (Alertmanager's default "
                            "when unset; the EU service's, or a proxy's)")


class Opsgenie(Integration):
    KIND = "opsgenie"
    SECRET = "api_key"
    api_key_file: SecretFile | None = Field(None, description="file holding the API (integration) key")
    api_key_secret: SecretRef | None = Field(None, description="Kubernetes: the Secret key holding it")
    api_url: str | None = Field(None, pattern=r"^https?://", description="API URL (Alertmanager's default, "
                                "api.opsgenie.com, when unset; the EU service's or a proxy's)")


class Email(Integration):
    KIND = "email"
    SECRET = "auth_password"
    to: Annotated[str, AfterValidator(addresses)] = Field(description="recipient address(es), comma-separated")
    from_: Annotated[str, AfterValidator(addresses)] = Field(alias="from", description="sender address")
    smarthost: Annotated[str, AfterValidator(host_port)] = Field(description="SMTP server, host:port")
    auth_username: str | None = Field(None, min_length=1, description="SMTP user (no authentication when unset)")
    auth_password_file: SecretFile | None = Field(None, description="file holding the SMTP password")
    auth_password_secret: SecretRef | None = Field(None, description="Kubernetes: the Secret key holding it")
    require_tls: bool = Field(True, description="STARTTLS required (false only for a relay on a trusted network)")

    def has_secret(self) -> bool:
        """A password only with a user to log in as."""
        return self.auth_username is not None

    @model_validator(mode="after")
    def _password_needs_user(self) -> Self:
        if self.auth_username is None and (self.auth_password_file or self.auth_password_secret):
            raise ValueError("auth_password_file/auth_password_secret: expected auth_username with them (without a "
                             "user no authentication is attempted), got a password and no user")
        return self


class Webhook(Integration):
    KIND = "webhook"
    SECRET = "url"
    url: str | None = Field(None, pattern=r"^https?://", description="alertmanager.yml: the URL Alertmanager's "
                            "JSON is posted to (written as is: Alertmanager 0.25 reads no webhook URL from a file; "
                            "keep secrets out of it)")
    url_secret: SecretRef | None = Field(None, description="Kubernetes: the Secret key holding the URL (the "
                                         "AlertmanagerConfig never carries `url`)")


class Receiver(BaseModel):
    """The integrations of one receiver; any number of them (none: shown in Alertmanager's UI only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    slack: Slack | None = None
    pagerduty: PagerDuty | None = None
    email: Email | None = None
    opsgenie: Opsgenie | None = None
    webhook: Webhook | None = None

    @property
    def integrations(self) -> list[Slack | PagerDuty | Email | Opsgenie | Webhook]:
        """The integrations set, in a fixed order."""
        found = (self.slack, self.pagerduty, self.email, self.opsgenie, self.webhook)
        return [one for one in found if one is not None]


class Receivers(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    pager: Receiver = Field(default_factory=Receiver, description="critical alerts (your pager's integration)")
    default: Receiver = Field(default_factory=Receiver, description="every other alert (a chat channel's)")
    watchdog: Receiver = Field(default_factory=Receiver, description="GRPOWatchdog, always firing, every "
                               "`watchdog_repeat_interval_s`: a dead man's switch that calls when it stops")

    def by_name(self) -> dict[ReceiverName, Receiver]:
        """Each receiver under the name routes send to."""
        return {"pager": self.pager, "default": self.default, "watchdog": self.watchdog}


def webhooks(**urls: str) -> Receivers:
    """Receivers that each post Alertmanager's JSON to a URL, by receiver name (the demo's local receiver)."""
    return Receivers.model_validate({name: {"webhook": {"url": url}} for name, url in urls.items()})
