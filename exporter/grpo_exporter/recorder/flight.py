"""The flight recorder: the seed's 三态保存 (last normal step, first anomalous step, the step after), written as
one incident per episode from a background thread.

Each observe call hands the recorder its stage's host metrics and inputs. The recorder keeps the rows of the
open steps, of the last normal step and of a pending incident (device tensors, ``rows`` rows each), and the
key metrics of the last ``history_steps`` steps. A step is *sealed* when its update ended, when a call of a
step two or more later arrives, or at close. A sealed step whose trigger (:mod:`.triggers`) is not already
active opens an incident; the next sealed step completes it and the incident goes to the writer thread. A
trigger stays active, opening nothing more, until a step that judged it no longer fires it (a step without a
rollout, e.g. the second update of ``num_iterations=2``, has no engine gap: it neither fires nor clears that
trigger): the first anomalous step of each episode is the one to read.
When the guard raises, at close, at interpreter exit and on SIGTERM (a handler installed from the main thread,
chaining the one before it), open steps are sealed and what is pending is written (``next`` absent when training
ended there), waiting at most ``flush_timeout_s``.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.recorder.reading_doc import dumps
from grpo_exporter.recorder.rows import Decode, describe_rows, json_number, row_bytes, select_rows, take_rows
from grpo_exporter.recorder.store import (
    INCIDENT_PREFIX,
    KEY_FAMILIES,
    ROLES,
    FreeFloor,
    RecorderError,
    ensure_root,
    incidents,
    size_of,
    sweep_partials,
    write_incident,
)
from grpo_exporter.recorder.triggers import judged, triggers_of
from grpo_exporter.runtime.background import DaemonExecutor, worker_thread
from grpo_exporter.serving.publication import Publication
from grpo_exporter.thresholds import StopLines

log = logging.getLogger("grpo_exporter")

FORMAT = 1
MAX_QUEUED = 4  # incidents waiting for the writer; more are dropped and counted (a disk that cannot keep up)
_KEY = frozenset(KEY_FAMILIES)
_INCIDENTS = catalog.metric("grpo_recorder_incidents_total")
_LATEST = catalog.metric("grpo_recorder_latest_incident_step")
_USAGE = catalog.metric("grpo_recorder_disk_usage_bytes")
_REMOVED = catalog.metric("grpo_recorder_removed_incidents_total")


def key_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The :data:`KEY_FAMILIES` samples of a step (no quantile or bucket samples)."""
    return {str(k): v for k, v in metrics.items() if isinstance(k, catalog.SampleKey) and k.sample in _KEY
            and not any(n in ("quantile", "le") for n, _ in k.labels)}


@dataclass
class State:
    """One step as the recorder keeps it."""

    step: int
    time: float = field(default_factory=time.time)
    metrics: dict[str, float] = field(default_factory=dict)
    triggers: list[str] = field(default_factory=list)
    rows: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # stage -> field -> (R, ...) device tensor
    drivers: dict[str, dict[int, str]] = field(default_factory=dict)  # stage -> row -> trigger it drove
    ready: Any = None  # a CUDA event recorded after the rows were taken: the writer waits on it
    versions: dict[str, int] = field(default_factory=dict)  # policy_version, rollout_policy_version

    def summary(self) -> dict[str, Any]:
        return {"step": self.step, "time": self.time, "triggers": list(self.triggers), **self.versions,
                "metrics": {k: json_number(v) for k, v in key_metrics(self.metrics).items()}}


@dataclass
class Incident:
    first: State
    last_normal: State | None
    history: list[dict[str, Any]]
    next: State | None = None
    ended: str = ""  # why there is no next state


# every recorder not closed, held strongly: a monitor that is never closed (no ``with``, an exception a
# launcher catches) keeps its recorder until the exit, which writes the pending incident (held weakly, it was
# collected with the monitor and the incident lost)
_LIVE: set[FlightRecorder] = set()


@atexit.register
def _flush_all(why: str = "the process exited") -> None:
    for recorder in list(_LIVE):
        with contextlib.suppress(Exception):
            left = recorder.flush(why)
            if left:  # the writer is stuck (a hung decode or filesystem): the exit does not wait for it
                sys.stderr.write(f"grpo-exporter flight recorder: {left} incident(s) still being written after "
                                 f"{recorder.flush_timeout_s:g} s (recorder_flush_timeout_s); abandoned at exit "
                                 f"(a hung decode or a stuck filesystem under {recorder.root}?)\n")


