"""Distributions in one pass: a fine log-bucket histogram of fp32 values, made on the device (read back on the host
as quantiles, top-fraction means and classic Prometheus buckets by :mod:`grpo_exporter.functional.histogram_host`).

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

import math
import struct
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.constants import cached_constant, is_tracing
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
    if is_tracing():
        return Histogram(counts, lowest, largest(kept, 0.0))
    return Histogram(counts, lowest, largest(kept.view(torch.int32), 0).view(torch.float32))


def histograms(x: Tensor, members: Tensor) -> Histogram:
    """k fine histograms of one (N,) sample at once, one per row of ``members`` (k, N) bool (subsets of the
    sample, e.g. completion lengths by outcome): the bucket keys are taken once and counted by one
    ``bincount`` over k x BUCKETS bins. ``x`` must be non-negative and finite where a member."""
    k = members.shape[0]
    values = x.float().contiguous()
    rows = _row_offsets(k, values.device).unsqueeze(1)
    keys = torch.where(members, _bucket_keys(values).unsqueeze(0) + rows, k * BUCKETS)
    counts = key_counts(keys.flatten(), k * BUCKETS + 1)[: k * BUCKETS].view(k, BUCKETS)
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
    if is_tracing():  # compiled, no bank: a GPU's adds are atomic, a CPU counts plain keys faster (benchmarks.md)
        return key_counts(_bucket_keys(values).flatten(), BUCKETS)
    keys = _bucket_keys(values, _bank_offsets(values.shape[-1], values.device))
    return key_counts(keys.flatten(), BANKS * BUCKETS).view(BANKS, BUCKETS).sum(0)


def key_counts(keys: Tensor, size: int) -> Tensor:
    """(size,) int64 counts of the integer ``keys`` (each in [0, size)): ``bincount`` eagerly. In a traced
    stage (:func:`~grpo_exporter.functional.constants.is_tracing`) on a CPU, :func:`_traced_bincount` (the
    compiler computes the keys in its fused loop and writes them once; inductor's own CPU scatter is an
    int64 index and a scalar loop, ~2x the ``bincount``: docs/benchmarks.md); on other devices an accumulating
    scatter into ``size`` bins, whose length is known from the shapes (``bincount``'s depends on the largest key,
    a device-to-host read on CUDA) and which the compiler fuses with the keys' arithmetic (atomic adds)."""
    if is_tracing():
        if counted_by_bincount(keys.device):  # unbanked: the fused loop writes plain keys (no per-position bank)
            return _traced_bincount(keys, size)
        ones = torch.ones((), dtype=torch.int64, device=keys.device).expand(keys.shape)
        return torch.zeros(size, dtype=torch.int64, device=keys.device).scatter_add_(0, keys.long(), ones)
    return torch.bincount(keys, minlength=size)


def counted_by_bincount(device: torch.device) -> bool:
    """Whether a traced stage on ``device`` counts histogram keys by :func:`_traced_bincount` (a CPU) rather
    than by the accumulating scatter that fuses on other devices (:func:`key_counts`)."""
    return device.type == "cpu"


@torch.library.custom_op("grpo_exporter::bincount", mutates_args=())
def _traced_bincount(keys: Tensor, size: int) -> Tensor:
    """``bincount`` of (M,) integer ``keys`` in [0, size) as one operator of a known output size (``size``,
    int64), so that a traced stage keeps it (a compiled program calls it as is)."""
    counts = torch.bincount(keys, minlength=size)
    if counts.numel() != size:
        raise ValueError(f"keys: expected every key in [0, {size}), came a key of {counts.numel() - 1}")
    return counts


@_traced_bincount.register_fake
def _(keys: Tensor, size: int) -> Tensor:
    return keys.new_empty((size,), dtype=torch.int64)


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
def midpoints(device: torch.device) -> Tensor:
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
    if bits_f32(bits) != bound or bits & ((1 << _SHIFT) - 1):
        below = nearest_edges(bound)
        raise ValueError(
            f"bucket bound {bound!r}: expected an edge of the fine histogram (at most {MANTISSA_BITS} mantissa "
            f"bits, so that the bucket counts are exact); nearest edges {below[0]!r} and {below[1]!r}"
        )
    return (bits >> _SHIFT) - _FIRST


def nearest_edges(value: float) -> tuple[float, float]:
    """The fine edges just below (or at) and just above ``value``."""
    bits = f32_bits(value) >> _SHIFT
    return bits_f32(bits << _SHIFT), bits_f32((bits + 1) << _SHIFT)


def bits_f32(bits: int) -> float:
    """The fp32 value of int32 ``bits`` (the inverse of :func:`~grpo_exporter.functional.reading.f32_bits`)."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]
