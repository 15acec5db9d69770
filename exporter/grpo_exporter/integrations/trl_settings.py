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
    is set for them. ``vllm_importance_sampling_clip_min`` has no counterpart here (the monitor counts above a
    cap only): what its ``*_mask`` modes drop leaves the loss mask at the update (``trl_update``), and the
    sequences dropped whole are counted in ``grpo_loss_mask_empty_sequences_total``."""
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
    CISPO's cap is its ``epsilon_high``, a ratio such as 5, not an epsilon: TRL's ``_compute_loss`` weights by
    ``clamp(ratio, max=epsilon_high)``). A loss type this adapter does not know is monitored without clip metrics
    (``clip="none"``) and said once at start.

    CISPO without ``epsilon_high``: TRL takes ``epsilon`` (0.2) as the cap, so every token whose ratio is above
    0.2 (on-policy, all of them) is weighted 0.2: the loss is a scaled policy gradient with no importance
    correction. A cap at or below 1 is no cap the monitor can measure (its ``ratio_cap`` is a ratio above 1):
    the run is monitored without clip metrics and this is said at start, naming the setting (ScaleRL's 5.0)."""
    level = "sequence" if str(getattr(args, "importance_sampling_level", "token")) == "sequence" else "token"
    loss = str(getattr(args, "loss_type", "grpo"))
    clip = LOSS_CLIP.get(loss)
    if clip is None:
        logger.warning("grpo_exporter: TRL loss_type=%r is not one this adapter knows (%s): its clip is unknown, "
                       "so no clipped-token metric is published", loss, ", ".join(LOSS_CLIP))
        clip = "none"
    if clip == "cap" and epsilon_high <= 1.0:
        logger.warning(
            "grpo_exporter: TRL loss_type='cispo' weights each token by min(ratio, epsilon_high) with epsilon_high="
            "%s%s: a cap at or below 1 truncates every on-policy token's weight to %s, a scaled policy gradient with "
            "no importance correction (TRL's docs recommend epsilon_high=5.0 for CISPO). It is monitored without "
            "clip metrics (clip='none'); set GRPOConfig(epsilon_high=5.0) for the CISPO loss.", epsilon_high,
            " (epsilon_high unset: TRL uses epsilon)" if getattr(args, "epsilon_high", None) is None else "",
            epsilon_high)
        clip = "none"
    settings: dict[str, Any] = {"clip_eps": (epsilon_low, epsilon_high), "ratio_level": level, "clip": clip}
    if clip == "cap":
        settings["ratio_cap"] = float(epsilon_high)
    return settings


#: TRL's ``scale_rewards`` (after GRPOConfig turns True/False into "group"/"none") -> the monitor's advantage_norm
SCALE_REWARDS = {"group": "unbiased", "batch": "batch", "none": "none"}


def advantage_norm(args: Any) -> str | None:
    """The form TRL's advantages have (its std is ``nanstd``, unbiased): from ``scale_rewards`` under
    ``multi_objective_aggregation="sum_then_normalize"``; "whitened" under ``"normalize_then_sum"`` (GDPO), where
    TRL sums each reward function's group z-scores and whitens that sum over the whole gathered batch (minus the
    batch mean, over the batch std, whatever ``scale_rewards`` says): no group bound holds for it. None for an
    aggregation or scaling this adapter does not know."""
    aggregation = str(getattr(args, "multi_objective_aggregation", "sum_then_normalize"))
    if aggregation == "normalize_then_sum":
        return "whitened"
    if aggregation != "sum_then_normalize":
        return None
    scale: Any = getattr(args, "scale_rewards", "group")
    named: Any = {True: "group", False: "none"}.get(scale, scale)
    return SCALE_REWARDS.get(named)


def advantage_source(args: Any) -> str:
    """The TRL settings the advantage form follows from, as a warning names them."""
    aggregation = str(getattr(args, "multi_objective_aggregation", "sum_then_normalize"))
    if aggregation != "sum_then_normalize":
        return f"multi_objective_aggregation={aggregation!r}"
    return f"scale_rewards={getattr(args, 'scale_rewards', 'group')!r}"


