"""Layer 1, trainer against rollout engine: the mismatch metrics that tell numeric noise from a systematic fault.

Seed (第 3 篇 (signal health), 两侧引擎 logprob 差): the mean |Δlogp| is what decides a stop, after "first run your own
baseline with a configuration known to be good". A bf16/fp16 engine's healthy gap is noise of 0.010-0.018 nats (TRL
#5312): zero-mean per token. The faults users hit are systematic, and these readings show it:

* the **signed** mean gap, mean(rollout - old) over tokens sampled from the engine q, is the k1 estimate of
  KL(q || p_trainer) >= 0: noise enters it only to second order (~ sd^2 / 2), a different distribution to first
  order (top-p renormalised log-probs: -log(kept mass) on every token, 0.11 nats at top_p 0.8; a temperature the
  trainer does not apply; stale or partial weights);
* k3 = exp(l) - 1 - l with l = old - rollout, the same KL by a non-negative per-token estimator (prime-rl's
  ``mismatch_kl``, verl ``rollout_corr/k3_kl``); k3 < k1 when the rollout-correction weights do not average 1,
  the signature of a truncated (renormalised) engine distribution;
* chi-square of the rollout-correction weights w = pi_old / pi_rollout = exp(l): E[w^2] - 1 per token and
  E[(prod w)^2] - 1 per sequence (verl ``chi2_token`` / ``chi2_seq``); the per-sequence log-perplexity
  difference mean_t(rollout) - mean_t(old) and its exp (verl ``log_ppl_diff`` / ``ppl_ratio``);
* the weights' distribution *before* any truncation (token, and per sequence the geometric mean
  exp(mean_t l)), and the share a configured cap truncates (TIS) or masks (MIS).

Every reading comes from ``difference`` = rollout - old already taken on the loss mask for the engine gap (one
pass each, no host sync); log weights are clamped to +-20 before exp (verl's safety bound), so no reading
overflows; a non-finite difference reads 0 and leaves the counts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.histogram import histogram, key_counts
from grpo_exporter.functional.histogram_host import Quantiles
from grpo_exporter.functional.reading import Ratio, count, finite, finite_or_zero, fraction, keep_bits, sum64, zeroed

LOG_WEIGHT_BOUND = 20.0  # |log w| clamp before exp (verl SAFETY_BOUND): finite readings for any gap


class Mismatch(NamedTuple):
    k1: Ratio  # mean signed gap rollout - old, nats
    k3: Ratio  # mean exp(l) - 1 - l, nats
    chi2_token: Ratio
    chi2_sequence: Ratio
    log_ppl_diff: Ratio  # mean over sequences of mean_t(rollout - old), nats
    ppl_multiple: Ratio  # mean over sequences of exp(log_ppl_diff_i): training ppl / rollout ppl
    token_weights: Quantiles  # w per finite loss token
    token_weight_sum: Tensor
    sequence_weights: Quantiles  # exp(mean_t l) per sequence with a finite loss token
    sequence_weight_sum: Tensor
    sequences: Tensor  # sequences with a finite loss token
    capped_tokens: Tensor | None  # w above the cap
    capped_sequences: Tensor | None  # geometric w above the cap
    capped_token_share: Ratio | None
    capped_sequence_share: Ratio | None


def mismatch_of(
    difference: Tensor, loss_mask: Tensor, tokens: Tensor, cap: float | None, quantiles: tuple[float, ...],
) -> Mismatch:
    """The mismatch readings of ``difference`` = rollout_logprobs - old_logprobs on the loss mask (fp32, 0
    elsewhere, (N, T)); ``tokens``: its finite loss tokens (the engine gap's count); ``cap``: the
    rollout-correction cap whose truncated / masked share is counted (None: not counted)."""
    delta = finite_or_zero(difference)
    log_w = delta.neg().clamp_(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)  # 0 off the mask and where non-finite
    w = torch.exp(log_w)
    k3 = torch.expm1(log_w).sub_(log_w)  # exp(l) - 1 - l, rounding relative to l (as the ref KL's k3)
    chi = torch.expm1(log_w * 2.0)  # w^2 - 1: 0 off the mask
    valid = loss_mask & finite(difference)
    bits = keep_bits(valid)
    kept = zeroed(w, bits)  # the weights on finite loss tokens, 0 elsewhere: the histogram's and the sum's
    row_tokens = count(valid, dim=1)
    present = row_tokens > 0
    sequences = count(present)
    # per sequence: a row without a finite loss token sums to 0 everywhere below, so only exp(0) = 1 needs a mask
    row_mean = delta.sum(dim=1) / row_tokens.clamp(min=1)  # mean_t(rollout - old)
    log_sum = log_w.sum(dim=1).clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    geometric = torch.exp(row_mean.neg())  # exp(mean_t l)
    geometric_kept = torch.where(present, geometric, 0.0)
    token_h = histogram(w, valid, 0.0 in quantiles, bits, kept, tokens)
    sequence_h = histogram(geometric, present, True, kept=geometric_kept, valid_count=sequences)
    capped_tokens = capped_sequences = None
    token_share = sequence_share = None
    if cap is not None:
        limit = math.log(cap)
        capped_tokens = count(log_w > limit)  # 0 (w = 1 <= cap) off the mask and where non-finite
        capped_sequences = count(present & (row_mean.neg() > limit))
        token_share, sequence_share = fraction(capped_tokens, tokens), fraction(capped_sequences, sequences)
    return Mismatch(
        fraction(sum64(delta), tokens),
        fraction(sum64(k3), tokens),
        fraction(sum64(chi), tokens),
        fraction(torch.expm1(log_sum * 2.0).double().sum(), sequences),
        fraction(row_mean.double().sum(), sequences),
        fraction(torch.expm1(row_mean).double().sum() + sequences, sequences),  # sum of exp over present rows
        Quantiles(token_h, quantiles),
        sum64(kept),
        Quantiles(sequence_h, quantiles),
        geometric_kept.double().sum(),
        sequences,
        capped_tokens,
        capped_sequences,
        token_share,
        sequence_share,
    )


def turn_index(tool_mask: Tensor, turns: int) -> Tensor:
    """(N, T) int64: the model turn each position belongs to in a multi-turn completion, 1 + the tool spans that
    begin before it (a tool span's own positions take the next turn's number; they are off every reading),
    capped at ``turns`` (the last label gathers the later turns)."""
    starts = tool_mask.clone()
    starts[:, 1:] &= ~tool_mask[:, :-1]
    return (starts.cumsum(dim=1) + 1).clamp_(max=turns)


def turn_gaps(gap: Tensor, scored: Tensor, tool_mask: Tensor, turns: int) -> list[Ratio]:
    """Mean |rollout - old| over the finite loss tokens (``scored``) of each model turn 1..``turns`` (the last:
    that turn and every later one), nats, from ``gap`` (the engine gap's (N, T) absolute difference, 0 where not
    scored): one pass to number the turns, one scatter of sums and one of counts, whatever ``turns``; absent for
    a turn no completion reached. verl PR #5229 logs the mismatch per round to find the turn that diverges; a
    turn separator dropped at each tool boundary makes it grow with the turn (verl PR #6921: "compounds each
    turn"), which one mean over all tokens hides."""
    turn = torch.where(scored, turn_index(tool_mask, turns), 0).flatten()
    totals = torch.zeros(turns + 1, dtype=torch.float64, device=gap.device).index_add_(0, turn, gap.flatten().double())
    counts = key_counts(turn, turns + 1)
    return [fraction(totals[k], counts[k]) for k in range(1, turns + 1)]
