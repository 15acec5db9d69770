"""Lines the exporter and the rules share, in one place: the in-process guard and the Prometheus alerts read
these fields.

``MonitorConfig`` (the guard, the in-process event counters) and ``MixinConfig`` (the rules, alerts and
dashboards) both inherit these models, so a line has one name, one default and one description wherever it
is set. The numbers are the seed's.
"""

from __future__ import annotations

from pydantic import Field

from grpo_exporter.settings import Settings

#: the longest run a step count is sized for: 10 million steps is years of training at a step a second
MAX_STEPS = 10_000_000


class StopLines(Settings):
    """Layer-1 stop criteria (seed 第 6 篇 (crash triage): fix, never tune). Documented once, in docs/exporter.md."""

    engine_gap_stop_nats: float = Field(
        0.01, gt=0, description="the stop line for the mean engine gap (mean >= 0.01 stop and check, "
        "after measuring your own clean baseline; the line applies to the mean, never the max). A clean gap above it "
        "is a notice to confirm once (GRPOEngineLogprobGapCleanLevelHigh); a gap above it and engine_gap_jump_factor "
        "x the accepted level stops (the guard, GRPOEngineLogprobGapCritical)",
    )
    engine_gap_healthy_nats: float = Field(
        0.001, gt=0, description="mean engine gap below which a run is usually healthy (mean < 0.001): a "
        "reference line of the dashboards; the alerts judge the gap against the run's accepted level instead",
    )
    engine_gap_jump_factor: float = Field(
        5.0, gt=1, description="a mean engine gap at or above the stop line and this multiple of the accepted level "
        "(grpo_engine_logprob_gap_accepted_nats: the reference run's, else the run's clean gap) stops: stale "
        "weights after a sync (TRL #5312: 0.015 -> 0.201), a partial sync, a LoRA merge that did not happen",
    )
    mismatch_kl_stop_nats: float = Field(
        0.01, gt=0, description="mismatch KL (|k1|, the mean signed gap rollout - old, or k3) at or above which "
        "training stops, from the first step, with no baseline: the part of the gap that does not average out (noise "
        "adds ~sd^2/2: ~1e-3 on healthy bf16 stacks, NeMo-RL; top-p 0.8 renormalisation adds 0.11 to k1)",
    )
    onpolicy_clip_stop_ratio: float = Field(
        0.01, ge=0, lt=1, description="share of loss tokens outside the clip range on an on-policy update above "
        "which training stops: the guard's stop and GRPORatioClippedBeforeUpdate (clipping before any "
        "update = stop; 1% leaves room for a stray rounding token, not for a second probability path)",
    )

    @property
    def stop_lines(self) -> StopLines:
        """Just the stop lines of a config that inherits them."""
        return StopLines(**{name: getattr(self, name) for name in StopLines.model_fields})


