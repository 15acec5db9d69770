"""One step in, every applicable metric out, with exactly one device-to-host transfer.

:func:`compute_step` runs each metric whose inputs were given, collects the device readings, packs every value
and presence flag into a single fp64 tensor and moves it to the host once (``tolist``). Keys are catalogue
sample keys (``Metric.key``): a metric name plus ``_sum``/``_count``/``_bucket`` suffixes and labels. Counter
and ``_sum``/``_count`` values are this step's increments; gauges and quantiles are this step's values.
Absent metrics (empty masks, no token of the gating sign...) are left out of the mapping.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.catalog import SampleKey, format_quantile
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import diversity, gradient, mismatch, reward, samples
from grpo_exporter.functional.groups import Groups, advantage_bounds
from grpo_exporter.functional.histogram import BUCKETS, Buckets, Histogram, HostHistograms, HostReading, Quantiles
from grpo_exporter.functional.reading import (
    SMALL,
    Ratio,
    always,
    count,
    count_nonfinite,
    fraction,
    keep_bits,
    largest,
    reading,
    zeroed,
)
from grpo_exporter.inputs import InputError, StepInputs

StepMetrics = dict[str, float]  # keyed by SampleKey (a str)


class Entry(NamedTuple):
    """One sample of the step: its key, and the reading it came from (``index``: the position in a vector
    reading, a quantile vector or a histogram's cumulative counts). How it merges across ranks is the
    catalogue's (:meth:`catalog.Metric.merge_of`)."""

    key: SampleKey
    reading: Any
    index: int = 0  # type: ignore[assignment]  # a field, shadowing tuple.index


class Element(NamedTuple):
    """Position ``index`` of ``vector``, as a value for :meth:`_Gather.add` (always present): the whole vector
    is packed once however many samples read it, with no select operator per sample."""

    vector: Tensor
    index: int  # type: ignore[assignment]  # a field, shadowing tuple.index


class Position(NamedTuple):
    """Where an entry's value is after the transfer. ``kind`` PLAIN: ``value`` and ``present`` (a flag) index
    the packed block; RATIO: its numerator (``value``) and denominator (``present``): the host divides, and the
    ratio is absent when the denominator is 0; HOST: ``value`` is the first row of the entry's histogram among
    the block's histogram rows, read on the host (:class:`~grpo_exporter.functional.histogram.HostHistograms`)."""

    value: int
    present: int
    kind: int


PLAIN, RATIO, HOST, WITNESSED = 0, 1, 2, 3


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


def _pack(entries: list[Entry]) -> Packed:
    """The device parts holding every entry's value and presence, and each entry's :class:`Position` in their
    concatenation. Scalars are stacked per dtype, vector readings and shared presence flags taken once each: a
    few dozen operators for a few hundred samples, where one conversion per sample cost ~5 each. A histogram
    travels whole (its counts, min and max), once however many readings it has."""
    scalars: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    vectors: dict[int, Tensor] = {}
    flags: dict[int, tuple[int, Tensor]] = {}
    stacks: dict[int, tuple[int, Histogram]] = {}  # by id of the counts: (first row, histogram stack)
    rows = 0
    where: list[tuple[tuple[Any, int], tuple[Any, int], int]] = []  # (value, presence) as (group, index)

    def scalar(t: Tensor) -> tuple[Any, int]:
        group = scalars.setdefault((t.dtype, t.device), [])
        group.append(t)
        return (t.dtype, t.device), len(group) - 1

    host: tuple[Any, Any] = (None, None)  # the last histogram reading and its position
    for e in entries:
        r = e.reading
        if r is host[0]:  # the next sample of a histogram reading (a bucket, a quantile): the same position
            where.append(host[1])
            continue
        if isinstance(r, HostReading):
            h = r.stack
            if id(h.counts) not in stacks:
                stacks[id(h.counts)] = (rows, h)
                rows += h.counts.numel() // BUCKETS
                vectors.setdefault(id(h.minimum), h.minimum)
                vectors.setdefault(id(h.maximum), h.maximum)
            host = (r, (("rows", stacks[id(h.counts)][0] + (r.row or 0)), ("rows", 0), HOST))
            where.append(host[1])
            continue
        if isinstance(r, Witnessed):
            at = scalar(r.witness)
            where.append((at, at, WITNESSED))
            continue
        if isinstance(r, Ratio):
            if r.numerator.dim() == 0:
                where.append((scalar(r.numerator), scalar(r.denominator), RATIO))
            else:  # a vector of ratios (pass@k for every k): ``e.index`` picks one
                vectors.setdefault(id(r.numerator), r.numerator)
                vectors.setdefault(id(r.denominator), r.denominator)
                where.append(((id(r.numerator), e.index), (id(r.denominator), e.index), RATIO))
            continue
        value, present = r.value, r.present
        flag = ("flags", flags.setdefault(id(present), (len(flags), present))[0])
        if value.dim() == 0:
            where.append((scalar(value), flag, PLAIN))
        else:
            vectors.setdefault(id(value), value)
            where.append(((id(value), e.index), flag, PLAIN))
    parts: list[Tensor] = []
    start: dict[Any, int] = {"rows": 0}  # a histogram reading's position is its row, not a packed offset
    offset = 0
    for kind, group in scalars.items():
        parts.append(torch.stack(group))
        start[kind], offset = offset, offset + len(group)
    for vid, vector in vectors.items():
        parts.append(_flat(vector))
        start[vid], offset = offset, offset + vector.numel()
    if flags:
        device = next(iter(flags.values()))[1].device
        parts.append(torch.stack([f if f.device == device else f.to(device) for _, f in flags.values()]))
        start["flags"] = offset
    extremes = [
        (start[id(h.minimum)] + i, start[id(h.maximum)] + i)
        for _, h in stacks.values() for i in range(h.counts.numel() // BUCKETS)
    ]
    histograms = [_flat(h.counts) for _, h in stacks.values()]
    positions = [Position(start[v[0]] + v[1], start[p[0]] + p[1], kind) for v, p, kind in where]
    return Packed(parts, histograms, positions, extremes)


def _flat(t: Tensor) -> Tensor:
    """``t`` as a 1-d tensor of its own dtype (the step's one ``cat`` converts every part to fp64)."""
    return t if t.dim() == 1 else t.reshape(-1)


_host = threading.local()


def reading_host_copy() -> bool:
    """True while this thread reads the step's block on the host, after its one transfer. The bench's probes
    count device reads and tensors built from Python data; reads of the host copy are neither, though on a
    CPU run the host copy and the device block are the same tensor."""
    return getattr(_host, "active", False)


def _scalar(value: Tensor | float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a tensor of ``dtype`` on ``device``: a Python number by a fill (a kernel; ``as_tensor`` of a
    number is a copy from host memory, on an accelerator a blocking one that waits for the training stream)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((), float(value), dtype=dtype, device=device)


def _counts_after_transfer(tensors: list[Tensor]) -> list[float]:
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
    with _on_host_copy():
        return carried.tolist()


@contextlib.contextmanager
def _on_host_copy() -> Iterator[None]:
    _host.active = True
    try:
        yield
    finally:
        _host.active = False


class Merger(Protocol):
    """Merges a stage's entries across ranks around the step's single transfer (see
    :mod:`grpo_exporter.distributed`): device parts go into the one transfer, the merge runs on the host."""

    def device_parts(self, entries: list[Entry], device: torch.device) -> Tensor | None: ...

    def merge(
        self, host: list[float], entries: list[Entry], local: StepMetrics, failed: set[str]
    ) -> tuple[StepMetrics, list[tuple[str, Exception]], frozenset[str] | None]: ...


NONFINITE = "grpo_nonfinite_values_total"


def produces(*families: str, nonfinite: tuple[str, ...] = ()) -> Callable[[Block], Block]:
    """Declare what a metric block may add: catalogue families, and the ``tensor`` labels of the non-finite
    counter it owns (several blocks share that family). The stage layout is built from these, and a block
    that raises drops exactly these samples, on every rank (see :attr:`grpo_exporter.layout.Slot.tags`)."""

    def mark(block: Block) -> Block:
        for name in families:
            catalog.metric(name)
        for tensor in nonfinite:
            catalog.metric(NONFINITE).key(tensor=tensor)
        block.families = (*families, *((NONFINITE,) if nonfinite else ()))  # type: ignore[attr-defined]
        block.tags = (*families, *(f"{NONFINITE}/{t}" for t in nonfinite))  # type: ignore[attr-defined]
        return block

    return mark


def families_of(blocks: Sequence[Block]) -> tuple[str, ...]:
    """The families a stage's blocks may produce, in block order, each once."""
    return tuple(dict.fromkeys(name for block in blocks for name in block.families))  # type: ignore[attr-defined]


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


class _Gather:
    """Collects readings keyed by catalogue sample keys, then transfers them to the host in one go."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[Entry] = []
        self.carried: dict[str, Tensor] = {}
        self.errors: list[tuple[str, Exception]] = []
        self.failed: set[str] = set()
        self.checks: list[tuple[str, Tensor]] = []

    def add(self, name: str, value: Any, suffix: str = "", **labels: str) -> None:
        key = catalog.metric(name).key(suffix, **labels)
        if isinstance(value, Element):
            self.entries.append(Entry(key, always(value.vector), value.index))
            return
        if isinstance(value, (int, float)):
            value = _scalar(value, torch.float64, self.device)
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

    def run(self, block: Block, ctx: _Context, strict: bool) -> None:
        """Run one metric block; on error drop what it added and mark its families failed (strict: re-raise)."""
        mark = len(self.entries)
        try:
            block(self, ctx)
        except Exception as exc:
            if strict:
                raise
            del self.entries[mark:]
            self.failed.update(block.tags)  # type: ignore[attr-defined]
            self.errors.append((block.__name__.lstrip("_"), exc))

    def transfer(
        self, merger: Merger | None, stage_tags: set[str]
    ) -> tuple[StepMetrics, dict[str, Tensor], frozenset[str]]:
        """The single device-to-host transfer of the step: every reading, the value checks of the inputs (a
        numeric mask holding other values than 0 and 1), with ``merger`` what the merge across ranks needs,
        and the carried vectors; then, on the host, the checks and the merge. The carried vectors stay CPU
        tensors (views of the transferred block): whoever reads them converts them, off the training thread."""
        packed_parts = _pack(self.entries)
        parts = packed_parts.parts
        width = sum(p.numel() for p in parts)
        if self.checks:
            parts.append(torch.stack([count for _, count in self.checks]))
        extra = merger.device_parts(self.entries, self.device) if merger is not None else None
        if extra is not None:
            parts.append(extra)
        listed = sum(p.numel() for p in parts)
        parts += packed_parts.histograms
        parts += [_flat(t) for t in self.carried.values()]
        parts = [p if p.device == self.device else p.to(self.device) for p in parts]
        if not any(p.dtype == torch.float64 for p in parts):  # cat promotes the parts to their widest dtype
            parts.append(torch.zeros(0, dtype=torch.float64, device=self.device))
        block = torch.cat(parts)  # every part converted to fp64 in the copy (bools, counts, fp32/bf16 values)
        host = block if block.device.type == "cpu" else block.cpu()  # the one device-to-host transfer
        packed = host[:listed].tolist()
        with _on_host_copy():
            return self._read(host, packed, packed_parts, width, listed, merger, extra, stage_tags)

    def _read(
        self, host: Tensor, packed: list[float], packed_parts: Packed, width: int, listed: int,
        merger: Merger | None, extra: Tensor | None, stage_tags: set[str],
    ) -> tuple[StepMetrics, dict[str, Tensor], frozenset[str]]:
        """After the transfer, on the host: every value (ratios divided, histograms read), the value checks,
        the merge across ranks, and the carried vectors."""
        positions = packed_parts.positions
        counted = sum(t.numel() for t in packed_parts.histograms)
        hists = HostHistograms(
            host[listed : listed + counted],
            [packed[low] for low, _ in packed_parts.extremes],
            [packed[high] for _, high in packed_parts.extremes],
        ) if counted else None
        read: dict[int, list[float] | None] = {}  # each histogram reading once, however many samples it has
        out: StepMetrics = {}
        late: list[tuple[SampleKey, Tensor]] = []  # witnessed counts whose witness saw NaN or inf
        for e, (v, p, kind) in zip(self.entries, positions, strict=True):
            if kind == HOST:
                r = e.reading
                if id(r) not in read:
                    read[id(r)] = r.read(hists, v)
                values = read[id(r)]
                if values is not None:
                    out[e.key] = values[e.index]
            elif kind == RATIO and packed[p] > 0:
                out[e.key] = packed[v] / packed[p]
            elif kind == PLAIN and packed[p]:
                out[e.key] = packed[v]
            elif kind == WITNESSED:
                if packed[v]:
                    late.append((e.key, e.reading.tensor))
                else:
                    out[e.key] = 0.0
        if late:
            out |= zip((key for key, _ in late), _counts_after_transfer([t for _, t in late]), strict=True)
        families = frozenset(catalog.family_of(sample).name for sample in {e.key.sample for e in self.entries})
        offset = width
        for name, _ in self.checks:
            if packed[offset]:
                self.errors.append(("input values", InputError(
                    name, "a bool tensor, or 0/1 values", f"{packed[offset]:g} values other than 0 and 1"
                )))
                self.failed |= stage_tags
                out, families = {}, frozenset()  # nothing computed from such a mask: every family keeps its last
            offset += 1
        if merger is not None:
            width = extra.numel() if extra is not None else 0
            out, errors, merged_families = merger.merge(packed[offset : offset + width], self.entries, out, self.failed)
            self.errors += errors
            families = merged_families if merged_families is not None else families
            offset += width
        carried = {}
        offset = listed + counted
        for name, t in self.carried.items():
            carried[name] = host[offset : offset + t.numel()]
            offset += t.numel()
        return out, carried, families


def compute_step(inputs: StepInputs, config: MetricsConfig) -> StepMetrics:
    """Every metric the given inputs allow, as ``{sample key: float}``, with one host transfer.

    Raises :class:`~grpo_exporter.inputs.InputError` for grouping that contradicts the config (N not a
    multiple of ``group_size`` without ``group_ids``), and any error of a metric block (strict).
    """
    return compute_step_carrying(inputs, config, {}, strict=True).metrics


class StepResult(NamedTuple):
    """What one computation produced: values of present metrics, carried vectors, the errors of metric
    blocks (non-strict), and every family computed on this rank, present or absent (what the publication
    replaces; a family that failed keeps describing its last computation)."""

    metrics: StepMetrics
    carried: dict[str, Tensor]
    errors: list[tuple[str, Exception]]
    families: frozenset[str]


def compute_step_carrying(
    inputs: StepInputs,
    config: MetricsConfig,
    carry: dict[str, Tensor],
    strict: bool = True,
    merger: Merger | None = None,
    blocks: tuple[Block, ...] | None = None,
    failed_inputs: bool = False,
) -> StepResult:
    """:func:`compute_step`, plus device vectors ``carry`` brought to the host in the same single transfer
    (the monitor carries its solve-rate moment terms and the edit-distance rows this way).

    Each metric block runs on its own: with ``strict=False`` a block that raises is dropped whole and
    returned in the error list, and every other block is still computed and transferred. ``merger`` merges
    the readings across ranks after the transfer (see :mod:`grpo_exporter.distributed`). ``blocks`` limits
    the computation to one stage (``ROLLOUT_BLOCKS``, ``UPDATE_BLOCKS``), so a tensor handed to both observe
    calls never counts a rollout-level quantity twice. ``failed_inputs``: some of this rank's inputs were
    rejected; the rank still takes part in the merge (so the ranks' collectives stay in step) with every
    family of the stage marked failed, hence absent on every rank; alone, a rank publishes what it has.
    """
    g = _Gather(inputs.device)
    g.carried = dict(carry)
    stage = BLOCKS if blocks is None else blocks
    tags = {tag for block in stage for tag in block.tags}  # type: ignore[attr-defined]
    if failed_inputs:
        g.failed |= tags
    g.checks = list(inputs.value_errors)
    with torch.inference_mode():
        ctx = _Context(inputs, config)
        # an empty batch: nothing to measure and no error; its families keep their last values, and merged
        # across ranks this rank adds nothing to the others' union
        for block in stage if not inputs.empty else ():
            g.run(block, ctx, strict)
        metrics, carried, families = g.transfer(merger, tags)
    if strict and g.errors:
        raise g.errors[0][1]
    return StepResult(metrics, carried, g.errors, families)


class _Context:
    """The step's inputs, config, groups, and what several blocks read, computed once: each token input on
    the loss mask (fp32, 0 elsewhere), the loss tokens per row, the log ratio."""

    def __init__(self, x: StepInputs, cfg: MetricsConfig) -> None:
        self.x, self.cfg = x, cfg
        self._masked: dict[str, Tensor] = {}
        self._nonfinite: dict[int, tuple[Tensor, Tensor]] = {}
        self._scratch: Tensor | None = None
        self.lr = None
        if x.loss_mask is not None and x.logprobs is not None and x.old_logprobs is not None:
            difference = self.masked("logprobs") - self.masked("old_logprobs")
            self.lr = gradient.log_ratio_of(difference, x.loss_mask, cfg.log_ratio_clamp)

    @functools.cached_property
    def keep(self) -> Tensor:
        """The loss mask as int32 words (:func:`~grpo_exporter.functional.reading.keep_bits`), built once."""
        assert self.x.loss_mask is not None  # read by blocks that need the loss mask only
        return keep_bits(self.x.loss_mask)

    def masked(self, name: str) -> Tensor:
        """Input ``name`` on the loss mask in fp32, 0 elsewhere (padding never enters arithmetic)."""
        if name not in self._masked:
            self._masked[name] = zeroed(getattr(self.x, name), self.keep)
        return self._masked[name]

    @functools.cached_property
    def row_tokens(self) -> Tensor:
        """(N,) loss tokens per row."""
        assert self.x.loss_mask is not None
        return count(self.x.loss_mask, dim=1)

    @functools.cached_property
    def tokens(self) -> Tensor:
        """The loss tokens (0-d)."""
        return self.row_tokens.sum()

    def nonfinite(self, t: Tensor) -> Tensor:
        """NaN / +-inf entries of ``t`` (0-d int64), counted once per tensor of the step (the non-finite input
        counters and the metrics that skip those tokens share the count). The counts of a stage's token
        tensors share one scratch tensor: it stays in cache, where a fresh one per count would not."""
        if id(t) not in self._nonfinite:
            scratch = None
            if t.dtype == torch.float32 and t.numel() >= SMALL:
                if self._scratch is None or self._scratch.shape != t.shape or self._scratch.device != t.device:
                    self._scratch = torch.empty_like(t, memory_format=torch.contiguous_format)
                scratch = self._scratch
            self._nonfinite[id(t)] = (t, count_nonfinite(t, scratch))  # the tensor is kept: its id stays its own
        return self._nonfinite[id(t)][1]

    @functools.cached_property
    def finite_ratio_tokens(self) -> Tensor:
        """The loss tokens with a finite log ratio (0-d int64): ``lr.valid`` counted (its bools read in a
        quarter of the bytes a non-finite count of the log ratio would)."""
        assert self.lr is not None
        return count(self.lr.valid)

    @functools.cached_property
    def weights_lr(self) -> gradient.LogRatio:
        """The log ratio the loss weights by: the token log ratio, or GSPO's sequence-level one on each loss
        token (``ratio_level="sequence"``); the importance weights, the ESS and the clip counts read it."""
        assert self.lr is not None
        if self.cfg.ratio_level == "sequence":
            return gradient.sequence_log_ratio(self.lr, self.row_tokens)
        return self.lr

    @functools.cached_property
    def weight_tokens(self) -> Tensor:
        """The loss tokens with a finite weight (0-d int64): :attr:`finite_ratio_tokens` at token level."""
        return self.finite_ratio_tokens if self.weights_lr is self.lr else count(self.weights_lr.valid)

    @functools.cached_property
    def signs(self) -> samples.SignedRows:
        """The loss tokens (or rows) with a finite advantage, by sign: the token counts and the clip counts
        both read them. Only where ``advantages`` and ``loss_mask`` were given."""
        assert self.x.advantages is not None
        assert self.x.loss_mask is not None
        return samples.advantage_signs(self.x.advantages, self.x.loss_mask, self.cfg.zero_advantage_atol)

    @functools.cached_property
    def positions(self) -> Tensor | None:
        """(N, T) completion positions: ``completion_mask``, else t < ``completion_lengths`` (built once)."""
        x = self.x
        if x.completion_mask is not None:
            return x.completion_mask
        width = next((t.shape[1] for t in (x.loss_mask, x.completion_ids) if t is not None), None)
        if x.completion_lengths is None or width is None:
            return None
        return gradient.completion_positions(x.completion_lengths, width)

    @functools.cached_property
    def groups(self) -> Groups | None:
        """The prompt groups; a grouping error raises here, in the blocks that need groups, and only there."""
        return self.x.groups(self.cfg.group_size)

    def _difference(self, a: str, b: str) -> Tensor | None:
        """Input ``a`` minus input ``b`` on the loss mask (fp32, 0 elsewhere), when both and the mask are given."""
        x = self.x
        if x.loss_mask is None or getattr(x, a) is None or getattr(x, b) is None:
            return None
        return self.masked(a) - self.masked(b)

    @functools.cached_property
    def gap_difference(self) -> Tensor | None:
        """rollout_logprobs - old_logprobs on the loss mask (the engine gap's)."""
        return self._difference("rollout_logprobs", "old_logprobs")

    @functools.cached_property
    def gap_tokens(self) -> Tensor:
        """The loss tokens where the engine gap's difference is finite (0-d): the gap's and the mismatch's count."""
        assert self.gap_difference is not None
        return self.tokens - self.nonfinite(self.gap_difference)

    @functools.cached_property
    def kl_difference(self) -> Tensor | None:
        """ref_logprobs - logprobs on the loss mask (the KL's)."""
        return self._difference("ref_logprobs", "logprobs")

    @functools.cached_property
    def witnesses(self) -> dict[str, Tensor]:
        """Per token input, the non-finite count of a difference it entered, which the step takes anyway (the
        log ratio, the engine gap, the KL's ref - logprobs): non-finite wherever the input is (NaN or inf in
        either side of a difference leaves NaN or inf), so 0 there means 0 in the input (:class:`Witnessed`)."""
        out: dict[str, Tensor] = {}
        if self.lr is not None:
            out["logprobs"] = out["old_logprobs"] = self.tokens - self.finite_ratio_tokens
        if self.gap_difference is not None:
            out["rollout_logprobs"] = self.nonfinite(self.gap_difference)
            if self.cfg.rollout_logprob_nan == "nonfinite":  # unscored NaN would make it a witness of nothing
                out.setdefault("old_logprobs", out["rollout_logprobs"])
        if self.kl_difference is not None:
            out["ref_logprobs"] = self.nonfinite(self.kl_difference)
            out.setdefault("logprobs", out["ref_logprobs"])
        return out


# ---- layer 1 ----------------------------------------------------------------------------------------------


@produces("grpo_rollout_unscored_tokens_total",
          nonfinite=("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy", "advantages",
                     "rewards", "reward_components", "loss"))
def _nonfinite_inputs(g: _Gather, c: _Context) -> None:
    x, mask = c.x, c.x.loss_mask
    if mask is not None:
        witnesses = c.witnesses
        for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy"):
            if getattr(x, name) is None:
                continue
            masked, witness = c.masked(name), witnesses.get(name)  # 0 off the mask: counted over the whole tensor
            if name == "rollout_logprobs" and c.cfg.rollout_logprob_nan == "unscored":
                g.add("grpo_nonfinite_values_total", count(torch.isinf(masked)), tensor=name)
                g.add("grpo_rollout_unscored_tokens_total", count(torch.isnan(masked)))
                continue
            tally = c.nonfinite(masked) if witness is None else Witnessed(masked, witness)
            g.add("grpo_nonfinite_values_total", tally, tensor=name)
    if x.advantages is not None and (x.advantages.dim() == 1 or mask is not None):
        adv_mask = None if x.advantages.dim() == 1 else mask
        g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.advantages, adv_mask), tensor="advantages")
    if x.rewards is not None:
        g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.rewards), tensor="rewards")
    if x.reward_components:
        bad = sum(gradient.nonfinite_count(v) for v in x.reward_components.values())
        g.add("grpo_nonfinite_values_total", bad, tensor="reward_components")
    if isinstance(x.loss, Tensor):
        g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.loss), tensor="loss")
    elif x.loss is not None:
        g.add("grpo_nonfinite_values_total", 0.0 if math.isfinite(x.loss) else 1.0, tensor="loss")


