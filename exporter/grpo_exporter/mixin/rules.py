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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig, Severity

BY = "job, run"


OPTIMIZER = "1-optimizer"  # the seed's triage step 4: a layer-1 question, but no 0/1 gate (it inhibits nothing)


@dataclass(frozen=True)
class Alert:
    name: str
    layer: Layer | str
    family: str
    severity: Severity
    expr: str
    for_s: int
    summary: str
    description: str
    for_steps: int = 0  # ``for`` is at least this many typical steps: a condition must outlive one batch
    event: bool = False  # pages on per-step events: keeps firing one rate window after the last one
    trend: bool = False  # a windowed trend: see rule()

    def rule(self, c: MixinConfig) -> dict[str, Any]:
        """The Prometheus rule. A trend alert's ``for`` outlives its window by a step (one odd batch moves a
        windowed mean for exactly one window, so it can never page alone), it is judged only when the window
        holds several steps (rules generated for a shorter step than the run's go silent instead of paging on
        one batch; GRPOStepCadenceSlowerThanConfigured says why), and it resolves only after a trend window
        without its condition (a slow signal crossing its line through noise fires once, not per flicker)."""
        steps = c.window_steps + 1 if self.trend else self.for_steps
        for_s = c.for_seconds.get(self.name, c.steps_s(steps, self.for_s))
        expr = self.expr
        if self.trend:
            expr = f"({expr}) and on(job, run) run:grpo_steps:window_increase >= {max(2, c.window_steps // 2)}"
        rule: dict[str, Any] = {"alert": self.name, "expr": expr, "for": c.duration(for_s) if for_s else "0s"}
        gate = self.layer is Layer.GRADIENT and c.severities.get(self.name, self.severity) == "critical"
        if gate:
            # a 0/1 gate outlives every trend alert it mutes by a rate window: a scrape gap cannot flicker it,
            # and when both stop together (the run ends) the downstream condition, read through recording
            # rules an evaluation or two later, resolves before the gate, so nothing behind it is released
            rule["keep_firing_for"] = c.duration(
                c.steps_s(c.trend_window_steps, c.rate_window_s) + c.steps_s(c.window_steps, c.rate_window_s)
            )
        elif self.trend:
            rule["keep_firing_for"] = c.window(c.trend_window_steps)
        elif self.event:
            rule["keep_firing_for"] = c.window()  # one episode per burst of events, not one per event
        return rule | {
            "labels": {
                "severity": c.severities.get(self.name, self.severity),
                "layer": self.layer.value if isinstance(self.layer, Layer) else self.layer,
                "family": self.family,
            },
            "annotations": {
                "summary": self.summary,
                "description": self.description + (INCIDENT if self.layer in (Layer.GRADIENT, OPTIMIZER) else ""),
                "runbook_url": f"{c.runbook_url}#{self.name.lower()}",
            },
        }


# Layer-1 descriptions end with where the flight recorder's latest incident of the run lies, when it wrote one
INCIDENT = (
    '{{ with printf "grpo_recorder_latest_incident_step{run=%q}" $labels.run | query }}{{ with first . }} Flight '
    'recorder: incident {{ label "incident" . }} (first anomalous step {{ value . | printf "%.0f" }}) in '
    '{{ label "directory" . }}; read it with `grpo-exporter inspect`.{{ end }}{{ end }}'
)


def _value(fmt: str = "%.3g") -> str:
    return f'{{{{ $value | printf "{fmt}" }}}}'


def _query(expr: str, fmt: str = "%.3g") -> str:
    """Template text: the first value of ``expr`` (``%q`` = this alert's run, quotes escaped), or none."""
    return (
        f'{{{{ with printf "{expr}" $labels.run | query }}}}{{{{ . | first | value | printf "{fmt}" }}}}'
        "{{ else }}none{{ end }}"
    )


def _rate(c: MixinConfig, metric: str, by: str = BY, steps: int | None = None, **labels: str) -> str:
    return f"sum by ({by}) (rate({metric}{c.matchers(**labels)}[{c.window(steps)}]))"


def _increase(c: MixinConfig, metric: str, by: str = BY, steps: int | None = None, **labels: str) -> str:
    return f"sum by ({by}) (increase({metric}{c.matchers(**labels)}[{c.window(steps)}]))"


def _sampling_error(window: str) -> str:
    """The standard error of pass@G's mean over the ``window`` (``window`` or ``trend``) from the groups it
    holds: sqrt(p(1-p)/groups), p the window's own mean (0 where no group count is published)."""
    p = f"run:grpo_pass_at_group_size:{window}_mean"
    # without a group count (none published) no sampling error is known: the margin alone decides
    return (f"(sqrt({p} * (1 - {p}) / on(job, run) clamp_min(run:grpo_groups:{window}_increase, 1)) "
            f"or on(job, run) 0 * {p})")


def _peak_sampling_error() -> str:
    """The standard error of the difference between pass@G's 20-step mean and the best 20-step mean the run has
    shown, both over the groups of one trend window: sqrt(2 p(1-p)/groups), p their mean. The slow leg wants 4
    of them: 2 for the test, 2 for the peak's own bias (the best of the ~7 independent windows of a day at
    10-min steps sits ~sqrt(2 ln 7) = 2 standard errors above the truth)."""
    p = "((run:grpo_pass_at_group_size:trend_mean + on(job, run) run:grpo_pass_at_group_size:peak) / 2)"
    return (f"(sqrt(2 * {p} * (1 - {p}) / on(job, run) clamp_min(run:grpo_groups:trend_increase, 1)) "
            "or on(job, run) 0 * run:grpo_pass_at_group_size:trend_mean)")


def _anchor_sampling_error() -> str:
    """The standard error of the difference between pass@G's mean over the long (baseline) window and the run's
    early window (its anchor, the first anchor_steps = trend_window_steps rollouts: as many groups as a trend
    window holds): sqrt(p(1-p) (1/groups_long + 1/groups_anchor)), p their mean. Neither is selected from many
    windows, so 2 of them are the test."""
    p = "((run:grpo_pass_at_group_size:long_mean + on(job, run) run:grpo_pass_at_group_size:anchor) / 2)"
    return (f"(sqrt({p} * (1 - {p}) * on(job, run) (1 / clamp_min(run:grpo_groups:long_increase, 1) + on(job, run) "
            "1 / clamp_min(run:grpo_groups:trend_increase, 1))) or on(job, run) 0 * run:grpo_pass_at_group_size:long_mean)")


