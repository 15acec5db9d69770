"""A bounded sample of the model's parameters, for the relative update |dtheta|/|theta| (seed 第 4 步)."""

from __future__ import annotations

import math

from torch import Tensor

PARAM_SAMPLE_TENSORS = 16
PARAM_SAMPLE_ELEMENTS = 65_536


def sample_parameters(params: list[Tensor]) -> list[Tensor]:
    """Copies of up to 16 evenly spaced parameter tensors, first 65,536 elements each: a bounded copy
    (at most ~4 MiB in fp32), whatever the model size, taken on the parameters' own devices."""
    stride = max(1, math.ceil(len(params) / PARAM_SAMPLE_TENSORS))
    return [p.detach().reshape(-1)[:PARAM_SAMPLE_ELEMENTS].clone() for p in params[::stride]]
