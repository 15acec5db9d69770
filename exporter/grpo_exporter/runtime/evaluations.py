"""The readings of the evaluations a loop runs every K steps beside training, outside the step's stages:
retrieval accuracy and the mastered-prompt regression set. Rank-local (the caller evaluates on one rank); each
is read to the host once, here, and returned as sample key -> value for the runtime to publish."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.functional.diversity import retrieval_accuracy
from grpo_exporter.inputs import InputError, describe, not_binary


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation publishes: counter ``increments``, ``gauges``, and the gauge families it owns (an
    owned family absent from ``gauges`` is removed, not left at its last value)."""

    increments: dict[str, float]
    gauges: dict[str, float]
    families: tuple[str, ...] = ()


def retrieval(scores: Tensor, own_prompt: Tensor) -> Evaluation:
    """Retrieval accuracy of ``scores`` (N, P) against ``own_prompt`` (N,), and chance 1/P beside it. The
    columns in ``own_prompt`` are checked with the one host read (an index outside 0..P-1 names the field)."""
    if not isinstance(scores, Tensor) or scores.dim() != 2 or scores.shape[1] < 2 or not scores.is_floating_point() \
            or scores.is_meta:
        raise InputError("scores", "an (N, P) floating-point tensor of P >= 2 prompts' scores (with data)",
                         describe(scores))
    if not isinstance(own_prompt, Tensor) or own_prompt.shape != scores.shape[:1] or own_prompt.is_floating_point() \
            or own_prompt.dtype == torch.bool or own_prompt.is_complex() or own_prompt.device != scores.device:
        raise InputError("own_prompt", f"an (N,) = ({scores.shape[0]},) integer tensor of column indices on "
                         f"{scores.device}, like `scores`", describe(own_prompt))
    columns = scores.shape[1]
    outside = (own_prompt < 0) | (own_prompt >= columns)
    r = retrieval_accuracy(scores, own_prompt.clamp(0, columns - 1))
    value, present, invalid = torch.stack([r.value.double(), r.present.double(), outside.sum().double()]).tolist()
    if invalid:
        raise InputError("own_prompt", f"column indices in 0..{columns - 1} (P = {columns} prompts)",
                         f"{int(invalid)} of its {own_prompt.numel()} indices outside")
    accuracy = catalog.metric("grpo_retrieval_accuracy_ratio")
    gauges: dict[str, float] = {catalog.key("grpo_retrieval_chance_ratio"): 1.0 / columns}
    if present:
        gauges[accuracy.key()] = value
    return Evaluation({}, gauges, (accuracy.name,))


def regression(correct: Tensor) -> Evaluation:
    """One evaluation of the mastered-prompt regression set (seed 第 4 篇 4.3, "monitor forgetting"): counted,
    its accuracy (correct / N) and size; the runtime anchors the accuracy's first evaluations."""
    expected = "a non-empty (N,) tensor of bool or 0/1 values, one per completion of the regression set"
    if not isinstance(correct, Tensor) or correct.dim() != 1 or correct.numel() == 0 or correct.is_complex() \
            or correct.is_meta:
        raise InputError("correct", expected, describe(correct))
    values = correct.double()
    hits, invalid = torch.stack([values.sum(), not_binary(values).double()]).tolist()
    n = correct.numel()
    if invalid:
        raise InputError("correct", expected, f"{int(invalid)} of its {n} values neither 0 nor 1 (NaN included)")
    return Evaluation(
        {catalog.key("grpo_regression_completions_total"): float(n),
         catalog.key("grpo_regression_correct_completions_total"): hits},
        {catalog.key("grpo_regression_accuracy_ratio"): hits / n,
         catalog.key("grpo_regression_evaluated_completions"): float(n)},
    )
