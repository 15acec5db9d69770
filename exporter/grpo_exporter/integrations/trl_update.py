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


class UpdateReading(TrainerBase):
    """The update side of :class:`GRPOMonitorMixin`: each micro-batch's log-probs, entropies, advantages and masks
    (one ``observe_update``) and the norm TRL clips with."""

    monitor: GRPOMonitor
    _grpo_preflight: bool
    _grpo_rollout_step: int | None
    _grpo_capture: list[tuple[Tensor, Tensor | None]] | None  # the micro-batch's log-probs and entropies
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
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        if self.off_policy_mask_threshold is not None:
            mask = mask & self._off_policy_kept(inputs, logprobs, mask)
        rollout_step = self._grpo_rollout_step
        self.monitor.observe_update(
            step,
            logprobs=logprobs.detach(),
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps"),
            advantages=inputs["advantages"],
            loss_mask=mask,
            entropy=entropy.detach() if entropy is not None else None,
            on_policy=rollout_step == step,
            loss=loss.detach(),
            policy_version=step if rollout_step is not None else None,
            rollout_policy_version=rollout_step,
        )

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
