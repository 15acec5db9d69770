"""Layer 2, the reward (does the reward measure what I think?)."""

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
    # a truncation share held over truncation_hold_steps, against the baseline from before it (a held surge
    # becomes the trailing baseline's own level within the baseline window)
    hold = c.window(c.truncation_hold_steps)
    held = f"min_over_time(run:grpo_truncated_completions:window_ratio[{hold}])"
    w = c.window()
    growth = "run:grpo_completion_length_tokens:growth_ratio"
    known_form = c.matchers('form!="unknown"')
    return [
        Alert(
            "GRPOAdvantageAboveBound", Layer.REWARD, "advantage_bound", "critical",
            f"{increase(c, 'grpo_advantage_over_bound_sequences_total')} > 0", 60,
            "Advantages above the group-normalisation bound: a data or reward bug.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" sequences over {w} have |A| above the bound "
            + template_query("max(grpo_advantage_bound{run=%q})") + " (max |A| "
            + template_query("max(grpo_advantage_abs_max{run=%q})") + ").",
        ),
        Alert(
            "GRPOAdvantageInconsistent", Layer.REWARD, "advantage_bound", "critical",
            f"{increase(c, 'grpo_advantage_inconsistent_sequences_total')} > 0", 60,
            "Advantages contradict their groups: misaligned groups or advantages of another batch.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" sequences over {w} have an advantage that "
            "ranks them against their reward within their group, moves where the group's rewards tie, or belongs "
            "to a group whose advantages do not sum to 0 (advantage form "
            + '{{ with printf "topk(1, sum by (form) (increase(grpo_advantage_form_sequences_total{run=%q}['
            + w + '])))" $labels.run | query }}{{ . | first | label "form" }}{{ else }}none{{ end }}).',
        ),
        Alert(
            "GRPOAdvantageFormUnexpected", Layer.REWARD, "advantage_form", "info",
            f"sum by ({BY}, form) (increase(grpo_advantage_form_sequences_total{known_form}[{w}])) > 0 "
            "unless on(job, run, form) "
            # the configured form over the same window: a run's info goes stale at its end before the window does
            f'label_replace(max_over_time(grpo_run_info{c.matchers()}[{w}]), "form", "$1", "advantage_norm", "(.+)")',
            0,
            "The advantages follow another form than the configured advantage_norm: set it to the estimator's.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + " sequences over " + w + " follow the "
            "advantage form {{ $labels.form }}, the monitor is configured with advantage_norm "
            + '{{ with printf "grpo_run_info{run=%q}" $labels.run | query }}{{ . | first | label '
            + '"advantage_norm" }}{{ else }}unknown{{ end }}: the |A| bound follows the data, set advantage_norm '
            "to your estimator's form so that a change of form is news.",
            for_steps=2,
        ),
        Alert(
            "GRPORewardCliff", Layer.REWARD, "reward_cliff", "critical",
            # the windowed mean: one noisy batch at a step of ten minutes is no cliff
            f'max by ({BY}) (run:grpo_reward_mean:window_mean{{component="total"}}) < on(job, run) '
            f'({c.reward_cliff_ratio:g} * run:grpo_reward_mean:baseline_median{{component="total"}}) '
            f'and on(job, run) run:grpo_reward_mean:baseline_median{{component="total"}} > {c.reward_cliff_min_baseline:g}',
            300,
            "Total reward fell off a cliff against its own baseline.",
            "Mean total reward of run {{ $labels.run }} over " + w + " is " + template_value("%.3g") + ", below "
            f"{c.reward_cliff_ratio:g}x its baseline "
            + template_query('max(run:grpo_reward_mean:baseline_median{run=%q,component=\\"total\\"})') + ".",
            trend=True,
        ),
        Alert(
            "GRPORewardHackSuspected", Layer.REWARD, "reward_hack", "warning",
            # window means, not the last batch: a hack is a trend, and one batch's correctness is a noisy share
            "run:grpo_reward_correctness:window_mean < on(job, run) "
            f"({c.correctness_drop_ratio:g} * run:grpo_reward_correctness:baseline_median) "
            f'and on(job, run) max by ({BY}) (run:grpo_reward_mean:window_mean{{component="total"}}) '
            f'>= on(job, run) run:grpo_reward_mean:baseline_median{{component="total"}}', 300,
            "Correctness falls while the total reward holds: another reward component is being gamed.",
            f"Mean correctness reward of run {{{{ $labels.run }}}} over {w} (component "
            + '{{ with printf "max by (component) (grpo_reward_component_role{run=%q,role=\\"correctness\\"})" '
            + '$labels.run | query }}{{ . | first | label "component" }}{{ else }}'
            + c.correctness_component + "{{ end }}) is " + template_value("%.3g") + ", below "
            f"{c.correctness_drop_ratio:g}x its baseline "
            + template_query("max(run:grpo_reward_correctness:baseline_median{run=%q})")
            + " while the total reward holds at "
            + template_query('max(run:grpo_reward_mean:window_mean{run=%q,component=\\"total\\"})') + ".",
            trend=True,
        ),
        Alert(
            "GRPOTruncationSurge", Layer.REWARD, "truncation", "warning",
            f"(run:grpo_truncated_completions:window_ratio > on(job, run) ({c.truncation_surge_factor:g} * "
            f"run:grpo_truncated_completions:baseline_ratio) and run:grpo_truncated_completions:window_ratio "
            f"> {c.truncation_surge_share:g}) or ({held} > {c.truncation_surge_floor:g} and {held} > on(job, run) "
            f"({c.truncation_surge_factor:g} * run:grpo_truncated_completions:baseline_ratio offset {hold}))", 600,
            "Many more completions hit the maximum length than usual.",
            "Run {{ $labels.run }}: " + template_value("%.3g") + " of completions truncated over " + w + ", against a "
            "baseline of " + template_query("max(run:grpo_truncated_completions:baseline_ratio{run=%q})") + " ("
            + template_query("max(run:grpo_truncated_completions:baseline_ratio{run=%q} offset " + hold + ")")
            + f" before the last {hold}; pages above {c.truncation_surge_share:g}, or above "
            f"{c.truncation_surge_floor:g} for the last {hold}).",
            trend=True,
        ),
        Alert(
            "GRPOLengthGrowthIncorrectOnly", Layer.REWARD, "length_incorrect", "warning",
            f'max by ({BY}) ({growth}{{outcome="incorrect"}}) > {c.length_growth_ratio:g} and on(job, run) '
            f'max by ({BY}) ({growth}{{outcome="correct"}}) <= {c.length_flat_ratio:g} and on(job, run) '
            f'max by ({BY}) (run:grpo_completions:window_increase{{outcome="incorrect"}}) >= '
            f'{c.length_min_completions}', 900,
            "Only incorrect completions grow longer: loss aggregation, not a length hack.",
            "Mean length of incorrect completions of run {{ $labels.run }} is " + template_value("%.2f") + "x its "
            "baseline while correct ones grow "
            + template_query('max(run:grpo_completion_length_tokens:growth_ratio{run=%q,outcome=\\"correct\\"})', "%.2f")
            + "x.",
            trend=True,
        ),
        Alert(
            "GRPOLengthHack", Layer.REWARD, "length_hack", "warning",
            f'max by ({BY}) ({growth}{{outcome="correct"}}) > {c.length_growth_ratio:g} and on(job, run) '
            f'max by ({BY}) ({growth}{{outcome="correct"}}) > on(job, run) max by ({BY}) ({growth}{{outcome="incorrect"}}) '
            f'and on(job, run) max by ({BY}) (run:grpo_completions:window_increase{{outcome="correct"}}) >= '
            f'{c.length_min_completions}',
            900,
            "Correct completions grow longer, faster than incorrect ones: a length hack.",
            "Mean length of correct completions of run {{ $labels.run }} is " + template_value("%.2f") + "x its "
            "baseline, faster than incorrect ones ("
            + template_query('max(run:grpo_completion_length_tokens:growth_ratio{run=%q,outcome=\\"incorrect\\"})', "%.2f")
            + "x).",
            trend=True,
        ),
        Alert(
            "GRPOCompletionLengthCountsToolTokens", Layer.REWARD, "length_tool_span", "warning",
            f"{increase(c, 'grpo_completion_length_tool_span_sequences_total')} > 0", 60,
            "Completion lengths count tool tokens: length penalties and overlong filters judge the wrong length.",
            "Run {{ $labels.run }}: " + template_value("%.0f") + f" completions over {w} have a length equal to "
            "their model tokens plus their tool tokens (a span, not the model's own tokens), baseline 0.",
        ),
        _noise(c),
        *_kl(c),
    ]


