"""The building blocks of the rules: the :class:`Alert` record and its Prometheus rule, and the PromQL and
alert-template fragments that recording rules and alerts share (windowed rates, means, rolling baselines,
anchors, sampling errors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig, Severity
from grpo_exporter.recorder.reading_doc import BY_LAYER

BY = "job, run"


OPTIMIZER = "1-optimizer"  # the seed's triage step 4: a layer-1 question, but no 0/1 gate (it inhibits nothing)


@dataclass(frozen=True)
class Alert:
    name: str
    layer: Layer | str
    family: str
    severity: Severity | Literal["none"]  # "none": GRPOWatchdog, routed by name to the dead man's switch
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
        without its condition (a slow signal crossing its line through noise fires once, not per flicker). A
        trend alert over a longer window than the rate window may set ``for_steps`` shorter: one batch moves a
        mean over N steps by 1/N of its deviation."""
        steps = (self.for_steps or c.window_steps + 1) if self.trend else self.for_steps
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
        layer = self.layer.value if isinstance(self.layer, Layer) else self.layer
        return rule | {
            "labels": {
                "severity": c.severities.get(self.name, self.severity),
                "layer": layer,
                "family": self.family,
            },
            "annotations": {
                "summary": self.summary,
                "description": self.description + (INCIDENT + reading_link(self.name, layer)
                                                   if self.severity != "none" else ""),
                "runbook_url": f"{c.runbook_url}#{self.name.lower()}",
            },
        }


#: the layers whose pages link the rollouts to read (a liveness page has none)
READING_LAYERS = tuple(BY_LAYER)
# Every page's description ends with where the flight recorder's latest incident of the run lies, when it wrote one
INCIDENT = (
    '{{ with printf "grpo_recorder_latest_incident_step{run=%q}" $labels.run | query }}{{ with first . }} Flight '
    'recorder: incident {{ label "incident" . }} (first anomalous step {{ value . | printf "%.0f" }}) in '
    '{{ label "directory" . }}; read it with `grpo-exporter inspect`.{{ end }}{{ end }}'
)


def reading_link(alert: str, layer: str) -> str:
    """Where the rollouts this page needs lie (the serving exporter's ``/reading``, read before any curve), for an
    alert of layers 1-4 of a run that publishes a reading set; the link is the scheme the exporter serves and the
    address Prometheus scrapes it at (``instance``)."""
    if layer not in READING_LAYERS:
        return ""
    query = f"alert={alert}&layer={layer}&format=text"
    return ('{{ with printf "grpo_reading_rollouts{job=%q,run=%q}" $labels.job $labels.run | query }}'
            '{{ with first . }} Rollouts to '
            f'read first: {{{{ label "scheme" . }}}}://{{{{ label "instance" . }}}}/reading?{query} (or '
            "`grpo-exporter read` that URL).{{ end }}{{ end }}")


def template_value(fmt: str = "%.3g") -> str:
    return f'{{{{ $value | printf "{fmt}" }}}}'


def template_query(expr: str, fmt: str = "%.3g") -> str:
    """Template text: the first value of ``expr`` (each ``%q`` = this alert's run, quotes escaped), or none."""
    runs = " ".join(["$labels.run"] * expr.count("%q"))
    return (
        f'{{{{ with printf "{expr}" {runs} | query }}}}{{{{ . | first | value | printf "{fmt}" }}}}'
        "{{ else }}none{{ end }}"
    )


def rate(c: MixinConfig, metric: str, by: str = BY, steps: int | None = None, **labels: str) -> str:
    return f"sum by ({by}) (rate({metric}{c.matchers(**labels)}[{c.window(steps)}]))"


def increase(c: MixinConfig, metric: str, by: str = BY, steps: int | None = None, **labels: str) -> str:
    return f"sum by ({by}) (increase({metric}{c.matchers(**labels)}[{c.window(steps)}]))"


def sampling_error(window: str) -> str:
    """The standard error of pass@G's mean over the ``window`` (``window`` or ``trend``) from the groups it
    holds: sqrt(p(1-p)/groups), p the window's own mean (0 where no group count is published)."""
    p = f"run:grpo_pass_at_group_size:{window}_mean"
    # without a group count (none published) no sampling error is known: the margin alone decides
    return (f"(sqrt({p} * (1 - {p}) / on(job, run) clamp_min(run:grpo_groups:{window}_increase, 1)) "
            f"or on(job, run) 0 * {p})")


def peak_sampling_error() -> str:
    """The standard error of the difference between pass@G's 20-step mean and the best 20-step mean the run has
    shown, both over the groups of one trend window: sqrt(2 p(1-p)/groups), p their mean. The slow leg wants 4
    of them: 2 for the test, 2 for the peak's own bias (the best of the ~7 independent windows of a day at
    10-min steps sits ~sqrt(2 ln 7) = 2 standard errors above the truth)."""
    p = "((run:grpo_pass_at_group_size:trend_mean + on(job, run) run:grpo_pass_at_group_size:peak) / 2)"
    return (f"(sqrt(2 * {p} * (1 - {p}) / on(job, run) clamp_min(run:grpo_groups:trend_increase, 1)) "
            "or on(job, run) 0 * run:grpo_pass_at_group_size:trend_mean)")


