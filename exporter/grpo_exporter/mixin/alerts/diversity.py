"""Layer 4, diversity (does the policy still read the question?)."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import (
    BY,
    Alert,
    anchor_sampling_error,
    early_window_sampling_error,
    peak_sampling_error,
    sampling_error,
    template_query,
    template_value,
)


def _pass_falls_towards_pass_1(c: MixinConfig, window: str, level: str) -> str:
    """pass@G's mean over ``window`` (``collapse``, ``trend`` or ``long``) below ``level`` by more than
    ``collapse_standard_errors`` of its sampling error and ``pass_drop_margin``, the spread pass@G - pass@1 over
    it narrower than early by ``pass_drop_margin``; judged only when the window holds ``collapse_min_groups``."""
    return (
        f"run:grpo_pass_at_group_size:{window}_mean < on(job, run) ({level} - on(job, run) "
        f"clamp_min({c.collapse_standard_errors:g} * {early_window_sampling_error(window, level)}, "
        f"{c.pass_drop_margin:g})) and on(job, run) {_towards_pass_1(c, window)} and on(job, run) "
        f"run:grpo_groups:{window}_increase >= {c.collapse_min_groups}"
    )


def _repeats_wrong_answer(c: MixinConfig, window: str) -> str:
    """The share of groups that repeat one wrong completion over ``window`` (``collapse``, ``trend`` or ``long``) above
    the run's early window by ``repeat_standard_errors`` of its sampling error and ``pass_drop_margin``, pass@G
    below its early window by at least ``repeat_pass_share`` of that rise, and falling towards pass@1; judged
    when the window holds ``repeat_min_groups``. Both against the early window: a trailing median of a few
    groups' pass@G per step reads 1 (most steps solve every prompt).

    The collapse's own count: a prompt turns into such a group when the policy, narrowed onto one path, loses its
    last right sample, so pass@G falls with it. A run whose unsolved prompts merely narrow onto one wrong answer
    raises the share while pass@G holds: no page. It rises from about 0, so it shows a collapse hours before
    pass@G's own fall is several standard errors out at a few groups a step."""
    share = "run:grpo_repeated_wrong_groups"
    error = early_window_sampling_error(window, f"{share}:anchor", share)
    rise = f"({share}:{window}_mean - on(job, run) {share}:anchor)"
    return (
        f"{share}:{window}_mean > on(job, run) ({share}:anchor + on(job, run) "
        f"clamp_min({c.repeat_standard_errors:g} * {error}, {c.pass_drop_margin:g})) and on(job, run) "
        f"run:grpo_pass_at_group_size:{window}_mean < on(job, run) (run:grpo_pass_at_group_size:anchor - "
        f"on(job, run) {c.repeat_pass_share:g} * {rise}) and "
        f"on(job, run) {_towards_pass_1(c, window)} and on(job, run) "
        f"run:grpo_groups:{window}_increase >= {c.repeat_min_groups}"
    )


def _towards_pass_1(c: MixinConfig, window: str, op: str = "<") -> str:
    """The spread pass@G - pass@1 over ``window`` narrower than over the run's early window by
    ``pass_drop_margin``: pass@G falls towards pass@1 (the seed's collapse, 第 2 篇 (diversity monitoring) ③:
    pass@1 holds while pass@k falls), not with it (a run getting worse at everything). ``op`` ">=": the
    opposite, the spread no narrower (pass@1 fell as far as pass@G)."""
    return (f"(run:grpo_pass_at_group_size:{window}_mean - on(job, run) run:grpo_pass_at_1:{window}_mean) {op} "
            f"on(job, run) (run:grpo_pass_at_group_size:anchor - on(job, run) run:grpo_pass_at_1:anchor - "
            f"{c.pass_drop_margin:g})")


