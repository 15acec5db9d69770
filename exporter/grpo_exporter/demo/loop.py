"""The training loop's own choices, which real GRPO loops make differently: how the token losses are aggregated,
which optimizer steps, how the learning rate starts, and the KL-to-reference term in the loss.

The world sweep (:mod:`grpo_exporter.demo.worlds`) varies them with epochs per rollout, micro-batches
accumulated per optimizer step and the grad clip (fields of :class:`~grpo_exporter.demo.trainer.DemoConfig`):
a threshold calibrated on one loop must hold in the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

AGGREGATIONS = ("token", "sequence", "constant")
OPTIMIZERS = ("adam", "adamw", "sgd")
WEIGHT_DECAY = 0.1  # AdamW's, as LLM RL recipes set it (verl and OpenRLHF default to 0.01-0.1)
SGD_MOMENTUM = 0.9
SGD_LR_SCALE = 100.0  # SGD with momentum learns at ~100x Adam's learning rate on the demo's tiny model
KL_ESTIMATOR_CLAMP = 10.0  # the k3 estimator's log-ratio d is clamped before exp (TRL clamps nothing, verl the value)


def aggregate(per_token: Tensor, mask: Tensor, how: str, constant: float) -> Tensor:
    """The loss of one micro-batch from per-token terms (N, T) and the loss mask (N, T) (seed 第 4 篇 (collapse
    root causes), loss aggregation):

    - ``token``: the mean over the micro-batch's loss tokens (DAPO's token-level loss);
    - ``sequence``: the mean over sequences of each one's token mean (GRPO's 1/|o_i|);
    - ``constant``: the sum over loss tokens divided by a constant (Dr. GRPO: rows x the maximum length), so
      no sequence's length scales its tokens' weight.
    """
    weighted = per_token * mask
    if how == "token":
        return weighted.sum() / mask.sum().clamp(min=1)
    if how == "sequence":
        return (weighted.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if how == "constant":
        return weighted.sum() / constant
    raise ValueError(f"loss aggregation: expected one of {AGGREGATIONS}, got {how!r}")


def optimizer(params: Iterable[torch.nn.Parameter], how: str, lr: float) -> torch.optim.Optimizer:
    """Adam (no weight decay), AdamW with :data:`WEIGHT_DECAY`, or SGD with momentum at :data:`SGD_LR_SCALE`
    times ``lr``."""
    if how == "adam":
        return torch.optim.Adam(params, lr=lr)
    if how == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    if how == "sgd":
        return torch.optim.SGD(params, lr=lr * SGD_LR_SCALE, momentum=SGD_MOMENTUM)
    raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {how!r}")


class Optimizer:
    """:func:`optimizer` with its learning-rate warm-up: each :meth:`step` sets the rate of its optimizer step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], how: str, lr: float, warmup_steps: int) -> None:
        self.inner = optimizer(params, how, lr)
        self.base = [float(g["lr"]) for g in self.inner.param_groups]
        self.warmup_steps, self.steps = warmup_steps, 0

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self, multiplier: float = 1.0) -> None:
        """One optimizer step at the scheduled rate times ``multiplier`` (1 but for the learning-rate fault)."""
        share = warmup_factor(self.steps, self.warmup_steps) * multiplier
        for group, base in zip(self.inner.param_groups, self.base, strict=True):
            group["lr"] = base * share
        self.inner.step()
        self.steps += 1


def ppo_clip(log_ratio: Tensor, advantages: Tensor, clip_eps: tuple[float, float], clamp: float,
             exp_before_clamp: bool = False) -> Tensor:
    """Per-token PPO-clip loss -min(r A, clip(r, 1-low, 1+high) A) with r = exp(log ratio clamped to +-``clamp``):
    the clamp is the fuse before exp (seed 第 6 篇 step 3); ``exp_before_clamp`` is the bug that clamps after it."""
    if exp_before_clamp:
        ratio = torch.exp(log_ratio).clamp(max=math.exp(clamp))
    else:
        ratio = torch.exp(log_ratio.clamp(-clamp, clamp))
    low, high = clip_eps
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - low, 1 + high) * advantages)


def warmup_factor(optimizer_step: int, warmup_steps: int) -> float:
    """The learning rate's share at ``optimizer_step`` (0-based): linear from 1/warmup_steps to 1 over the first
    ``warmup_steps`` optimizer steps, then 1; 0 warm-up steps is a constant rate."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (optimizer_step + 1) / warmup_steps)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - logp (Schulman's
    low-variance estimator, GRPO's KL term), d clamped to +-:data:`KL_ESTIMATOR_CLAMP`."""
    d = (ref_logprobs - logprobs).clamp(-KL_ESTIMATOR_CLAMP, KL_ESTIMATOR_CLAMP)
    return torch.expm1(d) - d


__all__ = ["AGGREGATIONS", "OPTIMIZERS", "Optimizer", "aggregate", "kl_k3", "optimizer", "ppo_clip", "warmup_factor"]
