"""The A/B/C consistency test (seed 第 6 篇 (crash triage) 第 1 步, 最小一致性测试).

Frozen weights, one fixed RNG seed, the same tokens: the trainer's log-probs twice (A, B) and the rollout
engine's once (C). A = B proves the trainer repeatable (dropout off, deterministic inputs); A vs C is the
engine gap before any update. The hard criterion is not a threshold on the gap: with weights that have not
moved, the ratio exp(A - C) must not already sit outside the clip range, or the objective reads an
implementation difference as a policy update: stop and fix the probability path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from grpo_exporter.checks.outcome import Outcome
from grpo_exporter.thresholds import StopLines

_LINES = StopLines()


@dataclass(frozen=True)
class Spread:
    """|x - y| over loss tokens, nats: mean, 99th percentile, max."""

    mean: float
    p99: float
    max: float


@dataclass(frozen=True)
class ABCReport(Outcome):
    """What the A/B/C test measured, and its verdict.

    ``repeat``: |A - B|; ``engine``: |A - C|; ``outside_clip_ratio``: loss tokens whose exp(A - C) lies
    outside [1 - eps_low, 1 + eps_high]; ``passed`` and a ``diagnosis`` naming what to fix first."""

    CHECK: ClassVar[str] = "abc_consistency"  # the ``check`` label of grpo_preflight_check_passed

    tokens: int
    repeat: Spread
    engine: Spread
    outside_clip_ratio: float
    passed: bool
    diagnosis: str
    cannot_tell: bool = False


def _spread(x: Tensor, y: Tensor, mask: Tensor) -> Spread:
    d = (x.double() - y.double()).abs()[mask].sort().values
    if d.numel() == 0:
        return Spread(0.0, 0.0, 0.0)
    p99 = d[max(0, math.ceil(0.99 * d.numel()) - 1)]  # nearest rank: no size limit, unlike torch.quantile
    return Spread(float(d.mean()), float(p99), float(d[-1]))


def abc_consistency(
    trainer_logprobs: Callable[[], Tensor],
    engine_logprobs: Callable[[], Tensor] | Tensor,
    loss_mask: Tensor,
    clip_eps: tuple[float, float] = (0.2, 0.2),
    seed: int = 0,
    repeat_tolerance_nats: float = 1e-4,
    max_outside_clip_ratio: float = _LINES.onpolicy_clip_stop_ratio,
    engine_gap_stop_nats: float = _LINES.engine_gap_stop_nats,
    clean_gap_nats: float | None = None,
    clean_factor: float = 10.0,
) -> ABCReport:
    """Run A, B (``trainer_logprobs()`` twice) and C (``engine_logprobs``, called once or given) on the same
    (N, T) tokens with no gradient, the RNG seeded once with ``seed`` before A (so a dropout left on draws
    other masks for B, as it would between two training passes).

    Cannot tell when ``loss_mask`` selects no token or a log-prob on a loss token is not finite (follow the
    numeric path first). Fails, in this order: A != B beyond ``repeat_tolerance_nats`` (the
    trainer is not repeatable: nothing downstream can be trusted); more than ``max_outside_clip_ratio`` of the
    loss tokens outside the clip range before any update (the seed's hard criterion); a mean |A - C| at or
    above ``engine_gap_stop_nats`` (seed: mean >= 0.01 stop); with ``clean_gap_nats`` (the mean |A - C| of a
    configuration known to be clean: measure it first, the seed says, never copy an industry threshold), a
    mean above ``clean_factor`` times it (and above 1e-5 nats): another probability path, even far below 0.001.
    """
    mask = loss_mask.bool()
    torch.manual_seed(seed)
    with torch.no_grad():
        a, b = trainer_logprobs().detach(), trainer_logprobs().detach()
        c = (engine_logprobs() if callable(engine_logprobs) else engine_logprobs).detach()
    for name, t in (("A (trainer)", a), ("B (trainer, again)", b), ("C (engine)", c)):
        if t.shape != mask.shape:
            raise ValueError(f"abc_consistency: {name} log-probs: expected shape {tuple(mask.shape)} like "
                             f"loss_mask, got {tuple(t.shape)}")
    tokens = int(mask.sum())
    bad = [name for name, t in (("A", a), ("B", b), ("C", c)) if not bool(torch.isfinite(t[mask]).all())]
    repeat, engine = _spread(a, b, mask), _spread(a, c, mask)
    log_ratio = (a.double() - c.double())[mask]
    outside = (log_ratio > math.log1p(clip_eps[1])) | (log_ratio < math.log1p(-clip_eps[0]))
    share = float(outside.double().mean()) if tokens else 0.0
    if tokens == 0:
        return ABCReport(0, repeat, engine, share, False,
                         f"cannot tell: loss_mask selects no token (shape {tuple(mask.shape)}): nothing to compare",
                         cannot_tell=True)
    if bad:
        return ABCReport(tokens, repeat, engine, share, False,
                         f"cannot tell: non-finite log-probs on loss tokens in {', '.join(bad)}: follow the numeric "
                         "path to the first NaN/Inf before anything else", cannot_tell=True)
    if repeat.max > repeat_tolerance_nats:
        return ABCReport(tokens, repeat, engine, share, False,
                         f"A != B: the trainer gives other log-probs for the same tokens and weights (max |A-B| "
                         f"{repeat.max:.3g} nats > {repeat_tolerance_nats:g}): dropout left on, inputs that change "
                         "between calls, or non-deterministic kernels. Fix repeatability before comparing engines")
    if share > max_outside_clip_ratio:
        return ABCReport(tokens, repeat, engine, share, False,
                         f"ratio clipped before any update: {share:.1%} of loss tokens have exp(A-C) outside "
                         f"[{1 - clip_eps[0]:g}, {1 + clip_eps[1]:g}] with unchanged weights (mean |A-C| "
                         f"{engine.mean:.3g} nats). Stop and fix the probability path (engine precision, a stale "
                         "or unsynced layer, another tokenizer or template)")
    if engine.mean >= engine_gap_stop_nats:
        return ABCReport(tokens, repeat, engine, share, False,
                         f"mean |A-C| {engine.mean:.3g} nats >= {engine_gap_stop_nats:g}: the engine and the trainer "
                         "disagree (seed: mean >= 0.01 stop); check precision and weight sync")
    if clean_gap_nats is not None and engine.mean > max(clean_factor * clean_gap_nats, 1e-5):
        return ABCReport(tokens, repeat, engine, share, False,
                         f"mean |A-C| {engine.mean:.3g} nats is more than {clean_factor:g}x the clean baseline "
                         f"{clean_gap_nats:.3g}: another probability path (engine precision, a kernel, a stale layer) "
                         "though no token is clipped yet")
    note = "healthy" if engine.mean < _LINES.engine_gap_healthy_nats else "within the stop line, above 0.001"
    return ABCReport(tokens, repeat, engine, share, True,
                     f"A = B (max {repeat.max:.3g} nats); A vs C mean {engine.mean:.3g}, p99 {engine.p99:.3g} nats "
                     f"({note}); {share:.2%} of tokens outside the clip range")
