"""Constant vectors (quantile levels, bucket bounds) on a device, made once per (values, dtype, device).

Building them with ``torch.tensor(list, device=...)`` every step is a host-to-device copy from Python data on
an accelerator, which waits for the training stream: a hidden sync per call. Cached, the copy happens once.
Callers must not modify the returned tensor in place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor


@functools.lru_cache(maxsize=128)
def _cached(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def constant(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a 1-d tensor on ``device``, shared across calls (read-only)."""
    return _cached(tuple(float(v) for v in values), dtype, torch.device(device))
