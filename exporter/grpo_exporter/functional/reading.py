"""The result type of every metric function: a value and whether it exists.

A metric whose inputs are empty (an empty mask, a batch with no positive-advantage token...) is *absent*, not
0 and not NaN. Functions never branch on data (that would be a host sync), so absence travels as a 0-d bool
tensor beside the value; the value is forced to 0 where absent so no NaN ever leaves this package.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.constants import cached_constant, is_tracing


class Reading(NamedTuple):
    """``value``: 0-d (or 1-d for quantile vectors) float tensor; ``present``: 0-d bool tensor."""

    value: Tensor
    present: Tensor


class Ratio:
    """A reading that is numerator / denominator (0-d tensors, or (k,) vectors of k ratios: pass@k for every k), absent
    when the denominator is 0: across ranks both are summed, then divided. ``value`` (fp64) and ``present`` are
    taken on the device only when read: the step transfers numerator and denominator and divides on the host (IEEE
    fp64 either way, so the same number), which saves four operators per ratio, a few dozen a step."""

    __slots__ = ("_read", "denominator", "numerator")

    def __init__(self, numerator: Tensor, denominator: Tensor) -> None:
        self.numerator, self.denominator = numerator, denominator
        self._read: tuple[Tensor, Tensor] | None = None

    def _taken(self) -> tuple[Tensor, Tensor]:
        if self._read is None:
            num, den = self.numerator.double(), self.denominator.double()
            present = den > 0
            self._read = (torch.where(present, num / den, 0.0), present)  # 0/0 never leaves the where
        return self._read

    @property
    def value(self) -> Tensor:
        return self._taken()[0]

    @property
    def present(self) -> Tensor:
        return self._taken()[1]

    def terms(self, index: int = 0) -> tuple[Tensor, Tensor]:
        """0-d numerator and denominator (of position ``index`` in a vector of ratios)."""
        if self.numerator.dim() == 0:
            return self.numerator, self.denominator
        return self.numerator[index], self.denominator[index]


class Extreme(NamedTuple):
    """A reading that is a max (``largest``) or min over elements: across ranks the extreme of extremes."""

    value: Tensor
    present: Tensor
    largest: bool


def reading(value: Tensor, present: Tensor) -> Reading:
    """A reading whose value is zeroed (never NaN) where absent."""
    value = value.float() if not value.is_floating_point() else value
    return Reading(torch.where(present, value, torch.zeros_like(value)), present)


def always(value: Tensor) -> Reading:
    """A reading that is always present: counts, where 0 is a true zero (one shared flag per device)."""
    return Reading(value, _true(value.device))


@cached_constant(maxsize=16)
def _true(device: torch.device) -> Tensor:
    return torch.ones((), dtype=torch.bool, device=device)


def fraction(numerator: Tensor, denominator: Tensor) -> Ratio:
    """numerator / denominator in fp64 (counts above 2^24 stay exact), absent when the denominator is 0."""
    return Ratio(numerator, denominator)


def masked_mean(x: Tensor, mask: Tensor, bits: Tensor | None = None) -> Ratio:
    """Mean of ``x`` over ``mask`` (a :func:`sum64` over the exact count); absent for an empty mask. ``bits``:
    :func:`keep_bits` of ``mask``, when the caller has them."""
    return fraction(sum64(zeroed(x, mask if bits is None else bits)), count(mask))


def sum64(x: Tensor) -> Tensor:
    """Sum of an fp32 tensor in fp64 without an fp64 copy of it: fp32 sums along the last dimension (one row
    each: a sequence's tokens), then an fp64 sum of those. A row sums alike on every rank, so the totals of
    ranks holding different rows add up to the single process's total (to fp64 rounding)."""
    return (x.sum(dim=-1) if x.dim() > 1 else x).double().sum()


def largest(x: Tensor, empty: float) -> Tensor:
    """``x.amax()``, or ``empty`` for a tensor without elements (T = 0 tokens: a shape known on the host, so
    no sync); the caller's reading is absent then."""
    return x.amax() if x.numel() else torch.full((), empty, dtype=x.dtype, device=x.device)


def smallest(x: Tensor, empty: float) -> Tensor:
    """``x.amin()``, or ``empty`` for a tensor without elements."""
    return x.amin() if x.numel() else torch.full((), empty, dtype=x.dtype, device=x.device)


def masked_max(x: Tensor, mask: Tensor, bits: Tensor | None = None) -> Extreme:
    """Max of ``x`` over ``mask``, absent for an empty mask (``bits``: as in :func:`masked_mean`)."""
    present = mask.any()
    value = largest(filled(x, mask if bits is None else bits, torch.finfo(torch.float32).min), 0.0)
    return Extreme(torch.where(present, value, 0.0), present, largest=True)


# Below this many positions a step is dispatch-bound: one torch.where (one operator) beats the bit masks' few.
SMALL = 1 << 16


def keep_bits(mask: Tensor) -> Tensor:
    """``mask`` in the form :func:`zeroed` and :func:`filled` read fastest, built once per mask: int32 words,
    all ones where ``mask`` and 0 elsewhere (ANDed with fp32 bits they keep a value or make it +0.0); below
    :data:`SMALL` positions the bool mask itself."""
    return mask if mask.numel() < SMALL or is_tracing() else mask.to(torch.int32).neg_()


def zeroed(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` in fp32 on ``mask`` (bool, or :func:`keep_bits` of one), +0.0 elsewhere: NaN or +-inf padding never
    survives. On large tensors the fp32 bits ANDed with the mask word: one integer pass at the speed of any
    elementwise op, where the CPU kernel of ``torch.where`` branches per element: as fast on a prefix mask, far
    slower on one that alternates (multi-turn tool spans, random masks; docs/benchmarks.md, implementation
    choices)."""
    bits = _bits(x, mask)
    x = x if x.dtype == torch.float32 else x.float()  # a no-op .float() is still an operator call
    if bits.dtype == torch.bool:
        return torch.where(bits, x, 0.0)
    return (x.view(torch.int32) & bits).view(torch.float32)


def filled(x: Tensor, mask: Tensor, fill: float) -> Tensor:
    """``x`` in fp32 on ``mask``, ``fill`` elsewhere (see :func:`zeroed`). When large, three integer passes on one
    new tensor: ((x ^ fill) & mask) ^ fill is x where the mask word is all ones and fill where it is 0."""
    bits = _bits(x, mask)
    x = x if x.dtype == torch.float32 else x.float()
    if bits.dtype == torch.bool:
        return torch.where(bits, x, fill)
    word = f32_bits(fill)
    return (x.view(torch.int32) ^ word).bitwise_and_(bits).bitwise_xor_(word).view(torch.float32)


def _bits(x: Tensor, mask: Tensor) -> Tensor:
    """Words for a bool ``mask`` against a large ``x`` (a per-row mask may broadcast over a large one)."""
    if mask.dtype == torch.bool and max(x.numel(), mask.numel()) >= SMALL and not is_tracing():
        return mask.to(torch.int32).neg_()
    return mask


@functools.lru_cache(maxsize=16)
def f32_bits(value: float) -> int:
    """The bits of ``value`` rounded to fp32, as a signed int32 (host arithmetic: no tensor, no transfer)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def finite(x: Tensor) -> Tensor:
    """Bool tensor: ``x`` is neither NaN nor +-Inf: ``|x| < inf``, two elementwise passes (NaN compares false)
    where ``torch.isfinite`` takes five on CPU and ``x * 0 == 0`` costs more (a float comparison is the slow
    part); integers and bools are always finite."""
    if not x.is_floating_point():
        return torch.ones_like(x, dtype=torch.bool)
    return x.abs() < math.inf


def finite_or_zero(x: Tensor) -> Tensor:
    """``x`` with NaN and +-inf read as 0 (``nan_to_num`` eagerly; compiled, a ``where`` on :func:`finite`,
    which vectorises where ``isnan`` does not)."""
    if is_tracing():
        return torch.where(finite(x), x, 0.0)
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def nonfinite(x: Tensor) -> Tensor:
    """Bool tensor: ``x`` is NaN or +-Inf (see :func:`finite`)."""
    if not x.is_floating_point():
        return torch.zeros_like(x, dtype=torch.bool)
    return ~(x.abs() < math.inf)


def count_nonfinite(x: Tensor, scratch: Tensor | None = None) -> Tensor:
    """Number of NaN / +-Inf entries (int64): ``x - x`` is +0.0 (no bit set) where finite and NaN elsewhere, and
    ``count_nonzero`` of its bits counts the NaNs. One arithmetic pass and one count, no bool tensor (the
    comparison would cost more than both). Counting integer bits is faster than counting floats (CPU); ``x * 0``
    would not do, -0.0 has its sign bit set. ``scratch``: a contiguous tensor of ``x``'s
    shape and dtype to write ``x - x`` into (a count per tensor of a step reuses one)."""
    if not x.is_floating_point():
        return torch.zeros((), dtype=torch.int64, device=x.device)
    if is_tracing():  # compiled, the comparison fuses into the pass that reads ``x`` anyway
        return nonfinite(x).sum()
    difference = x - x if scratch is None else torch.sub(x, x, out=scratch)
    return torch.count_nonzero(difference.view(_SAME_WIDTH_INT[x.element_size()]))


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def count(mask: Tensor, dim: int | None = None) -> Tensor:
    """True entries of a bool tensor, over ``dim`` or all. All: ``count_nonzero`` (int64), which reads a bool
    tensor faster than ``sum``. Along ``dim``: the bytes summed as uint8 into int32 (a count per row of a token
    tensor, far below 2^31), faster than ``count_nonzero`` along a dimension or ``any`` (CPU; the ratios are in
    docs/benchmarks.md, implementation choices)."""
    if is_tracing() and mask.dtype == torch.bool:  # compiled: a plain sum vectorises, a bytes view does not
        return mask.sum() if dim is None else mask.sum(dim=dim, dtype=torch.int32)
    if dim is None:
        return torch.count_nonzero(mask)
    if mask.dtype != torch.bool:
        return torch.count_nonzero(mask, dim=dim)
    return mask.view(torch.uint8).sum(dim=dim, dtype=torch.int32)