@produces("grpo_engine_logprob_gap_nats", "grpo_token_engine_logprob_gap_nats", "grpo_engine_logprob_gap_mean_nats")
def _engine_gap(g: _Gather, c: _Context) -> None:
    x, cfg = c.x, c.cfg
    difference = c.gap_difference
    if difference is not None:
        assert x.loss_mask is not None  # a gap difference exists on a loss mask only
        gap = gradient.engine_gap_of(difference, x.loss_mask, c.gap_tokens, cfg.gap_quantiles)
        g.summary("grpo_engine_logprob_gap_nats", gap.total, gap.count, gap.quantiles, cfg.gap_quantiles)
        g.histogram("grpo_token_engine_logprob_gap_nats", gap.quantiles, gap.total)
        g.add("grpo_engine_logprob_gap_mean_nats", gap.mean)


@produces(
    "grpo_mismatch_kl_nats", "grpo_mismatch_chi_square", "grpo_mismatch_log_ppl_diff_nats",
    "grpo_mismatch_ppl_multiple", "grpo_rollout_correction_weight", "grpo_token_rollout_correction_weight",
    "grpo_sequence_rollout_correction_weight", "grpo_rollout_correction_capped_tokens_total",
    "grpo_rollout_correction_capped_sequences_total", "grpo_rollout_correction_capped_ratio",
)
def _engine_mismatch(g: _Gather, c: _Context) -> None:
    """What tells engine noise from a systematic engine fault (:mod:`grpo_exporter.functional.mismatch`)."""
    x, cfg = c.x, c.cfg
    difference = c.gap_difference
    if difference is None:
        return
    qs = cfg.quantiles_of("grpo_rollout_correction_weight")
    tokens = c.gap_tokens
    assert x.loss_mask is not None
    m = mismatch.mismatch_of(difference, x.loss_mask, tokens, cfg.rollout_correction_cap, qs)
    g.add("grpo_mismatch_kl_nats", m.k1, estimator="k1")
    g.add("grpo_mismatch_kl_nats", m.k3, estimator="k3")
    g.add("grpo_mismatch_chi_square", m.chi2_token, level="token")
    g.add("grpo_mismatch_chi_square", m.chi2_sequence, level="sequence")
    g.add("grpo_mismatch_log_ppl_diff_nats", m.log_ppl_diff)
    g.add("grpo_mismatch_ppl_multiple", m.ppl_multiple)
    g.summary("grpo_rollout_correction_weight", m.token_weight_sum, tokens, m.token_weights, qs)
    g.histogram("grpo_token_rollout_correction_weight", m.token_weights, m.token_weight_sum)
    g.histogram("grpo_sequence_rollout_correction_weight", m.sequence_weights, m.sequence_weight_sum)
    if m.capped_tokens is not None and m.capped_sequences is not None:
        g.add("grpo_rollout_correction_capped_tokens_total", m.capped_tokens)
        g.add("grpo_rollout_correction_capped_sequences_total", m.capped_sequences)
        g.add("grpo_rollout_correction_capped_ratio", m.capped_token_share, level="token")
        g.add("grpo_rollout_correction_capped_ratio", m.capped_sequence_share, level="sequence")


