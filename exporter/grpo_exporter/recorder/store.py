"""Incidents on disk: written atomically, owner-only, within a byte budget, oldest removed first.

An incident is one directory ``incident-s<step>-<UTC time>-r<rank>`` holding ``incident.json`` (what fired,
the three states' metrics and row summaries, the last steps' key metrics) and one ``<state>.pt`` per state
(the kept rows as tensors, loadable with ``torch.load(weights_only=True)``). It is first written under
``.partial-<host>-<pid>-<n>`` (every file fsynced), then renamed into place: a reader, or a process killed with
``kill -9`` mid-write, never sees a partial incident. A later recorder on the same host removes partial
directories whose process is gone. Records hold prompts and completions: directories are 0700, files 0600.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INCIDENT_PREFIX = "incident-"
PARTIAL_PREFIX = ".partial-"
REMOVING_PREFIX = ".removing-"
MANIFEST = "incident.json"


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


def sweep_partials(root: Path) -> list[Path]:
    """Remove the partial and half-removed incident directories of processes of this host that are gone (a
    kill -9 mid-write); another host's, or a live process's, are left alone. Returns what was removed."""
    host = socket.gethostname()
    removed = []
    for path in root.iterdir():
        for prefix in (PARTIAL_PREFIX, REMOVING_PREFIX):
            if not path.name.startswith(prefix):
                continue
            owner_host, _, rest = path.name.removeprefix(prefix).rpartition("--")
            pid = rest.split("-", 1)[0]
            if owner_host == host and pid.isdigit() and not _alive(int(pid)):
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
    """The complete incidents under ``root``, oldest first (by name: step, then UTC time; then mtime)."""
    found = [p for p in root.iterdir() if p.name.startswith(INCIDENT_PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: ((p / MANIFEST).stat().st_mtime, p.name))


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_incident(root: Path, name: str, files: Mapping[str, bytes], budget_bytes: int, serial: int,
                   between_files: object = None) -> Written:
    """Write ``files`` as incident ``name`` atomically, then remove the oldest other incidents until every
    complete incident fits in ``budget_bytes``. ``between_files``: a test hook called after each file (to
    kill the process mid-write)."""
    total = sum(len(b) for b in files.values())
    if total > budget_bytes:
        raise RecorderError(f"incident {name}: {total} bytes exceed recorder_disk_budget_bytes={budget_bytes}")
    partial = root / f"{PARTIAL_PREFIX}{socket.gethostname()}--{os.getpid()}-{serial}"
    partial.mkdir(mode=0o700)
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
    return Written(final, *_prune(root, final, budget_bytes))


def _prune(root: Path, keep: Path, budget_bytes: int) -> tuple[list[str], int]:
    """Remove the oldest incidents (never ``keep``) until all fit in the budget; each is renamed away first, so
    a kill mid-removal leaves no partial incident behind."""
    found = incidents(root)
    sizes = {p: size_of(p) for p in found}
    usage = sum(sizes.values())
    removed: list[str] = []
    for path in found:
        if usage <= budget_bytes:
            break
        if path == keep:
            continue
        doomed = root / f"{REMOVING_PREFIX}{socket.gethostname()}--{os.getpid()}-{path.name}"
        try:
            os.rename(path, doomed)
        except OSError:
            continue  # removed meanwhile by another rank sharing the directory
        shutil.rmtree(doomed, ignore_errors=True)
        usage -= sizes[path]
        removed.append(path.name)
    return removed, usage
