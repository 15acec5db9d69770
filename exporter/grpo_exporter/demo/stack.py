"""The local stack of the demo: a real Prometheus and Alertmanager (Debian binaries) on 127.0.0.1 with free
ports, the rules generated from the mixin config with time shrunk, and a built-in webhook receiver that
prints every page as it arrives. Everything it starts is stopped by :meth:`Stack.close`."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from grpo_exporter.demo.scenarios import STEPS_PER_SECOND
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.receivers import webhooks
from grpo_exporter.mixin.render import alertmanager_output, rules_outputs

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
BINARIES = ("prometheus", "prometheus-alertmanager")
INSTALL_HINT = (
    "the demo's stack needs the Debian packages `prometheus` and `prometheus-alertmanager`: "
    "sudo apt-get install -y prometheus prometheus-alertmanager (or use --no-stack)"
)


def demo_mixin(**overrides: Any) -> MixinConfig:
    """The rules config of the demo: the production rules and baselines with time shrunk 50x (a 1 h baseline
    window ending 10 min back becomes 72 s ending 12 s back), Alertmanager's waits shortened to match. The demo
    trains at 2 steps/s: 0.5 s per step is 25 s at production time, its ``step_seconds``."""
    # GRPOExporterDown waits 10 s, not 2 s: Prometheus' service discovery publishes targets in batches every
    # 5 s, so at start `up` is absent for ~5 s whatever the scrape interval (a time that does not scale).
    settings: dict[str, Any] = {"time_scale": 0.02, "group_wait_s": 50, "group_interval_s": 250,
                                "repeat_interval_s": 3600, "for_seconds": {"GRPOExporterDown": 500}} | overrides
    settings.setdefault("step_seconds", 1.0 / STEPS_PER_SECOND / settings["time_scale"])
    return MixinConfig(**settings)


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reading_link(description: str) -> str:
    """The link a page's description gives to the rollouts to read first (:func:`~grpo_exporter.mixin.promql.
    reading_link`), or ''."""
    found = re.search(r"Rollouts to read first: (\S+)", description)
    return found.group(1) if found else ""


@dataclass(frozen=True)
class Page:
    receiver: str
    status: str
    alert: str
    layer: str
    severity: str
    run: str
    summary: str
    runbook: str
    reading: str = ""  # the link to the rollouts to read first, from the description (empty without a reading set)
    received_at: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        kind = "NOTICE" if self.severity == "info" else "PAGE"  # a notice (info) states the run's setup, once
        return (f"{kind} [{self.receiver}] {self.status.upper()} {self.alert} layer={self.layer} "
                f"severity={self.severity} run={self.run}: {self.summary} (runbook: {self.runbook})")


class _Receiver:
    def __init__(self, on_page: Callable[[Page], None]) -> None:
        self.pages: list[Page] = []
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                for alert in body.get("alerts", []):
                    labels, notes = alert.get("labels", {}), alert.get("annotations", {})
                    page = Page(self.path.strip("/"), alert.get("status", ""), labels.get("alertname", ""),
                                labels.get("layer", ""), labels.get("severity", ""), labels.get("run", ""),
                                notes.get("summary", ""), notes.get("runbook_url", ""),
                                reading_link(notes.get("description", "")))
                    with lock:
                        receiver.pages.append(page)
                    on_page(page)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# bound before any fork: the child between fork and exec only makes this one call
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the thread that started it dies, however that
    happens (even SIGKILL), so that no Prometheus or Alertmanager outlives the demo or the test."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_service(
    binary: str, args: list[str], log: Path, timeout: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a Prometheus-family binary on a free 127.0.0.1 port and wait for ``/-/ready``; (process, URL)."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen([binary, *args, f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{binary} exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.1)
    stop_services([process])
    raise TimeoutError(f"{binary} not ready after {timeout}s; see {log}")


def stop_services(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate, then kill what does not stop within 10 s."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


class Stack:
    """Prometheus scraping exporter ports on 127.0.0.1 (``targets`` from the start, more with
    :meth:`add_target`; file service discovery) and Alertmanager routing to the built-in receiver."""

    def __init__(self, mixin: MixinConfig | None = None, on_page: Callable[[Page], None] = lambda page: None,
                 workdir: Path | None = None, targets: tuple[int, ...] = ()) -> None:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"missing {', '.join(missing)}: {INSTALL_HINT}")
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="grpo-demo-")
            workdir = Path(self._tmp.name)
        self.workdir = workdir
        self.receiver = _Receiver(on_page)
        self.mixin = (mixin or demo_mixin()).model_copy(
            update={"receivers": webhooks(pager=f"{self.receiver.url}/pager",
                                          default=f"{self.receiver.url}/default")}
        )
        self.processes: list[subprocess.Popen[bytes]] = []
        self.targets = self.workdir / "targets.json"
        self._lock = threading.Lock()
        self._ports = list(targets)  # scraped from the first evaluation on: no "absent" page at start
        self._write_targets()
        for name, text in rules_outputs(self.mixin).items():
            (self.workdir / name).write_text(text)
        (self.workdir / "alertmanager.yml").write_text(alertmanager_output(self.mixin))
        self.alertmanager_url = self._start(
            "prometheus-alertmanager", "alertmanager",
            [f"--config.file={self.workdir / 'alertmanager.yml'}", f"--storage.path={self.workdir / 'am'}",
             "--cluster.listen-address="],
        )
        (self.workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [grpo-recording.rules.yml, grpo-alerts.rules.yml]\n"
            f"alerting:\n  alertmanagers:\n  - static_configs: [{{targets: ['{self.alertmanager_url[7:]}']}}]\n"
            "scrape_configs:\n- job_name: grpo\n"
            f"  file_sd_configs: [{{files: ['{self.targets}'], refresh_interval: 1s}}]\n"
        )
        self.prometheus_url = self._start(
            "prometheus", "prometheus",
            [f"--config.file={self.workdir / 'prometheus.yml'}", f"--storage.tsdb.path={self.workdir / 'tsdb'}"],
        )

    @property
    def pages(self) -> list[Page]:
        return list(self.receiver.pages)

    def add_target(self, port: int) -> None:
        """Have Prometheus scrape an exporter on 127.0.0.1:``port`` (file discovery: picked up within ~1 s)."""
        with self._lock:
            self._ports.append(port)
            self._write_targets()

    def retire_target(self, port: int, timeout: float = 15.0) -> None:
        """Stop scraping ``port`` and wait until Prometheus has dropped it, so that the exporter can close
        without a failed scrape (``up == 0`` would page GRPOExporterDown)."""
        with self._lock:
            self._ports.remove(port)
            self._write_targets()
        instance = f"127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.prometheus_url}/api/v1/targets?state=active", timeout=5) as r:
                active = json.load(r)["data"]["activeTargets"]
            if all(t["labels"].get("instance") != instance for t in active):
                return
            time.sleep(0.2)
        raise TimeoutError(f"Prometheus still scrapes {instance} after {timeout}s")

    def _write_targets(self) -> None:
        payload = [{"targets": [f"127.0.0.1:{port}" for port in self._ports]}] if self._ports else []
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(self.targets)

    def _start(self, binary: str, name: str, args: list[str]) -> str:
        process, url = start_service(binary, args, self.workdir / f"{name}.log")
        self.processes.append(process)
        return url

    def close(self) -> None:
        stop_services(self.processes)
        self.receiver.server.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
