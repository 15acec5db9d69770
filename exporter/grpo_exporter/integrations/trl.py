"""TRL's ``GRPOTrainer`` with a :class:`~grpo_exporter.runtime.monitor.GRPOMonitor` inside: two lines to adopt.

.. code-block:: python

    from grpo_exporter.integrations.trl import MonitoredGRPOTrainer
    trainer = MonitoredGRPOTrainer(model=..., reward_funcs=[accuracy, fmt], args=GRPOConfig(...),
                                   train_dataset=ds, verifier="accuracy", monitor_settings={"port": 9887})

TRL's callbacks see only the logged averages; the tensors the seed's metrics need live in private methods of
``GRPOTrainer``, which this subclass wraps with ``super()`` (each checked at import against the tested TRL
range, :data:`TESTED`):

* ``_generate(prompts)``: completion token lists, hence truncation (last token not EOS/pad, as TRL logs
  ``completions/clipped_ratio``) and generated lengths (before ``mask_truncated_completions`` zeroes a mask);
* ``_calculate_rewards(...)``: rewards per reward function (gathered over processes; this process's slice is
  kept), so components are named after the reward functions;
* ``_generate_and_score_completions(inputs)``: padded ids and masks, ``old_per_token_logps`` (TRL computes them
  when generation and optimisation are misaligned, e.g. ``num_iterations > 1``, or with vLLM importance
  sampling), ``sampling_per_token_logps`` (the engine's log-probs: vLLM or a ``rollout_func``), and
  ``ref_per_token_logps`` (``beta != 0``): one :meth:`~GRPOMonitor.observe_rollout` per optimizer step, of
  its generation batches joined (several when ``steps_per_generation * num_iterations`` is below
  ``gradient_accumulation_steps``);
* ``_get_per_token_logps_and_entropies`` inside ``_compute_loss(model, inputs)``: the current log-probs and
  entropies of each micro-batch, with its advantages and masks: one :meth:`~GRPOMonitor.observe_update`. TRL
  shuffles a generation batch's rows before it splits it into micro-batches (``_prepare_inputs``:
  ``shuffle_sequence_dict``, ``split_tensor_dict``), so each row carries its group id, its place in the
  step's rollout and its reward as three more tensors of the batch
  (:data:`~grpo_exporter.integrations.trl_update.GROUP_KEY`, :data:`~grpo_exporter.integrations.trl_update.
  ROW_KEY`, :data:`~grpo_exporter.integrations.trl_update.REWARD_KEY`): a rank's rows need not hold whole
  groups (TRL only needs the global batch to), and the advantages are checked against the rewards they came
  from. Where TRL computes no old log-probs but has the engine's (vLLM without its
  importance-sampling correction, a ``rollout_func``), the engine gap reads the loss's own forward of each row
  (the weights are the rollout's until the optimizer step) and the step's rollout is observed at its end. The
  loss mask handed over is the one TRL's loss trains with: less the sequences its off-policy mask drops and the
  tokens or sequences its vLLM importance-sampling ``*_mask`` modes zero (a sequence dropped whole counts in
  ``grpo_loss_mask_empty_sequences_total``);
* ``Trainer._get_grad_norm(model, grad_norm)``: the pre-clip norm TRL clips with ``max_grad_norm`` (computed
  without clipping when ``max_grad_norm`` is 0; DeepSpeed's own norm under DeepSpeed).

The monitor's step is TRL's ``state.global_step`` (one per optimizer step); a step ends at ``on_step_end``.
A micro-batch is on-policy when no optimizer step happened since its rollout (TRL's own step counter), which
is also the policy version handed for staleness. Every wrapper is contained: an error reading TRL's objects
is counted and logged and training goes on (``strict=True`` raises).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.integrations import IntegrationError, check_signature, require
from grpo_exporter.integrations.trl_settings import (
    LOSS_CLIP,
    TRL_METRICS,
    advantage_norm,
    concatenate_rollouts,
    engine_settings,
    generations_per_step,
    implied_staleness,
    loss_settings,
    prompt_key,
    say_what_differs,
)
from grpo_exporter.integrations.trl_update import GROUP_KEY, REWARD_KEY, ROW_KEY, TrainerBase, UpdateReading
from grpo_exporter.runtime.monitor import GRPOMonitor
from grpo_exporter.runtime.monitor_config import MonitorConfig

TESTED = "trl>=1.16,<1.17 with transformers>=5.24,<5.26"

logger = logging.getLogger("grpo_exporter")

trl = require("trl", "trl", TESTED)
transformers = require("transformers", "trl", TESTED)
try:
    from transformers import Trainer, TrainerCallback
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - an incompatible TRL
    raise IntegrationError(f"trl {trl.__version__}: cannot import GRPOTrainer ({exc}); tested with {TESTED}") from exc

check_signature(GRPOTrainer, "_generate", ("self", "prompts"), "trl", TESTED)
check_signature(GRPOTrainer, "_generate_and_score_completions", ("self", "inputs"), "trl", TESTED)
check_signature(
    GRPOTrainer, "_calculate_rewards", ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "trl", TESTED,
)
check_signature(
    GRPOTrainer, "_get_per_token_logps_and_entropies",
    ("self", "model", "input_ids", "attention_mask", "logits_to_keep"), "trl", TESTED,
)
check_signature(GRPOTrainer, "_compute_loss", ("self", "model", "inputs"), "trl", TESTED)
check_signature(  # returns (..., tool_call_count, tool_failure_count, ...) as results 4 and 5
    GRPOTrainer, "_tool_call_loop",
    ("self", "prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images", "multimodal_fields"),
    "trl", TESTED,
)
check_signature(  # a staticmethod: called with TRL's keywords to narrow the loss mask
    GRPOTrainer, "get_off_policy_mask",
    ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"), "trl", TESTED,
)
check_signature(Trainer, "_get_grad_norm", ("self", "model", "grad_norm"), "transformers", TESTED)

#: the monitor's default staleness line: raised to what TRL's schedule implies when the adapter makes the monitor
_STALENESS_LINE: int = MonitorConfig.model_fields["staleness_max_versions"].default


class _EndStep(TrainerCallback):
    """Ends the monitor's step after ``optimizer.step()``; closes a monitor the trainer made at train end."""

    def __init__(self, trainer: MonitoredGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.trainer.monitor.contained("rollout", "trl on_step_end: the step's rollouts"):
            self.trainer._flush_rollouts()
        with self.trainer.monitor.contained("update", "trl on_step_end"):
            self.trainer.monitor.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.trainer.monitor.contained("rollout", "trl on_train_end: the step's rollouts"):
            self.trainer._flush_rollouts()
        if self.trainer._grpo_owns_monitor:
            self.trainer.monitor.close()


class _RolloutReading(TrainerBase):
    """The rollout side of :class:`GRPOMonitorMixin`: TRL's generation, tool loop, rewards and scored batch, one
    ``observe_rollout`` per optimizer step (the state these methods share is made by the mixin's ``__init__``)."""

    monitor: GRPOMonitor
    _grpo_preflight: bool  # grpo_exporter.integrations.trl_preflight: observe nothing meanwhile
    _grpo_verifier: str | None
    _grpo_threshold: float
    _grpo_rollout_step: int | None  # the optimizer step of the last rollout (read by the update side)
    _grpo_generated: tuple[list[bool], list[int]] | None  # truncation and lengths of the generation batch
    _grpo_tools: tuple[int, int] | None  # its tool calls and failures
    _grpo_rewards: Tensor | None  # its rewards per function
    _grpo_pending: list[dict[str, Any]]  # the generation batches of the step, not yet observed
    _grpo_old_rows: list[tuple[Tensor, Tensor]]  # the step's rows and loss-forward log-probs (no old ones in TRL)
    _grpo_per_step: int
    _grpo_regression_eval: bool  # TRL's evaluation is the mastered-prompt regression set
    _grpo_regression: list[Tensor] | None  # the verifier's verdicts of the evaluate() call under way

    def _generate(self, prompts: list[Any]) -> Any:
        self._grpo_tools = None
        result = super()._generate(prompts)
        self._grpo_generated = None
        if self.model.training:
            with self.monitor.contained("rollout", "trl _generate"):
                _, completion_ids, tool_mask = result[0], result[1], result[2]
                stops = {*self.eos_token_ids, self._tokenizer.pad_token_id}
                truncated = [bool(ids) and ids[-1] not in stops for ids in completion_ids]
                lengths = (
                    [int(sum(m)) for m in tool_mask] if tool_mask is not None else [len(ids) for ids in completion_ids]
                )
                self._grpo_generated = (truncated, lengths)
        return result

    def _tool_call_loop(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._tool_call_loop(*args, **kwargs)
        with self.monitor.contained("rollout", "trl _tool_call_loop"):
            self._grpo_tools = (int(result[4]), int(result[5]))  # this process's calls and failures (tools/*)
        return result

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._grpo_rewards = rewards
        return rewards

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._grpo_rewards = None
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        if self.model.training and not self._grpo_preflight:
            with self.monitor.contained("rollout", "trl _generate_and_score_completions"):
                self._observe_rollout(inputs, output)
        elif self._grpo_regression is not None and self._grpo_rewards is not None:
            with self.monitor.contained("rollout", "trl evaluation batch (the regression set)"):
                self._grpo_regression.append(self._verdicts(self._grpo_rewards))
        return output

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """TRL's evaluation; with ``regression_eval`` its completions (every process's: TRL gathers the rewards),
        judged by the verifier, are one evaluation of the mastered-prompt regression set."""
        if not self._grpo_regression_eval:
            return super().evaluate(*args, **kwargs)
        self._grpo_regression = []
        try:
            metrics = super().evaluate(*args, **kwargs)
        finally:
            verdicts, self._grpo_regression = self._grpo_regression, None
        if verdicts:
            with self.monitor.contained("rollout", "trl evaluate (the regression set)"):
                self.monitor.observe_regression(int(self.state.global_step), torch.cat(verdicts))
        return metrics

    def _observe_rollout(self, inputs: Sequence[Mapping[str, Any]], output: dict[str, Any]) -> None:
        """Hold the generation batch's tensors; observe the step's batches as one rollout when the step has all
        of them (several when ``steps_per_generation * num_iterations`` divides ``gradient_accumulation_steps``
        more than once: each would otherwise overwrite the last one's readings), at the latest when it ends; a
        batch whose trainer log-probs come from the loss's forward waits for the step's end. Each row's group
        and place in the step's rollout go into ``output``, the batch TRL shuffles and splits."""
        step = int(self.state.global_step)
        if self._grpo_pending and self._grpo_pending[0]["step"] != step:
            self._flush_rollouts()
        self._grpo_rollout_step = step
        start = sum(int(r["completion_ids"].shape[0]) for r in self._grpo_pending)
        tensors = self._rollout_tensors(inputs, output, step, len(self._grpo_pending))
        deferred = tensors["old_logprobs"] is None and tensors["rollout_logprobs"] is not None
        self._grpo_pending.append({"step": step, "deferred": deferred, **tensors})
        n = int(tensors["completion_ids"].shape[0])
        output[GROUP_KEY] = tensors["group_ids"]
        if tensors.get("rewards") is not None:
            output[REWARD_KEY] = tensors["rewards"]
        output[ROW_KEY] = torch.arange(start, start + n, device=tensors["completion_ids"].device)
        if len(self._grpo_pending) >= self._grpo_per_step and not deferred:
            self._flush_rollouts()

    def _flush_rollouts(self) -> None:
        """Observe the held generation batches of one step as one rollout (concatenated along the batch)."""
        pending, self._grpo_pending = self._grpo_pending, []
        held, self._grpo_old_rows = self._grpo_old_rows, []
        if pending:
            step = pending[0]["step"]
            pad = self._tokenizer.pad_token_id
            batches = [{k: v for k, v in r.items() if k not in ("step", "deferred")} for r in pending]
            rollout = concatenate_rollouts(batches, int(pad) if pad is not None else 0)
            if any(r["deferred"] for r in pending):
                rollout["old_logprobs"] = self._old_from_updates(rollout["completion_ids"], held)
            self.monitor.observe_rollout(step, **rollout)

    @staticmethod
    def _old_from_updates(completion_ids: Tensor, held: Sequence[tuple[Tensor, Tensor]]) -> Tensor | None:
        """The step's trainer log-probs (N, T) from the loss's forward of each micro-batch (its rows' places in
        the rollout, its log-probs, right-padded as the rollout's batches are joined), where TRL computes no old
        ones: every row of the step's generation batches is trained ``num_iterations`` times within the step,
        before the optimizer step. None (no engine gap this step) unless each row was seen as often, which the
        host knows from the shapes alone."""
        n, width = completion_ids.shape
        seen = sum(int(rows.shape[0]) for rows, _ in held)
        if not held or seen % n:
            return None
        old = torch.zeros((n, width), dtype=held[0][1].dtype, device=completion_ids.device)
        for rows, logprobs in held:
            old[rows.to(old.device), : logprobs.shape[1]] = logprobs.to(old.device)
        return old

    def _rollout_tensors(self, inputs: Sequence[Mapping[str, Any]], output: Mapping[str, Any], step: int,
                         index: int) -> dict[str, Any]:
        """One generation batch's ``observe_rollout`` keywords; ``index``: its place among the step's batches
        (its groups are numbered after the earlier batches' groups on every process)."""
        completion_ids: Tensor = output["completion_ids"]
        device, n = completion_ids.device, completion_ids.shape[0]
        completion_mask = output["completion_mask"].bool()
        loss_mask = completion_mask & output["tool_mask"].bool() if "tool_mask" in output else completion_mask
        first = self.accelerator.process_index * n
        offset = index * -(-self.accelerator.num_processes * n // self.num_generations)
        rollout: dict[str, Any] = {
            "group_ids": torch.arange(first, first + n, device=device) // self.num_generations + offset,
            "prompt_ids": [prompt_key(x, step, (first + i) // self.num_generations + offset)
                           for i, x in enumerate(inputs)],
            "loss_mask": loss_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            # TRL's tool_mask marks the model's tokens; the monitor's marks where tools wrote
            "tool_mask": completion_mask & ~output["tool_mask"].bool() if "tool_mask" in output else None,
            "old_logprobs": output.get("old_per_token_logps"),
            "rollout_logprobs": output.get("sampling_per_token_logps"),
            "prompt_tokens": output.get("prompt_ids"),  # read by the flight recorder and the reading set only
        }
        if self._grpo_generated is not None and len(self._grpo_generated[0]) == n:
            truncated, lengths = self._grpo_generated
            rollout["truncated"] = torch.tensor(truncated, dtype=torch.bool, device=device)
            rollout["completion_lengths"] = torch.tensor(lengths, dtype=torch.int64, device=device)
        if self._grpo_rewards is not None:
            rollout.update(self._rewards(self._grpo_rewards[first : first + n].to(device)))
        if self._grpo_tools is not None:
            rollout["tool_calls"], rollout["tool_failures"] = self._grpo_tools
        return rollout

    def _rewards(self, per_func: Tensor) -> dict[str, Any]:
        """Total reward as TRL sums it (NaN where every function returned None: an unscorable completion), and
        the components. A function that returned None for some completions (not applicable, e.g. a multi-task
        set) is left out of that batch's components: its NaN is TRL's "not scored", not a numeric fault."""
        missing = torch.isnan(per_func)
        total = (per_func * self.reward_weights.to(per_func.device)).nansum(dim=1)
        total = total.masked_fill(missing.all(dim=1), float("nan"))
        partial = missing.any(dim=0).tolist()  # one small read: TRL has already synchronised on these rewards
        names = list(self.reward_func_names)
        components = {name: per_func[:, i] for i, name in enumerate(names) if not partial[i]}
        result: dict[str, Any] = {"rewards": total, "reward_components": components}
        if self._grpo_verifier is not None:
            result["correct"] = self._verdicts(per_func)
        return result

    def _verdicts(self, per_func: Tensor) -> Tensor:
        """Correct: the verifier's reward at or above its threshold (NaN, not scored, is not correct)."""
        return per_func[:, list(self.reward_func_names).index(str(self._grpo_verifier))] >= self._grpo_threshold


class GRPOMonitorMixin(_RolloutReading, UpdateReading):
    """The wrappers; mix into a ``GRPOTrainer`` subclass before it (``MonitoredGRPOTrainer`` does).

    ``monitor``: a monitor you made (you close it), else one is made with ``run`` = TRL's ``run_name`` (or the
    output directory's name), ``group_size`` = ``num_generations``, ``clip_eps`` = (``epsilon``,
    ``epsilon_high``), ``ratio_level`` and ``clip`` from ``importance_sampling_level`` and ``loss_type`` (GSPO's
    sequence ratio, CISPO's cap, SAPO's and VESPO's soft weights), ``advantage_norm`` from ``scale_rewards``
    ("whitened" under ``multi_objective_aggregation="normalize_then_sum"``), ``staleness_max_versions`` raised to
    the staleness TRL's schedule implies (``steps_per_generation x num_iterations`` micro-steps per generation
    over ``gradient_accumulation_steps``), ``correctness_component`` = ``verifier``, ``kl_coef`` = ``beta``, and
    ``monitor_settings`` on top (any :class:`~grpo_exporter.runtime.monitor_config.MonitorConfig` field, e.g.
    ``{"port": 9887}``); it is closed at the end of ``train()``. ``verifier``: the name of the reward function
    whose reward ``>= verifier_threshold`` means the completion is correct (pass@k, solve rates, length by
    outcome; the component GRPORewardHackSuspected reads); without it those metrics are absent. A monitor you
    hand in that disagrees with TRL's config on these is reported at start. ``regression_eval``: TRL's
    ``eval_dataset`` is a mastered-prompt regression set (a small fixed set of prompts the policy solves; seed
    第 4 篇 4.3): each ``evaluate()`` is one ``observe_regression`` of the verifier's verdicts.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a trainer whose loop this mixin cannot read (loud, at class definition), naming what is
        missing: TRL's ``AsyncGRPOTrainer`` is no ``GRPOTrainer``, none of the methods wrapped here runs in it."""
        super().__init_subclass__(**kwargs)
        if issubclass(cls, GRPOTrainer):
            return
        bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in cls.__mro__[1:] if b not in (object, cls))
        if any(b.__name__ == "AsyncGRPOTrainer" for b in cls.__mro__):
            raise IntegrationError(
                f"{cls.__qualname__}: TRL's AsyncGRPOTrainer is not monitored. Its rollouts come from a vLLM "
                "server's rollout worker and its loss reads tree-packed segments (compute_loss's token_index and "
                "segment_id), so none of the GRPOTrainer methods this adapter reads (_generate, "
                "_generate_and_score_completions, _compute_loss) runs; its old log-probs are the engine's, so no "
                "engine gap could be read either. Monitor trl.GRPOTrainer with use_vllm=True "
                "(vllm_mode='server' for a separate engine), or call GRPOMonitor.observe_rollout / observe_update "
                "from your own loop (docs/integrations.md).")
        raise IntegrationError(
            f"{cls.__qualname__}: GRPOMonitorMixin wraps methods of trl.GRPOTrainer; mix it in before a GRPOTrainer "
            f"subclass (class {cls.__qualname__}(GRPOMonitorMixin, GRPOTrainer)), got the bases {bases}")

    def __init__(
        self,
        *args: Any,
        monitor: GRPOMonitor | None = None,
        monitor_settings: Mapping[str, Any] | None = None,
        verifier: str | None = None,
        verifier_threshold: float = 0.5,
        regression_eval: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        names = list(self.reward_func_names)
        if verifier is not None and verifier not in names:
            raise ValueError(f"verifier: expected one of the reward function names {names}, got {verifier!r}")
        if regression_eval and verifier is None:
            raise ValueError("regression_eval: the regression set's accuracy needs a verifier (the name of the reward "
                             "function that says a completion is correct), got verifier=None")
        self._grpo_regression_eval = bool(regression_eval)
        self._grpo_regression = None
        self._grpo_verifier = verifier
        self._grpo_threshold = float(verifier_threshold)
        self._grpo_owns_monitor = monitor is None
        norm = advantage_norm(self.args)
        loss = loss_settings(self.args, self.epsilon_low, self.epsilon_high)
        stale = implied_staleness(self.args)
        if monitor is None:
            run = self.args.run_name or Path(self.args.output_dir or "trl").name
            settings = {
                "run": run, "group_size": self.num_generations, **loss, **engine_settings(self.args),
                "kl_coef": float(self.args.beta),
                **({"advantage_norm": norm} if norm else {}),
                **({"staleness_max_versions": stale} if stale > _STALENESS_LINE else {}),
                **({"correctness_component": verifier} if verifier else {}), **(monitor_settings or {}),
            }
            tok = self.processing_class
            # the text of the flight recorder's and the reading set's rows
            decode = (lambda ids: tok.decode(ids)) if hasattr(tok, "decode") else None
            monitor = GRPOMonitor(**settings, decode=decode)
        say_what_differs(self.args, monitor, self._grpo_owns_monitor, norm, loss, verifier,
                          bool(self.args.use_vllm or self.rollout_func))
        self.monitor = monitor
        self._grpo_preflight = False
        self._grpo_rollout_step = None
        self._grpo_generated = None
        self._grpo_tools = None
        self._grpo_rewards = None
        self._grpo_capture = None
        self._grpo_warned_no_grad_norm = False
        self._grpo_pending = []
        self._grpo_old_rows = []
        self._grpo_per_step = generations_per_step(self.args)
        self.add_callback(_EndStep(self))


class MonitoredGRPOTrainer(GRPOMonitorMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` publishing the seed's health metrics; see :class:`GRPOMonitorMixin` for the extra
    keywords (``monitor``, ``monitor_settings``, ``verifier``, ``verifier_threshold``)."""


__all__ = ["LOSS_CLIP", "TESTED", "TRL_METRICS", "GRPOMonitorMixin", "MonitoredGRPOTrainer", "concatenate_rollouts",
           "prompt_key"]
