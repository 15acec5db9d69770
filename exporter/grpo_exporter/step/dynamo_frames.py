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
(:func:`inline_while_traced`, set by the compiler thread for every thread before its first trace); its next call
compiles.

Importing ``torch._dynamo`` costs 0.8-1.7 s (measured on 2 cores), so only the compiler thread imports it
(:func:`import_dynamo`); what a training thread asks here (:func:`foreign_frames`) reads the module only once it
is loaded: before that no frame can have been compiled.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

_exporter_frames = 0  # frames dynamo compiled for the exporter's programs, process-wide
_count_lock = threading.Lock()


def compile_lock() -> Any:
    """Dynamo's process-wide compile lock (a re-entrant lock every ``torch.compile`` compilation takes)."""
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", contextlib.nullcontext())


def import_dynamo() -> None:
    """Import ``torch._dynamo`` (and its compile lock and counters): on the compiler thread, never on a training
    thread, which it would stall for a second."""
    import torch._dynamo.convert_frame
    import torch._dynamo.utils  # noqa: F401


def frames_total() -> int:
    """Frames dynamo compiled in this process so far, the exporter's and others'; 0 while ``torch._dynamo`` is not
    (fully) imported, which costs nothing and imports nothing (no frame is compiled before its import ends)."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return 0 if counters is None else int(counters["frames"]["total"])


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
    """For every thread of the process (the training's, whichever it is): a ``torch.compile``'d call made while
    another thread traces runs its function uncompiled instead of raising (dynamo's ``error_on_nested_fx_trace``;
    outside a trace it changes nothing). Called on the compiler thread before its first trace.

    torch's config settings are per thread (recent torch: a ``ContextVar`` over a process-wide default), so the
    setting goes to the default, which every thread that did not set its own reads; an older torch keeps one
    process-wide value, set as usual. A thread that set its own value keeps it."""
    import torch._dynamo.config as dynamo_config

    entry = getattr(dynamo_config, "_config", {}).get("error_on_nested_fx_trace")
    if entry is not None and hasattr(entry, "default") and hasattr(entry, "user_override"):
        entry.default = False
        return
    with contextlib.suppress(AttributeError):  # a torch without the setting raises in any case
        dynamo_config.error_on_nested_fx_trace = False