def _onset(c: MixinConfig) -> str:
    """GRPOPolicyCollapseOnset's expression (see its runbook): entropy below its alarm line, and pass@G falling
    towards pass@1 by ``collapse_standard_errors`` over a window of at least ``collapse_min_groups``, or the
    groups that repeat one wrong completion rising while it falls (:func:`_repeats_wrong_answer`)."""
    # the level pass@G over the collapse and trend windows is held to: the early window, or the run's trend mean
    # just before them where it has learned since (a collapse after hours of learning falls from there, and may
    # stay above where the run began). The long (baseline) window is judged against the early window only: it
    # spans hours of the collapse itself
    level = "run:grpo_pass_at_group_size:collapse_level"
    levels = {"collapse": level, "trend": level, "long": "run:grpo_pass_at_group_size:anchor"}
    falls = " or on(job, run) ".join(
        [f"({_pass_falls_towards_pass_1(c, w, levels[w])})" for w in ("collapse", "trend", "long")]
        + [f"({_repeats_wrong_answer(c, w)})" for w in ("collapse", "trend", "long")])
    return (f"run:grpo_entropy_mean_nats:window_mean < on(job, run) ({c.entropy_alarm_factor:g} * "
            f"run:grpo_entropy_mean_nats:anchor) and on(job, run) ({falls})")


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    w = c.window()
    ref = "grpo_reference_baseline"
    # pass@G falling: sharply against its trailing baseline, or slowly against the best the run has shown; by
    # more than its margin and than the window's own sampling error (seed: how many samples decide): 2 standard
    # errors sqrt(p(1-p)/groups) of the window's mean; for the slow leg 4 of the difference to the peak (which
    # is the best of many noisy means); four groups a step of G=16 move pass@G in quanta of 0.25
    pass_g_sharp = (
        "run:grpo_pass_at_group_size:window_mean < on(job, run) (run:grpo_pass_at_group_size:baseline_median - "
        f"on(job, run) clamp_min(2 * {sampling_error('window')}, {c.pass_drop_margin:g}))"
    )
    pass_g_slow = (
        "run:grpo_pass_at_group_size:trend_mean < on(job, run) (run:grpo_pass_at_group_size:peak - "
        f"on(job, run) clamp_min(4 * {peak_sampling_error()}, {c.peak_drop_margin:g}))"
    )
    # or slowly against the run's early window, over the long window: where a step holds a few groups (G = 16 of
    # 64 completions: 4), a 5- or 20-step window's sampling error hides a fall the run's hours show
    pass_g_long = (
        "run:grpo_pass_at_group_size:long_mean < on(job, run) (run:grpo_pass_at_group_size:anchor - "
        f"on(job, run) clamp_min(2 * {anchor_sampling_error()}, {c.peak_drop_margin:g}))"
    )
    # the same legs, each silenced where pass@1 fell as far as pass@G over its window (GRPODiversityCollapse: a
    # transient dip of a run that got worse at everything for a while is no collapse; without pass@1 or the
    # early window the legs judge as before)
    pass_g_narrows = " or on(job, run) ".join(
        f"({leg} unless on(job, run) {_towards_pass_1(c, window, '>=')})"
        for leg, window in ((pass_g_sharp, "window"), (pass_g_slow, "trend"), (pass_g_long, "long")))
    # the seed's signature early (第 2 篇 ③: pass@1 holds or rises while pass@k falls; entropy only the alarm):
    # pass@G below the level it held by more than their sampling error, and the spread pass@G - pass@1
    # narrower than early (pass@G falls towards pass@1, not with it), while entropy is below its alarm line. A
    # task being learned (pass@G holds or rises, pass@1 rises) and a run that gets worse at everything (pass@1
    # falls as far) do not page
    onset = _onset(c)
    return [
        Alert(
            "GRPOEntropyCollapse", Layer.DIVERSITY, "entropy", "warning",
            f"(run:grpo_entropy_mean_nats:window_mean < on(job, run) ({c.entropy_drop_factor:g} * "
            f"run:grpo_entropy_mean_nats:baseline_median) and on(job, run) ({pass_g_sharp})) or on(job, run) "
            f"(run:grpo_entropy_mean_nats:trend_mean < on(job, run) ({c.entropy_drop_factor:g} * "
            f"run:grpo_entropy_mean_nats:anchor) and on(job, run) ({pass_g_slow}))", 900,
            "Entropy collapses while pass@G falls.",
            "Mean token entropy of run {{ $labels.run }} is " + template_value() + f" nats (over {w} against its "
            "trailing baseline " + template_query("max(run:grpo_entropy_mean_nats:baseline_median{run=%q})")
            + f", or over {c.window(c.trend_window_steps)} against its early window "
            + template_query("max(run:grpo_entropy_mean_nats:anchor{run=%q})")
            + f"; line {c.entropy_drop_factor:g}x), while pass@G is "
            + template_query("max(run:grpo_pass_at_group_size:window_mean{run=%q})") + " (over "
            + c.window(c.trend_window_steps) + ": "
            + template_query("max(run:grpo_pass_at_group_size:trend_mean{run=%q})") + ") against "
            + template_query("max(run:grpo_pass_at_group_size:baseline_median{run=%q})") + " lately and "
            + template_query("max(run:grpo_pass_at_group_size:peak{run=%q})") + " at its best.",
            trend=True,
        ),
        Alert(
            "GRPOPolicyCollapseOnset", Layer.DIVERSITY, "collapse", "warning", onset, 900,
            "pass@G falls towards pass@1 while entropy falls: the policy collapse, in its first half.",
            "Run {{ $labels.run }}: mean token entropy " + template_value() + " nats over " + w + " (its early "
            "window " + template_query("max(run:grpo_entropy_mean_nats:anchor{run=%q})") + f"; alarm line "
            f"{c.entropy_alarm_factor:g}x) while pass@G over {c.window(c.collapse_window_steps)} is "
            + template_query("max(run:grpo_pass_at_group_size:collapse_mean{run=%q})") + " against "
            + template_query("max(run:grpo_pass_at_group_size:anchor{run=%q})") + " early (level "
            + template_query("max(run:grpo_pass_at_group_size:collapse_level{run=%q})") + ": the early window, or "
            "its mean before this window where it has learned above it), and pass@1 "
            + template_query("max(run:grpo_pass_at_1:collapse_mean{run=%q})") + " against "
            + template_query("max(run:grpo_pass_at_1:anchor{run=%q})") + ", groups repeating one wrong completion "
            + template_query("max(run:grpo_repeated_wrong_groups:collapse_mean{run=%q})") + " against "
            + template_query("max(run:grpo_repeated_wrong_groups:anchor{run=%q})") + " early: fewer prompts keep a "
            "solution among their samples while the best path holds. Read the groups' diversity (distinct "
            "completions, edit distance) and the zero-variance share before the collapse reaches them.",
            for_steps=2, trend=True,
        ),
        Alert(
            "GRPODiversityCollapse", Layer.DIVERSITY, "diversity", "warning",
            f"(run:grpo_unique_completions_ratio:window_mean < {c.unique_ratio_min:g} or "
            "run:grpo_edit_distance_median_ratio:window_mean < on(job, run) "
            f"({c.edit_distance_drop_factor:g} * run:grpo_edit_distance_median_ratio:baseline_median) or "
            "run:grpo_edit_distance_median_ratio:window_mean < on(job, run) "
            f"({c.edit_distance_drop_factor:g} * run:grpo_edit_distance_median_ratio:anchor)) "
            # the seed's collapse is pass@k falling (第 2 篇 (diversity monitoring) ③): identical completions while pass@G holds are a
            # learned task (one right answer), at any pass@1 and any warm start
            f"and on(job, run) ({pass_g_narrows})", 900,
            "Completions of the same prompt became (nearly) identical while pass@G falls towards pass@1.",
            "Run {{ $labels.run }}: in-group diversity " + template_value("%.3g") + f" over {w} (distinct share below "
            f"{c.unique_ratio_min:g}, or median edit distance below {c.edit_distance_drop_factor:g}x its baseline "
            + template_query("max(run:grpo_edit_distance_median_ratio:baseline_median{run=%q})") + " or early window "
            + template_query("max(run:grpo_edit_distance_median_ratio:anchor{run=%q})") + "), while pass@G is "
            + template_query("max(run:grpo_pass_at_group_size:window_mean{run=%q})") + " against "
            + template_query("max(run:grpo_pass_at_group_size:baseline_median{run=%q})") + " lately and "
            + template_query("max(run:grpo_pass_at_group_size:peak{run=%q})") + " at its best; over "
            + c.baseline_window + " " + template_query("max(run:grpo_pass_at_group_size:long_mean{run=%q})")
            + " against its early window " + template_query("max(run:grpo_pass_at_group_size:anchor{run=%q})")
            + " (pass@1 " + template_query("max(run:grpo_pass_at_1:trend_mean{run=%q})") + ").",
            trend=True,
        ),
        Alert(
            "GRPOPassAtGBelowBase", Layer.DIVERSITY, "pass_at_g", "warning",
            f"run:grpo_pass_at_group_size:window_mean < on(job, run) "
            f'max by ({BY}) ({ref}{c.matchers(metric="grpo_pass_at_k_ratio")})', 1800,
            "pass@G fell below the base model: the run narrows the policy instead of teaching it.",
            "pass@G of run {{ $labels.run }} over " + w + " is " + template_value("%.3g") + ", below the base model's "
            + template_query(f'max({ref}{{run=%q,metric=\\"grpo_pass_at_k_ratio\\"}})') + ".",
            trend=True,
        ),
        Alert(
            "GRPORetrievalNearChance", Layer.DIVERSITY, "retrieval", "warning",
            f"run:grpo_retrieval_accuracy_ratio:window_mean < on(job, run) "
            f"({c.retrieval_chance_factor:g} * max by ({BY}) (grpo_retrieval_chance_ratio{c.matchers()}))", 900,
            "Completions no longer identify their own prompt: template collapse.",
            "Retrieval accuracy of run {{ $labels.run }} over " + w + " is " + template_value("%.3g") + f", below "
            f"{c.retrieval_chance_factor:g}x chance " + template_query("max(grpo_retrieval_chance_ratio{run=%q})") + ".",
            trend=True,
        ),
        _regression(c),
    ]


