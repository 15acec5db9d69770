"""verl: the rollout side from a real ``DataProto``, the update side from the aggregates the workers return.

verl's driver holds the whole batch between rollout and update: ``responses``, ``response_mask``,
``token_level_scores``/``token_level_rewards``, ``old_log_probs``, ``rollout_log_probs`` (the engine's, when
``rollout_correction`` or ``calculate_log_probs`` keeps them), ``ref_log_prob``, ``advantages``, and the group
ids in ``non_tensor_batch["uid"]`` (strings: hashed by the monitor). The current log-probs and per-token
entropies stay in the workers; only aggregates come back (``actor/grad_norm``, ``actor/entropy``,
``actor/pg_clipfrac``, ...), so the metrics that need current log-probs (ratios, ESS, clip split, on-policy
check) are absent: docs/integrations.md lists them.

Two hook points, both one optimizer step per ``global_steps`` (verl's ``ppo_epochs``/mini-batches are one
driver step):

* v0 (``RayPPOTrainer``): :func:`monitored_ray_trainer` subclasses it; ``_compute_old_log_prob`` gives the
  per-token entropies of the sampling policy, ``_update_actor(batch)`` the full batch before the update and the
  aggregates after.
* v1 (``PPOTrainer``, registered with ``@register_trainer(name)``): override ``_update_actor(batch, metrics)``,
  read the fields from the TransferQueue and call :func:`observe_dataproto`, then :func:`observe_actor_metrics`
  with ``metrics`` after ``super()``: the recipe is in docs/integrations.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.integrations import (
    check_signature,
    observe_reported_update,
    observe_rollout_time_update,
    require,
)
from grpo_exporter.monitor import GRPOMonitor

TESTED = "verl>=0.9.1,<0.10"

verl = require("verl", "verl", TESTED)
from verl import DataProto  # noqa: E402

#: verl's logged actor metric → the sample here that means the same thing, and how they differ.
VERL_METRICS: Mapping[str, tuple[str, str]] = {
    "actor/grad_norm": ("grpo_grad_norm_pre_clip", "same: the norm the actor clipped, before clipping"),
    "actor/entropy": ("grpo_entropy_mean_nats", "verl's loss aggregation of token entropy (token-mean by default)"),
    "response_length/clip_ratio": (
        "increase(grpo_truncated_completions_total[w]) / increase(grpo_completions_total[w])",
        "same: a response as long as the response window is truncated",
    ),
    "critic/score/mean": ('grpo_reward_mean{component="total"}', "same: the sequence score before KL penalty"),
}


def _tensor(batch: Any, key: str) -> Tensor | None:
    return batch.get(key, None)


def observe_dataproto(
    monitor: GRPOMonitor,
    data: DataProto,
    step: int,
    *,
    correct_key: str | None = "acc",
    prompt_key: str | None = "index",
    component_keys: Sequence[str] = (),
    verifier_threshold: float = 0.5,
    entropy: Tensor | None = None,
) -> None:
    """One :meth:`~GRPOMonitor.observe_rollout` (and the rollout-time part of the update: advantages, and the KL
    of the sampling policy to the reference from ``old_log_probs`` and ``ref_log_prob``) from verl's batch.

    ``correct_key``: a ``non_tensor_batch`` entry of the reward manager's extra info (verl's math rewards write
    ``acc``) read as correct when ``>= verifier_threshold``; absent → no pass@k or solve rates. ``prompt_key``: a
    ``non_tensor_batch`` entry that identifies the prompt across steps (``index`` from the dataset's
    ``extra_info``); ``uid`` is per rollout, so it gives groups, not prompts. ``component_keys``: numeric
    ``non_tensor_batch`` entries published as reward components. ``entropy``: the per-token entropies of the
    old-log-prob pass (``_compute_old_log_prob``'s ``entropys``: the sampling policy on these tokens).
    """
    with monitor.contained("rollout", "verl observe_dataproto"):
        batch, extra = data.batch, data.non_tensor_batch
        responses: Tensor = batch["responses"]
        width = responses.shape[1]
        mask = _tensor(batch, "response_mask")
        if mask is None:
            mask = batch["attention_mask"][:, -width:]
        mask = mask.bool()
        scores = _tensor(batch, "token_level_scores")
        if scores is None:
            scores = batch["token_level_rewards"]
        lengths = mask.sum(dim=1)
        rollout: dict[str, Any] = {
            "rewards": scores.sum(dim=-1).float(),
            "loss_mask": mask,
            "completion_lengths": lengths,
            "truncated": lengths >= width,
            "completion_ids": responses,
            "completion_mask": mask,
            "old_logprobs": _tensor(batch, "old_log_probs"),
            "rollout_logprobs": _tensor(batch, "rollout_log_probs"),
            "prompt_tokens": _tensor(batch, "prompts"),  # read by the flight recorder only
        }
        if "uid" in extra:
            rollout["group_ids"] = extra["uid"]
        if prompt_key is not None and prompt_key in extra:
            rollout["prompt_ids"] = extra[prompt_key]
        device = responses.device
        if correct_key is not None and correct_key in extra:
            verdict = torch.as_tensor(extra[correct_key].astype("float64"), device=device)
            rollout["correct"] = verdict >= verifier_threshold
        components = {
            k: torch.as_tensor(extra[k].astype("float32"), device=device) for k in component_keys if k in extra
        }
        if components:
            rollout["reward_components"] = components
        monitor.observe_rollout(step, **rollout)
        observe_rollout_time_update(monitor, step, mask, _tensor(batch, "advantages"), rollout["old_logprobs"],
                                    _tensor(batch, "ref_log_prob"), entropy)


def observe_actor_metrics(
    monitor: GRPOMonitor, step: int, metrics: Mapping[str, Any], max_grad_norm: float | None = None
) -> None:
    """The update side from verl's returned aggregates (``actor/grad_norm``; ``actor/entropy`` when no per-token
    entropy was given; lists are averaged over mini-batches as verl's ``reduce_metrics`` does), then end the
    step."""
    with monitor.contained("update", "verl observe_actor_metrics"):
        observe_reported_update(monitor, step, _mean(metrics.get("actor/grad_norm")),
                                _mean(metrics.get("actor/entropy")), max_grad_norm)


def _mean(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, Sequence) and not isinstance(value, str):
        return sum(float(v) for v in value) / len(value) if value else None
    return float(value)


def monitored_ray_trainer(base: type | None = None) -> type:
    """A subclass of verl's v0 ``RayPPOTrainer`` (or ``base``) that reports every step to ``self.monitor``
    (set it after construction: ``trainer.monitor = GRPOMonitor(...)``)."""
    if base is None:
        base = require("verl.trainer.ppo.ray_trainer", "verl", TESTED).RayPPOTrainer
    check_signature(base, "_update_actor", ("self", "batch"), "verl", TESTED)
    check_signature(base, "_compute_old_log_prob", ("self", "batch"), "verl", TESTED)

    class MonitoredRayPPOTrainer(base):  # type: ignore[misc, valid-type]
        monitor: GRPOMonitor | None = None
        _grpo_entropy: Tensor | None = None

        def _compute_old_log_prob(self, batch: DataProto) -> Any:
            result = super()._compute_old_log_prob(batch)
            old = result[0] if isinstance(result, tuple) else result
            self._grpo_entropy = _tensor(old.batch, "entropys") if isinstance(old, DataProto) else None
            return result

        def _update_actor(self, batch: DataProto) -> Any:
            step = int(self.global_steps)
            if self.monitor is not None:
                observe_dataproto(self.monitor, batch, step, entropy=self._grpo_entropy)
            self._grpo_entropy = None
            output = super()._update_actor(batch)
            if self.monitor is not None:
                observe_actor_metrics(self.monitor, step, output.meta_info.get("metrics", {}), _grad_clip(self.config))
            return output

    return MonitoredRayPPOTrainer


def _grad_clip(config: Any) -> float | None:
    """``actor_rollout_ref.actor.grad_clip`` of verl's config, None when absent."""
    try:
        from omegaconf import OmegaConf

        value = OmegaConf.select(config, "actor_rollout_ref.actor.grad_clip")
    except Exception:
        return None
    return float(value) if value is not None else None
