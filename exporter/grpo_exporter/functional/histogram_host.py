"""The host side of the fine histograms (:mod:`grpo_exporter.functional.histogram`): after the step's one
transfer, the counts are read back as quantiles, top-fraction means and classic Prometheus buckets, by bisecting
their cumulative counts in place (no operator per reading); and the readings a metric block declares
(:class:`Quantiles`, :class:`TopMean`, :class:`Buckets`), which say what to read."""

from __future__ import annotations

import bisect
import ctypes
import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_exporter.functional.histogram import BUCKETS, Histogram, bits_f32, edge_index, histogram, midpoints
from grpo_exporter.functional.reading import f32_bits


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
        values = midpoints(torch.device("cpu"))[threshold + 1 :].clamp(self.lows[row], self.highs[row])
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
    return midpoints(torch.device("cpu")).tolist()


def f32(value: float) -> float:
    """``value`` rounded to fp32, as the device readings were (values here are fp32 ones or between two)."""
    return bits_f32(f32_bits(value)) if math.isfinite(value) else value


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

