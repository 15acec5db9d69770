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

import functools
import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.constants import constant
from grpo_exporter.functional.reading import count, f32_bits, filled, keep_bits, reading

MANTISSA_BITS = 7
_SHIFT = 23 - MANTISSA_BITS
LOW_EXPONENT, HIGH_EXPONENT = -32, 32
_FIRST = (127 + LOW_EXPONENT) << MANTISSA_BITS  # bit-key of the edge 2^-32
BUCKETS = ((HIGH_EXPONENT - LOW_EXPONENT) << MANTISSA_BITS) + 2  # 8194: [0, 2^-32], 8192 fine, (2^32, inf]
_TOP = BUCKETS - 1
RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)
ABSOLUTE_FLOOR = 2.0**LOW_EXPONENT


class Histogram(NamedTuple):
    """The fine histogram of one masked sample: (BUCKETS,) int64 counts and the exact min and max (0-d fp32;
    +inf / -inf when the sample is empty, so that they merge by max/min). A stack of k histograms has (k,
    BUCKETS) counts and (k,) extremes; every reading below takes either."""

    counts: Tensor
    minimum: Tensor
    maximum: Tensor


def histogram(x: Tensor, valid: Tensor, exact_min: bool = True, bits: Tensor | None = None) -> Histogram:
    """The fine histogram of ``x`` over ``valid`` positions (any shape, same shape as ``valid``).

    A few passes of integer ops on the bits (``valid`` enters as a word ANDed in: the invalid positions all
    land in bucket 0 and are taken out of it by their count) and one ``bincount``; ``valid`` must exclude NaN
    (callers pass loss mask and finiteness; +inf is a valid value and lands in the top bucket).
    ``exact_min=False`` saves the passes of the minimum where no reading needs it (no q = 0): it is then 0, a
    lower bound of these non-negative distributions, and readings are clamped at 0 below. ``bits``:
    :func:`~grpo_exporter.functional.reading.keep_bits` of ``valid``, when the caller has them."""
    values = x.float().contiguous()
    valid = valid.expand(values.shape)
    bits = keep_bits(valid) if bits is None else bits
    key = _bucket_keys(values)
    key = torch.where(bits, key, 0) if bits.dtype == torch.bool else key.bitwise_and_(bits)
    counts = torch.bincount(key.flatten(), minlength=BUCKETS)
    counts[0] -= key.numel() - count(valid)  # every invalid position was counted in bucket 0
    lowest = filled(values, bits, math.inf).amin() if exact_min else _zero(values.device)
    highest = filled(values, bits, -math.inf).amax()
    return Histogram(counts, lowest, highest)


def histograms(x: Tensor, members: Tensor) -> Histogram:
    """k fine histograms of one (N,) sample at once, one per row of ``members`` (k, N) bool (subsets of the
    sample, e.g. completion lengths by outcome): the bucket keys are taken once and counted by one
    ``bincount`` over k x BUCKETS bins. ``x`` must be finite where a member (NaN is never valid)."""
    k = members.shape[0]
    values = x.float().contiguous()
    rows = _row_offsets(k, values.device).unsqueeze(1)
    keys = torch.where(members, _bucket_keys(values).unsqueeze(0) + rows, k * BUCKETS)
    counts = torch.bincount(keys.flatten(), minlength=k * BUCKETS + 1)[: k * BUCKETS].view(k, BUCKETS)
    lowest = torch.where(members, values, math.inf).amin(dim=1)
    highest = torch.where(members, values, -math.inf).amax(dim=1)
    return Histogram(counts, lowest, highest)


def _bucket_keys(values: Tensor) -> Tensor:
    """int32 bucket of each fp32 value: a shift of its bits (negatives and -0.0, bits <= 0, go to bucket 0)."""
    key = values.view(torch.int32).clamp(min=1)
    return key.sub_(1 + ((_FIRST - 1) << _SHIFT)).bitwise_right_shift_(_SHIFT).clamp_(0, _TOP)


@functools.lru_cache(maxsize=16)
def _row_offsets(k: int, device: torch.device) -> Tensor:
    return torch.arange(k, device=device, dtype=torch.int32) * BUCKETS


