"""Distributions in one pass: a fine log-bucket histogram of fp32 values, read back as quantiles, top-fraction
means and classic Prometheus buckets.

The bit pattern of a non-negative fp32 value, read as an integer, grows with the value; its top bits (the
exponent and the first ``MANTISSA_BITS`` = 7 mantissa bits) name a bucket of relative width 2^-7. So the
bucket of a value is a shift of its bits: no log, no search, one ``bincount`` (the HDR-histogram idea). Buckets
are half-open from below, (lower, upper], so a classic bucket ``le=b`` counts values <= b exactly:

* bucket 0 holds [0, 2^-32] (and negatives, which no distribution here has);
* bucket i in 1..8192 holds (e_{i-1}, e_i] with e_i = 2^-32 (1 + k/128) 2^m, i = 128 m + k: 64 octaves;
* bucket 8193 holds (2^32, +inf].

Read back at the middle of its bucket (bucket 0 at 0), every order statistic of a value in (2^-32, 2^32] is
within relative error 2^-8 (0.39%) of the exact one, and within 2^-32 absolutely below that; the minimum and
maximum are kept exactly beside the counts, and readings are clamped into [min, max] (a value above 2^32 reads
as the maximum). Counts of several ranks merge by a plain sum, so a merged quantile is exactly the one of the
concatenated batch's histogram: the merge loses nothing the single process had.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.constants import cached_constant
from grpo_exporter.functional.reading import count, f32_bits, filled, keep_bits, largest, smallest, zeroed

MANTISSA_BITS = 7
_SHIFT = 23 - MANTISSA_BITS
LOW_EXPONENT, HIGH_EXPONENT = -32, 32
_FIRST = (127 + LOW_EXPONENT) << MANTISSA_BITS  # bit-key of the edge 2^-32
BUCKETS = ((HIGH_EXPONENT - LOW_EXPONENT) << MANTISSA_BITS) + 2  # 8194: [0, 2^-32], 8192 fine, (2^32, inf]
_TOP = BUCKETS - 1
RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)
ABSOLUTE_FLOOR = 2.0**LOW_EXPONENT


class Histogram(NamedTuple):
    """The fine histogram of one masked sample of non-negative values: (BUCKETS,) int64 counts and the exact min
    and max (0-d fp32; +inf and 0 when the sample is empty, so that they merge by min and max). A stack of k
    histograms has (k, BUCKETS) counts and (k,) extremes; every reading below takes either."""

    counts: Tensor
    minimum: Tensor
    maximum: Tensor


def histogram(
    x: Tensor,
    valid: Tensor | None,
    exact_min: bool = True,
    bits: Tensor | None = None,
    kept: Tensor | None = None,
    valid_count: Tensor | None = None,
) -> Histogram:
    """The fine histogram of non-negative ``x`` over ``valid`` positions (any shape, same shape as ``valid``).

    The values on ``valid`` (+0.0 elsewhere: those land in bucket 0 and are taken out of it by their count) go
    through a few passes of integer ops on their bits and one ``bincount``; their max is the histogram's (x >= 0,
    so the zeros elsewhere never exceed it). ``valid`` must exclude NaN (callers pass loss mask and finiteness;
    +inf is a valid value and lands in the top bucket). ``exact_min=False`` saves the passes of the minimum where
    no reading needs it (no q = 0): it is then 0, a lower bound of these non-negative distributions, and
    readings are clamped at 0 below. What the caller already has is not taken again: ``bits``
    (:func:`~grpo_exporter.functional.reading.keep_bits` of ``valid``), ``kept`` (``zeroed(x, bits)``) and
    ``valid_count`` (valid positions); with both of the last two and no exact minimum, ``valid`` is not read and
    may be None."""
    values = x if x.dtype == torch.float32 else x.float()
    if kept is None or exact_min:
        assert valid is not None
        valid = valid.expand(values.shape)
        bits = keep_bits(valid) if bits is None else bits
    if kept is None:
        assert bits is not None
        kept = zeroed(values, bits)
    if valid_count is None:
        assert valid is not None
        valid_count = count(valid)
    counts = _banked_counts(kept)
    counts[:1].sub_(kept.numel() - valid_count)  # every position off ``valid`` was counted in bucket 0
    if exact_min:
        assert bits is not None
        lowest = smallest(filled(values, bits, math.inf), math.inf)
    else:
        lowest = _zero(values.device)
    # non-negative fp32 values order as their bits do: an integer max, without the float kernel's NaN checks
    return Histogram(counts, lowest, largest(kept.view(torch.int32), 0).view(torch.float32))


def histograms(x: Tensor, members: Tensor) -> Histogram:
    """k fine histograms of one (N,) sample at once, one per row of ``members`` (k, N) bool (subsets of the
    sample, e.g. completion lengths by outcome): the bucket keys are taken once and counted by one
    ``bincount`` over k x BUCKETS bins. ``x`` must be non-negative and finite where a member."""
    k = members.shape[0]
    values = x.float().contiguous()
    rows = _row_offsets(k, values.device).unsqueeze(1)
    keys = torch.where(members, _bucket_keys(values).unsqueeze(0) + rows, k * BUCKETS)
    counts = torch.bincount(keys.flatten(), minlength=k * BUCKETS + 1)[: k * BUCKETS].view(k, BUCKETS)
    lowest = torch.where(members, values, math.inf).amin(dim=1)
    highest = torch.where(members, values, 0.0).amax(dim=1)
    return Histogram(counts, lowest, highest)


def _bucket_keys(values: Tensor, offsets: Tensor | None = None) -> Tensor:
    """int32 bucket of each fp32 value: a shift of its bits, clamped first (negatives and -0.0, whose bits are
    negative integers, go to bucket 0; NaN to the top one). ``offsets``: the bits to subtract instead of the key
    offset (:func:`_bank_offsets`: the bank folded into the same subtraction)."""
    bits = values.view(torch.int32).clamp(_LOW_BITS, _HIGH_BITS)
    return bits.sub_(_KEY_OFFSET if offsets is None else offsets).bitwise_right_shift_(_SHIFT)


def _banked_counts(values: Tensor) -> Tensor:
    """(BUCKETS,) int64 counts of the fp32 ``values`` (any shape), by one ``bincount``
    into :data:`BANKS` interleaved copies of the buckets, summed after. Neighbouring positions count into
    different banks: on the CPU ``bincount`` is a serial loop of increments, and a run of equal buckets (the
    padding's zeros, ratios near 1) makes each increment wait for the last one (docs/benchmarks.md,
    implementation choices). The bank is folded into the subtraction the keys take anyway: three passes over the bits
    (clamp, subtract, shift) and the count."""
    values = values.reshape(1) if values.dim() == 0 else values
    keys = _bucket_keys(values, _bank_offsets(values.shape[-1], values.device))
    return torch.bincount(keys.flatten(), minlength=BANKS * BUCKETS).view(BANKS, BUCKETS).sum(0)


BANKS = 3  # the largest count whose bank offsets keep every key's bits below 2^31
_KEY_OFFSET = 1 + ((_FIRST - 1) << _SHIFT)  # buckets are (lower, upper]: the upper edge's bits belong below
_LOW_BITS = _FIRST << _SHIFT  # the bits of 2^-32: at or below them, bucket 0
_HIGH_BITS = _KEY_OFFSET + (_TOP << _SHIFT)  # bits of the top bucket: every larger value (and NaN) lands there
assert _HIGH_BITS - _KEY_OFFSET + ((BANKS - 1) * BUCKETS << _SHIFT) < 2**31


@cached_constant(maxsize=16)
def _bank_offsets(width: int, device: torch.device) -> Tensor:
    """(width,) int32: the key offset less each position's bank (position mod :data:`BANKS`) shifted into the
    bits, so that one subtraction and the shift give bucket + bank x BUCKETS (the ``offsets`` of
    :func:`_bucket_keys`)."""
    bank = torch.arange(width, dtype=torch.int32, device=device) % BANKS
    return _KEY_OFFSET - bank * (BUCKETS << _SHIFT)


@cached_constant(maxsize=16)
def _row_offsets(k: int, device: torch.device) -> Tensor:
    return torch.arange(k, device=device, dtype=torch.int32) * BUCKETS


@cached_constant(maxsize=8)
def _zero(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


def _upper_edges() -> Tensor:
    """(BUCKETS,) fp64 upper edge of each bucket (the top one +inf), on the CPU."""
    bits = (torch.arange(BUCKETS - 1, dtype=torch.int64) + _FIRST) << _SHIFT
    edges = bits.to(torch.int32).view(torch.float32).double()
    return torch.cat([edges, torch.tensor([math.inf], dtype=torch.float64)])


@cached_constant(maxsize=8)
def _midpoints(device: torch.device) -> Tensor:
    upper = _upper_edges()
    lower = torch.cat([torch.zeros(1, dtype=torch.float64), upper[:-1]])
    middle = (lower + upper) / 2
    middle[0] = 0.0  # [0, 2^-32] reads as 0 (or the minimum): an engine gap of exact zeros reads 0
    middle[-1] = math.inf  # the top bucket reads as the maximum (after the clamp)
    return middle.to(device)


def edge_index(bound: float) -> int:
    """The bucket whose upper edge is ``bound``; ``ValueError`` when ``bound`` is not an edge (a float in
    (2^-32, 2^32] with at most 7 mantissa bits, e.g. 0.75, 1.0078125, 3e-3 is not one)."""
    if not ABSOLUTE_FLOOR <= bound <= 2.0**HIGH_EXPONENT:
        raise ValueError(f"bucket bound {bound!r}: expected a value in [2^-32, 2^32]")
    bits = f32_bits(bound)
    if _f32(bits) != bound or bits & ((1 << _SHIFT) - 1):
        below = nearest_edges(bound)
        raise ValueError(
            f"bucket bound {bound!r}: expected an edge of the fine histogram (at most {MANTISSA_BITS} mantissa "
            f"bits, so that the bucket counts are exact); nearest edges {below[0]!r} and {below[1]!r}"
        )
    return (bits >> _SHIFT) - _FIRST


def nearest_edges(value: float) -> tuple[float, float]:
    """The fine edges just below (or at) and just above ``value``."""
    bits = f32_bits(value) >> _SHIFT
    return _f32(bits << _SHIFT), _f32((bits + 1) << _SHIFT)


def _f32(bits: int) -> float:
    """The fp32 value of int32 ``bits`` (the inverse of :func:`~grpo_exporter.functional.reading.f32_bits`)."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


