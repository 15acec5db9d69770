"""The table of :class:`~grpo_exporter.inputs.StepInputs`' fields: how each is validated, how micro-steps join
it, and which observe call takes it as a keyword, with the bounds of the counts a call hands over.

Kept apart from the validation (:mod:`grpo_exporter.inputs`) because it needs no torch: the reference pages and
the CLI read it without importing torch."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldSpec:
    """How one :class:`StepInputs` field is validated and carried.

    ``axis``: ``"row"`` (N,), ``"token"`` (N, T), ``"row or token"`` (advantages), ``"scalar"`` (a number or
    one-element tensor), ``"integer"`` (a Python int in 0..:data:`MAX_INTEGER`: a step or a policy version),
    ``"count"`` (a Python int in 0..:data:`MAX_COUNT` the framework counted on the host), ``"tensors"`` (a
    sequence of tensors), ``"experts"`` (N, T, L, k): the k experts each token was routed to in each of L MoE
    layers, or ``"other"`` (validated on its own: the reward components, ``on_policy``, the value
    checks). ``kind``: ``"float"``, ``"bool"`` (bool, or 0/1 numbers stored as bool), ``"int"`` (any integers:
    ids) or ``"count"`` (integers in 0..:data:`MAX_ROW_COUNT`, checked on the device) for tensors; ``"norm"``
    for a scalar that is >= 0 (a negative tensor is counted on the device).
    ``stitched``: how micro-steps of one optimizer step join it (``"rows"`` concatenated along N, ``"last"`` the
    last given, ``""`` not by the stitcher). ``update``/``rollout``: accepted by ``observe_update``/
    ``observe_rollout`` as a keyword (:mod:`grpo_exporter.keywords` types them)."""

    axis: str
    kind: str = ""
    stitched: str = ""
    update: bool = True
    rollout: bool = False
    what: str = ""  # the expected value in an error message, when the kind's default does not say it


#: every StepInputs field, in validation order (sequence fields, then token fields, as N and T are learnt)
FIELDS: dict[str, FieldSpec] = {
    "rewards": FieldSpec("row", "float", "rows", rollout=True),
    "zero_variance_prob": FieldSpec("row", "float", update=False),
    "all_incorrect_prob": FieldSpec("row", "float", update=False),
    "correct": FieldSpec("row", "bool", "rows", rollout=True),
    "truncated": FieldSpec("row", "bool", "rows", rollout=True),
    "group_ids": FieldSpec("row", "int", "rows", what="an integer tensor", rollout=True),
    "completion_lengths": FieldSpec("row", "count", "rows", rollout=True),
    "turns": FieldSpec("row", "count", update=False, rollout=True),
    "partial": FieldSpec("row", "bool", update=False, rollout=True),
    "staleness": FieldSpec("row", "count", "rows"),
    "reward_components": FieldSpec("other", update=False, rollout=True),
    "logprobs": FieldSpec("token", "float", "rows"),
    "old_logprobs": FieldSpec("token", "float", "rows", rollout=True),
    "rollout_logprobs": FieldSpec("token", "float", "rows", rollout=True),
    "ref_logprobs": FieldSpec("token", "float", "rows"),
    "entropy": FieldSpec("token", "float", "rows"),
    "loss_mask": FieldSpec("token", "bool", "rows", rollout=True),
    "completion_mask": FieldSpec("token", "bool", "rows", rollout=True),
    "tool_mask": FieldSpec("token", "bool", "rows", rollout=True),
    "completion_ids": FieldSpec("token", "int", "rows", what="an integer tensor of token ids", rollout=True),
    "advantages": FieldSpec("row or token", "float", "rows"),
    "routed_experts": FieldSpec("experts", "int", update=False, rollout=True, what="an integer tensor of expert ids"),
    "rollout_routed_experts": FieldSpec("experts", "int", update=False, rollout=True,
                                        what="an integer tensor of expert ids"),
    "routing_replay": FieldSpec("other", update=False, rollout=True),
    "on_policy": FieldSpec("other"),
    "grad_norm_pre_clip": FieldSpec("scalar", "norm", stitched="last"),
    "grad_norm_post_clip": FieldSpec("scalar", "norm", stitched="last"),
    "max_grad_norm": FieldSpec("scalar", "norm", stitched="last"),
    "loss": FieldSpec("scalar", stitched="last"),
    "entropy_mean": FieldSpec("scalar", stitched="last"),
    "policy_version": FieldSpec("integer", stitched="last"),
    "rollout_policy_version": FieldSpec("integer", stitched="last"),
    "step": FieldSpec("integer", update=False),
    "tool_calls": FieldSpec("count", update=False, rollout=True),
    "tool_failures": FieldSpec("count", update=False, rollout=True),
    "aborted_completions": FieldSpec("count", update=False, rollout=True),
    "generated_groups": FieldSpec("count", update=False, rollout=True),
    "filtered_all_correct_groups": FieldSpec("count", update=False, rollout=True),
    "filtered_all_incorrect_groups": FieldSpec("count", update=False, rollout=True),
    "grads": FieldSpec("tensors"),
    "params_before": FieldSpec("tensors", update=False),
    "params_after": FieldSpec("tensors", update=False),
    "value_errors": FieldSpec("other", update=False),
}


@functools.cache
def fields_where(axis: str | None = None, kind: str | None = None, stitched: str | None = None,
                 update: bool | None = None, rollout: bool | None = None) -> tuple[str, ...]:
    """The field names whose spec matches every given attribute, in table order (made once per query: the
    validation of every step asks the same few)."""
    wanted = {"axis": axis, "kind": kind, "stitched": stitched, "update": update, "rollout": rollout}
    return tuple(name for name, spec in FIELDS.items()
                 if all(value is None or getattr(spec, key) == value for key, value in wanted.items()))


SEQUENCE_FLOATS = fields_where("row", "float")
SEQUENCE_BOOLS = fields_where("row", "bool")
TOKEN_FLOATS = fields_where("token", "float")
TOKEN_BOOLS = fields_where("token", "bool")
SCALARS = fields_where("scalar")
INTEGERS = fields_where("integer")
COUNTS = fields_where("count")

#: the largest step number or policy version: 2^53 - 1, the largest integer a float (the exposition's number, the
#: ``grpo_last_step`` gauge) holds exactly
MAX_INTEGER = 2**53 - 1
#: the largest count one call hands over (tool calls, groups generated or filtered, completions aborted or
#: dropped): 2^40, about 1.1e12, beyond any batch or run, so that a wrong number never sits in a counter for good
MAX_COUNT = 2**40
#: the largest per-completion count (tokens, turns, policy versions of staleness): 2^24, the largest integer fp32
#: holds exactly (their maxima and quantiles are read in fp32)
MAX_ROW_COUNT = 2**24
