"""The update side of :class:`~grpo_exporter.integrations.trl.GRPOMonitorMixin`: each micro-batch's log-probs,
entropies, advantages and masks (one ``observe_update``, from ``_compute_loss``) and the pre-clip norm TRL clips
with (``Trainer._get_grad_norm``). Imported by :mod:`grpo_exporter.integrations.trl`, which checks the wrapped
methods' signatures against the tested TRL range first."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.runtime.monitor import GRPOMonitor

logger = logging.getLogger("grpo_exporter")

#: what the mixin's methods read and call: the GRPOTrainer it is mixed into (typed loosely: TRL's own
#: annotations leave model, processing_class and args' GRPO fields optional or untyped)
TrainerBase: Any = object

#: the keys the adapter adds to each training generation batch, carried through TRL's shuffle and split
#: (``_prepare_inputs``: ``shuffle_sequence_dict``, ``split_tensor_dict``) with the rows: each row's group id
#: (its global row index // ``num_generations``, numbered after the step's earlier generation batches), its
#: place in the step's rollout (for the trainer log-probs the loss's forward gives) and its reward
GROUP_KEY = "grpo_exporter_group_ids"
ROW_KEY = "grpo_exporter_rows"
#: each row's total reward, as the rollout observed it: the update's advantages are checked against it
REWARD_KEY = "grpo_exporter_rewards"


class UpdateReading(TrainerBase):
    """The update side of :class:`GRPOMonitorMixin`: each micro-batch's log-probs, entropies, advantages and masks
    (one ``observe_update``) and the norm TRL clips with."""

    monitor: GRPOMonitor
    _grpo_preflight: bool
    _grpo_rollout_step: int | None
    _grpo_capture: list[tuple[Tensor, Tensor | None]] | None  # the micro-batch's log-probs and entropies
    _grpo_old_rows: list[tuple[Tensor, Tensor]]  # rows and loss-forward log-probs, where TRL computes no old ones
    _grpo_warned_no_grad_norm: bool

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._grpo_capture is not None:
            self._grpo_capture.append((result[0], result[1]))
        return result

    def _compute_loss(self, model: Any, inputs: Mapping[str, Any]) -> Tensor:
        self._grpo_capture = [] if self.model.training and not self._grpo_preflight else None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            captured, self._grpo_capture = self._grpo_capture, None
        if captured:
            with self.monitor.contained("update", "trl _compute_loss"):
                self._observe_update(inputs, captured[0], loss)
        return loss

    def _observe_update(self, inputs: Mapping[str, Any], captured: tuple[Tensor, Tensor | None], loss: Tensor) -> None:
        step = int(self.state.global_step)
        logprobs, entropy = captured
        trained = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            trained = trained & inputs["tool_mask"].bool()
        mask = trained
        if self.off_policy_mask_threshold is not None:
            mask = mask & self._off_policy_kept(inputs, logprobs, trained)
        corrected = self._correction_kept(inputs)
        if corrected is not None:
            mask = mask & corrected
        narrowed = mask is not trained  # the update's mask audit then counts the sequences dropped whole
        if ROW_KEY in inputs and "old_per_token_logps" not in inputs and "sampling_per_token_logps" in inputs:
            self._grpo_old_rows.append((inputs[ROW_KEY], logprobs.detach()))
        rollout_step = self._grpo_rollout_step
        self.monitor.observe_update(
            step,
            logprobs=logprobs.detach(),
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps"),
            advantages=inputs["advantages"],
            loss_mask=mask,
            group_ids=self._update_groups(inputs),
            rewards=inputs.get(REWARD_KEY),
            entropy=entropy.detach() if entropy is not None else None,
            on_policy=rollout_step == step,
            loss=loss.detach(),
            policy_version=step if rollout_step is not None else None,
            rollout_policy_version=rollout_step,
            completion_lengths=self._narrowed_lengths(trained, mask) if narrowed else None,
            completion_mask=inputs["completion_mask"].bool() if narrowed else None,
        )

    def _update_groups(self, inputs: Mapping[str, Any]) -> Tensor | None:
        """(B,) the micro-batch's group ids, carried through TRL's shuffle (:data:`GROUP_KEY`). Where several of
        the ``num_iterations`` passes over a generation batch fall in one optimizer step, each pass's rows form
        groups of their own (a group never holds a row twice). None without them (the preflight's batches)."""
        groups = inputs.get(GROUP_KEY)
        if groups is None:
            return None
        iterations = int(self.num_iterations)
        every = int(self.args.steps_per_generation) * iterations
        iteration = (int(self._step) % every) // int(self.args.steps_per_generation)
        return groups * iterations + iteration

    def _correction_kept(self, inputs: Mapping[str, Any]) -> Tensor | None:
        """(B, T) or (B, 1) bool: the tokens or sequences TRL's vLLM importance-sampling correction leaves in the
        loss. TRL multiplies each token's loss by ``importance_sampling_ratio``, which its ``*_mask`` modes set
        to 0 outside [``vllm_importance_sampling_clip_min``, ``vllm_importance_sampling_clip_max``] (per token,
        or the whole sequence under the default ``sequence_mask``); a zero weight trains nothing, so those are
        no loss tokens here. VESPO folds the ratio into its sequence weight instead (a masked token shrinks the
        sequence's weight, not to 0): nothing is narrowed there. None without the correction."""
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is None or self.loss_type == "vespo":
            return None
        kept: Tensor = ratio != 0
        return kept

    @staticmethod
    def _narrowed_lengths(trained: Tensor, mask: Tensor) -> Tensor:
        """(B,) the lengths the update's mask audit reads where TRL's masks narrow the loss (off-policy, IS): a
        sequence they drop whole keeps its length in TRL's own mask, so it counts in
        grpo_loss_mask_empty_sequences_total (a reason, not an error; once per pass over it); any other keeps
        the count of its loss tokens, so a token-level drop is no length mismatch. TRL's own mask was audited
        against the generated lengths at the rollout; a sequence it emptied (truncation masking) has 0 here and
        is not counted twice."""
        kept = mask.sum(dim=1)
        return torch.where(kept > 0, kept, trained.sum(dim=1))

    def _off_policy_kept(self, inputs: Mapping[str, Any], logprobs: Tensor, mask: Tensor) -> Tensor:
        """(B, 1) bool: the sequences TRL's off-policy sequence mask (``off_policy_mask_threshold``, DeepSeek-V3.2)
        keeps in this micro-batch's loss, by TRL's own ``get_off_policy_mask`` on the same tensors
        ``_compute_loss`` gives it: the dropped sequences (negative advantage, mean KL above the threshold) train
        nothing, so they are no loss tokens here."""
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = logprobs.detach() if old is None else old
        sampling = inputs.get("sampling_per_token_logps", old)
        kept = self.get_off_policy_mask(
            advantages=advantages, per_token_logps=logprobs, sampling_per_token_logps=sampling,
            mask=mask.to(logprobs.dtype), off_policy_threshold=self.off_policy_mask_threshold,
        )
        return kept.bool()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """The norm Trainer logs as ``grad_norm``: the pre-clip norm with ``max_grad_norm > 0``, computed
        without clipping at ``max_grad_norm = 0`` (then no clip line is published). Under DeepSpeed it is
        the engine's ``get_global_grad_norm()``, None before its first step: no reading, not an error."""
        found = super()._get_grad_norm(model, grad_norm=grad_norm)
        with self.monitor.contained("grad", "trl _get_grad_norm"):
            if found is None:
                if not self._grpo_warned_no_grad_norm:
                    self._grpo_warned_no_grad_norm = True
                    logger.info("grpo_exporter: the trainer returned no grad norm (DeepSpeed before its first "
                                "step?): grpo_grad_norm_pre_clip is absent until it does")
                return found
            norm = found.detach() if isinstance(found, Tensor) else torch.tensor(float(found))
            limit = float(self.args.max_grad_norm)
            clip: dict[str, Any] = {"max_grad_norm": limit} if limit > 0 else {}
            self.monitor.observe_update(int(self.state.global_step), grad_norm_pre_clip=norm, **clip)
        return found