class HostHistograms:
    """Fine histograms on the host, after the step's one transfer: (K, BUCKETS) counts (fp64: exact below 2^53)
    and each row's exact min and max. Every reading of the step is taken here, in Python arithmetic on a few
    looked-up buckets: a handful of host operators for all of a stage's histograms, where reading each on the
    device cost ~35 small operators (and on a GPU, as many kernels on the training stream)."""

    def __init__(self, counts: Tensor, lows: Sequence[float], highs: Sequence[float]) -> None:
        counts = counts.reshape(-1, BUCKETS)
        counts = counts if counts.dtype == torch.float64 else counts.double()
        self.counts = counts if counts.device.type == "cpu" else counts.cpu()  # the step's block: both already
        self.cum = self.counts.cumsum(-1)
        self._cum = _doubles(self.cum)  # read by index and bisect, no operator per read (lives with self.cum)
        self.totals: list[float] = self.cum[:, -1].tolist()
        self.lows, self.highs = list(lows), list(highs)

    @classmethod
    def of(cls, h: Histogram) -> HostHistograms:
        """A histogram (or a stack of them) brought to the host (a device sync: for use outside the step)."""
        lows, highs = h.minimum.reshape(-1).tolist(), h.maximum.reshape(-1).tolist()
        return cls(h.counts.cpu(), lows, highs)

    def quantiles(self, row: int, quantiles: Sequence[float]) -> list[float] | None:
        """Quantiles with numpy's linear interpolation between order statistics (fp64; q = 0 and q = 1 the exact
        min and max); None for an empty row."""
        n = self.totals[row]
        if n <= 0:
            return None
        last = n - 1.0
        low, high = self.lows[row], self.highs[row]
        out = []
        for q in quantiles:
            if q == 0 or q == 1:
                out.append(low if q == 0 else high)
                continue
            p = last * q
            r = float(math.floor(p))
            t = p - r
            lower = self._bucket(row, r)
            upper = min(r + 1.0, last)
            if t > 0 and self._cum[row * BUCKETS + lower] <= upper:  # else rank r + 1 lies in the same bucket
                v0, v1 = self._value(row, lower), self._value(row, self._bucket(row, upper))
                out.append(v0 + (v1 - v0) * t if v1 != v0 else v0)  # never inf - inf, never 0 * inf
            else:
                out.append(self._value(row, lower))
        return out

    def _bucket(self, row: int, rank: float) -> int:
        """The bucket of the ``rank``-th smallest value of a row: the first whose cumulative count exceeds it."""
        base = row * BUCKETS
        return bisect.bisect_right(self._cum, rank, base, base + BUCKETS) - base

    def _value(self, row: int, bucket: int) -> float:
        """A bucket's middle, clamped to the row's [min, max] (the value every order statistic in it reads)."""
        return min(max(_host_midpoints()[min(bucket, BUCKETS - 1)], self.lows[row]), self.highs[row])

    def top_mean(self, row: int, fraction: float) -> float | None:
        """Mean of the ceil(fraction n) largest values (fp64), each read at its bucket's middle clamped to
        [min, max]; the partial bucket at the threshold contributes only what the count needs. None when empty."""
        n = self.totals[row]
        if n <= 0:
            return None
        k = max(float(math.ceil(n * fraction - 1e-9)), 1.0)  # 0.2 * 15 is 3.0000000000000004
        threshold = self._bucket(row, n - k)  # holds the k-th largest: every higher bucket is taken whole
        above = n - self._cum[row * BUCKETS + threshold]  # values in higher buckets (integers in fp64: exact)
        counts = self.counts[row, threshold + 1 :]
        values = _midpoints(torch.device("cpu"))[threshold + 1 :].clamp(self.lows[row], self.highs[row])
        higher = float(torch.where(counts > 0, counts * values, 0.0).sum())  # no 0 * inf from empty buckets
        return (higher + (k - above) * self._value(row, threshold)) / k

    def buckets(self, row: int, bounds: Sequence[float]) -> list[float]:
        """Counts of values <= each bound (fine edges, increasing), then the total (``le="+Inf"``)."""
        base, cum = row * BUCKETS, self._cum
        return [*(cum[base + i] for i in _bound_positions(tuple(bounds))), self.totals[row]]


