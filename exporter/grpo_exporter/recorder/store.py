"""Incidents on disk: written atomically, owner-only, within a byte budget, oldest removed first.

An incident is one directory ``incident-s<step>-<UTC time>-r<rank>`` holding ``incident.json`` (what fired,
the three states' metrics and row summaries, the last steps' key metrics) and one ``<state>.pt`` per state
(the kept rows as tensors, loadable with ``torch.load(weights_only=True)``). It is first written under
``.partial-<host>--<pid>-<random>`` (every file fsynced), then renamed into place: a reader, or a process killed
with ``kill -9`` mid-write, never sees a partial incident. The writer holds an exclusive lock (flock) on the
partial directory while it writes; a later recorder removes a partial directory only when nobody holds its
lock and either its writer is a process of this host that is gone or it is older than ``UNLOCKED_GRACE_S``.
A PID alone proves nothing: another container's PID namespace reuses the same numbers (and a live writer
there looked dead to ``kill(pid, 0)``). Records hold prompts and completions: directories are 0700, files 0600.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INCIDENT_PREFIX = "incident-"
PARTIAL_PREFIX = ".partial-"
REMOVING_PREFIX = ".removing-"
MANIFEST = "incident.json"
# an incident's three states, in step order (``inspect`` reads them without torch, so they are defined here)
ROLES = ("last_normal", "first_anomalous", "next")
# the metrics an incident summarises per step and `inspect` tabulates (every sample of these families,
# quantiles and buckets left out)
KEY_FAMILIES = (
    "grpo_reward_mean", "grpo_completions_total", "grpo_truncated_completions_total", "grpo_nonfinite_values_total",
    "grpo_loss_mask_length_mismatch_sequences_total", "grpo_loss_mask_outside_completion_tokens_total",
    "grpo_loss_mask_tool_tokens_total", "grpo_engine_logprob_gap_mean_nats", "grpo_onpolicy_outside_clip_ratio",
    "grpo_onpolicy_log_ratio_abs_max_nats",
    "grpo_log_ratio_clamp_hit_ratio", "grpo_clipped_tokens_ratio", "grpo_grad_norm_pre_clip",
    "grpo_grad_norm_post_clip", "grpo_advantage_abs_max", "grpo_advantage_bound",
    "grpo_advantage_over_bound_sequences_total", "grpo_entropy_mean_nats", "grpo_ess_ratio", "grpo_kl_ref_nats",
    "grpo_rollout_staleness_versions", "grpo_zero_variance_groups_ratio",
)
# an unlocked partial directory this young may be one whose writer has made it and not locked it yet
UNLOCKED_GRACE_S = 600.0


class RecorderError(RuntimeError):
    """An incident that could not be written (counted in grpo_exporter_errors_total{stage="recorder"})."""


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened for fsync
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def ensure_root(root: Path) -> Path:
    """The recorder directory, created owner-only (0700) when missing; an existing one keeps its mode (each
    incident inside is 0700 anyway)."""
    root = root.expanduser().resolve()
    try:
        root.mkdir(parents=True, mode=0o700)
        os.chmod(root, 0o700)
    except FileExistsError:  # made before, or by another rank at the same moment
        pass
    except OSError as exc:
        raise RecorderError(f"recorder_dir: expected a directory this process can create, got {root} ({exc})") from exc
    if not root.is_dir():
        raise RecorderError(f"recorder_dir: expected a directory, got {root} (exists and is not one)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise RecorderError(f"recorder_dir: expected a directory this process can write, got {root} (no permission)")
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flock(path: Path) -> int:
    """An exclusive, non-blocking flock on the directory ``path``: its fd (the lock lives until it is closed).
    Raises BlockingIOError while another holds it, another OSError where this filesystem cannot lock."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _hold(path: Path) -> int:
    """The writer's lock on ``path`` (:func:`_flock`), or -1 where none can be taken (the write goes on)."""
    try:
        return _flock(path)
    except OSError:
        return -1


def _locked(path: Path) -> bool | None:
    """Whether a live writer holds ``path``'s lock; None when this filesystem cannot tell (no flock on a
    directory: then nothing is removed on a guess)."""
    try:
        os.close(_flock(path))
    except BlockingIOError:
        return True
    except OSError:
        return None
    return False


def sweep_partials(root: Path) -> list[Path]:
    """Remove the partial and half-removed incident directories whose writer is gone: nobody holds the lock,
    and the writer was a process of this host that no longer exists (a kill -9 mid-write) or the directory is
    older than ``UNLOCKED_GRACE_S``. A locked one (a live writer, in any PID namespace or on any host that
    shares the lock) is never touched. Returns what was removed."""
    host = socket.gethostname()
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for path in entries:
        for prefix in (PARTIAL_PREFIX, REMOVING_PREFIX):
            if not path.name.startswith(prefix):
                continue
            owner_host, _, rest = path.name.removeprefix(prefix).rpartition("--")
            pid = rest.split("-", 1)[0]
            gone = owner_host == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))
            try:
                old = time.time() - path.stat().st_mtime > UNLOCKED_GRACE_S
            except OSError:
                continue  # removed meanwhile
            if (gone or old) and _locked(path) is False:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Written:
    path: Path
    removed: list[str]  # incidents removed for the budget, oldest first
    usage_bytes: int  # bytes of every complete incident after the write


