"""Prometheus recording and alerting rules, as pure functions of :class:`MixinConfig`.

Recording rules are named ``level:metric:operation`` (``run:grpo_clipped_tokens:window_ratio``). Alerts are
``GRPO...`` with ``for``, labels ``severity``, ``layer`` (the signal-chain layer; ``1-optimizer`` for the
grad-norm family, the seed's triage step 4, which is no 0/1 gate) and ``family`` (critical and warning of one
family; Alertmanager lets the critical inhibit the warning), and annotations ``summary``,
``description`` (the current value and the baseline it was compared with) and ``runbook_url``.

Thresholds are baseline-relative wherever the seed says fixed lines lie: the run's own recent history
(medians over a window that ends ``baseline_offset`` ago), the run's own early window (``grpo_run_anchor``,
frozen by the exporter, so a slow decline or a persistent fault is never absorbed), a reference run
(``grpo_reference_baseline``), or a model prediction published by the exporter (E[p^G+(1-p)^G], 1/P).

Every window, baseline and ``for`` is sized in steps from ``step_seconds`` (with a floor in seconds): a
window that holds no step reads 0/0 and resets ``for``. Per-step events a scrape can miss (grad-norm spikes,
stale rollouts) are counted in the process and paged on their increase. Each alert judges its signal only
when the population behind it is big enough (tokens of a sign, groups, steps), and says in its runbook the
regimes in which it stays silent (docs/runbooks.md).

The alerts live in :mod:`grpo_exporter.mixin.alerts` (one module per layer), the fragments both share in
:mod:`grpo_exporter.mixin.promql`.
"""

from __future__ import annotations

from typing import Any

from grpo_exporter.mixin.alerts import alerts
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import (
    BY,
    MEDIAN,
    OPTIMIZER,
    anchor,
    correctness,
    fraction,
    histogram_quantile,
    increase,
    rate,
    rolling_baseline,
    windowed_mean,
)

__all__ = ["OPTIMIZER", "alerts", "recording_rules", "rule_files"]


