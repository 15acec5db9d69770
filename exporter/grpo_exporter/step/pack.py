"""Where each reading of a step lies in the one block the step moves to the host, and the host-side helpers of
that transfer.

A stage's readings (:class:`Entry`: a sample key and the reading it comes from) are packed into 1-d device
parts by :func:`pack`: scalars stacked per dtype, vectors and shared presence flags once each, each fine
histogram whole; :class:`Position` says where an entry's value lies in their concatenation and how it is read
back (:class:`Kind`). The block's other regions (value checks, the rank merge's parts, histograms, carried
vectors) are laid out by :class:`~grpo_exporter.step.gather.TransferLayout`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from enum import IntEnum
from typing import Any, NamedTuple

import torch
from torch import Tensor

from grpo_exporter.catalog import SampleKey
from grpo_exporter.functional.histogram import BUCKETS, Histogram
from grpo_exporter.functional.histogram_host import HostReading
from grpo_exporter.functional.reading import Ratio, count_nonfinite

StepMetrics = dict[str, float]  # keyed by SampleKey (a str)


class Entry(NamedTuple):
    """One sample of the step: its key, and the reading it came from (``index``: the position in a vector
    reading, a quantile vector or a histogram's cumulative counts). How it merges across ranks is the
    catalogue's (:meth:`catalog.Metric.merge_of`)."""

    key: SampleKey
    reading: Any
    index: int = 0  # type: ignore[assignment]  # a field, shadowing tuple.index


class Element(NamedTuple):
    """Position ``index`` of ``vector``, as a value for :meth:`~grpo_exporter.step.gather.Gather.add` (always
    present): the whole vector is packed once however many samples read it, with no select operator per
    sample."""

    vector: Tensor
    index: int  # type: ignore[assignment]  # a field, shadowing tuple.index


class Kind(IntEnum):
    """How an entry's value is read back after the transfer (see :class:`Position`)."""

    PLAIN = 0
    RATIO = 1
    HOST = 2
    WITNESSED = 3


PLAIN, RATIO, HOST, WITNESSED = Kind.PLAIN, Kind.RATIO, Kind.HOST, Kind.WITNESSED


class Position(NamedTuple):
    """Where an entry's value is after the transfer. ``kind`` PLAIN: ``value`` and ``present`` (a flag) index
    the packed block; RATIO: its numerator (``value``) and denominator (``present``): the host divides, and the
    ratio is absent when the denominator is 0; HOST: ``value`` is the first row of the entry's histogram among
    the block's histogram rows, read on the host (:class:`~grpo_exporter.functional.histogram_host.HostHistograms`)."""

    value: int
    present: int
    kind: Kind


class Witnessed(NamedTuple):
    """The non-finite count of ``tensor``, when a cheaper count witnesses it: ``witness`` (0-d) counts the
    non-finite values of a tensor that is non-finite wherever ``tensor`` is (a difference ``tensor`` entered,
    which the step counts anyway). Witness 0 (every healthy step): the count is 0 and no pass over ``tensor`` is
    made. Otherwise ``tensor`` is counted after the transfer, with the stage's other such counts: a stage with
    NaN or inf in a log-prob input on a loss token takes one more transfer (a few integers)."""

    tensor: Tensor
    witness: Tensor


class Packed(NamedTuple):
    """The device parts of a stage's readings, 1-d, each of its own dtype (the transfer's one ``cat`` makes them
    fp64): ``parts`` (read back as a list), ``histograms`` (the fine counts of every distinct histogram, read
    back as one (K, BUCKETS) view), each entry's :class:`Position`, and where each histogram row's min and max
    lie in the packed list."""

    parts: list[Tensor]
    histograms: list[Tensor]
    positions: list[Position]
    extremes: list[tuple[int, int]]


def pack(entries: list[Entry]) -> Packed:
    """The device parts holding every entry's value and presence, and each entry's :class:`Position` in their
    concatenation. Scalars are stacked per dtype, vector readings and shared presence flags taken once each: a
    few dozen operators for a few hundred samples, where one conversion per sample cost ~5 each. A histogram
    travels whole (its counts, min and max), once however many readings it has."""
    packer = _Packer()
    for e in entries:
        packer.place(e)
    return packer.packed()


Slot = tuple[Any, int]  # (group, index): a scalar group (dtype, device), a vector (its id), "flags" or "rows"


class _Packer:
    """Places each entry's value and presence in a group (:data:`Slot`); :meth:`packed` lays the groups out."""

    def __init__(self) -> None:
        self.scalars: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        self.vectors: dict[int, Tensor] = {}
        self.flags: dict[int, tuple[int, Tensor]] = {}
        self.stacks: dict[int, tuple[int, Histogram]] = {}  # by id of the counts: (first row, histogram stack)
        self.rows = 0
        self.where: list[tuple[Slot, Slot, Kind]] = []  # (value, presence) of each entry
        self.host: tuple[Any, Any] = (None, None)  # the last histogram reading and its place

    def scalar(self, t: Tensor) -> Slot:
        group = self.scalars.setdefault((t.dtype, t.device), [])
        group.append(t)
        return (t.dtype, t.device), len(group) - 1

    def vector(self, t: Tensor, index: int) -> Slot:
        self.vectors.setdefault(id(t), t)
        return id(t), index

    def place(self, e: Entry) -> None:
        r = e.reading
        if r is self.host[0]:  # the next sample of a histogram reading (a bucket, a quantile): the same place
            self.where.append(self.host[1])
        elif isinstance(r, HostReading):
            h = r.stack
            if id(h.counts) not in self.stacks:
                self.stacks[id(h.counts)] = (self.rows, h)
                self.rows += h.counts.numel() // BUCKETS
                self.vector(h.minimum, 0)
                self.vector(h.maximum, 0)
            self.host = (r, (("rows", self.stacks[id(h.counts)][0] + (r.row or 0)), ("rows", 0), HOST))
            self.where.append(self.host[1])
        elif isinstance(r, Witnessed):
            at = self.scalar(r.witness)
            self.where.append((at, at, WITNESSED))
        elif isinstance(r, Ratio) and r.numerator.dim() == 0:
            self.where.append((self.scalar(r.numerator), self.scalar(r.denominator), RATIO))
        elif isinstance(r, Ratio):  # a vector of ratios (pass@k for every k): ``e.index`` picks one
            self.where.append((self.vector(r.numerator, e.index), self.vector(r.denominator, e.index), RATIO))
        else:
            flag = ("flags", self.flags.setdefault(id(r.present), (len(self.flags), r.present))[0])
            value = self.scalar(r.value) if r.value.dim() == 0 else self.vector(r.value, e.index)
            self.where.append((value, flag, PLAIN))

    def packed(self) -> Packed:
        parts: list[Tensor] = []
        start: dict[Any, int] = {"rows": 0}  # a histogram reading's position is its row, not a packed offset
        offset = 0
        for key, group in self.scalars.items():
            parts.append(torch.stack(group))
            start[key], offset = offset, offset + len(group)
        for vid, vector in self.vectors.items():
            parts.append(flat(vector))
            start[vid], offset = offset, offset + vector.numel()
        if self.flags:
            device = next(iter(self.flags.values()))[1].device
            parts.append(torch.stack([f if f.device == device else f.to(device) for _, f in self.flags.values()]))
            start["flags"] = offset
        extremes = [
            (start[id(h.minimum)] + i, start[id(h.maximum)] + i)
            for _, h in self.stacks.values() for i in range(h.counts.numel() // BUCKETS)
        ]
        histograms = [flat(h.counts) for _, h in self.stacks.values()]
        positions = [Position(start[v[0]] + v[1], start[p[0]] + p[1], kind) for v, p, kind in self.where]
        return Packed(parts, histograms, positions, extremes)


def flat(t: Tensor) -> Tensor:
    """``t`` as a 1-d tensor of its own dtype (the step's one ``cat`` converts every part to fp64)."""
    return t if t.dim() == 1 else t.reshape(-1)


_host = threading.local()


def reading_host_copy() -> bool:
    """True while this thread reads the step's block on the host, after its one transfer. The bench's probes
    count device reads and tensors built from Python data; reads of the host copy are neither, though on a
    CPU run the host copy and the device block are the same tensor."""
    return getattr(_host, "active", False)


def scalar(value: Tensor | float | torch.SymInt, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a tensor of ``dtype`` on ``device``: a Python number by a fill (a kernel; ``as_tensor`` of a
    number is a copy from host memory, on an accelerator a blocking one that waits for the training stream)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype)
    fill = value if isinstance(value, torch.SymInt) else float(value)  # a traced size stays symbolic
    return torch.full((), fill, dtype=dtype, device=device)  # type: ignore[arg-type]


def counts_after_transfer(tensors: list[Tensor]) -> list[float]:
    """The non-finite counts of ``tensors``, taken after the step's transfer (:class:`Witnessed` counts whose
    witness saw NaN or inf) and read together: on an accelerator one more transfer, which the bench's probes
    count as one."""
    active, _host.active = getattr(_host, "active", False), False
    try:
        return torch.stack([count_nonfinite(t) for t in tensors]).tolist()
    finally:
        _host.active = active


def host_values(carried: Tensor) -> list[float]:
    """The values of a carried vector (:class:`StepResult`), a view of the step's block already on the host:
    read with no transfer (and not counted as one by the bench's probes, as on a CPU run it would be)."""
    with on_host_copy():
        return carried.tolist()


@contextlib.contextmanager
def on_host_copy() -> Iterator[None]:
    _host.active = True
    try:
        yield
    finally:
        _host.active = False
