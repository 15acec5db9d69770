"""verl: the rollout side from a real ``DataProto``, the update side from the aggregates the workers return.

verl's driver holds the whole batch between rollout and update: ``responses``, ``response_mask``,
``token_level_scores``/``token_level_rewards``, ``old_log_probs``, ``rollout_log_probs`` (the engine's, when
``rollout_correction`` or ``calculate_log_probs`` keeps them), ``ref_log_prob``, ``advantages``, and the group
ids in ``non_tensor_batch["uid"]`` (strings: hashed by the monitor). The current log-probs and per-token
entropies stay in the workers; only aggregates come back (``actor/grad_norm``, ``actor/entropy``,
``actor/pg_clipfrac``, ...), so the metrics that need current log-probs (ratios, ESS, clip split, on-policy
check) are absent: docs/integrations.md lists them.

Three hook points, each one monitor step per optimizer step:

* v0 (``RayPPOTrainer``, deprecated by verl): :func:`monitored_ray_trainer` subclasses it;
  ``_compute_old_log_prob`` gives the per-token entropies of the sampling policy, ``_update_actor(batch)`` the
  full batch before the update and the aggregates after (verl's ``ppo_epochs``/mini-batches are one step).
* fully-async (``verl.experimental.fully_async_policy``): ``FullyAsyncTrainer`` is a Ray actor class;
  :mod:`grpo_exporter.integrations.verl_fully_async` launches the same hooks on it, one step per local update,
  the policy version counted in parameter versions (``current_param_version``), not in steps.
* v1 (``PPOTrainer``, verl 0.9's default): the batch lives in the TransferQueue;
  :mod:`grpo_exporter.integrations.verl_v1` reads it once per global step.

Every monitor the adapters make checks the advantages as the configured estimator computes them
(:func:`advantage_form`, from ``algorithm.adv_estimator``): GRPOAdvantageAboveBound pages only where a per-group
bound holds. What verl's config implies (:func:`monitor_settings`) is read in
:mod:`grpo_exporter.integrations.verl_settings`.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo_exporter.ids import id_tensor
from grpo_exporter.integrations import (
    IntegrationError,
    check_signature,
    observe_reported_update,
    observe_rollout_time_update,
    require,
    say_once,
)
from grpo_exporter.integrations.verl_settings import (
    ESTIMATOR_FORMS,
    TESTED,
    _bypass,
    _grad_clip,
    _routing_replay,
    _select,
    advantage_form,
    monitor_settings,
)
from grpo_exporter.runtime.monitor import GRPOMonitor

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
    # rollout correction's diagnostics (decoupled mode, on the batch before rejection), same definitions
    "rollout_corr/kl": ('grpo_mismatch_kl_nats{estimator="k1"}', "same: mean(rollout - old)"),
    "rollout_corr/k3_kl": ('grpo_mismatch_kl_nats{estimator="k3"}', "same: mean exp(l) - 1 - l, l = old - rollout"),
    "rollout_corr/chi2_token": ('grpo_mismatch_chi_square{level="token"}', "same: E[w^2] - 1 over tokens"),
    "rollout_corr/chi2_seq": ('grpo_mismatch_chi_square{level="sequence"}',
                              "same: E[(prod w)^2] - 1 over sequences"),
    "rollout_corr/log_ppl_diff": ("grpo_mismatch_log_ppl_diff_nats", "same"),
    "rollout_corr/ppl_ratio": ("grpo_mismatch_ppl_multiple", "same"),
    "training/off_policy/trajectory_staleness_worst/max": (
        "grpo_rollout_staleness_versions",
        "same (v1): the policy version minus the oldest trajectory's start version (min_global_steps)",
    ),
    "training/off_policy/trajectory_staleness_worst/mean": (
        "grpo_token_staleness_mean_versions",
        "per loss token where verl's is per trajectory (fully-async's trajectory_staleness/mean, PR #7569, weighs "
        "tokens as here); the age from min_global_steps against the policy version",
    ),
    "response/aborted_ratio": (
        "increase(grpo_aborted_completions_total[w]) / (increase(grpo_completions_total[w]) + "
        "increase(grpo_aborted_completions_total[w]))",
        "same: aborted samples (no response token) are counted apart and are no completion: left out of every "
        "other reading and count",
    ),
    # what the agent loop and the fully-async trainer count themselves (observe_dataproto passes them on)
    "num_turns/mean": ("rate(grpo_completion_turns_sum[w]) / rate(grpo_completion_turns_count[w])",
                       "same, over completions (verl's batch also holds aborted samples)"),
    "num_turns/min": ('grpo_completion_turns{quantile="0"}', "same, over completions"),
    "num_turns/max": ('grpo_completion_turns{quantile="1"}', "same, over completions"),
    "tool_call_counts/mean": ("increase(grpo_tool_calls_total[w]) / increase(grpo_completions_total[w])", "same"),
    "fully_async/partial/total_partial_num": ("increase(grpo_partial_completions_total[w])", "same"),
    "fully_async/partial/partial_ratio": (
        "increase(grpo_partial_completions_total[w]) / increase(grpo_completions_total[w])", "same"),
    "fully_async/count/dropped_stale_samples": (
        "grpo_dropped_stale_completions_total",
        "same count (the batch's meta_info fully_async/count/dropped_stale_samples); verl's runs since its "
        "rollouter started, this counter since the exporter did"),
}


logger = logging.getLogger("grpo_exporter")
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
    response_mask: Tensor | None = None,
    bypass: bool = False,
    policy_version: int | None = None,
    response_window: int | None = None,
    filter_counts: Mapping[str, int] | None = None,
    routing_replay: bool | None = None,
) -> None:
    """One :meth:`~GRPOMonitor.observe_rollout` (and the rollout-time part of the update: advantages, and the KL
    of the sampling policy to the reference from ``old_log_probs`` and ``ref_log_prob``) from verl's batch.

    ``correct_key``: a ``non_tensor_batch`` entry of the reward manager's extra info (verl's math rewards write
    ``acc``) read as correct when ``>= verifier_threshold``; absent → no pass@k or solve rates. ``prompt_key``: a
    ``non_tensor_batch`` entry that identifies the prompt across steps (``index`` from the dataset's
    ``extra_info``); ``uid`` is per rollout, so it gives groups, not prompts. verl's dataset sets ``index`` to 0
    where ``extra_info`` has none: a batch whose every row has one ``prompt_key`` value across several ``uid``
    groups (or that lacks the key) is identified by the prompt's token ids instead (``prompts``, its padding
    left out; else ``uid``), from then on for this monitor, said once. ``component_keys``: numeric
    ``non_tensor_batch`` entries published as reward components. ``entropy``: the per-token entropies of the
    old-log-prob pass (``_compute_old_log_prob``'s ``entropys``: the sampling policy on these tokens).

    verl's conventions, read as verl means them:

    * ``response_mask``: the model's tokens *before* rollout correction's rejection sampling (decoupled mode's
      ``compute_rollout_correction_and_add_to_batch`` overwrites the batch's with the kept tokens, which would
      measure the engine gap on exactly the tokens kept for agreeing). Default: the batch's.
    * Multi-turn agent loops: ``response_mask`` is 0 on tool output, the ``attention_mask``'s response window
      holds every token (model and tool); a response fills its window (truncated) when the window is full, as
      verl's ``response_length/clip_ratio`` counts. Aborted samples (no response token, verl's
      ``response/aborted_ratio``) are left out of every reading: they are no completion, not a reward of 0.
    * ``bypass``: rollout correction's bypass mode (``apply_bypass_mode``: ``old_log_probs`` *is*
      ``rollout_log_probs``). The engine gap then reads 0 by construction: it is absent instead (and said once).
      Detected from the batch when the two are one tensor.
    * Weight versions: verl's rollout servers tag each trajectory with the weight versions it was generated on
      (``min_global_steps`` / ``max_global_steps``: the ``global_steps`` of the last weight sync; v0 syncs
      ``global_steps`` after each update, so a fresh rollout carries ``global_steps - 1``, fully-async
      ``current_param_version``). The oldest start against ``policy_version`` (the version the old log-probs were
      computed on; default ``step``) gives the rollout staleness. The engine gap is read only when every
      trajectory was generated on ``policy_version`` alone (``min_global_steps`` and ``max_global_steps`` equal
      to it): on older weights the difference to the old log-probs is the policy lag, not an engine fault, so
      the gap is absent for such batches (said once). Partial rollouts (``max_global_steps`` above
      ``min_global_steps``) are counted, and the rollouter's running total of samples it dropped as too stale
      (``meta_info["fully_async/count/dropped_stale_samples"]``, which ``assemble_batch_from_rollout_samples``
      copies from the rollouter's ``count/dropped_stale_samples``) is counted as it grows.
    * ``response_window``: the response length at which verl cuts a response (``rollout.response_length``);
      default the batch's width (v0 pads every response to it).
    * Rewards: the rollout's are the sequence scores (``token_level_scores``: the task reward, verl's
      ``critic/score``); the advantages are checked against what verl's estimators read,
      ``token_level_rewards`` summed (with ``use_kl_in_reward`` the score minus the KL penalty), handed with them
      to the update, so that the form's premise and bound (Dr. GRPO's range) hold on the rewards they came from.
    * ``filter_counts``: with dynamic sampling (the DAPO recipe's ``algorithm.filter_groups``) the kept batch's
      ``generated_groups`` (``num_gen_batches`` x ``gen_batch_size``) and ``filtered_all_correct_groups`` /
      ``filtered_all_incorrect_groups``, passed to ``observe_rollout`` as counted.
    * ``routing_replay``: MoE routing replay R3 (``router_replay.mode: R3`` with
      ``rollout.enable_rollout_routing_replay``): the batch's ``routed_experts`` (prompt + response positions,
      aligned to ``input_ids``) are the engine's, handed as ``rollout_routed_experts`` at the positions behind the
      response tokens, with ``routing_replay=True``. verl records one side only (R2's trainer-side routing, in
      another layout, is not read), so the routing mismatch and its alerts are absent, said once; the engine's
      expert load is published with ``moe_experts``.
    """
    with monitor.contained("rollout", "verl observe_dataproto"):
        batch, extra = data.batch, data.non_tensor_batch
        responses: Tensor = batch["responses"]
        width = responses.shape[1]
        loss_all, window_all = _masks(batch, width, response_mask)
        rows = _Rows(window_all, extra)
        loss_mask, window = _kept(rows.take(loss_all)), _kept(rows.take(window_all))
        scores = _tensor(batch, "token_level_scores")
        old_all = _tensor(batch, "old_log_probs")
        old = rows.take(old_all)
        version = step if policy_version is None else policy_version
        engine = _engine_logprobs(monitor, old, rows.take(_tensor(batch, "rollout_log_probs")), bypass, extra, version)
        rollout: dict[str, Any] = {
            "rewards": _kept(rows.take(batch["token_level_rewards"] if scores is None else scores)).sum(dim=-1).float(),
            "loss_mask": loss_mask,
            "completion_lengths": loss_mask.sum(dim=1),
            "truncated": window.sum(dim=1) >= (width if response_window is None else response_window),
            "completion_ids": _kept(rows.take(responses)),
            "completion_mask": window,
            "old_logprobs": old,
            "rollout_logprobs": engine,
            "prompt_tokens": rows.take(_tensor(batch, "prompts")),  # read by the recorder and reading set only
        }
        device = responses.device
        rollout |= _verdicts(rows, correct_key, _prompt_ids(monitor, rows, prompt_key, batch), component_keys,
                             verifier_threshold, device)
        rollout |= _agent_loop_counts(extra, rows, device) | dict(filter_counts or {})
        rollout |= _routing(monitor, batch, rows, width, routing_replay)
        if rows.rows is not None:  # verl's response/aborted_ratio: rows with no response token
            rollout["aborted_completions"] = responses.shape[0] - rows.rows.numel()
        dropped = data.meta_info.get("fully_async/count/dropped_stale_samples",
                                     data.meta_info.get("count/dropped_stale_samples"))  # the rollouter's total
        if dropped is not None:
            rollout["dropped_stale_total"] = int(dropped)
        monitor.observe_rollout(step, **rollout)
        more = _update_keywords(batch, rows, version, device)
        observe_rollout_time_update(monitor, step, loss_all, _tensor(batch, "advantages"), old_all,
                                    _tensor(batch, "ref_log_prob"), entropy, more)


def _update_keywords(batch: Any, rows: _Rows, version: int, device: torch.device) -> dict[str, Any]:
    """The rollout-time update's keywords beyond its tensors: the policy versions and each row's staleness (from
    ``min_global_steps``), the groups and the rewards verl's estimators read."""
    extra = rows.non_tensors
    more: dict[str, Any] = {}
    started = _versions(extra, "min_global_steps")
    if started is not None and len(rows.pick(started)):
        more = {"policy_version": version, "rollout_policy_version": int(rows.pick(started).min()),
                # every row, as the update keeps them: an aborted one has no loss token and weighs nothing
                "staleness": version - torch.as_tensor(started, device=device)}
    # the update keeps every row: verl normalised each group's advantages with its aborted samples in it
    # (their loss mask is empty), so the bound is that of the whole group
    if "uid" in extra:
        more["group_ids"] = id_tensor("group_ids", extra["uid"], device)
    earned = _tensor(batch, "token_level_rewards")
    if earned is not None and _tensor(batch, "advantages") is not None:
        # what verl's estimators read (score - beta x KL with use_kl_in_reward): the form and bound premises
        more["rewards"] = earned.sum(dim=-1).float()
    return more