def incidents(root: Path) -> list[Path]:
    """The complete incidents under ``root``, oldest first (by mtime, then name); one another process removes
    meanwhile is left out."""
    dated = []
    for p in root.iterdir():
        if p.name.startswith(INCIDENT_PREFIX):
            with contextlib.suppress(OSError):
                dated.append(((p / MANIFEST).stat().st_mtime, p.name, p))
    return [p for _, _, p in sorted(dated)]


def size_of(path: Path) -> int:
    """Bytes of the files under ``path`` (0 for what another process removes meanwhile)."""
    total = 0
    with contextlib.suppress(OSError):
        for f in path.rglob("*"):
            with contextlib.suppress(OSError):
                total += f.stat().st_size if f.is_file() else 0
    return total


@dataclass(frozen=True)
class FreeFloor:
    """The free space an incident must leave on its filesystem: the larger of ``min_bytes`` and ``min_ratio``
    of the filesystem's size (recorder_min_free_bytes, recorder_min_free_ratio). A recorder directory often
    shares its filesystem with checkpoints: an incident must never be the write that makes a checkpoint fail."""

    min_bytes: int = 0
    min_ratio: float = 0.0

    def bytes_on(self, root: Path) -> tuple[int, int]:
        """(free bytes, floor in bytes) of ``root``'s filesystem now."""
        usage = shutil.disk_usage(root)
        return usage.free, max(self.min_bytes, int(self.min_ratio * usage.total))


def _make_room(root: Path, name: str, need: int, floor: FreeFloor) -> list[str]:
    """Remove the oldest incidents until writing ``need`` bytes leaves the floor free; the names removed. Raises
    :class:`RecorderError` (nothing written) when even that is not enough."""
    free, line = floor.bytes_on(root)
    removed: list[str] = []
    for path in incidents(root):
        if free - need >= line:
            break
        if _remove(root, path):
            removed.append(path.name)
            free, line = floor.bytes_on(root)
    if free - need < line:
        raise RecorderError(
            f"incident {name} not written: {need} bytes would leave {max(free - need, 0)} of {free} free bytes on the "
            f"filesystem of {root}, below the floor of {line} (recorder_min_free_bytes={floor.min_bytes}, "
            f"recorder_min_free_ratio={floor.min_ratio:g}); {len(removed)} older incident(s) removed first"
        )
    return removed


def write_incident(root: Path, name: str, files: Mapping[str, bytes], budget_bytes: int, serial: int,
                   between_files: object = None, floor: FreeFloor | None = None) -> Written:
    """Write ``files`` as incident ``name`` atomically, then remove the oldest other incidents until every
    complete incident fits in ``budget_bytes``. Before the write, the oldest incidents are removed until it
    leaves ``floor`` free (:class:`FreeFloor`). ``between_files``: a test hook called after each file (to kill
    the process mid-write)."""
    total = sum(len(b) for b in files.values())
    if total > budget_bytes:
        raise RecorderError(f"incident {name}: {total} bytes exceed recorder_disk_budget_bytes={budget_bytes}")
    made_room = _make_room(root, name, total, floor) if floor is not None else []
    # random: two recorders of one process on one directory never share a name
    partial = root / f"{PARTIAL_PREFIX}{socket.gethostname()}--{os.getpid()}-{serial}-{uuid.uuid4().hex[:12]}"
    partial.mkdir(mode=0o700)
    lock = _hold(partial)
    os.chmod(partial, 0o700)
    try:
        for file, data in files.items():
            _write_file(partial / file, data)
            if callable(between_files):
                between_files()
        _fsync_dir(partial)
        final = root / name
        suffix = 1
        while final.exists():
            suffix += 1
            final = root / f"{name}-{suffix}"
        os.rename(partial, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        if lock >= 0:
            os.close(lock)
    pruned, usage = _prune(root, final, budget_bytes)
    return Written(final, made_room + pruned, usage)


def _prune(root: Path, keep: Path, budget_bytes: int) -> tuple[list[str], int]:
    """Remove the oldest incidents (never ``keep``) until all fit in the budget (:func:`_remove`)."""
    found = incidents(root)
    sizes = {p: size_of(p) for p in found}
    usage = sum(sizes.values())
    removed: list[str] = []
    for path in found:
        if usage <= budget_bytes:
            break
        if path == keep or not _remove(root, path):
            continue
        usage -= sizes[path]
        removed.append(path.name)
    return removed, usage


def _remove(root: Path, path: Path) -> bool:
    """Remove incident ``path``, renamed away first so that a kill mid-removal leaves no partial incident; False
    when another rank sharing the directory removed it meanwhile."""
    doomed = root / f"{REMOVING_PREFIX}{socket.gethostname()}--{os.getpid()}-{path.name}"
    try:
        os.rename(path, doomed)
    except OSError:
        return False
    lock = _hold(doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    if lock >= 0:
        os.close(lock)
    return True