def implied_staleness(args: Any) -> int:
    """The most policy versions an update trails its rollout by under TRL's schedule (the adapter's
    ``policy_version - rollout_policy_version``): a generation batch feeds the ``steps_per_generation *
    num_iterations`` micro-steps from the one it is made at, ``gradient_accumulation_steps`` of them per optimizer
    step, so its last micro-step falls that many optimizer steps after the one it was made in (taken over every
    place a generation can start within a step: one that starts mid-step straddles a step more)."""
    every = int(args.steps_per_generation) * int(getattr(args, "num_iterations", 1))
    accumulation = max(1, int(args.gradient_accumulation_steps))
    return max((start + every - 1) // accumulation - start // accumulation
               for start in range(0, every * accumulation, every))


def skips_old_logprobs(args: Any) -> bool:
    """TRL computes no ``old_per_token_logps`` (``_generate_and_score_completions``): every use of a generation
    batch falls in the optimizer step it was made in (``gradient_accumulation_steps`` a multiple of
    ``steps_per_generation * num_iterations``) and no vLLM importance-sampling correction asks for them."""
    every = int(args.steps_per_generation) * int(getattr(args, "num_iterations", 1))
    correction = bool(args.use_vllm) and bool(getattr(args, "vllm_importance_sampling_correction", False))
    return int(args.gradient_accumulation_steps) % every == 0 and not correction


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
    normalisation, the loss's ratio and clip, the verifier's component, the engine's NaN placeholders, the
    staleness TRL's schedule implies; and once, what TRL's top-entropy mask leaves out of the loss and where the
    engine gap's trainer log-probs come from when TRL computes none."""
    _warn_advantage_form(args, monitor, norm)
    _warn_staleness_line(args, monitor)
    _warn_loss_ratio_and_clip(args, monitor, loss)
    _warn_verifier_component(monitor, verifier)
    _warn_engine_placeholders(monitor, owns_monitor, engine)
    _say_top_entropy_mask(args, monitor)
    _say_split_groups(args, monitor)
    _say_no_old_logprobs(args, monitor, engine)


def _warn_advantage_form(args: Any, monitor: GRPOMonitor, norm: str | None) -> None:
    """Warns when the monitor checks advantages in another form than TRL's settings give them: the advantage
    bound alert would judge them against the wrong bound."""
    if norm is not None and monitor.config.advantage_norm != norm:
        logger.warning(
            "grpo_exporter: TRL's %s gives advantages of the form %r, the monitor checks them as %r: "
            "GRPOAdvantageAboveBound judges them against the wrong bound. Make the monitor with advantage_norm=%r "
            "(MonitoredGRPOTrainer does when it makes the monitor).",
            advantage_source(args), norm, monitor.config.advantage_norm, norm,
        )


def _warn_staleness_line(args: Any, monitor: GRPOMonitor) -> None:
    """Warns when the monitor's staleness line is below what TRL's schedule implies by design: every such step
    would be counted stale and the staleness alert fire on a healthy run."""
    stale = implied_staleness(args)
    if monitor.config.staleness_max_versions < stale:
        logger.warning(
            "grpo_exporter: TRL's schedule (steps_per_generation=%s x num_iterations=%s over "
            "gradient_accumulation_steps=%s) trains on rollouts up to %d policy versions old by design; the "
            "monitor's staleness_max_versions=%d counts each such step in grpo_stale_update_steps_total and "
            "GRPORolloutsStale fires on a healthy run. Make the monitor with staleness_max_versions=%d "
            "(MonitoredGRPOTrainer does when it makes the monitor).", args.steps_per_generation,
            getattr(args, "num_iterations", 1), args.gradient_accumulation_steps, stale,
            monitor.config.staleness_max_versions, stale,
        )


def _warn_loss_ratio_and_clip(args: Any, monitor: GRPOMonitor, loss: Mapping[str, Any]) -> None:
    """Warns when the monitor's ratio level, clip or ratio cap differ from TRL's loss: its clip, ratio and ESS
    metrics would measure another loss."""
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


