"""Plain-NLL reach (seed 第 6 篇 (crash triage) 第 1.5 步, 2.2 用简单目标测试"梯度能否到达参数").

Reward, ratio and clip put aside: a few fixed prompt-completion pairs, plain NLL on completion tokens only, in
fp32; the loss must fall by a stated factor within a stated number of steps. If it does not, the gradient does
not reach the parameters: check frozen parameters, the loss mask, accumulation, the reduction, the learning
rate and the optimizer step before anything GRPO-specific. Passing proves only the plain supervised path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from grpo_exporter.checks.outcome import Outcome


@dataclass(frozen=True)
class ReachReport(Outcome):
    """``losses``: the NLL (nats per completion token) before each step; ``without_gradient``: trainable
    parameter tensors that got no (or an all-zero) gradient on the first backward."""

    CHECK: ClassVar[str] = "nll_reach"  # the ``check`` label of grpo_preflight_check_passed

    steps: int
    factor: float
    initial_nll: float
    final_nll: float
    losses: tuple[float, ...]
    without_gradient: int
    passed: bool
    diagnosis: str
    cannot_tell: bool = False


def nll_reach(
    completion_logprobs: Callable[[], Tensor],
    completion_mask: Tensor,
    params: Iterable[Tensor],
    optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
    steps: int = 50,
    factor: float = 2.0,
    lr: float = 1e-2,
    seed: int = 0,
) -> ReachReport:
    """Train on NLL = -mean over completion tokens of ``completion_logprobs()`` ((N, T) log-probs of the fixed
    completions under the current parameters, with grad) for ``steps`` steps of ``optimizer(params)`` (Adam at
    ``lr`` by default); pass when the NLL fell to at most 1/``factor`` of its start; cannot tell when
    ``completion_mask`` selects no token or the NLL is not finite; a mask of another shape than the log-probs'
    is an error (it would broadcast into a wrong NLL). The parameters are
    trained in place: run it on a copy or a checkpoint you can reload."""
    mask = completion_mask.bool()
    tokens = int(mask.sum())
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return ReachReport(0, factor, 0.0, 0.0, (), 0, False,
                           "no parameter requires grad: every parameter is frozen")
    opt = optimizer(trainable) if optimizer is not None else torch.optim.Adam(trainable, lr=lr)
    torch.manual_seed(seed)
    losses: list[float] = []
    without = 0
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        logprobs = completion_logprobs()
        if step == 0 and logprobs.shape != mask.shape:
            raise ValueError(f"nll_reach: completion_logprobs(): expected shape {tuple(mask.shape)} like "
                             f"completion_mask, got {tuple(logprobs.shape)}")
        if tokens == 0:
            return ReachReport(0, factor, 0.0, 0.0, (), 0, False,
                               "cannot tell: completion_mask selects no token (the loss mask is empty)",
                               cannot_tell=True)
        nll = -(logprobs.float() * mask).sum() / tokens
        losses.append(float(nll.detach()))
        if not math.isfinite(losses[-1]):
            return ReachReport(step, factor, losses[0], losses[-1], tuple(losses), without, False,
                               f"cannot tell: the NLL is not finite at step {step} ({losses[-1]}): non-finite "
                               "log-probs on completion tokens (follow the numeric path to the first NaN/Inf)",
                               cannot_tell=True)
        if step == steps:
            break
        if not nll.requires_grad:
            return ReachReport(step, factor, losses[0], losses[-1], tuple(losses), len(trainable), False,
                               "the log-probs carry no graph (computed under no_grad or detached): no gradient "
                               "can reach the parameters")
        nll.backward()
        if step == 0:
            without = sum(1 for p in trainable if p.grad is None or not bool(p.grad.any()))
        opt.step()
    initial, final = losses[0], losses[-1]
    passed = final <= initial / factor
    return ReachReport(steps, factor, initial, final, tuple(losses), without, passed,
                       _why(passed, initial, final, steps, factor, without, len(trainable)))


def _why(passed: bool, initial: float, final: float, steps: int, factor: float, without: int, trainable: int) -> str:
    """The verdict in words: how far the NLL fell, and when it did not fall enough, what to look at."""
    if passed:
        return f"the NLL fell from {initial:.4g} to {final:.4g} nats/token in {steps} steps (>= {factor:g}x)"
    if without == trainable:
        return (f"no trainable parameter got a gradient ({without} of {trainable}): frozen parameters, a detached "
                "path or an all-zero mask")
    return (f"the NLL went from {initial:.4g} to {final:.4g} nats/token in {steps} steps (< {factor:g}x fall; "
            f"{without} of {trainable} trainable tensors got no gradient): check frozen parameters, the loss mask, "
            "gradient accumulation, the reduction, the learning rate and the optimizer step")
