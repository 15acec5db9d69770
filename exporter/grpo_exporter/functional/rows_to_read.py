"""The rollouts to read before the curves: which rows of a rollout batch each kind of page needs, chosen on the
tensors' device without a host read.

Seed: 读原文在读曲线之前 (read the raw rollouts before the curves: a 3-minute read classifies what the curves take half
an hour to), and for a suspected reward hack 人工阅读 reward 最高和增长最快的样本 (read the highest-reward and
fastest-rising samples by hand). The quick read looks for reward hacking (well-formed answers that skirt the task),
mass truncation (answers cut mid-sentence) and gibberish or repetition. One pick per kind:

* ``highest_reward``: the highest total reward (layer 2).
* ``rising_component``: the largest in-group excess of the component whose mean rose fastest (chosen by the
  caller): the rows that component pushes above their siblings, i.e. what the gradient is being paid for.
* ``truncated``: truncated completions (truncation).
* ``repeated_groups``: one row per group, the groups whose most repeated completion has the most copies (layer 4).
* ``lowest_entropy_groups``: one row per group (its lowest-entropy row), the groups of lowest mean entropy (layer 4).
* ``control``: rows spread pseudo-randomly over the batch (a different spread each step), the reading's control.

Every pick is ``k`` slots of (row, score, detail); a slot whose score is -inf holds no row (fewer rows than
``k`` qualify). Pure: tensors in, tensors out, no host sync, no RNG state touched.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter.functional.groups import Groups, group_stats

KINDS = ("highest_reward", "rising_component", "truncated", "repeated_groups", "lowest_entropy_groups", "control")
_MIX_STEP, _MIX_SLOT = 0x9E3779B1, 0x85EBCA77  # odd constants: the control rows' per-step spread


class Pick(NamedTuple):
    """``k`` slots of one kind: ``rows`` (k,) int64, ``score`` (k,) fp64 (-inf: empty slot), ``detail`` (k,) fp64
    (the kind's second number: copies in the group, the group's mean entropy; 0 otherwise)."""

    rows: Tensor
    score: Tensor
    detail: Tensor


def _top(score: Tensor, k: int) -> Pick:
    """The ``k`` highest-scoring entries (fewer than ``k``: the rest empty)."""
    n = score.shape[0]
    top = torch.topk(score, min(k, n))
    rows, best = top.indices, top.values
    found = torch.zeros_like(best)
    if n < k:
        pad = k - n
        rows = torch.cat([rows, rows.new_zeros(pad)])
        best = torch.cat([best, best.new_full((pad,), -math.inf)])
        found = torch.cat([found, found.new_zeros(pad)])
    return Pick(rows, best, found)


def _excluding_nan(values: Tensor) -> Tensor:
    """fp64 scores, -inf where not finite."""
    x = values.double()
    return torch.where(torch.isfinite(x), x, -math.inf)


def highest_reward(rewards: Tensor, groups: Groups, k: int) -> Pick:
    """The highest total rewards, one row per group (``k`` prompts, not one prompt's siblings)."""
    score = _excluding_nan(rewards)
    return _per_group(score, torch.isfinite(score), groups, k, torch.zeros_like(score))


def rising_component(component: Tensor, groups: Groups, k: int) -> Pick:
    """Rows by ``component`` minus its group's mean (finite entries; the statistics the reward blocks took of this
    tensor): the excess the advantage rewards, one row per group. Only rows above their group's mean qualify."""
    valid = torch.isfinite(component)
    excess = torch.where(valid, component.double(), 0.0) - group_stats(component, groups).mean[groups.index]
    return _per_group(excess, valid & (excess > 0), groups, k, torch.zeros_like(excess))


def truncated_rows(truncated: Tensor, groups: Groups, k: int) -> Pick:
    """Truncated rows, one per group (each step's pick is a sample; the reading set keeps the latest)."""
    hit = truncated.bool()
    return _per_group(torch.zeros(hit.shape, dtype=torch.float64, device=hit.device), hit, groups, k,
                      torch.zeros(hit.shape, dtype=torch.float64, device=hit.device))


def _per_group(row_score: Tensor, valid: Tensor, groups: Groups, k: int, detail: Tensor,
               rank: Tensor | None = None) -> Pick:
    """Per group its best row (highest ``row_score``, the first on a tie); the ``k`` groups of highest ``rank``
    (per group; default that best row's score)."""
    n = row_score.shape[0]
    score = torch.where(valid, row_score.double(), -math.inf)
    best = groups.amax(score, valid)
    is_best = valid & (score == best[groups.index])
    order = torch.arange(n, device=score.device)
    rep = torch.full((groups.bins,), n, dtype=torch.int64, device=score.device)
    rep = rep.scatter_reduce(0, groups.index, torch.where(is_best, order, n), reduce="amin")
    picked = _top(torch.where(rep < n, best if rank is None else rank, -math.inf), k)
    rows = rep[picked.rows].clamp(max=max(n - 1, 0))
    return Pick(rows, picked.score, detail[rows])


def repeated_groups(copies: Tensor, groups: Groups, k: int) -> Pick:
    """The groups whose most repeated completion has the most copies (at least 2), one row each: that
    completion. Detail: its copies."""
    detail = copies.double()
    return _per_group(detail, copies >= 2, groups, k, detail)


def row_entropy(per_token: Tensor, tokens: Tensor, sign: float = 1.0) -> Tensor:
    """(N,) fp64 mean of ``sign`` x ``per_token`` (nats) over each row's ``tokens``; NaN for a row without one, or
    with a non-finite value on one (left out of the pick). ``per_token`` is the policy's entropy (``sign`` 1), or
    the sampled tokens' log p (``sign`` -1: -log p, the entropy's unbiased estimate). Three passes over (N, T)."""
    total = torch.where(tokens, per_token, 0.0).sum(1, dtype=torch.float64)
    count = tokens.sum(1)
    return torch.where(count > 0, sign * total / count.clamp(min=1), math.nan)


def lowest_entropy_groups(entropy: Tensor, groups: Groups, k: int) -> Pick:
    """The groups of lowest mean row entropy, one row each (its lowest-entropy row). Score: minus the group's
    mean entropy; detail: the group's mean entropy (nats)."""
    valid = torch.isfinite(entropy)
    x = torch.where(valid, entropy, 0.0)
    mean = groups.sum(x) / groups.count(valid).clamp(min=1).double()
    return _per_group(-x, valid, groups, k, mean[groups.index], rank=-mean)


def control_rows(n: int, k: int, step: int, device: torch.device) -> Pick:
    """``k`` rows spread over ``0..n-1`` by a multiplicative hash of the step and slot: a different spread each
    step, the same in every run (no RNG state is read or advanced: the training's random stream is its own)."""
    slot = torch.arange(1, k + 1, device=device, dtype=torch.int64)
    rows = (slot * _MIX_SLOT + (step % (1 << 31)) * _MIX_STEP) % max(n, 1)
    score = torch.zeros(k, dtype=torch.float64, device=device) if n else torch.full(
        (k,), -math.inf, dtype=torch.float64, device=device)
    return Pick(rows, score, torch.zeros_like(score))


__all__ = ["KINDS", "Pick", "control_rows", "highest_reward", "lowest_entropy_groups",
           "repeated_groups", "rising_component", "row_entropy", "truncated_rows"]
