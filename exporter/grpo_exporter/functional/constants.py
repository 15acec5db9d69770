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

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
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

        cached = functools.lru_cache(maxsize=maxsize)(normal)

        @functools.wraps(make)
        def constant_of(*args: P.args, **kwargs: P.kwargs) -> Tensor:
            made: dict[str, Tensor] | None = getattr(_tracing, "made", None)
            if made is None:
                return cached(*args, **kwargs)  # type: ignore[arg-type]
            # a traced operator of the program, made once per trace and never kept in the cache; the key is
            # printed, as a size may be symbolic (unhashable)
            key = f"{make.__module__}.{make.__qualname__}{args!r}{sorted(kwargs.items())!r}"
            if key not in made:
                made[key] = make(*args, **kwargs)
            return made[key]

        constant_of.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return constant_of

    return wrap


_tracing = threading.local()

#: tables of a fixed size, made once per device outside any trace (:func:`table`), which a trace takes as constants
_TABLES: list[Callable[[str], Tensor]] = []


def table(make: Callable[[str], Tensor]) -> Callable[[str], Tensor]:
    """A constant table of a fixed size per device (its argument: the device's name), cached like
    :func:`cached_constant`; a trace reads the cached table as a constant of its program, so
    :func:`prepare_tables` makes every table for the device before a trace starts."""
    cached = functools.lru_cache(maxsize=8)(make)

    @functools.wraps(make)
    def made(device: str) -> Tensor:
        with torch.inference_mode(False):
            return cached(device)

    made.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    _TABLES.append(made)
    return made


def prepare_tables(device: torch.device) -> None:
    """Make every :func:`table` for ``device`` (before a trace, which must not make them itself)."""
    for make in _TABLES:
        make(str(device))


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """While this thread traces a stage into a program (:mod:`grpo_exporter.step.program`): the cached
    constants are made as operators of the trace (their sizes may be symbolic), and nothing made from a tracer
    is kept in a cache."""
    before = getattr(_tracing, "made", None)
    _tracing.made = {}
    try:
        yield
    finally:
        _tracing.made = before


def is_tracing() -> bool:
    """True while this thread traces a stage (:func:`tracing`)."""
    return getattr(_tracing, "made", None) is not None


@cached_constant(maxsize=128)
def _cached(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def constant(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a 1-d tensor on ``device``, shared across calls (read-only)."""
    return _cached(tuple(float(v) for v in values), dtype, torch.device(device))
