"""verl's v1 trainer (``trainer.use_v1: true``, verl 0.9's default): the batch lives in the TransferQueue.

The v1 ``PPOTrainer`` hands the driver only ``KVBatchMeta`` (keys, tags); the tensors are nested (one row per
trajectory, as long as its response) in TransferQueue storage. One global step runs ``parameter_sync_step``
local updates (``_step_once``: sample, old log-probs, advantages, update) and returns the keys of all of them,
with ``min_global_steps`` / ``max_global_steps`` in each tag (the weight versions a trajectory was generated
across) and ``is_padding`` on the no-op rows ``upsample_batch_to_divisible_size`` appends.

:func:`monitored_v1_trainer` subclasses a registered v1 trainer: after ``step`` it reads the global step's rows
once from the TransferQueue and hands them to :func:`~grpo_exporter.integrations.verl.observe_dataproto`, then
the step's aggregated actor metrics to :func:`~grpo_exporter.integrations.verl.observe_actor_metrics`. verl
builds the trainer inside its ``TaskRunnerV1`` Ray actor, so :func:`monitored_task_runner` gives the task
runner that installs the monitored class there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo_exporter.integrations import carried_variables, carrying, check_signature, require, say_once
from grpo_exporter.integrations.verl import DataProto, observe_actor_metrics, observe_dataproto
from grpo_exporter.integrations.verl_settings import (
    TESTED,
    _bypass,
    _grad_clip,
    _select,
    monitor_settings,
)
from grpo_exporter.runtime.monitor import GRPOMonitor

#: the TransferQueue fields read once per global step (absent ones are skipped by the TransferQueue)
FIELDS = ("uid", "index", "prompts", "responses", "response_mask", "rm_scores", "token_level_rewards",
          "old_log_probs", "rollout_log_probs", "ref_log_prob", "advantages", "entropy", "extra_fields", "num_turns")


def _rows(data: Any, name: str) -> list[Any]:
    return list(data[name]) if name in data else []


def observe_tq_batch(
    monitor: GRPOMonitor,
    batch: Any,
    step: int,
    *,
    response_length: int | None,
    response_masks: Mapping[str, Tensor] | None = None,
    engine_gap: bool = True,
    bypass: bool = False,
    policy_version: int | None = None,
    correct_key: str | None = "acc",
    prompt_key: str | None = "index",
    component_keys: Sequence[str] = (),
    verifier_threshold: float = 0.5,
) -> None:
    """One global step's rows from the TransferQueue (``batch``: the ``KVBatchMeta`` ``step`` returned) as
    :func:`~grpo_exporter.integrations.verl.observe_dataproto` reads a v0 ``DataProto``.

    * Padding rows (``is_padding`` tags) are left out: they are no trajectories.
    * The nested fields are padded to the batch's longest response; a response is truncated when it is
      ``response_length`` tokens long (``actor_rollout_ref.rollout.response_length``), not when it is the
      batch's longest.
    * ``rm_scores`` is the token-level score (the sequence score on the last token); correctness is the reward
      extra info ``extra_fields["reward_extra_info"][correct_key]`` the reward loop wrote. With
      ``use_kl_in_reward`` verl writes ``token_level_rewards`` (score - beta x KL): the rewards the advantages
      came from, handed with them; else those are the scores.
    * ``response_masks``: each key's response mask before rollout correction's rejection sampling (decoupled
      mode writes the kept tokens back into the TransferQueue).
    * ``engine_gap=False``: the old log-probs were not computed on the weights the engine sampled with
      (``parameter_sync_step > 1`` in the modes that do not restore them): the engine gap is absent, never the
      policy lag read as an engine fault.
    * ``prompts``: the prompt token ids, for the prompt identity where ``index`` cannot give it (verl's dataset
      writes index 0 where a row's ``extra_info`` has none): the attention mask handed on spans prompt (its
      own length) and response, so that the padding is left out of the prompt's digest.
    * The tags' ``min_global_steps`` against ``policy_version`` give the rollout staleness; a trajectory
      generated on other weights than ``policy_version`` (async modes) leaves the engine gap absent too
      (:func:`~grpo_exporter.integrations.verl.observe_dataproto`).
    """
    tq = require("transfer_queue", "verl", TESTED)
    with monitor.contained("rollout", "verl v1 TransferQueue read"):
        rows = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        keys = [batch.keys[i] for i in rows]
        if not keys:
            return
        tags = [batch.tags[i] for i in rows]
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=list(FIELDS))
        lengths = data["responses"].offsets().diff()
        non_tensors = _non_tensors(data, tags, correct_key, component_keys)
        tensors = {name: data[name].to_padded_tensor(padding=0) for name in FIELDS
                   if name in data and isinstance(data[name], Tensor) and data[name].is_nested}
        width = tensors["responses"].shape[1]
        window = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
        if "prompts" in tensors:  # the prompt's own tokens (right-padded here), then the response window
            prompt_lengths = data["prompts"].offsets().diff()
            prompt = torch.arange(tensors["prompts"].shape[1]).unsqueeze(0) < prompt_lengths.unsqueeze(1)
            window = torch.cat([prompt.long(), window], dim=1)
        tensors["attention_mask"] = window
        tensors["token_level_scores"] = tensors.pop("rm_scores")
        tensors.setdefault("token_level_rewards", tensors["token_level_scores"])  # verl writes them with KL only
        entropy = tensors.pop("entropy", None)
        if not engine_gap:
            tensors.pop("rollout_log_probs", None)
        mask = None
        if response_masks is not None and all(k in response_masks for k in keys):
            mask = torch.zeros(len(keys), width, dtype=torch.long)
            for i, k in enumerate(keys):
                mask[i, : response_masks[k].shape[0]] = response_masks[k]
        proto = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    observe_dataproto(monitor, proto, step, correct_key=correct_key if correct_key in non_tensors else None,
                      prompt_key=prompt_key, component_keys=component_keys, verifier_threshold=verifier_threshold,
                      entropy=entropy, response_mask=mask, bypass=bypass, policy_version=policy_version,
                      response_window=response_length)


def _non_tensors(data: Any, tags: list[Any], correct_key: str | None, component_keys: Sequence[str]
                 ) -> dict[str, Any]:
    """The ``non_tensor_batch`` of the rows as a v0 ``DataProto`` holds it: ``uid`` and ``index``, the reward
    extra info's ``correct_key`` and ``component_keys`` (where every row has them), the agent loop's turns and
    the tags' weight versions."""
    non_tensors: dict[str, Any] = {}
    for name in ("uid", "index"):
        values = _rows(data, name)
        if values:
            non_tensors[name] = np.array(values, dtype=object if name == "uid" else None)
    infos = [(extra or {}).get("reward_extra_info", {}) if isinstance(extra, Mapping) else {}
             for extra in _rows(data, "extra_fields")]
    for key in ([correct_key] if correct_key else []) + list(component_keys):
        if infos and all(key in info for info in infos):
            non_tensors[key] = np.array([float(info[key]) for info in infos])
    turns = _rows(data, "num_turns")
    if turns:  # the agent loop's count, under v0's name (verl's own num_turns/* metrics do the same)
        non_tensors["__num_turns__"] = np.array([int(t) for t in turns], dtype=np.int64)
    for name in ("min_global_steps", "max_global_steps"):  # staleness, and whether the engine gap is readable
        versions = [tag.get(name) for tag in tags]
        if all(v is not None for v in versions):
            non_tensors[name] = np.array(versions, dtype=np.int64)
    return non_tensors


