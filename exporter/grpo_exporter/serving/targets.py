"""Target discovery by the exporter itself: the serving rank announces its run in a Prometheus ``file_sd`` file.

On a cluster the scheduler picks the node and, after a port fallback, the port: only the process knows where it
serves. With ``targets_dir`` (a directory Prometheus reads with ``file_sd_configs``, on a filesystem both see) the
serving rank writes ``grpo-<run>.json``: one target, ``<advertised host>:<port>``, with the labels the rules need
(``job``, ``run``, the configured ones) and ``__scheme__`` (https where TLS is on). The file is written atomically
(a temporary file renamed over it), after the port is bound, so it names the port actually served; a heartbeat
thread touches it every :data:`HEARTBEAT_S` (and writes it again if someone removed it).

Its life follows the run's: :meth:`TargetFile.remove` runs in ``close()`` after the scrape that saw the run's
normal end (a file removed at once hides ``grpo_run_finished``, and a clean end would then page
GRPOTrainingStalled). A process that died leaves its file, so Prometheus keeps scraping a dead target and
GRPOExporterDown pages the crash; the file stops being touched, and :func:`prune` removes it once it is older
than ``targets_stale_after_s`` (every exporter that starts in the directory prunes it; so does ``grpo-exporter
targets prune``, for a SLURM epilog or a timer). A run started again under the same name replaces its file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("grpo_exporter")

HEARTBEAT_S = 60.0  # how often a serving exporter touches its file: far below any stale_after_s worth setting
PREFIX = "grpo-"
MARKER = "__grpo_exporter_pid"  # a label of ours in every file (dropped by Prometheus after relabelling)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: an address outside any network this machine is in: connecting a UDP socket to it sends nothing, and makes the
#: kernel choose the source address of the default route (TEST-NET-2, RFC 5737)
_PROBE = ("198.51.100.1", 9)


@dataclass(frozen=True)
class Announcement:
    """Where and how to announce the run: ``directory`` read by Prometheus' ``file_sd_configs``; ``host`` the
    address other machines reach this one at (None: :func:`node_address`); ``labels`` besides ``job`` and
    ``run``; files older than ``stale_after_s`` are pruned at start."""

    directory: Path
    job: str = "grpo"
    host: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    stale_after_s: float = 3600.0


def node_address() -> str:
    """This machine's address on its default route (the interface a central Prometheus usually reaches), found
    without sending a packet; where there is no route, the address its hostname resolves to; 127.0.0.1 last."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(_PROBE)
        address = str(probe.getsockname()[0])
        if address != "0.0.0.0":
            return address
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def advertised_host(bind_host: str, configured: str | None) -> str:
    """The host written in the target: ``configured`` when given; else the bound address when it is one address
    (not every interface); else :func:`node_address`."""
    if configured:
        return configured
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return node_address()


def file_name(run: str) -> str:
    """``grpo-<run>.json`` with every character outside ``[A-Za-z0-9._-]`` replaced, plus a short hash of the
    run where one was (two runs never share a file; the same run always finds its own)."""
    safe = _UNSAFE.sub("_", run)
    if safe != run:
        safe = f"{safe}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"
    return f"{PREFIX}{safe}.json"


def target_text(target: str, job: str, run: str, labels: Mapping[str, str], scheme: str) -> str:
    """The ``file_sd`` document: one target group. ``job`` and ``run`` win over same-named configured labels."""
    group = {"targets": [target],
             "labels": {**labels, "job": job, "run": run, "__scheme__": scheme, MARKER: str(os.getpid())}}
    return json.dumps([group], indent=2) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never a part: a temporary
    file beside it (a name ``file_sd``'s ``*.json`` does not match), flushed, then renamed over it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


class Pruned(NamedTuple):
    """What :func:`prune` did: the files removed, and those it could not remove, with why."""

    removed: list[Path]
    failed: list[tuple[Path, OSError]]


def prune(directory: Path, stale_after_s: float, now: float | None = None) -> Pruned:
    """Remove this exporter's target files in ``directory`` not touched for ``stale_after_s`` (their process is
    gone: a live one touches its file every :data:`HEARTBEAT_S`); other files are left alone. A file that cannot be
    removed (another user's, in a directory with the sticky bit) is reported and the others are still pruned."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    failed: list[tuple[Path, OSError]] = []
    for path in sorted(directory.glob(f"{PREFIX}*.json")):
        try:
            if now - path.stat().st_mtime <= stale_after_s or not _ours(path):
                continue
            path.unlink()
            removed.append(path)
        except FileNotFoundError:  # removed meanwhile (another exporter pruning, its own run ending)
            continue
        except OSError as exc:
            failed.append((path, exc))
    return Pruned(removed, failed)


def _ours(path: Path) -> bool:
    """Whether ``path`` is a target file this exporter wrote (its marker label is in it)."""
    try:
        groups = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(groups, list) and any(isinstance(g, dict) and MARKER in g.get("labels", {}) for g in groups)


class TargetFile:
    """The run's announced target, written at construction (stale files pruned first), touched by a heartbeat
    thread until :meth:`remove`. Failures go to ``on_error`` (counted and logged; training goes on)."""

    def __init__(self, announcement: Announcement, run: str, target: str, scheme: str,
                 on_error: Callable[[Exception], None]) -> None:
        self.path = announcement.directory / file_name(run)
        self.target = target
        self._text = target_text(target, announcement.job, run, announcement.labels, scheme)
        self._on_error = on_error
        self._stop = threading.Event()
        announcement.directory.mkdir(parents=True, exist_ok=True)
        pruned = prune(announcement.directory, announcement.stale_after_s)
        for stale in pruned.removed:
            log.info("grpo-exporter: removed the stale target file %s (not touched for over %gs)",
                     stale, announcement.stale_after_s)
        for stale, exc in pruned.failed:  # not ours to fix: our own announcement goes on
            log.warning("grpo-exporter: cannot remove the stale target file %s (%s); it keeps its target in "
                        "Prometheus until its owner or `grpo-exporter targets prune` run by them removes it",
                        stale, exc.strerror or exc)
        write_atomically(self.path, self._text)
        log.info("grpo-exporter: announced %s in %s for Prometheus' file_sd_configs", target, self.path)
        self._thread = threading.Thread(target=self._heartbeat, name="grpo-exporter-targets", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                try:
                    os.utime(self.path)
                except FileNotFoundError:  # removed by hand or by a prune: the run still serves
                    write_atomically(self.path, self._text)
            except Exception as exc:  # a shared filesystem's hiccup: counted, tried again next beat
                self._on_error(exc)

    def remove(self) -> None:
        """Stop the heartbeat and remove the file (the run ended and its end was scraped). Idempotent."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


__all__ = ["Announcement", "Pruned", "TargetFile", "advertised_host", "file_name", "node_address", "prune"]
