"""What the bench counts besides time: operators launched (torch profiler), host reads (Python calls that
bring a tensor's value to the host), tensors built from Python data, and resident memory."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grpo_exporter.step import reading_host_copy

_HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


class Counts:
    def __init__(self) -> None:
        self.host_reads = 0
        self.from_python = 0


@contextlib.contextmanager
def counting(device: torch.device | str = "cpu") -> Iterator[Counts]:
    """Count, while inside, the host reads of tensors (``.item()``, ``.tolist()``, ``.cpu()``, ``float(t)``,
    ``bool(t)``, ...: each a device-to-host transfer and a sync on an accelerator) and ``torch.tensor(data)`` or
    ``torch.as_tensor(data)`` calls from Python data (each a host-to-device copy on an accelerator), made on
    the calling (training) thread: the edit-distance worker's conversions of rows already on the host are not
    the step's. A read counts when its tensor lives on ``device`` (the bench's): on an accelerator, reading
    values already copied to the host is not another transfer, and neither is, on any device, what the step
    does with its block after the transfer (:func:`~grpo_exporter.step.reading_host_copy`)."""
    counts = Counts()
    training = threading.get_ident()
    kind = torch.device(device).type
    saved: dict[str, Any] = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    make, convert = torch.tensor, torch.as_tensor

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == training and self.device.type == kind and not reading_host_copy():
                counts.host_reads += 1
            return original(self, *args, **kwargs)

        return counted

    def from_data(build: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not isinstance(data, torch.Tensor) and threading.get_ident() == training and not reading_host_copy():
                counts.from_python += 1
            return build(data, *args, **kwargs)

        return counted

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, wrap(original))
        torch.tensor, torch.as_tensor = from_data(make), from_data(convert)
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.tensor, torch.as_tensor = make, convert


def operators(run: Callable[[], Any]) -> int:
    """aten operators launched by ``run()`` (every ``aten::`` event the profiler records, nested ones too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for event in prof.events() if event.name.startswith("aten::"))


def passes(run: Callable[[], Any], elements: int) -> int:
    """Passes over whole-step tensors made by ``run()``: aten operators that read or write at least half of
    ``elements`` (N x T) values, counted at the dispatcher (views and allocations read nothing and are not
    counted). At large sizes a step's time is about its passes times the cost of one, so the monitor's passes
    over the floor's bound its time over the floor's for any eager implementation that keeps them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = 0

    class Passes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            nonlocal count
            out = func(*args, **(kwargs or {}))
            count += is_pass(func, (args, kwargs, out), elements)
            return out

    with Passes():
        run()
    return count


def is_pass(op: Any, tensors: Any, elements: int) -> bool:
    """Whether a call of ``op`` that read or wrote ``tensors`` (any nesting of arguments and outputs) is a pass
    over (N, T): some tensor holds at least half of ``elements`` values, and ``op`` is neither a view nor an
    allocation (an operator overload or its packet; any other callable, e.g. an extern kernel, can be a pass)."""
    from torch.utils._pytree import tree_leaves

    if isinstance(op, torch._ops.OpOverload) and (op.is_view or op.overloadpacket in _ALLOCATIONS):
        return False
    if isinstance(op, torch._ops.OpOverloadPacket) and (
            op in _ALLOCATIONS or any(getattr(op, name).is_view for name in op.overloads())):
        return False
    largest = max((t.numel() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)), default=0)
    return largest * 2 >= elements


_ALLOCATIONS = frozenset({torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided})


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread): each is a fresh page the kernel maps and zeroes,
    what glibc's malloc costs when it hands freed memory back to the system and takes it again (0 off Unix)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
