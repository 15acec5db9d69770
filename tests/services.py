"""Real Prometheus-family binaries for tests: free ports on 127.0.0.1, started and always stopped (with the
package's own helpers), and a local webhook receiver."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from grpo_exporter.demo.stack import start_service, stop_services


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is required (Debian prometheus / prometheus-alertmanager, see scripts/setup.sh)")
    return path


@contextmanager
def prometheus(config: Path, workdir: Path) -> Iterator[str]:
    """A real Prometheus on a free port; yields its base URL."""
    process, url = start_service(binary("prometheus"), [f"--config.file={config}",
                                 f"--storage.tsdb.path={workdir / 'tsdb'}"], workdir / "prometheus.log")
    try:
        yield url
    finally:
        stop_services([process])


@contextmanager
def alertmanager(config: Path, workdir: Path) -> Iterator[str]:
    """A real prometheus-alertmanager on a free port, clustering off; yields its base URL."""
    process, url = start_service(binary("prometheus-alertmanager"), [f"--config.file={config}",
                                 f"--storage.path={workdir / 'am-data'}", "--cluster.listen-address="],
                                 workdir / "alertmanager.log")
    try:
        yield url
    finally:
        stop_services([process])


class Webhook:
    """A local Alertmanager webhook receiver that records every notification, by path."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with hook.lock:
                    hook.received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self) -> list[tuple[str, dict]]:
        """(path, alert) for every alert of every notification received so far."""
        with self.lock:
            return [(path, alert) for path, body in self.received for alert in body["alerts"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post_json(url: str, payload: object) -> None:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.status


def prometheus_query(base: str, expr: str) -> dict:
    """The JSON answer of Prometheus' instant-query API, also for a rejected query (status "error")."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 0.1) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(every)


def query(base: str, expr: str) -> list[dict[str, Any]]:
    """The result vector of an instant query that must succeed."""
    answer = prometheus_query(base, expr)
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


class Poller:
    """Calls :meth:`poll` every ``every`` seconds on a daemon thread, from construction until :meth:`close`."""

    def __init__(self, every: float) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self.thread.start()

    def _run(self, every: float) -> None:
        while not self.stop.wait(every):
            self.poll()

    def poll(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class PageClock(Poller):
    """When each alert (by fingerprint) first reached ``webhook``, firing: polled every 0.1 s until close()."""

    def __init__(self, webhook: Webhook) -> None:
        self.webhook = webhook
        self.first: dict[str, float] = {}
        super().__init__(0.1)

    def poll(self) -> None:
        now = time.monotonic()
        for _, alert in self.webhook.alerts():
            if alert["status"] == "firing":
                self.first.setdefault(alert["fingerprint"], now)

    def pages(self, **labels: str) -> list[tuple[float, str, dict[str, Any]]]:
        """(first seen, receiver path, alert) of every firing alert delivered whose labels include ``labels``."""
        return [(self.first.get(a["fingerprint"], time.monotonic()), path, a) for path, a in self.webhook.alerts()
                if a["status"] == "firing" and labels.items() <= a["labels"].items()]
