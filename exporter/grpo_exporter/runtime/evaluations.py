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
    """Retrieval accuracy of ``scores`` (N, P) against ``own_prompt`` (N,), and chance 1/P beside it."""
    if scores.dim() != 2 or own_prompt.shape != scores.shape[:1]:
        raise ValueError(f"`scores`/`own_prompt`: expected (N, P) and (N,), got {tuple(scores.shape)} and "
                         f"{tuple(own_prompt.shape)}")
    r = retrieval_accuracy(scores, own_prompt)
    value, present = torch.stack([r.value.double(), r.present.double()]).tolist()
    accuracy = catalog.metric("grpo_retrieval_accuracy_ratio")
    gauges: dict[str, float] = {catalog.key("grpo_retrieval_chance_ratio"): 1.0 / scores.shape[1]}
    if present:
        gauges[accuracy.key()] = value
    return Evaluation({}, gauges, (accuracy.name,))


def regression(correct: Tensor) -> Evaluation:
    """One evaluation of the mastered-prompt regression set (seed 第 4 篇 4.3, "monitor forgetting"): counted,
    its accuracy (correct / N) and size; the runtime anchors the accuracy's first evaluations."""
    expected = "a non-empty (N,) tensor of bool or 0/1 values, one per completion of the regression set"
    if not isinstance(correct, Tensor) or correct.dim() != 1 or correct.numel() == 0 or correct.is_complex():
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