@produces(
    "grpo_onpolicy_outside_clip_tokens_total",
    "grpo_onpolicy_checked_tokens_total",
    "grpo_onpolicy_outside_clip_ratio",
    "grpo_onpolicy_log_ratio_abs_max_nats",
    "grpo_log_ratio_clamp_hit_tokens_total",
    "grpo_log_ratio_clamp_hit_ratio",
    nonfinite=("log_ratio", "ratio"),
)
def _log_ratio_checks(g: _Gather, c: _Context) -> None:
    lr, cfg = c.lr, c.cfg
    if lr is None:
        return
    # off the loss mask the log ratio is 0 and the ratio 1: the log ratio's non-finite values are the loss tokens
    # it leaves out of ``valid``; the ratio is exp(log ratio) in fp32 without clamp: its count also holds the
    # tokens that would overflow where exp comes before the clamp (seed 4.2)
    g.add("grpo_nonfinite_values_total", c.tokens - c.finite_ratio_tokens, tensor="log_ratio")
    g.add("grpo_nonfinite_values_total", c.nonfinite(lr.ratio), tensor="ratio")
    rows = c.x.on_policy
    if rows is True or isinstance(rows, Tensor):
        check = gradient.onpolicy_check(lr, *cfg.onpolicy_eps, None if rows is True else rows)
        g.add("grpo_onpolicy_outside_clip_tokens_total", check.outside)
        g.add("grpo_onpolicy_checked_tokens_total", check.checked)
        g.add("grpo_onpolicy_outside_clip_ratio", check.outside_ratio)
        g.add("grpo_onpolicy_log_ratio_abs_max_nats", check.abs_log_ratio_max)
    if cfg.log_ratio_clamp is not None:
        hits = gradient.clamp_hits(lr, cfg.log_ratio_clamp, c.row_tokens.sum())
        g.add("grpo_log_ratio_clamp_hit_tokens_total", hits.hits)
        g.add("grpo_log_ratio_clamp_hit_ratio", hits.hit_ratio)