def _noise(c: MixinConfig) -> Alert:
    """Advantage drawn from reward noise (seed 第 4 篇 2.2: the last bit of variance, when correctness ties, may
    come from punctuation, length or a weak component, and sigma-normalisation makes it a full-size signal)."""
    trend = c.window(c.trend_window_steps)
    return Alert(
        "GRPOAdvantageFromRewardNoise", Layer.REWARD, "reward_noise", "warning",
        f"run:grpo_noise_advantage_groups:trend_mean > {c.noise_groups_max:g}", 600,
        "Many groups take a full-size advantage from a reward spread that is noise: the model chases score noise.",
        "Run {{ $labels.run }}: over " + trend + ", " + template_value("%.2f") + " of the groups had a reward range "
        "below the monitor's noise_range_fraction (1% by default) of the reward's scale that sigma-normalisation "
        "scaled to a full-size advantage. Where correctness "
        'ties, the variance comes most from component {{ with printf "topk(1, grpo_reward_tied_variance_ratio'
        '{run=%q})" $labels.run | query }}{{ . | first | label "component" }} (a share of {{ . | first | value | '
        'printf "%.2f" }}){{ else }}(not reported: it needs correct and reward_components){{ end }}.',
        trend=True,
    )


def _kl(c: MixinConfig) -> list[Alert]:
    """The KL to the reference where a KL penalty is configured (seed 第 4 篇 一: too strong and nothing is
    learned; implemented wrong, no real constraint): a runaway against its own past, and a KL that stays exactly 0."""
    trend = earlier = c.window(c.trend_window_steps)  # two trend windows side by side: now, and the one before
    penalised = f"and on(job, run) max by ({BY}) (grpo_kl_penalty_coefficient{c.matchers()}) > 0"
    kl = "run:grpo_kl_ref_nats:trend_mean"
    return [
        Alert(
            "GRPOKLToReferenceRunaway", Layer.REWARD, "kl", "warning",
            f"{kl} > on(job, run) ({c.kl_growth_factor:g} * ({kl} offset {earlier})) and {kl} > "
            f"{c.kl_runaway_min_nats:g} {penalised}", 600,
            "The KL to the reference runs away despite its penalty: the constraint is not acting (a sign or scale "
            "bug, a reference that moves).",
            "Run {{ $labels.run }}: mean KL to the reference " + template_value("%.3g") + f" nats over {trend}, "
            f"over {c.kl_growth_factor:g}x its mean {earlier} earlier ("
            + template_query(f"max(run:grpo_kl_ref_nats:trend_mean{{run=%q}} offset {earlier})") + "), with a "
            "penalty coefficient of " + template_query("max(grpo_kl_penalty_coefficient{run=%q})", "%.3g") + ".",
            trend=True,
        ),
        Alert(
            "GRPOKLToReferenceZero", Layer.REWARD, "kl_zero", "info",
            f"max by ({BY}) (max_over_time(grpo_kl_ref_nats{c.matchers()}[{trend}])) == 0 {penalised} "
            f"and on(job, run) {increase(c, 'grpo_steps_total', steps=c.trend_window_steps)} >= "
            f"{c.trend_window_steps - 1}", 0,
            "The KL penalty is configured but the KL to the reference is exactly 0: the reference is the policy.",
            "Run {{ $labels.run }}: the KL to the reference read " + template_value("%.3g") + f" on every step over "
            f"{trend} although the penalty coefficient is "
            + template_query("max(grpo_kl_penalty_coefficient{run=%q})", "%.3g") + ": the reference log-probs are "
            "the policy's own (a shared model, an adapter disabled on both passes), so the penalty constrains "
            "nothing.",
            for_steps=2,
        ),
    ]
