"""The monitor's worker threads (daemon threads that an interpreter's exit never waits for, and stops before it
finalizes), and the in-group edit distance, computed on one of them so the training thread never waits for it."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.edit_distance import median_normalized_edit_distance, pair_cap, rows_to_groups
from grpo_exporter.inputs import StepInputs
from grpo_exporter.serving.publication import Publication

log = logging.getLogger("grpo_exporter")

EXIT_TIMEOUT_S = 2.0  # at exit, the wait for interrupted calls to leave torch's code (milliseconds, measured)


def edit_distance_carry(inputs: StepInputs, groups_sampled: int, group_size: int) -> dict[str, Tensor]:
    """The rows of the first ``groups_sampled`` groups (ids, lengths, group index) to bring to the host with
    the rollout's one transfer; empty when the inputs do not allow it."""
    lengths = inputs.completion_lengths
    if lengths is None and inputs.completion_mask is not None:
        lengths = inputs.completion_mask.sum(dim=1)
    if groups_sampled == 0 or inputs.completion_ids is None or lengths is None:
        return {}
    try:
        groups = inputs.groups(group_size)
    except ValueError:
        return {}  # the grouping error is counted by the group metric blocks
    if groups is None:
        return {}
    rows = torch.argsort(groups.index, stable=True)[: groups_sampled * group_size]
    return {"ed_ids": inputs.completion_ids[rows], "ed_lengths": lengths[rows], "ed_group": groups.index[rows]}


def lowest_priority() -> None:
    """Nice 19 for this thread (Linux schedules threads as tasks): on cores training keeps busy, the
    edit-distance job takes only what training leaves. Elsewhere, or when refused, it keeps the default."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def serial_operators() -> None:
    """Torch operators called on this thread run serially: this thread's OpenMP thread count is set to 1.

    A torch operator large enough to go parallel (~32K elements) on a thread other than training's starts a
    second OpenMP thread team; libgomp then counts more threads than cores and makes every team of the
    process, training's included, sleep between parallel regions instead of spinning: slower steps for the
    monitor and for training's own CPU operators alike (measured in docs/benchmarks.md, implementation
    choices). The
    count is a per-thread setting of the OpenMP runtime, set through it directly: ``torch.set_num_threads``
    would also change the default of every thread started later. Torch's own per-thread initialisation runs
    first (it would reset the count). Where no OpenMP runtime is loaded, nothing changes."""
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        with contextlib.suppress(AttributeError, OSError):
            runtime.omp_set_num_threads(1)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp, libomp or libiomp5, found in the process's memory map)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
        for path in sorted(paths):
            if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp5")):
                return ctypes.CDLL(path)
    return None


def worker_thread() -> None:
    """Initializer of the monitor's worker threads: lowest priority, serial torch operators."""
    lowest_priority()
    serial_operators()


T = TypeVar("T")


class Interrupted(BaseException):
    """Raised into a :class:`DaemonExecutor`'s thread by :meth:`~DaemonExecutor.interrupt`: the call in progress
    ends at its next Python line. A BaseException, so that no ``except Exception`` on the way swallows it."""


class DaemonExecutor:
    """One daemon thread running the submitted calls in order: ThreadPoolExecutor(max_workers=1) without its
    join at interpreter shutdown. concurrent.futures joins its workers then, so one call that never returns (a
    hung ``decode``, an fsync on a dead NFS mount) kept a finished process, and the job's GPUs, alive for ever.
    Whoever needs the work done waits on its Future, with a timeout; at exit a daemon thread is abandoned.

    Abandoned inside a torch operator, a daemon thread aborts the process: once the interpreter finalizes, a
    thread that takes the GIL back is ended by ``pthread_exit``, whose unwinding meets torch's ``noexcept``
    ``gil_scoped_release`` destructor and calls ``std::terminate`` (exit status 134, "terminate called without an
    active exception"). Blocked in Python's own waits (a queue, a lock, a subprocess) it ends harmlessly. So an
    executor whose calls run torch code is made ``stopped_at_exit``: the exit hook :meth:`stop` s it before
    finalization (it drops the calls not started and interrupts the one in progress); its owner may stop it
    earlier the same way."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None, stopped_at_exit: bool = False
                 ) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._closed = False
        self._running = False  # a call is in progress (what interrupt() may end)
        self._thread = threading.Thread(target=self._loop, args=(initializer,), name=name, daemon=True)
        self._thread.start()
        if stopped_at_exit:
            _stop_at_exit(self)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("cannot schedule new calls after shutdown")
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, timeout: float = 0.0, cancel_futures: bool = False) -> bool:
        """Take no more calls; the thread ends after the queued ones, or, with ``cancel_futures``, after the one in
        progress (the others are cancelled, their Futures done). Waits at most ``timeout`` for it to end, and says
        whether it did: a thread still ending while the interpreter tears down can abort the whole process (see
        the class; "terminate called without an active exception", seen in 5 of 8 exits right after a recorder's
        close)."""
        self._closed = True
        if cancel_futures:
            self._cancel_queued()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def interrupt(self) -> bool:
        """Raise :class:`Interrupted` into the thread if a call is in progress: it ends at its next Python line (a
        call blocked in C code, a subprocess's wait, sees it when that returns). Says whether it was raised."""
        ident = self._thread.ident
        if not self._running or ident is None or not self._thread.is_alive():
            return False
        return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(Interrupted)) == 1

    def stop(self, deadline: float) -> bool:
        """Take no more calls, drop the queued ones and interrupt the one in progress until the thread ends or
        ``deadline`` (``time.monotonic()``) passes. Says whether it ended."""
        if self.shutdown(0.0, cancel_futures=True):
            return True
        while self._thread.is_alive() and time.monotonic() < deadline:
            self.interrupt()  # again until it ends: a handler on the way may have swallowed the last one
            self._thread.join(0.01)
        return not self._thread.is_alive()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _loop(self, initializer: Callable[[], None] | None) -> None:
        if initializer is not None:
            with contextlib.suppress(Exception):
                initializer()
        with contextlib.suppress(Interrupted):  # one raised just after its call returned ends the thread
            while (item := self._queue.get()) is not None:
                future, fn, args = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    self._running = True
                    try:
                        result = fn(*args)
                    finally:
                        self._running = False
                except BaseException as exc:  # the caller's to see, on its Future
                    future.set_exception(exc)
                else:
                    future.set_result(result)


