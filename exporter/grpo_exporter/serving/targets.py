"""Target discovery by the exporter itself: the serving rank announces its run in a Prometheus ``file_sd`` file.

On a cluster the scheduler picks the node and, after a port fallback, the port: only the process knows where it
serves. With ``targets_dir`` (a directory Prometheus reads with ``file_sd_configs``, on a filesystem both see) the
serving rank writes ``grpo-<run>@<host>_<port>.json``: one target, ``<advertised host>:<port>``, with the labels the
rules need (``job``, ``run``, the configured ones) and ``__scheme__`` (https where TLS is on), once the port is
bound, so it names the port actually served. Every file operation runs on one thread of the announcement's own
(:class:`TargetFile`): a hung shared filesystem never holds up a training step, and the file cannot come back
after it was withdrawn. The file is written atomically (an exclusively created temporary file renamed over it;
no symlink planted in a shared directory is followed) and touched every :data:`HEARTBEAT_S` (written again if
someone removed it).

Its life follows the run's: :meth:`TargetFile.remove` runs in ``close()`` after the scrape that saw the run's
normal end (a file removed at once hides ``grpo_run_finished``, and a clean end would then page
GRPOTrainingStalled). A process that died leaves its file, so Prometheus keeps scraping a dead target and
GRPOExporterDown pages the crash; the file stops being touched, and :func:`prune` removes it once it is older
than ``targets_stale_after_s`` (every exporter that starts in the directory prunes it; so does ``grpo-exporter
targets prune``, for a SLURM epilog or a timer). A file naming the very address and port a new exporter has just
bound is dead by construction (nothing else serves there): it is withdrawn at once, or Prometheus would scrape the
new run under the dead run's labels.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from grpo_exporter.serving.settings import STALE_AFTER_S, is_ip

log = logging.getLogger("grpo_exporter")

HEARTBEAT_S = 60.0  # how often a serving exporter touches its file: far below any stale_after_s worth setting
FIRST_WRITE_WAIT_S = 5.0  # construction waits this long for the first write (a hung filesystem: it goes on)
REMOVE_WAIT_S = 2.0  # close() waits this long for the file's withdrawal
PREFIX = "grpo-"
MARKER = "__grpo_exporter_pid"  # a label of ours in every file (dropped by Prometheus after relabelling)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: an address outside any network this machine is in: connecting a UDP socket to it sends nothing, and makes the
#: kernel choose the source address of the default route (TEST-NET-2, RFC 5737)
_PROBE = ("198.51.100.1", 9)


@dataclass(frozen=True)
class Announcement:
    """Where and how to announce the run: ``directory`` read by Prometheus' ``file_sd_configs``; ``host`` the
    address other machines reach this one at (decided by the assembly, :func:`advertised_host`; None: the bound
    address); ``labels`` besides ``job`` and
    ``run``; files older than ``stale_after_s`` are pruned at start."""

    directory: Path
    job: str = "grpo"
    host: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    stale_after_s: float = STALE_AFTER_S


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


def bind_host(advertised: str) -> str:
    """Where to bind, the host unset, to be reached at ``advertised``: that address when it is one of this
    machine's; every interface (0.0.0.0) when it is not (a NAT or load-balancer address, a name that does not
    resolve here) or when a name resolves to loopback here (Debian's ``/etc/hosts`` maps the hostname to
    127.0.1.1, which no other machine reaches)."""
    try:
        family, _, _, _, address = min(socket.getaddrinfo(advertised, 0, socket.AF_UNSPEC, socket.SOCK_STREAM),
                                       key=lambda info: info[0] != socket.AF_INET)
    except OSError:
        return "0.0.0.0"
    ip = str(address[0])
    if ipaddress.ip_address(ip).is_loopback and not is_ip(advertised):
        return "0.0.0.0"
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as trial:
        trial.bind((ip, 0))
        return ip
    return "0.0.0.0"


def file_name(run: str, target: str) -> str:
    """``grpo-<run>@<host>_<port>.json`` for ``target`` (``host:port``), every character outside
    ``[A-Za-z0-9._-]`` of the run and host replaced, plus a short hash where one was (two runs never share a
    file; the same run on the same address always finds its own)."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    safe_run, safe_host = _UNSAFE.sub("_", run), _UNSAFE.sub("_", host)
    tag = ""
    if (safe_run, safe_host) != (run, host):
        tag = "-" + hashlib.sha256(f"{run}\0{host}".encode()).hexdigest()[:8]
    return f"{PREFIX}{safe_run}@{safe_host}_{port}{tag}.json"