@functools.lru_cache(maxsize=8)
def _zero(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


def _upper_edges() -> Tensor:
    """(BUCKETS,) fp64 upper edge of each bucket (the top one +inf), on the CPU."""
    bits = (torch.arange(BUCKETS - 1, dtype=torch.int64) + _FIRST) << _SHIFT
    edges = bits.to(torch.int32).view(torch.float32).double()
    return torch.cat([edges, torch.tensor([math.inf], dtype=torch.float64)])


@functools.lru_cache(maxsize=8)
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


def _order_statistics(h: Histogram, ranks: Tensor) -> Tensor:
    """The ``ranks``-th smallest values (0-based, fp64 ranks, (..., r)), read at bucket middles, clamped to
    [min, max]."""
    cum = h.counts.cumsum(-1)
    bucket = torch.searchsorted(cum, ranks.to(cum.dtype), right=True).clamp_(max=BUCKETS - 1)
    lowest, highest = h.minimum.double().unsqueeze(-1), h.maximum.double().unsqueeze(-1)
    return _midpoints(h.counts.device)[bucket].clamp_(lowest, highest)


class Quantiles(NamedTuple):
    """Quantiles of a masked sample, with its histogram kept for merging across ranks."""

    value: Tensor
    present: Tensor
    histogram: Histogram
    quantiles: tuple[float, ...]


class TopMean(NamedTuple):
    """Mean of the top ``fraction`` of a masked sample, with its histogram kept for merging across ranks."""

    value: Tensor
    present: Tensor
    histogram: Histogram
    fraction: float


def quantile_values(h: Histogram, quantiles: Sequence[float]) -> Tensor:
    """Quantiles with numpy's linear interpolation between order statistics, read from the histogram (fp64;
    q = 0 and q = 1 are the exact min and max; 0 where the sample is empty)."""
    n = h.counts.sum(-1, keepdim=True).double()
    q = constant(quantiles, torch.float64, h.counts.device)
    last = (n - 1).clamp(min=0)
    position = last * q
    lower = position.floor()
    upper = torch.minimum(lower + 1, last)
    v0, v1 = _order_statistics(h, torch.cat([lower, upper], -1)).chunk(2, -1)
    t = position - lower
    value = torch.where((t > 0) & (v1 != v0), v0 + (v1 - v0) * t, v0)  # never inf - inf, never 0 * inf
    if 0.0 in quantiles or 1.0 in quantiles:  # the levels are host numbers: no operator when neither is asked
        lowest, highest = h.minimum.double().unsqueeze(-1), h.maximum.double().unsqueeze(-1)
        value = torch.where(q == 0, lowest, torch.where(q == 1, highest, value))
    return torch.where(n > 0, value, 0.0)


def top_mean_value(h: Histogram, fraction: float) -> Tensor:
    """Mean of the ceil(fraction n) largest values (fp64), each read at its bucket's middle clamped to
    [min, max]; the partial bucket at the threshold contributes only what the count needs."""
    n = h.counts.sum().double()
    k = torch.ceil(n * fraction - 1e-9).clamp(min=1)  # 0.2 * 15 is 3.0000000000000004
    middle = _midpoints(h.counts.device)
    values = torch.minimum(torch.maximum(middle, h.minimum.double()), h.maximum.double())
    counts = h.counts.double()
    above = n - counts.cumsum(0)  # values in higher buckets (integers in fp64: exact)
    take = torch.clamp(torch.minimum(counts, k - above), min=0.0)
    return torch.where(take > 0, take * values, 0.0).sum() / k


def masked_quantiles(
    x: Tensor, valid: Tensor, quantiles: Sequence[float], bits: Tensor | None = None
) -> Quantiles:
    """Quantiles of ``x`` (non-negative) over ``valid`` positions (relative error <= 2^-8), absent when none is
    valid; the exact minimum is taken only when q = 0 is asked for (``bits``: as in :func:`histogram`)."""
    h = histogram(x, valid, exact_min=0.0 in quantiles, bits=bits)
    r = reading(quantile_values(h, quantiles).float(), h.counts.sum() > 0)
    return Quantiles(r.value, r.present, h, tuple(quantiles))


def top_fraction_mean(
    x: Tensor, valid: Tensor, fraction: float, h: Histogram | None = None, bits: Tensor | None = None
) -> TopMean:
    """Mean of the ceil(fraction * n) largest valid values (relative error <= 2^-8).

    The set has a fixed share of the step's positions, so the value is comparable across steps even as the
    policy sharpens (seed, 高不确定性位置的熵, remedy 3: quantile instead of an absolute threshold).
    """
    h = histogram(x, valid, exact_min=False, bits=bits) if h is None else h
    r = reading(top_mean_value(h, fraction).float(), h.counts.sum() > 0)
    return TopMean(r.value, r.present, h, fraction)


def cumulative_buckets(h: Histogram, bounds: Sequence[float]) -> Tensor:
    """(len(bounds) + 1,) int64 counts of values <= each bound (bounds must be fine edges, increasing), the
    last one the total (``le="+Inf"``): a classic Prometheus histogram read exactly from the fine one."""
    cum = h.counts.cumsum(-1)
    index = _bound_index(tuple(bounds), h.counts.device)
    return torch.cat([cum[..., index], cum[..., -1:]], -1)


@functools.lru_cache(maxsize=64)
def _bound_index(bounds: tuple[float, ...], device: torch.device) -> Tensor:
    return torch.tensor([edge_index(b) for b in bounds], dtype=torch.int64, device=device)
