"""Stitching the micro-steps of one optimizer step into one computation.

Gradient accumulation hands the monitor several ``observe_update`` calls per optimizer step. They are kept
(detached: no autograd graph is held) until the step ends, then concatenated and computed in one pass with
one host transfer. The step ends at ``clip_grad_norm_``, ``end_step()``, ``flush``/``close``, or an
``observe_update`` of another step number; a rollout never ends an update step, so an asynchronous pipeline
that samples rollout k+1 while update k runs keeps its steps whole.

* ``on_policy`` is per micro-step: the on-policy ratio check runs on the rows of the micro-steps flagged
  (every micro-step of the first optimizer step on a fresh rollout is on-policy; the flag of one micro-step
  never switches the check off for the others).
* Scalars that frameworks compute themselves (``grad_norm_pre_clip``, ``grad_norm_post_clip``,
  ``max_grad_norm``, ``loss``, ``entropy_mean``,
  policy versions) pass through: the last value given in the step wins, and
  ``clip_grad_norm_``'s own record wins over them.
* At most ``max_pending`` micro-steps are held; further ones are dropped and counted, so a step that never
  ends cannot grow without bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.inputs import StepInputs, fields_where

PER_ROW = fields_where(stitched="rows")  # joined along N (token fields padded to the widest T)
PASSED_THROUGH = fields_where(stitched="last")  # the last micro-step that gives one


class StepStitcher:
    """The pending micro-steps of the current optimizer step."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.step: int | None = None
        self.pending: list[StepInputs] = []
        self.grad: dict[str, Any] = {}
        self.open = False  # an update call (even a failed one) happened in this step: the step must end
        self.failed = False  # a micro-step of this step was rejected: merged across ranks, the step is absent

    def begin(self, step: int) -> bool:
        """Whether an update call of ``step`` ends the pending step (it has another step number)."""
        return self.open and self.step is not None and step != self.step

    def add(self, step: int, inputs: StepInputs) -> bool:
        """Hold a micro-step (detached); False when it was dropped for the bound."""
        self.step, self.open = step, True
        if len(self.pending) >= self.max_pending:
            return False
        self.pending.append(_detached(inputs))
        return True

    def mark(self, step: int) -> None:
        """An update call of ``step`` whose inputs could not be read: the step still ends like the others."""
        self.step, self.open = step, True

    def record_grad(self, values: Mapping[str, Any]) -> None:
        self.grad = dict(values)
        self.open = True

    def take(self) -> StepInputs | None:
        """Reset, and return the step's stitched inputs (None when no update happened since the last take).
        Raises if the micro-steps cannot be stitched (the state is reset all the same)."""
        if not self.open:
            return None
        parts, grad = self.pending, self.grad
        self.pending, self.grad, self.open, self.failed = [], {}, False, False
        return concatenate(parts, grad)


def concatenate(parts: list[StepInputs], grad: Mapping[str, Any]) -> StepInputs:
    """One StepInputs for the micro-steps of an optimizer step: per-row fields concatenated (token fields
    padded to the widest T with masked-out padding; a field missing from any micro-step is dropped),
    ``on_policy`` as a per-row mask of the flagged micro-steps, scalars passed through."""
    fields: dict[str, Any] = {}
    rows = [p for p in parts if p.n is not None]  # a scalars-only call (a framework's grad norm) has no rows
    if rows:
        width = max((p.loss_mask.shape[1] for p in rows if p.loss_mask is not None), default=0)
        for name in PER_ROW:
            values = [getattr(p, name) for p in rows]
            if any(v is None for v in values):
                continue
            fields[name] = _joined([_pad(v, width) for v in values])
        if any(p.on_policy is True or isinstance(p.on_policy, Tensor) for p in rows):
            fields["on_policy"] = torch.cat([_rows(p) for p in rows])
    if parts:
        for name in PASSED_THROUGH:
            given = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            if given:
                fields[name] = given[-1]
    fields.update(grad)
    fields["value_errors"] = tuple(check for p in parts for check in p.value_errors)
    return StepInputs(**fields)


def _joined(values: list[Tensor]) -> Tensor:
    """The rows of ``values`` one after another: a view when they already lie so in one tensor's memory
    (micro-batches sliced or chunked from one batch tensor, as verl's ``chunk`` and TRL's slices hand them),
    else a copy. The view saves a copy of each (N, T) input per step (6 MB per fp32 input at 1M loss tokens)."""
    first = values[0]
    if len(values) == 1:
        return first
    if first.dim() == 0 or first.stride(0) == 0:
        return torch.cat(values)
    rows, offset = first.shape[0], first.storage_offset()
    for v in values[1:]:
        if (v.dtype != first.dtype or v.device != first.device or v.shape[1:] != first.shape[1:]
                or v.stride() != first.stride()
                or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or v.storage_offset() != offset + rows * first.stride(0)):
            return torch.cat(values)
        rows += v.shape[0]
    return first.as_strided((rows, *first.shape[1:]), first.stride(), offset)


def _rows(part: StepInputs) -> Tensor:
    flag = part.on_policy
    if isinstance(flag, Tensor):
        return flag
    return torch.full((part.n or 0,), flag is True, dtype=torch.bool, device=part.device)


def _detached(inputs: StepInputs) -> StepInputs:
    changes = {name: v.detach() for name, v in vars(inputs).items() if isinstance(v, Tensor) and v.requires_grad}
    return inputs.replaced(**changes) if changes else inputs


def _pad(value: Tensor, width: int) -> Tensor:
    if value.dim() != 2 or value.shape[1] == width:
        return value
    fill = False if value.dtype == torch.bool else 0
    return torch.nn.functional.pad(value, (0, width - value.shape[1]), value=fill)