def _regression(c: MixinConfig) -> Alert:
    """The mastered-prompt regression set's last evaluation against its early window, by more than the
    difference's binomial noise (pooled accuracy p; the anchor holds E evaluations of the set's N completions,
    so the variance of the difference is p(1-p)(1 + 1/E)/N) and than a minimum drop."""
    last = f"max by ({BY}) (grpo_regression_accuracy_ratio{c.matchers()})"
    early = f'max by ({BY}) (grpo_run_anchor{c.matchers(metric="grpo_regression_accuracy_ratio")})'
    size = f"max by ({BY}) (grpo_regression_evaluated_completions{c.matchers()})"
    e = c.regression_anchor_evaluations
    pooled = f"(({last} + on(job, run) {e} * {early}) / {1 + e})"
    noise = f"sqrt({pooled} * (1 - {pooled}) * {1 + 1 / e:.6g} / on(job, run) {size})"
    return Alert(
        "GRPOMasteredPromptsRegressed", Layer.DIVERSITY, "regression", "warning",
        f"{last} < on(job, run) ({early} - on(job, run) "
        f"clamp_min({c.regression_noise_sigmas:g} * {noise}, {c.regression_min_drop:g}))", 600,
        "Prompts the policy had mastered are failing again: forgetting the training batches cannot show.",
        "The last evaluation of run {{ $labels.run }}'s regression set scored " + template_value("%.3g") + " over "
        + template_query("max(grpo_regression_evaluated_completions{run=%q})", "%.0f") + " completions, against "
        + template_query('max(grpo_run_anchor{run=%q,metric=\\"grpo_regression_accuracy_ratio\\"})')
        + " over its first " + str(e) + " evaluations: a drop beyond the set's noise.",
    )
