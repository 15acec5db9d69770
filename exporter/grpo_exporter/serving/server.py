"""The HTTP(S) endpoint: prometheus-client's WSGI app behind a server that a hostile client cannot hurt.

Binds 127.0.0.1 by default (0.0.0.0 or ``::`` is an explicit choice for containers; IPv6 addresses work, a
hostname is resolved once, IPv4 preferred); ``port=0`` picks a free port, reported by :attr:`MetricsServer.port`.
A busy port raises :class:`PortInUseError` at start; a host that does not resolve or is no address of this
machine raises :class:`AddressUnavailableError` naming it. What a client can cost the training process is bounded:

* the accept loop only accepts: TLS handshakes and request parsing run in a bounded pool of worker threads
  (``WORKERS``); a connection beyond it is closed at once; the listen backlog is 128;
* every connection has a read timeout (``IDLE_TIMEOUT_S``), TLS handshake included, and a deadline for the
  whole exchange (``REQUEST_DEADLINE_S``: handshake, headers, body and answer), so neither an idle client nor
  one that trickles a byte every few seconds (slowloris) ties up a worker for more than seconds;
* when every worker is busy, a new connection that sends its whole request head at once (plain: request line
  and headers; TLS: the first handshake record) within ``PROMPT_S``, as a scraper does, evicts the oldest
  connection still sending its request after ``EVICT_AFTER_S``; a new connection that trickles is dropped, so
  reconnecting tricklers never evict each other and scrapes are answered;
* :meth:`MetricsServer.close` returns within 2 s whatever the clients do (it closes their sockets);
* basic auth (exporter-toolkit's scheme): the hash format is validated at configuration time; an unknown
  user is checked against a dummy hash of the same cost, so timing does not reveal user names; verified
  credentials are cached, so a scraper pays the slow hash once; one lock lets at most one slow hash run at a
  time, and failed attempts draw on a small token bucket: past it, the answer is 429 without hashing, so a
  flood of wrong passwords costs the training process a few slow hashes a second at most; while failed
  attempts are being throttled, the accept loop also sheds connections beyond ``CONNECTIONS_PER_S`` a
  second before reading a byte; every dropped connection (shed, or all workers busy) makes the loop rest
  ``SHED_PAUSE_S``, so a client that reconnects at once costs at most ~200 dropped accepts a second beside
  the connections it is answered on (scrapes may fail during such a flood: training comes first).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import select
import socket
import socketserver
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from socketserver import BaseServer
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from grpo_exporter.serving.health import WithHealth
from grpo_exporter.serving.reading import Render, WithReading
from grpo_exporter.serving.settings import hash_password, parse_password_hash, verify_password

WORKERS = 8
BACKLOG = 128
IDLE_TIMEOUT_S = 5.0
REQUEST_DEADLINE_S = 10.0  # a connection's whole exchange; Prometheus' own scrape_timeout defaults to 10 s
PROMPT_S = 0.05  # every worker busy: a new connection whose request head is in within this may evict a slow one
EVICT_AFTER_S = 0.25  # a connection still sending its request this long may be evicted by a prompt one
EVICT_WAIT_S = 0.5  # how long a new connection waits for the evicted one's worker
TLS_RECORD_HEADER = 5  # content type, version, length (2 bytes)
CLOSE_WITHIN_S = 2.0
FAILED_AUTH_PER_S = 1.0  # refill of the failed-attempt bucket: slow hashes a second a wrong-password flood gets
FAILED_AUTH_BURST = 5
CONNECTIONS_PER_S = 50.0  # under a wrong-password flood: connections a second still accepted
CONNECTIONS_BURST = 50
SHED_PAUSE_S = 0.005  # after shedding a connection the accept loop rests: a reconnect storm costs <= 200 accepts/s
VERIFIED_CACHE = 16


class PortInUseError(OSError):
    """The configured port is taken by another process."""


class AddressUnavailableError(OSError):
    """The configured host cannot be bound: a name that does not resolve, an address that is not this machine's,
    or an IPv6 address where the machine has no IPv6. Raised whatever ``strict`` says: unlike a busy port there is
    no equivalent to fall back to (another address would change who can reach the endpoint)."""


def _bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """The family and socket address to bind ``host:port``: an IP literal as it is, a name resolved once (an IPv4
    address preferred, as Prometheus' targets usually are). ``socket.gaierror`` for a name that does not
    resolve."""
    if ":" in host:
        return socket.AF_INET6, (host, port)
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    return family, address


def _unavailable(host: str, port: int, exc: OSError) -> AddressUnavailableError:
    reason = exc.strerror or str(exc)
    return AddressUnavailableError(
        errno.EADDRNOTAVAIL, f"host {host!r}: cannot serve port {port} there ({reason}); expected an address of this "
        "machine or a name that resolves to one (127.0.0.1; 0.0.0.0 or :: for every interface)",
    )


class _Handler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S  # socket timeout of every read: an idle client is dropped after it
    server: _Server

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.headed()  # the request line and headers are in: no longer a candidate for eviction
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news; stay silent."""


@dataclass(eq=False)
class _Connection:
    """One served connection: its socket (the TLS one once wrapped), when it was accepted, and whether its
    request's headers are in."""

    sock: socket.socket
    accepted: float
    headed: bool = False

    def cut(self) -> None:
        """End it from another thread: the worker's pending read returns and the worker lets it go."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class BasicAuth:
    """HTTP basic auth in front of a WSGI app, against one user and a PBKDF2 hash."""

    def __init__(self, app: Callable[..., Iterable[bytes]], user: str, password_hash: str) -> None:
        iterations = parse_password_hash(password_hash)[0]  # validated at configuration too: never a 500 a scrape
        self.app, self.user, self.password_hash = app, user, password_hash
        self._dummy = hash_password("not the password", iterations)  # same cost for an unknown user
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._slow = threading.Lock()  # at most one key derivation at a time
        self.failures = _TokenBucket(FAILED_AUTH_PER_S, FAILED_AUTH_BURST)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        verdict = self.check(environ.get("HTTP_AUTHORIZATION", ""))
        if verdict == "ok":
            return self.app(environ, start_response)
        if verdict == "throttled":
            start_response("429 Too Many Requests", [("Retry-After", "1")])
            return [b"too many failed attempts\n"]
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="grpo-exporter"')])
        return [b"unauthorized\n"]

    def check(self, header: str) -> str:
        """``ok``, ``denied`` or ``throttled`` for an Authorization header."""
        if not header.startswith("Basic "):
            return "denied"
        fingerprint = hashlib.sha256(header.encode(errors="replace")).digest()
        with self._slow:
            if fingerprint in self._verified:
                self._verified.move_to_end(fingerprint)
                return "ok"
            if not self.failures.take():
                return "throttled"
            try:
                name, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
            except ValueError:
                return "denied"
            known = hmac.compare_digest(name.encode(), self.user.encode())
            ok = verify_password(password, self.password_hash if known else self._dummy) and known
            if ok:
                self.failures.give_back()  # a success costs no failure token
                self._verified[fingerprint] = None
                while len(self._verified) > VERIFIED_CACHE:
                    self._verified.popitem(last=False)
            return "ok" if ok else "denied"


class _TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved; not thread-safe (callers hold a lock or are the
    accept loop)."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.refilled = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.refilled) * self.rate)
        self.refilled = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def give_back(self) -> None:
        self.tokens = min(self.burst, self.tokens + 1.0)


def _prompt(sock: socket.socket, tls: bool) -> bool:
    """Whether a new connection's request head is in within ``PROMPT_S`` (read with MSG_PEEK: the worker reads it
    again): the request line and headers, or for TLS the whole first record (the ClientHello)."""
    deadline = time.monotonic() + PROMPT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            if not select.select([sock], [], [], left)[0]:
                return False
            head = sock.recv(1 << 14, socket.MSG_PEEK)
        except (OSError, ValueError):
            return False
        if not head:
            return False
        if tls:
            if len(head) >= TLS_RECORD_HEADER and len(head) >= TLS_RECORD_HEADER + int.from_bytes(head[3:5], "big"):
                return True
        elif b"\r\n\r\n" in head or len(head) == 1 << 14:
            return True
        time.sleep(0.005)  # more of it may be on its way; the bytes already there keep select() answering
    return False


class _Server(WSGIServer):
    """A WSGI server whose accept loop only accepts; each connection is served (TLS handshake included) by
    one of ``WORKERS`` threads, or closed at once when all are busy."""

    request_queue_size = BACKLOG
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[Any, ...], tls: ssl.SSLContext | None,
                 family: socket.AddressFamily = socket.AF_INET) -> None:
        self.address_family = family
        self.tls = tls
        self.slots = threading.BoundedSemaphore(WORKERS)
        self.open_connections: set[_Connection] = set()
        self.connections_lock = threading.Lock()
        self.current = threading.local()  # the worker thread's connection
        self.closing = False
        self.accepting = _TokenBucket(CONNECTIONS_PER_S, CONNECTIONS_BURST)
        self.auth: BasicAuth | None = None
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        """Bind as ``WSGIServer`` does, without its reverse DNS lookup of the address (``socket.getfqdn``: for
        0.0.0.0 a lookup of the machine's name, which can hang for seconds where DNS is unreachable)."""
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        shedding = self.auth is not None and self.auth.failures.tokens < 1.0 and not self.accepting.take()
        served = not self.closing and not shedding and (
            self.slots.acquire(blocking=False)
            or (_prompt(request, self.tls is not None) and self._evict_slowest()
                and self.slots.acquire(timeout=EVICT_WAIT_S))
        )
        if not served:
            self.shutdown_request(request)  # shed, or every worker busy: drop it; a scraper retries next interval
            if not self.closing:  # a client that reconnects at once would keep this loop (and a core) busy
                time.sleep(SHED_PAUSE_S)
            return
        connection = _Connection(request, time.monotonic())
        with self.connections_lock:
            self.open_connections.add(connection)
        threading.Thread(target=self._serve, args=(connection, client_address), daemon=True,
                         name="grpo-exporter-http-worker").start()

    def _evict_slowest(self) -> bool:
        """Cut the oldest connection still sending its request after ``EVICT_AFTER_S``; whether there was one."""
        now = time.monotonic()
        with self.connections_lock:
            slow = [c for c in self.open_connections if not c.headed and now - c.accepted >= EVICT_AFTER_S]
            if not slow:
                return False
            min(slow, key=lambda c: c.accepted).cut()
        return True

    def service_actions(self) -> None:
        """Each turn of the accept loop (at most ``poll_interval`` apart): cut the connections past their
        deadline, whatever they are doing."""
        now = time.monotonic()
        with self.connections_lock:
            for connection in self.open_connections:
                if now - connection.accepted > REQUEST_DEADLINE_S:
                    connection.cut()

    def headed(self) -> None:
        """Called by the worker once its request's headers are in."""
        connection = getattr(self.current, "connection", None)
        if connection is not None:
            connection.headed = True

    def _serve(self, connection: _Connection, client_address: Any) -> None:
        conn = connection.sock
        self.current.connection = connection
        try:
            conn.settimeout(IDLE_TIMEOUT_S)
            if self.tls is not None:
                with self.connections_lock:  # wrapping takes the socket's descriptor over
                    conn = connection.sock = self.tls.wrap_socket(conn, server_side=True,
                                                                  do_handshake_on_connect=False)
                conn.do_handshake()  # bounded by the socket timeout and the deadline
            self.finish_request(conn, client_address)
        except Exception:
            pass
        finally:
            self.current.connection = None
            with self.connections_lock:
                self.open_connections.discard(connection)
            self.shutdown_request(conn)
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Client errors are not logged with a traceback."""

    def drop_connections(self) -> None:
        with self.connections_lock:
            connections, self.open_connections = list(self.open_connections), set()
        for connection in connections:
            connection.cut()
            with contextlib.suppress(OSError):
                connection.sock.close()


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
        health: Callable[[], dict[str, Any]] | None = None,
        reading: Render | None = None,
    ) -> None:
        """``health``: the document of ``/healthz`` (:mod:`grpo_exporter.serving.health`); ``reading``: the
        answer of ``/reading`` (:mod:`grpo_exporter.serving.reading`); None: no such path."""
        app: Callable[..., Iterable[bytes]] = make_wsgi_app(registry)
        if health is not None:
            app = WithHealth(app, health)
        if reading is not None:
            app = WithReading(app, reading)
        auth = None
        if auth_user and auth_password_hash:
            app = auth = BasicAuth(app, auth_user, auth_password_hash)
        context = None
        if tls_cert and tls_key:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(tls_cert), str(tls_key))
        try:
            family, address = _bind_address(host, port)
            self._httpd = _Server(address, context, family)
        except socket.gaierror as exc:
            raise _unavailable(host, port, exc) from exc
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    exc.errno, f"port {port} on {host} is already in use; choose another port or port=0 for a free one"
                ) from exc
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):  # EINVAL: fe80::1, no scope
                raise _unavailable(host, port, exc) from exc
            raise
        self._httpd.set_app(app)
        self._httpd.auth = auth
        self.scheme = "https" if context is not None else "http"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="grpo-exporter-http", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._httpd.server_address[0])  # a str for AF_INET / AF_INET6 servers
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop accepting, let answers in flight finish (briefly), close every client connection that is
        left, and return (within ~2 s whatever the clients do)."""
        deadline = time.monotonic() + CLOSE_WITHIN_S * 0.5
        self._httpd.closing = True
        stopper = threading.Thread(target=BaseServer.shutdown, args=(self._httpd,), daemon=True)
        stopper.start()
        stopper.join(timeout=CLOSE_WITHIN_S / 2)
        while self._httpd.open_connections and time.monotonic() < deadline:  # e.g. the scrape close() waited for
            time.sleep(0.01)
        self._httpd.drop_connections()
        self._httpd.server_close()
        self._thread.join(timeout=max(0.0, deadline + CLOSE_WITHIN_S * 0.2 - time.monotonic()))
