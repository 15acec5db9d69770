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
    w = c.window()
    growth = "run:grpo_completion_length_tokens:growth_ratio"
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
            f"run:grpo_truncated_completions:window_ratio > on(job, run) ({c.truncation_surge_factor:g} * "
            f"run:grpo_truncated_completions:baseline_ratio) and run:grpo_truncated_completions:window_ratio "
            f"> {c.truncation_surge_floor:g}", 600,
            "Many more completions hit the maximum length than usual.",
            "Run {{ $labels.run }}: " + template_value("%.3g") + " of completions truncated over " + w + ", against a "
            "baseline of " + template_query("max(run:grpo_truncated_completions:baseline_ratio{run=%q})") + ".",
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
    ]