def early_window_sampling_error(window: str, reference: str = "run:grpo_pass_at_group_size:anchor",
                                share: str = "run:grpo_pass_at_group_size") -> str:
    """The standard error of the difference between a per-group ``share``'s mean (pass@G's unless named) over
    the ``window`` (``window``, ``collapse``, ``trend`` or ``long``) and the run's early window (its anchor: as
    many groups as a trend window holds), or another ``reference`` of at least that many groups:
    sqrt(p(1-p) (1/groups + 1/groups_anchor)), p their mean."""
    mean = f"{share}:{window}_mean"
    p = f"(({mean} + on(job, run) {reference}) / 2)"
    return (f"(sqrt({p} * (1 - {p}) * on(job, run) (1 / clamp_min(run:grpo_groups:{window}_increase, 1) + on(job, run) "
            f"1 / clamp_min(run:grpo_groups:trend_increase, 1))) or on(job, run) 0 * {mean})")


def anchor_sampling_error() -> str:
    """The standard error of the difference between pass@G's mean over the long (baseline) window and the run's
    early window (its anchor, the first anchor_steps = trend_window_steps rollouts: as many groups as a trend
    window holds): sqrt(p(1-p) (1/groups_long + 1/groups_anchor)), p their mean. Neither is selected from many
    windows, so 2 of them are the test."""
    p = "((run:grpo_pass_at_group_size:long_mean + on(job, run) run:grpo_pass_at_group_size:anchor) / 2)"
    return (f"(sqrt({p} * (1 - {p}) * on(job, run) (1 / clamp_min(run:grpo_groups:long_increase, 1) + on(job, run) "
            "1 / clamp_min(run:grpo_groups:trend_increase, 1))) or on(job, run) 0 * run:grpo_pass_at_group_size:long_mean)")


def fraction(numerator: str, denominator: str, on: str = "") -> str:
    """``numerator / denominator`` with 0/0 (a window without events, as the first window of a run of slow
    steps) dropped: no sample rather than NaN, which would poison every average or quantile over the window
    it falls in (a 10 h length baseline read NaN from the run's first step on)."""
    return f"({numerator} / {on}{denominator}) > -Inf"


def histogram_quantile(c: MixinConfig, q: float, metric: str, by: str = BY) -> str:
    """The ``q`` quantile of a classic histogram over the window, every rank's buckets added (a window without
    observations is dropped, never NaN)."""
    return f"histogram_quantile({q:g}, {rate(c, metric + '_bucket', by=by + ', le')}) > -Inf"


def windowed_mean(c: MixinConfig, metric: str, by: str = BY, steps: int | None = None, op: str = "avg_over_time(",
          **labels: str) -> str:
    """The windowed mean of a last-step gauge (one batch is a noisy sample; a window holds several); ``op``
    another ``*_over_time(`` of it, as in :func:`rolling_baseline` (``"quantile_over_time(0.5, "``: the median)."""
    return f"max by ({by}) ({op}{metric}{c.matchers(**labels)}[{c.window(steps)}]))"


MEDIAN = "quantile_over_time(0.5, "


def correctness(c: MixinConfig, series: str) -> str:
    """``series`` (by job, run, component) of the component that measures correctness: the one the run names
    (``grpo_reward_component_role{role="correctness"}``, e.g. the verifier's reward function), else the one
    called ``correctness_component``."""
    role = f'max by (job, run, component) (grpo_reward_component_role{c.matchers(role="correctness")})'
    return (f"max by ({BY}) ({series} * on(job, run, component) group_left() {role}) "
            f'or on(job, run) max by ({BY}) ({series}{{component="{c.correctness_component}"}})')


def rolling_baseline(c: MixinConfig, expr: str, by: str = BY, op: str = MEDIAN) -> str:
    """A rolling baseline over the window ending ``baseline_offset`` ago, once that window holds
    ``min_baseline_steps`` steps (counted by grpo_steps_total, not by scrapes)."""
    window, offset = c.baseline_window, c.baseline_offset
    return (f"max by ({by}) ({op}{expr}[{window}] offset {offset})) and on(job, run) "
            f"sum by ({BY}) (increase(grpo_steps_total{c.matchers()}[{window}] offset {offset})) "
            f">= {c.min_baseline_steps}")


def anchor(c: MixinConfig, metric: str, labels: str = "") -> str:
    """The run's early window of ``metric`` (grpo_run_anchor), else the reference run's value."""
    sel = {"metric": metric} | ({"labels": labels} if labels else {})
    return (f"max by ({BY}) (grpo_run_anchor{c.matchers(**sel)}) or on({BY}) "
            f"max by ({BY}) (grpo_reference_baseline{c.matchers(**sel)})")