def _doubles(t: Tensor) -> ctypes.Array[ctypes.c_double]:
    """A contiguous CPU fp64 tensor's values as a ctypes array over the same memory (no copy): indexed and
    bisected in Python without a torch operator per read. Valid only while ``t`` lives: keep both together."""
    if t.device.type != "cpu" or t.dtype != torch.float64 or not t.is_contiguous():
        raise ValueError(f"a contiguous CPU fp64 tensor, got {t.dtype} on {t.device}")
    return _doubles_type(t.numel()).from_address(t.data_ptr())


@functools.lru_cache(maxsize=16)
def _doubles_type(n: int) -> type[ctypes.Array[ctypes.c_double]]:
    return ctypes.c_double * n  # one type per length, made once (a stage has a fixed row count)


@functools.lru_cache(maxsize=64)
def _bound_positions(bounds: tuple[float, ...]) -> tuple[int, ...]:
    return tuple(edge_index(b) for b in bounds)


@functools.lru_cache(maxsize=1)
def _host_midpoints() -> list[float]:
    return _midpoints(torch.device("cpu")).tolist()


def f32(value: float) -> float:
    """``value`` rounded to fp32, as the device readings were (values here are fp32 ones or between two)."""
    return _f32(f32_bits(value)) if math.isfinite(value) else value


