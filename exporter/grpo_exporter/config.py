"""Validated configuration of the per-step metric math.

Validated once at the boundary; the hot path trusts it. The monitor's own settings (run id, port, TLS...) wrap
this model in a later layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo_exporter.catalog import GAP_QUANTILES, LENGTH_QUANTILES, RATIO_QUANTILES, SOLVE_RATE_BUCKETS

AdvantageNorm = Literal["unbiased", "population", "none", "batch"]


class MetricsConfig(BaseModel):
    """Knobs of the metric math. Defaults follow the seed and common GRPO setups."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(ge=1, description="G: completions per prompt; contiguous groups unless group_ids")
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip lower side: ratio < 1 - eps_low")
    clip_eps_high: float = Field(0.2, gt=0.0, description="PPO clip upper side: ratio > 1 + eps_high")
    advantage_norm: AdvantageNorm = Field(
        "unbiased", description="group std normalisation: unbiased (torch.std), population, none (Dr. GRPO), or "
        "batch (group-centred rewards over the whole batch's std, TRL scale_rewards='batch': no per-group |A| "
        "bound, so grpo_advantage_bound is absent and nothing counts as over it)"
    )
    log_ratio_clamp: float | None = Field(
        None, gt=0.0, description="numerical |log ratio| clamp before exp (the fuse); None = not used"
    )
    advantage_zero_atol: float | None = Field(
        None, ge=0.0, description="|A| at or below this is a zero advantage (no gradient): the rounding a group "
        "of equal rewards leaves, (r - mean) / (std + eps) with the mean's fp32 rounding over eps 1e-4, is "
        "~1e-3 for rewards of ~1, never an exact 0. None: 1e-2 with std normalisation (far below the smallest "
        "real one, ~1/sqrt(G) for G up to thousands), 1e-6 without (advantage_norm none: reward differences)"
    )
    advantage_bound_rtol: float = Field(
        1e-3, ge=0.0, description="relative slack before |A| counts as above the normalisation bound"
    )
    pass_k: tuple[int, ...] = Field((), description="extra k for pass@k besides 1 and group_size; each <= G")
    entropy_top_fraction: float = Field(0.2, gt=0.0, le=1.0, description="share of highest-entropy positions")
    gap_quantiles: tuple[float, ...] = GAP_QUANTILES
    ratio_quantiles: tuple[float, ...] = RATIO_QUANTILES
    length_quantiles: tuple[float, ...] = LENGTH_QUANTILES
    solve_rate_buckets: tuple[float, ...] = SOLVE_RATE_BUCKETS
    rollout_correction_cap: float | None = Field(
        None, gt=1.0, description="the rollout-correction cap of your trainer (TIS truncation or MIS masking of "
        "pi_old / pi_rollout: TRL 3, verl 2, slime 2, AReaL 5): the tokens and sequences above it are counted; "
        "None = not counted",
    )
    rollout_logprob_nan: Literal["nonfinite", "unscored"] = Field(
        "nonfinite", description="what a NaN rollout log-prob on a loss token means: nonfinite (a numeric fault, "
        "counted in grpo_nonfinite_values_total) or unscored (the engine handed the token back without a "
        "log-prob: vLLM's None, which TRL turns into NaN and leaves out of its own sampling metrics); unscored "
        "tokens leave the engine gap and the mismatch readings and are counted in "
        "grpo_rollout_unscored_tokens_total; +-inf stays non-finite either way",
    )
    max_reward_components: int = Field(8, ge=0, description="cap on distinct reward component labels")

    @field_validator("gap_quantiles", "ratio_quantiles", "length_quantiles")
    @classmethod
    def _quantiles_in_unit_interval(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v or any(not 0.0 <= q <= 1.0 for q in v) or list(v) != sorted(set(v)):
            raise ValueError(f"expected strictly increasing quantiles in [0, 1], got {v}")
        return v

    @field_validator("solve_rate_buckets")
    @classmethod
    def _buckets_inside_open_unit_interval(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 < b < 1.0 for b in v) or list(v) != sorted(set(v)):
            raise ValueError(f"expected strictly increasing bucket bounds in (0, 1), got {v}")
        return v

    @model_validator(mode="after")
    def _pass_k_within_group(self) -> MetricsConfig:
        bad = [k for k in self.pass_k if not 1 <= k <= self.group_size]
        if bad:
            raise ValueError(f"pass_k: expected every k in [1, group_size={self.group_size}], got {bad}")
        return self

    @property
    def zero_advantage_atol(self) -> float:
        """The tolerance below which an advantage is zero (``advantage_zero_atol``, or its default by norm)."""
        if self.advantage_zero_atol is not None:
            return self.advantage_zero_atol
        return 1e-6 if self.advantage_norm == "none" else 1e-2

    @property
    def pass_ks(self) -> tuple[int, ...]:
        """k values for pass@k: 1, the group size, and the configured extras, sorted."""
        return tuple(sorted({1, self.group_size, *self.pass_k}))

    def quantiles_of(self, summary: str) -> tuple[float, ...]:
        """The configured quantiles of a catalogue summary."""
        return {
            "grpo_engine_logprob_gap_nats": self.gap_quantiles,
            "grpo_importance_weight": self.ratio_quantiles,
            "grpo_rollout_correction_weight": self.ratio_quantiles,
            "grpo_completion_length_tokens": self.length_quantiles,
        }[summary]

    def buckets_of(self, histogram: str, default: tuple[float, ...]) -> tuple[float, ...]:
        """The configured bucket bounds of a catalogue histogram (``default``: its catalogue buckets)."""
        return self.solve_rate_buckets if histogram == "grpo_mixed_group_solve_rate_ratio" else default


def load_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping (an empty file is an empty one); ``what`` names its content in
    the error."""
    loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path}: expected a YAML mapping of {what}, got {type(loaded).__name__}")
    return dict(loaded)
