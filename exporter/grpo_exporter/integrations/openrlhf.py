"""OpenRLHF: the rollout side from its ``Experience`` batches, the update side from ``ppo_train``'s status.

An ``Experience`` carries ``sequences`` (prompt + response), ``action_mask``, ``action_log_probs`` (the
trainer's, before the update: old), ``base_action_log_probs`` (reference), ``rollout_log_probs`` (vLLM's, when
``--rollout.enable_logprobs``-style options keep them), ``advantages``, ``rewards``, ``scores`` (the binary
verifier score), ``response_length``, ``truncated`` and the prompt texts. The PPO update returns scalars only
(``actor_grad_norm``, ``entropy_loss``, ``kl``, ``policy_loss``), so ratio, ESS, clip split and the on-policy
check are absent (docs/integrations.md).

Hook: :func:`attach` wraps a ``PPOTrainer`` instance's ``experience_maker.make_experience_batch`` and
``ppo_train(global_step)`` (OpenRLHF's ``train_step`` calls both once per step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from grpo_exporter.integrations import observe_reported_update, observe_rollout_time_update, require
from grpo_exporter.monitor import GRPOMonitor

TESTED = "openrlhf>=0.11,<0.12"

require("openrlhf", "openrlhf", TESTED)
from openrlhf.trainer.ppo_utils import Experience  # noqa: E402


def observe_experiences(
    monitor: GRPOMonitor, experiences: Sequence[Experience], step: int, *, correct_threshold: float = 0.5
) -> None:
    """One :meth:`~GRPOMonitor.observe_rollout` for the step's experiences (concatenated with OpenRLHF's own
    ``Experience.concat_experiences``), and the rollout-time update inputs (advantages; the KL of the sampling
    policy to the reference). Groups and prompts are keyed by the prompt text: repeated prompts of one batch
    are one group, as OpenRLHF's ``group_norm`` reshapes them. ``scores >= correct_threshold`` is correct."""
    with monitor.contained("rollout", "openrlhf observe_experiences"):
        batch = Experience.concat_experiences(list(experiences), pad_token_id=0)
        mask: Tensor = batch.action_mask.bool()
        width = mask.shape[1]
        rollout: dict[str, Any] = {
            "loss_mask": mask,
            "completion_ids": batch.sequences[:, -width:],
            "completion_mask": mask,
            "old_logprobs": batch.action_log_probs,
            "rollout_logprobs": batch.rollout_log_probs,
        }
        if batch.rewards is not None:
            rollout["rewards"] = batch.rewards.float().reshape(-1)
        if batch.scores is not None:
            rollout["correct"] = batch.scores.float().reshape(-1) >= correct_threshold
        if batch.truncated is not None:
            rollout["truncated"] = batch.truncated.bool().reshape(-1)
        if batch.response_length is not None:
            rollout["completion_lengths"] = batch.response_length.long().reshape(-1)
        if batch.prompts:
            rollout["group_ids"] = list(batch.prompts)
            rollout["prompt_ids"] = list(batch.prompts)
        monitor.observe_rollout(step, **rollout)
        observe_rollout_time_update(monitor, step, mask, batch.advantages, batch.action_log_probs,
                                    batch.base_action_log_probs)


def observe_status(
    monitor: GRPOMonitor, step: int, status: Mapping[str, Any], max_grad_norm: float | None = None
) -> None:
    """The update side from ``ppo_train``'s status (``actor_grad_norm``; ``entropy_loss``, the token mean of the
    policy entropy when an entropy coefficient is set), then end the step."""
    with monitor.contained("update", "openrlhf observe_status"):
        grad, entropy = status.get("actor_grad_norm"), status.get("entropy_loss")
        observe_reported_update(monitor, step, None if grad is None else float(grad),
                                None if entropy is None else float(entropy), max_grad_norm)


def attach(trainer: Any, monitor: GRPOMonitor, max_grad_norm: float | None = None) -> None:
    """Report every ``train_step`` of an OpenRLHF PPO trainer instance to ``monitor``: wraps its
    ``experience_maker.make_experience_batch`` (the experiences are held) and ``ppo_train(global_step)``, which
    observes them at ``global_step`` before the update and the status after it."""
    maker = trainer.experience_maker
    make, train = maker.make_experience_batch, trainer.ppo_train
    held: list[Sequence[Experience]] = []

    def make_experience_batch(*args: Any, **kwargs: Any) -> Any:
        experiences = make(*args, **kwargs)
        held[:] = [experiences]
        return experiences

    def ppo_train(global_step: int, *args: Any, **kwargs: Any) -> Any:
        if held:
            observe_experiences(monitor, held.pop(), int(global_step))
        status = train(global_step, *args, **kwargs)
        observe_status(monitor, int(global_step), status, max_grad_norm)
        return status

    maker.make_experience_batch = make_experience_batch
    trainer.ppo_train = ppo_train
