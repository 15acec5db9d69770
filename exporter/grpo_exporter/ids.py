"""Prompt and group identifiers from what frameworks carry: strings (verl's ``uid``, TRL's prompt text or chat
messages), Python or NumPy integers, or integer tensors, turned into one int64 tensor at the API boundary.

Strings are hashed with BLAKE2b (8 bytes, top bit cleared): stable across processes, ranks and restarts
(Python's ``hash()`` is salted per process), so a prompt keeps its solve-rate slot for the whole run and two
ranks give the same prompt the same id. Non-string values (a chat as a list of dicts) are hashed by their
canonical JSON. A collision of two prompts has probability ~n²/2⁶⁴.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .inputs import InputError, describe

_MASK = (1 << 63) - 1


def stable_id(value: Any) -> int:
    """A non-negative int64 id for a prompt or group key, the same in every process."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode("utf-8")
    else:
        data = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK


def id_tensor(name: str, value: Tensor | Sequence[Any] | None, device: torch.device | None) -> Tensor | None:
    """``value`` as an int64 tensor of shape (N,) on ``device``; a tensor passes through unchanged (its own
    checks come later). Integers are kept as they are; anything else is hashed with :func:`stable_id`."""
    if value is None or isinstance(value, Tensor):
        return value
    items = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InputError(name, "a tensor, or a sequence of strings or integers with one entry per completion",
                         describe(value))
    if any(isinstance(v, float | bool) or v is None for v in items):
        bad = next(v for v in items if isinstance(v, float | bool) or v is None)
        expected = "strings, integers or chat messages, one per completion"
        raise InputError(name, expected, f"{type(bad).__name__} {bad!r}")
    ids = [v if isinstance(v, int) else stable_id(v) for v in items]
    if any(not -(1 << 63) <= v < (1 << 63) for v in ids):
        raise InputError(name, "integers that fit in int64", "an integer out of range")
    return torch.tensor(ids, dtype=torch.int64, device=device)
