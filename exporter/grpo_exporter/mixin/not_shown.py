"""The catalogue families no dashboard panel plots, each with why: a test holds every family to a panel or to
this table, so a new metric is shown or its absence explained (dashboards/README.md)."""

from __future__ import annotations

NOT_SHOWN: dict[str, str] = {
    "grpo_observe_duration_seconds": "exporter self-timing; read it in Prometheus when tuning the exporter",
    "grpo_exporter_compiled_stage_calls_total": "exporter self-monitoring (compile_step); the exporter panel shows "
    "its fallbacks to the eager step",
    "grpo_recorder_disk_usage_bytes": "flight-recorder housekeeping: the incidents' bytes, kept within its disk budget",
    "grpo_recorder_removed_incidents_total": "flight-recorder housekeeping: incidents removed, oldest first, for the budget",
    "grpo_dropped_reward_components_total": "configuration feedback (raise max_reward_components), not a training signal",
    "grpo_dropped_micro_steps_total": "API-use feedback (a step that never ends), logged by the exporter too",
    "grpo_stale_update_steps_total": "GRPORolloutsStale's counter; the staleness panel shows the versions and the line",
    "grpo_run_finished": "lifecycle: tells a normal end from a crash for GRPOExporterDown and GRPOTrainingStalled",
    "grpo_build_info": "used by the job and run variables, not plotted",
    "grpo_steps_total": "shown as steps per minute",
    "grpo_last_step_timestamp_seconds": "feeds GRPOTrainingStalled; the step panel shows progress",
    "grpo_optimizer_steps_total": "denominator of the clip-activity ratio",
    "grpo_onpolicy_checked_tokens_total": "denominator of the on-policy clip share",
    "grpo_completions_total": "denominator of the truncation share",
    "grpo_groups_total": "denominator of the zero-variance share",
    "grpo_run_info": "joins pass@k with the group size (pass@G recording rule)",
    "grpo_reward_component_role": "picks the correctness component for GRPORewardHackSuspected; the reward "
    "panel shows every component by name",
    "grpo_engine_logprob_gap_mean_nats": "the panels show the windowed mean recorded from _sum/_count",
    "grpo_onpolicy_outside_clip_ratio": "the panels show the windowed share recorded from the counters",
    "grpo_log_ratio_clamp_hit_ratio": "the panels show the windowed share recorded from the counters",
    "grpo_clipped_tokens_ratio": "the panels show the windowed shares recorded from the counters",
    "grpo_zero_variance_groups_ratio": "the panels show the windowed share recorded from the counters",
    "grpo_engine_logprob_gap_clean_baseline_nats": "the gap panel shows the accepted level, which is it unless a "
    "reference run gives one",
    "grpo_mismatch_ppl_multiple": "exp of each sequence's log-perplexity difference, which the mismatch panel shows",
    "grpo_rollout_correction_capped_tokens_total": "the capped share per step is shown; the counters are for windows",
    "grpo_rollout_correction_capped_sequences_total": "the capped share per step is shown; the counters are for windows",
    "grpo_regression_completions_total": "the regression panel shows each evaluation's accuracy; the counters are "
    "for windows over several evaluations",
    "grpo_regression_correct_completions_total": "the regression panel shows each evaluation's accuracy; the "
    "counters are for windows over several evaluations",
    "grpo_kept_groups_ratio": "the dynamic-sampling panel shows the kept share recorded from the counters over a "
    "trend window, and its anchor",
    "grpo_regression_evaluated_completions": "the set's size: it sets the accuracy's noise, which the alert weighs "
    "(the regression panel's description names it)",
}