_SIGTERM_BEFORE: Any = None  # the SIGTERM handler ours replaced (None: ours is not installed)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM, the usual way a scheduler ends a job, skips atexit: write what is pending first (at most
    ``flush_timeout_s`` per recorder), then end as the handler before ours would have (the default: the
    process dies of SIGTERM, its exit status unchanged)."""
    _flush_all("the process was sent SIGTERM")
    before = _SIGTERM_BEFORE
    if callable(before):
        before(signum, frame)
    elif before != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _handle_sigterm() -> None:
    """Install :func:`_on_sigterm` once, chaining the handler in place. Only from the main thread (Python's
    rule) and only over a handler Python knows (a handler installed from C, ``getsignal`` None, is left)."""
    global _SIGTERM_BEFORE
    if _SIGTERM_BEFORE is not None or threading.current_thread() is not threading.main_thread():
        return
    before = signal.getsignal(signal.SIGTERM)
    if before is None or before is _on_sigterm:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, _on_sigterm)
        _SIGTERM_BEFORE = before


class FlightRecorder:
    """Rows and key metrics around the first anomalous step, written as incidents under ``root``."""

    def __init__(
        self, root: Path, *, run: str, rank: int, world: int, rows: int, history_steps: int, budget_bytes: int,
        triggers: tuple[str, ...], lines: StopLines, flush_timeout_s: float, publication: Publication,
        cooldown_steps: int = 0, floor: FreeFloor | None = None, state_bytes: int = 1 << 62,
        on_error: Callable[[BaseException], None], decode: Decode | None = None,
        metrics: MetricsConfig | None = None,
    ) -> None:
        self.root = ensure_root(root)
        for path in sweep_partials(self.root):
            log.warning("grpo-exporter: removed %s, an incident a killed process left half-written", path)
        self._run, self._rank, self._world = run, rank, world
        self._rows, self._budget, self._enabled, self._lines = rows, budget_bytes, triggers, lines
        self._flush_timeout_s = flush_timeout_s
        self._publication, self._on_error, self._decode = publication, on_error, decode
        self._metrics = metrics
        self._open: dict[int, State] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=history_steps)
        self._last_normal: State | None = None
        self._pending: Incident | None = None
        self._active: set[str] = set()  # the triggers of the episodes in progress
        self._cooldown, self._floor, self._state_bytes = cooldown_steps, floor, state_bytes
        self._opened: dict[str, int] = {}  # trigger -> the step whose incident it last opened
        self._serial = 0
        self._lock = threading.RLock()  # SIGTERM's flush runs on the training thread, maybe inside observe
        self._queued: list[Future[None]] = []
        self._pool = DaemonExecutor("grpo-exporter-recorder", initializer=worker_thread)
        self.between_files: Callable[[], None] | None = None  # test hook: called after each file written
        self.reading: Callable[[], dict[str, Any]] | None = None  # the run's reading set, written beside incidents
        # counters start at 0, so the first incident is an increase; the usage of what the directory holds
        publication.add({_INCIDENTS.key(): 0.0, _REMOVED.key(): 0.0})
        publication.merge({_USAGE.key(): float(sum(size_of(p) for p in incidents(self.root)))})
        _LIVE.add(self)
        _handle_sigterm()

    # ---- called from observe (training thread) ------------------------------------------------------------

    def observe(self, stage: str, step: int, inputs: StepInputs | None, metrics: Mapping[str, float],
                extra: Mapping[str, Tensor | None] | None = None, spike: bool = False) -> tuple[str, ...]:
        """Keep this stage's metrics and rows for ``step``; returns the triggers it fired. Seals steps two or
        more before ``step`` (and, for an update, ``step`` and everything before it)."""
        with self._lock:
            self._seal(lambda s: s <= step - 2)
            state = self._open.setdefault(step, State(step))
            state.metrics.update(metrics)
            fired = triggers_of(metrics, self._lines, spike, self._enabled)
            state.triggers += [t for t in fired if t not in state.triggers]
            for name in ("policy_version", "rollout_policy_version"):
                if inputs is not None and getattr(inputs, name) is not None:
                    state.versions[name] = int(getattr(inputs, name))
            if inputs is not None and inputs.n:
                rows = min(self._rows, max(1, self._state_bytes // row_bytes(inputs, extra)))
                index, drivers = select_rows(inputs, fired, rows, self._metrics)
                state.rows[stage] = take_rows(inputs, index, extra)
                state.drivers[stage] = drivers
                if index.is_cuda:
                    state.ready = torch.cuda.Event()
                    state.ready.record()
            if stage == "update":
                self._seal(lambda s: s <= step)
            return fired

    @property
    def flush_timeout_s(self) -> float:
        return self._flush_timeout_s

    def flush(self, why: str, timeout: float | None = None) -> int:
        """Seal every open step, write a pending incident without its next state (``why`` says why), and wait
        for the writer (at most ``timeout``, default ``flush_timeout_s``); the incidents still being written
        then (a stuck writer: nobody waits longer)."""
        with self._lock:
            self._seal(lambda s: True)
            if self._pending is not None:
                self._pending.ended = why
                self._submit(self._pending)
                self._pending = None
        return self.wait(self._flush_timeout_s if timeout is None else timeout)

    def wait(self, timeout: float) -> int:
        """Block until the incidents handed to the writer are written (at most ``timeout``); how many are not."""
        deadline = time.monotonic() + timeout
        for job in list(self._queued):
            with contextlib.suppress(Exception):
                job.result(timeout=max(0.0, deadline - time.monotonic()))
        return sum(not job.done() for job in self._queued)

    def close(self) -> None:
        left = self.flush("the run ended (close)")
        if left:
            log.warning("grpo-exporter flight recorder: %d incident(s) still being written after %g s "
                        "(recorder_flush_timeout_s): close() returns without them (a hung decode or a stuck "
                        "filesystem under %s?)", left, self._flush_timeout_s, self.root)
        self._pool.shutdown(0.0 if left else self._flush_timeout_s)  # a stuck writer is abandoned, an idle one ends
        _LIVE.discard(self)

    # ---- sealing --------------------------------------------------------------------------------------------

    def _seal(self, due: Callable[[int], bool]) -> None:
        """Seal the due open steps in order. A trigger not already active opens an incident (its episode),
        unless it opened one within ``cooldown_steps`` (a flapping trigger: the same episode); a trigger stays
        active until a step that judged it (:func:`~.triggers.judged`) no longer fires it."""
        for step in sorted(s for s in self._open if due(s)):
            state = self._open.pop(step)
            self._history.append(state.summary())
            new = [t for t in state.triggers if t not in self._active
                   and step - self._opened.get(t, step - self._cooldown - 1) > self._cooldown]
            self._opened |= dict.fromkeys(new, step)
            self._active = {t for t in self._active if t in state.triggers or not judged(t, state.metrics)}
            self._active |= set(state.triggers)
            if self._pending is not None:
                self._pending.next = state
                self._submit(self._pending)
                self._pending = None
            if new:
                self._pending = Incident(state, self._last_normal, list(self._history))
            elif not state.triggers:
                self._last_normal = state

    def _submit(self, incident: Incident) -> None:
        self._queued = [job for job in self._queued if not job.done()]
        if len(self._queued) >= MAX_QUEUED:
            self._on_error(RecorderError(
                f"incident at step {incident.first.step} dropped: {MAX_QUEUED} incidents are still being written"))
            return
        self._serial += 1
        try:
            self._queued.append(self._pool.submit(self._write, incident, self._serial))
        except RuntimeError:  # interpreter shutdown: the pool takes no more work, so write here
            self._write(incident, self._serial)

    # ---- the writer thread ----------------------------------------------------------------------------------

    def _write(self, incident: Incident, serial: int) -> None:
        with self._publication.guarded(self._on_error):
            name, files = self._serialise(incident)
            written = write_incident(self.root, name, files, self._budget, serial, self.between_files, self._floor)
            latest = _LATEST.key(incident=written.path.name, directory=str(self.root)[-128:])
            removed: dict[str, float] = {_REMOVED.key(): float(len(written.removed))} if written.removed else {}
            self._publication.commit(
                add={_INCIDENTS.key(): 1.0} | removed,
                merge={latest: float(incident.first.step), _USAGE.key(): float(written.usage_bytes)},
                families=[_LATEST.name, _USAGE.name],
            )
            log.warning("grpo-exporter flight recorder: incident %s written (%s at step %d); read it with "
                        "`grpo-exporter inspect %s`", written.path.name, ", ".join(incident.first.triggers),
                        incident.first.step, written.path)

    def _serialise(self, incident: Incident) -> tuple[str, dict[str, bytes]]:
        first = incident.first
        stamp = datetime.fromtimestamp(first.time, UTC).strftime("%Y%m%dT%H%M%SZ")
        name = f"{INCIDENT_PREFIX}s{first.step:09d}-{stamp}-r{self._rank}"
        states = dict(zip(ROLES, (incident.last_normal, first, incident.next), strict=True))
        files: dict[str, bytes] = {}
        described: dict[str, Any] = {}
        for role, state in states.items():
            if state is None:
                continue
            if state.ready is not None:
                state.ready.synchronize()
            host = {stage: {k: v.cpu() for k, v in rows.items()} for stage, rows in state.rows.items()}
            described[role] = state.summary() | {
                "rows": {stage: _offending_first(describe_rows(rows, state.drivers.get(stage, {}), self._decode))
                         for stage, rows in host.items()},
            }
            buffer = io.BytesIO()
            torch.save(host, buffer)
            files[f"{role}.pt"] = buffer.getvalue()
        manifest = {
            "format": FORMAT, "id": name, "run": self._run, "rank": self._rank, "world": self._world,
            "created": datetime.now(UTC).isoformat(timespec="seconds"), "triggers": list(first.triggers),
            "steps": {role: (s.step if s is not None else None) for role, s in states.items()},
            "next_missing": incident.ended or None,
            "stop_lines": self._lines.model_dump(), "torch_initial_seed": torch.initial_seed(),
            "history": incident.history, "states": described,
        }
        if self.reading is not None:  # the rollouts the layers' pages read, as they stand when it is written
            files["reading.json"] = dumps(self.reading())
        files["incident.json"] = json.dumps(manifest, indent=1, allow_nan=False).encode()
        if sum(len(b) for b in files.values()) > self._budget:  # the reading set goes first, then the rows
            files.pop("reading.json", None)
        if sum(len(b) for b in files.values()) > self._budget:  # the rows alone break the budget: keep the summary
            files = {"incident.json": json.dumps(manifest | {"raw_rows": "left out: over the disk budget"},
                                                 indent=1, allow_nan=False).encode()}
        return name, files


def _offending_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: r.get("driver") is None)
