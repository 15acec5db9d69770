"""The run's scrape endpoint: the catalogue collector registered on the registry, and, where this rank serves,
the process collector and the HTTP server; at the end it lingers for one more scrape."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from grpo_exporter.serving.collector import CatalogCollector
from grpo_exporter.serving.publication import Publication
from grpo_exporter.serving.server import MetricsServer, PortInUseError


@dataclass(frozen=True)
class Listen:
    """Where and how to serve: ``port`` 0 picks a free one; TLS with both files, basic auth with both fields."""

    host: str
    port: int
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_user: str | None = None
    auth_password_hash: str | None = None


class Endpoint:
    """The collector of ``publication`` on ``registry`` (a scrape's errors go to ``on_error``), served over
    HTTP when ``listen`` is given."""

    def __init__(self, publication: Publication, run: str, registry: CollectorRegistry,
                 on_error: Callable[[Exception], None], listen: Listen | None,
                 on_busy: Callable[[PortInUseError, int], None] | None = None) -> None:
        """``on_busy``: when the port is taken, serve on a free one and say so to it (with the error and the
        chosen port); None raises PortInUseError (strict mode)."""
        self._collector = CatalogCollector(publication, run, registry, on_error=on_error)
        self._server: MetricsServer | None = None
        if listen is not None:
            ProcessCollector(registry=registry)
            try:
                self._server = self._serve(registry, listen, listen.port)
            except PortInUseError as exc:
                if on_busy is None:
                    raise
                self._server = self._serve(registry, listen, 0)
                on_busy(exc, self._server.port)

    @staticmethod
    def _serve(registry: CollectorRegistry, listen: Listen, port: int) -> MetricsServer:
        return MetricsServer(registry, listen.host, port, listen.tls_cert, listen.tls_key, listen.auth_user,
                             listen.auth_password_hash)

    @property
    def port(self) -> int | None:
        """The bound port, or None when not serving."""
        return self._server.port if self._server else None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server else None

    def close(self, linger_s: float) -> None:
        """Stop serving once one more scrape has rendered the publication (at most ``linger_s``; not at all when
        nothing ever scraped): otherwise Prometheus sees the target vanish and cannot tell a normal end (the run's
        finished mark, published just before) from a crash. Idempotent."""
        if self._server is None:
            return
        seen = self._collector.scrapes
        deadline = time.monotonic() + linger_s
        while seen and self._collector.scrapes == seen and time.monotonic() < deadline:
            time.sleep(0.05)
        self._server.close()
        self._server = None


__all__ = ["Endpoint", "Listen"]
