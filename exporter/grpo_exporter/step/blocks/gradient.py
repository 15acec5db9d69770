"""Layer 1, the gradient (does the gradient match what I think?): non-finite inputs, the engine gap and
mismatch, the on-policy check and clamp hits, the loss-mask audit, the KL to the reference, grad norms and
the update size."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.functional import gradient, mismatch
from grpo_exporter.functional.reading import count, count_nonfinite, finite
from grpo_exporter.step.context import Context
from grpo_exporter.step.gather import Gather
from grpo_exporter.step.pack import Witnessed, scalar
from grpo_exporter.step.registry import produces


@produces("grpo_rollout_unscored_tokens_total",
          nonfinite=("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy", "advantages",
                     "rewards", "reward_components", "loss"), stages=("rollout", "update"))
def nonfinite_inputs(out: Gather, ctx: Context) -> None:
    x, mask = ctx.x, ctx.x.loss_mask
    if mask is not None:
        witnesses = ctx.witnesses
        for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy"):
            if getattr(x, name) is None:
                continue
            masked, witness = ctx.masked(name), witnesses.get(name)  # 0 off the mask: counted over the whole tensor
            if name == "rollout_logprobs" and ctx.cfg.rollout_logprob_nan == "unscored":
                out.add("grpo_nonfinite_values_total", count(torch.isinf(masked)), tensor=name)
                out.add("grpo_rollout_unscored_tokens_total", count(torch.isnan(masked)))
                continue
            tally = ctx.nonfinite(masked) if witness is None else Witnessed(masked, witness)
            out.add("grpo_nonfinite_values_total", tally, tensor=name)
    if x.advantages is not None and (x.advantages.dim() == 1 or mask is not None):
        adv_mask = None if x.advantages.dim() == 1 else mask
        out.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.advantages, adv_mask), tensor="advantages")
    if x.rewards is not None:
        out.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.rewards), tensor="rewards")
    if x.reward_components:
        bad = sum(gradient.nonfinite_count(v) for v in x.reward_components.values())
        out.add("grpo_nonfinite_values_total", bad, tensor="reward_components")
    if isinstance(x.loss, Tensor):
        out.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.loss), tensor="loss")
    elif x.loss is not None:
        out.add("grpo_nonfinite_values_total", 0.0 if math.isfinite(x.loss) else 1.0, tensor="loss")


@produces("grpo_engine_logprob_gap_nats", "grpo_token_engine_logprob_gap_nats", "grpo_engine_logprob_gap_mean_nats",
          "grpo_engine_logprob_gap_turn_mean_nats", stages=("rollout",))
def engine_gap(out: Gather, ctx: Context) -> None:
    x, cfg = ctx.x, ctx.cfg
    difference = ctx.gap_difference
    if difference is not None:
        assert x.loss_mask is not None  # a gap difference exists on a loss mask only
        gap = gradient.engine_gap_of(difference, x.loss_mask, ctx.gap_tokens, cfg.gap_quantiles)
        out.summary("grpo_engine_logprob_gap_nats", gap.total, gap.count, gap.quantiles, cfg.gap_quantiles)
        out.histogram("grpo_token_engine_logprob_gap_nats", gap.quantiles, gap.total)
        out.add("grpo_engine_logprob_gap_mean_nats", gap.mean)
        if x.tool_mask is not None:
            scored = x.loss_mask & finite(difference)
            gaps = mismatch.turn_gaps(gap.absolute, scored, x.tool_mask, len(catalog.TURNS))
            for turn, value in zip(catalog.TURNS, gaps, strict=True):
                out.add("grpo_engine_logprob_gap_turn_mean_nats", value, turn=turn)


@produces(
    "grpo_mismatch_kl_nats", "grpo_mismatch_chi_square", "grpo_mismatch_log_ppl_diff_nats",
    "grpo_mismatch_ppl_multiple", "grpo_rollout_correction_weight", "grpo_token_rollout_correction_weight",
    "grpo_sequence_rollout_correction_weight", "grpo_rollout_correction_capped_tokens_total",
    "grpo_rollout_correction_capped_sequences_total", "grpo_rollout_correction_capped_ratio", stages=("rollout",))
def engine_mismatch(out: Gather, ctx: Context) -> None:
    """What tells engine noise from a systematic engine fault (:mod:`grpo_exporter.functional.mismatch`)."""
    x, cfg = ctx.x, ctx.cfg
    difference = ctx.gap_difference
    if difference is None:
        return
    qs = cfg.quantiles_of("grpo_rollout_correction_weight")
    tokens = ctx.gap_tokens
    assert x.loss_mask is not None
    m = mismatch.mismatch_of(difference, x.loss_mask, tokens, cfg.rollout_correction_cap, qs)
    out.add("grpo_mismatch_kl_nats", m.k1, estimator="k1")
    out.add("grpo_mismatch_kl_nats", m.k3, estimator="k3")
    out.add("grpo_mismatch_chi_square", m.chi2_token, level="token")
    out.add("grpo_mismatch_chi_square", m.chi2_sequence, level="sequence")
    out.add("grpo_mismatch_log_ppl_diff_nats", m.log_ppl_diff)
    out.add("grpo_mismatch_ppl_multiple", m.ppl_multiple)
    out.summary("grpo_rollout_correction_weight", m.token_weight_sum, tokens, m.token_weights, qs)
    out.histogram("grpo_token_rollout_correction_weight", m.token_weights, m.token_weight_sum)
    out.histogram("grpo_sequence_rollout_correction_weight", m.sequence_weights, m.sequence_weight_sum)
    if m.capped_tokens is not None and m.capped_sequences is not None:
        out.add("grpo_rollout_correction_capped_tokens_total", m.capped_tokens)
        out.add("grpo_rollout_correction_capped_sequences_total", m.capped_sequences)
        out.add("grpo_rollout_correction_capped_ratio", m.capped_token_share, level="token")
        out.add("grpo_rollout_correction_capped_ratio", m.capped_sequence_share, level="sequence")


@produces(
    "grpo_onpolicy_outside_clip_tokens_total",
    "grpo_onpolicy_checked_tokens_total",
    "grpo_onpolicy_outside_clip_ratio",
    "grpo_onpolicy_log_ratio_abs_max_nats",
    "grpo_log_ratio_clamp_hit_tokens_total",
    "grpo_log_ratio_clamp_hit_ratio",
    nonfinite=("log_ratio", "ratio"), stages=("update",))
def log_ratio_checks(out: Gather, ctx: Context) -> None:
    log_ratio, cfg = ctx.log_ratio, ctx.cfg
    if log_ratio is None:
        return
    # off the loss mask the log ratio is 0 and the ratio 1: the log ratio's non-finite values are the loss tokens
    # it leaves out of ``valid``; the ratio is exp(log ratio) in fp32 without clamp: its count also holds the
    # tokens that would overflow where exp comes before the clamp (seed 4.2)
    out.add("grpo_nonfinite_values_total", ctx.tokens - ctx.finite_ratio_tokens, tensor="log_ratio")
    out.add("grpo_nonfinite_values_total", ctx.nonfinite(log_ratio.ratio), tensor="ratio")
    rows = ctx.x.on_policy
    if rows is True or isinstance(rows, Tensor):
        check = gradient.onpolicy_check(log_ratio, *cfg.onpolicy_eps, None if rows is True else rows)
        out.add("grpo_onpolicy_outside_clip_tokens_total", check.outside)
        out.add("grpo_onpolicy_checked_tokens_total", check.checked)
        out.add("grpo_onpolicy_outside_clip_ratio", check.outside_ratio)
        out.add("grpo_onpolicy_log_ratio_abs_max_nats", check.abs_log_ratio_max)
    if cfg.log_ratio_clamp is not None:
        hits = gradient.clamp_hits(log_ratio, cfg.log_ratio_clamp, ctx.row_tokens.sum())
        out.add("grpo_log_ratio_clamp_hit_tokens_total", hits.hits)
        out.add("grpo_log_ratio_clamp_hit_ratio", hits.hit_ratio)


@produces(
    "grpo_loss_mask_length_mismatch_sequences_total",
    "grpo_loss_mask_empty_sequences_total",
    "grpo_loss_mask_outside_completion_tokens_total", "grpo_loss_mask_tool_tokens_total",
    "grpo_completion_length_tool_span_sequences_total", stages=("rollout", "update"))
def mask_audit(out: Gather, ctx: Context) -> None:
    x, given = ctx.x, ctx.given_loss_mask
    if given is not None and x.completion_lengths is not None:
        audit = gradient.mask_audit(given, x.completion_lengths, x.completion_mask, ctx.row_tokens, ctx.positions,
                                    x.tool_mask)
        out.add("grpo_loss_mask_length_mismatch_sequences_total", audit.length_mismatch)
        out.add("grpo_loss_mask_empty_sequences_total", audit.empty)
        out.add("grpo_loss_mask_outside_completion_tokens_total", audit.outside_completion)
        if audit.on_tool is not None and audit.tool_span_lengths is not None:
            out.add("grpo_loss_mask_tool_tokens_total", audit.on_tool)
            out.add("grpo_completion_length_tool_span_sequences_total", audit.tool_span_lengths)


@produces("grpo_kl_ref_nats", stages=("update",))
def kl(out: Gather, ctx: Context) -> None:
    d = ctx.kl_difference
    if d is not None:
        out.add("grpo_kl_ref_nats", gradient.kl_k3_of(d, ctx.tokens - ctx.nonfinite(d)))


@produces(
    "grpo_optimizer_steps_total",
    "grpo_grad_norm_pre_clip",
    "grpo_grad_norm_post_clip",
    "grpo_grad_clip_active_steps_total",
    nonfinite=("grad_norm",), stages=("update",))
def grad_norms(out: Gather, ctx: Context) -> None:
    x = ctx.x
    pre = x.grad_norm_pre_clip
    if pre is None and x.grads is not None:
        pre = gradient.total_norm(x.grads)
    if pre is None:
        return
    pre_t = scalar(pre, torch.float32, out.device)
    out.add("grpo_nonfinite_values_total", count_nonfinite(pre_t), tensor="grad_norm")
    out.add("grpo_optimizer_steps_total", 1.0)
    out.add("grpo_grad_norm_pre_clip", pre_t)
    post = x.grad_norm_post_clip
    if post is None and x.max_grad_norm is not None:
        post = gradient.clipped_norm(pre_t, x.max_grad_norm)
    if post is not None:
        out.add("grpo_grad_norm_post_clip", scalar(post, torch.float32, out.device))
    limit = x.max_grad_norm
    if limit is not None:
        above = pre_t > (limit.to(out.device, pre_t.dtype) if isinstance(limit, Tensor) else float(limit))
        out.add("grpo_grad_clip_active_steps_total", above.to(torch.int64))


@produces("grpo_param_relative_update", "grpo_rollout_staleness_versions", stages=("update",))
def update_size(out: Gather, ctx: Context) -> None:
    x = ctx.x
    if x.params_before is not None and x.params_after is not None:
        out.add("grpo_param_relative_update", gradient.relative_update(x.params_before, x.params_after))
    if x.policy_version is not None and x.rollout_policy_version is not None:
        out.add("grpo_rollout_staleness_versions", x.policy_version - x.rollout_policy_version)
