"""The gathering of a step's readings and its one device-to-host transfer.

Metric blocks add readings to a :class:`Gather` under catalogue sample keys; :meth:`Gather.transfer` packs
them (:mod:`grpo_exporter.step.pack`), moves the block to the host once, and reads every value back there:
ratios divided, histograms read, the inputs' value checks, and the carried vectors. What the merge across
ranks needs from the device (a :class:`Merger`'s parts) rides in the same transfer; the merge itself is the
runtime's to call, after the step (:class:`StepResult` hands it its part of the block).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.catalog import SampleKey, format_quantile
from grpo_exporter.functional.histogram_host import Buckets, HostHistograms, HostReading, Quantiles
from grpo_exporter.functional.reading import Ratio, always
from grpo_exporter.inputs import value_error
from grpo_exporter.step.pack import (
    Element,
    Entry,
    Packed,
    StepMetrics,
    counts_after_transfer,
    flat,
    on_host_copy,
    pack,
    scalar,
)
from grpo_exporter.step.read_table import ReadTable

if TYPE_CHECKING:
    from grpo_exporter.step.context import Context
    from grpo_exporter.step.registry import Block


class Merger(Protocol):
    """Merges a stage's readings across ranks around the step's single transfer (see
    :mod:`grpo_exporter.ranks.distributed`): its device parts go into the one transfer; the runtime runs the
    merge on the host after the step, with the transferred parts (:attr:`StepResult.merge_host`)."""

    def device_parts(self, entries: list[Entry], device: torch.device) -> Tensor | None: ...

    def key(self) -> Hashable:
        """What a compiled stage's program depends on: the merge layout (the same key, the same device parts)."""
        ...

    def fresh(self) -> Merger:
        """A merger of the same layout, for a trace (:mod:`grpo_exporter.step.program`) made while this one
        serves the eager step."""
        ...

    def adopt(self, traced: Merger) -> None:
        """Take what ``traced`` learnt from its :meth:`device_parts` in a trace (which slot holds which reading,
        the problems found), for the host merge of a compiled step."""
        ...


class StepResult(NamedTuple):
    """What one computation produced: values of present metrics, carried vectors, the errors of metric
    blocks (non-strict), and every family computed on this rank, present or absent (what the publication
    replaces; a family that failed keeps describing its last computation). For the merge across ranks, run by
    the runtime after the step: the tags that ``failed`` here and ``merge_host``, the merger's transferred
    parts (None without a merger)."""

    metrics: StepMetrics
    carried: dict[str, Tensor]
    errors: list[tuple[str, Exception]]
    families: frozenset[str]
    failed: frozenset[str] = frozenset()
    merge_host: list[float] | None = None


@dataclass(frozen=True)
class TransferLayout:
    """The regions of the transferred block, in order: the packed ``values`` (:func:`~grpo_exporter.step.pack.
    pack`'s parts), one count per value ``check``, the rank ``merge``'s device parts, every fine
    ``histogram``'s counts, then the ``carried`` vectors (name, length). The first three are read as one
    Python list (:attr:`listed`), the last two as views of the host block. Written once by
    :meth:`Gather.transfer`, read by :meth:`Gather._read`."""

    values: int
    checks: int
    merge: int
    histograms: int
    carried: tuple[tuple[str, int], ...]

    @property
    def checks_at(self) -> int:
        return self.values

    @property
    def merge_at(self) -> int:
        return self.values + self.checks

    @property
    def listed(self) -> int:
        return self.values + self.checks + self.merge

    def carried_at(self) -> Iterator[tuple[str, int, int]]:
        """Each carried vector's name, start and length in the host block."""
        start = self.listed + self.histograms
        for name, width in self.carried:
            yield name, start, width
            start += width


@functools.lru_cache(maxsize=256)
def _quantile_keys(name: str, qs: tuple[float, ...], labels: tuple[tuple[str, str], ...]) -> tuple[SampleKey, ...]:
    family = catalog.metric(name)
    return tuple(family.key(quantile=format_quantile(q), **dict(labels)) for q in qs)