def monitored_v1_trainer(base: type | None = None, *, correct_key: str | None = "acc",
                         **settings: Any) -> type:
    """A subclass of a verl v1 trainer class (``base``; default the one registered as ``"sync"``) that makes a
    :class:`GRPOMonitor` after verl's ``__init__``
    (:func:`~grpo_exporter.integrations.verl_settings.monitor_settings`: ``group_size`` =
    ``actor_rollout_ref.rollout.n``, ``run`` = ``trainer.experiment_name``, ``kl_coef``, and ``advantage_norm``
    from ``algorithm.adv_estimator``, unless ``settings`` say otherwise) and reports every global step.

    The monitor step is verl's ``global_steps``; the policy version is ``global_steps - 1`` (the weights the
    step's rollouts were sampled with when they are fresh: verl's own ``trajectory_staleness`` is
    ``(global_steps - 1) - max_global_steps``). The engine gap is read only when every row was generated on that
    version alone and the old log-probs of every local update were computed on it: one local update
    (``parameter_sync_step == 1``), or ``separate_async``, whose ``_compute_old_log_prob`` restores the weights
    of the step's first local update (pi_old) for every later one. ``sync`` and ``colocate_async`` with
    ``parameter_sync_step > 1`` compute them on weights the engine never had: the gap would be the policy lag,
    and is absent (said once).

    The ``GRPO_EXPORTER_*`` variables of the process that calls this go with the class and apply where the
    monitor is built, under that process's own (:func:`~grpo_exporter.integrations.carrying`)."""
    trainer_base = require("verl.trainer.ppo.v1.trainer_base", "verl", TESTED)
    if base is None:
        base = trainer_base.get_trainer_cls("sync")
    check_signature(base, "step", ("self", "metrics", "timing_raw"), "verl", TESTED)
    check_signature(base, "_compute_advantage", ("self", "batch", "metrics"), "verl", TESTED)

    restores = _restores_pi_old(base)
    carried = carried_variables()

    class MonitoredV1Trainer(base):  # type: ignore[misc, valid-type]
        monitor: GRPOMonitor
        _grpo_masks: dict[str, Tensor]

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            with carrying(carried):
                self.monitor = GRPOMonitor(**monitor_settings(config, **settings))
            self._grpo_masks = {}

        def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
            # decoupled rollout correction writes the rejection-sampled response_mask back: keep the model's tokens
            if _decoupled(self.config) and getattr(self, "monitor", None) is not None:
                with self.monitor.contained("rollout", "verl v1 response mask"):
                    tq = require("transfer_queue", "verl", TESTED)
                    masks = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                            select_fields=["response_mask"])["response_mask"]
                    self._grpo_masks.update(zip(batch.keys, (m.clone() for m in masks.unbind()), strict=True))
            return super()._compute_advantage(batch, metrics)

        def step(self, metrics: dict, timing_raw: dict) -> Any:
            batch = super().step(metrics, timing_raw)
            monitor = getattr(self, "monitor", None)
            if monitor is None:
                return batch
            step = int(self.global_steps)
            pi_old = restores or int(getattr(self, "parameter_sync_step", 1)) == 1
            bypass = _bypass(self.config)
            if not pi_old and not bypass:
                say_once(monitor, "verl-v1-lag", f"grpo_exporter: verl v1 {type(self).__name__} with "
                         "parameter_sync_step > 1: a step's later local updates compute old log-probs on weights "
                         "the engine never had, so the engine log-prob gap would be the policy lag and is absent")
            masks, self._grpo_masks = self._grpo_masks, {}
            width = _select(self.config, "actor_rollout_ref.rollout.response_length")
            observe_tq_batch(monitor, batch, step, response_length=None if width is None else int(width),
                             response_masks=masks or None, engine_gap=pi_old, bypass=bypass,
                             policy_version=step - 1,
                             correct_key=correct_key)
            observe_actor_metrics(monitor, step, metrics, _grad_clip(self.config))
            return batch

    MonitoredV1Trainer.__name__ = MonitoredV1Trainer.__qualname__ = f"Monitored{base.__name__}"
    return MonitoredV1Trainer