def _warn_verifier_component(monitor: GRPOMonitor, verifier: str | None) -> None:
    """Warns when the monitor names another correctness component than the verifier's: the reward-hacking alert
    reads the component the monitor names."""
    if verifier is not None and monitor.config.correctness_component != verifier:
        logger.warning(
            "grpo_exporter: the verifier %r measures correctness, the monitor names %r: GRPORewardHackSuspected "
            "reads the component the monitor names (else the rules' correctness_component). Make the monitor "
            "with correctness_component=%r (MonitoredGRPOTrainer does when it makes the monitor).",
            verifier, monitor.config.correctness_component, verifier,
        )


def _warn_engine_placeholders(monitor: GRPOMonitor, owns_monitor: bool, engine: bool) -> None:
    """Warns when a monitor handed in counts the engine's NaN log-prob placeholders as non-finite values: TRL
    marks an unscored token that way, so the non-finite alert would fire on a healthy run."""
    if not owns_monitor and engine and monitor.config.rollout_logprob_nan != "unscored":
        logger.warning(
            "grpo_exporter: TRL hands a token its engine returned without a log-prob as NaN; this monitor has "
            "rollout_logprob_nan=%r and counts each such token as a non-finite value (GRPONonFiniteValues). "
            "Make it with rollout_logprob_nan='unscored'.", monitor.config.rollout_logprob_nan,
        )


def _say_top_entropy_mask(args: Any, monitor: GRPOMonitor) -> None:
    """Says once that TRL's top-entropy mask trains on part of the tokens while the ratio, clip and ESS metrics
    here count them all."""
    if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        say_once(monitor, "trl-top-entropy", (
            f"grpo_exporter: TRL's top_entropy_quantile={args.top_entropy_quantile} trains on the "
            "highest-entropy tokens only; the ratio, clip and ESS metrics here count every completion token, "
            "the ones this mask leaves out of the loss included"))


def _say_split_groups(args: Any, monitor: GRPOMonitor) -> None:
    """Says once that a process's generation batch is not a whole number of groups (several processes): TRL
    spreads a group over processes, and the group readings merged across them misjudge the run."""
    rows = int(args.per_device_train_batch_size) * int(args.steps_per_generation)
    if int(getattr(args, "world_size", 1)) > 1 and rows % int(args.num_generations):
        say_once(monitor, "trl-split-groups", (
            f"grpo_exporter: each process generates {rows} completions per generation batch "
            f"(per_device_train_batch_size x steps_per_generation), not a multiple of num_generations="
            f"{args.num_generations}: TRL spreads a prompt's group over several processes. The advantage checks "
            "follow each completion's group (carried through TRL's shuffle); the rollout's group readings (group "
            "reward std and range, zero-variance groups, pass@k, solve rates, reward-noise groups) are merged "
            "across processes as if every group lived on one and read the fragments each holds, so "
            "GRPOFewGroupsCarrySignal, GRPOZeroVarianceAbovePrediction, GRPOPassAtGBelowBase, "
            "GRPOAdvantageFromRewardNoise and the pass@G terms of GRPOEntropyCollapse, GRPOPolicyCollapseOnset and "
            "GRPODiversityCollapse misjudge this run. Make per_device_train_batch_size x "
            "steps_per_generation a multiple of num_generations to keep whole groups on one process"))


def _say_no_old_logprobs(args: Any, monitor: GRPOMonitor, engine: bool) -> None:
    """Says once, with an engine, that TRL computes no old log-probs here: where the engine gap's trainer
    log-probs come from instead, and which ratio readings and alerts are absent since TRL's ratio is 1."""
    if engine and skips_old_logprobs(args):
        say_once(monitor, "trl-no-old-logprobs", (
            "grpo_exporter: TRL computes no old log-probs in this configuration (no vLLM importance-sampling "
            "correction, gradient_accumulation_steps a multiple of steps_per_generation x num_iterations): the "
            "engine gap reads the engine's log-probs against the loss's own forward of each completion (no extra "
            "forward pass: until the optimizer step the weights are the rollout's), and the step's rollout "
            "metrics are published when the step ends. TRL's loss ratio is 1 by construction here, so the ratio, "
            "clip, ESS and on-policy readings are absent and GRPORatioClippedBeforeUpdate, GRPOOnPolicyRatioDrift, "
            "GRPOLogRatioFuseBlowing, GRPOESSDrop, GRPOLowerClipDominant and GRPOClipFractionHigh cannot fire"))


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