_LIVE: weakref.WeakSet[DaemonExecutor] = weakref.WeakSet()  # executors the exit stops (a running one is held
_HOOKED = False  # by its thread)


def _stop_at_exit(executor: DaemonExecutor) -> None:
    """Have the exit stop ``executor``; the hook is registered with the first one (later than torch's own hooks,
    so it runs before them)."""
    global _HOOKED
    _LIVE.add(executor)
    if not _HOOKED:
        _HOOKED = True
        atexit.register(_stop_all)


def _stop_all() -> None:
    """The exit hook: every such thread stopped before the interpreter finalizes, all within ``EXIT_TIMEOUT_S``;
    one still inside torch's code then is said on stderr (the process may abort)."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    _ignore_interrupts_raised_in_callbacks()
    for executor in list(_LIVE):
        if not executor.stop(deadline):
            log.warning("grpo-exporter: the %s thread did not stop within %.1f s of the exit", executor.thread.name,
                        EXIT_TIMEOUT_S)


def _ignore_interrupts_raised_in_callbacks() -> None:
    """An :class:`Interrupted` that lands in a callback (an import lock's, a weakref's) is dropped there by Python
    and said on stderr as "Exception ignored"; at exit that says nothing wrong, so the exit hook silences it."""
    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            before(unraisable)

    sys.unraisablehook = hook


class EditDistanceWorker:
    """One job at a time: a rollout's sampled groups arrive while the previous job runs are skipped. Each job
    is bounded by ``budget_s`` of wall time and a pair cap that shrinks as 1/T^2
    (:mod:`grpo_exporter.edit_distance`)."""

    def __init__(
        self, publication: Publication, on_error: Callable[[BaseException], None], budget_s: float = 0.02
    ) -> None:
        self._publication = publication
        self._on_error = on_error
        self._budget_s = budget_s
        self._jobs = 0
        self._pool = DaemonExecutor("grpo-exporter-edit-distance", initializer=worker_thread, stopped_at_exit=True)
        self._job: Future[None] | None = None

    def submit(self, carried: dict[str, Tensor], width: int) -> None:
        """Hand over the carried rows (``ed_ids``, ``ed_lengths``, ``ed_group``) of ``width`` tokens."""
        if "ed_ids" not in carried or (self._job is not None and not self._job.done()):
            return
        self._jobs += 1
        self._job = self._pool.submit(self._run, carried, width, self._jobs)

    def _run(self, carried: dict[str, Tensor], width: int, job: int) -> None:
        with self._publication.guarded(self._on_error):
            groups = rows_to_groups(carried["ed_ids"], carried["ed_lengths"], carried["ed_group"], width)
            median, _ = median_normalized_edit_distance(
                groups, self._budget_s, pair_cap(width, self._budget_s), seed=job
            )
            family = catalog.metric("grpo_edit_distance_median_ratio")
            self._publication.commit(merge={} if median is None else {family.key(): median}, families=[family.name])

    def wait(self, timeout: float = 10.0) -> None:
        if self._job is not None:
            self._job.result(timeout=timeout)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Take no more jobs; wait for the running one (bounded by its budget) and the thread's end, at most
        ``timeout``. A job can outlive it on a starved core (the thread runs at nice 19: 4 ranks on 2 cores took
        over a second); the exit hook then interrupts it, since one left inside torch's code when the process
        exits right after ``close()`` aborted it (status 134, a finished training reported failed)."""
        self._pool.shutdown(timeout)