def recording_rules(c: MixinConfig) -> list[dict[str, Any]]:
    """The ``grpo-recording`` group: windowed fractions from counters and means of gauges, the run's anchors,
    then rolling baselines."""
    run_info = f"max by (job, run, group_size) (grpo_run_info{c.matchers()})"
    signed = (f"({rate(c, 'grpo_update_tokens_total', advantage_sign='positive')}"
              f" + {rate(c, 'grpo_update_tokens_total', advantage_sign='negative')})")
    rules: list[dict[str, Any]] = [
        {"record": "run:grpo_engine_logprob_gap_nats:window_mean",
         "expr": fraction(rate(c, "grpo_engine_logprob_gap_nats_sum"), rate(c, "grpo_engine_logprob_gap_nats_count"))},
        {"record": "run:grpo_mismatch_kl_nats:window_mean",
         "expr": windowed_mean(c, "grpo_mismatch_kl_nats", by="job, run, estimator")},
        {"record": "run:grpo_routing_differing_decisions:window_ratio",
         "expr": fraction(rate(c, "grpo_routing_differing_decisions_total"),
                           rate(c, "grpo_routing_compared_decisions_total"))},
        # under routing replay every differing decision, and every one the engine recorded no route for, fell back
        {"record": "run:grpo_routing_fallback_decisions:window_ratio",
         "expr": fraction(f"({rate(c, 'grpo_routing_differing_decisions_total')} + "
                          f"{rate(c, 'grpo_routing_unrecorded_decisions_total')})",
                          f"({rate(c, 'grpo_routing_compared_decisions_total')} + "
                          f"{rate(c, 'grpo_routing_unrecorded_decisions_total')})")},
        {"record": "run:grpo_routing_mismatch_ratio:window_mean",
         "expr": windowed_mean(c, "grpo_routing_mismatch_ratio", by="job, run, moe_layer")},
        {"record": "run:grpo_onpolicy_log_ratio_abs_max_nats:window_max",
         "expr": f"max by ({BY}) (max_over_time(grpo_onpolicy_log_ratio_abs_max_nats{c.matchers()}[{c.window()}]))"},
        {"record": "run:grpo_clipped_tokens:window_ratio", "labels": {"bound": "upper"},
         "expr": fraction(rate(c, "grpo_clipped_tokens_total", bound="upper"),
                           rate(c, "grpo_upper_clip_reachable_tokens_total"))},
        {"record": "run:grpo_clipped_tokens:window_ratio", "labels": {"bound": "lower"},
         "expr": fraction(rate(c, "grpo_clipped_tokens_total", bound="lower"),
                           rate(c, "grpo_update_tokens_total", advantage_sign="negative"))},
        # the share of positive tokens that could reach the upper clip at all (p_old < 1/(1+eps_high))
        {"record": "run:grpo_upper_clip_reachable_tokens:window_ratio",
         "expr": fraction(rate(c, "grpo_upper_clip_reachable_tokens_total"),
                           rate(c, "grpo_update_tokens_total", advantage_sign="positive"))},
        {"record": "run:grpo_update_tokens:window_increase",
         "expr": increase(c, "grpo_update_tokens_total", by="job, run, advantage_sign")},
        # over signed tokens only: a zero-advantage token can never be clipped (100% must read 100%)
        {"record": "run:grpo_tokens_outside_clip:window_ratio",
         "expr": fraction(f"({rate(c, 'grpo_clipped_tokens_total')} + "
                           f"{rate(c, 'grpo_out_of_range_unclipped_tokens_total')})", signed)},
        {"record": "run:grpo_onpolicy_outside_clip_tokens:window_ratio",
         "expr": fraction(rate(c, "grpo_onpolicy_outside_clip_tokens_total"),
                           rate(c, "grpo_onpolicy_checked_tokens_total"))},
        {"record": "run:grpo_log_ratio_clamp_hit_tokens:window_ratio",
         "expr": fraction(rate(c, "grpo_log_ratio_clamp_hit_tokens_total"), rate(c, "grpo_importance_weight_count"))},
        {"record": "run:grpo_grad_clip_active_steps:window_ratio",
         "expr": fraction(rate(c, "grpo_grad_clip_active_steps_total", steps=c.clip_window_steps),
                           rate(c, "grpo_optimizer_steps_total", steps=c.clip_window_steps))},
        # how much the clip takes off the typical update: 1 = nothing, 2 = half (medians of the gauges over the
        # clip window; at steps shorter than the scrape interval the scrapes sample the steps)
        {"record": "run:grpo_grad_norm_clip_factor:window_median",
         "expr": fraction(windowed_mean(c, "grpo_grad_norm_pre_clip", steps=c.clip_window_steps, op=MEDIAN),
                           windowed_mean(c, "grpo_grad_norm_post_clip", steps=c.clip_window_steps, op=MEDIAN))},
        {"record": "run:grpo_groups:window_increase", "expr": increase(c, "grpo_groups_total")},
        {"record": "run:grpo_groups:trend_increase",
         "expr": increase(c, "grpo_groups_total", steps=c.trend_window_steps)},
        {"record": "run:grpo_groups:collapse_increase",
         "expr": increase(c, "grpo_groups_total", steps=c.collapse_window_steps)},
        {"record": "run:grpo_steps:window_increase", "expr": increase(c, "grpo_steps_total")},
        {"record": "run:grpo_noise_advantage_groups:trend_mean",
         "expr": windowed_mean(c, "grpo_noise_advantage_groups_ratio", steps=c.trend_window_steps)},
        {"record": "run:grpo_kl_ref_nats:trend_mean",
         "expr": windowed_mean(c, "grpo_kl_ref_nats", steps=c.trend_window_steps)},
        # the share of the groups a dynamic-sampling loop generated that its batches kept, over a trend window
        {"record": "run:grpo_kept_groups:trend_ratio",
         "expr": fraction(rate(c, "grpo_groups_total", steps=c.trend_window_steps),
                           rate(c, "grpo_generated_groups_total", steps=c.trend_window_steps))},
        # the groups of the long window (the baseline's length, ending now): pass@G's long leg
        {"record": "run:grpo_groups:long_increase",
         "expr": f"sum by ({BY}) (increase(grpo_groups_total{c.matchers()}[{c.baseline_window}]))"},
        {"record": "run:grpo_zero_variance_groups:window_ratio",
         "expr": fraction(rate(c, "grpo_zero_variance_groups_total"), rate(c, "grpo_groups_total"))},
        {"record": "run:grpo_zero_variance_groups:window_ratio_by_outcome",
         "expr": fraction(rate(c, "grpo_zero_variance_groups_total", by="job, run, outcome"),
                           rate(c, "grpo_groups_total"), on="on(job, run) group_left() ")},
        {"record": "run:grpo_zero_variance_groups_expected:window_mean",
         "expr": windowed_mean(c, "grpo_zero_variance_groups_expected_ratio")},
        {"record": "run:grpo_all_incorrect_groups_expected:window_mean",
         "expr": windowed_mean(c, "grpo_all_incorrect_groups_expected_ratio")},
        # zero-variance groups that are not all-correct (all-incorrect or unknown outcome), and their prediction
        # (the whole share and prediction where correctness or the split is missing)
        {"record": "run:grpo_unsolved_zero_variance_groups:window_ratio",
         "expr": "run:grpo_zero_variance_groups:window_ratio - on(job, run) (max by (job, run) "
                 '(run:grpo_zero_variance_groups:window_ratio_by_outcome{outcome="all_correct"}) '
                 "or on(job, run) 0 * run:grpo_zero_variance_groups:window_ratio)"},
        {"record": "run:grpo_unsolved_zero_variance_groups_expected:window_mean",
         "expr": "run:grpo_all_incorrect_groups_expected:window_mean or on(job, run) "
                 "run:grpo_zero_variance_groups_expected:window_mean"},
        {"record": "run:grpo_reward_mean:window_mean", "expr": windowed_mean(c, "grpo_reward_mean", by="job, run, component")},
        {"record": "run:grpo_ess_ratio:window_mean", "expr": windowed_mean(c, "grpo_ess_ratio", by="job, run, level")},
        {"record": "run:grpo_entropy_mean_nats:window_mean", "expr": windowed_mean(c, "grpo_entropy_mean_nats")},
        {"record": "run:grpo_unique_completions_ratio:window_mean", "expr": windowed_mean(c, "grpo_unique_completions_ratio")},
        {"record": "run:grpo_edit_distance_median_ratio:window_mean",
         "expr": windowed_mean(c, "grpo_edit_distance_median_ratio")},
        {"record": "run:grpo_retrieval_accuracy_ratio:window_mean", "expr": windowed_mean(c, "grpo_retrieval_accuracy_ratio")},
        {"record": "run:grpo_truncated_completions:window_ratio",
         "expr": fraction(rate(c, "grpo_truncated_completions_total"), rate(c, "grpo_completions_total"))},
        {"record": "run:grpo_completions:window_increase",
         "expr": increase(c, "grpo_completion_length_tokens_count", by="job, run, outcome")},
        {"record": "run:grpo_completion_length_tokens:window_mean",
         "expr": fraction(rate(c, "grpo_completion_length_tokens_sum", by="job, run, outcome"),
                           rate(c, "grpo_completion_length_tokens_count", by="job, run, outcome"))},
        # quantiles over the window and every rank, from the classic histograms (the per-step summaries are one
        # rank's last step): within a bucket the position is interpolated, so read them as bucket-precise
        {"record": "run:grpo_token_engine_logprob_gap_nats:window_p99",
         "expr": histogram_quantile(c, 0.99, "grpo_token_engine_logprob_gap_nats")},
        {"record": "run:grpo_token_importance_weight:window_p99",
         "expr": histogram_quantile(c, 0.99, "grpo_token_importance_weight")},
        {"record": "run:grpo_token_importance_weight:window_p01",
         "expr": histogram_quantile(c, 0.01, "grpo_token_importance_weight")},
        {"record": "run:grpo_token_entropy_nats:window_p50", "expr": histogram_quantile(c, 0.5, "grpo_token_entropy_nats")},
        {"record": "run:grpo_completion_length_distribution_tokens:window_p99",
         "expr": histogram_quantile(c, 0.99, "grpo_completion_length_distribution_tokens", by="job, run, outcome")},
        {"record": "run:grpo_pass_at_group_size:ratio",
         "expr": f"max by ({BY}) (grpo_pass_at_k_ratio{c.matchers()} * on(job, run, k) group_left()"
                 f' label_replace({run_info}, "k", "$1", "group_size", "(.*)"))'},
        {"record": "run:grpo_pass_at_group_size:window_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.window()}]))"},
        # trend means: the slow comparisons against the run's early window average over trend_window_steps
        {"record": "run:grpo_entropy_mean_nats:trend_mean",
         "expr": windowed_mean(c, "grpo_entropy_mean_nats", steps=c.trend_window_steps)},
        {"record": "run:grpo_pass_at_group_size:trend_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.window(c.trend_window_steps)}]))"},
        {"record": "run:grpo_pass_at_group_size:long_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.baseline_window}]))"},
        # the collapse window: GRPOPolicyCollapseOnset reads pass@G and pass@1 over it
        {"record": "run:grpo_pass_at_group_size:collapse_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.window(c.collapse_window_steps)}]))"},
        {"record": "run:grpo_repeated_wrong_groups:collapse_mean",
         "expr": windowed_mean(c, "grpo_repeated_wrong_groups_ratio", steps=c.collapse_window_steps)},
        {"record": "run:grpo_repeated_wrong_groups:trend_mean",
         "expr": windowed_mean(c, "grpo_repeated_wrong_groups_ratio", steps=c.trend_window_steps)},
        {"record": "run:grpo_repeated_wrong_groups:long_mean",
         "expr": f"max by ({BY}) (avg_over_time(grpo_repeated_wrong_groups_ratio{c.matchers()}[{c.baseline_window}]))"},
        {"record": "run:grpo_pass_at_1:window_mean",
         "expr": windowed_mean(c, "grpo_pass_at_k_ratio", k="1")},
        {"record": "run:grpo_pass_at_1:collapse_mean",
         "expr": windowed_mean(c, "grpo_pass_at_k_ratio", steps=c.collapse_window_steps, k="1")},
        {"record": "run:grpo_pass_at_1:trend_mean",
         "expr": windowed_mean(c, "grpo_pass_at_k_ratio", steps=c.trend_window_steps, k="1")},
        {"record": "run:grpo_pass_at_1:long_mean",
         "expr": f"max by ({BY}) (avg_over_time(grpo_pass_at_k_ratio{c.matchers(k='1')}[{c.baseline_window}]))"},
        # the trend mean once its window holds its steps: the run's best (peak) is taken over these only, never
        # over the first minutes' windows of a step or two (a partial window of 4 groups reads 1.0)
        {"record": "run:grpo_pass_at_group_size:trend_mean_full",
         "expr": f"run:grpo_pass_at_group_size:trend_mean and on(job, run) (max by ({BY}) (max_over_time("
                 f"grpo_steps_total{c.matchers()}[{c.window(c.trend_window_steps)}]) - min_over_time("
                 f"grpo_steps_total{c.matchers()}[{c.window(c.trend_window_steps)}])) >= {c.trend_window_steps - 1})"},
        {"record": "run:grpo_step_interval_seconds:mean",
         # the span of step timestamps over the steps taken in it: exact for a run younger than the window
         # (rate() would divide by the whole window), undefined (no sample) before a second step
         "expr": f"max by ({BY}) (max_over_time(grpo_last_step_timestamp_seconds{c.matchers()}[{c.baseline_window}]) "
                 f"- min_over_time(grpo_last_step_timestamp_seconds{c.matchers()}[{c.baseline_window}])) / "
                 f"max by ({BY}) (max_over_time(grpo_steps_total{c.matchers()}[{c.baseline_window}]) "
                 f"- min_over_time(grpo_steps_total{c.matchers()}[{c.baseline_window}]))"},
        # the run's early window (frozen by the exporter), else the reference run's
        {"record": "run:grpo_entropy_mean_nats:anchor", "expr": anchor(c, "grpo_entropy_mean_nats")},
        {"record": "run:grpo_pass_at_group_size:anchor",
         "expr": f"max by ({BY}) (grpo_run_anchor{c.matchers(metric='grpo_pass_at_k_ratio')} * on(job, run, labels) "
                 f"group_left() label_replace({run_info}, \"labels\", \"k='$1'\", \"group_size\", \"(.*)\")) "
                 f"or on({BY}) max by ({BY}) (grpo_reference_baseline{c.matchers(metric='grpo_pass_at_k_ratio')})"},
        {"record": "run:grpo_pass_at_1:anchor", "expr": anchor(c, "grpo_pass_at_k_ratio", "k='1'")},
        {"record": "run:grpo_repeated_wrong_groups:anchor", "expr": anchor(c, "grpo_repeated_wrong_groups_ratio")},
        # the best the run has shown (its 20-step pass@G, over peak_window_s, or its early window)
        {"record": "run:grpo_pass_at_group_size:peak",
         "expr": f"max by ({BY}) (max_over_time(run:grpo_pass_at_group_size:trend_mean_full[{c.duration(c.peak_window_s)}]))"
                 " > on(job, run) run:grpo_pass_at_group_size:anchor or on(job, run) run:grpo_pass_at_group_size:anchor"},
        # the level GRPOPolicyCollapseOnset holds pass@G over the collapse and trend windows to: the run's trend
        # mean baseline_offset ago (its steps just before the collapse window), where the run has learned above its
        # early window since, else the early window. A mean, not a median: a few groups' per-step pass@G takes a
        # few values (8 groups: eighths), and their median moves by a whole eighth or not at all
        {"record": "run:grpo_pass_at_group_size:collapse_level",
         "expr": f"run:grpo_pass_at_group_size:trend_mean_full offset {c.baseline_offset} > on(job, run) "
                 "run:grpo_pass_at_group_size:anchor or on(job, run) run:grpo_pass_at_group_size:anchor"},
        {"record": "run:grpo_edit_distance_median_ratio:anchor", "expr": anchor(c, "grpo_edit_distance_median_ratio")},
        # rolling baselines: the run's own history, ending baseline_offset ago
        {"record": "run:grpo_grad_norm_pre_clip:baseline_median",
         "expr": rolling_baseline(c, f"grpo_grad_norm_pre_clip{c.matchers()}")},
        {"record": "run:grpo_ess_ratio:baseline_median",
         "expr": rolling_baseline(c, f"grpo_ess_ratio{c.matchers()}", by="job, run, level")},
        {"record": "run:grpo_reward_mean:baseline_median",
         "expr": rolling_baseline(c, f"grpo_reward_mean{c.matchers()}", by="job, run, component")},
        {"record": "run:grpo_reward_correctness:window_mean",
         "expr": correctness(c, "run:grpo_reward_mean:window_mean")},
        {"record": "run:grpo_reward_correctness:baseline_median",
         "expr": correctness(c, "run:grpo_reward_mean:baseline_median")},
        {"record": "run:grpo_tokens_outside_clip:baseline_ratio",
         "expr": rolling_baseline(c, "run:grpo_tokens_outside_clip:window_ratio")},
        {"record": "run:grpo_truncated_completions:baseline_ratio",
         "expr": rolling_baseline(c, "run:grpo_truncated_completions:window_ratio")},
        {"record": "run:grpo_completion_length_tokens:baseline_mean",
         "expr": rolling_baseline(c, "run:grpo_completion_length_tokens:window_mean", by="job, run, outcome",
                           op="avg_over_time(")},
        {"record": "run:grpo_completion_length_tokens:growth_ratio",
         "expr": fraction("run:grpo_completion_length_tokens:window_mean",
                           "run:grpo_completion_length_tokens:baseline_mean", on="on(job, run, outcome) ")},
        {"record": "run:grpo_entropy_mean_nats:baseline_median",
         "expr": rolling_baseline(c, f"grpo_entropy_mean_nats{c.matchers()}")},
        {"record": "run:grpo_pass_at_group_size:baseline_median",
         "expr": rolling_baseline(c, "run:grpo_pass_at_group_size:ratio")},
        {"record": "run:grpo_edit_distance_median_ratio:baseline_median",
         "expr": rolling_baseline(c, f"grpo_edit_distance_median_ratio{c.matchers()}")},
    ]
    return rules


def rule_files(c: MixinConfig) -> dict[str, dict[str, Any]]:
    """File name -> rule file content (a ``groups`` document)."""
    return {
        "grpo-recording.rules.yml": {"groups": [{"name": "grpo-recording", "rules": recording_rules(c)}]},
        "grpo-alerts.rules.yml": {"groups": [{"name": "grpo-alerts", "rules": [a.rule(c) for a in alerts(c)]}]},
    }
