"""Where and how the serving rank serves: bind address and port, TLS, basic auth, and the announced target
(``targets_dir``: :mod:`grpo_exporter.serving.targets`), a part of the monitor's configuration
(:class:`~grpo_exporter.runtime.monitor_config.MonitorConfig` inherits them). The helpers check a host and make and
verify basic-auth password hashes (``grpo-exporter hash-password``)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from grpo_exporter import catalog
from grpo_exporter.config_files import short_repr
from grpo_exporter.settings import Settings

DEFAULT_PORT = 9887  # in the exporters' range 9100-9999 of Prometheus' default port allocations
PASSWORD_SCHEME = "pbkdf2_sha256"
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
MAX_TARGET_LABELS = 16  # each is on every series of the run
_LABEL_NAME = re.compile(r"[a-zA-Z][a-zA-Z0-9_]{0,127}")  # no leading _: Prometheus reserves __ names
DAY_S = 86400.0  # the longest targets_stale_after_s is 30 of them
#: targets_stale_after_s: its default, and its floor (a live exporter touches its file every minute: a shorter
#: line would remove live targets); `grpo-exporter targets prune` takes the same
STALE_AFTER_S, MIN_STALE_AFTER_S = 3600.0, 300.0


def check_host(value: str) -> str:
    """``value`` if it is an address to bind: an IPv4 or IPv6 literal (an IPv6 one may come in URL brackets,
    ``[::1]``, which are removed) or a hostname (letters, digits, ``-`` and ``_`` in dot-separated labels, as
    container and service names are). ``ValueError`` saying why otherwise: an empty host would bind every
    interface, and whitespace or a malformed address fails only later, in the server, far from the setting."""
    if not value:
        raise ValueError("expected an address to bind (127.0.0.1; 0.0.0.0 or :: for every interface), got ''")
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError(f"expected an address without whitespace or control characters, got {short_repr(value)}")
    if value.startswith("[") and value.endswith("]"):
        if ":" not in value or not is_ip(value[1:-1]):
            raise ValueError(f"expected an IPv6 address inside the brackets, got {short_repr(value)}")
        return value[1:-1]
    if is_ip(value):
        return value
    with contextlib.suppress(OSError):  # inet_aton's forms ("0x0", "127.1"): the resolver would bind them
        read = socket.inet_ntoa(socket.inet_aton(value))
        raise ValueError(f"expected an IPv4 address in dotted-decimal form, got {short_repr(value)} (which the "
                         f"resolver reads as {read})")
    if ":" in value:
        raise ValueError(f"expected an IPv6 address (or an IPv4 address or hostname), got {short_repr(value)}")
    labels = value.removesuffix(".").split(".")
    if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"expected an IPv4 or IPv6 address or a hostname, got {short_repr(value)}")
    return value


def is_ip(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 address literal."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def hash_password(password: str, iterations: int = 200_000) -> str:
    """A salted PBKDF2-SHA256 hash for ``basic_auth_password_hash``: ``pbkdf2_sha256$iterations$salt$hex``."""
    salt = secrets.token_hex(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), iterations).hex()
    return f"{PASSWORD_SCHEME}${iterations}${salt}${digest}"


def parse_password_hash(encoded: str) -> tuple[int, str, str]:
    """(iterations, salt, hex digest) of a :func:`hash_password` string; ``ValueError`` saying what is wrong."""
    parts = encoded.split("$")
    if len(parts) != 4 or parts[0] != PASSWORD_SCHEME:
        raise ValueError(
            f"basic_auth_password_hash: expected '{PASSWORD_SCHEME}$ITERATIONS$SALT$HEX' from "
            f"`grpo-exporter hash-password`, got {len(parts)} '$'-separated parts starting {parts[0][:20]!r}"
        )
    _, iterations, salt, digest = parts
    if not iterations.isdigit() or not 1_000 <= int(iterations) <= 10_000_000:
        raise ValueError(f"basic_auth_password_hash: expected iterations 1000..10000000, got {iterations!r}")
    if not salt or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("basic_auth_password_hash: expected a non-empty salt and a 64-digit lowercase hex digest")
    return int(iterations), salt, digest


def verify_password(password: str, encoded: str) -> bool:
    """Check ``password`` against a :func:`hash_password` string (constant-time comparison of the digests)."""
    iterations, salt, digest = parse_password_hash(encoded)
    candidate = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), iterations).hex()
    return hmac.compare_digest(candidate, digest)


class ServingSettings(Settings):
    """The endpoint's fields; ``port`` None: this process serves nothing."""

    host: str | None = Field(
        None, description="bind address: an IPv4 or IPv6 address (brackets, [::1], are removed) or a hostname, "
        "checked at construction. None: 127.0.0.1 (this machine only), or with targets_dir the advertised address "
        "(advertise_host, or the node's own address: reachable from the cluster, bound on that interface only); "
        "0.0.0.0 (or :: for IPv6 too) binds every interface (containers). An address this machine cannot bind "
        "raises AddressUnavailableError naming it when serving starts",
    )
    port: int | None = Field(
        DEFAULT_PORT, ge=0, le=65535, description="HTTP port; 0 picks a free one; None serves nothing (a bool is "
        "an error, not port 1)"
    )
    advertise_host: str | None = Field(
        None, min_length=1, max_length=253, description="with targets_dir: the host written in the target file, "
        "the name or address Prometheus reaches this node at (e.g. the node's name in the cluster's DNS). None: "
        "host when it names one address, else this node's address on its default route"
    )
    targets_dir: Path | None = Field(
        None, description="a directory Prometheus reads with file_sd_configs (on a filesystem both see): the "
        "serving rank writes grpo-<run>@<host>_<port>.json there, naming the host and port it serves (after any port "
        "fallback) with the job, run and targets_labels labels, and removes it once the run's end was scraped; "
        "a crashed run's file stays (GRPOExporterDown pages) until it is older than targets_stale_after_s"
    )
    targets_job: str = Field(
        "grpo", min_length=1, max_length=128, description="the job label of the announced target (the rules "
        "select job=\"grpo\" unless generated with another `selector`)"
    )
    targets_labels: dict[str, str] = Field(
        default_factory=dict, description="more labels of the announced target (e.g. the scheduler's job id): "
        "every series of the run carries them; job and run are set by the exporter"
    )
    targets_stale_after_s: float = Field(
        STALE_AFTER_S, ge=MIN_STALE_AFTER_S, le=30 * DAY_S, description="a target file not touched for this long "
        "is removed by the next exporter that starts in targets_dir and by `grpo-exporter targets prune` (a serving "
        "exporter touches its file every minute): how long a crashed run's target keeps GRPOExporterDown firing at "
        "most, unless the lifecycle lookback of the rules (6 h by default) ends it first"
    )
    tls_cert: Path | None = Field(None, description="PEM certificate: serve HTTPS when given with tls_key")
    tls_key: Path | None = None
    basic_auth_user: str | None = Field(None, min_length=1, max_length=256)
    basic_auth_password_hash: str | None = Field(
        None, max_length=1024, description="from grpo_exporter.hash_password()"
    )

    @field_validator("host")
    @classmethod
    def _host_is_an_address(cls, value: str | None) -> str | None:
        return None if value is None else check_host(value)

    @field_validator("advertise_host")
    @classmethod
    def _advertised_is_an_address(cls, value: str | None) -> str | None:
        return None if value is None else check_host(value)

    @field_validator("targets_job")
    @classmethod
    def _job_is_a_label_value(cls, value: str) -> str:
        return catalog.check_label_value("targets_job", value)

    @field_validator("targets_labels")
    @classmethod
    def _labels_are_labels(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_TARGET_LABELS:
            raise ValueError(f"targets_labels: expected at most {MAX_TARGET_LABELS} labels, got {len(value)}")
        for name, text in value.items():
            if not _LABEL_NAME.fullmatch(name) or name in ("job", "run", "instance"):
                raise ValueError(f"targets_labels: expected label names ([a-zA-Z][a-zA-Z0-9_]*, not job, run or "
                                 f"instance, which the exporter and Prometheus set), got {name!r}")
            catalog.check_label_value(f"targets_labels[{name!r}]", text)
        return value

    @model_validator(mode="after")
    def _pairs(self) -> ServingSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: expected both or neither")
        if (self.basic_auth_user is None) != (self.basic_auth_password_hash is None):
            raise ValueError("basic_auth_user and basic_auth_password_hash: expected both or neither")
        if self.basic_auth_password_hash:
            parse_password_hash(self.basic_auth_password_hash)
        return self
