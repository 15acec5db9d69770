"""What the exporter's compiled programs share with the rest of the process in ``torch._dynamo``: its compile
lock and its count of compiled frames.

torch's FX-tracing flag is process-wide, not per thread (torch 2.13: ``torch.fx._symbolic_trace``): while one
thread traces (``make_fx``, and the AOT trace inside every ``torch.compile``), a call of a ``torch.compile``'d
function on another thread raises ``RuntimeError: Detected that you are using FX to symbolically trace a
dynamo-optimized function``, and two traces on two threads reset each other's flag. So the compiler thread
(:mod:`grpo_exporter.runtime.compilation`) traces and compiles only while it holds dynamo's compile lock (a
training thread's own compilation waits for it, and never interleaves with it), and only in a process where no
frame but the exporter's programs was ever compiled: :func:`foreign_frames` counts the others. A training whose
first compiled call comes while a program is traced runs that call uncompiled instead of raising
(:func:`inline_while_traced`, set on the training thread when it queues a program); its next call compiles.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_exporter_frames = 0  # frames dynamo compiled for the exporter's programs, process-wide
_count_lock = threading.Lock()


def compile_lock() -> Any:
    """Dynamo's process-wide compile lock (a re-entrant lock every ``torch.compile`` compilation takes)."""
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", contextlib.nullcontext())


def frames_total() -> int:
    """Frames dynamo compiled in this process so far, the exporter's and others'."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


@contextlib.contextmanager
def exporter_frames() -> Iterator[None]:
    """Count the frames compiled inside as the exporter's (a program's first call, a recompile)."""
    global _exporter_frames
    before = frames_total()
    try:
        yield
    finally:
        with _count_lock:
            _exporter_frames += frames_total() - before


def foreign_frames() -> int:
    """Frames compiled in this process that were not the exporter's: the training's own ``torch.compile``."""
    return frames_total() - _exporter_frames


def inline_while_traced() -> None:
    """On the calling (training) thread: a ``torch.compile``'d call made while another thread traces runs its
    function uncompiled instead of raising (dynamo's ``error_on_nested_fx_trace``; outside a trace it changes
    nothing)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.error_on_nested_fx_trace = False