def _fraction(numerator: str, denominator: str, on: str = "") -> str:
    """``numerator / denominator`` with 0/0 (a window without events, as the first window of a run of slow
    steps) dropped: no sample rather than NaN, which would poison every average or quantile over the window
    it falls in (a 10 h length baseline read NaN from the run's first step on)."""
    return f"({numerator} / {on}{denominator}) > -Inf"


def _histogram_quantile(c: MixinConfig, q: float, metric: str, by: str = BY) -> str:
    """The ``q`` quantile of a classic histogram over the window, every rank's buckets added (a window without
    observations is dropped, never NaN)."""
    return f"histogram_quantile({q:g}, {_rate(c, metric + '_bucket', by=by + ', le')}) > -Inf"


def _mean(c: MixinConfig, metric: str, by: str = BY, steps: int | None = None, op: str = "avg_over_time(",
          **labels: str) -> str:
    """The windowed mean of a last-step gauge (one batch is a noisy sample; a window holds several); ``op``
    another ``*_over_time(`` of it, as in :func:`_baseline` (``"quantile_over_time(0.5, "``: the median)."""
    return f"max by ({by}) ({op}{metric}{c.matchers(**labels)}[{c.window(steps)}]))"


MEDIAN = "quantile_over_time(0.5, "


def _correctness(c: MixinConfig, series: str) -> str:
    """``series`` (by job, run, component) of the component that measures correctness: the one the run names
    (``grpo_reward_component_role{role="correctness"}``, e.g. the verifier's reward function), else the one
    called ``correctness_component``."""
    role = f'max by (job, run, component) (grpo_reward_component_role{c.matchers(role="correctness")})'
    return (f"max by ({BY}) ({series} * on(job, run, component) group_left() {role}) "
            f'or on(job, run) max by ({BY}) ({series}{{component="{c.correctness_component}"}})')


def _baseline(c: MixinConfig, expr: str, by: str = BY, op: str = MEDIAN) -> str:
    """A rolling baseline over the window ending ``baseline_offset`` ago, once that window holds
    ``min_baseline_steps`` steps (counted by grpo_steps_total, not by scrapes)."""
    window, offset = c.baseline_window, c.baseline_offset
    return (f"max by ({by}) ({op}{expr}[{window}] offset {offset})) and on(job, run) "
            f"sum by ({BY}) (increase(grpo_steps_total{c.matchers()}[{window}] offset {offset})) "
            f">= {c.min_baseline_steps}")


def _anchor(c: MixinConfig, metric: str, labels: str = "") -> str:
    """The run's early window of ``metric`` (grpo_run_anchor), else the reference run's value."""
    sel = {"metric": metric} | ({"labels": labels} if labels else {})
    return (f"max by ({BY}) (grpo_run_anchor{c.matchers(**sel)}) or on({BY}) "
            f"max by ({BY}) (grpo_reference_baseline{c.matchers(**sel)})")


