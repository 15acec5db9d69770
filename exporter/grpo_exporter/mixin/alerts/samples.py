"""Layer 3, the samples (how many samples decide this update?)."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import (
    BY,
    Alert,
    increase,
    template_query,
    template_value,
)


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    w = c.window()
    groups_enough = f"and on(job, run) run:grpo_groups:window_increase >= {c.min_window_groups}"
    return [
        Alert(
            "GRPOESSDrop", Layer.SAMPLES, "ess", "warning",
            f'max by ({BY}) (run:grpo_ess_ratio:window_mean{{level="token"}}) < on(job, run) ({c.ess_drop_factor:g} * '
            f'max by ({BY}) (run:grpo_ess_ratio:baseline_median{{level="token"}}))', 300,
            "The effective sample size ratio fell: a few samples decide the update.",
            "Token ESS ratio of run {{ $labels.run }} over " + w + " is " + template_value("%.3g") + f", below "
            f"{c.ess_drop_factor:g}x its baseline "
            + template_query('max(run:grpo_ess_ratio:baseline_median{run=%q,level=\\"token\\"})') + ".",
            trend=True,
        ),
        Alert(
            "GRPOZeroVarianceAbovePrediction", Layer.SAMPLES, "zero_variance", "warning",
            # the zero-variance groups that are not all-correct against their own prediction E[(1-p)^G]: all-correct
            # groups beyond theirs are the seed's "data too easy" (or a policy learning faster than its history),
            # no alarm; without the split (no correctness, or a prediction without it) the whole share vs E[...]
            # by more than the margin and than 2 standard errors of the observed share over the window's groups
            "run:grpo_unsolved_zero_variance_groups:window_ratio > on(job, run) "
            "(run:grpo_unsolved_zero_variance_groups_expected:window_mean + on(job, run) clamp_min(2 * sqrt("
            "run:grpo_unsolved_zero_variance_groups:window_ratio * (1 - run:grpo_unsolved_zero_variance_groups:"
            "window_ratio) / on(job, run) clamp_min(run:grpo_groups:window_increase, 1)), "
            f"{c.zero_variance_margin:g})) {groups_enough} "
            # the prediction starts from a prior and learns the run's solve rates from its batches: judged once
            # the run's early window is complete (its reward anchor, 20 batches: the prior then weighs ~3%)
            f'and on(job, run) max by ({BY}) (grpo_run_anchor{c.matchers(metric="grpo_reward_mean")})',
            900,
            "More groups without reward variance than the difficulty predicts, and not because they are solved.",
            "Run {{ $labels.run }}: " + template_value("%.3g") + f" of groups have zero reward variance without being "
            f"all-correct over {w}, against a predicted all-incorrect E[(1-p)^G] of "
            + template_query("max(run:grpo_unsolved_zero_variance_groups_expected:window_mean{run=%q})") + " (zero variance in all "
            + template_query("max(run:grpo_zero_variance_groups:window_ratio{run=%q})") + " against E[p^G+(1-p)^G] of "
            + template_query("max(run:grpo_zero_variance_groups_expected:window_mean{run=%q})") + "; all-correct "
            + template_query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_correct\\"})')
            + ", all-incorrect "
            + template_query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_incorrect\\"})')
            + ").",
            trend=True,
        ),
        Alert(
            "GRPOFewGroupsCarrySignal", Layer.SAMPLES, "signal_groups", "warning",
            f"1 - run:grpo_zero_variance_groups:window_ratio < {c.signal_groups_min_ratio:g} {groups_enough} "
            # a learned task (all-correct groups dominate, as its prediction says) is success, not starvation:
            # that regime is GRPOZeroVarianceAbovePrediction's only when beyond the prediction
            "and on(job, run) (max by (job, run) (run:grpo_zero_variance_groups:window_ratio_by_outcome"
            '{outcome="all_correct"}) < 0.8 * run:grpo_zero_variance_groups:window_ratio)', 900,
            "Almost no group carries a task gradient, and not because the task is learned: a handful of samples "
            "decides every update.",
            "Run {{ $labels.run }}: only " + template_value("%.3g") + f" of groups had reward variance over {w} "
            f"(line {c.signal_groups_min_ratio:g}); all-incorrect "
            + template_query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_incorrect\\"})')
            + ", all-correct "
            + template_query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_correct\\"})')
            + ". Check the verifier for false negatives first, then the base model's ability (SFT, curriculum, "
            "intermediate difficulty); do not switch on filtering before. Groups that repeat one completion "
            "(GRPODiversityCollapse, low entropy) mean a collapsed policy instead: read layer 4.",
            trend=True,
        ),
        Alert(
            "GRPOLowerClipDominant", Layer.SAMPLES, "clip_sides", "warning",
            f'max by ({BY}) (run:grpo_clipped_tokens:window_ratio{{bound="lower"}}) > {c.lower_clip_min:g} and on(job, run) '
            f'max by ({BY}) (run:grpo_clipped_tokens:window_ratio{{bound="upper"}}) < {c.upper_clip_max:g} '
            f"and on(job, run) run:grpo_upper_clip_reachable_tokens:window_ratio >= {c.upper_clip_reachable_min:g} "
            f'and on(job, run) max by ({BY}) (run:grpo_update_tokens:window_increase{{advantage_sign="negative"}}) '
            f">= {c.min_clip_tokens}", 900,
            "The lower clip bound cuts many tokens while the upper bound cuts almost none: collapse precursor.",
            "Run {{ $labels.run }}: lower-bound clip fraction " + template_value("%.3g") + " of negative-advantage tokens, "
            "upper " + template_query('max(run:grpo_clipped_tokens:window_ratio{run=%q,bound=\\"upper\\"})')
            + " of the positive-advantage tokens that could reach it ("
            + template_query("max(run:grpo_upper_clip_reachable_tokens:window_ratio{run=%q})")
            + f" of them; thresholds {c.lower_clip_min:g} / {c.upper_clip_max:g}).",
            trend=True,
        ),
        Alert(
            "GRPOClipFractionHigh", Layer.SAMPLES, "clip_total", "warning",
            f"(run:grpo_tokens_outside_clip:window_ratio > {c.clip_fraction_extreme:g} or "
            f"(run:grpo_tokens_outside_clip:window_ratio > {c.clip_fraction_high:g} and "
            f"run:grpo_tokens_outside_clip:window_ratio > on(job, run) "
            f"({c.clip_fraction_rise:g} * run:grpo_tokens_outside_clip:baseline_ratio))) and on(job, run) "
            f"sum by ({BY}) (run:grpo_update_tokens:window_increase{{advantage_sign!=\"zero\"}}) >= {c.min_clip_tokens}",
            600,
            "Many more tokens than before lie outside the clip range: updates too large or data too stale.",
            "Run {{ $labels.run }}: " + template_value("%.3g") + f" of signed update tokens are outside the clip range "
            f"over {w}: above {c.clip_fraction_high:g} and {c.clip_fraction_rise:g}x the run's baseline "
            + template_query("max(run:grpo_tokens_outside_clip:baseline_ratio{run=%q})", "%.3g")
            + f", or above {c.clip_fraction_extreme:g}.",
            trend=True,
        ),
        Alert(
            "GRPORolloutsStale", Layer.SAMPLES, "staleness", "warning",
            f"{increase(c, 'grpo_stale_update_steps_total')} > 0", 600,
            "The trainer learns from rollouts of an old policy.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" update steps over {w} trained on rollouts more than "
            f"{c.staleness_max_versions} policy versions old (counted on every step by the exporter; last scraped "
            "staleness " + template_query("max(grpo_rollout_staleness_versions{run=%q})", "%.0f") + ").",
            for_steps=2, event=True,
        ),
        _pool(c),
    ]


def _pool(c: MixinConfig) -> Alert:
    """A dynamic-sampling loop's kept share of generated groups over a trend window, against its early window
    (seed 第 4 篇 4.1 and 4.3: the batch stays full while the prompt pool shrinks, and the cost is the extra
    generation)."""
    early = f'max by ({BY}) (grpo_run_anchor{c.matchers(metric="grpo_kept_groups_ratio")})'
    trend = c.window(c.trend_window_steps)
    filtered = 'sum(increase(grpo_filtered_groups_total{run=%q,outcome=\\"OUTCOME\\"}[' + trend + ']))'
    return Alert(
        "GRPODynamicSamplingPoolShrinking", Layer.SAMPLES, "dynamic_sampling", "warning",
        f"run:grpo_kept_groups:trend_ratio < on(job, run) clamp_max({early} / {c.pool_overhead_growth:g}, "
        f"{c.pool_kept_max:g})", 900,
        "Dynamic sampling generates ever more groups to fill a batch: the prompts the policy can still learn "
        "from are running out, while the batch looks full.",
        "Run {{ $labels.run }} kept " + template_value("%.3g") + " of the groups it generated over the last "
        + trend + ", against "
        + template_query('max(grpo_run_anchor{run=%q,metric=\\"grpo_kept_groups_ratio\\"})')
        + " in its early window; filtered all-correct " + template_query(filtered.replace("OUTCOME", "all_correct"), "%.0f")
        + ", all-incorrect " + template_query(filtered.replace("OUTCOME", "all_incorrect"), "%.0f")
        + ". Check the mastered-prompt regression set (GRPOMasteredPromptsRegressed) and refresh the prompt pool.",
        trend=True,
    )
