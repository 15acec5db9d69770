"""Layer 3, the samples (how many samples decide this update?): advantage signs, importance weights and ESS,
the clip split, zero-variance groups against their prediction, solve rates."""

from __future__ import annotations

import math

import torch

from grpo_exporter import catalog
from grpo_exporter.catalog import format_quantile
from grpo_exporter.functional import samples
from grpo_exporter.functional.reading import fraction, masked_max, zeroed
from grpo_exporter.step.context import Context
from grpo_exporter.step.gather import Gather
from grpo_exporter.step.pack import Element, scalar
from grpo_exporter.step.registry import produces


@produces("grpo_update_tokens_total", "grpo_zero_advantage_tokens_ratio", stages=("update",))
def advantage_signs(out: Gather, ctx: Context) -> None:
    mask, advantages = ctx.x.loss_mask, ctx.x.advantages
    if mask is None or advantages is None:
        return
    signs = samples.advantage_sign_tokens(advantages, mask, ctx.row_tokens, ctx.signs)
    for sign, value in zip(catalog.ADVANTAGE_SIGNS, signs, strict=True):
        out.add("grpo_update_tokens_total", value, advantage_sign=sign)
    total = signs.positive + signs.negative + signs.zero
    out.add("grpo_zero_advantage_tokens_ratio", fraction(signs.zero, total))


@produces("grpo_token_staleness_mean_versions", "grpo_token_staleness_max_versions", stages=("update",))
def token_staleness(out: Gather, ctx: Context) -> None:
    """Staleness as asynchronous frameworks define it (verl fully-async's trajectory staleness): per completion,
    the policy versions since its oldest token was generated; weighted by its loss tokens, and its max."""
    x = ctx.x
    if x.staleness is None or x.loss_mask is None:
        return
    versions = x.staleness.double()
    out.add("grpo_token_staleness_mean_versions", fraction((versions * ctx.row_tokens).sum(), ctx.tokens))
    out.add("grpo_token_staleness_max_versions", masked_max(versions.float(), ctx.row_tokens > 0))


@produces("grpo_aborted_completions_total", stages=("rollout",))
def aborted(out: Gather, ctx: Context) -> None:
    if ctx.x.aborted_completions is not None:
        out.add("grpo_aborted_completions_total", ctx.x.aborted_completions)


@produces("grpo_ess_ratio", "grpo_importance_weight", "grpo_token_importance_weight", stages=("update",))
def importance_weights(out: Gather, ctx: Context) -> None:
    if ctx.log_ratio is None:
        return
    log_ratio, qs, tokens = ctx.weights_log_ratio, ctx.cfg.ratio_quantiles, ctx.weight_tokens
    weights = samples.importance_weights(log_ratio, qs, tokens)
    ess = samples.ess_ratio(log_ratio, tokens, weights.quantiles.stack.maximum,
                            geometric=ctx.cfg.ratio_level == "sequence")
    out.add("grpo_ess_ratio", ess.token, level="token")
    out.add("grpo_ess_ratio", ess.sequence, level="sequence")
    out.summary("grpo_importance_weight", weights.total, weights.count, weights.quantiles, qs)
    out.histogram("grpo_token_importance_weight", weights.quantiles, weights.total)


@produces(
    "grpo_clipped_tokens_total",
    "grpo_out_of_range_unclipped_tokens_total",
    "grpo_clipped_tokens_ratio",
    "grpo_upper_clip_reachable_tokens_total", stages=("update",))
