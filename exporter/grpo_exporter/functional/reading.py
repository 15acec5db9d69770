"""The result type of every metric function: a value and whether it exists.

A metric whose inputs are empty (an empty mask, a batch with no positive-advantage token...) is *absent*, not
0 and not NaN. Functions never branch on data (that would be a host sync), so absence travels as a 0-d bool
tensor beside the value; the value is forced to 0 where absent so no NaN ever leaves this package.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Reading(NamedTuple):
    """``value``: 0-d (or 1-d for quantile vectors) float tensor; ``present``: 0-d bool tensor."""

    value: Tensor
    present: Tensor


def reading(value: Tensor, present: Tensor) -> Reading:
    """A reading whose value is zeroed (never NaN) where absent."""
    value = value.float() if not value.is_floating_point() else value
    return Reading(torch.where(present, value, torch.zeros_like(value)), present)


def always(value: Tensor) -> Reading:
    """A reading that is always present: counts, where 0 is a true zero."""
    return Reading(value, torch.ones((), dtype=torch.bool, device=value.device))


def fraction(numerator: Tensor, denominator: Tensor) -> Reading:
    """numerator / denominator in fp64 (counts above 2^24 stay exact), absent when the denominator is 0."""
    present = denominator > 0
    den = torch.where(present, denominator, torch.ones_like(denominator)).double()
    return reading(numerator.double() / den, present)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` over ``mask`` in fp32; masked positions never enter arithmetic (no inf*0 NaN)."""
    return torch.where(mask, x.float(), 0.0).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Reading:
    """Mean of ``x`` over ``mask`` in fp32 (fp64 accumulation of the count), absent for an empty mask."""
    return fraction(torch.where(mask, x.float(), 0.0).double().sum(), mask.sum())


def masked_max(x: Tensor, mask: Tensor) -> Reading:
    """Max of ``x`` over ``mask``, absent for an empty mask."""
    lowest = torch.finfo(torch.float32).min
    return reading(torch.where(mask, x.float(), lowest).amax(), mask.any())


def finite(x: Tensor) -> Tensor:
    """Bool tensor: ``x`` is neither NaN nor +-Inf."""
    return torch.isfinite(x)