def _masks(batch: Any, width: int, response_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(loss mask, response window) of every row, bool: the model's tokens (``response_mask`` given, else the
    batch's, else the window) and every token of the response window (the ``attention_mask``'s last ``width``
    positions, model and tool tokens; else the loss mask)."""
    loss_mask = response_mask if response_mask is not None else _tensor(batch, "response_mask")
    window = _tensor(batch, "attention_mask")
    window = window[:, -width:].bool() if window is not None else None
    if loss_mask is None:
        loss_mask = window
    if loss_mask is None:
        raise ValueError("verl batch: expected response_mask or attention_mask, found neither")
    loss_mask = loss_mask.bool()
    return loss_mask, window if window is not None else loss_mask


class _Rows:
    """The rows that are completions: an aborted sample (no response token) is none. ``take`` selects them
    from a tensor, ``extra`` from a ``non_tensor_batch`` entry (verl's driver holds CPU tensors)."""

    def __init__(self, window: Tensor, extra: Mapping[str, Any]) -> None:
        keep = window.any(dim=1)
        self.rows: Tensor | None = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        self.non_tensors = extra

    def take(self, t: Tensor | None) -> Tensor | None:
        return t if t is None or self.rows is None else t[self.rows.to(t.device)]

    def extra(self, key: str) -> Any:
        return self.pick(self.non_tensors[key])

    def pick(self, values: np.ndarray) -> np.ndarray:
        """The completions' entries of a per-row array."""
        return values if self.rows is None else values[self.rows.cpu().numpy()]


def _engine_logprobs(monitor: GRPOMonitor, old: Tensor | None, engine: Tensor | None, bypass: bool,
                     extra: Mapping[str, Any], version: int) -> Tensor | None:
    """The engine's log-probs where they measure the engine: absent in bypass mode (they are the old ones) and
    on trajectories generated on other weights than ``version`` (the difference would be the policy lag)."""
    if engine is not None and (bypass or (old is not None and _same_storage(old, engine))):
        say_once(monitor, "verl-bypass", "grpo_exporter: verl rollout correction in bypass mode (old_log_probs "
                 "are the engine's rollout_log_probs): the engine log-prob gap cannot be measured and is absent, "
                 "not 0")
        return None
    if engine is not None and not _on_version(extra, version):
        say_once(monitor, "verl-lag", "grpo_exporter: verl batch with trajectories generated on other weights "
                 f"than policy version {version} (min_global_steps / max_global_steps): the engine log-prob gap "
                 "would include the policy lag and is absent for such batches")
        return None
    return engine


def _verdicts(rows: _Rows, correct_key: str | None, prompt_ids: np.ndarray | None, component_keys: Sequence[str],
              threshold: float, device: torch.device) -> dict[str, Any]:
    """Groups (``uid``), prompt identity, correctness and reward components from the ``non_tensor_batch``."""
    extra = rows.non_tensors
    out: dict[str, Any] = {}
    if "uid" in extra:
        out["group_ids"] = rows.extra("uid")
    if prompt_ids is not None:
        out["prompt_ids"] = prompt_ids
    if correct_key is not None and correct_key in extra:
        out["correct"] = torch.as_tensor(rows.extra(correct_key).astype("float64"), device=device) >= threshold
    components = {k: torch.as_tensor(rows.extra(k).astype("float32"), device=device)
                  for k in component_keys if k in extra}
    if components:
        out["reward_components"] = components
    return out


def _agent_loop_counts(extra: Mapping[str, Any], rows: _Rows, device: torch.device) -> dict[str, Any]:
    """What verl's loops count per trajectory, as ``observe_rollout`` keywords: the agent loop's
    ``__num_turns__`` (``num_turns/*``), ``tool_call_counts`` where a tool agent writes them
    (``tool_call_counts/*``), and partial rollouts: trajectories whose ``max_global_steps`` differs from their
    ``min_global_steps`` (fully-async's ``partial/partial_ratio``)."""
    counts: dict[str, Any] = {}
    if "__num_turns__" in extra:
        counts["turns"] = torch.as_tensor(rows.extra("__num_turns__").astype("int64"), device=device)
    if "tool_call_counts" in extra:
        counts["tool_calls"] = int(rows.extra("tool_call_counts").astype("int64").sum())
    started, ended = _versions(extra, "min_global_steps"), _versions(extra, "max_global_steps")
    if started is not None and ended is not None:
        counts["partial"] = torch.as_tensor(rows.pick(ended != started), device=device)
    return counts


def _routing(monitor: GRPOMonitor, batch: Any, rows: _Rows, width: int, replay: bool | None) -> dict[str, Any]:
    """Under routing replay R3, the engine's routed experts behind each response token (the position before it:
    ``prompts`` width - 1 + t), and ``routing_replay``."""
    routed = _tensor(batch, "routed_experts")
    if routed is None or not replay:
        return {}
    say_once(monitor, "verl-routing", "grpo_exporter: verl records the engine's routed experts only (routing replay "
             "R3): the trainer's routing is not recorded, so the routing mismatch (GRPORoutingReplayFellBack, "
             "GRPORoutingMismatchRising) cannot be read; the engine's expert load is published with moe_experts")
    start = batch["prompts"].shape[1] - 1
    return {"rollout_routed_experts": _kept(rows.take(routed[:, start : start + width])), "routing_replay": True}


def _kept(t: Tensor | None) -> Tensor:
    """A row selection of a tensor the batch holds (never None)."""
    assert t is not None
    return t


def _versions(extra: Mapping[str, Any], key: str) -> np.ndarray | None:
    """A weight-version tag of every row (int64), or None where the batch lacks it or a server left it unset
    (verl's agent loop always writes the keys; a server that never had its version set writes None)."""
    values = extra.get(key)
    if values is None or any(v is None for v in values):
        return None
    return np.asarray([int(v) for v in values], dtype=np.int64)


def _on_version(extra: Mapping[str, Any], version: int) -> bool:
    """Every trajectory generated on ``version`` alone (true when the batch carries no versions)."""
    return all(tags is None or bool((tags == version).all())
               for tags in (_versions(extra, "min_global_steps"), _versions(extra, "max_global_steps")))


#: the monitors whose prompts are identified by their token ids (verl's index said nothing), for good
_BY_PROMPT_TOKENS: weakref.WeakSet[GRPOMonitor] = weakref.WeakSet()


def _prompt_ids(monitor: GRPOMonitor, rows: _Rows, prompt_key: str | None, batch: Any) -> np.ndarray | None:
    """Each completion's prompt identity: the ``prompt_key`` entry, unless it cannot tell prompts apart (absent,
    or verl's dataset default: ``index`` 0 on every row while the batch holds several ``uid`` groups); then, for
    this monitor from now on, a digest of the prompt's token ids (``prompts``), else the ``uid``."""
    if prompt_key is None:
        return None
    extra = rows.non_tensors
    values, uids = extra.get(prompt_key), extra.get("uid")
    if monitor not in _BY_PROMPT_TOKENS:
        one_value = values is not None and len(values) > 1 and len(set(values.tolist())) == 1
        if values is not None and not (one_value and uids is not None and len(set(uids.tolist())) > 1):
            return rows.extra(prompt_key)
        _BY_PROMPT_TOKENS.add(monitor)
        why = (f"has no {prompt_key!r}" if values is None or uids is None else
               f"holds {prompt_key}={values[0]!r} on every sample of {len(set(uids.tolist()))} groups (verl's "
               "dataset writes index 0 where a row's extra_info has none)")
        say_once(monitor, "verl-prompt-ids", f"grpo_exporter: verl's batch {why}: prompts are identified by their "
                 "prompt token ids instead (uid where the batch has none), for the rest of the run; set "
                 "extra_info.index per prompt in your dataset, or pass prompt_key=")
    digests = _prompt_digests(batch)
    if digests is not None:
        return rows.pick(digests)
    return rows.extra("uid") if uids is not None else None


def _prompt_digests(batch: Any) -> np.ndarray | None:
    """A 64-bit digest (hex) of each row's prompt token ids, padding left out where the ``attention_mask`` spans
    prompt and response (v0's left padding varies with the batch's longest prompt); None without ``prompts``."""
    prompts, mask = _tensor(batch, "prompts"), _tensor(batch, "attention_mask")
    if prompts is None:
        return None
    tokens = prompts.detach().cpu().long()
    width = tokens.shape[1]
    if mask is not None and mask.shape[1] == width + batch["responses"].shape[1]:
        valid = mask[:, :width].detach().cpu().bool()
    else:
        valid = torch.ones_like(tokens, dtype=torch.bool)
    return np.array([hashlib.blake2b(row[keep].numpy().tobytes(), digest_size=8).hexdigest()
                     for row, keep in zip(tokens, valid, strict=True)], dtype=object)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    """One tensor under two keys (verl's bypass alias), without reading values."""
    return a is b or (a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.stride() == b.stride())


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
    (set it after construction: ``trainer.monitor = GRPOMonitor(**monitor_settings(config, targets_dir=d))``;
    the trainer is built in verl's task runner, a Ray actor on a node Ray picks: with ``targets_dir`` the monitor
    announces the address and port it serves in ``d`` for Prometheus' ``file_sd_configs``).

    The policy version is ``global_steps - 1``: v0 syncs the weights to the rollout servers as ``global_steps``
    after each update, so a fresh rollout is tagged one below the step that trains on it. verl's fully-async
    ``FullyAsyncTrainer`` is refused at once (a Ray actor class, versioned in parameter versions, not in
    steps): :func:`~grpo_exporter.integrations.verl_fully_async.monitored_fully_async_task_runner` launches it
    monitored."""
    if base is None:
        base = require("verl.trainer.ppo.ray_trainer", "verl", TESTED).RayPPOTrainer
        _say_v0_deprecated()
    _refuse_actor_classes(base)
    return _hooked(base, "MonitoredRayPPOTrainer")


_SAID_V0: list[bool] = []


def _say_v0_deprecated() -> None:
    """Once per process: verl 0.9.1 marks its v0 trainer for removal (its ``@deprecated`` RayPPOTrainer)."""
    if not _SAID_V0:
        _SAID_V0.append(True)
        logger.warning(
            "grpo_exporter: verl 0.9.1 marks its v0 trainer for removal (RayPPOTrainer warns 'Legacy trainer is "
            "deprecated, and wil be removed in v0.9.0', main_ppo.py says the same of main_ppo_v0.py with "
            "trainer.use_v1=false); it may be gone in any later verl. verl's default v1 trainer (trainer.use_v1) "
            "is monitored with grpo_exporter.integrations.verl_v1.monitored_task_runner()")


def _refuse_actor_classes(base: Any) -> None:
    """The v0 hooks need a plain class with verl's v0 step and version semantics: a Ray actor class cannot be
    subclassed, and the fully-async trainer counts versions in ``current_param_version``."""
    inner = getattr(base, "__ray_actor_class__", base)
    if any(c.__name__ == "FullyAsyncTrainer" for c in getattr(inner, "__mro__", ())):
        raise IntegrationError(
            f"grpo_exporter.integrations.verl: {inner.__name__} is verl's fully-async trainer: a Ray actor class "
            "(@ray.remote), which monitored_ray_trainer cannot subclass, whose rollouts are tagged with "
            "current_param_version while global_steps counts every local update (the staleness would grow with "
            "trigger_parameter_sync_step). Launch verl's fully_async_main with "
            "run_ppo(config, task_runner_class=monitored_fully_async_task_runner(...)) instead. Tested with "
            f"{TESTED}.")
    if inner is not base:
        raise IntegrationError(
            f"grpo_exporter.integrations.verl: {inner.__name__} is a Ray actor class (@ray.remote): a subclass of "
            "it is no actor class and cannot be launched as verl launches it. Pass its __ray_actor_class__ and "
            f"wrap the result with ray.remote. Tested with {TESTED}.")


def _hooked(base: Any, name: str) -> type:
    """``base`` with the hooks: ``_compute_old_log_prob`` keeps the model's tokens and the per-token entropies of
    the sampling policy, ``_update_actor(batch)`` reads the batch before the update and the aggregates after.
    ``_grpo_versions`` gives (monitor step, policy version)."""
    check_signature(base, "_update_actor", ("self", "batch"), "verl", TESTED)
    check_signature(base, "_compute_old_log_prob", ("self", "batch"), "verl", TESTED)

    class MonitoredRayPPOTrainer(base):
        monitor: GRPOMonitor | None = None
        _grpo_entropy: Tensor | None = None
        _grpo_response_mask: Tensor | None = None
        #: whether the adapter made the monitor from verl's config (else one handed in is checked against it)
        _grpo_made_monitor = False

        def _grpo_versions(self) -> tuple[int, int]:
            step = int(self.global_steps)
            return step, step - 1

        def _compute_old_log_prob(self, batch: DataProto) -> Any:
            # decoupled rollout correction replaces response_mask with the rejection-sampled one after this
            # pass: the model's tokens are kept here (a copy: the engine gap is measured on all of them)
            mask = _tensor(batch.batch, "response_mask")
            self._grpo_response_mask = None if mask is None else mask.clone()
            result = super()._compute_old_log_prob(batch)
            old = result[0] if isinstance(result, tuple) else result
            self._grpo_entropy = _tensor(old.batch, "entropys") if isinstance(old, DataProto) else None
            return result

        def _update_actor(self, batch: DataProto) -> Any:
            step, version = self._grpo_versions()
            if self.monitor is not None:
                if not self._grpo_made_monitor:
                    _check_form(self.monitor, self.config)
                observe_dataproto(self.monitor, batch, step, entropy=self._grpo_entropy, policy_version=version,
                                  response_mask=self._grpo_response_mask, bypass=_bypass(self.config),
                                  routing_replay=_routing_replay(self.config))
            self._grpo_entropy = self._grpo_response_mask = None
            output = super()._update_actor(batch)
            if self.monitor is not None:
                observe_actor_metrics(self.monitor, step, output.meta_info.get("metrics", {}), _grad_clip(self.config))
            return output

    MonitoredRayPPOTrainer.__name__ = MonitoredRayPPOTrainer.__qualname__ = name
    return MonitoredRayPPOTrainer


def _check_form(monitor: GRPOMonitor, config: Any) -> None:
    """Once per monitor, where a monitor handed in checks the advantages as another form than verl computes (an
    estimator of yours: the monitor's form is yours)."""
    try:
        form = advantage_form(config)
    except IntegrationError:
        return
    if monitor.config.advantage_norm != form:
        estimator = _select(config, "algorithm.adv_estimator")
        say_once(monitor, "verl-form", f"grpo_exporter: verl's algorithm.adv_estimator={estimator!r} computes "
                 f"{form!r} advantages (use_kl_in_reward={bool(_select(config, 'algorithm.use_kl_in_reward'))}), "
                 f"the monitor checks them as {monitor.config.advantage_norm!r}: GRPOAdvantageAboveBound judges "
                 "them against the wrong bound. Make the monitor with GRPOMonitor(**monitor_settings(config, ...)).")


__all__ = ["ESTIMATOR_FORMS", "TESTED", "VERL_METRICS", "advantage_form", "monitor_settings", "monitored_ray_trainer",
           "observe_actor_metrics", "observe_dataproto"]
