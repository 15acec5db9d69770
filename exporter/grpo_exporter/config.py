"""Validated configuration of the per-step metric math.

Validated once at the boundary; the hot path trusts it. The monitor's own settings (run id, port, TLS...) wrap
this model in a later layer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_exporter.catalog import GAP_QUANTILES, LENGTH_QUANTILES, RATIO_QUANTILES, SOLVE_RATE_BUCKETS, metric
from grpo_exporter.settings import Settings

AdvantageNorm = Literal["unbiased", "population", "none", "batch", "whitened", "shaped"]
RatioLevel = Literal["token", "sequence"]
ClipKind = Literal["ppo", "cap", "none"]

#: the band the on-policy check judges each token with when the loss has no per-token PPO band (a sequence-level
#: ratio, a ratio cap or no hard clip): the seed's default [0.8, 1.2] (第 1 篇 (triage) 1.1)
DEFAULT_ONPOLICY_EPS = (0.2, 0.2)


#: the most quantiles or bucket bounds a summary or histogram may publish: each one is a series every scrape
MAX_SERIES_BOUNDS = 64


class MetricsConfig(Settings):
    """Knobs of the metric math. Defaults follow the seed and common GRPO setups. Every float is finite and
    every count bounded (:class:`~grpo_exporter.settings.Settings`)."""

    group_size: int = Field(
        ge=1, le=1 << 16, description="G: completions per prompt; contiguous groups unless group_ids (at most "
        "65536, far beyond any GRPO setup's hundreds)",
    )
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip lower side: ratio < 1 - eps_low")
    clip_eps_high: float = Field(0.2, gt=0.0, description="PPO clip upper side: ratio > 1 + eps_high")
    ratio_level: RatioLevel = Field(
        "token", description="the importance ratio the loss weights by: token (PPO, GRPO, DAPO: r_t per token) or "
        "sequence (GSPO, TRL importance_sampling_level='sequence': s_i = exp(mean_t log r_it), one per sequence, "
        "which then carries each of its tokens): the clip counts, the importance-weight distribution and the ESS "
        "read that ratio; the on-policy check still reads every token's",
    )
    clip: ClipKind = Field(
        "ppo", description="how the loss bounds the ratio: ppo (the min() of PPO with [1-eps_low, 1+eps_high]), "
        "cap (CISPO: the weight min(r, ratio_cap) with its gradient stopped, so no token's gradient is cut; "
        "the tokens above the cap are counted as the upper bound, there is no lower one), or none (SAPO's soft "
        "gate, VESPO's gamma weights: no hard clip, so no clipped-token metric is published)",
    )
    ratio_cap: float | None = Field(
        None, gt=1.0, description="clip='cap': the ratio above which the weight is capped (TRL's epsilon_high for "
        "loss_type='cispo', e.g. 5.0); required with it, unused otherwise",
    )
    advantage_norm: AdvantageNorm = Field(
        "unbiased", description="the form of the advantages your estimator computes (the premise of the |A| bound, "
        "checked against the data each step: grpo_advantage_form_sequences_total): unbiased (group z-score with "
        "torch.std: GRPO, TRL scale_rewards='group', verl grpo, OpenRLHF group_norm), population (group z-score "
        "with the population std), none (group-centred, Dr. GRPO: verl norm_adv_by_std_in_grpo=False, TRL "
        "scale_rewards='none', OpenRLHF dr_grpo), batch (group-centred over one batch-wide factor: TRL "
        "scale_rewards='batch', RLOO's G/(G-1)), whitened (batch-whitened: minus the batch mean, over the batch "
        "std; OpenRLHF reinforce_baseline and reinforce, verl reinforce_plus_plus_baseline, TRL "
        "multi_objective_aggregation='normalize_then_sum'), or shaped (per-token advantages of a reward shaped per "
        "token, the KL penalty in the reward: OpenRLHF's default, verl use_kl_in_reward, GAE). Only unbiased, "
        "population and none bound |A| per group. Pass the rewards to observe_update too, and the advantages are "
        "also checked against them (misaligned groups, another batch's advantages: "
        "grpo_advantage_inconsistent_sequences_total)",
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
    noise_range_fraction: float = Field(
        0.01, gt=0.0, lt=1.0, description="a group whose reward range is above 0 but below this fraction of the "
        "reward's scale, under sigma-normalisation, draws its advantage from reward noise: "
        "grpo_noise_advantage_groups_ratio",
    )
    reward_scale: float | None = Field(
        None, gt=0.0, description="the total reward's scale, the range a real difference spans (1.0 for a 0/1 "
        "verifier); None = each batch's own range of rewards, which a batch of only tied groups shrinks to the "
        "noise itself: set it when a batch can hold no solved-against-failed contrast (a continuous reward model)",
    )
    advantage_bound_rtol: float = Field(
        1e-3, ge=0.0, description="relative slack before |A| counts as above the normalisation bound"
    )
    pass_k: tuple[int, ...] = Field(
        (), max_length=MAX_SERIES_BOUNDS, description="extra k for pass@k besides 1 and group_size; each <= G"
    )
    entropy_top_fraction: float = Field(0.2, gt=0.0, le=1.0, description="share of highest-entropy positions")
    gap_quantiles: tuple[float, ...] = Field(GAP_QUANTILES, max_length=MAX_SERIES_BOUNDS)
    ratio_quantiles: tuple[float, ...] = Field(RATIO_QUANTILES, max_length=MAX_SERIES_BOUNDS)
    length_quantiles: tuple[float, ...] = Field(LENGTH_QUANTILES, max_length=MAX_SERIES_BOUNDS)
    solve_rate_buckets: tuple[float, ...] = Field(SOLVE_RATE_BUCKETS, max_length=MAX_SERIES_BOUNDS)
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
    max_reward_components: int = Field(
        8, ge=0, le=1024, description="cap on distinct reward component labels (at most 1024: each is a few series "
        "per scrape)",
    )
    max_moe_layers: int = Field(
        128, ge=1, le=1024, description="mixture-of-experts models: the most MoE layers the routed experts may "
        "hold (grpo_routing_mismatch_ratio is one series per layer, moe_layer 0..L-1); routed experts of more "
        "layers are an input error naming this setting",
    )
    moe_experts: int | None = Field(
        None, ge=1, le=1 << 16, description="mixture-of-experts models: the routed experts per MoE layer (E, e.g. "
        "128 for Qwen3-30B-A3B); with it the expert load of each side is published (grpo_expert_load_peak_multiple); "
        "None: not published",
    )

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

    @model_validator(mode="after")
    def _cap_with_cap_clip(self) -> MetricsConfig:
        if self.clip == "cap" and self.ratio_cap is None:
            raise ValueError("ratio_cap: expected a ratio > 1 with clip='cap' (CISPO's cap), got None")
        return self

    @property
    def onpolicy_eps(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the band the on-policy check judges each token with: the PPO clip band of a
        token-level loss, else :data:`DEFAULT_ONPOLICY_EPS` (a sequence-level ratio's band, GSPO's 3e-4, lies
        within the per-token noise of a bf16 recomputation; a cap or a soft clip has no band)."""
        if self.clip == "ppo" and self.ratio_level == "token":
            return self.clip_eps_low, self.clip_eps_high
        return DEFAULT_ONPOLICY_EPS

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
        """The quantiles of a catalogue summary: the configured ones where a setting names them, else the
        catalogue's own (a new summary needs no setting)."""
        configured = {
            "grpo_engine_logprob_gap_nats": self.gap_quantiles,
            "grpo_importance_weight": self.ratio_quantiles,
            "grpo_rollout_correction_weight": self.ratio_quantiles,
            "grpo_completion_length_tokens": self.length_quantiles,
        }
        return configured[summary] if summary in configured else metric(summary).quantiles

    def buckets_of(self, histogram: str, default: tuple[float, ...]) -> tuple[float, ...]:
        """The configured bucket bounds of a catalogue histogram (``default``: its catalogue buckets)."""
        return self.solve_rate_buckets if histogram == "grpo_mixed_group_solve_rate_ratio" else default
