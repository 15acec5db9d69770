"""Layer 1, the gradient (does the gradient match what I think?): the 0/1 gates, whose critical pages
inhibit the layers behind them, and the optimizer family (grad norms), which inhibits nothing."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import (
    BY,
    OPTIMIZER,
    Alert,
    increase,
    template_query,
    template_value,
)


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    w = c.window()
    gap = "run:grpo_engine_logprob_gap_nats:window_mean"
    ref = "grpo_reference_baseline"
    return [
        Alert(
            "GRPOEngineLogprobGapCritical", Layer.GRADIENT, "engine_logprob_gap", "critical",
            # noise or fault: a systematic gap (the mean signed gap, k1, does not average out) from the first step;
            # or a jump of the gap above the stop line and a multiple of the setup's accepted level
            f"max by ({BY}) (abs(run:grpo_mismatch_kl_nats:window_mean)) >= {c.mismatch_kl_stop_nats:g} "
            f"or ({gap} >= {c.engine_gap_stop_nats:g} and {gap} >= on(job, run) ({c.engine_gap_jump_factor:g} * "
            f"max by ({BY}) (grpo_engine_logprob_gap_accepted_nats{c.matchers()})))", 120,
            "Trainer and rollout engine disagree systematically, or the gap jumped: stop training.",
            "Run {{ $labels.run }} reads " + template_value("%.4g") + " nats over " + w + ": mean signed engine gap (k1 mismatch KL) "
            + template_query('max(run:grpo_mismatch_kl_nats:window_mean{run=%q,estimator=\\"k1\\"})', "%.4g")
            + " nats, k3 "
            + template_query('max(run:grpo_mismatch_kl_nats:window_mean{run=%q,estimator=\\"k3\\"})', "%.4g")
            + f" nats (stop at {c.mismatch_kl_stop_nats:g}: numeric noise averages out, top-p/top-k "
            "renormalisation, a temperature or other weights do not), mean |gap| "
            + template_query(f"max({gap}{{run=%q}})", "%.4g")
            + " nats against the accepted level "
            + template_query("max(grpo_engine_logprob_gap_accepted_nats{run=%q})", "%.3g")
            + f" (stop at {c.engine_gap_jump_factor:g}x it and >= {c.engine_gap_stop_nats:g}: stale or partially "
            "synced weights).",
            for_steps=1,
        ),
        Alert(
            "GRPOEngineLogprobGapWarning", Layer.GRADIENT, "engine_logprob_gap", "warning",
            f"{gap} > on(job, run) ({c.gap_clean_factor:g} * max by ({BY}) "
            f"(grpo_engine_logprob_gap_accepted_nats{c.matchers()})) and {gap} > {c.gap_floor_nats:g}", 600,
            "Trainer and rollout engine log-probs drift apart from the setup's accepted level.",
            "Mean engine log-prob gap of run {{ $labels.run }} is " + template_value("%.4g") + f" nats over {w}, above "
            f"{c.gap_clean_factor:g}x the accepted level "
            + template_query("max(grpo_engine_logprob_gap_accepted_nats{run=%q})", "%.3g")
            + " nats (the reference run's, else the run's own clean gap "
            + template_query("max(grpo_engine_logprob_gap_clean_baseline_nats{run=%q})", "%.3g") + " nats).",
            for_steps=2,
        ),
        Alert(
            "GRPOEngineLogprobGapCleanLevelHigh", Layer.GRADIENT, "engine_logprob_gap_level", "info",
            f"max by ({BY}) (grpo_engine_logprob_gap_clean_baseline_nats{c.matchers()}) >= {c.engine_gap_stop_nats:g} "
            f"unless on({BY}) max by ({BY}) ({ref}{c.matchers(metric='grpo_engine_logprob_gap_mean_nats')})", 0,
            "The run's own clean engine gap sits above the stop line: confirm it once, then record it.",
            "The clean engine log-prob gap of run {{ $labels.run }} (its first "
            f"{c.gap_baseline_steps} rollouts) is " + template_value("%.4g") + f" nats, above the stop line "
            f"{c.engine_gap_stop_nats:g}. A bf16/fp16 engine is often here (0.010-0.018 on healthy bf16 stacks). "
            "Confirm it with the A/B/C preflight (trainer twice and engine once on frozen weights); if it holds, "
            "record it as reference_baseline grpo_engine_logprob_gap_mean_nats so later runs start from it. The "
            "run is judged against this level meanwhile; nothing is muted by this notice.",
        ),
        Alert(
            "GRPORatioClippedBeforeUpdate", Layer.GRADIENT, "onpolicy_ratio", "critical",
            f"run:grpo_onpolicy_outside_clip_tokens:window_ratio > {c.onpolicy_clip_stop_ratio:g}", 60,
            "The importance ratio is outside the clip range before any update: old and new log-probs differ.",
            "On on-policy updates of run {{ $labels.run }}, " + template_value("%.3g") + " of loss tokens already lie "
            f"outside the clip range (threshold {c.onpolicy_clip_stop_ratio:g}): the weights did not move, so "
            "the probability path differs. Stop and fix it before reading any other curve.",
            for_steps=1,
        ),
        Alert(
            "GRPOOnPolicyRatioDrift", Layer.GRADIENT, "onpolicy_ratio", "warning",
            f"run:grpo_onpolicy_log_ratio_abs_max_nats:window_max > on(job, run) ({c.onpolicy_noise_factor:g} * "
            f"max by ({BY}) (grpo_onpolicy_log_ratio_clean_baseline_nats{c.matchers()})) "
            f"and run:grpo_onpolicy_log_ratio_abs_max_nats:window_max > {c.onpolicy_noise_floor_nats:g}", 0,
            "On-policy log ratios left the run's own recomputation noise: another probability path.",
            "The max |log r| of on-policy updates of run {{ $labels.run }} reached " + template_value("%.3g") + f" nats "
            f"over {w}, above {c.onpolicy_noise_factor:g}x the run's own early noise "
            + template_query("max(grpo_onpolicy_log_ratio_clean_baseline_nats{run=%q})", "%.3g")
            + f" nats (and {c.onpolicy_noise_floor_nats:g}), even if inside the clip band: the weights did not "
            "move, so trainer and behaviour policy no longer compute the same probabilities.",
            for_steps=2,
        ),
        Alert(
            "GRPONonFiniteValues", Layer.GRADIENT, "nonfinite", "critical",
            f"{increase(c, 'grpo_nonfinite_values_total', by='job, run, tensor')} > 0", 60,
            "Non-finite values on loss tokens.",
            "Run {{ $labels.run }} saw " + template_value("%.0f") + " NaN/Inf values in `{{ $labels.tensor }}` over "
            f"{w} (baseline: 0). Find the first non-finite tensor along the numeric path.",
        ),
        Alert(
            "GRPOLossMaskMismatch", Layer.GRADIENT, "loss_mask", "critical",
            f"{increase(c, 'grpo_loss_mask_length_mismatch_sequences_total')}"
            f" + {increase(c, 'grpo_loss_mask_outside_completion_tokens_total')} > 0", 60,
            "The loss mask disagrees with the completions.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" loss-mask faults over {w} (sequences whose loss-token "
            "count differs from their length, plus loss tokens outside completions; baseline: 0).",
        ),
        Alert(
            "GRPOLossOnToolTokens", Layer.GRADIENT, "loss_mask", "critical",
            f"{increase(c, 'grpo_loss_mask_tool_tokens_total')} > 0", 60,
            "The loss covers tool output: the model is trained on text it never sampled.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" loss tokens over {w} sit on positions the "
            "environment wrote (tool_mask: tool responses, observations), baseline 0. The other readings leave "
            "them out; the gradient does not.",
        ),
        Alert(
            "GRPOLogRatioFuseBlowing", Layer.GRADIENT, "fuse", "warning",
            f"run:grpo_log_ratio_clamp_hit_tokens:window_ratio > {c.fuse_hit_ratio:g}", 300,
            "The numerical log-ratio clamp (the fuse before exp) is hit often.",
            "Run {{ $labels.run }}: " + template_value("%.3g") + f" of loss tokens hit the log-ratio clamp over {w} "
            f"(threshold {c.fuse_hit_ratio:g}; should be ~0).",
            trend=True,
        ),
        Alert(
            "GRPOGradNormSpike", OPTIMIZER, "grad_norm", "warning",
            f"{increase(c, 'grpo_grad_norm_spike_confirmed_steps_total')} > 0", 0,
            "A sudden pre-clip gradient-norm spike, confirmed by what a real instability moves with it.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" optimizer step(s) over {w} confirmed a "
            f"pre-clip grad norm above {c.grad_spike_factor:g}x the median of the previous "
            f"{c.grad_spike_window_steps} non-zero norms and {c.grad_spike_tail_factor:g}x their 90th percentile, "
            "with a non-finite value, the log-ratio fuse, the ESS ratio, "
            f"|dtheta|/|theta| or a spike on another rollout within {c.grad_spike_confirm_steps} steps (or above "
            f"{c.grad_spike_extreme_factor:g}x); "
            + template_query("sum(increase(grpo_grad_norm_spike_steps_total{run=%q}[" + w + "]))", "%.0f")
            + " spike(s) recorded; rolling median now "
            + template_query("max(run:grpo_grad_norm_pre_clip:baseline_median{run=%q})") + ".",
            event=True,
        ),
        Alert(
            "GRPOParamUpdateJump", OPTIMIZER, "param_update", "warning",
            f"{increase(c, 'grpo_param_update_jump_steps_total')} > 0", 0,
            "An optimizer step moved the weights far more than any step before it.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" optimizer step(s) over {w} had a relative "
            f"parameter update |dtheta|/|theta| above {c.grad_spike_update_factor:g}x its largest over the previous "
            f"{c.grad_spike_window_steps} steps (now "
            + template_query("max(grpo_param_relative_update{run=%q})") + "; grad norm "
            + template_query("max(grpo_grad_norm_pre_clip{run=%q})") + "): the learning rate, the optimizer "
            "state, the loss scale or a sharded update, not the gradient.",
            event=True,
        ),
        Alert(
            "GRPOGradClippingEveryStep", OPTIMIZER, "grad_clip", "warning",
            f"run:grpo_grad_clip_active_steps:window_ratio > {c.grad_clip_active_ratio:g} and on(job, run) "
            f"{increase(c, 'grpo_optimizer_steps_total', steps=c.clip_window_steps)} >= {c.clip_window_steps // 2} "
            f"and on(job, run) (run:grpo_grad_norm_clip_factor:window_median >= {c.grad_clip_extreme_factor:g} or "
            f"(run:grpo_grad_norm_clip_factor:window_median >= {c.grad_clip_carry_factor:g} and on(job, run) "
            f"min_over_time(run:grpo_grad_clip_active_steps:window_ratio[{c.baseline_window}]) < "
            f"{c.grad_clip_onset_ratio:g}))",
            900,
            "Gradient clipping has started to carry the update on nearly every step.",
            "Run {{ $labels.run }}: " + template_value("%.2f") + f" of optimizer steps were clipped over the last "
            f"{c.clip_window_steps} steps (threshold {c.grad_clip_active_ratio:g}), the median pre-clip norm "
            + template_query("max(run:grpo_grad_norm_clip_factor:window_median{run=%q})", "%.2f")
            + f"x the clip (threshold {c.grad_clip_carry_factor:g}x where fewer than {c.grad_clip_onset_ratio:g} of "
            f"a window's steps were clipped within {c.baseline_window}, else {c.grad_clip_extreme_factor:g}x): the "
            "update depends on the fuse.",
            for_steps=5,
        ),
    ]