def recording_rules(c: MixinConfig) -> list[dict[str, Any]]:
    """The ``grpo-recording`` group: windowed fractions from counters and means of gauges, the run's anchors,
    then rolling baselines."""
    run_info = f"max by (job, run, group_size) (grpo_run_info{c.matchers()})"
    signed = (f"({_rate(c, 'grpo_update_tokens_total', advantage_sign='positive')}"
              f" + {_rate(c, 'grpo_update_tokens_total', advantage_sign='negative')})")
    rules: list[dict[str, Any]] = [
        {"record": "run:grpo_engine_logprob_gap_nats:window_mean",
         "expr": _fraction(_rate(c, "grpo_engine_logprob_gap_nats_sum"), _rate(c, "grpo_engine_logprob_gap_nats_count"))},
        {"record": "run:grpo_mismatch_kl_nats:window_mean",
         "expr": _mean(c, "grpo_mismatch_kl_nats", by="job, run, estimator")},
        {"record": "run:grpo_onpolicy_log_ratio_abs_max_nats:window_max",
         "expr": f"max by ({BY}) (max_over_time(grpo_onpolicy_log_ratio_abs_max_nats{c.matchers()}[{c.window()}]))"},
        {"record": "run:grpo_clipped_tokens:window_ratio", "labels": {"bound": "upper"},
         "expr": _fraction(_rate(c, "grpo_clipped_tokens_total", bound="upper"),
                           _rate(c, "grpo_upper_clip_reachable_tokens_total"))},
        {"record": "run:grpo_clipped_tokens:window_ratio", "labels": {"bound": "lower"},
         "expr": _fraction(_rate(c, "grpo_clipped_tokens_total", bound="lower"),
                           _rate(c, "grpo_update_tokens_total", advantage_sign="negative"))},
        # the share of positive tokens that could reach the upper clip at all (p_old < 1/(1+eps_high))
        {"record": "run:grpo_upper_clip_reachable_tokens:window_ratio",
         "expr": _fraction(_rate(c, "grpo_upper_clip_reachable_tokens_total"),
                           _rate(c, "grpo_update_tokens_total", advantage_sign="positive"))},
        {"record": "run:grpo_update_tokens:window_increase",
         "expr": _increase(c, "grpo_update_tokens_total", by="job, run, advantage_sign")},
        # over signed tokens only: a zero-advantage token can never be clipped (100% must read 100%)
        {"record": "run:grpo_tokens_outside_clip:window_ratio",
         "expr": _fraction(f"({_rate(c, 'grpo_clipped_tokens_total')} + "
                           f"{_rate(c, 'grpo_out_of_range_unclipped_tokens_total')})", signed)},
        {"record": "run:grpo_onpolicy_outside_clip_tokens:window_ratio",
         "expr": _fraction(_rate(c, "grpo_onpolicy_outside_clip_tokens_total"),
                           _rate(c, "grpo_onpolicy_checked_tokens_total"))},
        {"record": "run:grpo_log_ratio_clamp_hit_tokens:window_ratio",
         "expr": _fraction(_rate(c, "grpo_log_ratio_clamp_hit_tokens_total"), _rate(c, "grpo_importance_weight_count"))},
        {"record": "run:grpo_grad_clip_active_steps:window_ratio",
         "expr": _fraction(_rate(c, "grpo_grad_clip_active_steps_total", steps=c.clip_window_steps),
                           _rate(c, "grpo_optimizer_steps_total", steps=c.clip_window_steps))},
        # how much the clip takes off the typical update: 1 = nothing, 2 = half (medians of the gauges over the
        # clip window; at steps shorter than the scrape interval the scrapes sample the steps)
        {"record": "run:grpo_grad_norm_clip_factor:window_median",
         "expr": _fraction(_mean(c, "grpo_grad_norm_pre_clip", steps=c.clip_window_steps, op=MEDIAN),
                           _mean(c, "grpo_grad_norm_post_clip", steps=c.clip_window_steps, op=MEDIAN))},
        {"record": "run:grpo_groups:window_increase", "expr": _increase(c, "grpo_groups_total")},
        {"record": "run:grpo_groups:trend_increase",
         "expr": _increase(c, "grpo_groups_total", steps=c.trend_window_steps)},
        {"record": "run:grpo_steps:window_increase", "expr": _increase(c, "grpo_steps_total")},
        # the groups of the long window (the baseline's length, ending now): pass@G's long leg
        {"record": "run:grpo_groups:long_increase",
         "expr": f"sum by ({BY}) (increase(grpo_groups_total{c.matchers()}[{c.baseline_window}]))"},
        {"record": "run:grpo_zero_variance_groups:window_ratio",
         "expr": _fraction(_rate(c, "grpo_zero_variance_groups_total"), _rate(c, "grpo_groups_total"))},
        {"record": "run:grpo_zero_variance_groups:window_ratio_by_outcome",
         "expr": _fraction(_rate(c, "grpo_zero_variance_groups_total", by="job, run, outcome"),
                           _rate(c, "grpo_groups_total"), on="on(job, run) group_left() ")},
        {"record": "run:grpo_zero_variance_groups_expected:window_mean",
         "expr": _mean(c, "grpo_zero_variance_groups_expected_ratio")},
        {"record": "run:grpo_all_incorrect_groups_expected:window_mean",
         "expr": _mean(c, "grpo_all_incorrect_groups_expected_ratio")},
        # zero-variance groups that are not all-correct (all-incorrect or unknown outcome), and their prediction
        # (the whole share and prediction where correctness or the split is missing)
        {"record": "run:grpo_unsolved_zero_variance_groups:window_ratio",
         "expr": "run:grpo_zero_variance_groups:window_ratio - on(job, run) (max by (job, run) "
                 '(run:grpo_zero_variance_groups:window_ratio_by_outcome{outcome="all_correct"}) '
                 "or on(job, run) 0 * run:grpo_zero_variance_groups:window_ratio)"},
        {"record": "run:grpo_unsolved_zero_variance_groups_expected:window_mean",
         "expr": "run:grpo_all_incorrect_groups_expected:window_mean or on(job, run) "
                 "run:grpo_zero_variance_groups_expected:window_mean"},
        {"record": "run:grpo_reward_mean:window_mean", "expr": _mean(c, "grpo_reward_mean", by="job, run, component")},
        {"record": "run:grpo_ess_ratio:window_mean", "expr": _mean(c, "grpo_ess_ratio", by="job, run, level")},
        {"record": "run:grpo_entropy_mean_nats:window_mean", "expr": _mean(c, "grpo_entropy_mean_nats")},
        {"record": "run:grpo_unique_completions_ratio:window_mean", "expr": _mean(c, "grpo_unique_completions_ratio")},
        {"record": "run:grpo_edit_distance_median_ratio:window_mean",
         "expr": _mean(c, "grpo_edit_distance_median_ratio")},
        {"record": "run:grpo_retrieval_accuracy_ratio:window_mean", "expr": _mean(c, "grpo_retrieval_accuracy_ratio")},
        {"record": "run:grpo_truncated_completions:window_ratio",
         "expr": _fraction(_rate(c, "grpo_truncated_completions_total"), _rate(c, "grpo_completions_total"))},
        {"record": "run:grpo_completions:window_increase",
         "expr": _increase(c, "grpo_completion_length_tokens_count", by="job, run, outcome")},
        {"record": "run:grpo_completion_length_tokens:window_mean",
         "expr": _fraction(_rate(c, "grpo_completion_length_tokens_sum", by="job, run, outcome"),
                           _rate(c, "grpo_completion_length_tokens_count", by="job, run, outcome"))},
        # quantiles over the window and every rank, from the classic histograms (the per-step summaries are one
        # rank's last step): within a bucket the position is interpolated, so read them as bucket-precise
        {"record": "run:grpo_token_engine_logprob_gap_nats:window_p99",
         "expr": _histogram_quantile(c, 0.99, "grpo_token_engine_logprob_gap_nats")},
        {"record": "run:grpo_token_importance_weight:window_p99",
         "expr": _histogram_quantile(c, 0.99, "grpo_token_importance_weight")},
        {"record": "run:grpo_token_importance_weight:window_p01",
         "expr": _histogram_quantile(c, 0.01, "grpo_token_importance_weight")},
        {"record": "run:grpo_token_entropy_nats:window_p50", "expr": _histogram_quantile(c, 0.5, "grpo_token_entropy_nats")},
        {"record": "run:grpo_completion_length_distribution_tokens:window_p99",
         "expr": _histogram_quantile(c, 0.99, "grpo_completion_length_distribution_tokens", by="job, run, outcome")},
        {"record": "run:grpo_pass_at_group_size:ratio",
         "expr": f"max by ({BY}) (grpo_pass_at_k_ratio{c.matchers()} * on(job, run, k) group_left()"
                 f' label_replace({run_info}, "k", "$1", "group_size", "(.*)"))'},
        {"record": "run:grpo_pass_at_group_size:window_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.window()}]))"},
        # trend means: the slow comparisons against the run's early window average over trend_window_steps
        {"record": "run:grpo_entropy_mean_nats:trend_mean",
         "expr": _mean(c, "grpo_entropy_mean_nats", steps=c.trend_window_steps)},
        {"record": "run:grpo_pass_at_group_size:trend_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.window(c.trend_window_steps)}]))"},
        {"record": "run:grpo_pass_at_group_size:long_mean",
         "expr": f"max by ({BY}) (avg_over_time(run:grpo_pass_at_group_size:ratio[{c.baseline_window}]))"},
        {"record": "run:grpo_pass_at_1:trend_mean",
         "expr": _mean(c, "grpo_pass_at_k_ratio", steps=c.trend_window_steps, k="1")},
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
        {"record": "run:grpo_entropy_mean_nats:anchor", "expr": _anchor(c, "grpo_entropy_mean_nats")},
        {"record": "run:grpo_pass_at_group_size:anchor",
         "expr": f"max by ({BY}) (grpo_run_anchor{c.matchers(metric='grpo_pass_at_k_ratio')} * on(job, run, labels) "
                 f"group_left() label_replace({run_info}, \"labels\", \"k='$1'\", \"group_size\", \"(.*)\")) "
                 f"or on({BY}) max by ({BY}) (grpo_reference_baseline{c.matchers(metric='grpo_pass_at_k_ratio')})"},
        {"record": "run:grpo_pass_at_1:anchor", "expr": _anchor(c, "grpo_pass_at_k_ratio", "k='1'")},
        # the best the run has shown (its 20-step pass@G, over peak_window_s, or its early window)
        {"record": "run:grpo_pass_at_group_size:peak",
         "expr": f"max by ({BY}) (max_over_time(run:grpo_pass_at_group_size:trend_mean_full[{c.duration(c.peak_window_s)}]))"
                 " > on(job, run) run:grpo_pass_at_group_size:anchor or on(job, run) run:grpo_pass_at_group_size:anchor"},
        {"record": "run:grpo_edit_distance_median_ratio:anchor", "expr": _anchor(c, "grpo_edit_distance_median_ratio")},
        # rolling baselines: the run's own history, ending baseline_offset ago
        {"record": "run:grpo_grad_norm_pre_clip:baseline_median",
         "expr": _baseline(c, f"grpo_grad_norm_pre_clip{c.matchers()}")},
        {"record": "run:grpo_ess_ratio:baseline_median",
         "expr": _baseline(c, f"grpo_ess_ratio{c.matchers()}", by="job, run, level")},
        {"record": "run:grpo_reward_mean:baseline_median",
         "expr": _baseline(c, f"grpo_reward_mean{c.matchers()}", by="job, run, component")},
        {"record": "run:grpo_reward_correctness:window_mean",
         "expr": _correctness(c, "run:grpo_reward_mean:window_mean")},
        {"record": "run:grpo_reward_correctness:baseline_median",
         "expr": _correctness(c, "run:grpo_reward_mean:baseline_median")},
        {"record": "run:grpo_truncated_completions:baseline_ratio",
         "expr": _baseline(c, "run:grpo_truncated_completions:window_ratio")},
        {"record": "run:grpo_completion_length_tokens:baseline_mean",
         "expr": _baseline(c, "run:grpo_completion_length_tokens:window_mean", by="job, run, outcome",
                           op="avg_over_time(")},
        {"record": "run:grpo_completion_length_tokens:growth_ratio",
         "expr": _fraction("run:grpo_completion_length_tokens:window_mean",
                           "run:grpo_completion_length_tokens:baseline_mean", on="on(job, run, outcome) ")},
        {"record": "run:grpo_entropy_mean_nats:baseline_median",
         "expr": _baseline(c, f"grpo_entropy_mean_nats{c.matchers()}")},
        {"record": "run:grpo_pass_at_group_size:baseline_median",
         "expr": _baseline(c, "run:grpo_pass_at_group_size:ratio")},
        {"record": "run:grpo_edit_distance_median_ratio:baseline_median",
         "expr": _baseline(c, f"grpo_edit_distance_median_ratio{c.matchers()}")},
    ]
    return rules


