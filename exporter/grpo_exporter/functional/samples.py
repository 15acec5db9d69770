"""Layer 3, "how many samples decide this update?": ESS, clip fractions by sign, ratio tails, zero variance.

Seed sections: 第 3 篇 (signal health) §1 (zero-variance share against E[p^G + (1-p)^G], never a fixed 50%;
token-level dilution), §2 (upper and lower clip counted apart and read against the advantage sign), §5 (ESS ratio,
the early warning), and 第 5 篇 (clip asymmetry) §一/§四 (the PPO min() only truly cuts the gradient when ratio and
advantage point the same way: upper = A>0 and r>1+eps_high, lower = A<0 and r<1-eps_low).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.constants import constant
from grpo_exporter.functional.gradient import LogRatio
from grpo_exporter.functional.groups import Groups, group_stats
from grpo_exporter.functional.histogram import histogram
from grpo_exporter.functional.histogram_host import Quantiles
from grpo_exporter.functional.reading import (
    Ratio,
    count,
    count_nonfinite,
    filled,
    finite,
    finite_or_zero,
    fraction,
    keep_bits,
    largest,
    sum64,
    zeroed,
)


def clip_log_widths(eps_low: float, eps_high: float) -> tuple[float, float]:
    """Widths of the clip range in log space, (-log(1-eps_low), log(1+eps_high)), nats.

    Seed 第 5 篇 (clip asymmetry) §1.1: the default [0.8, 1.2] is symmetric in ratio but not in log space, 0.223 below
    against 0.182 above (ratio ~1.225), so the lower side is reached later and counts differ by geometry alone.
    """
    return -math.log1p(-eps_low), math.log1p(eps_high)


def symmetric_eps_high(eps_low: float) -> float:
    """eps_high that makes the clip range symmetric in log space: eps_low / (1 - eps_low) (seed §1.2)."""
    return eps_low / (1.0 - eps_low)


class SignedRows(NamedTuple):
    """Where the advantage is finite and of each sign: (N, 1) bool per row for sequence-level advantages
    (``per_row``; count loss tokens through the loss tokens per row), (N, T) for token-level ones, where the
    loss mask is already applied."""

    positive: Tensor
    negative: Tensor
    zero: Tensor
    per_row: bool


def advantage_signs(advantages: Tensor, loss_mask: Tensor, atol: float = 0.0) -> SignedRows:
    """Finite advantages by sign; within ``atol`` of 0 an advantage is zero (a group of equal rewards leaves
    the rounding of its mean, divided by the std's eps: ~1e-3 for rewards of ~1 in fp32, not an exact 0). An
    (N,) advantage is judged once per row, never expanded to (N, T): a sequence-level advantage costs O(N),
    not O(N T)."""
    if advantages.dim() == 1:
        a = advantages.float().unsqueeze(1)
        ok = finite(a)
        return SignedRows(ok & (a > atol), ok & (a < -atol), ok & (a.abs() <= atol), True)
    a = advantages.float()
    signed = loss_mask & finite(a)
    return SignedRows(signed & (a > atol), signed & (a < -atol), signed & (a.abs() <= atol), False)


def _tokens(selected: Tensor, signs: SignedRows, row_tokens: Tensor) -> Tensor:
    """Loss tokens in ``selected``: by rows (``row_tokens`` (N,) loss tokens per row) or by tokens."""
    if signs.per_row:
        return (row_tokens * selected.squeeze(1)).sum()
    return count(selected)


class Effective(Ratio):
    """An ESS ratio reading ((sum w)^2 / (sum w^2) over n, a :class:`Ratio`), with its log weights kept for
    merging across ranks."""

    __slots__ = ("log_weights", "valid")

    def __init__(self, ratio: Ratio, log_weights: Tensor, valid: Tensor) -> None:
        super().__init__(ratio.numerator, ratio.denominator)
        self.log_weights, self.valid = log_weights, valid


def shifted_weight_sums(log_weights: Tensor, valid: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """(sum w, sum w^2) with w = exp(log_weights - shift) over ``valid`` (a bool mask or its keep_bits);
    ``shift`` must be >= every valid log weight (their max, so that no w overflows and the largest is 1; ESS is
    scale invariant, so any such shift gives the same ratio). Elsewhere w may be anything, NaN included: the
    mask zeroes it after the exp. The weights are fp32 (relative error ~1e-7 each; fp64 exp costs ~15x on CPU),
    the sums fp64."""
    weights = log_weights if log_weights.dtype == torch.float32 else log_weights.float()
    w = zeroed(torch.exp(weights - (shift if shift.dtype == torch.float32 else shift.float())), valid)
    return sum64(w), sum64(w.square())


def ess_from_sums(s1: Tensor, s2: Tensor, n: Tensor) -> Ratio:
    """ESS ratio (sum w)^2 / (sum w^2) / n."""
    return fraction(s1.square() / s2.clamp(min=torch.finfo(torch.float64).tiny), n)


def _ess(log_weights: Tensor, valid: Tensor, bits: Tensor | None = None, n: Tensor | None = None,
         shift: Tensor | None = None) -> Effective:
    """(sum w)^2 / (sum w^2) / n with w = exp(log_weights), shifted by the max log weight first so that
    huge ratios neither overflow nor vanish (``bits``: keep_bits of ``valid``; ``n``: its count; ``shift``: a
    number >= every valid log weight; when the caller has them). With no valid weight n = 0 and the reading is
    absent, whatever the shift."""
    bits = keep_bits(valid) if bits is None else bits
    if shift is None:
        shift = largest(filled(log_weights, bits, torch.finfo(torch.float32).min), 0.0)
    s1, s2 = shifted_weight_sums(log_weights, bits, shift)
    r = ess_from_sums(s1, s2, count(valid) if n is None else n)
    return Effective(r, log_weights, valid)


class ESS(NamedTuple):
    token: Effective
    sequence: Effective


def ess_ratio(log_ratios: LogRatio, tokens: Tensor | None = None, largest_ratio: Tensor | None = None,
              geometric: bool = False) -> ESS:
    """ESS ratio of the importance weights of loss tokens, and of sequences with w_i = exp(sum_t log r_it)
    (the sequence-level importance weight) over sequences with at least one finite loss token (``tokens``: the
    finite loss tokens, when the caller has them). ``geometric``: the sequence weight is exp(mean_t log r_it)
    instead, the ratio a sequence-level loss (GSPO) weights by.

    ``largest_ratio``: the largest ratio over the finite loss tokens (the ratio histogram's exact max), when the
    caller has it: the token weights are then shifted by its log, which costs no pass over the tokens. Where it
    overflowed to +inf the shift is the largest log weight (> 88, the max of the log weights with 0 off the valid
    tokens, which the sequence sums take anyway); where it underflowed to 0 (every log ratio below -103.9) the
    weights do too and the token ESS reads 0. Within those bounds it equals the exact shift to a few ulps (to 4%
    for subnormal ratios), enough to keep every weight <= ~1 and the largest ~1."""
    kept = zeroed(log_ratios.exponent, log_ratios.keep)
    seq_log_w = kept.sum(dim=1)
    if geometric:
        seq_log_w = seq_log_w / count(log_ratios.valid, 1).clamp(min=1)
    shift = None
    if largest_ratio is not None:  # log(+inf) and log(0) are not finite: the fallback
        log_largest = largest_ratio.log()  # the histogram maximum: fp32
        shift = torch.where(torch.isfinite(log_largest), log_largest, largest(kept, 0.0).clamp(min=0.0))
    token = _ess(log_ratios.exponent, log_ratios.valid, log_ratios.keep, tokens, shift)
    return ESS(token, _ess(seq_log_w, count(log_ratios.valid, 1) > 0))


class SignCounts(NamedTuple):
    positive: Tensor
    negative: Tensor
    zero: Tensor


def advantage_sign_tokens(
    advantages: Tensor, loss_mask: Tensor, row_tokens: Tensor | None = None, signs: SignedRows | None = None
) -> SignCounts:
    """Loss tokens with a finite advantage, by sign (``advantages`` (N,) or (N, T); ``row_tokens``: the loss
    tokens per row, ``signs``: :func:`advantage_signs`, when the caller has them)."""
    signs = advantage_signs(advantages, loss_mask) if signs is None else signs
    row_tokens = count(loss_mask, dim=1) if row_tokens is None else row_tokens
    return SignCounts(*(_tokens(m, signs, row_tokens) for m in (signs.positive, signs.negative, signs.zero)))


class ClipCounts(NamedTuple):
    reachable: Tensor
    upper: Tensor
    lower: Tensor
    upper_unclipped: Tensor
    lower_unclipped: Tensor
    upper_ratio: Ratio
    lower_ratio: Ratio


def clip_counts(
    log_ratios: LogRatio, advantages: Tensor, old_logprobs: Tensor, eps_low: float, eps_high: float,
    row_tokens: Tensor | None = None, old_masked: bool = False, signs: SignedRows | None = None,
    cap: float | None = None,
) -> ClipCounts:
    """Truly clipped tokens by bound, the opposite-sign out-of-range tokens apart, and per-step fractions
    normalised by the tokens of the gating sign (upper / positive-advantage, lower / negative-advantage).

    The denominators are the loss tokens with a finite advantage of that sign, exactly the
    ``grpo_update_tokens_total`` counters, so a windowed counter ratio equals the pooled per-step fraction;
    a token whose log ratio is not finite cannot be classified and is never counted as clipped.
    ``reachable``: the positive-advantage tokens where the upper clip can bind at all, p_old < 1/(1+eps_high)
    (r = p_new/p_old <= 1/p_old): in a solved task most positive tokens sit at p_old ~1 and a missing upper
    clip says nothing about asymmetry. ``advantages`` (N,) or (N, T); (N,) is counted per row (O(N) after one
    row sum per token mask). ``old_logprobs`` may hold anything off the loss mask (padding), unless
    ``old_masked`` (it is 0 there); ``row_tokens``: the loss tokens per row, ``signs``: :func:`advantage_signs`,
    when the caller has them.

    ``cap``: a ratio cap instead of the PPO band (CISPO's min(r, cap) weight): the upper line is the cap, a
    token at p_old < 1/cap can reach it, and there is no lower line (the lower counts read 0 and the caller
    leaves them out). A sequence-level ratio (:func:`~grpo_exporter.functional.gradient.
    sequence_log_ratio`, GSPO) is counted the same way: each loss token of a sequence beyond a line is cut,
    and ``old_logprobs`` then holds each row's mean old log-prob on its loss tokens.
    """
    signs = advantage_signs(advantages, log_ratios.loss_mask) if signs is None else signs
    upper_line = 1.0 + eps_high if cap is None else cap
    above = log_ratios.valid & (log_ratios.ratio > upper_line)
    below = log_ratios.valid & (log_ratios.ratio < 1.0 - eps_low) if cap is None else torch.zeros_like(above)
    old = old_logprobs.float() if old_masked else zeroed(old_logprobs, log_ratios.loss_mask)
    room = old < -math.log(upper_line)  # 0 off the mask: never below
    if signs.per_row:
        pos, neg = signs.positive.squeeze(1), signs.negative.squeeze(1)
        above_rows, below_rows, room_rows = count(above, 1), count(below, 1), count(room, 1)
        row_tokens = count(log_ratios.loss_mask, 1) if row_tokens is None else row_tokens
        upper, lower = (above_rows * pos).sum(), (below_rows * neg).sum()
        return ClipCounts(
            (room_rows * pos).sum(), upper, lower, (above_rows * neg).sum(), (below_rows * pos).sum(),
            fraction(upper, (row_tokens * pos).sum()), fraction(lower, (row_tokens * neg).sum()),
        )
    positive, negative = signs.positive, signs.negative
    upper, lower = count(positive & above), count(negative & below)
    return ClipCounts(
        count(positive & room),
        upper,
        lower,
        count(negative & above),
        count(positive & below),
        fraction(upper, count(positive)),
        fraction(lower, count(negative)),
    )


class ImportanceWeights(NamedTuple):
    """The per-token ratio's distribution over finite loss tokens, and its sum and count over those whose ratio
    is finite (an overflowed ratio never enters the cumulative ``_sum``)."""

    quantiles: Quantiles
    total: Tensor
    count: Tensor  # type: ignore[assignment]  # a field, shadowing tuple.count


def importance_weights(log_ratios: LogRatio, quantiles: Sequence[float], tokens: Tensor) -> ImportanceWeights:
    """Quantiles of the per-token ratio exp(log ratio) over finite loss tokens (may be +Inf, never NaN), and
    the sum and count of its finite values; ``tokens``: the finite loss tokens (``count(log_ratios.valid)``)."""
    kept = zeroed(log_ratios.ratio, log_ratios.keep)
    h = histogram(log_ratios.ratio, log_ratios.valid, 0.0 in quantiles, log_ratios.keep, kept, tokens)
    weights = Quantiles(h, quantiles)
    return ImportanceWeights(weights, sum64(finite_or_zero(kept)), tokens - count_nonfinite(kept))


class ZeroVariance(NamedTuple):
    groups: Tensor
    all_correct: Tensor
    all_incorrect: Tensor
    unknown: Tensor
    share: Ratio


def zero_variance_groups(rewards: Tensor, groups: Groups, correct: Tensor | None) -> ZeroVariance:
    """Groups whose finite rewards are all equal, split by outcome when ``correct`` is given.

    Equality is exact (range == 0): a std computed in floating point can be a tiny non-zero for equal values.
    Without ``correct`` every zero-variance group is 'unknown'; with it, a zero-variance group whose
    correctness is mixed (a reward that ignores correctness) is 'unknown' too.
    """
    stats = group_stats(rewards, groups)
    populated = groups.sizes() > 0
    zero = populated & (stats.range == 0)
    n_groups = populated.sum()
    if correct is None:
        all_correct = all_incorrect = torch.zeros((), dtype=torch.int64, device=rewards.device)
        unknown = zero.sum()
    else:
        hits = groups.count(correct)
        sizes = groups.sizes()
        all_correct = (zero & (hits == sizes)).sum()
        all_incorrect = (zero & (hits == 0)).sum()
        unknown = zero.sum() - all_correct - all_incorrect
    return ZeroVariance(n_groups, all_correct, all_incorrect, unknown, fraction(zero.sum(), n_groups))


def zero_variance_probability(p: Tensor, size: Tensor | float) -> Tensor:
    """p^G + (1-p)^G: the chance that G independent samples at solve rate p are all correct or all wrong
    (seed 第 3 篇 (signal health) §1), fp64."""
    p = p.double().clamp(0.0, 1.0)
    return p.pow(size) + (1.0 - p).pow(size)


def beta_binomial_zero_variance(alpha: Tensor, beta: Tensor, size: Tensor | float) -> Tensor:
    """E[p^G + (1-p)^G] for p ~ Beta(alpha, beta): B(a+G, b)/B(a, b) + B(a, b+G)/B(a, b), fp64.

    The Beta-binomial probability of k = G or k = 0: the prediction averaged over the solve rates a prompt may
    have, not taken at their mean (the function is convex; the mean underestimates it). The six log-gammas
    are taken in one call and combined by one product with their signs (a dozen operators where one call per
    term took thirty: this runs on every rollout). ``size``: per sample, or one G for all (contiguous groups)."""
    return beta_binomial_extremes(alpha, beta, size).sum(dim=0).clamp(0.0, 1.0)


def beta_binomial_extremes(alpha: Tensor, beta: Tensor, size: Tensor | float) -> Tensor:
    """(2, ...) fp64: E[p^G] (all correct) and E[(1-p)^G] (all incorrect) for p ~ Beta(alpha, beta), the two
    parts of :func:`beta_binomial_zero_variance` (the seed reads them apart: all-correct beyond prediction is
    "data too easy", all-incorrect beyond it a verifier or ability problem). Inputs as that function's."""
    a = alpha if alpha.dtype == torch.float64 else alpha.double()
    b = beta if beta.dtype == torch.float64 else beta.double()
    g: Tensor | float = size
    if isinstance(size, Tensor):
        g = size if size.dtype == torch.float64 else size.double()
        if not a.shape == b.shape == g.shape:
            a, b, g = torch.broadcast_tensors(a, b, g)
    elif a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)
    ab = a + b
    logs = torch.lgamma(torch.stack([a, b, ab, a + g, b + g, ab + g]))
    signs = constant(_BETA_SIGNS, torch.float64, logs.device).view(2, 6)
    return (signs @ logs.reshape(6, -1)).exp().reshape(2, *a.shape).clamp(0.0, 1.0)


# log B(a+G, b) - log B(a, b) = lgG(a+G) - lgG(a+b+G) - lgG(a) + lgG(a+b); the same with b+G for k = 0
_BETA_SIGNS = (-1.0, 0.0, 1.0, 1.0, 0.0, -1.0, 0.0, -1.0, 1.0, 0.0, 1.0, -1.0)


def expected_zero_variance_ratio(zero_variance_prob: Tensor, groups: Groups) -> Ratio:
    """The predicted zero-variance share of the batch's groups (seed 第 3 篇 (signal health) §1): per group the mean of
    its members' finite ``zero_variance_prob`` (each sample carries its group's prediction), averaged over groups."""
    valid = torch.isfinite(zero_variance_prob)
    members = groups.count(valid)
    has = members > 0
    expected = (groups.sum(torch.where(valid, zero_variance_prob.double(), 0.0)) / members.clamp(min=1)).clamp(0, 1)
    return fraction(torch.where(has, expected, 0.0).sum(), has.sum())


class SolveRateHistogram(NamedTuple):
    cumulative: Tensor  # (len(buckets) + 1,) counts with solve rate <= bound; the last is +Inf
    total: Tensor
    count: Tensor  # type: ignore[assignment]  # a field, shadowing tuple.count


def mixed_group_solve_rates(correct: Tensor, groups: Groups, buckets: Sequence[float]) -> SolveRateHistogram:
    """Histogram of the solve rate c/n of groups with mixed outcomes (0 < c < n): are they piled at the
    ends, where sigma normalisation gives the lone minority the largest weight (seed 第 4 篇 (collapse root causes),
    落地顺序 2: the order of fixes)?"""
    hits = groups.count(correct).double()
    sizes = groups.sizes().double()
    mixed = (hits > 0) & (hits < sizes)
    rate = hits / sizes.clamp(min=1.0)
    bounds = constant([*buckets, math.inf], torch.float64, correct.device)
    cumulative = (mixed.unsqueeze(0) & (rate.unsqueeze(0) <= bounds.unsqueeze(1))).sum(dim=1)
    return SolveRateHistogram(cumulative, torch.where(mixed, rate, 0.0).sum(), mixed.sum())
