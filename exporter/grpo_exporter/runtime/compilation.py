"""The compiled stages of one monitor (:mod:`grpo_exporter.step.program`): made on a background thread, used
when ready, the eager step otherwise.

A stage call asks :meth:`CompiledStages.compute` first. Below ``compile_min_positions`` (N x T) the eager step
serves: there a step costs its fixed cost, which compilation does not lower. Otherwise a ready program whose
guards admit the step's sizes computes it; when none does, the eager step serves this step and the call's
signature and sizes (host facts, no tensor) go to the compiler thread, which traces the stage on zeros of those
sizes, compiles the program and runs it once: no training step waits on compilation. The thread holds a lock
while it compiles; a stage call that finds it held runs eagerly (``torch.compiler.set_stance`` is process-wide,
and a step must never compile on the training thread: the compiled call runs with ``fail_on_recompile``).

Every way of not using a compiled program is counted by reason (:attr:`CompiledStages.fallbacks`) and the
first of each reason is logged once: ``compiler`` (tracing or compiling failed: that signature stays eager),
``run`` (a compiled call raised: that signature stays eager), ``recompile`` (the compiled call would have
recompiled: refused, and the variant is compiled in the background), ``late`` (a non-finite log-prob on a loss
token: the eager step takes the counts it needs), ``busy``, ``pending``. The monitor publishes them, and the
compiled calls, as counters (``grpo_exporter_compiled_fallbacks_total{reason}``,
``grpo_exporter_compiled_stage_calls_total``).

The compiler thread is a daemon (a compilation never holds a finished process), and nothing of it runs on the
training thread: the call that queues a program only computes its signature and puts it in the queue; importing
``torch._dynamo`` (about a second), tracing, compiling and the warm-up run are the thread's, and they start once
the stage call that queued them has returned (a thread holding the GIL for a second of imports made that call's
eager step 5-20 times slower: 0.08-0.35 s instead of 0.015 s at 131K positions on 2 cores). A job goes in phases
(import, trace, compile and warm-up) and starts none once the stages are closed. :meth:`CompiledStages.close`
drops the queued jobs and waits at most ``CLOSE_TIMEOUT_S`` for the phase in progress. At the interpreter's exit
(the hook :mod:`~grpo_exporter.runtime.background` runs for every thread of ours that runs torch code) the queue
is dropped and the job in progress is interrupted at its next Python line, waited for at most ``EXIT_TIMEOUT_S``:
a compiler thread left inside a torch operator while the interpreter finalizes aborts the process (exit status
134, "terminate called without an active exception"; see :class:`~grpo_exporter.runtime.background.DaemonExecutor`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.runtime.background import DaemonExecutor, Interrupted
from grpo_exporter.step import program as step_program
from grpo_exporter.step.dynamo_frames import compile_lock, foreign_frames, import_dynamo, inline_while_traced
from grpo_exporter.step.gather import LateCounts, Merger, StepResult
from grpo_exporter.step.program import Signature
from grpo_exporter.step.registry import Block

log = logging.getLogger("grpo_exporter")

MAX_PROGRAMS = 4  # per signature: size classes whose traces took different branches (small / large tensors)
CLOSE_TIMEOUT_S = 2.0  # close() waits this long for a job's phase in progress (a compile phase: 3-20 s on 2 cores)
START_WAIT_S = 5.0  # a job waits at most this long for the stage call that queued it to return
MAX_LAYOUTS = 256  # per program: the admitted layouts remembered
OPTIONS = {"compile_threads": 1}  # no compile worker processes inside a training process

Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, bool]


def meta(t: Tensor) -> Meta:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.is_inference()


def examples(metas: Sequence[Meta]) -> list[Tensor]:
    """Zero tensors of these sizes, strides, dtypes and devices, inference tensors where the step's were (the
    compiled call's guards tell them apart): a trace's and a warm-up's arguments."""
    out = []
    for size, stride, dtype, device, inference in metas:
        with torch.inference_mode(inference):
            out.append(torch.empty_strided(size, stride, dtype=dtype, device=device).zero_())
    return out


