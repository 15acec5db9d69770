"""Real Prometheus-family binaries for tests: free ports on 127.0.0.1, started and always stopped."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is required (Debian prometheus / prometheus-alertmanager, see scripts/setup.sh)")
    return path


def wait_ready(url: str, timeout: float = 30.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


@contextmanager
def alertmanager(config: Path, workdir: Path) -> Iterator[str]:
    """A real prometheus-alertmanager on a free port, clustering off; yields its base URL."""
    port = free_port()
    log = (workdir / "alertmanager.log").open("w")
    process = subprocess.Popen(
        [binary("prometheus-alertmanager"), f"--config.file={config}", f"--storage.path={workdir / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/-/ready", process=process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


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