class EventLines(Settings):
    """Per-step events the exporter counts in process (a scrape every 30 s would miss a one-step event, and a
    step of minutes empties a rate window); the alerts page on the counters' increase."""

    grad_spike_factor: float = Field(
        10.0, gt=1, description="a step's pre-clip grad norm above this multiple of the median of the previous "
        "non-zero norms, and sudden for the run (grad_spike_tail_factor), is a spike (the field notes: a sudden "
        "spike of 10x or more), counted in grpo_grad_norm_spike_steps_total; each norm is taken per share of loss "
        "tokens with non-zero advantage (the gradient's dilution)",
    )
    grad_spike_tail_factor: float = Field(
        3.0, gt=1, le=1000, description="a spike is also above this multiple of the 90th percentile of the previous "
        "norms (the norm one step in ten reaches): a loop whose healthy norms swing by 10x (the first epoch on a "
        "rollout against the clipped later ones, a solved task's one mixed group against several) spikes only "
        "beyond its own swing",
    )
    grad_spike_extreme_factor: float = Field(
        100.0, gt=1, description="a spike above this multiple of the median needs no confirmation: nothing healthy "
        "reaches it (grpo_grad_norm_spike_confirmed_steps_total, GRPOGradNormSpike)",
    )
    grad_spike_confirm_steps: int = Field(
        2, ge=0, le=100, description="training steps after a spike's in which what a real instability moves with "
        "it (a non-finite value, the log-ratio fuse, ESS, |Δθ|/|θ|, a spike on another rollout) still confirms it; "
        "the spike's own step (its later epochs) always counts (the field notes: ESS warns, the grad norm "
        "confirms)",
    )
    grad_spike_ess_factor: float = Field(
        0.5, gt=0, lt=1, description="a token ESS ratio below this fraction of its smallest over the window "
        "confirms a spike (the importance weights concentrated on a few tokens)",
    )
    grad_spike_update_factor: float = Field(
        3.0, gt=1, description="|Δθ|/|θ| above this multiple of its largest over the window is a violent update: "
        "counted in grpo_param_update_jump_steps_total (GRPOParamUpdateJump), and it confirms a spike (measured "
        "at the next optimizer step, within grad_spike_confirm_steps)",
    )
    grad_spike_window_steps: int = Field(
        50, ge=2, le=10_000, description="how many previous non-zero pre-clip norms the spike median and spread "
        "are taken over (zero norms, steps without a mixed group in a solved task, are left out: they would make "
        "the median 0), and the confirming readings' run medians; at most 10,000, as the medians are taken every "
        "step",
    )
    grad_spike_min_steps: int = Field(
        20, ge=1, description="no spike is judged before this many non-zero norms were seen (a median of a "
        "handful of early norms is no baseline); nor is a confirming reading before as many of its values",
        le=MAX_STEPS,
    )
    staleness_max_versions: int = Field(
        4, ge=1, description="an update step trained on rollouts more than this many policy versions old counts "
        "in grpo_stale_update_steps_total; GRPORolloutsStale pages while such steps keep coming (the staleness "
        "gauge is a sawtooth that resets at every weight sync: a scrape can always land after the reset)", le=MAX_STEPS,
    )
    gap_baseline_steps: int = Field(
        20, ge=1, description="rollouts whose mean engine gap make the run's own clean gap "
        "(grpo_engine_logprob_gap_clean_baseline_nats, frozen after them; measure your own clean baseline), "
        "the accepted level when no reference_baseline gives one", le=MAX_STEPS,
    )
    gap_clean_factor: float = Field(
        3.0, gt=1, description="GRPOEngineLogprobGapWarning fires when the gap exceeds this multiple of the accepted "
        "level (grpo_engine_logprob_gap_accepted_nats) and the floor: a drift from the setup's own noise, at any "
        "level (an fp32 engine's 1e-7 or a bf16 engine's 0.015; a healthy run's gap moves within ~2x, TRL #5312)",
    )
    gap_floor_nats: float = Field(
        1e-5, gt=0, description="the clean-baseline comparison applies only above this mean gap: an exactly "
        "matching engine (clean gap ~0) must not page on rounding",
    )
    anchor_steps: int = Field(
        20, ge=1, description="values (steps) whose mean makes a run anchor: grpo_run_anchor for entropy, pass@k, "
        "rewards, ESS and diversity, and grpo_onpolicy_log_ratio_clean_baseline_nats (frozen after them; the "
        "run's own early window, which a slow decline or a persistent fault cannot move)", le=MAX_STEPS,
    )
    onpolicy_noise_factor: float = Field(
        10.0, gt=1, description="GRPOOnPolicyRatioDrift: an on-policy update's max |log r| above this multiple of "
        "the run's own recomputation noise (grpo_onpolicy_log_ratio_clean_baseline_nats) and the floor",
    )
    onpolicy_noise_floor_nats: float = Field(
        1e-3, gt=0, description="GRPOOnPolicyRatioDrift applies only above this max |log r|: a trainer that "
        "recomputes exactly (noise 0) must not page on one rounding step",
    )
    regression_anchor_evaluations: int = Field(
        3, ge=1, description="evaluations of the mastered-prompt regression set (observe_regression) whose mean "
        "accuracy makes its anchor (grpo_run_anchor, frozen after them); GRPOMasteredPromptsRegressed weighs the "
        "anchor's sampling noise as this many evaluations of the set's size", le=MAX_STEPS,
    )
