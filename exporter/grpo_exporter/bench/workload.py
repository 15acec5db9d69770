"""A synthetic training step of a given size, for the bench: the tensors one GRPO step hands the monitor.

Sizes are in loss tokens (the positions inside the loss mask). Completion lengths are uniform in [T/4, T], so
about 5/8 of the (N, T) positions are loss tokens; T is 256 up to 128K loss tokens and 1024 above.

Two shapes of the same step. ``bench`` (the tables' rows since the first bench): a prefix loss mask, T a power
of two, and every micro-batch a slice of one batch tensor, so stitching the micro-batches costs no copy.
``framework``: what a framework's loop hands over instead. Each micro-batch's log-probs and entropy are the
outputs of its own forward pass (separate tensors, which the monitor must copy to stitch). T is the batch's
longest completion, no multiple of 8 or of anything (T - 3). The loss mask is multi-turn: a tool's response
spans 37 positions of every 148 inside a completion, and those positions are off the mask. As TRL's adapter
hands them, ``completion_mask`` marks the completion's positions (the tool's included) and the completion
lengths count the model's own tokens (the loss tokens), so the mask audit sees a correct mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

G = 16
MICRO_BATCHES = 4
FILL = 0.625
SHAPES = ("bench", "framework")
TOOL_SPAN, TOOL_PERIOD = 37, 148  # the framework shape's multi-turn mask: positions [111, 148) of every 148 off


@dataclass(frozen=True)
class Workload:
    """One step's inputs, on one device."""

    n: int
    t: int
    rewards: Tensor
    correct: Tensor
    truncated: Tensor
    lengths: Tensor
    mask: Tensor
    completion_ids: Tensor
    prompt_ids: Tensor
    old: Tensor
    new: Tensor
    rollout: Tensor
    ref: Tensor
    entropy: Tensor
    advantages: Tensor
    shape: str = "bench"
    completion_mask: Tensor | None = None  # framework shape: the completion's positions, tool spans included
    new_parts: tuple[Tensor, ...] = ()  # framework shape: each micro-batch's own log-probs (``new`` is their cat)
    entropy_parts: tuple[Tensor, ...] = ()

    def rows(self, k: int) -> slice:
        """Micro-batch ``k``'s rows of the batch tensors."""
        size = self.n // MICRO_BATCHES
        return slice(k * size, (k + 1) * size)

    def micro_batch(self, k: int) -> tuple[Tensor, Tensor]:
        """Micro-batch ``k``'s log-probs and entropy, as the loop hands them to ``observe_update``."""
        if self.new_parts:
            return self.new_parts[k], self.entropy_parts[k]
        return self.new[self.rows(k)], self.entropy[self.rows(k)]

    @property
    def loss_tokens(self) -> int:
        return int(self.mask.sum())


def shape_for(loss_tokens: int, width: int | None = None) -> tuple[int, int]:
    """(N, T) with N a multiple of both G and the micro-batch count, holding about ``loss_tokens`` (T =
    ``width`` when given)."""
    t = width or (256 if loss_tokens <= 131_072 else 1024)
    unit = G * MICRO_BATCHES
    n = max(unit, round(loss_tokens / (t * FILL) / unit) * unit)
    return n, t


def make(
    loss_tokens: int, device: torch.device | str = "cpu", seed: int = 0, shape: str = "bench", width: int | None = None
) -> Workload:
    """A reproducible step of about ``loss_tokens`` loss tokens: rewards of mixed groups, log-probs of a policy
    a few updates off the rollout (ratios within a few percent of 1), an engine 1e-3 nats off. ``shape``: one of
    :data:`SHAPES` (module docstring); the framework shape keeps N and T - 3, so it holds ~1/4 fewer loss
    tokens than the bench shape of the same size. ``width``: T, instead of the size's (the bench's fixed-cost step
    is 64 x 16)."""
    if shape not in SHAPES:
        raise ValueError(f"`shape`: expected one of {SHAPES}, got {shape!r}")
    n, t = shape_for(loss_tokens, width)
    if shape == "framework":
        t -= 3
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (n,), generator=gen)
    positions = torch.arange(t)
    mask = positions[None, :] < lengths[:, None]
    completion_mask = None
    if shape == "framework":
        completion_mask = mask
        mask = mask & (positions % TOOL_PERIOD < TOOL_PERIOD - TOOL_SPAN)[None, :]
    solve = torch.rand(n // G, generator=gen).repeat_interleave(G)
    correct = torch.rand(n, generator=gen) < solve
    old = -torch.rand(n, t, generator=gen).pow(3) * 4
    new = old + torch.randn(n, t, generator=gen) * 0.05
    rewards = correct.float()
    grouped = rewards.view(-1, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
    on: dict[str, Any] = {"device": device}
    entropy = torch.rand(n, t, generator=gen) * 2
    parts: dict[str, tuple[Tensor, ...]] = {}
    if shape == "framework":  # one forward pass per micro-batch: tensors of their own, not views of one
        parts = {name: tuple(p.to(**on).clone() for p in x.chunk(MICRO_BATCHES))
                 for name, x in (("new_parts", new), ("entropy_parts", entropy))}
    return Workload(
        n=n, t=t, rewards=rewards.to(**on), correct=correct.to(**on), truncated=(lengths == t).to(**on),
        lengths=(lengths if completion_mask is None else mask.sum(1)).to(**on), mask=mask.to(**on),
        completion_mask=None if completion_mask is None else completion_mask.to(**on),
        completion_ids=torch.randint(3, 32_000, (n, t), generator=gen).to(**on),
        prompt_ids=torch.arange(n // G).repeat_interleave(G).to(**on),
        old=old.to(**on), new=new.to(**on), rollout=(old + torch.randn(n, t, generator=gen) * 1e-3).to(**on),
        ref=(old - torch.rand(n, t, generator=gen) * 0.1).to(**on),
        entropy=entropy.to(**on), advantages=advantages.to(**on), shape=shape, **parts,
    )
