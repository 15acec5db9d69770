"""A mergeable log-bucket sketch of non-negative samples, for quantiles across ranks.

Exact quantiles of a sample split over ranks would need the sample itself (an all-gather). Instead each
rank counts its values into fixed logarithmic buckets (the DDSketch scheme): bucket i >= 1 holds
(v_min g^(i-1), v_min g^i] with g = (1+alpha)/(1-alpha); bucket 0 holds [0, v_min]; the last bucket
holds everything above v_max, +inf included. Bucket counts merge by a plain sum. An order statistic read
back from the merged sketch is within relative error ``ALPHA`` of the exact one for values in
(v_min, v_max], within ``V_MIN`` absolutely below that; min and max are merged exactly apart.

Every distribution the exporter reduces is non-negative: |log-prob gaps|, importance ratios, lengths and
entropies. Negative values are counted in bucket 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_exporter.functional.constants import constant

ALPHA = 0.005
GAMMA = (1 + ALPHA) / (1 - ALPHA)
V_MIN = 1e-9
V_MAX = 1e12
BUCKETS = math.ceil(math.log(V_MAX / V_MIN) / math.log(GAMMA)) + 2
_LOG_GAMMA = math.log(GAMMA)


def sketch(x: Tensor, valid: Tensor) -> Tensor:
    """(BUCKETS,) fp64 counts of the valid values of ``x``."""
    v = torch.where(valid, x.double(), 0.0).flatten()
    index = torch.ceil(torch.log(v.clamp(min=V_MIN) / V_MIN) / _LOG_GAMMA).clamp(0, BUCKETS - 1).long()
    index = torch.where(v > V_MIN, index.clamp(min=1), 0)
    return torch.zeros(BUCKETS, dtype=torch.float64, device=x.device).scatter_add_(0, index, valid.flatten().double())


def _representative(bucket: Tensor, maximum: Tensor) -> Tensor:
    """The value reported for a bucket: 2 v_min g^i / (g + 1), within ALPHA of anything in it."""
    value = 2.0 * V_MIN * torch.exp(bucket.double() * _LOG_GAMMA) / (GAMMA + 1.0)
    value = torch.where(bucket == 0, 0.0, value)
    return torch.where(bucket >= BUCKETS - 1, maximum.double(), torch.minimum(value, maximum.double()))


def _rank_values(counts: Tensor, ranks: Tensor, maximum: Tensor) -> Tensor:
    cum = counts.cumsum(0)
    bucket = torch.searchsorted(cum, ranks.double(), right=True).clamp(max=BUCKETS - 1)
    return _representative(bucket, maximum)


def sketch_quantiles(counts: Tensor, quantiles: Sequence[float], minimum: Tensor, maximum: Tensor) -> Tensor:
    """Quantiles (linear interpolation between order statistics, like numpy) read from merged counts;
    q = 0 and q = 1 are the exact ``minimum`` and ``maximum``."""
    n = counts.sum()
    q = constant(quantiles, torch.float64, counts.device)
    position = (n - 1).clamp(min=0) * q
    lower = position.floor()
    upper = torch.minimum(lower + 1, (n - 1).clamp(min=0))
    v0, v1 = _rank_values(counts, lower, maximum), _rank_values(counts, upper, maximum)
    t = position - lower
    value = v0 + (v1 - v0) * t
    value = torch.where(q == 0, minimum.double(), torch.where(q == 1, maximum.double(), value))
    return value.float()


def sketch_top_mean(counts: Tensor, fraction: float, maximum: Tensor) -> Tensor:
    """Mean of the ceil(fraction n) largest values, read from merged counts (relative error <= ALPHA)."""
    n = counts.sum()
    k = torch.ceil(n * fraction - 1e-9).clamp(min=1)
    buckets = torch.arange(BUCKETS, device=counts.device)
    values = _representative(buckets, maximum)
    above = counts.flip(0).cumsum(0).flip(0) - counts  # values in higher buckets
    take = torch.clamp(torch.minimum(counts, k - above), min=0.0)
    return ((take * values).sum() / k).float()