@dataclass
class Ready:
    """A compiled program, what it took to make, and the layouts (sizes, strides, offsets) its guards admitted:
    a training loop repeats a few, and evaluating the guards costs more than looking one up."""

    program: step_program.Program
    runner: step_program.Runner
    seconds: float
    admitted: set[tuple[Any, ...]] = field(default_factory=set)

    def admits(self, args: Sequence[Tensor]) -> bool:
        layout = tuple((t.shape, t.stride(), t.storage_offset()) for t in args)
        if layout in self.admitted:
            return True
        if not self.program.admits(args):
            return False
        if len(self.admitted) < MAX_LAYOUTS:
            self.admitted.add(layout)
        return True


@dataclass(eq=False)  # compared and hashed by identity
class CompiledStages:
    """Per-monitor state of compilation: the ``ready`` programs by signature, the compiler thread (one
    :class:`~grpo_exporter.runtime.background.DaemonExecutor`, started by the first request), and the counts
    the bench, the logs and the published counters read. Inductor's settings are per thread: ``options`` are
    the compiler thread's (the bench adds a kernel profile). ``mode``: "auto" (compile above ``min_positions``)
    or "off"."""

    config: MetricsConfig
    mode: str = "auto"
    min_positions: int = 1 << 16
    ready: dict[Signature, list[Ready]] = field(default_factory=dict)
    refused: dict[Signature, str] = field(default_factory=dict)
    fallbacks: Counter[str] = field(default_factory=Counter)
    compiled_steps: int = 0
    compiles: int = 0
    first_compile_s: float | None = None
    foreign: str | None = None  # why no program is compiled any more (the training's own torch.compile)
    options: dict[str, Any] = field(default_factory=lambda: dict(OPTIONS))  # inductor's, for programs made later
    _published: Counter[str] = field(default_factory=Counter)  # fallbacks already published
    _published_steps: int = 0  # compiled steps already published
    _counts_lock: threading.Lock = field(default_factory=threading.Lock)  # the compiler thread counts too
    _pending: set[tuple[Signature, tuple[Meta, ...] | None]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _executor: DaemonExecutor | None = None
    _start_lock: threading.Lock = field(default_factory=threading.Lock)  # one compiler thread, whichever calls
    _closed: bool = False  # no job is queued, and no phase of one started, any more

    def compute(self, blocks: Sequence[Block], inputs: StepInputs, carry: dict[str, Tensor], failed: bool,
                merger: Merger | None = None) -> StepResult | None:
        """The stage's step by a compiled program, or None when the eager step must serve (counted, and a
        program queued when one could serve it). ``merger``: the step's merge across ranks, which the caller
        runs after (its device parts ride in the program's block)."""
        if self.mode == "off" or self._closed or inputs.empty or _positions(inputs) < self.min_positions:
            return None
        sig = step_program.signature(blocks, inputs, carry, failed, merger)
        if sig in self.refused:
            return None
        args = step_program.leaves(inputs, carry)
        ready = next((r for r in self.ready.get(sig, ()) if r.admits(args)), None)
        if ready is None:
            if not self._shares_dynamo():
                self._request(sig, blocks, args, None, merger)
            return None
        if not self._lock.acquire(blocking=False):
            self._fallback("busy")
            return None
        try:
            with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
                result = step_program.run(ready.program, ready.runner, args, {t for b in blocks for t in b.tags},
                                          merger)
        except LateCounts:
            self._fallback("late")
            return None
        except Exception as exc:  # the compiled call failed: this step and signature are eager's
            if "recompile" in str(exc).lower():
                self._fallback("recompile", exc)
                self._request(sig, blocks, args, ready)
            else:
                self.refused[sig] = f"run: {exc!r}"
                self._fallback("run", exc)
            return None
        finally:
            self._lock.release()
        with self._counts_lock:
            self.compiled_steps += 1
        return result

    def _request(self, sig: Signature, blocks: Sequence[Block], args: Sequence[Tensor],
                 ready: Ready | None, merger: Merger | None = None) -> None:
        """Queue a trace and compilation (``ready`` None; with a fresh copy of ``merger`` for the trace) or a
        warm-up of ``ready`` for these sizes."""
        metas = tuple(meta(t) for t in args)
        key = (sig, None if ready is None else metas)  # one trace of a signature at a time
        if key in self._pending or (ready is None and len(self.ready.get(sig, ())) >= MAX_PROGRAMS):
            self._fallback("pending")
            return
        self._pending.add(key)
        self._fallback("pending")
        traced = merger.fresh() if merger is not None and ready is None else None
        try:
            future = self._compiler().submit(self._job, _stage_call(), sig, tuple(blocks), metas, ready, traced)
        except RuntimeError:  # closed meanwhile (by another thread, or the exit)
            self._pending.discard(key)
            return
        future.add_done_callback(lambda _: self._pending.discard(key))  # run, failed or dropped at close

    def _compiler(self) -> DaemonExecutor:
        """The compiler thread, started by the first request (by one thread when several observe at once); the
        exit hook learns of it."""
        with self._start_lock:
            if self._executor is None:
                if self._closed:
                    raise RuntimeError("closed")
                self._executor = DaemonExecutor("grpo-exporter-compile", stopped_at_exit=True)
            return self._executor

    def _shares_dynamo(self) -> bool:
        """Whether the training compiled frames of its own with ``torch.compile``: then no program is traced or
        compiled any more (a trace on this thread would interleave with the training's compiled calls, see
        :mod:`~grpo_exporter.step.dynamo_frames`); the programs already made still serve. Said once."""
        if self.foreign is None and foreign_frames() > 0:
            self.foreign = (f"the training compiled {foreign_frames()} frame(s) of its own with torch.compile: no "
                            "further program is compiled (torch's FX-tracing state is process-wide), the programs "
                            "made still serve")
            self._fallback("compiler", RuntimeError(self.foreign))
        return self.foreign is not None

    def _job(self, call: Call | None, sig: Signature, blocks: Sequence[Block], metas: Sequence[Meta],
             ready: Ready | None, merger: Merger | None) -> None:
        """One queued request, on the compiler thread: once the monitor's ``call`` that queued it has returned,
        import dynamo, then (holding the compile locks) trace, compile and run once. Ends quietly when the stages
        close (between phases) or the exit interrupts it."""
        try:
            _after(call, START_WAIT_S, lambda: self._closed)
            self._phase()
            import_dynamo()  # here, not on the training thread: about a second
            inline_while_traced()  # before any trace: a training's compiled call meanwhile runs, uncompiled
            with compile_lock(), self._lock:  # no compilation of the training's interleaves with this one
                if self._shares_dynamo():
                    return
                self._build(sig, blocks, metas, ready, merger)
        except Interrupted:  # closed, or the process exits: the program is not needed any more
            return
        except Exception as exc:  # a compiler missing or failing: this signature stays eager
            self.refused[sig] = f"compiler: {exc!r}"
            self._fallback("compiler", exc)

    def _phase(self) -> None:
        """Between a job's phases: none starts once the stages are closed."""
        if self._closed:
            raise Interrupted

    def _build(self, sig: Signature, blocks: Sequence[Block], metas: Sequence[Meta],
               ready: Ready | None, merger: Merger | None) -> None:
        start = time.perf_counter()
        args = examples(metas)
        device = metas[0][3] if metas else torch.device("cpu")
        if ready is None:
            self._phase()
            program = step_program.trace(blocks, self.config, sig, args, device, merger)
            ready = Ready(program, step_program.compile_program(program, self.options), 0.0)
        self._phase()
        with torch.inference_mode():
            ready.runner(*args)  # compiles here, off the training thread
        ready.seconds = time.perf_counter() - start
        self.compiles += 1
        if self.first_compile_s is None:
            self.first_compile_s = ready.seconds
        known = self.ready.setdefault(sig, [])
        if ready not in known:
            known.append(ready)
        log.info("grpo-exporter: compiled the %s stage's program in %.1f s (%d compiled so far)",
                 "/".join(sig.stage[:1]) or "?", ready.seconds, self.compiles)

    def _fallback(self, reason: str, exc: BaseException | None = None) -> None:
        with self._counts_lock:
            self.fallbacks[reason] += 1
        if exc is not None and self.fallbacks[reason] == 1:
            log.warning("grpo-exporter: the compiled step fell back to eager (%s: %r); counted, said once", reason,
                        exc)

    def unpublished(self) -> tuple[int, dict[str, int]]:
        """(compiled stage calls, fallbacks by reason) counted since the last call: what the monitor adds to
        ``grpo_exporter_compiled_stage_calls_total`` and ``grpo_exporter_compiled_fallbacks_total``."""
        with self._counts_lock:
            fallbacks, compiled = Counter(self.fallbacks), self.compiled_steps
        fresh = (compiled - self._published_steps, dict(fallbacks - self._published))
        self._published, self._published_steps = fallbacks, compiled
        return fresh

    def wait(self, timeout_s: float = 600.0) -> bool:
        """Block until the compiler thread has nothing queued (for warm-ups, benches and tests): True if idle."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._pending

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Take no more compilations, drop the queued ones, and let the compiler thread end, waiting at most
        ``timeout_s`` for the phase in progress (a compile phase cannot be interrupted safely while the process
        goes on). One that outlives the wait is logged and abandoned: it starts no further phase, and the exit
        hook interrupts it if the interpreter exits first. Returns whether no compiler thread runs any more."""
        self._closed = True
        with self._start_lock:
            executor = self._executor
        if executor is None or executor.shutdown(timeout_s, cancel_futures=True):
            self._pending.clear()  # nothing will run any more
            return True
        log.warning("grpo-exporter: a compilation was still running %.1f s after close(); abandoned (it starts no "
                    "further phase)", timeout_s)
        return False

    def stop(self, deadline: float) -> bool:
        """Close, and interrupt the job in progress until the compiler thread ends or ``deadline``
        (``time.monotonic()``) passes, as the exit does. Returns whether it ended."""
        self._closed = True
        with self._start_lock:
            executor = self._executor
        if executor is not None and not executor.stop(deadline):
            return False
        self._pending.clear()  # an interrupted job may have left its key
        return True


_RUNTIME = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the monitor's calls run here
Call = tuple[int, int, Any]  # a thread, the id of a frame on its stack, that frame's code


def _stage_call() -> Call | None:
    """The calling thread's outermost frame in the monitor's runtime (an ``observe_*`` or ``end_step``): the call
    that is queuing a job, which the job lets return first. Its id and code, not the frame (that would keep the
    step's tensors alive)."""
    outer = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_RUNTIME):
            outer = frame
        frame = frame.f_back
    return None if outer is None else (threading.get_ident(), id(outer), outer.f_code)


def _after(call: Call | None, timeout_s: float, closed: Callable[[], bool]) -> None:
    """Wait until ``call`` has returned, at most ``timeout_s`` and not once ``closed()``: a job's Python would
    otherwise share the GIL with that call's eager step."""
    deadline = time.monotonic() + timeout_s
    while call is not None and time.monotonic() < deadline and not closed() and _running(call):
        time.sleep(0.005)


def _running(call: Call) -> bool:
    thread, frame_id, code = call
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if id(frame) == frame_id and frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _positions(inputs: StepInputs) -> int:
    """N x T of the stage's token tensors (0 without any): the size that decides eager or compiled."""
    for t in (inputs.loss_mask, inputs.logprobs, inputs.old_logprobs, inputs.completion_ids):
        if t is not None:
            return t.numel()
    return 0
