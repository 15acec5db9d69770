"""Constant vectors (quantile levels, bucket bounds) on a device, made once per (values, dtype, device).

Building them with ``torch.tensor(list, device=...)`` every step is a host-to-device copy from Python data on
an accelerator, which waits for the training stream: a hidden sync per call. Cached, the copy happens once.
Callers must not modify the returned tensor in place.

The monitor computes under ``torch.inference_mode`` (fewer dispatch steps per operator: ~10% of a step). A
tensor made there is an inference tensor, which autograd cannot save; so every cached tensor is made with
inference mode off (:func:`cached_constant`), and a caller outside it may use the cache with tensors that need
gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec

import torch
from torch import Tensor

P = ParamSpec("P")


def cached_constant(maxsize: int) -> Callable[[Callable[P, Tensor]], Callable[P, Tensor]]:
    """``functools.lru_cache(maxsize)`` for a function making a read-only tensor, made with inference mode off
    (a normal tensor, whatever mode the first caller is in)."""

    def wrap(make: Callable[P, Tensor]) -> Callable[P, Tensor]:
        @functools.wraps(make)
        def normal(*args: P.args, **kwargs: P.kwargs) -> Tensor:
            with torch.inference_mode(False):
                return make(*args, **kwargs)

        return functools.lru_cache(maxsize=maxsize)(normal)  # type: ignore[return-value]

    return wrap


@cached_constant(maxsize=128)
def _cached(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def constant(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a 1-d tensor on ``device``, shared across calls (read-only)."""
    return _cached(tuple(float(v) for v in values), dtype, torch.device(device))
