"""Gradient-accumulation equivalence (seed 第 6 篇 (crash triage) 第 1.5 步, 2.1 梯度累积等价性测试).

The same samples, the same parameters, the same RNG: one backward over the whole batch against the training
code's accumulation over micro-batches. A loss divided once too often or not at all, a micro-batch left out,
a reduction over the wrong group shows as a gradient whose norm is off by an integer multiple (the
micro-batch count, the world size, a ratio of token counts) or whose direction differs; the seed compares the
relative norm difference, the cosine, and the parameter delta after one optimizer step, never one
parameter's absolute error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from grpo_exporter.checks.outcome import Outcome

_MULTIPLE_RTOL = 0.02


@dataclass(frozen=True)
class AccumulationReport(Outcome):
    """``norm_ratio``: |g accumulated| / |g one batch|; ``delta_relative_difference``: |d2 - d1| / |d1| of the
    parameter deltas after one step of the given optimizer (None without one); ``multiple``: the integer
    multiple the norms differ by, and what it matches, when they do."""

    CHECK: ClassVar[str] = "accumulation_equivalence"  # the ``check`` label of grpo_preflight_check_passed

    micro_batches: int
    cosine: float
    norm_ratio: float
    relative_norm_difference: float
    delta_relative_difference: float | None
    multiple: str | None
    passed: bool
    diagnosis: str
    cannot_tell: bool = False


def _gradients(params: list[Tensor], run: Callable[[], None], seed: int) -> Tensor:
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    run()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                      for p in params])


def _scatter(params: list[Tensor], flat: Tensor) -> None:
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
        offset += p.numel()


def _delta(params: list[Tensor], saved: list[Tensor], grad: Tensor,
           optimizer: Callable[[list[Tensor]], torch.optim.Optimizer]) -> Tensor:
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    _scatter(params, grad)
    optimizer(params).step()
    with torch.no_grad():
        return torch.cat([(p.detach() - s).double().flatten() for p, s in zip(params, saved, strict=True)])


def _integer_multiple(ratio: float, candidates: Mapping[str, float]) -> str | None:
    """'k x (what k is)' when ``ratio`` or its inverse is a named candidate or an integer >= 2, within 2%."""
    if not (ratio > 0 and math.isfinite(ratio)):
        return None
    for value, direction in ((ratio, "x"), (1.0 / ratio, "x smaller")):
        for name, k in candidates.items():
            if k > 1 and abs(value / k - 1.0) <= _MULTIPLE_RTOL:
                return f"{k:g}{direction} = the {name}"
        nearest = round(value)
        if nearest >= 2 and abs(value / nearest - 1.0) <= _MULTIPLE_RTOL:
            return f"{nearest}{direction} (an integer multiple)"
    return None


def _verdict(n1: float, n2: float, multiple: str | None, cosine: float, cosine_min: float, difference: float,
             norm_rtol: float) -> tuple[bool, str]:
    """Whether the accumulated gradient (norm ``n2``) is the batch one (``n1``), and if not the likeliest cause."""
    if n1 == 0 or n2 == 0:
        return False, (f"a zero gradient ({'batch' if n1 == 0 else 'accumulated'}): nothing reaches the "
                       "parameters (a detached loss, an all-zero mask, frozen parameters)")
    if multiple is not None:
        return False, (f"the accumulated gradient is {multiple}: the loss is scaled once too often or not at all "
                       "(divide once by the micro-batch count, or by the global token count)")
    if cosine < cosine_min:
        return False, (f"the direction differs (cosine {cosine:.4f} < {cosine_min}): the two paths weigh samples "
                       "differently (a per-micro-batch token mean against a global one, a mask or a reduction "
                       "that differs)")
    if difference > norm_rtol:
        return False, (f"the gradients differ by {difference:.3g} (> {norm_rtol:g}) without an integer multiple: "
                       "check the loss denominator of each path")
    return True, "equivalent"


def accumulation_equivalence(
    params: Iterable[Tensor],
    batch_loss: Callable[[], Tensor],
    micro_losses: Sequence[Callable[[], Tensor]],
    optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
    multiples: Mapping[str, float] | None = None,
    seed: int = 0,
    cosine_min: float = 0.999,
    norm_rtol: float = 1e-3,
) -> AccumulationReport:
    """Compare the gradient of ``batch_loss()`` (the whole batch, one backward) with the one the training code
    accumulates by calling backward on each of ``micro_losses`` (each returns a micro-batch's loss exactly as
    the training loop scales it). ``optimizer(params)`` makes a fresh optimizer for the parameter-delta
    comparison (parameters are restored afterwards, gradients cleared). ``multiples``: further named ratios a
    scaling bug could match (``{"world size": 8, "token ratio": 1.7}``); the micro-batch count is always one.

    Fails when the cosine is below ``cosine_min`` or the norms differ by more than ``norm_rtol`` (fp32 on one
    device is near 1e-6; bf16 and distributed reductions need a looser one), naming an integer multiple when
    the norms differ by one.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("accumulation_equivalence: params: expected parameters that require grad, got none")
    if not micro_losses:
        raise ValueError("accumulation_equivalence: micro_losses: expected at least one micro-batch loss")
    saved = [p.detach().clone() for p in params]
    g1 = _gradients(params, lambda: batch_loss().backward(), seed)

    def accumulate() -> None:
        for loss in micro_losses:
            loss().backward()

    g2 = _gradients(params, accumulate, seed)
    n1, n2 = float(g1.norm()), float(g2.norm())
    cosine = float(torch.dot(g1, g2) / (n1 * n2)) if n1 > 0 and n2 > 0 else 0.0
    ratio = n2 / n1 if n1 > 0 else float("inf")
    difference = float((g2 - g1).norm() / n1) if n1 > 0 else float("inf")
    delta = None
    if optimizer is not None:
        d1, d2 = _delta(params, saved, g1, optimizer), _delta(params, saved, g2, optimizer)
        delta = float((d2 - d1).norm() / d1.norm()) if float(d1.norm()) > 0 else float("inf")
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    for p in params:
        p.grad = None
    candidates = {"micro-batch count": float(len(micro_losses)), **(multiples or {})}
    multiple = _integer_multiple(ratio, candidates)
    numbers = (f"cosine {cosine:.6f}, |g_acc|/|g_batch| {ratio:.4g}, relative difference {difference:.3g}"
               + (f", parameter delta difference {delta:.3g}" if delta is not None else ""))
    if not (math.isfinite(n1) and math.isfinite(n2)):
        where = " and ".join(name for name, n in (("batch", n1), ("accumulated", n2)) if not math.isfinite(n))
        return AccumulationReport(len(micro_losses), cosine, ratio, difference, delta, None, False,
                                  f"cannot tell: the {where} gradient is not finite (a NaN or Inf loss): follow "
                                  f"the numeric path to the first NaN/Inf, then run this check again ({numbers})",
                                  cannot_tell=True)
    passed, why = _verdict(n1, n2, multiple, cosine, cosine_min, difference, norm_rtol)
    return AccumulationReport(len(micro_losses), cosine, ratio, difference, delta, multiple, passed,
                              f"{why} ({numbers})")
