"""A synthetic training step of a given size, for the bench: the tensors one GRPO step hands the monitor.

Sizes are in loss tokens (the positions inside the loss mask). Completion lengths are uniform in [T/4, T], so
about 5/8 of the (N, T) positions are loss tokens; T is 256 up to 128K loss tokens and 1024 above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

G = 16
MICRO_BATCHES = 4
FILL = 0.625


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

    @property
    def loss_tokens(self) -> int:
        return int(self.mask.sum())


def shape_for(loss_tokens: int) -> tuple[int, int]:
    """(N, T) with N a multiple of both G and the micro-batch count, holding about ``loss_tokens``."""
    t = 256 if loss_tokens <= 131_072 else 1024
    unit = G * MICRO_BATCHES
    n = max(unit, round(loss_tokens / (t * FILL) / unit) * unit)
    return n, t


def make(loss_tokens: int, device: torch.device | str = "cpu", seed: int = 0) -> Workload:
    """A reproducible step of about ``loss_tokens`` loss tokens: rewards of mixed groups, log-probs of a policy
    a few updates off the rollout (ratios within a few percent of 1), an engine 1e-3 nats off."""
    n, t = shape_for(loss_tokens)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (n,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    solve = torch.rand(n // G, generator=gen).repeat_interleave(G)
    correct = torch.rand(n, generator=gen) < solve
    old = -torch.rand(n, t, generator=gen).pow(3) * 4
    new = old + torch.randn(n, t, generator=gen) * 0.05
    rewards = correct.float()
    grouped = rewards.view(-1, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
    on = {"device": device}
    return Workload(
        n=n, t=t, rewards=rewards.to(**on), correct=correct.to(**on), truncated=(lengths == t).to(**on),
        lengths=lengths.to(**on), mask=mask.to(**on),
        completion_ids=torch.randint(3, 32_000, (n, t), generator=gen).to(**on),
        prompt_ids=torch.arange(n // G).repeat_interleave(G).to(**on),
        old=old.to(**on), new=new.to(**on), rollout=(old + torch.randn(n, t, generator=gen) * 1e-3).to(**on),
        ref=(old - torch.rand(n, t, generator=gen) * 0.1).to(**on),
        entropy=(torch.rand(n, t, generator=gen) * 2).to(**on), advantages=advantages.to(**on),
    )
