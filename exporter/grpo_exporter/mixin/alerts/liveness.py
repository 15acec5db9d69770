"""Liveness: the exporter is scraped, the run reports steps, at the pace the rules were sized for; a target that
was announced answers, and answers as the exporter; the alerting path itself is alive (GRPOWatchdog)."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import (
    BY,
    Alert,
    template_query,
    template_value,
)

WATCHDOG = "GRPOWatchdog"


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    return [*_target_alerts(c), *_run_alerts(c), Alert(
        WATCHDOG, Layer.LIVENESS, "watchdog", "none", "vector(1)", 0,
        "Always firing: the alerting pipeline (Prometheus, its rules, Alertmanager) is alive.",
        "This alert fires all the time on purpose. Alertmanager sends it to the watchdog receiver, a dead man's "
        "switch that calls a person when it stops arriving: then Prometheus, its rules or Alertmanager are down "
        "and no other alert could page.",
    )]


def _target_alerts(c: MixinConfig) -> list[Alert]:
    """Is the run's exporter scraped: down after serving, announced and never reached, or another program."""
    lookback = c.duration(c.lifecycle_lookback_s)
    announced = c.matchers('run!=""')  # a target that carries its run: written by the exporter (targets_dir)
    pod_targets = c.matchers('pod!=""')
    last_finished = _latest_run_finished(c, lookback)
    return [
        Alert(
            "GRPOExporterDown", Layer.LIVENESS, "exporter", "critical",
            # a static target (local, compose) is down between runs: it pages only after serving a run that did
            # not report its normal end (an announced target, targets_dir, the same: its file outlives a crash); a
            # discovered pod (the `pod` label) exists only while its training does
            f"(up{c.matchers()} == 0 and on(job, instance) ({last_finished} == 0)) or "
            f"(up{pod_targets} == 0 unless on(job, instance) ({last_finished} == 1))", 120,
            "The grpo-exporter target is down and its run did not end normally: nothing below can be judged.",
            "Prometheus cannot scrape {{ $labels.job }} {{ $labels.instance }} (up = " + template_value("%g") + ") and the "
            "run there never reported a normal end (grpo_run_finished).",
        ),
        Alert(
            "GRPOExporterNeverAnswered", Layer.LIVENESS, "exporter", "critical",
            # announced by the exporter, still a target, and down since (never up in the lookback), while the
            # announcement is younger than the lookback: a run that answered once and died is GRPOExporterDown's,
            # a withdrawn target is silent at once, a file left behind for longer than the lookback pages no more
            f"up{announced} == 0 and on(job, instance, run) max_over_time(up{announced}[{lookback}]) == 0 "
            f"unless on(job, instance, run) (up{announced} offset {lookback})",
            120,
            "A run announced its target, and Prometheus has never reached it: the run is not monitored.",
            "Prometheus has never scraped {{ $labels.job }} {{ $labels.instance }} (up = " + template_value("%g")
            + " since), which run {{ $labels.run }} announced in its targets file: the advertised address or port is "
            "not reachable from Prometheus (advertise_host, a firewall, a port only bound on loopback, http against "
            "https).",
        ),
        Alert(
            "GRPOTargetServesNoGRPOMetrics", Layer.LIVENESS, "exporter", "critical",
            # a target that served no run within the lookback (a static target of your own server between runs
            # has), or an announced one that serves another run than its own (a dead run's file at a new address)
            f"(up{c.matchers()} == 1 unless on(job, instance) group by (job, instance) "
            f"(last_over_time(grpo_run_info{c.matchers()}[{lookback}]))) or (up{announced} == 1 unless "
            f"on(job, instance, run) group by (job, instance, run) (grpo_run_info{c.matchers()}))",
            300,
            "Prometheus scrapes a target of the grpo job that does not serve its run: no run is monitored there.",
            "{{ $labels.job }} {{ $labels.instance }} answers (up = " + template_value("%g") + ") without the grpo_ "
            "series it should carry{{ with $labels.run }} for run {{ . }}{{ end }}: another program holds the port (a "
            "GPU node's DCGM exporter on 9400, a node exporter), the target points at the wrong port, or a run that "
            "is gone left its announcement where another run now serves. The run's exporter moved to a free port if "
            "its own was taken: announce it (targets_dir) or give it a port of its own.",
        ),
    ]


def _latest_run_finished(c: MixinConfig, lookback: str) -> str:
    """Per (job, instance): ``grpo_run_finished`` of the run the target served last (the series scraped last,
    within ``lookback``, matched on all its labels). An earlier run's clean end on the same address (the same node
    and port the next job), or under the same run name with other target labels (a run started again), must not
    hide the next crash, as a max over the target's runs would."""
    seen = f"max_over_time(timestamp(grpo_run_finished{c.matchers()})[{lookback}:{c.duration(60)}])"
    latest = f"{seen} == on(job, instance) group_left() max by (job, instance) ({seen})"
    return (f"max by (job, instance) (last_over_time(grpo_run_finished{c.matchers()}[{lookback}]) "
            f"and ({latest}))")


def _run_alerts(c: MixinConfig) -> list[Alert]:
    """Does the run report steps, at the pace the rules were sized for."""
    lookback = c.duration(c.lifecycle_lookback_s)
    finished = f"(max by ({BY}) (last_over_time(grpo_run_finished{c.matchers()}[{lookback}])) == 1)"
    return [
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
