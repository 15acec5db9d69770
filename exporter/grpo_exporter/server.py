"""The HTTP(S) endpoint: prometheus-client's WSGI app on a threading server, with optional TLS and basic auth.

Binds 127.0.0.1 by default (0.0.0.0 is an explicit choice for containers); ``port=0`` picks a free port,
reported by :attr:`MetricsServer.port`. A busy port raises :class:`PortInUseError` at start.
"""

from __future__ import annotations

import base64
import errno
import hmac
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from grpo_exporter.monitor_config import verify_password


class PortInUseError(OSError):
    """The configured port is taken by another process."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news; stay silent."""


def basic_auth(app: Callable[..., Iterable[bytes]], user: str, password_hash: str) -> Callable[..., Iterable[bytes]]:
    """Wrap a WSGI app with HTTP basic auth against a PBKDF2 hash; a verified header is remembered so a
    scrape storm does not pay the key derivation on every request."""
    accepted: set[str] = set()
    lock = threading.Lock()

    def check(header: str) -> bool:
        with lock:
            if any(hmac.compare_digest(header, known) for known in accepted):
                return True
        if not header.startswith("Basic "):
            return False
        try:
            name, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except ValueError:
            return False
        ok = hmac.compare_digest(name, user) and verify_password(password, password_hash)
        if ok:
            with lock:
                accepted.add(header)
        return ok

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if check(environ.get("HTTP_AUTHORIZATION", "")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="grpo-exporter"')])
        return [b"unauthorized\n"]

    return wrapped


class MetricsServer:
    """Serves ``registry`` on ``host:port`` in a daemon thread until :meth:`close`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        auth_user: str | None = None,
        auth_password_hash: str | None = None,
    ) -> None:
        app = make_wsgi_app(registry)
        if auth_user and auth_password_hash:
            app = basic_auth(app, auth_user, auth_password_hash)
        try:
            self._httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    exc.errno, f"port {port} on {host} is already in use; choose another port or port=0 for a free one"
                ) from exc
            raise
        self.scheme = "http"
        if tls_cert and tls_key:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(tls_cert), str(tls_key))
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="grpo-exporter-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
