"""Grafana dashboards as code with grafana-foundation-sdk (the Grafana 11.x build), from the same config as
the rules: thresholds are read from :class:`MixinConfig`, never retyped.

Two dashboards:

* "GRPO training health": an overview row, then one row per signal-chain question in order (1 does the
  gradient match? and, for MoE models, do trainer and engine route tokens to the same experts? 2 does the reward
  measure the task? 3 how many samples decide the update? 4 does the policy still read the question?). Every panel is titled by the question it answers and says how to read it.
* "GRPO crash triage": one run, the first anomalous step, ratio and gap quantiles, non-finite and mask
  counters, grad norms before and after clipping.

Panels are declared as data (:mod:`grpo_exporter.mixin.panels`) so tests can inspect every query; :func:`build`
turns a spec list into the SDK's builders, setting panel ids and query refIds explicitly.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphThresholdsStyleMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, Threshold, ThresholdsMode, VariableRefresh

from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.panels import SEL, DashboardSpec, PanelSpec, RowSpec, W, q

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")


def training_health(c: MixinConfig) -> DashboardSpec:
    gap = "run:grpo_engine_logprob_gap_nats:window_mean"
    overview = RowSpec("Overview: is the run alive, and which layer pages?", (
        PanelSpec("Which signal-chain layers have firing alerts?",
                  "Firing GRPO alerts by layer. Read layer 1 first: while it fires, layers 2-4 mean nothing.",
                  (q(f'count by (layer) (ALERTS{{alertstate="firing",alertname=~"GRPO.*",{SEL}}})', "{{layer}}"),),
                  "short", "stat", ((1, "red"),), width=6),
        PanelSpec("Which step is each run at?", "Last step reported by each run.",
                  (q(f"max by (run) (grpo_last_step{{{SEL}}})"),), "none", "stat", width=6),
        PanelSpec("How many steps per minute?", "Training throughput; a drop to 0 precedes GRPOTrainingStalled.",
                  (q(f"sum by (run) (rate(grpo_steps_total{{{SEL}}}[{W}])) * 60"),), "short", width=6, min=0),
        PanelSpec("Is the exporter healthy?",
                  "Scrape target up, exporter errors per second by stage (should be 0), and with compile_step=\"auto\" "
                  "stage calls per second the eager step served instead of a compiled one, by reason (pending at "
                  "start is normal; the readings are the same either way).",
                  (q('up{job=~"$job"}', "up {{instance}}"),
                   q(f"sum by (run, stage) (rate(grpo_exporter_errors_total{{{SEL}}}[{W}]))", "errors {{run}} {{stage}}"),
                   q(f"sum by (run, reason) (rate(grpo_exporter_compiled_fallbacks_total{{{SEL}}}[{W}]))",
                     "eager instead of compiled {{run}} {{reason}}")),
                  "short", width=6, min=0),
    ))
    layer1 = RowSpec("1 · Does the gradient match what I think?", (
        PanelSpec("Do trainer and rollout engine agree on log-probs? (mean gap)",
                  f"Mean |rollout - trainer| log-prob gap on loss tokens against the run's accepted level (the reference "
                  f"run's, else its own first {c.gap_baseline_steps} rollouts). < {c.engine_gap_healthy_nats:g} "
                  f"usually healthy, {c.engine_gap_stop_nats:g} stop and check after measuring your own clean baseline "
                  f"(a bf16 engine's noise sits at 0.010-0.018). Warning at {c.gap_clean_factor:g}x the accepted level, "
                  f"critical at {c.engine_gap_jump_factor:g}x it above {c.engine_gap_stop_nats:g}. Judge the mean, never the max.",
                  (q(gap), q(f"max by (run) (grpo_engine_logprob_gap_accepted_nats{{{SEL}}})", "accepted {{run}}"),
                   q(f"{c.gap_clean_factor:g} * max by (run) (grpo_engine_logprob_gap_accepted_nats{{{SEL}}})", "warning line {{run}}"),
                   q(f"{c.engine_gap_jump_factor:g} * max by (run) (grpo_engine_logprob_gap_accepted_nats{{{SEL}}})", "jump line {{run}}")),
                  "none", thresholds=((c.engine_gap_healthy_nats, "yellow"), (c.engine_gap_stop_nats, "red")), min=0),
        PanelSpec("Does the gap grow with the turn? (multi-turn)",
                  "Mean engine gap per model turn (tool_mask tells the turns apart; 5+ gathers the later ones): a gap that grows with the turn is a boundary engine and trainer tokenize differently, e.g. a separator dropped at each tool call.",
                  (q(f"max by (run, turn) (grpo_engine_logprob_gap_turn_mean_nats{{{SEL}}})", "{{run}} turn {{turn}}"),),
                  "none", thresholds=((c.engine_gap_healthy_nats, "yellow"), (c.engine_gap_stop_nats, "red")), min=0),
        PanelSpec("Is the gap noise or a fault? (signed gap, mismatch KL)",
                  f"k1 = mean signed gap rollout - trainer (KL(engine || trainer)): noise averages out (~1e-3 on a healthy "
                  f"bf16 stack), top-p renormalisation, a temperature or other weights do not; critical when |k1| or k3 >= "
                  f"{c.mismatch_kl_stop_nats:g}. k3 below k1 and a correction weight mean below 1: a renormalised engine "
                  "distribution (mean weight = kept mass). Chi-square > 1: severe shift (verl).",
                  (q('max by (run, estimator) (run:grpo_mismatch_kl_nats:window_mean)', "{{run}} {{estimator}}"),
                   q(f"max by (run, level) (grpo_mismatch_chi_square{{{SEL}}})", "{{run}} chi2 {{level}}"),
                   q(f"max by (run) (grpo_mismatch_log_ppl_diff_nats{{{SEL}}})", "{{run}} log-ppl diff"),
                   q(f"sum by (run) (rate(grpo_rollout_correction_weight_sum{{{SEL}}}[{W}])) / "
                     f"sum by (run) (rate(grpo_rollout_correction_weight_count{{{SEL}}}[{W}])) - 1", "{{run}} mean weight - 1")),
                  "none", thresholds=((c.mismatch_kl_stop_nats, "red"),)),
        PanelSpec("How are the rollout-correction weights spread, before truncation?",
                  "Quantiles of pi_old / pi_rollout per token (before any TIS/MIS cap; TRL logs its ratio only after), the "
                  "sequence-geometric weight's p01/p99 over the window, the share above rollout_correction_cap, and the "
                  "share of loss tokens the engine returned without a log-prob (rollout_logprob_nan=unscored; left out "
                  "of every engine reading).",
                  (q(f'max by (run, quantile) (grpo_rollout_correction_weight{{quantile=~"0|0.5|0.99|1",{SEL}}})', "{{run}} q{{quantile}}"),
                   q(f"histogram_quantile(0.99, sum by (run, le) (rate(grpo_sequence_rollout_correction_weight_bucket{{{SEL}}}[{W}])))", "{{run}} sequence p99"),
                   q(f"histogram_quantile(0.99, sum by (run, le) (rate(grpo_token_rollout_correction_weight_bucket{{{SEL}}}[{W}])))", "{{run}} token p99 over the window"),
                   q(f"max by (run, level) (grpo_rollout_correction_capped_ratio{{{SEL}}})", "{{run}} capped {{level}}"),
                   q(f"sum by (run) (rate(grpo_rollout_unscored_tokens_total{{{SEL}}}[{W}])) / (sum by (run) "
                     f"(rate(grpo_rollout_unscored_tokens_total{{{SEL}}}[{W}])) + sum by (run) "
                     f"(rate(grpo_engine_logprob_gap_nats_count{{{SEL}}}[{W}])))", "{{run}} unscored share")),
                  "none"),
        PanelSpec("Which tokens disagree most? (gap quantiles)",
                  "p99, p99.9 and max of the engine gap in the last step: a few bad tokens can hit the clip while the mean looks fine.",
                  (q(f'max by (run, quantile) (grpo_engine_logprob_gap_nats{{quantile=~"0.99|0.999|1",{SEL}}})', "{{run}} q{{quantile}}"),
                   q("run:grpo_token_engine_logprob_gap_nats:window_p99", "{{run}} p99 over the window, all ranks")),
                  "none", min=0),
        PanelSpec("Is the ratio clipped before any update?",
                  "Share of loss tokens outside the clip range on on-policy updates (weights unchanged). Should be ~0.",
                  (q("run:grpo_onpolicy_outside_clip_tokens:window_ratio"),
                   q(f"max by (run) (grpo_onpolicy_log_ratio_abs_max_nats{{{SEL}}})", "max |log r| {{run}}"),
                   q(f"max by (run) (grpo_onpolicy_log_ratio_clean_baseline_nats{{{SEL}}})", "own noise {{run}}")),
                  "percentunit", thresholds=((c.onpolicy_clip_stop_ratio, "red"),), min=0),
        PanelSpec("Are there non-finite values or mask faults?",
                  "NaN/Inf per second by tensor (loss tokens only), sequences with a wrong loss-token count, loss tokens outside completions, loss tokens on tool output. Any is a bug.",
                  (q(f"sum by (run, tensor) (rate(grpo_nonfinite_values_total{{{SEL}}}[{W}])) > 0", "{{run}} {{tensor}}"),
                   q(f"sum by (run) (rate(grpo_loss_mask_length_mismatch_sequences_total{{{SEL}}}[{W}]))", "mask length {{run}}"),
                   q(f"sum by (run) (rate(grpo_loss_mask_outside_completion_tokens_total{{{SEL}}}[{W}]))", "outside completion {{run}}"),
                   q(f"sum by (run) (rate(grpo_loss_mask_tool_tokens_total{{{SEL}}}[{W}]))", "on tool output {{run}}")),
                  "short", thresholds=((1e-9, "red"),), min=0),
        PanelSpec("Is the log-ratio fuse blowing?",
                  "Share of tokens hitting the numerical clamp before exp. Should be ~0: frequent hits mean inconsistency or staleness.",
                  (q("run:grpo_log_ratio_clamp_hit_tokens:window_ratio"),),
                  "percentunit", thresholds=((c.fuse_hit_ratio, "orange"),), min=0),
        PanelSpec("How large is the gradient before and after clipping?",
                  f"Pre-clip norm (log before clip!), post-clip norm and {c.grad_spike_factor:g}x the rolling median: a spike crossing it is recorded, and pages once confirmed (panel below).",
                  (q(f"max by (run) (grpo_grad_norm_pre_clip{{{SEL}}})", "pre-clip {{run}}"),
                   q(f"max by (run) (grpo_grad_norm_post_clip{{{SEL}}})", "post-clip {{run}}"),
                   q(f"{c.grad_spike_factor:g} * run:grpo_grad_norm_pre_clip:baseline_median", "spike line {{run}}")),
                  "none", min=0),
        PanelSpec("Is a spike a real instability?", "Spikes (recorded); confirmed ones and update jumps page.",
                  tuple(q(f"sum by (run) (increase({m}_steps_total{{{SEL}}}[{c.window()}]))", f"{m[5:]} {{{{run}}}}")
                        for m in ("grpo_grad_norm_spike", "grpo_grad_norm_spike_confirmed", "grpo_param_update_jump")),
                  "short", min=0),
        PanelSpec("Does clipping act on every step?",
                  "Share of optimizer steps rescaled by gradient clipping. Nearly every step while the clip removes half "
                  f"the update or more (pre-clip norm >= {c.grad_clip_carry_factor:g}x post-clip, panel above) = the "
                  "root cause is unsolved; a norm steady a little above the line acts as a lower learning rate.",
                  (q("run:grpo_grad_clip_active_steps:window_ratio"),),
                  "percentunit", thresholds=((c.grad_clip_active_ratio, "orange"),), min=0),
        PanelSpec("How far does each optimizer step move the weights?",
                  "|dtheta| / |theta| over sampled parameters, and the KL to the reference policy (k3 estimator).",
                  (q(f"max by (run) (grpo_param_relative_update{{{SEL}}})", "|dθ|/|θ| {{run}}"),
                   q(f"max by (run) (grpo_kl_ref_nats{{{SEL}}})", "KL {{run}}")),
                  "none", min=0),
    ))
    decisions = "run:grpo_routing_differing_decisions:window_ratio"
    early = f'max by (run) (grpo_run_anchor{{metric="grpo_routing_decision_mismatch_ratio",{SEL}}})'
    routing = RowSpec("1 · MoE: do trainer and engine route tokens to the same experts?", (
        PanelSpec("How many routing decisions differ?",
                  "Share of (loss token, MoE layer) decisions whose experts differ between trainer and engine, over the "
                  "window, against the run's own early level, and the share of tokens differing in at least one layer. "
                  f"Never 0 without routing replay (~10% of decisions on Qwen3-30B-A3B in bf16): a rise above "
                  f"{c.routing_rise_factor:g}x the early level warns; with replay on, any decision that was not the "
                  "engine's (it differs, or the engine returned no route) is critical: the replay fell back.",
                  (q(decisions), q(early, "early level {{run}}"),
                   q(f"{c.routing_rise_factor:g} * {early}", "warning line {{run}}"),
                   q(f"max by (run) (grpo_routing_mismatch_tokens_ratio{{{SEL}}})", "tokens, any layer {{run}}"),
                   q(f"max by (run) (grpo_routing_replay_enabled{{{SEL}}})", "replay on {{run}}"),
                   q("run:grpo_routing_fallback_decisions:window_ratio and on(job, run) "
                     "max by (job, run) (grpo_routing_replay_enabled) == 1", "replay fell back {{run}}")),
                  "percentunit", min=0),
        PanelSpec("Which MoE layers route differently?",
                  "Share of loss tokens whose experts differ, per MoE layer (the 10 worst of the last rollout): one "
                  "layer rising alone is that layer's router out of sync.",
                  (q(f"topk by (run) (10, max by (run, moe_layer) (grpo_routing_mismatch_ratio{{{SEL}}}))",
                     "{{run}} layer {{moe_layer}}"),),
                  "percentunit", min=0),
        PanelSpec("How much of the engine gap is the router's?",
                  "Mean engine gap on tokens routed alike in every layer against those routed differently, and the "
                  "share of the gap's sum the latter carry: a gap that lives on differently routed tokens is the "
                  "router's, routing replay removes it.",
                  (q(f"max by (run, routing) (grpo_engine_logprob_gap_by_routing_mean_nats{{{SEL}}})",
                     "{{run}} {{routing}}"),
                   q(f"max by (run) (grpo_engine_logprob_gap_routing_share_ratio{{{SEL}}})", "{{run}} share")),
                  "none", min=0),
        PanelSpec("Is a router collapsing onto a few experts?",
                  "The most-loaded expert's share of routed slots as a multiple of an even split (1 = even, E/k = one "
                  "expert in every token's top-k), in the "
                  "worst MoE layer, for each side (needs moe_experts).",
                  (q(f"max by (run, side) (grpo_expert_load_peak_multiple{{{SEL}}})", "{{run}} {{side}}"),),
                  "none", min=0),
    ))
    layer2 = RowSpec("2 · Does the reward measure what I think?", (
        PanelSpec("Does the KL penalty hold the policy near its reference?",
                  f"KL to the reference over a trend window, against {c.kl_growth_factor:g}x its value over the trend window before, and the penalty coefficient: with a penalty the KL levels off; multiplying past {c.kl_runaway_min_nats:g} nats it is not acting (a sign or scale bug, a moving reference). Exactly 0 under a penalty: the reference is the policy.",
                  (q("run:grpo_kl_ref_nats:trend_mean", "KL {{run}}"),
                   q(f"{c.kl_growth_factor:g} * (run:grpo_kl_ref_nats:trend_mean offset {c.window(c.trend_window_steps)})", "runaway line {{run}}"),
                   q(f"max by (run) (grpo_kl_penalty_coefficient{{{SEL}}})", "coefficient {{run}}")),
                  "none", min=0),
        PanelSpec("Which reward component moves? (mean per component)",
                  "Mean reward per component and total. Format up while correctness is flat: learning layout, not solving.",
                  (q(f"max by (run, component) (grpo_reward_mean{{{SEL}}})", "{{run}} {{component}}"),), "none"),
        PanelSpec("How much do rewards differ inside a group, before normalisation?",
                  "Mean within-group std and range per component: sigma normalisation turns a tiny spread into a full-strength signal.",
                  (q(f"max by (run, component) (grpo_reward_group_std_mean{{{SEL}}})", "std {{run}} {{component}}"),
                   q(f"max by (run, component) (grpo_reward_group_range_mean{{{SEL}}})", "range {{run}} {{component}}")),
                  "none", min=0),
        PanelSpec("Is the advantage made of reward noise?",
                  f"Share of groups whose sub-1% reward spread sigma turns into a full-size advantage (trend mean, line at {c.noise_groups_max:g}), and where correctness ties, each component's share of the reward variance: the warning, a model chasing score noise.",
                  (q("run:grpo_noise_advantage_groups:trend_mean", "noise groups {{run}}"),
                   q(f"max by (run, component) (grpo_reward_tied_variance_ratio{{{SEL}}})", "tied variance {{run}} {{component}}")),
                  "percentunit", thresholds=((c.noise_groups_max, "orange"),), min=0),
        PanelSpec("Are advantages inside their bound?",
                  "Max |A| against the bound of the form the advantages follow ((G-1)/sqrt(G) for a group z-score with unbiased std; none for a batch std, whitening or a per-token shaped reward): above it is a data or reward bug. Inconsistent: advantages against their group's rewards, or groups that do not sum to 0.",
                  (q(f"max by (run) (grpo_advantage_abs_max{{{SEL}}})", "max |A| {{run}}"),
                   q(f"max by (run) (grpo_advantage_bound{{{SEL}}})", "bound {{run}}"),
                   q(f"sum by (run) (rate(grpo_advantage_over_bound_sequences_total{{{SEL}}}[{W}]))", "over bound/s {{run}}"),
                   q(f"sum by (run) (rate(grpo_advantage_inconsistent_sequences_total{{{SEL}}}[{W}]))", "inconsistent/s {{run}}")),
                  "none", min=0),
        PanelSpec("Which form do the advantages follow?",
                  "Sequences per second by the advantage form the data follows (unbiased or population group z-score, none: group-centred, batch, whitened, shaped per token, unknown), against the configured advantage_norm (grpo_run_info): a form that changes mid-run is a change of estimator or a bug.",
                  (q(f"sum by (run, form) (rate(grpo_advantage_form_sequences_total{{{SEL}}}[{W}]))", "{{run}} {{form}}"),),
                  "short", min=0),
        PanelSpec("Which answers grow longer, correct or incorrect?",
                  "Mean length by outcome, never merged: only incorrect growing = 1/|o| loss aggregation; correct growing faster = length hack.",
                  (q("run:grpo_completion_length_tokens:window_mean", "{{run}} {{outcome}}"),
                   q(f'max by (run, outcome) (grpo_completion_length_tokens{{quantile="0.99",{SEL}}})', "p99 {{run}} {{outcome}}"),
                   q("run:grpo_completion_length_distribution_tokens:window_p99", "p99 over the window {{run}} {{outcome}}")),
                  "none", min=0),
        PanelSpec("How many completions hit the maximum length?",
                  "Share of truncated completions (sample level; kept apart from token-level clip fractions) and its baseline.",
                  (q("run:grpo_truncated_completions:window_ratio"),
                   q("run:grpo_truncated_completions:baseline_ratio", "baseline {{run}}")),
                  "percentunit", thresholds=((c.truncation_surge_floor, "orange"),), min=0),
        PanelSpec("How many turns and tool calls does a completion take?",
                  "Multi-turn loops, as the framework counts them: mean and max model turns per completion, tool calls per completion (TRL's tools/call_frequency, verl's num_turns/*).",
                  (q(f"sum by (run) (rate(grpo_completion_turns_sum{{{SEL}}}[{W}])) / sum by (run) (rate(grpo_completion_turns_count{{{SEL}}}[{W}]))", "turns {{run}}"),
                   q(f'max by (run) (grpo_completion_turns{{quantile="1",{SEL}}})', "max turns {{run}}"),
                   q(f"sum by (run) (increase(grpo_tool_calls_total{{{SEL}}}[{W}])) / sum by (run) (increase(grpo_completions_total{{{SEL}}}[{W}]))", "tool calls {{run}}")),
                  "none", min=0),
        PanelSpec("Do tools fail, and what does asynchronous generation lose?",
                  "Failed share of tool calls (reward the model cannot earn); completions generated over more than one policy version (partial rollouts resumed on newer weights), completions dropped as too stale and completions aborted, per completion trained on.",
                  (q(f"sum by (run) (increase(grpo_tool_call_failures_total{{{SEL}}}[{W}])) / sum by (run) (increase(grpo_tool_calls_total{{{SEL}}}[{W}]))", "tool failures {{run}}"),
                   q(f"sum by (run) (increase(grpo_partial_completions_total{{{SEL}}}[{W}])) / sum by (run) (increase(grpo_completions_total{{{SEL}}}[{W}]))", "partial {{run}}"),
                   q(f"sum by (run) (increase(grpo_dropped_stale_completions_total{{{SEL}}}[{W}])) / sum by (run) (increase(grpo_completions_total{{{SEL}}}[{W}]))", "dropped stale {{run}}"),
                   q(f"sum by (run) (increase(grpo_aborted_completions_total{{{SEL}}}[{W}])) / sum by (run) (increase(grpo_completions_total{{{SEL}}}[{W}]))", "aborted {{run}}")),
                  "percentunit", min=0),
    ))
    layer3 = RowSpec("3 · How many samples decide this update?", (
        PanelSpec("How stale are the rollouts?", "Policy versions between the trainer and the rollouts it learns from: the batch's oldest, and per loss token (a trajectory as old as its oldest token, a long one weighing its tokens) with its max.",
                  (q(f"max by (run) (grpo_rollout_staleness_versions{{{SEL}}})", "batch {{run}}"),
                   q(f"max by (run) (grpo_token_staleness_mean_versions{{{SEL}}})", "per token {{run}}"),
                   q(f"max by (run) (grpo_token_staleness_max_versions{{{SEL}}})", "max {{run}}")),
                  "none", thresholds=((c.staleness_max_versions, "orange"),), min=0),
        PanelSpec("How many samples really carry the gradient? (ESS ratio)",
                  f"Effective sample size ratio per token and per sequence, and the token baseline: falling below {c.ess_drop_factor:g}x warns before grad norm spikes.",
                  (q(f"max by (run, level) (grpo_ess_ratio{{{SEL}}})", "{{run}} {{level}}"),
                   q('run:grpo_ess_ratio:baseline_median{level="token"}', "baseline {{run}}")),
                  "percentunit", min=0),
        PanelSpec("Are there more zero-variance groups than predicted?",
                  "Observed share of groups with identical rewards against the prediction E[p^G+(1-p)^G] from solve-rate history: a fixed 50% line is wrong. The alert reads the groups that are not all-correct against their part E[(1-p)^G]: all-correct beyond prediction is data too easy.",
                  (q("run:grpo_zero_variance_groups:window_ratio", "observed {{run}}"),
                   q("run:grpo_zero_variance_groups_expected:window_mean", "predicted {{run}}"),
                   q("run:grpo_unsolved_zero_variance_groups:window_ratio", "not all-correct {{run}}"),
                   q("run:grpo_unsolved_zero_variance_groups_expected:window_mean", "predicted all-incorrect {{run}}")),
                  "percentunit", min=0),
        PanelSpec("Are zero-variance groups all correct or all wrong?",
                  "All-correct: data too easy. All-incorrect: check the verifier first. The same share calls for opposite fixes.",
                  (q(f"sum by (run, outcome) (rate(grpo_zero_variance_groups_total{{{SEL}}}[{W}]))", "{{run}} {{outcome}}"),),
                  "short", min=0),
        PanelSpec("Does dynamic sampling still fill the batch cheaply?",
                  f"Kept share of the groups a dynamic-sampling loop generated (trend window) against its early window, and the groups it filtered by composition: the batch stays full while the pool shrinks. The alert pages at 1/{c.pool_overhead_growth:g} of the early window and below {c.pool_kept_max:g}.",
                  (q("run:grpo_kept_groups:trend_ratio", "kept {{run}}"),
                   q(f'max by (run) (grpo_run_anchor{{metric="grpo_kept_groups_ratio",{SEL}}})', "early window {{run}}"),
                   q(f"sum by (run, outcome) (rate(grpo_filtered_groups_total{{{SEL}}}[{W}])) / on(run) group_left() "
                     f"sum by (run) (rate(grpo_generated_groups_total{{{SEL}}}[{W}]))", "filtered {{outcome}} {{run}}")),
                  "percentunit", thresholds=((c.pool_kept_max, "orange"),), min=0),
        PanelSpec("Which clip bound cuts the gradient? (upper vs lower, never merged)",
                  "Truly clipped share: upper of the positive-advantage tokens that can reach it (p_old < 1/(1+eps_high)), lower of negative-advantage tokens. Lower high with upper ~0 = collapse precursor, unless few tokens can reach the upper clip (a solved task).",
                  (q('run:grpo_clipped_tokens:window_ratio{bound="upper"}', "upper {{run}}"),
                   q('run:grpo_clipped_tokens:window_ratio{bound="lower"}', "lower {{run}}"),
                   q(f"sum by (run) (rate(grpo_upper_clip_reachable_tokens_total{{{SEL}}}[{W}])) / sum by (run) "
                     f'(rate(grpo_update_tokens_total{{advantage_sign="positive",{SEL}}}[{W}]))', "upper reachable {{run}}")),
                  "percentunit", thresholds=((c.lower_clip_min, "orange"),), min=0),
        PanelSpec("How many tokens lie outside the clip range at all?",
                  f"Clipped plus opposite-sign out-of-range tokens over the signed (non-zero advantage) update tokens, which alone can be clipped; the danger line is {c.clip_fraction_high:g}.",
                  (q("run:grpo_tokens_outside_clip:window_ratio"),),
                  "percentunit", thresholds=((c.clip_fraction_high, "red"),), min=0),
        PanelSpec("How are update tokens split by advantage sign?",
                  "Loss tokens per second by advantage sign; zero-advantage tokens dilute a token-level loss.",
                  (q(f"sum by (run, advantage_sign) (rate(grpo_update_tokens_total{{{SEL}}}[{W}]))", "{{run}} {{advantage_sign}}"),
                   q(f"max by (run) (grpo_zero_advantage_tokens_ratio{{{SEL}}})", "zero-A share {{run}}")),
                  "short", min=0),
        PanelSpec("How extreme are the importance ratios?",
                  "Quantiles of pi/pi_old in the last update (one rank), and p1/p99 over the window and every rank from the histogram: the mean hides e^5 outliers.",
                  (q(f"max by (run, quantile) (grpo_importance_weight{{{SEL}}})", "{{run}} q{{quantile}}"),
                   q("run:grpo_token_importance_weight:window_p01", "{{run}} p1 over the window"),
                   q("run:grpo_token_importance_weight:window_p99", "{{run}} p99 over the window")),
                  "none", min=0),
        PanelSpec("Where do mixed groups' solve rates sit?",
                  "Share of mixed-outcome groups at the ends (solve rate <= 0.1 or > 0.9), where the lone minority gets the largest weight.",
                  (q(f'(sum by (run) (rate(grpo_mixed_group_solve_rate_ratio_bucket{{le="0.1",{SEL}}}[{W}])) + sum by (run) (rate(grpo_mixed_group_solve_rate_ratio_count{{{SEL}}}[{W}])) - sum by (run) (rate(grpo_mixed_group_solve_rate_ratio_bucket{{le="0.9",{SEL}}}[{W}]))) / sum by (run) (rate(grpo_mixed_group_solve_rate_ratio_count{{{SEL}}}[{W}]))'),),
                  "percentunit", min=0),
    ))
    layer4 = RowSpec("4 · Does the policy still read the question?", (
        PanelSpec("Is entropy collapsing? (all and top-20% positions)",
                  "Mean token entropy and the mean of the 20% most uncertain positions (the forking tokens), against its trailing baseline and the run's early window (a slow decline shows against the latter). Falling alone is sharpening; read it with pass@G.",
                  (q(f"max by (run) (grpo_entropy_mean_nats{{{SEL}}})", "mean {{run}}"),
                   q(f"max by (run) (grpo_entropy_top_mean_nats{{{SEL}}})", "top 20% {{run}}"),
                   q("run:grpo_token_entropy_nats:window_p50", "median token {{run}}"),
                   q("run:grpo_entropy_mean_nats:baseline_median", "baseline {{run}}"),
                   q(f'max by (run) (grpo_run_anchor{{metric="grpo_entropy_mean_nats",{SEL}}})', "early window {{run}}")),
                  "none", min=0),
        PanelSpec("Does pass@1 rise while pass@G falls?",
                  "pass@k from the rollouts (before any filtering), the base model's pass@G, and pass@G over the collapse window against the level GRPOPolicyCollapseOnset holds it to (the run's early window, or its mean over the steps before the window where it has learned above that since; paged when falling towards pass@1 while pass@1 holds): pass@G below base = narrowing, not learning.",
                  (q(f"max by (run, k) (grpo_pass_at_k_ratio{{{SEL}}})", "pass@{{k}} {{run}}"),
                   q(f'max by (run) (grpo_reference_baseline{{metric="grpo_pass_at_k_ratio",{SEL}}})', "base pass@G {{run}}"),
                   q("run:grpo_pass_at_group_size:collapse_mean", "pass@G, collapse window {{run}}"),
                   q("run:grpo_pass_at_group_size:collapse_level", "pass@G, onset level {{run}}"),
                   q("run:grpo_pass_at_group_size:anchor", "pass@G, early window {{run}}")),
                  "percentunit", min=0),
        PanelSpec("Do completions of one prompt still differ?",
                  "Distinct completions per group (2-3 of 16 is collapse), the median normalised edit distance, and the groups that repeat one wrong completion over the collapse window against the run's early window (GRPOPolicyCollapseOnset: rising as prompts lose their last right sample).",
                  (q(f"max by (run) (grpo_unique_completions_ratio{{{SEL}}})", "distinct {{run}}"),
                   q(f"max by (run) (grpo_edit_distance_median_ratio{{{SEL}}})", "edit distance {{run}}"),
                   q("run:grpo_repeated_wrong_groups:collapse_mean", "repeating one wrong completion {{run}}"),
                   q("run:grpo_repeated_wrong_groups:anchor", "repeating one wrong, early window {{run}}")),
                  "percentunit", thresholds=((c.unique_ratio_min, "orange"),), min=0),
        PanelSpec("Does each answer still find its own question?",
                  "Retrieval accuracy against chance 1/P: near chance = one template for every prompt, even at high entropy.",
                  (q(f"max by (run) (grpo_retrieval_accuracy_ratio{{{SEL}}})", "accuracy {{run}}"),
                   q(f"max by (run) (grpo_retrieval_chance_ratio{{{SEL}}})", "chance {{run}}")),
                  "percentunit", min=0),
        PanelSpec("Are mastered prompts still solved?",
                  "Accuracy of the mastered-prompt regression set at each evaluation against its early window (its size, grpo_regression_evaluated_completions, sets the noise): with dynamic sampling the batches never show solved prompts again, so forgetting shows here or nowhere. Dozens of prompts are an alarm, not a ruler.",
                  (q(f"max by (run) (grpo_regression_accuracy_ratio{{{SEL}}})", "accuracy {{run}}"),
                   q(f'max by (run) (grpo_run_anchor{{metric="grpo_regression_accuracy_ratio",{SEL}}})', "early window {{run}}")),
                  "percentunit", min=0),
    ))
    return DashboardSpec(
        "grpo-training-health", "GRPO training health",
        "The signal chain of a GRPO run, top to bottom: a failure in an upper row makes every row below it meaningless.",
        (overview, layer1, routing, layer2, layer3, layer4),
    )


def crash_triage(c: MixinConfig) -> DashboardSpec:
    faults = (f"(sum by (run) (increase(grpo_nonfinite_values_total{{{SEL}}}[{W}])) + "
              f"sum by (run) (increase(grpo_loss_mask_length_mismatch_sequences_total{{{SEL}}}[{W}])) + "
              f"sum by (run) (increase(grpo_loss_mask_outside_completion_tokens_total{{{SEL}}}[{W}]))) > 0 or "
              f"sum by (run) (increase(grpo_loss_mask_tool_tokens_total{{{SEL}}}[{W}])) > 0")
    rows = (
        RowSpec("Where did it start?", (
            PanelSpec("Which step was the first anomalous one?",
                      "Smallest step in the time range with a non-finite value or a mask fault; save the last normal step, this one and the next.",
                      (q(f"min_over_time((max by (run) (grpo_last_step{{{SEL}}}) and on(run) ({faults}))[$__range:])"),),
                      "none", "stat", width=6),
            PanelSpec("Which layer-1 alerts fired?", "GRPO layer-1 alerts of this run in the time range.",
                      (q(f'count by (alertname) (max_over_time(ALERTS{{alertstate="firing",layer=~"1-.*",{SEL}}}[$__range]))', "{{alertname}}"),),
                      "short", "stat", ((1, "red"),), width=6),
            PanelSpec("Where is the evidence?",
                      "The flight recorder's latest incident (recorder_dir): its first anomalous step, labelled with the incident and its directory, and the incidents written. `grpo-exporter inspect DIR` shows the last normal step, that step and the next, the rows that drove the trigger first (docs/recorder.md). Empty: the recorder is off, or nothing fired. Then the rollouts the reading set holds and where to read them (`grpo-exporter read` that address; docs/reading.md).",
                      (q(f"max by (run, incident, directory) (grpo_recorder_latest_incident_step{{{SEL}}})", "step of {{incident}} in {{directory}}"),
                       q(f"max by (run) (grpo_recorder_incidents_total{{{SEL}}})", "incidents"),
                       q(f"max by (run, scheme, instance) (grpo_reading_rollouts{{{SEL}}})", "rollouts to read at {{scheme}}://{{instance}}/reading")),
                      "none", "stat", width=6),
            PanelSpec("Did the preflight checks pass?",
                      "The last verdict of each preflight check published with GRPOMonitor.publish_check (A/B/C consistency, gradient-accumulation equivalence, plain-NLL reach, the mask table): 1 = passed, 0 = fix before reading any curve, -1 = it could not tell (empty, all-masked or non-finite inputs: its diagnosis says which; docs/checks.md).",
                      (q(f"min by (check) (grpo_preflight_check_passed{{{SEL}}} - grpo_preflight_check_cannot_tell{{{SEL}}})", "{{check}}"),), "none", "stat",
                      ((-0.5, "red"), (0.5, "green")), width=6, base="orange"),
        )),
        RowSpec("Probability path: do the two sides agree, is the ratio sane?", (
            PanelSpec("Engine gap quantiles", "p50/p99/p99.9/max of |rollout - trainer| log-prob on loss tokens, and the windowed mean.",
                      (q(f"max by (run, quantile) (grpo_engine_logprob_gap_nats{{{SEL}}})", "q{{quantile}}"), q("run:grpo_engine_logprob_gap_nats:window_mean", "mean")),
                      "none", thresholds=((c.engine_gap_healthy_nats, "yellow"), (c.engine_gap_stop_nats, "red")), width=12),
            PanelSpec("Importance ratio quantiles", "min/p50/p95/p99/max of pi/pi_old on loss tokens.",
                      (q(f"max by (run, quantile) (grpo_importance_weight{{{SEL}}})", "q{{quantile}}"),), "none", width=12),
        )),
        RowSpec("Numerics and masks", (
            PanelSpec("Non-finite values by tensor", "Cumulative NaN/Inf count per tensor: the first tensor to move is where to look.",
                      (q(f"max by (run, tensor) (grpo_nonfinite_values_total{{{SEL}}})", "{{tensor}}"),), "short", width=12),
            PanelSpec("Loss-mask faults", "Cumulative sequences with a wrong loss-token count, loss tokens outside completions and on tool output, and lengths that count tool tokens.",
                      (q(f"max by (run) (grpo_loss_mask_length_mismatch_sequences_total{{{SEL}}})", "length mismatch"),
                       q(f"max by (run) (grpo_loss_mask_outside_completion_tokens_total{{{SEL}}})", "outside completion"),
                       q(f"max by (run) (grpo_loss_mask_tool_tokens_total{{{SEL}}})", "on tool output"),
                       q(f"max by (run) (grpo_completion_length_tool_span_sequences_total{{{SEL}}})", "length counts tools"),
                       q(f"max by (run) (grpo_loss_mask_empty_sequences_total{{{SEL}}})", "masked whole")), "short", width=12),
        )),
        RowSpec("Update size", (
            PanelSpec("Grad norm before and after clipping", "The pre-clip norm shows the real spike; post-clip what the optimizer got.",
                      (q(f"max by (run) (grpo_grad_norm_pre_clip{{{SEL}}})", "pre-clip"), q(f"max by (run) (grpo_grad_norm_post_clip{{{SEL}}})", "post-clip")),
                      "none", width=12),
            PanelSpec("Clip fractions and ESS", "Upper/lower truly clipped shares and the token ESS ratio around the crash.",
                      (q('run:grpo_clipped_tokens:window_ratio{bound="upper"}', "upper"), q('run:grpo_clipped_tokens:window_ratio{bound="lower"}', "lower"),
                       q(f'max by (run) (grpo_ess_ratio{{level="token",{SEL}}})', "ESS token")), "percentunit", width=12),
        )),
    )
    return DashboardSpec("grpo-crash-triage", "GRPO crash triage", "One run around its first anomalous step.", rows,
                         multi_run=False)


def specs(c: MixinConfig) -> tuple[DashboardSpec, ...]:
    return training_health(c), crash_triage(c)


def dashboard_files(c: MixinConfig) -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{s.uid}.json": json.dumps(build(s), indent=2, sort_keys=True) + "\n" for s in specs(c)}


def build(spec: DashboardSpec) -> dict[str, Any]:
    """The dashboard JSON model (a dict) for a spec, built with grafana-foundation-sdk."""
    builder = (
        db.Dashboard(spec.title).uid(spec.uid).description(spec.description).tags(list(spec.tags))
        .refresh("30s").time("now-3h", "now").timezone("browser").editable()
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(db.QueryVariable("job").label("Job").datasource(DATASOURCE)
                       .query("label_values(grpo_build_info, job)").multi(True).include_all(True).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
        .with_variable(db.QueryVariable("run").label("Run").datasource(DATASOURCE)
                       .query('label_values(grpo_build_info{job=~"$job"}, run)').multi(spec.multi_run)
                       .include_all(spec.multi_run).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
    )
    panel_id, y = 1, 0
    for row in spec.rows:
        builder = builder.with_row(db.Row(row.title).id(panel_id).grid_pos(GridPos(h=1, w=24, x=0, y=y)))
        panel_id, y, x = panel_id + 1, y + 1, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y = 0, y + 8
            builder = builder.with_panel(_panel(p, panel_id, GridPos(h=8, w=p.width, x=x, y=y)))
            panel_id, x = panel_id + 1, x + p.width
        y += 8
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def _panel(p: PanelSpec, panel_id: int, pos: GridPos) -> Any:
    steps = [Threshold(value=None, color=p.base), *(Threshold(value=v, color=color) for v, color in p.thresholds)]
    panel: Any = (stat.Panel() if p.kind == "stat" else timeseries.Panel()).id(panel_id).title(p.title)
    panel = panel.description(p.description).unit(p.unit).datasource(DATASOURCE).grid_pos(pos)
    panel = panel.thresholds(db.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps))
    if p.kind != "stat" and p.thresholds:
        panel = panel.thresholds_style(_style())
    if p.min is not None:
        panel = panel.min(p.min)
    for i, query in enumerate(p.queries):
        target = prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(chr(ord("A") + i))
        panel = panel.with_target(target.datasource(DATASOURCE))
    return panel


def _style() -> Any:
    return GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED)