@functools.lru_cache(maxsize=256)
def _bucket_keys(name: str, labels: tuple[tuple[str, str], ...]) -> tuple[SampleKey, ...]:
    """The ``_bucket`` keys of a histogram family, +Inf last."""
    family = catalog.metric(name)
    return tuple(family.key("_bucket", le="+Inf" if b == math.inf else format_quantile(b), **dict(labels))
                 for b in (*family.buckets, math.inf))


class Staged(NamedTuple):
    """Where a stage's readings lie in its transferred block: the packed values, the regions, and whether the
    rank merge's parts are in it."""

    packed: Packed
    layout: TransferLayout
    merged: bool


class LateCounts(Exception):  # noqa: N818 -- a signal to the compiled stage's caller, not an error
    """A compiled stage's block says some witnessed non-finite counts must be taken from their tensors, which
    only the eager step holds: the caller computes the step eagerly."""


class Gather:
    """Collects readings keyed by catalogue sample keys, then transfers them to the host in one go. ``traced``:
    the readings are a compiled stage's trace (:mod:`grpo_exporter.step.program`), whose tensors are gone."""

    traced = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[Entry] = []
        self.carried: dict[str, Tensor] = {}
        self.errors: list[tuple[str, Exception]] = []
        self.failed: set[str] = set()
        self.checks: list[tuple[str, Tensor]] = []
        self._table: ReadTable | None = None  # made at the first read; a compiled stage's readers share it

    def add(self, name: str, value: Any, suffix: str = "", **labels: str) -> None:
        key = catalog.metric(name).key(suffix, **labels)
        if isinstance(value, Element):
            self.entries.append(Entry(key, always(value.vector), value.index))
            return
        if isinstance(value, (int, float, torch.SymInt)):  # a host number (a size, when traced: symbolic)
            value = scalar(value, torch.float64, self.device)
        if isinstance(value, Tensor):
            value = always(value)
        self.entries.append(Entry(key, value))

    def each(self, name: str, r: Ratio, label: str, values: Sequence[str]) -> None:
        """One sample per label value, each reading its position of the vector ratio ``r``."""
        family = catalog.metric(name)
        for i, value in enumerate(values):
            self.entries.append(Entry(family.key(**{label: value}), r, i))

    def summary(
        self, name: str, total: Tensor | Element, count: Tensor | Element, r: Quantiles, qs: Sequence[float],
        **labels: str,
    ) -> None:
        for i, key in enumerate(_quantile_keys(name, tuple(qs), tuple(labels.items()))):
            self.entries.append(Entry(key, r, i))
        self.add(name, total, "_sum", **labels)
        self.add(name, count, "_count", **labels)

    def histogram(self, name: str, h: HostReading, total: Tensor | Element, **labels: str) -> None:
        """A classic histogram read exactly from the fine one of ``h`` (any reading of it): this step's
        increments of every ``_bucket`` (the catalogue's bounds, which are fine edges), ``_sum`` (``total``) and
        ``_count`` (the +Inf bucket)."""
        family = catalog.metric(name)
        buckets = Buckets(h.stack, family.buckets, h.row)  # read on the host with the stage's other histograms
        keys = _bucket_keys(name, tuple(labels.items()))
        for i, key in enumerate(keys):
            self.entries.append(Entry(key, buckets, i))
        self.add(name, total, "_sum", **labels)
        self.entries.append(Entry(family.key("_count", **labels), buckets, len(keys) - 1))

    def run(self, block: Block, ctx: Context, strict: bool) -> None:
        """Run one metric block; on error drop what it added and mark its families failed (strict: re-raise)."""
        mark = len(self.entries)
        try:
            block(self, ctx)
        except Exception as exc:
            if strict:
                raise
            del self.entries[mark:]
            self.failed.update(block.tags)
            self.errors.append((block.name, exc))

    def transfer(self, merger: Merger | None, stage_tags: set[str]) -> StepResult:
        """The single device-to-host transfer of the step: every reading, the value checks of the inputs (a
        numeric mask holding other values than 0 and 1), with ``merger`` what the merge across ranks needs,
        and the carried vectors; then, on the host, the checks. The carried vectors stay CPU tensors (views of
        the transferred block): whoever reads them converts them, off the training thread."""
        block, staged = self.staged(merger)
        host = block if block.device.type == "cpu" else block.cpu()  # the one device-to-host transfer
        return self.read(host, staged, stage_tags)

    def staged(self, merger: Merger | None) -> tuple[Tensor, Staged]:
        """The device block of every reading (packed, one ``cat``) and where each lies in it. A compiled stage
        (:mod:`grpo_exporter.step.program`) traces this far, and reads its block with the traced layout."""
        packed_parts = pack(self.entries)
        parts = list(packed_parts.parts)
        if self.checks:
            parts.append(torch.stack([count for _, count in self.checks]))
        extra = merger.device_parts(self.entries, self.device) if merger is not None else None
        if extra is not None:
            parts.append(extra)
        parts += packed_parts.histograms
        parts += [flat(t) for t in self.carried.values()]
        layout = TransferLayout(
            values=sum(p.numel() for p in packed_parts.parts), checks=len(self.checks),
            merge=extra.numel() if extra is not None else 0,
            histograms=sum(t.numel() for t in packed_parts.histograms),
            carried=tuple((name, t.numel()) for name, t in self.carried.items()),
        )
        parts = [p if p.device == self.device else p.to(self.device) for p in parts]
        if not any(p.dtype == torch.float64 for p in parts):  # cat promotes the parts to their widest dtype
            parts.append(torch.zeros(0, dtype=torch.float64, device=self.device))
        block = torch.cat(parts)  # every part converted to fp64 in the copy (bools, counts, fp32/bf16 values)
        return block, Staged(packed_parts, layout, extra is not None)

    def read(self, host: Tensor, staged: Staged, stage_tags: set[str]) -> StepResult:
        """The step's result from its block on the host (:meth:`staged`'s layout): values, checks, carried
        vectors, the merger's parts."""
        layout = staged.layout
        packed = host[: layout.listed].tolist()
        with on_host_copy():
            metrics, families = self._read(host, packed, staged.packed, layout, stage_tags)
        carried = {name: host[start : start + width] for name, start, width in layout.carried_at()}
        merge_host = packed[layout.merge_at : layout.listed] if staged.merged else None
        return StepResult(metrics, carried, self.errors, families, frozenset(self.failed), merge_host)

    def table(self, packed_parts: Packed) -> ReadTable:
        """How these readings are read back (:class:`~grpo_exporter.step.read_table.ReadTable`), made once:
        a compiled stage makes it when traced, and every :meth:`reader` of it reads by the same table."""
        if self._table is None:
            self._table = ReadTable(self.entries, packed_parts.positions)
        return self._table

    def reader(self) -> Gather:
        """A gather with these readings' layout and fresh errors, to read another block of the same layout."""
        other = Gather(self.device)
        other.entries, other.carried, other.checks = self.entries, self.carried, self.checks
        other.errors, other.failed = list(self.errors), set(self.failed)
        other.traced = self.traced
        other._table = self._table
        return other

    def _read(
        self, host: Tensor, packed: list[float], packed_parts: Packed, layout: TransferLayout, stage_tags: set[str],
    ) -> tuple[StepMetrics, frozenset[str]]:
        """After the transfer, on the host: every value (ratios divided, histograms read) and the value checks."""
        hists = HostHistograms(
            host[layout.listed : layout.listed + layout.histograms],
            [packed[low] for low, _ in packed_parts.extremes],
            [packed[high] for _, high in packed_parts.extremes],
        ) if layout.histograms else None
        table = self.table(packed_parts)
        out, late = table.read(packed, hists)
        if late:
            if self.traced:
                raise LateCounts(len(late))
            out |= zip((key for key, _ in late), counts_after_transfer([r.tensor for _, r in late]), strict=True)
        families = table.families
        failed = [(name, bad) for (name, _), bad in zip(self.checks, packed[layout.checks_at : layout.merge_at],
                                                        strict=True) if bad]
        if failed:
            self.errors.append(("input values", value_error(failed)))
            self.failed |= stage_tags
            out, families = {}, frozenset()  # nothing computed from such inputs: every family keeps its last
        return out, families