@produces(
    "grpo_loss_mask_length_mismatch_sequences_total",
    "grpo_loss_mask_empty_sequences_total",
    "grpo_loss_mask_outside_completion_tokens_total",
)
def _mask_audit(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.loss_mask is not None and x.completion_lengths is not None:
        audit = gradient.mask_audit(x.loss_mask, x.completion_lengths, x.completion_mask, c.row_tokens, c.positions)
        g.add("grpo_loss_mask_length_mismatch_sequences_total", audit.length_mismatch)
        g.add("grpo_loss_mask_empty_sequences_total", audit.empty)
        g.add("grpo_loss_mask_outside_completion_tokens_total", audit.outside_completion)


@produces("grpo_kl_ref_nats")
def _kl(g: _Gather, c: _Context) -> None:
    d = c.kl_difference
    if d is not None:
        g.add("grpo_kl_ref_nats", gradient.kl_k3_of(d, c.tokens - c.nonfinite(d)))


@produces(
    "grpo_optimizer_steps_total",
    "grpo_grad_norm_pre_clip",
    "grpo_grad_norm_post_clip",
    "grpo_grad_clip_active_steps_total",
    nonfinite=("grad_norm",),
)
def _grad_norms(g: _Gather, c: _Context) -> None:
    x = c.x
    pre = x.grad_norm_pre_clip
    if pre is None and x.grads is not None:
        pre = gradient.total_norm(x.grads)
    if pre is None:
        return
    pre_t = _scalar(pre, torch.float32, g.device)
    g.add("grpo_nonfinite_values_total", count_nonfinite(pre_t), tensor="grad_norm")
    g.add("grpo_optimizer_steps_total", 1.0)
    g.add("grpo_grad_norm_pre_clip", pre_t)
    post = x.grad_norm_post_clip
    if post is None and x.max_grad_norm is not None:
        post = gradient.clipped_norm(pre_t, x.max_grad_norm)
    if post is not None:
        g.add("grpo_grad_norm_post_clip", _scalar(post, torch.float32, g.device))
    limit = x.max_grad_norm
    if limit is not None:
        above = pre_t > (limit.to(g.device) if isinstance(limit, Tensor) else float(limit))
        g.add("grpo_grad_clip_active_steps_total", above.to(torch.int64))


@produces("grpo_param_relative_update", "grpo_rollout_staleness_versions")
def _update_size(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.params_before is not None and x.params_after is not None:
        g.add("grpo_param_relative_update", gradient.relative_update(x.params_before, x.params_after))
    if x.policy_version is not None and x.rollout_policy_version is not None:
        g.add("grpo_rollout_staleness_versions", float(x.policy_version - x.rollout_policy_version))


# ---- layer 2 ----------------------------------------------------------------------------------------------


@produces("grpo_completions_total")
def _completions(g: _Gather, c: _Context) -> None:
    if c.x.rewards is not None:
        g.add("grpo_completions_total", float(c.x.rewards.shape[0]))


@produces("grpo_reward_mean", "grpo_reward_group_std_mean", "grpo_reward_group_range_mean")
def _rewards(g: _Gather, c: _Context) -> None:
    x, groups = c.x, c.groups
    if groups is None or (x.rewards is None and not x.reward_components):
        return
    named = {"total": x.rewards} if x.rewards is not None else {}
    named.update(x.reward_components)
    for component, values in named.items():
        stats = reward.reward_stats(values, groups)
        g.add("grpo_reward_mean", stats.mean, component=component)
        g.add("grpo_reward_group_std_mean", stats.group_std_mean, component=component)
        g.add("grpo_reward_group_range_mean", stats.group_range_mean, component=component)


@produces("grpo_advantage_abs_max", "grpo_advantage_over_bound_sequences_total", "grpo_advantage_bound")
def _advantages(g: _Gather, c: _Context) -> None:
    x, groups, cfg = c.x, c.groups, c.cfg
    if x.advantages is None or groups is None:
        return
    bounds = advantage_bounds(x.rewards, groups, cfg.advantage_norm, cfg.group_size)
    check = reward.advantage_check(x.advantages, x.loss_mask, groups, bounds, cfg.advantage_bound_rtol)
    g.add("grpo_advantage_abs_max", check.abs_max)
    g.add("grpo_advantage_over_bound_sequences_total", check.over_bound)
    known = (groups.sizes() > 0) & torch.isfinite(bounds)
    g.add("grpo_advantage_bound", reading(largest(torch.where(known, bounds, 0.0), 0.0), known.any()))


@produces("grpo_completion_length_tokens", "grpo_completion_length_distribution_tokens",
          "grpo_truncated_completions_total")
def _lengths(g: _Gather, c: _Context) -> None:
    x, qs = c.x, c.cfg.length_quantiles
    if x.completion_lengths is not None:
        outcomes = {"all": torch.ones_like(x.completion_lengths, dtype=torch.bool)}
        if x.correct is not None:
            outcomes |= {"correct": x.correct, "incorrect": ~x.correct}
        stats = reward.length_stats(x.completion_lengths, list(outcomes.values()), qs)
        for i, outcome in enumerate(outcomes):
            total = Element(stats.totals, i)
            g.summary("grpo_completion_length_tokens", total, Element(stats.counts, i), stats.quantiles[i], qs,
                      outcome=outcome)
            g.histogram("grpo_completion_length_distribution_tokens", stats.quantiles[i], total, outcome=outcome)
    if x.truncated is not None:
        g.add("grpo_truncated_completions_total", x.truncated.sum())


# ---- layer 3 ----------------------------------------------------------------------------------------------


@produces("grpo_update_tokens_total", "grpo_zero_advantage_tokens_ratio")
def _advantage_signs(g: _Gather, c: _Context) -> None:
    mask, advantages = c.x.loss_mask, c.x.advantages
    if mask is None or advantages is None:
        return
    signs = samples.advantage_sign_tokens(advantages, mask, c.row_tokens, c.signs)
    for sign, value in zip(catalog.ADVANTAGE_SIGNS, signs, strict=True):
        g.add("grpo_update_tokens_total", value, advantage_sign=sign)
    total = signs.positive + signs.negative + signs.zero
    g.add("grpo_zero_advantage_tokens_ratio", fraction(signs.zero, total))


@produces("grpo_ess_ratio", "grpo_importance_weight", "grpo_token_importance_weight")
def _importance_weights(g: _Gather, c: _Context) -> None:
    if c.lr is None:
        return
    lr, qs, tokens = c.weights_lr, c.cfg.ratio_quantiles, c.weight_tokens
    weights = samples.importance_weights(lr, qs, tokens)
    ess = samples.ess_ratio(lr, tokens, weights.quantiles.stack.maximum, geometric=c.cfg.ratio_level == "sequence")
    g.add("grpo_ess_ratio", ess.token, level="token")
    g.add("grpo_ess_ratio", ess.sequence, level="sequence")
    g.summary("grpo_importance_weight", weights.total, weights.count, weights.quantiles, qs)
    g.histogram("grpo_token_importance_weight", weights.quantiles, weights.total)


@produces(
    "grpo_clipped_tokens_total",
    "grpo_out_of_range_unclipped_tokens_total",
    "grpo_clipped_tokens_ratio",
    "grpo_upper_clip_reachable_tokens_total",
)
def _clipping(g: _Gather, c: _Context) -> None:
    """The clip counts of the loss's own clip: PPO's two bounds, a cap's upper one only (CISPO), none without a
    hard clip (SAPO, VESPO); of the sequence-level ratio under GSPO, whose reach is judged by each row's mean
    old log-prob."""
    cfg = c.cfg
    if c.lr is None or c.x.advantages is None or c.x.old_logprobs is None or cfg.clip == "none":
        return
    old = c.masked("old_logprobs")
    if cfg.ratio_level == "sequence":
        mean_old = old.sum(1) / c.row_tokens.clamp(min=1)
        old = zeroed(mean_old.unsqueeze(1).expand_as(old), c.keep)
    cap = cfg.ratio_cap if cfg.clip == "cap" else None
    clip = samples.clip_counts(c.weights_lr, c.x.advantages, old, cfg.clip_eps_low, cfg.clip_eps_high,
                               c.row_tokens, old_masked=True, signs=c.signs, cap=cap)
    g.add("grpo_upper_clip_reachable_tokens_total", clip.reachable)
    g.add("grpo_clipped_tokens_total", clip.upper, bound="upper")
    g.add("grpo_out_of_range_unclipped_tokens_total", clip.upper_unclipped, bound="upper")
    g.add("grpo_clipped_tokens_ratio", clip.upper_ratio, bound="upper")
    if cap is None:
        g.add("grpo_clipped_tokens_total", clip.lower, bound="lower")
        g.add("grpo_out_of_range_unclipped_tokens_total", clip.lower_unclipped, bound="lower")
        g.add("grpo_clipped_tokens_ratio", clip.lower_ratio, bound="lower")


@produces(
    "grpo_groups_total",
    "grpo_zero_variance_groups_total",
    "grpo_zero_variance_groups_ratio",
    "grpo_zero_variance_groups_expected_ratio",
    "grpo_all_incorrect_groups_expected_ratio",
)
def _zero_variance(g: _Gather, c: _Context) -> None:
    x, groups = c.x, c.groups
    if groups is None:
        return
    if x.rewards is not None:
        zv = samples.zero_variance_groups(x.rewards, groups, x.correct)
        g.add("grpo_groups_total", zv.groups)
        g.add("grpo_zero_variance_groups_total", zv.all_correct, outcome="all_correct")
        g.add("grpo_zero_variance_groups_total", zv.all_incorrect, outcome="all_incorrect")
        g.add("grpo_zero_variance_groups_total", zv.unknown, outcome="unknown")
        g.add("grpo_zero_variance_groups_ratio", zv.share)
    if x.zero_variance_prob is not None:
        expected = samples.expected_zero_variance_ratio(x.zero_variance_prob, groups)
        g.add("grpo_zero_variance_groups_expected_ratio", expected)
    if x.all_incorrect_prob is not None:
        g.add("grpo_all_incorrect_groups_expected_ratio", samples.expected_zero_variance_ratio(x.all_incorrect_prob,
                                                                                             groups))


@produces("grpo_mixed_group_solve_rate_ratio")
def _solve_rates(g: _Gather, c: _Context) -> None:
    x, groups, buckets = c.x, c.groups, c.cfg.solve_rate_buckets
    if x.correct is None or groups is None:
        return
    hist = samples.mixed_group_solve_rates(x.correct, groups, buckets)
    name = "grpo_mixed_group_solve_rate_ratio"
    for i, bound in enumerate((*buckets, math.inf)):
        le = "+Inf" if bound == math.inf else format_quantile(bound)
        g.add(name, Element(hist.cumulative, i), "_bucket", le=le)
    g.add(name, hist.total, "_sum")
    g.add(name, hist.count, "_count")


# ---- layer 4 ----------------------------------------------------------------------------------------------


@produces("grpo_entropy_mean_nats", "grpo_entropy_top_mean_nats", "grpo_token_entropy_nats")
def _entropy(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.loss_mask is not None and x.entropy is not None:
        masked = c.masked("entropy")
        ent = diversity.entropy_stats(masked, c.tokens - c.nonfinite(masked), c.cfg.entropy_top_fraction)
        g.add("grpo_entropy_mean_nats", ent.mean)
        g.add("grpo_entropy_top_mean_nats", ent.top_mean)
        g.histogram("grpo_token_entropy_nats", ent.top_mean, ent.mean.numerator)
    elif x.entropy is None and x.entropy_mean is not None:  # a framework's own token mean (verl, OpenRLHF)
        mean = _scalar(x.entropy_mean, torch.float64, g.device)
        ok = torch.isfinite(mean)  # a non-finite report is absent, never published
        g.add("grpo_entropy_mean_nats", fraction(torch.where(ok, mean, 0.0), ok.double()))


@produces("grpo_pass_at_k_ratio")
def _pass_at_k(g: _Gather, c: _Context) -> None:
    if c.x.correct is not None and c.groups is not None:
        ks = c.cfg.pass_ks
        g.each("grpo_pass_at_k_ratio", diversity.pass_at_ks(c.x.correct, c.groups, ks), "k", [str(k) for k in ks])


@produces("grpo_unique_completions_ratio")
def _distinct_completions(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.completion_ids is None or c.groups is None:
        return
    positions = c.positions
    if positions is not None:
        ratio = diversity.unique_completion_ratio(x.completion_ids, positions, c.groups)
        g.add("grpo_unique_completions_ratio", ratio)


Block = Callable[[_Gather, _Context], None]

# Rollout-level metrics: once per rollout batch (groups, rewards, outcomes, lengths, engine vs trainer).
ROLLOUT_BLOCKS: tuple[Block, ...] = (
    _nonfinite_inputs,
    _engine_gap,
    _engine_mismatch,
    _mask_audit,
    _completions,
    _rewards,
    _lengths,
    _zero_variance,
    _solve_rates,
    _pass_at_k,
    _distinct_completions,
)
# Update-level metrics: per optimizer step (the ratio, the loss mask actually trained on, advantages, grads).
UPDATE_BLOCKS: tuple[Block, ...] = (
    _nonfinite_inputs,
    _log_ratio_checks,
    _mask_audit,
    _kl,
    _grad_norms,
    _update_size,
    _advantages,
    _advantage_signs,
    _importance_weights,
    _clipping,
    _entropy,
)
# the audit runs where the loss mask and completion lengths meet: the update's mask, else the rollout's
MASK_AUDIT_FAMILIES: tuple[str, ...] = _mask_audit.families  # type: ignore[attr-defined]
BLOCKS: tuple[Block, ...] = (*ROLLOUT_BLOCKS, *(b for b in UPDATE_BLOCKS if b not in ROLLOUT_BLOCKS))