def clipping(out: Gather, ctx: Context) -> None:
    """The clip counts of the loss's own clip: PPO's two bounds, a cap's upper one only (CISPO), none without a
    hard clip (SAPO, VESPO); of the sequence-level ratio under GSPO, whose reach is judged by each row's mean
    old log-prob."""
    cfg = ctx.cfg
    if ctx.log_ratio is None or ctx.x.advantages is None or ctx.x.old_logprobs is None or cfg.clip == "none":
        return
    old = ctx.masked("old_logprobs")
    if cfg.ratio_level == "sequence":
        mean_old = old.sum(1) / ctx.row_tokens.clamp(min=1)
        old = zeroed(mean_old.unsqueeze(1).expand_as(old), ctx.keep)
    cap = cfg.ratio_cap if cfg.clip == "cap" else None
    clip = samples.clip_counts(ctx.weights_log_ratio, ctx.x.advantages, old, cfg.clip_eps_low, cfg.clip_eps_high,
                               ctx.row_tokens, old_masked=True, signs=ctx.signs, cap=cap)
    out.add("grpo_upper_clip_reachable_tokens_total", clip.reachable)
    out.add("grpo_clipped_tokens_total", clip.upper, bound="upper")
    out.add("grpo_out_of_range_unclipped_tokens_total", clip.upper_unclipped, bound="upper")
    out.add("grpo_clipped_tokens_ratio", clip.upper_ratio, bound="upper")
    if cap is None:
        out.add("grpo_clipped_tokens_total", clip.lower, bound="lower")
        out.add("grpo_out_of_range_unclipped_tokens_total", clip.lower_unclipped, bound="lower")
        out.add("grpo_clipped_tokens_ratio", clip.lower_ratio, bound="lower")


@produces(
    "grpo_groups_total",
    "grpo_zero_variance_groups_total",
    "grpo_zero_variance_groups_ratio",
    "grpo_zero_variance_groups_expected_ratio",
    "grpo_all_incorrect_groups_expected_ratio",
    "grpo_kept_groups_ratio", stages=("rollout",))
def zero_variance(out: Gather, ctx: Context) -> None:
    x, groups = ctx.x, ctx.groups
    if groups is None:
        return
    if x.rewards is not None:
        zv = samples.zero_variance_groups(x.rewards, groups, x.correct)
        out.add("grpo_groups_total", zv.groups)
        out.add("grpo_zero_variance_groups_total", zv.all_correct, outcome="all_correct")
        out.add("grpo_zero_variance_groups_total", zv.all_incorrect, outcome="all_incorrect")
        out.add("grpo_zero_variance_groups_total", zv.unknown, outcome="unknown")
        out.add("grpo_zero_variance_groups_ratio", zv.share)
        if x.generated_groups is not None:
            generated = scalar(x.generated_groups, torch.float64, zv.groups.device)
            out.add("grpo_kept_groups_ratio", fraction(zv.groups, generated))
            # every kept group was generated: more kept than generated cannot be true (a value check read with the
            # transfer, naming generated_groups; its count is the groups kept). Kept + filtered may pass generated:
            # a loop whose rounds cannot fill the batch tops it up with groups it had filtered
            kept = zv.groups.to(torch.int64)
            out.checks.append(("generated_groups", torch.where(kept > generated, kept, 0)))
    if x.zero_variance_prob is not None:
        expected = samples.expected_zero_variance_ratio(x.zero_variance_prob, groups)
        out.add("grpo_zero_variance_groups_expected_ratio", expected)
    if x.all_incorrect_prob is not None:
        out.add("grpo_all_incorrect_groups_expected_ratio", samples.expected_zero_variance_ratio(x.all_incorrect_prob,
                                                                                             groups))


@produces("grpo_generated_groups_total", "grpo_filtered_groups_total", stages=("rollout",))
def dynamic_sampling(out: Gather, ctx: Context) -> None:
    """What a dynamic-sampling loop (DAPO) counted while filling the batch (seed 第 4 篇 4.1: record how many
    groups it generated, beside the zero-variance share), taken as counted."""
    x = ctx.x
    if x.generated_groups is not None:
        out.add("grpo_generated_groups_total", x.generated_groups)
    for outcome, count in (("all_correct", x.filtered_all_correct_groups),
                           ("all_incorrect", x.filtered_all_incorrect_groups)):
        if count is not None:
            out.add("grpo_filtered_groups_total", count, outcome=outcome)


@produces("grpo_mixed_group_solve_rate_ratio", stages=("rollout",))
def solve_rates(out: Gather, ctx: Context) -> None:
    x, groups, buckets = ctx.x, ctx.groups, ctx.cfg.solve_rate_buckets
    if x.correct is None or groups is None:
        return
    hist = samples.mixed_group_solve_rates(x.correct, groups, buckets)
    name = "grpo_mixed_group_solve_rate_ratio"
    for i, bound in enumerate((*buckets, math.inf)):
        le = "+Inf" if bound == math.inf else format_quantile(bound)
        out.add(name, Element(hist.cumulative, i), "_bucket", le=le)
    out.add(name, hist.total, "_sum")
    out.add(name, hist.count, "_count")
