"""Liveness: the exporter is scraped, the run reports steps, at the pace the rules were sized for."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import (
    BY,
    Alert,
    template_query,
    template_value,
)


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    lookback = c.duration(c.lifecycle_lookback_s)
    finished = f"(max by ({BY}) (last_over_time(grpo_run_finished{c.matchers()}[{lookback}])) == 1)"
    pod_targets = c.matchers('pod!=""')
    last_finished = f"max by (job, instance) (last_over_time(grpo_run_finished{c.matchers()}[{lookback}]))"
    return [
        Alert(
            "GRPOExporterDown", Layer.LIVENESS, "exporter", "critical",
            # a static target (local, compose) is down between runs: it pages only after serving a run that did
            # not report its normal end; a discovered pod (the `pod` label) exists only while its training does
            f"(up{c.matchers()} == 0 and on(job, instance) ({last_finished} == 0)) or "
            f"(up{pod_targets} == 0 unless on(job, instance) ({last_finished} == 1))", 120,
            "The grpo-exporter target is down and its run did not end normally: nothing below can be judged.",
            "Prometheus cannot scrape {{ $labels.job }} {{ $labels.instance }} (up = " + template_value("%g") + ") and the "
            "run there never reported a normal end (grpo_run_finished).",
        ),
        Alert(
            "GRPOTrainingStalled", Layer.LIVENESS, "stalled", "critical",
            f"time() - max by ({BY}) (last_over_time(grpo_last_step_timestamp_seconds{c.matchers()}[{lookback}])) "
            f"> {c.stall_s:g} unless on({BY}) {finished}",
            60,
            "Training has not reported a new step, and the run did not end normally.",
            "Run {{ $labels.run }} has reported no step for " + template_value("%.0f") + f"s (threshold {c.stall_s:g}s: "
            f"{c.stall_steps} typical steps of {c.step_seconds:g}s, at least {c.stall_after_s}s; its process may "
            "be hung or gone); last step "
            + template_query(f"max(last_over_time(grpo_last_step{{run=%q}}[{lookback}]))", "%.0f") + ".",
        ),
        Alert(
            "GRPOStepCadenceSlowerThanConfigured", Layer.LIVENESS, "cadence", "info",
            f"run:grpo_step_interval_seconds:mean > {c.cadence_tolerance * c.step_seconds * c.time_scale:g} "
            f"and on({BY}) (time() - max by ({BY}) (grpo_last_step_timestamp_seconds{c.matchers()}) < {c.stall_s:g})",
            3600,
            "Steps are much slower than the rules' step_seconds: their windows may hold too few steps.",
            "Run {{ $labels.run }} takes " + template_value("%.0f") + f"s per step on average over {c.baseline_window}, "
            f"more than {c.cadence_tolerance:g}x the configured step_seconds ({c.step_seconds:g}s, scaled). "
            "Regenerate the rules with `grpo-exporter rules --step-seconds S` (or step_seconds in the config) near the "
            "observed value.",
        ),
    ]
