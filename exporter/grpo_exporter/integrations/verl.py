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
* v1 (``PPOTrainer``, verl 0.9's default): the batch lives in the TransferQueue;
  :mod:`grpo_exporter.integrations.verl_v1` reads it once per global step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.ids import id_tensor
from grpo_exporter.integrations import (
    check_signature,
    observe_reported_update,
    observe_rollout_time_update,
    require,
    say_once,
)
from grpo_exporter.runtime.monitor import GRPOMonitor

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
        "same count (the batch's meta_info count/dropped_stale_samples); verl's runs since its rollouter started, "
        "this counter since the exporter did"),
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
    response_mask: Tensor | None = None,
    bypass: bool = False,
    policy_version: int | None = None,
    response_window: int | None = None,
    filter_counts: Mapping[str, int] | None = None,
) -> None:
    """One :meth:`~GRPOMonitor.observe_rollout` (and the rollout-time part of the update: advantages, and the KL
    of the sampling policy to the reference from ``old_log_probs`` and ``ref_log_prob``) from verl's batch.

    ``correct_key``: a ``non_tensor_batch`` entry of the reward manager's extra info (verl's math rewards write
    ``acc``) read as correct when ``>= verifier_threshold``; absent → no pass@k or solve rates. ``prompt_key``: a
    ``non_tensor_batch`` entry that identifies the prompt across steps (``index`` from the dataset's
    ``extra_info``); ``uid`` is per rollout, so it gives groups, not prompts. ``component_keys``: numeric
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
    * Fully-async: the batch's ``min_global_steps`` (the parameter version each trajectory started on) against
      ``policy_version`` (default ``step``) give the rollout staleness. The engine gap is read only when every
      trajectory was generated on ``policy_version`` alone (``min_global_steps`` and ``max_global_steps`` equal
      to it): on older weights the difference to the old log-probs is the policy lag, not an engine fault, so
      the gap is absent for such batches (said once). Partial rollouts (``max_global_steps`` above
      ``min_global_steps``) are counted, and the rollouter's running total of samples it dropped as too stale
      (``meta_info["count/dropped_stale_samples"]``) is counted as it grows.
    * ``response_window``: the response length at which verl cuts a response (``rollout.response_length``);
      default the batch's width (v0 pads every response to it).
    * ``filter_counts``: with dynamic sampling (the DAPO recipe's ``algorithm.filter_groups``) the kept batch's
      ``generated_groups`` (``num_gen_batches`` x ``gen_batch_size``) and ``filtered_all_correct_groups`` /
      ``filtered_all_incorrect_groups``, passed to ``observe_rollout`` as counted.
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
            "prompt_tokens": rows.take(_tensor(batch, "prompts")),  # read by the flight recorder only
        }
        device = responses.device
        rollout |= _verdicts(rows, correct_key, prompt_key, component_keys, verifier_threshold, device)
        rollout |= _agent_loop_counts(extra, rows.extra, device) | dict(filter_counts or {})
        if rows.rows is not None:  # verl's response/aborted_ratio: rows with no response token
            rollout["aborted_completions"] = responses.shape[0] - rows.rows.numel()
        dropped = data.meta_info.get("count/dropped_stale_samples")  # the fully-async rollouter's running total
        if dropped is not None:
            rollout["dropped_stale_total"] = int(dropped)
        monitor.observe_rollout(step, **rollout)
        more: dict[str, Any] = {}
        started = rows.extra("min_global_steps") if "min_global_steps" in extra else ()
        if len(started):
            more = {"policy_version": version, "rollout_policy_version": int(min(started)),
                    # every row, as the update keeps them: an aborted one has no loss token and weighs nothing
                    "staleness": version - torch.tensor([int(v) for v in extra["min_global_steps"]], device=device)}
        # the update keeps every row: verl normalised each group's advantages with its aborted samples in it
        # (their loss mask is empty), so the bound is that of the whole group
        if "uid" in extra:
            more["group_ids"] = id_tensor("group_ids", extra["uid"], device)
        observe_rollout_time_update(monitor, step, loss_all, _tensor(batch, "advantages"), old_all,
                                    _tensor(batch, "ref_log_prob"), entropy, more)


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
        values = self.non_tensors[key]
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


def _verdicts(rows: _Rows, correct_key: str | None, prompt_key: str | None, component_keys: Sequence[str],
              threshold: float, device: torch.device) -> dict[str, Any]:
    """Groups (``uid``), prompt identity, correctness and reward components from the ``non_tensor_batch``."""
    extra = rows.non_tensors
    out: dict[str, Any] = {}
    if "uid" in extra:
        out["group_ids"] = rows.extra("uid")
    if prompt_key is not None and prompt_key in extra:
        out["prompt_ids"] = rows.extra(prompt_key)
    if correct_key is not None and correct_key in extra:
        out["correct"] = torch.as_tensor(rows.extra(correct_key).astype("float64"), device=device) >= threshold
    components = {k: torch.as_tensor(rows.extra(k).astype("float32"), device=device)
                  for k in component_keys if k in extra}
    if components:
        out["reward_components"] = components
    return out


def _agent_loop_counts(extra: Mapping[str, Any], take_extra: Callable[[str], Any], device: torch.device
                       ) -> dict[str, Any]:
    """What verl's loops count per trajectory, as ``observe_rollout`` keywords: the agent loop's
    ``__num_turns__`` (``num_turns/*``), ``tool_call_counts`` where a tool agent writes them
    (``tool_call_counts/*``), and partial rollouts: trajectories whose ``max_global_steps`` differs from their
    ``min_global_steps`` (fully-async's ``partial/partial_ratio``)."""
    counts: dict[str, Any] = {}
    if "__num_turns__" in extra:
        counts["turns"] = torch.as_tensor(take_extra("__num_turns__").astype("int64"), device=device)
    if "tool_call_counts" in extra:
        counts["tool_calls"] = int(take_extra("tool_call_counts").astype("int64").sum())
    if "min_global_steps" in extra and "max_global_steps" in extra:
        started, ended = take_extra("min_global_steps"), take_extra("max_global_steps")
        counts["partial"] = torch.as_tensor((ended != started).astype(bool), device=device)
    return counts


def _kept(t: Tensor | None) -> Tensor:
    """A row selection of a tensor the batch holds (never None)."""
    assert t is not None
    return t


def _on_version(extra: Mapping[str, Any], version: int) -> bool:
    """Every trajectory generated on ``version`` alone (true when the batch carries no versions)."""
    return all(key not in extra or all(int(v) == version for v in extra[key])
               for key in ("min_global_steps", "max_global_steps"))


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
    (set it after construction: ``trainer.monitor = GRPOMonitor(...)``)."""
    if base is None:
        base = require("verl.trainer.ppo.ray_trainer", "verl", TESTED).RayPPOTrainer
    check_signature(base, "_update_actor", ("self", "batch"), "verl", TESTED)
    check_signature(base, "_compute_old_log_prob", ("self", "batch"), "verl", TESTED)

    class MonitoredRayPPOTrainer(base):  # type: ignore[misc, valid-type]
        monitor: GRPOMonitor | None = None
        _grpo_entropy: Tensor | None = None

        _grpo_response_mask: Tensor | None = None

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
            step = int(self.global_steps)
            if self.monitor is not None:
                observe_dataproto(self.monitor, batch, step, entropy=self._grpo_entropy,
                                  response_mask=self._grpo_response_mask, bypass=_bypass(self.config))
            self._grpo_entropy = self._grpo_response_mask = None
            output = super()._update_actor(batch)
            if self.monitor is not None:
                observe_actor_metrics(self.monitor, step, output.meta_info.get("metrics", {}), _grad_clip(self.config))
            return output

    return MonitoredRayPPOTrainer


def _select(config: Any, key: str) -> Any:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.select(config, key)
    except Exception:
        return None


def _grad_clip(config: Any) -> float | None:
    """The norm verl's actor clips at: ``actor_rollout_ref.actor.optim.clip_grad`` (what verl's engines read),
    else the deprecated ``actor.grad_clip`` (verl copies it there); None when neither is set."""
    value = _select(config, "actor_rollout_ref.actor.optim.clip_grad")
    if value is None:
        value = _select(config, "actor_rollout_ref.actor.grad_clip")
    return float(value) if value is not None else None


def _bypass(config: Any) -> bool:
    """``algorithm.rollout_correction.bypass_mode`` of verl's config."""
    return bool(_select(config, "algorithm.rollout_correction.bypass_mode"))
