"""What TRL's configuration, batches and logs mean here, without importing TRL: the monitor settings
``GRPOConfig`` implies (the loss's ratio level and clip, the engine's NaN placeholders and cap, the advantage
normalisation), the generation batches of an optimizer step and how they join, what identifies a prompt, the
warnings when a monitor handed in disagrees with TRL, and :data:`TRL_METRICS`, TRL's logged names mapped to the
series here. Read by :mod:`grpo_exporter.integrations.trl`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grpo_exporter.integrations import say_once
from grpo_exporter.runtime.monitor import GRPOMonitor

logger = logging.getLogger("grpo_exporter")

#: TRL's logged metric → the series that means the same thing here (PromQL), and how they differ, if at all.
TRL_METRICS: Mapping[str, tuple[str, str]] = {
    "reward": ('grpo_reward_mean{component="total"}', "same (weighted sum of the reward functions)"),
    "rewards/{name}/mean": ('grpo_reward_mean{component="{name}"}', "same"),
    "frac_reward_zero_std": ("grpo_zero_variance_groups_ratio", "same: TRL counts rows, groups are equal-sized"),
    "entropy": ("grpo_entropy_mean_nats", "TRL averages micro-batch means; here token-weighted over the step"),
    "kl": ("grpo_kl_ref_nats", "same k3 estimator; TRL averages micro-batch means"),
    "clip_ratio/high_mean": (
        'grpo_clipped_tokens_ratio{bound="upper"}', "TRL divides by all loss tokens, here by A>0 tokens; with "
        "importance_sampling_level='sequence' TRL counts sequences, here their loss tokens"),
    "clip_ratio/low_mean": (
        'grpo_clipped_tokens_ratio{bound="lower"}', "TRL divides by all loss tokens, here by A<0 tokens; with "
        "importance_sampling_level='sequence' TRL counts sequences, here their loss tokens"),
    "cispo_clip_ratio": (
        'grpo_clipped_tokens_ratio{bound="upper"}', "loss_type='cispo': A>0 tokens whose weight the cap "
        "truncates; TRL divides by all loss tokens, here by A>0 tokens"),
    "tools/call_frequency": (
        "increase(grpo_tool_calls_total[w]) / increase(grpo_completions_total[w])", "same"),
    "tools/failure_frequency": (
        "increase(grpo_tool_call_failures_total[w]) / increase(grpo_tool_calls_total[w])", "same"),
    "completions/clipped_ratio": (
        "increase(grpo_truncated_completions_total[w]) / increase(grpo_completions_total[w])", "same"),
    "completions/mean_length": (
        "rate(grpo_completion_length_tokens_sum[w]) / rate(grpo_completion_length_tokens_count[w])", "same"),
    "grad_norm": ("grpo_grad_norm_pre_clip", "same (the norm before clipping)"),
    "sampling/sampling_logp_difference/mean": ("grpo_engine_logprob_gap_mean_nats", "same"),
    "sampling/sampling_logp_difference/max": ('grpo_engine_logprob_gap_nats{quantile="1"}', "same"),
    "sampling/importance_sampling_ratio/mean": (
        "rate(grpo_rollout_correction_weight_sum[w]) / rate(grpo_rollout_correction_weight_count[w])",
        "token_* modes: here before truncation, TRL's after its clip_max (TRL #5231), TRL counting unscored "
        "tokens as 1; sequence_* modes: TRL's exp(sum log w) per sequence, not comparable"),
    "sampling/importance_sampling_ratio/min": (
        'grpo_rollout_correction_weight{quantile="0"}', "token_* modes: here before truncation; TRL's after its cap"),
    "sampling/importance_sampling_ratio/max": (
        'grpo_rollout_correction_weight{quantile="1"}', "token_* modes: here before truncation; TRL's after its cap"),
}


def engine_settings(args: Any) -> dict[str, Any]:
    """The monitor settings TRL's engine path implies. TRL turns a token its engine (vLLM or a ``rollout_func``)
    returned without a log-prob into NaN and leaves it out of ``sampling/*``: here it is unscored, not a numeric
    fault. With vLLM's token-level importance-sampling correction (``token_truncate`` / ``token_mask``), its
    ``vllm_importance_sampling_clip_max`` is the rollout-correction cap whose truncated / masked share is counted;
    TRL's sequence modes cap exp(sum_t log w), which is not this exporter's geometric sequence weight, so no cap
    is set for them."""
    settings: dict[str, Any] = {"rollout_logprob_nan": "unscored"}
    cap = getattr(args, "vllm_importance_sampling_clip_max", None)
    mode = str(getattr(args, "vllm_importance_sampling_mode", ""))
    if args.use_vllm and args.vllm_importance_sampling_correction and mode.startswith("token_") and cap and cap > 1:
        settings["rollout_correction_cap"] = float(cap)
    return settings


#: TRL's ``loss_type`` -> how its loss bounds the ratio (the monitor's ``clip``): the PPO min() with
#: [1 - epsilon, 1 + epsilon_high]; CISPO's weight min(r, epsilon_high) with its gradient stopped; SAPO's soft
#: sigmoid gate and VESPO's gamma weights, no hard clip
LOSS_CLIP = {"grpo": "ppo", "bnpo": "ppo", "dr_grpo": "ppo", "dapo": "ppo", "luspo": "ppo", "cispo": "cap",
             "sapo": "none", "vespo": "none"}


def loss_settings(args: Any, epsilon_low: float, epsilon_high: float) -> dict[str, Any]:
    """The monitor settings TRL's loss implies: ``clip_eps`` (``epsilon``, ``epsilon_high``), ``ratio_level``
    from ``importance_sampling_level`` (GSPO: "sequence") and ``clip`` from ``loss_type`` (:data:`LOSS_CLIP`;
    CISPO's cap is its ``epsilon_high``, a ratio such as 5, not an epsilon). A loss type this adapter does not
    know is monitored without clip metrics (``clip="none"``) and said once at start."""
    level = "sequence" if str(getattr(args, "importance_sampling_level", "token")) == "sequence" else "token"
    loss = str(getattr(args, "loss_type", "grpo"))
    clip = LOSS_CLIP.get(loss)
    if clip is None:
        logger.warning("grpo_exporter: TRL loss_type=%r is not one this adapter knows (%s): its clip is unknown, "
                       "so no clipped-token metric is published", loss, ", ".join(LOSS_CLIP))
        clip = "none"
    settings: dict[str, Any] = {"clip_eps": (epsilon_low, epsilon_high), "ratio_level": level, "clip": clip}
    if clip == "cap":
        settings["ratio_cap"] = float(epsilon_high)
    return settings


#: TRL's ``scale_rewards`` (after GRPOConfig turns True/False into "group"/"none") -> the monitor's advantage_norm
SCALE_REWARDS = {"group": "unbiased", "batch": "batch", "none": "none"}


def advantage_norm(args: Any) -> str | None:
    """The normalisation TRL's advantages have (its std is ``nanstd``, unbiased), or None when this adapter
    cannot say (``multi_objective_aggregation="normalize_then_sum"`` normalises each reward function first)."""
    if str(getattr(args, "multi_objective_aggregation", "sum_then_normalize")) != "sum_then_normalize":
        return None
    scale: Any = getattr(args, "scale_rewards", "group")
    named: Any = {True: "group", False: "none"}.get(scale, scale)
    return SCALE_REWARDS.get(named)


def generations_per_step(args: Any) -> int:
    """Generation batches per optimizer step: TRL generates every ``steps_per_generation * num_iterations``
    micro-steps, so ``gradient_accumulation_steps`` over that when it divides it (else 1: each generation batch
    is observed as it comes, and the batches of a step are joined at its end)."""
    every = int(args.steps_per_generation) * int(getattr(args, "num_iterations", 1))
    accumulation = int(args.gradient_accumulation_steps)
    return accumulation // every if every < accumulation and accumulation % every == 0 else 1


def say_what_differs(args: Any, monitor: GRPOMonitor, owns_monitor: bool, norm: str | None, loss: Mapping[str, Any],
                      verifier: str | None, engine: bool) -> None:
    """Where TRL's config and the monitor disagree (a monitor handed in), one warning each: the advantage
    normalisation, the loss's ratio and clip, the verifier's component, the engine's NaN placeholders; and once,
    what TRL's top-entropy mask leaves out of the loss."""
    if norm is not None and monitor.config.advantage_norm != norm:
        logger.warning(
            "grpo_exporter: TRL's scale_rewards=%r gives advantages normalised %r, the monitor checks them as "
            "%r: GRPOAdvantageAboveBound judges them against the wrong bound. Make the monitor with "
            "advantage_norm=%r (MonitoredGRPOTrainer does when it makes the monitor).",
            args.scale_rewards, norm, monitor.config.advantage_norm, norm,
        )
    differs = [k for k in ("ratio_level", "clip", "ratio_cap")
               if k in loss and getattr(monitor.config, k) != loss[k]]
    if differs:
        logger.warning(
            "grpo_exporter: TRL's loss (loss_type=%r, importance_sampling_level=%r) weights by %s; the monitor "
            "has %s: its clip, ratio and ESS metrics measure another loss. Make the monitor with these settings "
            "(MonitoredGRPOTrainer does when it makes the monitor).", args.loss_type,
            args.importance_sampling_level, ", ".join(f"{k}={loss[k]!r}" for k in differs),
            ", ".join(f"{k}={getattr(monitor.config, k)!r}" for k in differs),
        )
    if verifier is not None and monitor.config.correctness_component != verifier:
        logger.warning(
            "grpo_exporter: the verifier %r measures correctness, the monitor names %r: GRPORewardHackSuspected "
            "reads the component the monitor names (else the rules' correctness_component). Make the monitor "
            "with correctness_component=%r (MonitoredGRPOTrainer does when it makes the monitor).",
            verifier, monitor.config.correctness_component, verifier,
        )
    if not owns_monitor and engine and monitor.config.rollout_logprob_nan != "unscored":
        logger.warning(
            "grpo_exporter: TRL hands a token its engine returned without a log-prob as NaN; this monitor has "
            "rollout_logprob_nan=%r and counts each such token as a non-finite value (GRPONonFiniteValues). "
            "Make it with rollout_logprob_nan='unscored'.", monitor.config.rollout_logprob_nan,
        )
    if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        say_once(monitor, "trl-top-entropy", (
            f"grpo_exporter: TRL's top_entropy_quantile={args.top_entropy_quantile} trains on the "
            "highest-entropy tokens only; the ratio, clip and ESS metrics here count every completion token, "
            "the ones this mask leaves out of the loss included"))


_PAD_ROLLOUT = {"loss_mask": False, "completion_mask": False, "completion_ids": 0, "old_logprobs": 0.0,
                "rollout_logprobs": 0.0}


def concatenate_rollouts(batches: Sequence[Mapping[str, Any]], prompt_pad: int = 0) -> dict[str, Any]:
    """Several generation batches' ``observe_rollout`` keywords as one: tensors joined along the batch, the
    (N, T) ones right-padded to the widest (off every mask), prompt tokens left-padded with ``prompt_pad`` as TRL
    pads prompts, lists joined, reward components kept where every batch has them."""
    if len(batches) == 1:
        return dict(batches[0])
    out: dict[str, Any] = {}
    for key in batches[0]:
        values: list[Any] = [b.get(key) for b in batches]
        if any(v is None for v in values):
            out[key] = None
        elif key == "reward_components":
            names = set.intersection(*(set(v) for v in values))
            out[key] = {name: torch.cat([v[name] for v in values]) for name in values[0] if name in names}
        elif isinstance(values[0], list):
            out[key] = [item for v in values for item in v]
        elif isinstance(values[0], int):  # counts (tool calls): the step's batches add up
            out[key] = sum(values)
        elif values[0].dim() == 2:
            width = max(v.shape[1] for v in values)
            left = key == "prompt_tokens"
            pad = prompt_pad if left else _PAD_ROLLOUT.get(key, 0)
            out[key] = torch.cat([
                torch.nn.functional.pad(v, (width - v.shape[1], 0) if left else (0, width - v.shape[1]), value=pad)
                for v in values])
        else:
            out[key] = torch.cat(values)
    return out


def prompt_key(example: Mapping[str, Any], step: int, group: int) -> Any:
    """What identifies an example's prompt (hashed into its prompt id): its ``prompt`` (text or chat). An
    environment-only example (no prompt: the environment makes it) is identified by its other fields, and one
    with none by its group of this step: a prompt of its own, never merged with the batch's other prompts (with
    ``x.get("prompt", "")`` every such example was one prompt, one solve-rate slot)."""
    prompt = example.get("prompt")
    if prompt is not None and prompt != "" and prompt != []:
        return prompt
    rest = {k: v for k, v in example.items() if k != "prompt"}
    return rest if rest else f"grpo_exporter/unnamed/{step}/{group}"