def alerts(c: MixinConfig) -> list[Alert]:
    """Every alert, in signal-chain order (liveness, then layers 1-4); an override naming no alert fails."""
    found = _alerts(c)
    unknown = (set(c.severities) | set(c.for_seconds)) - {a.name for a in found}
    if unknown:
        raise ValueError(f"severities/for_seconds: unknown alert(s) {sorted(unknown)}; expected GRPO... names "
                         f"of {[a.name for a in found]}")
    return found


def _alerts(c: MixinConfig) -> list[Alert]:
    w = c.window()
    gap = "run:grpo_engine_logprob_gap_nats:window_mean"
    ref = "grpo_reference_baseline"
    growth = "run:grpo_completion_length_tokens:growth_ratio"
    lookback = c.duration(c.lifecycle_lookback_s)
    finished = f"(max by ({BY}) (last_over_time(grpo_run_finished{c.matchers()}[{lookback}])) == 1)"
    g1, g2, g3, g4, g0 = Layer.GRADIENT, Layer.REWARD, Layer.SAMPLES, Layer.DIVERSITY, Layer.LIVENESS
    groups_enough = f"and on(job, run) run:grpo_groups:window_increase >= {c.min_window_groups}"
    # pass@G falling: sharply against its trailing baseline, or slowly against the best the run has shown; by
    # more than its margin and than the window's own sampling error (seed: how many samples decide): 2 standard
    # errors sqrt(p(1-p)/groups) of the window's mean; for the slow leg 4 of the difference to the peak (which
    # is the best of many noisy means); four groups a step of G=16 move pass@G in quanta of 0.25
    pass_g_sharp = (
        "run:grpo_pass_at_group_size:window_mean < on(job, run) (run:grpo_pass_at_group_size:baseline_median - "
        f"on(job, run) clamp_min(2 * {_sampling_error('window')}, {c.pass_drop_margin:g}))"
    )
    pass_g_slow = (
        "run:grpo_pass_at_group_size:trend_mean < on(job, run) (run:grpo_pass_at_group_size:peak - "
        f"on(job, run) clamp_min(4 * {_peak_sampling_error()}, {c.peak_drop_margin:g}))"
    )
    # or slowly against the run's early window, over the long window: where a step holds a few groups (G = 16 of
    # 64 completions: 4), a 5- or 20-step window's sampling error hides a fall the run's hours show
    pass_g_long = (
        "run:grpo_pass_at_group_size:long_mean < on(job, run) (run:grpo_pass_at_group_size:anchor - "
        f"on(job, run) clamp_min(2 * {_anchor_sampling_error()}, {c.peak_drop_margin:g}))"
    )
    pass_g_falls = f"{pass_g_sharp} or on(job, run) {pass_g_slow} or on(job, run) {pass_g_long}"
    return [
        # ---- liveness ----
        Alert(
            "GRPOExporterDown", g0, "exporter", "critical",
            f"up{c.matchers()} == 0 unless on(job, instance) "
            f"(max by (job, instance) (last_over_time(grpo_run_finished{c.matchers()}[{lookback}])) == 1)", 120,
            "The grpo-exporter target is down and its run did not end normally: nothing below can be judged.",
            "Prometheus cannot scrape {{ $labels.job }} {{ $labels.instance }} (up = " + _value("%g") + ") and the "
            "run there never reported a normal end (grpo_run_finished).",
        ),
        Alert(
            "GRPOTrainingStalled", g0, "stalled", "critical",
            f"time() - max by ({BY}) (last_over_time(grpo_last_step_timestamp_seconds{c.matchers()}[{lookback}])) "
            f"> {c.stall_s:g} unless on({BY}) {finished}",
            60,
            "Training has not reported a new step, and the run did not end normally.",
            "Run {{ $labels.run }} has reported no step for " + _value("%.0f") + f"s (threshold {c.stall_s:g}s: "
            f"{c.stall_steps} typical steps of {c.step_seconds:g}s, at least {c.stall_after_s}s; its process may "
            "be hung or gone); last step "
            + _query(f"max(last_over_time(grpo_last_step{{run=%q}}[{lookback}]))", "%.0f") + ".",
        ),
        Alert(
            "GRPOStepCadenceSlowerThanConfigured", g0, "cadence", "info",
            f"run:grpo_step_interval_seconds:mean > {c.cadence_tolerance * c.step_seconds * c.time_scale:g} "
            f"and on({BY}) (time() - max by ({BY}) (grpo_last_step_timestamp_seconds{c.matchers()}) < {c.stall_s:g})",
            3600,
            "Steps are much slower than the rules' step_seconds: their windows may hold too few steps.",
            "Run {{ $labels.run }} takes " + _value("%.0f") + f"s per step on average over {c.baseline_window}, "
            f"more than {c.cadence_tolerance:g}x the configured step_seconds ({c.step_seconds:g}s, scaled). "
            "Regenerate the rules with `grpo-exporter rules --step-seconds S` (or step_seconds in the config) near the "
            "observed value.",
        ),
        # ---- layer 1: does the gradient match what I think? ----
        Alert(
            "GRPOEngineLogprobGapCritical", g1, "engine_logprob_gap", "critical",
            # noise or fault: a systematic gap (the mean signed gap, k1, does not average out) from the first step;
            # or a jump of the gap above the stop line and a multiple of the setup's accepted level
            f"max by ({BY}) (abs(run:grpo_mismatch_kl_nats:window_mean)) >= {c.mismatch_kl_stop_nats:g} "
            f"or ({gap} >= {c.engine_gap_stop_nats:g} and {gap} >= on(job, run) ({c.engine_gap_jump_factor:g} * "
            f"max by ({BY}) (grpo_engine_logprob_gap_accepted_nats{c.matchers()})))", 120,
            "Trainer and rollout engine disagree systematically, or the gap jumped: stop training.",
            "Run {{ $labels.run }} reads " + _value("%.4g") + " nats over " + w + ": mean signed engine gap (k1 mismatch KL) "
            + _query('max(run:grpo_mismatch_kl_nats:window_mean{run=%q,estimator=\\"k1\\"})', "%.4g")
            + " nats, k3 "
            + _query('max(run:grpo_mismatch_kl_nats:window_mean{run=%q,estimator=\\"k3\\"})', "%.4g")
            + f" nats (stop at {c.mismatch_kl_stop_nats:g}: numeric noise averages out, top-p/top-k "
            "renormalisation, a temperature or other weights do not), mean |gap| "
            + _query(f"max({gap}{{run=%q}})", "%.4g")
            + " nats against the accepted level "
            + _query("max(grpo_engine_logprob_gap_accepted_nats{run=%q})", "%.3g")
            + f" (stop at {c.engine_gap_jump_factor:g}x it and >= {c.engine_gap_stop_nats:g}: stale or partially "
            "synced weights).",
            for_steps=1,
        ),
        Alert(
            "GRPOEngineLogprobGapWarning", g1, "engine_logprob_gap", "warning",
            f"{gap} > on(job, run) ({c.gap_clean_factor:g} * max by ({BY}) "
            f"(grpo_engine_logprob_gap_accepted_nats{c.matchers()})) and {gap} > {c.gap_floor_nats:g}", 600,
            "Trainer and rollout engine log-probs drift apart from the setup's accepted level.",
            "Mean engine log-prob gap of run {{ $labels.run }} is " + _value("%.4g") + f" nats over {w}, above "
            f"{c.gap_clean_factor:g}x the accepted level "
            + _query("max(grpo_engine_logprob_gap_accepted_nats{run=%q})", "%.3g")
            + " nats (the reference run's, else the run's own clean gap "
            + _query("max(grpo_engine_logprob_gap_clean_baseline_nats{run=%q})", "%.3g") + " nats).",
            for_steps=2,
        ),
        Alert(
            "GRPOEngineLogprobGapAboveSeedLine", g1, "engine_logprob_gap_level", "info",
            f"max by ({BY}) (grpo_engine_logprob_gap_clean_baseline_nats{c.matchers()}) >= {c.engine_gap_stop_nats:g} "
            f"unless on({BY}) max by ({BY}) ({ref}{c.matchers(metric='grpo_engine_logprob_gap_mean_nats')})", 0,
            "The run's own clean engine gap sits above the seed's stop line: confirm it once, then record it.",
            "The clean engine log-prob gap of run {{ $labels.run }} (its first "
            f"{c.gap_baseline_steps} rollouts) is " + _value("%.4g") + f" nats, above the seed's stop line "
            f"{c.engine_gap_stop_nats:g}. A bf16/fp16 engine is often here (0.010-0.018 on healthy bf16 stacks). "
            "Confirm it with the A/B/C preflight (trainer twice and engine once on frozen weights); if it holds, "
            "record it as reference_baseline grpo_engine_logprob_gap_mean_nats so later runs start from it. The "
            "run is judged against this level meanwhile; nothing is muted by this notice.",
        ),
        Alert(
            "GRPORatioClippedBeforeUpdate", g1, "onpolicy_ratio", "critical",
            f"run:grpo_onpolicy_outside_clip_tokens:window_ratio > {c.onpolicy_clip_stop_ratio:g}", 60,
            "The importance ratio is outside the clip range before any update: old and new log-probs differ.",
            "On on-policy updates of run {{ $labels.run }}, " + _value("%.3g") + " of loss tokens already lie "
            f"outside the clip range (threshold {c.onpolicy_clip_stop_ratio:g}): the weights did not move, so "
            "the probability path differs. Stop and fix it before reading any other curve.",
            for_steps=1,
        ),
        Alert(
            "GRPOOnPolicyRatioDrift", g1, "onpolicy_ratio", "warning",
            f"run:grpo_onpolicy_log_ratio_abs_max_nats:window_max > on(job, run) ({c.onpolicy_noise_factor:g} * "
            f"max by ({BY}) (grpo_onpolicy_log_ratio_clean_baseline_nats{c.matchers()})) "
            f"and run:grpo_onpolicy_log_ratio_abs_max_nats:window_max > {c.onpolicy_noise_floor_nats:g}", 0,
            "On-policy log ratios left the run's own recomputation noise: another probability path.",
            "The max |log r| of on-policy updates of run {{ $labels.run }} reached " + _value("%.3g") + f" nats "
            f"over {w}, above {c.onpolicy_noise_factor:g}x the run's own early noise "
            + _query("max(grpo_onpolicy_log_ratio_clean_baseline_nats{run=%q})", "%.3g")
            + f" nats (and {c.onpolicy_noise_floor_nats:g}), even if inside the clip band: the weights did not "
            "move, so trainer and behaviour policy no longer compute the same probabilities.",
            for_steps=2,
        ),
        Alert(
            "GRPONonFiniteValues", g1, "nonfinite", "critical",
            f"{_increase(c, 'grpo_nonfinite_values_total', by='job, run, tensor')} > 0", 60,
            "Non-finite values on loss tokens.",
            "Run {{ $labels.run }} saw " + _value("%.0f") + " NaN/Inf values in `{{ $labels.tensor }}` over "
            f"{w} (baseline: 0). Find the first non-finite tensor along the numeric path.",
        ),
        Alert(
            "GRPOLossMaskMismatch", g1, "loss_mask", "critical",
            f"{_increase(c, 'grpo_loss_mask_length_mismatch_sequences_total')}"
            f" + {_increase(c, 'grpo_loss_mask_outside_completion_tokens_total')} > 0", 60,
            "The loss mask disagrees with the completions.",
            "Run {{ $labels.run }}: " + _value("%.0f") + f" loss-mask faults over {w} (sequences whose loss-token "
            "count differs from their length, plus loss tokens outside completions; baseline: 0).",
        ),
        Alert(
            "GRPOLogRatioFuseBlowing", g1, "fuse", "warning",
            f"run:grpo_log_ratio_clamp_hit_tokens:window_ratio > {c.fuse_hit_ratio:g}", 300,
            "The numerical log-ratio clamp (the fuse before exp) is hit often.",
            "Run {{ $labels.run }}: " + _value("%.3g") + f" of loss tokens hit the log-ratio clamp over {w} "
            f"(threshold {c.fuse_hit_ratio:g}; should be ~0).",
            trend=True,
        ),
        Alert(
            "GRPOGradNormSpike", OPTIMIZER, "grad_norm", "warning",
            f"{_increase(c, 'grpo_grad_norm_spike_steps_total')} > 0", 0,
            "Pre-clip gradient norm spiked above its rolling median.",
            "Run {{ $labels.run }}: " + _value("%.0f") + f" optimizer step(s) over {w} had a pre-clip grad norm "
            f"above {c.grad_spike_factor:g}x the median of the previous {c.grad_spike_window_steps} non-zero "
            "norms (counted in the process, so no step between scrapes is missed); rolling median now "
            + _query("max(run:grpo_grad_norm_pre_clip:baseline_median{run=%q})") + ".",
            event=True,
        ),
        Alert(
            "GRPOGradClippingEveryStep", OPTIMIZER, "grad_clip", "warning",
            f"run:grpo_grad_clip_active_steps:window_ratio > {c.grad_clip_active_ratio:g} and on(job, run) "
            f"{_increase(c, 'grpo_optimizer_steps_total', steps=c.clip_window_steps)} >= {c.clip_window_steps // 2} "
            f"and on(job, run) run:grpo_grad_norm_clip_factor:window_median >= {c.grad_clip_carry_factor:g}",
            900,
            "Gradient clipping is active on nearly every step and carries the update.",
            "Run {{ $labels.run }}: " + _value("%.2f") + f" of optimizer steps were clipped over the last "
            f"{c.clip_window_steps} steps (threshold {c.grad_clip_active_ratio:g}), the median pre-clip norm "
            + _query("max(run:grpo_grad_norm_clip_factor:window_median{run=%q})", "%.2f")
            + f"x the clip (threshold {c.grad_clip_carry_factor:g}x): the update depends on the fuse.",
            for_steps=5,
        ),
        # ---- layer 2: does the reward measure what I think? ----
        Alert(
            "GRPOAdvantageAboveBound", g2, "advantage_bound", "critical",
            f"{_increase(c, 'grpo_advantage_over_bound_sequences_total')} > 0", 60,
            "Advantages above the group-normalisation bound: a data or reward bug.",
            "Run {{ $labels.run }}: " + _value("%.0f") + f" sequences over {w} have |A| above the bound "
            + _query("max(grpo_advantage_bound{run=%q})") + " (max |A| "
            + _query("max(grpo_advantage_abs_max{run=%q})") + ").",
        ),
        Alert(
            "GRPORewardCliff", g2, "reward_cliff", "critical",
            # the windowed mean: one noisy batch at a step of ten minutes is no cliff
            f'max by ({BY}) (run:grpo_reward_mean:window_mean{{component="total"}}) < on(job, run) '
            f'({c.reward_cliff_ratio:g} * run:grpo_reward_mean:baseline_median{{component="total"}}) '
            f'and on(job, run) run:grpo_reward_mean:baseline_median{{component="total"}} > {c.reward_cliff_min_baseline:g}',
            300,
            "Total reward fell off a cliff against its own baseline.",
            "Mean total reward of run {{ $labels.run }} over " + w + " is " + _value("%.3g") + ", below "
            f"{c.reward_cliff_ratio:g}x its baseline "
            + _query('max(run:grpo_reward_mean:baseline_median{run=%q,component=\\"total\\"})') + ".",
            trend=True,
        ),
        Alert(
            "GRPORewardHackSuspected", g2, "reward_hack", "warning",
            # window means, not the last batch: a hack is a trend, and one batch's correctness is a noisy share
            "run:grpo_reward_correctness:window_mean < on(job, run) "
            f"({c.correctness_drop_ratio:g} * run:grpo_reward_correctness:baseline_median) "
            f'and on(job, run) max by ({BY}) (run:grpo_reward_mean:window_mean{{component="total"}}) '
            f'>= on(job, run) run:grpo_reward_mean:baseline_median{{component="total"}}', 300,
            "Correctness falls while the total reward holds: another reward component is being gamed.",
            f"Mean correctness reward of run {{{{ $labels.run }}}} over {w} (component "
            + '{{ with printf "max by (component) (grpo_reward_component_role{run=%q,role=\\"correctness\\"})" '
            + '$labels.run | query }}{{ . | first | label "component" }}{{ else }}'
            + c.correctness_component + "{{ end }}) is " + _value("%.3g") + ", below "
            f"{c.correctness_drop_ratio:g}x its baseline "
            + _query("max(run:grpo_reward_correctness:baseline_median{run=%q})")
            + " while the total reward holds at "
            + _query('max(run:grpo_reward_mean:window_mean{run=%q,component=\\"total\\"})') + ".",
            trend=True,
        ),
        Alert(
            "GRPOTruncationSurge", g2, "truncation", "warning",
            f"run:grpo_truncated_completions:window_ratio > on(job, run) ({c.truncation_surge_factor:g} * "
            f"run:grpo_truncated_completions:baseline_ratio) and run:grpo_truncated_completions:window_ratio "
            f"> {c.truncation_surge_floor:g}", 600,
            "Many more completions hit the maximum length than usual.",
            "Run {{ $labels.run }}: " + _value("%.3g") + " of completions truncated over " + w + ", against a "
            "baseline of " + _query("max(run:grpo_truncated_completions:baseline_ratio{run=%q})") + ".",
            trend=True,
        ),
        Alert(
            "GRPOLengthGrowthIncorrectOnly", g2, "length_incorrect", "warning",
            f'max by ({BY}) ({growth}{{outcome="incorrect"}}) > {c.length_growth_ratio:g} and on(job, run) '
            f'max by ({BY}) ({growth}{{outcome="correct"}}) <= {c.length_flat_ratio:g} and on(job, run) '
            f'max by ({BY}) (run:grpo_completions:window_increase{{outcome="incorrect"}}) >= '
            f'{c.length_min_completions}', 900,
            "Only incorrect completions grow longer: loss aggregation, not a length hack.",
            "Mean length of incorrect completions of run {{ $labels.run }} is " + _value("%.2f") + "x its "
            "baseline while correct ones grow "
            + _query('max(run:grpo_completion_length_tokens:growth_ratio{run=%q,outcome=\\"correct\\"})', "%.2f")
            + "x.",
            trend=True,
        ),
        Alert(
            "GRPOLengthHack", g2, "length_hack", "warning",
            f'max by ({BY}) ({growth}{{outcome="correct"}}) > {c.length_growth_ratio:g} and on(job, run) '
            f'max by ({BY}) ({growth}{{outcome="correct"}}) > on(job, run) max by ({BY}) ({growth}{{outcome="incorrect"}}) '
            f'and on(job, run) max by ({BY}) (run:grpo_completions:window_increase{{outcome="correct"}}) >= '
            f'{c.length_min_completions}',
            900,
            "Correct completions grow longer, faster than incorrect ones: a length hack.",
            "Mean length of correct completions of run {{ $labels.run }} is " + _value("%.2f") + "x its "
            "baseline, faster than incorrect ones ("
            + _query('max(run:grpo_completion_length_tokens:growth_ratio{run=%q,outcome=\\"incorrect\\"})', "%.2f")
            + "x).",
            trend=True,
        ),
        # ---- layer 3: how many samples decide this update? ----
        Alert(
            "GRPOESSDrop", g3, "ess", "warning",
            f'max by ({BY}) (run:grpo_ess_ratio:window_mean{{level="token"}}) < on(job, run) ({c.ess_drop_factor:g} * '
            f'max by ({BY}) (run:grpo_ess_ratio:baseline_median{{level="token"}}))', 300,
            "The effective sample size ratio fell: a few samples decide the update.",
            "Token ESS ratio of run {{ $labels.run }} over " + w + " is " + _value("%.3g") + f", below "
            f"{c.ess_drop_factor:g}x its baseline "
            + _query('max(run:grpo_ess_ratio:baseline_median{run=%q,level=\\"token\\"})') + ".",
            trend=True,
        ),
        Alert(
            "GRPOZeroVarianceAbovePrediction", g3, "zero_variance", "warning",
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
            "Run {{ $labels.run }}: " + _value("%.3g") + f" of groups have zero reward variance without being "
            f"all-correct over {w}, against a predicted all-incorrect E[(1-p)^G] of "
            + _query("max(run:grpo_unsolved_zero_variance_groups_expected:window_mean{run=%q})") + " (zero variance in all "
            + _query("max(run:grpo_zero_variance_groups:window_ratio{run=%q})") + " against E[p^G+(1-p)^G] of "
            + _query("max(run:grpo_zero_variance_groups_expected:window_mean{run=%q})") + "; all-correct "
            + _query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_correct\\"})')
            + ", all-incorrect "
            + _query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_incorrect\\"})')
            + ").",
            trend=True,
        ),
        Alert(
            "GRPOFewGroupsCarrySignal", g3, "signal_groups", "warning",
            f"1 - run:grpo_zero_variance_groups:window_ratio < {c.signal_groups_min_ratio:g} {groups_enough} "
            # a learned task (all-correct groups dominate, as its prediction says) is success, not starvation:
            # that regime is GRPOZeroVarianceAbovePrediction's only when beyond the prediction
            "and on(job, run) (max by (job, run) (run:grpo_zero_variance_groups:window_ratio_by_outcome"
            '{outcome="all_correct"}) < 0.8 * run:grpo_zero_variance_groups:window_ratio)', 900,
            "Almost no group carries a task gradient, and not because the task is learned: a handful of samples "
            "decides every update.",
            "Run {{ $labels.run }}: only " + _value("%.3g") + f" of groups had reward variance over {w} "
            f"(line {c.signal_groups_min_ratio:g}); all-incorrect "
            + _query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_incorrect\\"})')
            + ", all-correct "
            + _query('max(run:grpo_zero_variance_groups:window_ratio_by_outcome{run=%q,outcome=\\"all_correct\\"})')
            + ". Check the verifier for false negatives first, then the base model's ability (SFT, curriculum, "
            "intermediate difficulty); do not switch on filtering before. Groups that repeat one completion "
            "(GRPODiversityCollapse, low entropy) mean a collapsed policy instead: read layer 4.",
            trend=True,
        ),
        Alert(
            "GRPOLowerClipDominant", g3, "clip_sides", "warning",
            f'max by ({BY}) (run:grpo_clipped_tokens:window_ratio{{bound="lower"}}) > {c.lower_clip_min:g} and on(job, run) '
            f'max by ({BY}) (run:grpo_clipped_tokens:window_ratio{{bound="upper"}}) < {c.upper_clip_max:g} '
            f"and on(job, run) run:grpo_upper_clip_reachable_tokens:window_ratio >= {c.upper_clip_reachable_min:g} "
            f'and on(job, run) max by ({BY}) (run:grpo_update_tokens:window_increase{{advantage_sign="negative"}}) '
            f">= {c.min_clip_tokens}", 900,
            "The lower clip bound cuts many tokens while the upper bound cuts almost none: collapse precursor.",
            "Run {{ $labels.run }}: lower-bound clip fraction " + _value("%.3g") + " of negative-advantage tokens, "
            "upper " + _query('max(run:grpo_clipped_tokens:window_ratio{run=%q,bound=\\"upper\\"})')
            + " of the positive-advantage tokens that could reach it ("
            + _query("max(run:grpo_upper_clip_reachable_tokens:window_ratio{run=%q})")
            + f" of them; thresholds {c.lower_clip_min:g} / {c.upper_clip_max:g}).",
            trend=True,
        ),
        Alert(
            "GRPOClipFractionHigh", g3, "clip_total", "warning",
            f"run:grpo_tokens_outside_clip:window_ratio > {c.clip_fraction_high:g} and on(job, run) "
            f"sum by ({BY}) (run:grpo_update_tokens:window_increase{{advantage_sign!=\"zero\"}}) >= {c.min_clip_tokens}",
            600,
            "Many tokens lie outside the clip range: updates too large or data too stale.",
            "Run {{ $labels.run }}: " + _value("%.3g") + f" of signed update tokens are outside the clip range "
            f"over {w} (threshold {c.clip_fraction_high:g}).",
            trend=True,
        ),
        Alert(
            "GRPORolloutsStale", g3, "staleness", "warning",
            f"{_increase(c, 'grpo_stale_update_steps_total')} > 0", 600,
            "The trainer learns from rollouts of an old policy.",
            "Run {{ $labels.run }}: " + _value("%.0f") + f" update steps over {w} trained on rollouts more than "
            f"{c.staleness_max_versions} policy versions old (counted on every step by the exporter; last scraped "
            "staleness " + _query("max(grpo_rollout_staleness_versions{run=%q})", "%.0f") + ").",
            for_steps=2, event=True,
        ),
        # ---- layer 4: does the policy still read the question? ----
        Alert(
            "GRPOEntropyCollapse", g4, "entropy", "warning",
            f"(run:grpo_entropy_mean_nats:window_mean < on(job, run) ({c.entropy_drop_factor:g} * "
            f"run:grpo_entropy_mean_nats:baseline_median) and on(job, run) ({pass_g_sharp})) or on(job, run) "
            f"(run:grpo_entropy_mean_nats:trend_mean < on(job, run) ({c.entropy_drop_factor:g} * "
            f"run:grpo_entropy_mean_nats:anchor) and on(job, run) ({pass_g_slow}))", 900,
            "Entropy collapses while pass@G falls.",
            "Mean token entropy of run {{ $labels.run }} is " + _value() + f" nats (over {w} against its "
            "trailing baseline " + _query("max(run:grpo_entropy_mean_nats:baseline_median{run=%q})")
            + f", or over {c.window(c.trend_window_steps)} against its early window "
            + _query("max(run:grpo_entropy_mean_nats:anchor{run=%q})")
            + f"; line {c.entropy_drop_factor:g}x), while pass@G is "
            + _query("max(run:grpo_pass_at_group_size:window_mean{run=%q})") + " (over "
            + c.window(c.trend_window_steps) + ": "
            + _query("max(run:grpo_pass_at_group_size:trend_mean{run=%q})") + ") against "
            + _query("max(run:grpo_pass_at_group_size:baseline_median{run=%q})") + " lately and "
            + _query("max(run:grpo_pass_at_group_size:peak{run=%q})") + " at its best.",
            trend=True,
        ),
        Alert(
            "GRPODiversityCollapse", g4, "diversity", "warning",
            f"(run:grpo_unique_completions_ratio:window_mean < {c.unique_ratio_min:g} or "
            "run:grpo_edit_distance_median_ratio:window_mean < on(job, run) "
            f"({c.edit_distance_drop_factor:g} * run:grpo_edit_distance_median_ratio:baseline_median) or "
            "run:grpo_edit_distance_median_ratio:window_mean < on(job, run) "
            f"({c.edit_distance_drop_factor:g} * run:grpo_edit_distance_median_ratio:anchor)) "
            # the seed's collapse is pass@k falling (第 2 篇 ③): identical completions while pass@G holds are a
            # learned task (one right answer), at any pass@1 and any warm start
            f"and on(job, run) ({pass_g_falls})", 900,
            "Completions of the same prompt became (nearly) identical while pass@G falls.",
            "Run {{ $labels.run }}: in-group diversity " + _value("%.3g") + f" over {w} (distinct share below "
            f"{c.unique_ratio_min:g}, or median edit distance below {c.edit_distance_drop_factor:g}x its baseline "
            + _query("max(run:grpo_edit_distance_median_ratio:baseline_median{run=%q})") + " or early window "
            + _query("max(run:grpo_edit_distance_median_ratio:anchor{run=%q})") + "), while pass@G is "
            + _query("max(run:grpo_pass_at_group_size:window_mean{run=%q})") + " against "
            + _query("max(run:grpo_pass_at_group_size:baseline_median{run=%q})") + " lately and "
            + _query("max(run:grpo_pass_at_group_size:peak{run=%q})") + " at its best; over "
            + c.baseline_window + " " + _query("max(run:grpo_pass_at_group_size:long_mean{run=%q})")
            + " against its early window " + _query("max(run:grpo_pass_at_group_size:anchor{run=%q})")
            + " (pass@1 " + _query("max(run:grpo_pass_at_1:trend_mean{run=%q})") + ").",
            trend=True,
        ),
        Alert(
            "GRPOPassAtGBelowBase", g4, "pass_at_g", "warning",
            f"run:grpo_pass_at_group_size:window_mean < on(job, run) "
            f'max by ({BY}) ({ref}{c.matchers(metric="grpo_pass_at_k_ratio")})', 1800,
            "pass@G fell below the base model: the run narrows the policy instead of teaching it.",
            "pass@G of run {{ $labels.run }} over " + w + " is " + _value("%.3g") + ", below the base model's "
            + _query(f'max({ref}{{run=%q,metric=\\"grpo_pass_at_k_ratio\\"}})') + ".",
            trend=True,
        ),
        Alert(
            "GRPORetrievalNearChance", g4, "retrieval", "warning",
            f"run:grpo_retrieval_accuracy_ratio:window_mean < on(job, run) "
            f"({c.retrieval_chance_factor:g} * max by ({BY}) (grpo_retrieval_chance_ratio{c.matchers()}))", 900,
            "Completions no longer identify their own prompt: template collapse.",
            "Retrieval accuracy of run {{ $labels.run }} over " + w + " is " + _value("%.3g") + f", below "
            f"{c.retrieval_chance_factor:g}x chance " + _query("max(grpo_retrieval_chance_ratio{run=%q})") + ".",
            trend=True,
        ),
    ]


def rule_files(c: MixinConfig) -> dict[str, dict[str, Any]]:
    """File name -> rule file content (a ``groups`` document)."""
    return {
        "grpo-recording.rules.yml": {"groups": [{"name": "grpo-recording", "rules": recording_rules(c)}]},
        "grpo-alerts.rules.yml": {"groups": [{"name": "grpo-alerts", "rules": [a.rule(c) for a in alerts(c)]}]},
    }