class HostReading:
    """A reading of a fine histogram (row ``row`` of a stack, or the histogram itself) taken on the host after
    the step's transfer (see :class:`HostHistograms`); ``value`` and ``present`` take it at once, with a
    device sync, for use outside the step."""

    __slots__ = ("row", "stack")

    def __init__(self, stack: Histogram, row: int | None = None) -> None:
        self.stack, self.row = stack, row

    @property
    def histogram(self) -> Histogram:
        """This reading's own histogram: (BUCKETS,) counts, 0-d min and max."""
        if self.row is None:
            return self.stack
        return Histogram(*(t[self.row] for t in self.stack))

    def read(self, host: HostHistograms, row: int) -> list[float] | None:
        """The values of this reading from row ``row`` of ``host``; None when absent."""
        raise NotImplementedError

    def _now(self) -> list[float] | None:
        return self.read(HostHistograms.of(self.histogram), 0)

    @property
    def value(self) -> Tensor:
        got = self._now()
        return torch.tensor([0.0] if got is None else got, dtype=torch.float32).squeeze()

    @property
    def present(self) -> Tensor:
        return torch.tensor(self._now() is not None)


class Quantiles(HostReading):
    """Quantiles of a masked sample (fp32 values, as published), with its histogram kept for merging across
    ranks."""

    __slots__ = ("quantiles",)

    def __init__(self, stack: Histogram, quantiles: Sequence[float], row: int | None = None) -> None:
        super().__init__(stack, row)
        self.quantiles = tuple(quantiles)

    def read(self, host: HostHistograms, row: int) -> list[float] | None:
        values = host.quantiles(row, self.quantiles)
        return None if values is None else [f32(v) for v in values]

    @property
    def value(self) -> Tensor:
        got = self._now()
        return torch.tensor([0.0] * len(self.quantiles) if got is None else got, dtype=torch.float32)


