"""Preflight checks: the seed's cheap 0/1 tests that come before any curve (第 6 篇 (crash triage) 第 1 / 1.5 / 2 步).

Each takes the user's model and engine as callables and returns a report with its numbers, a pass/fail
verdict and a diagnosis naming what to fix:

* :func:`abc_consistency` - trainer log-probs twice (A, B) and the engine's once (C) on the same tokens with
  frozen weights: A = B proves the trainer repeatable, and the hard criterion: with no update, the ratio
  exp(A - C) must not already sit outside the clip range.
* :func:`accumulation_equivalence` - one batch against accumulated micro-batches: cosine, relative norm
  difference, parameter delta after one optimizer step, and integer-multiple ratios that mark a scaling bug.
* :func:`nll_reach` - plain NLL on completion tokens must fall by a stated factor within a stated number of
  steps: the gradient reaches the parameters at all.
* :func:`mask_table` - one sample, token by token (position, token, source, attention mask, loss mask,
  advantage), with the runtime assertions on the loss mask.
"""

from grpo_exporter.checks.accumulation import AccumulationReport, accumulation_equivalence
from grpo_exporter.checks.consistency import ABCReport, abc_consistency
from grpo_exporter.checks.mask_table import MaskRow, MaskTableReport, mask_table
from grpo_exporter.checks.reach import ReachReport, nll_reach

__all__ = [
    "ABCReport",
    "AccumulationReport",
    "MaskRow",
    "MaskTableReport",
    "ReachReport",
    "abc_consistency",
    "accumulation_equivalence",
    "mask_table",
    "nll_reach",
]
