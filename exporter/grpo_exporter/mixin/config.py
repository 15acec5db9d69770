"""The one config behind the rules, the alerts, the Alertmanager routing and the dashboards.

Each knob says why you would change it and which alert it feeds. Windows and ``for`` durations are in
seconds and all scale with ``time_scale`` (a demo or an end-to-end test shrinks every window at once).
Thresholds are the seed's where it gives one; the others are stated as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from grpo_exporter.config import load_yaml_mapping
from grpo_exporter.thresholds import EventLines, StopLines

Severity = Literal["critical", "warning", "info"]
RUNBOOK_FALLBACK = "docs/runbooks.md"


class MixinConfig(StopLines, EventLines):
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

    # ---- windows (seconds) ----
    rate_window_s: int = Field(
        300, ge=1, description="window of every rate()/increase() and windowed mean. Longer = smoother, slower; "
        "it should span several training steps. Feeds every counter-based alert."
    )
    baseline_window_s: int = Field(
        3600, ge=1, description="span of the run's own history a rolling baseline is the median of. Feeds "
        "GRPOGradNormSpike, GRPOESSDrop, GRPORewardCliff, GRPOTruncationSurge, the length and entropy alerts."
    )
    baseline_offset_s: int = Field(
        600, ge=0, description="how far back the baseline window ends, so a spike cannot raise its own baseline "
        "before it is judged against it."
    )
    min_baseline_samples: int = Field(
        20, ge=1, description="a rolling baseline exists only once its window holds this many samples: a median of "
        "a handful of early points is no baseline (it made early steps look like grad-norm spikes). Feeds every "
        "baseline-relative alert."
    )
    stall_after_s: int = Field(
        900, ge=1, description="GRPOTrainingStalled: no new step for this long. Set above your slowest step "
        "(evaluation and checkpointing included)."
    )
    lifecycle_lookback_s: int = Field(
        21600, ge=1, description="how long a run's last samples are remembered after its process is gone: a run "
        "that died without close() pages GRPOTrainingStalled (and a static target GRPOExporterDown) for this long; "
        "a run that ended with close() (grpo_run_finished 1) pages nothing, and between runs nothing pages."
    )

    # ---- layer 1 thresholds ----
    # engine_gap_stop_nats, engine_gap_healthy_nats and onpolicy_clip_stop_ratio: StopLines (shared with the guard)
    engine_gap_baseline_factor: float = Field(
        3.0, gt=1, description="GRPOEngineLogprobGapWarning also fires above this multiple of the reference run's "
        "clean gap (grpo_reference_baseline); the seed: measure your own clean baseline first."
    )
    fuse_hit_ratio: float = Field(
        0.001, gt=0, lt=1, description="GRPOLogRatioFuseBlowing: share of tokens hitting the numerical log-ratio "
        "clamp. Should be ~0 (our choice of line)."
    )
    # grad_spike_factor, grad_spike_window_steps, grad_spike_min_steps, gap_baseline_steps, gap_clean_factor,
    # gap_floor_nats: EventLines (judged by the exporter or against what it publishes)
    grad_clip_active_ratio: float = Field(
        0.9, gt=0, le=1, description="GRPOGradClippingEveryStep: share of optimizer steps clipped. Seed: clipping "
        "on nearly every step = root cause unsolved."
    )

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
        "task itself (the `component` label your training passes to reward_components)"
    )
    correctness_drop_ratio: float = Field(
        0.7, gt=0, lt=1, description="GRPORewardHackSuspected: correctness below this share of its baseline ..."
    )
    truncation_surge_factor: float = Field(2.0, gt=1, description="GRPOTruncationSurge: x the baseline share")
    truncation_surge_floor: float = Field(0.05, ge=0, lt=1, description="GRPOTruncationSurge: and above this share")
    length_growth_ratio: float = Field(
        1.2, gt=1, description="the length alerts: mean length over this multiple of its own baseline is growth"
    )
    length_flat_ratio: float = Field(
        1.05, ge=1, description="GRPOLengthGrowthIncorrectOnly: correct answers grow less than this"
    )

    # ---- layer 3 thresholds ----
    ess_drop_factor: float = Field(0.5, gt=0, lt=1, description="GRPOESSDrop: token ESS ratio below this x baseline")
    zero_variance_margin: float = Field(
        0.1, ge=0, lt=1, description="GRPOZeroVarianceAbovePrediction: observed share above the predicted "
        "E[p^G+(1-p)^G] by more than this (absolute). The seed: never a fixed 50% line."
    )
    lower_clip_min: float = Field(0.05, gt=0, lt=1, description="GRPOLowerClipDominant: lower clip share above")
    upper_clip_max: float = Field(0.005, ge=0, lt=1, description="GRPOLowerClipDominant: while upper is below")
    clip_fraction_high: float = Field(0.2, gt=0, lt=1, description="GRPOClipFractionHigh: seed's 20%")
    # staleness_max_versions: EventLines (counted by the exporter)

    # ---- layer 4 thresholds ----
    entropy_drop_factor: float = Field(
        0.5, gt=0, lt=1, description="GRPOEntropyCollapse: entropy below this x its baseline (with pass@G falling)"
    )
    unique_ratio_min: float = Field(
        0.2, gt=0, lt=1, description="GRPODiversityCollapse: distinct completions per group (seed: 16 samples "
        "down to 2-3 distinct is collapse)"
    )
    edit_distance_drop_factor: float = Field(
        0.5, gt=0, lt=1, description="GRPODiversityCollapse: in-group edit distance below this x its baseline"
    )
    retrieval_chance_factor: float = Field(
        1.5, gt=1, description="GRPORetrievalNearChance: retrieval accuracy below this x chance 1/P"
    )

    # ---- paging ----
    runbook_url: str = Field(
        RUNBOOK_FALLBACK, description="base of every alert's runbook_url: set it to a URL your pager can open (where "
        "you host docs/runbooks.md); the default is the repository-relative fallback, named in every generated file",
    )
    for_seconds: dict[str, int] = Field(
        default_factory=dict, description="per-alert `for` overrides in seconds (scaled by time_scale), e.g. "
        "{GRPOEngineLogprobGapWarning: 1800} to page only on a persistent drift"
    )
    severities: dict[str, Severity] = Field(
        default_factory=dict, description="per-alert severity overrides, e.g. {GRPORolloutsStale: info}"
    )
    pager_webhook_url: str = Field(
        "http://127.0.0.1:9887/unused-pager", description="Alertmanager: where critical alerts go"
    )
    default_webhook_url: str = Field(
        "http://127.0.0.1:9887/unused-default", description="Alertmanager: where everything else goes"
    )
    group_wait_s: int = Field(30, ge=0, description="Alertmanager group_wait (scaled by time_scale)")
    group_interval_s: int = Field(300, ge=1, description="Alertmanager group_interval (scaled)")
    repeat_interval_s: int = Field(4 * 3600, ge=1, description="Alertmanager repeat_interval (scaled)")

    def duration(self, seconds: float) -> str:
        """A Prometheus duration for ``seconds`` x ``time_scale`` (at least 1s)."""
        total = max(1, round(seconds * self.time_scale))
        for unit, size in (("h", 3600), ("m", 60)):
            if total % size == 0:
                return f"{total // size}{unit}"
        return f"{total}s"

    def matchers(self, **labels: str) -> str:
        """``{label="value",<selector>}`` for a metric selection."""
        parts = [f'{k}="{v}"' for k, v in labels.items()]
        if self.selector:
            parts.append(self.selector)
        return "{" + ",".join(parts) + "}"

    @classmethod
    def load(cls, path: str | Path | None = None) -> MixinConfig:
        if path is None:
            return cls()
        return cls.model_validate(load_yaml_mapping(path, "MixinConfig settings"))