class TopMean(HostReading):
    """Mean of the top ``fraction`` of a masked sample (fp32), with its histogram kept for merging across ranks."""

    __slots__ = ("fraction",)

    def __init__(self, stack: Histogram, fraction: float, row: int | None = None) -> None:
        super().__init__(stack, row)
        self.fraction = fraction

    def read(self, host: HostHistograms, row: int) -> list[float] | None:
        value = host.top_mean(row, self.fraction)
        return None if value is None else [f32(value)]


class Buckets(HostReading):
    """A classic Prometheus histogram read exactly from a fine one: counts of values <= each of ``bounds``
    (fine edges), then the total; always present (an empty sample counts 0 everywhere)."""

    __slots__ = ("bounds",)

    def __init__(self, stack: Histogram, bounds: Sequence[float], row: int | None = None) -> None:
        super().__init__(stack, row)
        self.bounds = tuple(bounds)

    def read(self, host: HostHistograms, row: int) -> list[float] | None:
        return host.buckets(row, self.bounds)

    @property
    def value(self) -> Tensor:
        got = self._now()
        return torch.tensor(got, dtype=torch.int64)


def quantile_values(h: Histogram, quantiles: Sequence[float]) -> Tensor:
    """Quantiles (fp64, on the CPU, (..., len(quantiles))) of a histogram or a stack, as the step reads them on
    the host (0 where empty)."""
    host = HostHistograms.of(h)
    rows = [host.quantiles(i, quantiles) or [0.0] * len(quantiles) for i in range(len(host.totals))]
    return torch.tensor(rows, dtype=torch.float64).reshape(*h.counts.shape[:-1], len(quantiles))


def top_mean_value(h: Histogram, fraction: float) -> Tensor:
    """Mean of the top ``fraction`` (fp64, 0-d, on the CPU; 0 when empty), as the step reads it on the host."""
    value = HostHistograms.of(h).top_mean(0, fraction)
    return torch.tensor(0.0 if value is None else value, dtype=torch.float64)


def masked_quantiles(
    x: Tensor,
    valid: Tensor,
    quantiles: Sequence[float],
    bits: Tensor | None = None,
    kept: Tensor | None = None,
    valid_count: Tensor | None = None,
) -> Quantiles:
    """Quantiles of ``x`` (non-negative) over ``valid`` positions (relative error <= 2^-8), absent when none is
    valid; the exact minimum is taken only when q = 0 is asked for (``bits``, ``kept``, ``valid_count``: as in
    :func:`histogram`)."""
    h = histogram(x, valid, exact_min=0.0 in quantiles, bits=bits, kept=kept, valid_count=valid_count)
    return Quantiles(h, quantiles)


def top_fraction_mean(
    x: Tensor,
    valid: Tensor,
    fraction: float,
    bits: Tensor | None = None,
    kept: Tensor | None = None,
    valid_count: Tensor | None = None,
) -> TopMean:
    """Mean of the ceil(fraction * n) largest valid values (relative error <= 2^-8).

    The set has a fixed share of the step's positions, so the value is comparable across steps even as the
    policy sharpens (seed, 高不确定性位置的熵, remedy 3: quantile instead of an absolute threshold).
    """
    return TopMean(histogram(x, valid, exact_min=False, bits=bits, kept=kept, valid_count=valid_count), fraction)


def cumulative_buckets(h: Histogram, bounds: Sequence[float]) -> Tensor:
    """(..., len(bounds) + 1) int64 counts of values <= each bound (bounds must be fine edges, increasing), the
    last one the total (``le="+Inf"``): a classic Prometheus histogram read exactly from the fine one (on the
    CPU, as the step reads it on the host)."""
    host = HostHistograms.of(h)
    rows = [host.buckets(i, bounds) for i in range(len(host.totals))]
    return torch.tensor(rows, dtype=torch.int64).reshape(*h.counts.shape[:-1], len(bounds) + 1)

