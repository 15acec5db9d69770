"""The one config behind the rules, the alerts, the Alertmanager routing and the dashboards.

Each knob says why you would change it and which alert it feeds. Windows, baselines and ``for`` durations
are sized in *steps* from ``step_seconds`` (with a floor in seconds each), so a run of 20-second steps and one
of 10-minute steps both get windows that hold several steps; all scale with ``time_scale`` (a demo or an
end-to-end test shrinks every window at once).
Thresholds are the seed's where it gives one; the others are stated as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from grpo_exporter.config_files import load_yaml_mapping
from grpo_exporter.mixin.deploy_config import DeploySettings
from grpo_exporter.thresholds import EventLines, StopLines

Severity = Literal["critical", "warning", "info"]
#: the project's home; runbook links default to the runbooks there
PROJECT_URL = "https://github.com/grpo-exporter/grpo-exporter"
RUNBOOKS = f"{PROJECT_URL}/blob/main/docs/runbooks.md"
#: settings an earlier version had, and where each went
MOVED = {
    "pager_webhook_url": "receivers.pager.webhook.url",
    "default_webhook_url": "receivers.default.webhook.url",
    "watchdog_webhook_url": "receivers.watchdog.webhook.url",
}


class MixinConfig(StopLines, EventLines, DeploySettings):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- selection ----
    selector: str = Field(
        'job="grpo"',
        description="label matchers of the exporter's series. Change it to your scrape job's name; every "
        "expression uses it, GRPOExporterDown included (an empty selector would watch every target's `up`).",
    )
    time_scale: float = Field(
        1.0, gt=0, le=1.0,
        description="multiplies every window and `for` duration: 1 for production; the demo and the end-to-end "
        "tests shrink time so that a run of minutes exercises every alert.",
    )

    # ---- cadence and windows ----
    step_seconds: float = Field(
        60.0, gt=0, description="the typical seconds of one training step (rollout + update, evaluation and "
        "checkpoints amortised). Set it to your run's: every window, baseline and `for` below is sized in steps "
        "from it (a window must hold several steps, or counter ratios read 0/0 and `for` resets). It is a setting, "
        "not derived live, because a PromQL range is a literal; GRPOStepCadenceSlowerThanConfigured (info) says "
        "when the observed cadence is slower than this.",
    )
    window_steps: int = Field(
        5, ge=1, description="steps every rate()/increase() window and windowed mean spans (at least "
        "`rate_window_s`). Feeds every counter-based alert and the windowed means.",
    )
    trend_window_steps: int = Field(
        20, ge=1, description="steps the slow comparisons average over: a value against the run's early window "
        "(entropy and pass@G for GRPOEntropyCollapse's slow leg, pass@1 for GRPODiversityCollapse). One "
        "batch's pass@G of 16 groups is a share with a standard error of ~0.08; twenty steps bring it to ~0.02.",
    )
    collapse_window_steps: int = Field(
        10, ge=1, description="steps GRPOPolicyCollapseOnset averages pass@G and pass@1 over (at least "
        "`rate_window_s`) before it compares them with the level they held: half the trend window, whose lag "
        "(half its span, 100 min at 10-min steps) would spend most of a collapse's first half, and twice the rate "
        "window, whose 5 steps of 16 groups are too few to tell a fall of 0.1 from noise",
    )
    rate_window_s: int = Field(
        300, ge=1, description="the shortest rate window whatever the cadence: ten 30-s scrapes, so fast steps "
        "still average over several scrapes."
    )
    baseline_steps: int = Field(
        60, ge=1, description="steps of the run's own history a rolling baseline is the median of (at least "
        "`baseline_window_s`). Feeds the trailing baselines of the ESS, reward, truncation, length, entropy, "
        "pass@G and edit-distance alerts.",
    )
    baseline_window_s: int = Field(3600, ge=1, description="the shortest rolling-baseline window")
    baseline_offset_steps: int = Field(
        10, ge=0, description="how many steps back the baseline window ends (at least `baseline_offset_s`), so "
        "a change cannot raise its own baseline before it is judged against it."
    )
    baseline_offset_s: int = Field(600, ge=0, description="the shortest baseline offset")
    min_baseline_steps: int = Field(
        20, ge=1, description="a rolling baseline exists only once its window holds this many *steps* "
        "(grpo_steps_total), whatever the scrape interval: a median of a handful of early steps is no baseline. "
        "Feeds every baseline-relative alert."
    )
    stall_steps: int = Field(
        3, ge=1, description="GRPOTrainingStalled: no new step for this many typical steps (and at least "
        "`stall_after_s`)."
    )
    stall_after_s: int = Field(
        900, ge=1, description="GRPOTrainingStalled: the shortest silence that pages. Set it above your slowest "
        "step (evaluation and checkpointing included)."
    )
    lifecycle_lookback_s: int = Field(
        21600, ge=1, description="how long a run's last samples are remembered after its process is gone: a run "
        "that died without close() pages GRPOTrainingStalled (and a static target GRPOExporterDown) for this long; "
        "a run that ended with close() (grpo_run_finished 1) pages nothing, and between runs nothing pages."
    )
    cadence_tolerance: float = Field(
        2.0, gt=1, description="GRPOStepCadenceSlowerThanConfigured (info): the mean step interval over the "
        "last baseline window is above this multiple of `step_seconds` (the windows are then too short)."
    )

    # ---- populations: a share of too few things means nothing ----
    min_window_groups: int = Field(
        64, ge=1, description="GRPOZeroVarianceAbovePrediction and GRPOFewGroupsCarrySignal judge a window only "
        "when it holds this many groups (the share of 16 groups moves by 0.06 per group)."
    )
    min_clip_tokens: int = Field(
        200, ge=1, description="the clip alerts judge a window only when it holds this many tokens of the sign "
        "they divide by (a clip share of a few tokens is noise; in a solved task few tokens carry a sign)."
    )

    # ---- layer 1 thresholds ----
    # engine_gap_stop_nats, engine_gap_healthy_nats and onpolicy_clip_stop_ratio: StopLines (shared with the guard)
    # engine_gap_jump_factor, mismatch_kl_stop_nats: StopLines too; the accepted level is published per run
    fuse_hit_ratio: float = Field(
        0.001, gt=0, lt=1, description="GRPOLogRatioFuseBlowing: share of tokens hitting the numerical log-ratio "
        "clamp. Should be ~0 (our choice of line)."
    )
    routing_replay_tolerance_ratio: float = Field(
        0.0, ge=0, lt=1, description="GRPORoutingReplayFellBack (critical): with routing replay on, the window's "
        "share of routing decisions that were not the engine's (differing, or with no route recorded by the "
        "engine) above this pages. 0: any (the trainer replays the engine's experts, so every difference is a "
        "replay that fell back)."
    )
    routing_rise_factor: float = Field(
        2.0, gt=1, description="GRPORoutingMismatchRising (warning): with routing replay off, the window's share of "
        "differing routing decisions above this multiple of the run's own early level (grpo_run_anchor; the "
        "reference run's when the run has none), or one MoE layer's share above this multiple of its own. An MoE "
        "engine's level is never 0 (~10% of decisions on Qwen3-30B-A3B in bf16): its rise is the fault (a weight "
        "sync that skips the router), its level is not."
    )
    routing_rise_floor_ratio: float = Field(
        0.02, gt=0, lt=1, description="GRPORoutingMismatchRising: and at least this much above the early level "
        "(an absolute share, of decisions or of a layer's tokens): a router that agrees on 99.9% of decisions may "
        "double without meaning."
    )
    # grad_spike_factor, grad_spike_window_steps, grad_spike_min_steps, gap_baseline_steps, gap_clean_factor,
    # gap_floor_nats: EventLines (judged by the exporter or against what it publishes)
    grad_clip_active_ratio: float = Field(
        0.9, gt=0, le=1, description="GRPOGradClippingEveryStep: share of optimizer steps clipped. Clipping "
        "on nearly every step = root cause unsolved."
    )
    grad_clip_carry_factor: float = Field(
        2.0, gt=1, description="GRPOGradClippingEveryStep pages only while the clip carries the update: the median "
        "pre-clip norm over the clip window is at least this multiple of the median post-clip norm (the clip removes "
        "half of the typical update or more). 2 is the smallest integer scaling error "
        "(a norm off by the accumulation steps or world size). A norm steady a little above a configured line "
        "is the run's effective learning rate (world 130 of docs/worlds-200.md: 1.25x the line on 84% of its steps), "
        "not a fault."
    )
    grad_clip_onset_ratio: float = Field(
        0.5, gt=0, lt=1, description="GRPOGradClippingEveryStep pages the clip *starting* to carry the update: "
        "within the last baseline window a clip window had fewer than this share of its steps clipped. A loop "
        "configured with a clip below its own healthy norms is clipped from its first step and its norms fall as it "
        "learns (docs/worlds-200.md: clip 0.5 at 1.5-3.4x); the field notes' 'clipped on every step' is a change."
    )
    grad_clip_extreme_factor: float = Field(
        10.0, gt=1, description="GRPOGradClippingEveryStep pages whatever the run's history once the median "
        "pre-clip norm is this multiple of the clip: no healthy loop of the world sweep passes 3.4x, a gradient "
        "scaled by the accumulation steps from the first step does."
    )
    clip_window_steps: int = Field(
        20, ge=1, description="GRPOGradClippingEveryStep: steps its share is taken over. A healthy run whose "
        "norms sit near the clip is clipped on many steps in a row; 'every step' needs a long run of them."
    )
    # onpolicy_noise_factor, onpolicy_noise_floor_nats, anchor_steps, regression_anchor_evaluations: EventLines
    # (the exporter's anchors)

    # ---- layer 2 thresholds ----
    reward_cliff_ratio: float = Field(
        0.5, gt=0, lt=1, description="GRPORewardCliff: total reward below this share of its own baseline."
    )
    reward_cliff_min_baseline: float = Field(
        0.05, ge=0, description="GRPORewardCliff is not judged while the baseline reward is below this (a run "
        "that never had reward cannot fall off a cliff)."
    )
    correctness_component: str = Field(
        "correctness", min_length=1, description="GRPORewardHackSuspected: the reward component that measures the "
        "task itself (the `component` label your training passes to reward_components), for runs that do not "
        "name theirs (a monitor's correctness_component, which the TRL adapter sets to the verifier, wins)"
    )
    correctness_drop_ratio: float = Field(
        0.7, gt=0, lt=1, description="GRPORewardHackSuspected: correctness below this share of its baseline ..."
    )
    truncation_surge_factor: float = Field(2.0, gt=1, description="GRPOTruncationSurge: x the baseline share")
    truncation_surge_floor: float = Field(
        0.05, ge=0, lt=1, description="GRPOTruncationSurge: and above this share, held over `truncation_hold_steps` "
        "(answers near the length limit swing: a healthy run went 0.01 -> 0.11 for 20 steps and back)"
    )
    truncation_surge_share: float = Field(
        0.15, gt=0, lt=1, description="GRPOTruncationSurge: a share this large pages without being held (the field "
        "notes: many samples hitting max_len, whose rewards are mostly waste); above a healthy run's 0.11 "
        "excursion near the limit"
    )
    truncation_hold_steps: int = Field(
        30, ge=1, description="GRPOTruncationSurge: steps a surge below `truncation_surge_share` must hold above "
        "the floor (longer than a healthy run's excursion near the limit, 20 steps)"
    )
    length_growth_ratio: float = Field(
        1.2, gt=1, description="the length alerts: mean length over this multiple of its own baseline is growth"
    )
    length_flat_ratio: float = Field(
        1.05, ge=1, description="GRPOLengthGrowthIncorrectOnly: correct answers grow less than this"
    )
    length_min_completions: int = Field(
        32, ge=1, description="the length alerts: completions of the growing outcome a rate window must hold "
        "(how many samples decide: a solved run's few incorrect completions move their mean 20% on one long one)"
    )

    # ---- layer 3 thresholds ----
    ess_drop_factor: float = Field(0.5, gt=0, lt=1, description="GRPOESSDrop: token ESS ratio below this x baseline")
    zero_variance_margin: float = Field(
        0.1, ge=0, lt=1, description="GRPOZeroVarianceAbovePrediction: observed share above the predicted "
        "E[p^G+(1-p)^G] by more than this (absolute). The field notes: never a fixed 50% line."
    )
    lower_clip_min: float = Field(0.05, gt=0, lt=1, description="GRPOLowerClipDominant: lower clip share above")
    upper_clip_max: float = Field(
        0.005, ge=0, lt=1, description="GRPOLowerClipDominant: while the upper clip share of the tokens that "
        "could reach it (grpo_upper_clip_reachable_tokens_total) is below this"
    )
    upper_clip_reachable_min: float = Field(
        0.2, gt=0, le=1, description="GRPOLowerClipDominant is judged only while this share of positive-advantage "
        "tokens can reach the upper clip at all (p_old < 1/(1+eps_high)); in a solved task most cannot, and a "
        "missing upper clip is geometry, not a collapse precursor"
    )
    signal_groups_min_ratio: float = Field(
        0.1, gt=0, lt=1, description="GRPOFewGroupsCarrySignal: share of groups with reward variance (the only "
        "ones with a task gradient) below this over a window, while all-correct groups are not 80% of "
        "the zero-variance ones (a learned task is success; all-correct beyond its prediction is "
        "GRPOZeroVarianceAbovePrediction's). At 60-70% zero-variance groups filtering already costs a lot; "
        "at 90% the update is decided by a handful of groups"
    )
    clip_fraction_high: float = Field(
        0.2, gt=0, lt=1, description="GRPOClipFractionHigh: the field notes' danger line, crossed *suddenly*: the "
        "share must also be `clip_fraction_rise` x its rolling baseline"
    )
    clip_fraction_rise: float = Field(
        2.0, gt=1, description="GRPOClipFractionHigh: x the run's own baseline share. Several epochs per rollout "
        "keep a healthy share at 0.1-0.3 from the first step (the later epochs move off the rollout's policy)"
    )
    clip_fraction_extreme: float = Field(
        0.4, gt=0, lt=1, description="GRPOClipFractionHigh pages above this share whatever the baseline (and before "
        "one exists): twice the danger line, above every healthy loop of the world sweep"
    )
    # staleness_max_versions: EventLines (counted by the exporter)

    # ---- layer 4 thresholds ----
    entropy_drop_factor: float = Field(
        0.5, gt=0, lt=1, description="GRPOEntropyCollapse: windowed entropy below this x its trailing baseline "
        "(with pass@G below its trailing baseline), or below this x the run's anchor (with pass@G below the "
        "best the run has shown by `peak_drop_margin`): a sharp drop, or a slow one over hours"
    )
    entropy_alarm_factor: float = Field(
        0.95, gt=0, lt=1, description="GRPOPolicyCollapseOnset: windowed entropy below this x the run's "
        "early window is the alarm (the field notes: mean entropy is only an alarm line, and it falls in any run that "
        "learns; what they read is its fall together with pass@k's). At 0.85 the line held a collapse whose entropy "
        "falls slowly at first (the fall's square: 0.85 at 8 h of a collapse from 4 h to 12 h) past its pass@G "
        "evidence by up to 1.1 h in our replays; at 0.95 no healthy world of the 200 pages it. It pages only "
        "while pass@G also falls below the level it held (the run's early window, or its trailing baseline where "
        "that is higher), by more than "
        "`collapse_standard_errors` of its sampling error and than `pass_drop_margin`, and falls towards pass@1 "
        "(the spread pass@G - pass@1 narrows by `pass_drop_margin`): the collapse, pass@k falling while "
        "pass@1 holds"
    )
    collapse_standard_errors: float = Field(
        2.5, gt=0, description="GRPOPolicyCollapseOnset: how many standard errors of the difference "
        "between pass@G's windowed mean and the level it held (sqrt(p(1-p)(1/groups + 1/groups)), the groups "
        "each holds) the fall must exceed. More than two: the window is judged afresh at every evaluation. At 10-min "
        "steps and 16 groups a step, 3 paged a collapse over 8 h (half-way at 4 h) at 7.8 h on its slowest random seed "
        "of 8 and 2.5 at 7.3 h, the others within 2.4-3.2 h"
    )
    collapse_min_groups: int = Field(
        100, ge=1, description="GRPOPolicyCollapseOnset: each of its windows (collapse, trend, long) is judged only "
        "when it holds this many groups (dozens of prompts are an alarm, not a ruler). Below it a pass@G near 1 "
        "moves by whole groups, far from the normal approximation its standard error assumes: at 4 groups a "
        "step, 4 failed groups of 40 read as a fall of 0.08 from 0.98"
    )
    repeat_standard_errors: float = Field(
        3.0, gt=0, description="GRPOPolicyCollapseOnset, its repeated-wrong leg: how many standard errors "
        "(sqrt(p(1-p)(1/groups + 1/groups_early)), p their mean share) the share of groups that repeat one wrong "
        "completion (`grpo_repeated_wrong_groups_ratio`) over the collapse, trend or long window must exceed the run's "
        "early window by, and by `pass_drop_margin` at least. Three, not `collapse_standard_errors`: a share near 0 "
        "moves by whole groups, and its tail is heavier than the normal's"
    )
    repeat_min_groups: int = Field(
        40, ge=1, description="GRPOPolicyCollapseOnset, its repeated-wrong leg: a window is judged when it holds "
        "this many groups. Fewer than `collapse_min_groups`: the share rises from about 0, where a handful of "
        "groups is already many standard errors; a smaller window lags a slow collapse less"
    )
    repeat_pass_share: float = Field(
        0.5, gt=0, le=1, description="GRPOPolicyCollapseOnset, its repeated-wrong leg: pass@G must be below its "
        "early window by at least this share of the repeated-wrong share's rise. In a collapse the groups that "
        "start to repeat a wrong completion are mostly prompts that lost their solution (pass@G falls by 0.6-0.8 "
        "of the rise in our replays: the rest were never solved); in a run whose unsolved prompts narrow onto one "
        "wrong answer (the sweep's weak warm starts: the share rises by 0.1-0.3 while pass@G holds or rises) a "
        "window's noise alone must make up half of the rise"
    )
    pass_drop_margin: float = Field(
        0.05, ge=0, lt=1, description="GRPOEntropyCollapse, fast leg: windowed pass@G this far below its trailing "
        "baseline is falling; a solved task's pass@G of ~1 dips by one failed group without falling. "
        "GRPOPolicyCollapseOnset's floor too: pass@G this far below the level it held, and the spread "
        "pass@G - pass@1 this much narrower"
    )
    peak_drop_margin: float = Field(
        0.1, ge=0, lt=1, description="GRPOEntropyCollapse, slow leg: pass@G over 20 steps this far below the best "
        "20-step pass@G of the run (or its early window) is falling. Wider than `pass_drop_margin`: the best of "
        "many noisy means sits above the truth. GRPODiversityCollapse's long leg uses it too: pass@G over the "
        "baseline's window this far below the run's early window"
    )
    peak_window_s: int = Field(
        86400, ge=1, description="how far back the run's best 20-step pass@G is remembered (the slow leg of "
        "GRPOEntropyCollapse compares against it: a run that learned, then declines for hours)"
    )
    unique_ratio_min: float = Field(
        0.2, gt=0, lt=1, description="GRPODiversityCollapse: distinct completions per group (16 samples "
        "down to 2-3 distinct is collapse), paged only while pass@G falls (`pass_drop_margin` below its trailing "
        "baseline, `peak_drop_margin` below its best, or over the baseline's window `peak_drop_margin` below the "
        "run's early window; each also by its sampling error): identical correct completions are a learned task"
    )
    edit_distance_drop_factor: float = Field(
        0.5, gt=0, lt=1, description="GRPODiversityCollapse: in-group edit distance below this x its baseline"
    )
    retrieval_chance_factor: float = Field(
        1.5, gt=1, description="GRPORetrievalNearChance: retrieval accuracy below this x chance 1/P"
    )
    regression_noise_sigmas: float = Field(
        4.0, gt=0, description="GRPOMasteredPromptsRegressed: the regression set's last accuracy below its early "
        "window by more than this many standard errors of the difference (binomial over the set's completions "
        "and the anchor's regression_anchor_evaluations of the same size; an upper bound for a fixed set, "
        "whose prompts do not change between evaluations). 4: ~3e-5 per evaluation of a healthy run"
    )
    regression_min_drop: float = Field(
        0.05, gt=0, lt=1, description="GRPOMasteredPromptsRegressed: and by at least this much accuracy: a set "
        "solved without a miss early (pooled p near 1, its noise estimate near 0) must not page on one or two "
        "misses, and a large set's few-point shift is no forgetting (dozens of prompts are an alarm, not "
        "a ruler)"
    )
    noise_groups_max: float = Field(
        0.3, gt=0, lt=1, description="GRPOAdvantageFromRewardNoise: the share of groups, over a trend window, whose "
        "advantage is a sub-1% reward spread scaled to full size by sigma (our number: the field notes say to "
        "watch the range before normalisation; a 0/1 verifier leaves no such group, a weak component's noise can "
        "supply 94-100% of them)"
    )
    kl_growth_factor: float = Field(
        4.0, gt=1, description="GRPOKLToReferenceRunaway: the KL to the reference over a trend window above this "
        "many times its mean over the trend window before (a runaway multiplies: 0.83 -> 6.7 nats in 100 steps; a "
        "constrained run's KL levels off)"
    )
    kl_runaway_min_nats: float = Field(
        0.5, gt=0, description="GRPOKLToReferenceRunaway: and above this many nats per token (not a published line: "
        "ours, where a policy is far from its reference by any constrained run we know; below it growth is "
        "the ordinary drift of the first hours, 1e-4 to 1e-2 nats, tenfold and harmless)"
    )
    pool_overhead_growth: float = Field(
        2.0, gt=1, description="GRPODynamicSamplingPoolShrinking: the groups a dynamic-sampling loop generates per "
        "kept group, over a trend window, at least this many times its early window's (the kept share at most "
        "1/this of its anchor): filling the batch costs twice the generation it did, the pool shrinking"
    )
    pool_kept_max: float = Field(
        0.4, gt=0, lt=1, description="GRPODynamicSamplingPoolShrinking: and the kept share at most this: "
        "six or seven in ten groups all-correct or all-incorrect, where filling the batch takes "
        "a lot of extra generation; a run that starts there pages only at 1/pool_overhead_growth of its start"
    )

    # ---- paging ----
    runbook_url: str = Field(
        RUNBOOKS, pattern=r"^https?://\S+$", description="base of every alert's runbook_url, an absolute URL a "
        "phone opens: where your docs/runbooks.md is served (an internal wiki, a fork); the default is the "
        "runbooks on the project's home",
    )
    grafana_url: str | None = Field(
        None, pattern=r"^https?://\S+$", description="Grafana's URL as a person on call opens it: every page then "
        "links the run's dashboard over the hour before the alert (its layer's: crash triage for layer 1, training "
        "health for the rest). Unset, pages carry no dashboard link and the generators say so",
    )
    for_seconds: dict[str, int] = Field(
        default_factory=dict, description="per-alert `for` overrides in seconds (scaled by time_scale), e.g. "
        "{GRPOEngineLogprobGapWarning: 1800} to page only on a persistent drift"
    )
    severities: dict[str, Severity] = Field(
        default_factory=dict, description="per-alert severity overrides, e.g. {GRPORolloutsStale: info}"
    )
    # receivers, secrets_dir and the Kubernetes settings: DeploySettings
    group_wait_s: int = Field(30, ge=0, description="Alertmanager group_wait (scaled by time_scale)")
    group_interval_s: int = Field(300, ge=1, description="Alertmanager group_interval (scaled)")
    repeat_interval_s: int = Field(4 * 3600, ge=1, description="Alertmanager repeat_interval (scaled)")
    notice_repeat_interval_s: int = Field(
        30 * 24 * 3600, ge=1, description="Alertmanager repeat_interval of info notices (scaled): a notice such as "
        "GRPOEngineLogprobGapCleanLevelHigh holds for the whole run and is said once, not every repeat_interval. "
        "Alertmanager forgets what it sent after its `--data.retention` (120 h by default) and says it again then: "
        "run it with a retention above this (the compose file's is 745h)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in MOVED.items():
                if old in data:
                    raise ValueError(f"{old}: this setting moved to {new} (receivers: docs/receivers.md), got "
                                     f"{old} set")
        return data

    def steps_s(self, steps: float, floor_s: float = 0.0) -> float:
        """Seconds of ``steps`` typical steps, at least ``floor_s`` (production time, before time_scale)."""
        return max(floor_s, steps * self.step_seconds)

    def window(self, steps: int | None = None) -> str:
        """The rate window: ``steps`` (default window_steps) typical steps, at least rate_window_s."""
        return self.duration(self.steps_s(self.window_steps if steps is None else steps, self.rate_window_s))

    @property
    def baseline_window(self) -> str:
        return self.duration(self.steps_s(self.baseline_steps, self.baseline_window_s))

    @property
    def baseline_offset(self) -> str:
        return self.duration(self.steps_s(self.baseline_offset_steps, self.baseline_offset_s))

    @property
    def stall_s(self) -> float:
        """GRPOTrainingStalled's silence, scaled: seconds as Prometheus sees them."""
        return self.steps_s(self.stall_steps, self.stall_after_s) * self.time_scale

    def duration(self, seconds: float) -> str:
        """A Prometheus duration for ``seconds`` x ``time_scale`` (at least 1s)."""
        total = max(1, round(seconds * self.time_scale))
        for unit, size in (("h", 3600), ("m", 60)):
            if total % size == 0:
                return f"{total // size}{unit}"
        return f"{total}s"

    def matchers(self, *raw: str, **labels: str) -> str:
        """``{<raw matchers>,label="value",<selector>}`` for a metric selection."""
        parts = [*raw, *(f'{k}="{v}"' for k, v in labels.items())]
        if self.selector:
            parts.append(self.selector)
        return "{" + ",".join(parts) + "}"

    @classmethod
    def load(cls, path: str | Path | None = None) -> MixinConfig:
        if path is None:
            return cls()
        return cls.model_validate(load_yaml_mapping(path, "MixinConfig settings", "--config"))
