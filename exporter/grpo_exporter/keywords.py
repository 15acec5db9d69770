"""The step-field keywords of GRPOMonitor's two observe calls, typed once for the type checker.

Which call takes which field is said by the input field table (:data:`grpo_exporter.input_fields.FIELDS`, its
``rollout`` and ``update`` columns); the run-time check of a call's keywords reads the table, and a test holds
these TypedDicts to it (same names, the :class:`~grpo_exporter.inputs.StepInputs` types).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from grpo_exporter.input_fields import fields_where

if TYPE_CHECKING:
    from torch import Tensor

ROLLOUT_FIELDS = frozenset(fields_where(rollout=True))
UPDATE_FIELDS = frozenset(fields_where(update=True))


class RolloutFields(TypedDict, total=False):
    """``observe_rollout``'s step fields: (N,) per completion, (N, T) per token; ``group_ids`` may also be a
    sequence of strings or integers (hashed stably, :mod:`grpo_exporter.ids`)."""

    rewards: Tensor | None
    group_ids: Tensor | Sequence[Any] | None
    correct: Tensor | None
    truncated: Tensor | None
    reward_components: Mapping[str, Tensor] | None
    rollout_logprobs: Tensor | None
    old_logprobs: Tensor | None
    loss_mask: Tensor | None
    completion_lengths: Tensor | None
    completion_ids: Tensor | None
    completion_mask: Tensor | None
    tool_mask: Tensor | None
    turns: Tensor | None
    partial: Tensor | None
    routed_experts: Tensor | None
    rollout_routed_experts: Tensor | None
    routing_replay: bool | None
    tool_calls: int | None
    tool_failures: int | None
    aborted_completions: int | None
    generated_groups: int | None
    filtered_all_correct_groups: int | None
    filtered_all_incorrect_groups: int | None


class UpdateFields(TypedDict, total=False):
    """``observe_update``'s step fields, one optimizer micro-step's."""

    rewards: Tensor | None
    correct: Tensor | None
    truncated: Tensor | None
    group_ids: Tensor | None
    completion_lengths: Tensor | None
    logprobs: Tensor | None
    old_logprobs: Tensor | None
    rollout_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    entropy: Tensor | None
    loss_mask: Tensor | None
    completion_mask: Tensor | None
    tool_mask: Tensor | None
    completion_ids: Tensor | None
    advantages: Tensor | None
    on_policy: bool | Tensor | None
    grad_norm_pre_clip: Tensor | float | None
    grad_norm_post_clip: Tensor | float | None
    max_grad_norm: Tensor | float | None
    loss: Tensor | float | None
    entropy_mean: Tensor | float | None
    policy_version: int | None
    rollout_policy_version: int | None
    staleness: Tensor | None
    grads: Sequence[Tensor] | None


#: the step fields each observe call takes, from the table
ACCEPTED = {"observe_rollout": ROLLOUT_FIELDS, "observe_update": UPDATE_FIELDS}
#: their types, for the type checker and the metric reference
TYPED = {"observe_rollout": RolloutFields, "observe_update": UpdateFields}


def check_keywords(call: str, given: Mapping[str, object]) -> None:
    """An unknown keyword raises ``TypeError`` naming it and what ``call`` accepts, as Python would."""
    unknown = sorted(set(given) - ACCEPTED[call])
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {unknown}; accepted: {sorted(ACCEPTED[call])}")