def target_text(target: str, job: str, run: str, labels: Mapping[str, str], scheme: str) -> str:
    """The ``file_sd`` document: one target group. ``job`` and ``run`` win over same-named configured labels."""
    group = {"targets": [target],
             "labels": {**labels, "job": job, "run": run, "__scheme__": scheme, MARKER: str(os.getpid())}}
    return json.dumps([group], indent=2) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never a part: a temporary
    file created exclusively beside it (a random name ``file_sd``'s ``*.json`` does not match: a symlink planted
    in a shared directory is never followed), flushed, then renamed over it (a symlink at ``path`` is replaced,
    not followed)."""
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes it 0600: Prometheus, another user, must read it
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
    return _remove_where(directory, lambda path, groups: now - path.stat().st_mtime > stale_after_s)


def _remove_where(directory: Path, dead: Callable[[Path, list[Any]], bool]) -> Pruned:
    """Remove the target files of ours in ``directory`` that ``dead(path, groups)`` says are dead."""
    removed: list[Path] = []
    failed: list[tuple[Path, OSError]] = []
    for path in sorted(directory.glob(f"{PREFIX}*.json")):
        try:
            groups = _ours(path)
            if groups is None or not dead(path, groups):
                continue
            path.unlink()
            removed.append(path)
        except FileNotFoundError:  # removed meanwhile (another exporter pruning, its own run ending)
            continue
        except OSError as exc:
            failed.append((path, exc))
    return Pruned(removed, failed)


def _ours(path: Path) -> list[Any] | None:
    """The target groups of ``path`` when it is a target file this exporter wrote (its marker label is in it)."""
    try:
        groups = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(groups, list) and any(isinstance(g, dict) and MARKER in g.get("labels", {}) for g in groups):
        return groups
    return None


def _names(groups: list[Any], target: str) -> bool:
    return any(isinstance(g, dict) and target in g.get("targets", ()) for g in groups)


class TargetFile:
    """The run's announced target, kept by a thread of its own: it prunes stale files, withdraws files naming
    the same address (dead), writes the file, touches it every :data:`HEARTBEAT_S` until :meth:`remove`, then
    removes it. Construction waits for the first write at most :data:`FIRST_WRITE_WAIT_S`. Failures go to
    ``on_error`` (counted and logged; training goes on); with ``on_error`` None (strict) a failed first write
    raises here."""

    def __init__(self, announcement: Announcement, run: str, target: str, scheme: str,
                 on_error: Callable[[Exception], None] | None) -> None:
        self.announcement, self.run, self.target = announcement, run, target
        self.path = announcement.directory / file_name(run, target)
        self._text = target_text(target, announcement.job, run, announcement.labels, scheme)
        self._on_error = on_error
        self._stop, self._written = threading.Event(), threading.Event()
        self._first_error: Exception | None = None
        self._thread = threading.Thread(target=self._keep, name="grpo-exporter-targets", daemon=True)
        self._thread.start()
        if not self._written.wait(FIRST_WRITE_WAIT_S):
            self._report(TimeoutError(
                f"targets_dir {announcement.directory}: writing {self.path.name} took over {FIRST_WRITE_WAIT_S:g} s "
                "(a hung filesystem?); it is written when the filesystem answers"))
        elif self._first_error is not None and on_error is None:
            self.remove()
            raise self._first_error

    def _report(self, exc: Exception) -> None:
        if self._on_error is not None:
            self._on_error(exc)
        else:  # strict, on this thread or after construction: no caller to raise to
            log.warning("grpo-exporter: the target file %s: %s", self.path, exc)

    def _keep(self) -> None:
        try:
            self._announce()
        except Exception as exc:
            self._first_error = exc
            if self._on_error is not None:
                self._report(exc)
        finally:
            self._written.set()
        while not self._stop.wait(HEARTBEAT_S):
            try:
                try:
                    os.utime(self.path, follow_symlinks=False)
                except FileNotFoundError:  # removed by hand, or the first write failed: the run still serves
                    self._announce()
            except Exception as exc:  # a shared filesystem's hiccup: counted, tried again next beat
                self._report(exc)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._report(exc)

    def _announce(self) -> None:
        directory = self.announcement.directory
        directory.mkdir(parents=True, exist_ok=True)
        pruned = prune(directory, self.announcement.stale_after_s)
        for stale in pruned.removed:
            log.info("grpo-exporter: removed the stale target file %s (not touched for over %gs)",
                     stale, self.announcement.stale_after_s)
        for stale, exc in pruned.failed:  # not ours to fix: our own announcement goes on
            log.warning("grpo-exporter: cannot remove the stale target file %s (%s); its target stays in Prometheus "
                        "until its owner (or `grpo-exporter targets prune` run by them) removes it",
                        stale, exc.strerror or exc)
        dead = _remove_where(directory, lambda path, groups: path != self.path and _names(groups, self.target))
        for path in dead.removed:
            log.warning("grpo-exporter: withdrew %s: it names %s, the address this run now serves, so its run is "
                        "gone (a crash there pages GRPOTrainingStalled, not GRPOExporterDown)", path, self.target)
        write_atomically(self.path, self._text)
        log.info("grpo-exporter: announced %s in %s for Prometheus' file_sd_configs", self.target, self.path)

    def remove(self) -> None:
        """Stop the heartbeat and have the file removed (the run ended and its end was scraped), waiting at most
        :data:`REMOVE_WAIT_S`: on a hung filesystem the thread removes it when the filesystem answers, and nothing
        writes it again. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=REMOVE_WAIT_S)
        if self._thread.is_alive():
            self._report(TimeoutError(f"targets_dir {self.announcement.directory}: {self.path.name} not removed "
                                      f"within {REMOVE_WAIT_S:g} s (a hung filesystem?); it goes when it answers"))


__all__ = ["Announcement", "Pruned", "TargetFile", "advertised_host", "bind_host", "file_name", "node_address",
           "prune"]
