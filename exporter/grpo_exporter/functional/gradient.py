"""Layer 1, "does the gradient match what I think?": probability consistency, masks, numerics, update size.

Seed sections: 两侧引擎的 logprob 差 (engine gap), 第 1 步 最小一致性测试 (ratio clipped before any update),
第 2 步 mask (loss_mask.sum() == completion tokens), 第 3 步 NaN/Inf and the log-ratio clamp, 第 4 步 grad norm
before/after clipping and |dtheta|/|theta|.

All functions take tensors and return 0-d tensors (or readings of them): no host sync, fp32 arithmetic, and
masked positions replaced before any arithmetic so a -inf padding sentinel never produces NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.histogram import histogram
from grpo_exporter.functional.histogram_host import Quantiles
from grpo_exporter.functional.reading import (
    Extreme,
    Ratio,
    count,
    count_nonfinite,
    finite,
    finite_or_zero,
    fraction,
    keep_bits,
    largest,
    nonfinite,
    sum64,
    zeroed,
)


class LogRatio(NamedTuple):
    """Per-token log ratio in fp32 (0 outside the loss mask), where it is a finite loss token, and the ratio
    exp(log ratio), after the user's own clamp when one is configured (computed once: every ratio metric of
    the step reads it)."""

    value: Tensor
    valid: Tensor
    loss_mask: Tensor
    ratio: Tensor
    exponent: Tensor  # log of ``ratio``: the log ratio after the clamp (the importance weights' log)
    keep: Tensor  # keep_bits(valid): the ratio metrics mask with it several times


def masked_difference(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """``a - b`` in fp32 on ``mask``, 0 elsewhere; padding values never enter the subtraction."""
    bits = keep_bits(mask)
    return zeroed(a, bits) - zeroed(b, bits)


def log_ratio(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor, clamp: float | None = None) -> LogRatio:
    """log pi_theta - log pi_old on loss tokens, in fp32 (seed 4.1: subtract in fp32, never in bf16).

    ``clamp``: the |log ratio| clamp the training loss applies before exp (seed 4.2: clamp, then exp). The
    ratio is then exp(clamp(log ratio)), as the loss sees it: a finite log ratio above 88.7 is a fuse hit,
    not an overflow. Without it the ratio is exp(log ratio) and such a token counts as a non-finite ratio.
    """
    return log_ratio_of(masked_difference(logprobs, old_logprobs, loss_mask), loss_mask, clamp)


def log_ratio_of(value: Tensor, loss_mask: Tensor, clamp: float | None = None) -> LogRatio:
    """:func:`log_ratio` from the fp32 difference already taken on loss tokens (0 elsewhere)."""
    exponent = value if clamp is None else value.clamp(-clamp, clamp)
    valid = loss_mask & finite(value)
    return LogRatio(value, valid, loss_mask, torch.exp(exponent), exponent, keep_bits(valid))


def sequence_log_ratio(log_ratios: LogRatio, row_tokens: Tensor) -> LogRatio:
    """The sequence-level log ratio of GSPO, mean_t log r_it over each row's loss tokens, on every one of them:
    the ratio s_i = exp(mean) the loss clips and weights each of the sequence's tokens by (TRL
    ``importance_sampling_level="sequence"``). A row with a non-finite loss token has no ratio (its mean is not
    finite in the loss either): none of its tokens is valid. ``row_tokens``: (N,) loss tokens per row."""
    whole = count(log_ratios.valid, 1) == row_tokens
    rows = row_tokens.clamp(min=1)
    value = zeroed(log_ratios.value, log_ratios.keep).sum(1) / rows
    exponent = zeroed(log_ratios.exponent, log_ratios.keep).sum(1) / rows
    valid = log_ratios.loss_mask & whole.unsqueeze(1)
    bits = keep_bits(valid)
    value_t = zeroed(value.unsqueeze(1).expand_as(log_ratios.value), bits)
    exponent_t = zeroed(exponent.unsqueeze(1).expand_as(log_ratios.value), bits)
    return LogRatio(value_t, valid, log_ratios.loss_mask, torch.exp(exponent_t), exponent_t, bits)


class EngineGap(NamedTuple):
    total: Tensor
    count: Tensor  # type: ignore[assignment]  # a field, shadowing tuple.count
    mean: Ratio
    quantiles: Quantiles
    absolute: Tensor  # (N, T) |rollout - old|, 0 off the loss mask and where non-finite: the per-turn means' too


def engine_gap_of(
    difference: Tensor, loss_mask: Tensor, tokens: Tensor, quantiles: Sequence[float]
) -> EngineGap:
    """|rollout_logprobs - old_logprobs| on finite loss tokens, nats, from ``difference`` = rollout - old
    already taken on loss tokens (fp32, 0 elsewhere; ``tokens``: the loss tokens where it is finite, the
    caller's count, e.g. ``count(loss_mask) - count_nonfinite(difference)``): sum, count, mean and
    quantiles. A non-finite difference reads 0 and leaves the count, so no validity mask is built (only for
    the exact minimum, when q = 0 is asked for).

    Seed (第 3 篇 (signal health) §3): mean < 0.001 is usually healthy, mean near or above 0.01 stop and check;
    p99/p99.9 track the worst tokens; max locates samples but never carries the 0.01 line.
    """
    kept = finite_or_zero(difference).abs_()
    total = sum64(kept)
    exact_min = 0.0 in quantiles
    valid = loss_mask & finite(difference) if exact_min else None
    h = histogram(kept, valid, exact_min, kept=kept, valid_count=tokens)
    return EngineGap(total, tokens, fraction(total, tokens), Quantiles(h, quantiles), kept)


class OnPolicyCheck(NamedTuple):
    outside: Tensor
    checked: Tensor
    outside_ratio: Ratio
    abs_log_ratio_max: Extreme


def onpolicy_check(log_ratios: LogRatio, eps_low: float, eps_high: float, rows: Tensor | None = None) -> OnPolicyCheck:
    """On the first update of a fresh rollout batch the ratio must be 1.

    Counts loss tokens whose ratio already lies outside [1-eps_low, 1+eps_high] whatever the advantage
    sign (seed 1.1: "未训先大面积撞 clip" = stop training and fix the probability path), and max |log ratio|;
    ``rows`` (N,) bool limits the check to the on-policy sequences. Always per token, whatever ratio the loss
    weights by: the probability path is a per-token property (``MetricsConfig.onpolicy_eps`` gives the band).
    """
    valid = log_ratios.valid if rows is None else log_ratios.valid & rows.unsqueeze(1)
    outside = valid & ((log_ratios.ratio > 1.0 + eps_high) | (log_ratios.ratio < 1.0 - eps_low))
    checked, out = count(valid), count(outside)
    present = checked > 0
    # |x| >= 0: zeros never win
    top = largest(zeroed(log_ratios.value.abs(), log_ratios.keep if rows is None else valid), 0.0)
    return OnPolicyCheck(out, checked, fraction(out, checked),
                         Extreme(torch.where(present, top, 0.0), present, largest=True))


def nonfinite_count(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Number of NaN/Inf entries of ``x`` (only where ``mask`` is True, when given)."""
    return count(nonfinite(x) & mask) if mask is not None else count_nonfinite(x)


class MaskAudit(NamedTuple):
    length_mismatch: Tensor
    empty: Tensor
    outside_completion: Tensor
    on_tool: Tensor | None = None  # loss tokens on tool output (with a tool mask)
    tool_span_lengths: Tensor | None = None  # sequences whose length counts their tool tokens (with a tool mask)


def completion_positions(completion_lengths: Tensor, width: int) -> Tensor:
    """(N, width) bool: position t holds a completion token iff t < completion_lengths[i]."""
    t = torch.arange(width, device=completion_lengths.device)
    return t.unsqueeze(0) < completion_lengths.unsqueeze(1)


def mask_audit(
    loss_mask: Tensor, completion_lengths: Tensor, completion_mask: Tensor | None = None,
    row_tokens: Tensor | None = None, positions: Tensor | None = None, tool_mask: Tensor | None = None,
) -> MaskAudit:
    """Audit the loss mask against the rollout engine's completion lengths (seed 第 2 步).

    * length mismatch: sequences with loss tokens whose loss-token count differs from their length;
    * empty: sequences with a completion but no loss token (masked whole: counted as a reason, not a bug);
    * outside completion: loss tokens on positions that are not completion tokens (prompt, tool, padding),
      judged by ``completion_mask`` when given, else by t < completion_lengths (``positions``: that (N, T)
      mask, when the caller has it).

    With ``tool_mask`` (the positions the environment wrote inside a multi-turn completion), two more reasons,
    told apart from a mask bug: loss tokens on tool output (the loss trains the model on text it never
    sampled: verl #4412, slime #1370), and a length that counts the tool tokens (measured as a span, not as
    the model's tokens: OpenRLHF PR #1252, whose overlong penalties then fired falsely), which is then no
    length mismatch. The lengths are the model's tokens, and so are the loss tokens counted against them
    (``row_tokens``: the loss tokens off the tool positions, per row, when the caller has them).
    """
    model_mask = loss_mask if tool_mask is None else loss_mask & ~tool_mask
    counts = count(model_mask, dim=1) if row_tokens is None else row_tokens
    lengths = completion_lengths.to(counts.dtype)
    if positions is None:
        positions = completion_mask if completion_mask is not None else completion_positions(
            completion_lengths, loss_mask.shape[1]
        )
    wrong = (counts > 0) & (counts != lengths)
    on_tool = span = None
    if tool_mask is not None:
        on_tool = count(loss_mask & tool_mask)
        spans = wrong & (counts + count(tool_mask, dim=1).to(counts.dtype) == lengths)
        wrong, span = wrong & ~spans, spans.sum()
    return MaskAudit(wrong.sum(), ((counts == 0) & (lengths > 0)).sum(), count(loss_mask & ~positions), on_tool, span)


class ClampHits(NamedTuple):
    hits: Tensor
    hit_ratio: Ratio


def clamp_hits(log_ratios: LogRatio, bound: float, loss_tokens: Tensor | None = None) -> ClampHits:
    """Loss tokens whose |log ratio| reached the numerical clamp ``bound`` (the fuse; seed 4.2-4.3).

    Non-finite log ratios count as hits: they are what the fuse exists for. The log ratio is 0 off the loss
    mask, so the positions below the bound are counted over the whole tensor and the rest are the hits.
    """
    hits = log_ratios.value.numel() - count(log_ratios.value.abs() < bound * (1.0 - 1e-6))
    return ClampHits(hits, fraction(hits, count(log_ratios.loss_mask) if loss_tokens is None else loss_tokens))


def total_norm(tensors: Sequence[Tensor]) -> Tensor:
    """Global L2 norm of a list of tensors (e.g. gradients), accumulated in fp32."""
    norms = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32) for t in tensors]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clipped_norm(pre_clip: Tensor, max_norm: Tensor | float) -> Tensor:
    """Norm after ``torch.nn.utils.clip_grad_norm_``: scaled by min(1, max_norm / (pre + 1e-6))."""
    pre = pre_clip.float()
    limit = max_norm.float() if isinstance(max_norm, Tensor) else float(max_norm)  # a number: no tensor from it
    return pre * (limit / (pre + 1e-6)).clamp(max=1.0)


def relative_update(before: Sequence[Tensor], after: Sequence[Tensor]) -> Ratio:
    """|theta_after - theta_before| / |theta_before| over (sampled) parameters; absent when |theta| = 0."""
    delta = total_norm([a.detach().float() - b.detach().float() for a, b in zip(after, before, strict=True)])
    return fraction(delta, total_norm(before))


def kl_k3_of(d: Tensor, tokens: Tensor) -> Ratio:
    """Mean per-token KL(pi_theta || pi_ref) by the k3 estimator exp(d) - d - 1 (Schulman), from d = ref - logp
    already taken on loss tokens (fp32, 0 elsewhere; ``tokens``: the loss tokens where d is finite, the caller's
    count), over finite loss tokens;
    unbiased and non-negative per token. Taken as expm1(d) - d: two passes, and fp32 rounding relative to d
    instead of to 1 (exp(d) - 1 loses the d^2/2 of a policy near its reference). A non-finite d reads 0 (whose
    k3 is 0) and leaves the count."""
    kept = finite_or_zero(d)
    return fraction(sum64(torch.expm1(kept).sub_(kept)), tokens)