def _restores_pi_old(cls: type) -> bool:
    """Whether ``cls`` computes every local update's old log-probs on the weights the step's rollouts were sampled
    with: verl's ``separate_async`` trainer (``PPOTrainerSeparateAsync._compute_old_log_prob`` saves the weights of
    local update 0 and restores them for each later one; in bypass mode the old log-probs are the engine's)."""
    try:
        from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    except ImportError:
        return False
    return issubclass(cls, PPOTrainerSeparateAsync)


def _decoupled(config: Any) -> bool:
    """Rollout correction's rejection sampling in decoupled mode: ``_compute_advantage`` writes the kept tokens
    back as ``response_mask``."""
    return _select(config, "algorithm.rollout_correction.rollout_rs") is not None and not _bypass(config)


def install(mode: str, **settings: Any) -> type:
    """Make verl's trainer registry answer ``mode`` (``trainer.v1.trainer_mode``) with the monitored subclass of
    the trainer registered there, in this process (idempotent). ``settings`` go to
    :func:`monitored_v1_trainer`."""
    trainer_base = require("verl.trainer.ppo.v1.trainer_base", "verl", TESTED)
    current = trainer_base.get_trainer_cls(mode)
    if getattr(current, "_grpo_monitored", False):
        return current
    monitored = monitored_v1_trainer(current, **settings)
    monitored._grpo_monitored = True  # type: ignore[attr-defined]
    trainer_base.TRAINER_REGISTRY[mode] = monitored  # register_trainer refuses to rebind a name: the dict itself
    return monitored


def monitored_task_runner(**settings: Any) -> Any:
    """A Ray actor class to pass as ``run_ppo(config, task_runner_class=...)`` in place of verl's
    ``TaskRunnerV1``: before verl's ``run`` builds the trainer (in the task runner's own process), the trainer
    registered for ``config.trainer.v1.trainer_mode`` is replaced by its monitored subclass (:func:`install`).

    Ray places the task runner on a node of its choice: ``targets_dir=`` (a directory Prometheus reads with
    ``file_sd_configs``) has its monitor announce the address and port it serves there. ``settings`` travel with
    the class (Ray ships it to the actor by value), and so do the ``GRPO_EXPORTER_*`` variables of the process
    that calls this (but ``GRPO_EXPORTER_HOST`` and ``GRPO_EXPORTER_ADVERTISE_HOST``, which name this node): the
    actor does not inherit this environment on another node. The actor's own variables win over them."""
    main_ppo = require("verl.trainer.main_ppo", "verl", TESTED)
    base = main_ppo.TaskRunnerV1
    cls = getattr(base, "__ray_actor_class__", base)
    carried = carried_variables()

    class MonitoredTaskRunner(cls):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            with carrying(carried):  # the monitored trainer class takes them along
                install(str(config.trainer.v1.trainer_mode), **settings)
            return super().run(config)

    if cls is base:
        return MonitoredTaskRunner
    import ray

    return ray.remote(MonitoredTaskRunner)
