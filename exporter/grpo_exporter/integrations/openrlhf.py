"""OpenRLHF: the rollout side from its ``Experience`` batches, the update side from ``ppo_train``'s status.

An ``Experience`` carries ``sequences`` (the whole observation: prompt, actions and, in multi-turn agents, the
environment's feedback), ``action_mask`` over ``sequences[:, 1:]`` (B, T-1: 1 on the model's tokens),
``action_log_probs`` (the trainer's, before the update: old), ``base_action_log_probs`` (reference; only with
``--algo.kl.use_loss``), ``rollout_log_probs`` (vLLM's; only with ``--algo.advantage.is_correction_level``
other than ``off``), ``advantages``, ``rewards``, ``scores`` (the binary verifier score), ``truncated`` and
``index`` (the sample's position in the rollout: OpenRLHF's groups are ``index // n_samples_per_prompt``). The
PPO update returns scalars only (``actor_grad_norm``, ``entropy_loss``, ``vllm_kl``, ``is_filter_ratio``), so
ratio, ESS, clip split and the on-policy check are absent (docs/integrations.md).

Hooks: OpenRLHF's ``PPOTrainer`` is a Ray actor (``train_ppo_ray.py`` holds only its handle), so
:func:`monitored_ppo_trainer` returns a Ray actor class to launch in its place: the monitor lives in the trainer's
process. :func:`attach` wraps an instance's ``experience_maker.make_experience_batch`` and
``ppo_train(global_step)`` (``train_step`` calls both once per step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from grpo_exporter.ids import id_tensor
from grpo_exporter.integrations import observe_reported_update, observe_rollout_time_update, require, say_once
from grpo_exporter.runtime.monitor import GRPOMonitor

TESTED = "openrlhf>=0.11,<0.12"

require("openrlhf", "openrlhf", TESTED)
from openrlhf.trainer.ppo_utils import Experience  # noqa: E402

#: OpenRLHF's logged status key → the sample here that means the same thing, and how they differ.
OPENRLHF_METRICS: Mapping[str, tuple[str, str]] = {
    "actor_grad_norm": ("grpo_grad_norm_pre_clip", "same (DeepSpeed's global norm), except OpenRLHF's 0.0 for a "
                        "norm DeepSpeed did not compute: absent here"),
    "entropy_loss": ("grpo_entropy_mean_nats", "same: token mean of the policy entropy (with --actor.entropy_coef)"),
    "vllm_kl": ('grpo_mismatch_kl_nats{estimator="k1"}',
                "same: masked mean of rollout - old log-probs (OpenRLHF's over each micro-batch's tokens, averaged)"),
    "is_filter_ratio": (
        'grpo_rollout_correction_capped_ratio{level="token"}',
        "token level, ratio gating, with rollout_correction_cap = the HIGH threshold: the share above it (OpenRLHF "
        "also counts the tokens below LOW)",
    ),
    "response_length": ("grpo_completion_length_tokens", "single turn: the same; multi-turn agents: OpenRLHF's spans "
                        "first to last action token (environment feedback included), here the model's tokens"),
}


def observe_experiences(
    monitor: GRPOMonitor, experiences: Sequence[Experience], step: int, *, correct_threshold: float = 0.5
) -> None:
    """One :meth:`~GRPOMonitor.observe_rollout` for the step's experiences (concatenated with OpenRLHF's own
    ``Experience.concat_experiences``), and the rollout-time update inputs (advantages; the KL of the sampling
    policy to the reference). Groups are OpenRLHF's: ``index // group_size`` (its advantage reshapes the rewards
    by sample index, so two groups of one prompt text in a batch stay two groups); the prompt text, when there is
    no index. Prompts (for solve rates) are keyed by their text. Completion lengths are the model's tokens (a
    multi-turn ``response_length`` spans the environment's feedback too). ``scores >= correct_threshold`` is
    correct."""
    with monitor.contained("rollout", "openrlhf observe_experiences"):
        batch = Experience.concat_experiences(list(experiences), pad_token_id=0)
        mask: Tensor = batch.action_mask.bool()
        width = mask.shape[1]
        rollout: dict[str, Any] = {
            "loss_mask": mask,
            "completion_ids": batch.sequences[:, -width:],
            "completion_mask": mask,
            "completion_lengths": mask.sum(dim=1),
            "old_logprobs": batch.action_log_probs,
            "rollout_logprobs": batch.rollout_log_probs,
        }
        if batch.rewards is not None:
            rollout["rewards"] = batch.rewards.float().reshape(-1)
        if batch.scores is not None:
            rollout["correct"] = batch.scores.float().reshape(-1) >= correct_threshold
        if batch.truncated is not None:
            rollout["truncated"] = batch.truncated.bool().reshape(-1)
        index = list(batch.index) if batch.index is not None else []
        if len(index) == mask.shape[0]:
            rollout["group_ids"] = [int(i) // monitor.config.group_size for i in index]
        elif batch.prompts:
            rollout["group_ids"] = list(batch.prompts)
        if batch.prompts:
            rollout["prompt_ids"] = list(batch.prompts)
        monitor.observe_rollout(step, **rollout)
        groups = rollout.get("group_ids")
        more = {} if groups is None else {"group_ids": id_tensor("group_ids", groups, mask.device)}
        observe_rollout_time_update(monitor, step, mask, batch.advantages, batch.action_log_probs,
                                    batch.base_action_log_probs, more=more)


def observe_status(
    monitor: GRPOMonitor, step: int, status: Mapping[str, Any], max_grad_norm: float | None = None
) -> None:
    """The update side from ``ppo_train``'s status (``actor_grad_norm``; ``entropy_loss``, the token mean of the
    policy entropy when an entropy coefficient is set), then end the step. OpenRLHF reports a grad norm of
    exactly 0.0 when DeepSpeed computed none (``get_grad_norm``): no reading, said once, never a norm of 0."""
    with monitor.contained("update", "openrlhf observe_status"):
        grad, entropy = status.get("actor_grad_norm"), status.get("entropy_loss")
        if grad is not None and float(grad) == 0.0:
            say_once(monitor, "openrlhf-zero-norm", "grpo_exporter: OpenRLHF reports actor_grad_norm 0.0, its value "
                     "when DeepSpeed computed no norm: no grad-norm reading is published for such steps")
            grad = None
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


def _kl_coef(args: Any) -> float:
    """The KL-to-reference coefficient OpenRLHF starts from: ``algo.kl.init_coef`` (in the loss with
    ``--algo.kl.use_loss``, else in the reward; 0 is no penalty). An adaptive controller (``algo.kl.target``)
    moves it from there: the rules read whether a penalty is on, not its value."""
    kl = getattr(getattr(args, "algo", None), "kl", None)
    return float(getattr(kl, "init_coef", 0.0) or 0.0)


def monitored_ppo_trainer(base: Any = None, *, max_grad_norm: float | None = None,
                          **monitor_settings: Any) -> Any:
    """A Ray actor class to launch in place of OpenRLHF's ``PPOTrainer`` (``MonitoredPPOTrainer.remote(...)``
    with the same arguments, e.g. in a copy of ``train_ppo_ray.py``): the trainer's own class (the one under
    ``@ray.remote``), which makes a :class:`GRPOMonitor` in the trainer's process after OpenRLHF's ``__init__``
    (``group_size`` from ``rollout.n_samples_per_prompt``, ``kl_coef`` from ``algo.kl.init_coef``, ``run`` from
    ``monitor_settings`` or the environment)
    and :func:`attach` es it, with the clip line ``actor.max_norm`` unless ``max_grad_norm`` is given (0:
    DeepSpeed does not clip). ``base``: OpenRLHF's ``PPOTrainer`` (default) or ``PPOTrainerAsync``, a Ray actor
    class or a plain class (a plain class comes back plain)."""
    if base is None:
        base = require("openrlhf.trainer.ppo_trainer", "openrlhf", TESTED).PPOTrainer
    cls = getattr(base, "__ray_actor_class__", base)

    class MonitoredPPOTrainer(cls):  # type: ignore[misc, valid-type]
        monitor: GRPOMonitor

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            settings = {"group_size": int(self.args.rollout.n_samples_per_prompt), "kl_coef": _kl_coef(self.args),
                        **monitor_settings}
            self.monitor = GRPOMonitor(**settings)
            clip = max_grad_norm if max_grad_norm is not None else float(self.args.actor.max_norm)
            attach(self, self.monitor, max_grad_norm=clip if clip > 0 else None)

    MonitoredPPOTrainer.__name__ = MonitoredPPOTrainer.__qualname__ = f"Monitored{cls.__name__}"
    if cls is base:
        return MonitoredPPOTrainer
    import ray

    return ray.remote(MonitoredPPOTrainer)
