"""The run's scrape endpoint: the catalogue collector registered on the registry, and, where this rank serves,
the process collector, the HTTP server (``/metrics``, ``/healthz``, ``/reading``) and the run's announced target
file; at the end it lingers for one more scrape, then withdraws the target and stops serving."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from grpo_exporter.serving.collector import CatalogCollector
from grpo_exporter.serving.health import health
from grpo_exporter.serving.publication import Publication
from grpo_exporter.serving.reading import Render
from grpo_exporter.serving.server import MetricsServer, PortInUseError
from grpo_exporter.serving.targets import Announcement, TargetFile


@dataclass(frozen=True)
class Listen:
    """Where and how to serve: ``port`` 0 picks a free one; TLS with both files, basic auth with both fields;
    ``announce``: write the served target for Prometheus' ``file_sd_configs``."""

    host: str
    port: int
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_user: str | None = None
    auth_password_hash: str | None = None
    announce: Announcement | None = None


class Endpoint:
    """The collector of ``publication`` on ``registry`` (a scrape's errors go to ``on_error``), served over
    HTTP when ``listen`` is given. The registry holds at most one open run's collector; :meth:`close` (or a
    failed construction) leaves it as it was found."""

    def __init__(self, publication: Publication, run: str, registry: CollectorRegistry,
                 on_error: Callable[[Exception], None], listen: Listen | None,
                 on_busy: Callable[[PortInUseError, int], None] | None = None,
                 on_announce_error: Callable[[Exception], None] | None = None,
                 reading: Render | None = None) -> None:
        """``reading``: the answer of ``/reading`` (the run's reading set), None: no such path. ``on_busy``: when the
        port is taken, serve on a free one and say so to it (with the error and the chosen port); None raises
        PortInUseError (strict mode). ``on_announce_error``: the target file could not be written (or touched, or
        removed): told to it, from the file's own thread, and serving goes on; None (strict mode) raises a failed
        first write here and logs later failures.
        """
        self._registry = registry
        self._owned: list[Collector] = []
        self._server: MetricsServer | None = None
        self._target: TargetFile | None = None
        self._publication, self._run, self._reading = publication, run, reading
        self._collector = CatalogCollector(publication, run, on_error=on_error)
        closing = _take(registry, run)
        try:
            registry.register(self._collector)
            self._owned.append(self._collector)
            _OPEN[registry] = (run, self._collector)
            if listen is not None:
                self._process_collector(registry)
                try:
                    self._server = self._serve(registry, listen, listen.port)
                except PortInUseError as exc:
                    if on_busy is None:
                        raise
                    self._server = self._serve(registry, listen, 0)
                    on_busy(exc, self._server.port)
                if listen.announce is not None:
                    self._announce(listen, listen.announce, on_announce_error)
        except BaseException:
            if self._server is not None:
                self._server.close()
                self._server = None
            self._release()
            _give_back(registry, closing)
            raise

    def _process_collector(self, registry: CollectorRegistry) -> None:
        """The process' own series (CPU, memory, start time) beside the run's, unless the registry has them
        already (prometheus-client's default registry registers its own at import)."""
        with contextlib.suppress(ValueError):  # DuplicateTimeseries: the registry's own collector serves them
            self._owned.append(ProcessCollector(registry=registry))

    def _release(self) -> None:
        """Unregister what this endpoint registered."""
        for collector in self._owned:
            with contextlib.suppress(KeyError):
                self._registry.unregister(collector)
        self._owned.clear()
        if _OPEN.get(self._registry, (None, None))[1] is self._collector:
            del _OPEN[self._registry]

    def _serve(self, registry: CollectorRegistry, listen: Listen, port: int) -> MetricsServer:
        publication, run = self._publication, self._run
        return MetricsServer(registry, listen.host, port, listen.tls_cert, listen.tls_key, listen.auth_user,
                             listen.auth_password_hash, health=lambda: health(run, publication.snapshot()),
                             reading=self._reading)

    def _announce(self, listen: Listen, announce: Announcement,
                  on_error: Callable[[Exception], None] | None) -> None:
        """Write the served target (the port actually bound) for Prometheus to discover: on a thread of its own
        (:class:`TargetFile`); None ``on_error`` (strict) raises a failed first write here."""
        assert self._server is not None
        host = announce.host or listen.host  # the assembly decides the advertised host; a bare Listen: the bound one
        target = f"[{host}]:{self._server.port}" if ":" in host else f"{host}:{self._server.port}"
        self._target = TargetFile(announce, self._run, target, self._server.scheme, on_error)

    @property
    def target(self) -> str | None:
        """The announced ``host:port`` (None when nothing is announced)."""
        return self._target.target if self._target else None

    @property
    def port(self) -> int | None:
        """The bound port, or None when not serving."""
        return self._server.port if self._server else None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server else None

    @property
    def scheme(self) -> str | None:
        """``http`` or ``https`` where this endpoint serves, else None."""
        return self._server.scheme if self._server else None

    def close(self, linger_s: float) -> None:
        """Stop serving once one more scrape has rendered the publication (at most ``linger_s``; not at all when
        nothing ever scraped): otherwise Prometheus sees the target vanish and cannot tell a normal end (the run's
        finished mark, published just before) from a crash. Then the registry is left as it was found. On a
        registry the monitor does not serve (``port=None``, another rank's), whoever serves it gets the same:
        the collector leaves once its next scrape has rendered the end, at once when nothing ever scraped it, and
        when a new monitor takes the registry. Idempotent."""
        if self._server is not None:
            seen = self._collector.scrapes
            deadline = time.monotonic() + linger_s
            while seen and self._collector.scrapes == seen and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                if self._target is not None:  # the end was scraped (or nothing ever scraped): withdraw the target
                    self._target.remove()
                    self._target = None
            finally:
                self._server.close()
                self._server = None
        elif self._collector.scrapes and self._collector in self._owned:
            self._collector.retire_after_next_scrape(self._registry)
            self._owned.remove(self._collector)  # it unregisters itself; the rest leave now
            _CLOSING[self._registry] = self._collector
        self._release()


#: the open run's collector on each registry (one at a time: two would print every family twice)
_OPEN: weakref.WeakKeyDictionary[CollectorRegistry, tuple[str, CatalogCollector]] = weakref.WeakKeyDictionary()
#: a closed run's collector still waiting for the scrape that shows its end, on a registry it does not serve
_CLOSING: weakref.WeakKeyDictionary[CollectorRegistry, CatalogCollector] = weakref.WeakKeyDictionary()


def _take(registry: CollectorRegistry, run: str) -> CatalogCollector | None:
    """Make room for run ``run``'s collector on ``registry``: an open run's is an error naming both (close it
    first, or give each its own registry); a closed run's collector still waiting for its last scrape leaves now,
    and is returned (a construction that fails gives it back: :func:`_give_back`)."""
    held = _OPEN.get(registry)
    if held is not None:
        raise ValueError(
            f"registry: expected a registry without another open GRPOMonitor, got one where run {held[0]!r} still "
            f"publishes (for run {run!r}): close() that monitor first, or give each monitor its own "
            "CollectorRegistry() (two would print every grpo_ family twice)"
        )
    closing = _CLOSING.pop(registry, None)
    if closing is not None:
        try:
            registry.unregister(closing)
        except KeyError:  # it saw its last scrape and left
            return None
    return closing


def _give_back(registry: CollectorRegistry, closing: CatalogCollector | None) -> None:
    """Put back a closed run's collector that :func:`_take` removed, its last scrape still owed."""
    if closing is not None:
        registry.register(closing)
        _CLOSING[registry] = closing


__all__ = ["Endpoint", "Listen"]
