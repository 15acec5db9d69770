"""The reference the bench compares against: the seed's per-step metrics written the obvious way, one metric at
a time, a host read per scalar, ``torch.quantile`` (one sort) per distribution.

:func:`naive_step` computes the monitor's metric set on the same inputs (every family the bench's step
publishes, with the catalogue's quantiles and classic histogram buckets); :func:`naive_core_step` only the
seed's core 47 values (layers 1-4, one or two readings each), the conservative comparison. The monitor's
off-thread edit distance and its solve-rate history (a Beta posterior per prompt) have no naive counterpart: the
naive expected zero-variance share plugs in each group's own solve rate.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.bench.workload import MICRO_BATCHES, G, Workload

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> list[float]:
    """All quantiles of one distribution from one ``torch.quantile`` call (one sort), read one by one."""
    return [v.item() for v in torch.quantile(values.double(), torch.tensor(qs, dtype=torch.float64))]


class _Tokens(NamedTuple):
    """What the core computes on the loss tokens and the rest of the metric set reads again (naive code keeps
    a value it already has; it does not take it twice)."""

    gap: Tensor
    log_ratio: Tensor
    ratio: Tensor
    adv_t: Tensor
    ent: Tensor
    group_std: Tensor
    solved: Tensor


def naive_core_step(w: Workload) -> dict[str, float]:
    """The seed's core metrics of one step, as naive code computes them (returns them so nothing is optimised
    away)."""
    return _core(w)[0]


def _core(w: Workload) -> tuple[dict[str, float], _Tokens]:
    out: dict[str, float] = {}
    if w.new_parts:  # each micro-batch's forward output: naive code concatenates them first, as the monitor does
        w = dataclasses.replace(w, new=torch.cat(w.new_parts), entropy=torch.cat(w.entropy_parts))
    gap, log_ratio, ratio = _layer_1(w, out)
    group_std = _layer_2(w, out)
    adv_t = _layer_3(w, out, ratio, group_std)
    ent, solved = _layer_4(w, out)
    out["micro_batches"] = float(MICRO_BATCHES)  # the step's grad norm, as naive code reads it
    return out, _Tokens(gap, log_ratio, ratio, adv_t, ent, group_std, solved)


def _layer_1(w: Workload, out: dict[str, float]) -> tuple[Tensor, Tensor, Tensor]:
    """Engine gap, non-finite values, on-policy ratio, clamp hits, mask mismatch; the masked gap, log ratio and
    ratio."""
    m = w.mask
    gap = (w.rollout - w.old).abs()[m]
    out["gap_mean"] = gap.mean().item()
    for q, v in zip((0.5, 0.99, 0.999, 1.0), _quantiles(gap, (0.5, 0.99, 0.999, 1.0)), strict=True):
        out[f"gap_q{q}"] = v
    for name, x in (("old", w.old), ("new", w.new), ("rollout", w.rollout), ("ref", w.ref), ("entropy", w.entropy)):
        out[f"nonfinite_{name}"] = (~torch.isfinite(x[m])).sum().item()
    out["nonfinite_adv"] = (~torch.isfinite(w.advantages)).sum().item()
    out["nonfinite_rewards"] = (~torch.isfinite(w.rewards)).sum().item()
    log_ratio = (w.new - w.old)[m]
    ratio = torch.exp(log_ratio)
    out["onpolicy_outside"] = ((ratio < 1 - EPS_LOW) | (ratio > 1 + EPS_HIGH)).float().mean().item()
    out["onpolicy_max_abs"] = log_ratio.abs().max().item()
    out["clamp_hits"] = (log_ratio.abs() > 20).sum().item()
    out["mask_mismatch"] = (m.sum(1) != w.lengths).sum().item()
    return gap, log_ratio, ratio


def _layer_2(w: Workload, out: dict[str, float]) -> Tensor:
    """Rewards, groups, advantages, lengths, truncation; the groups' reward std."""
    grouped = w.rewards.view(-1, G)
    out["reward_mean"] = w.rewards.mean().item()
    group_std = grouped.std(1)
    out["group_std"] = group_std.mean().item()
    out["group_range"] = (grouped.max(1).values - grouped.min(1).values).mean().item()
    out["adv_max"] = w.advantages.abs().max().item()
    out["adv_over_bound"] = (w.advantages.abs() > (G - 1) / G**0.5).sum().item()
    lengths = w.lengths.double()
    for outcome, rows in (("all", torch.ones_like(w.correct)), ("correct", w.correct), ("incorrect", ~w.correct)):
        if rows.sum().item() > 0:
            out[f"len_q99_{outcome}"] = torch.quantile(lengths[rows], 0.99).item()
            out[f"len_mean_{outcome}"] = lengths[rows].mean().item()
    out["truncated"] = w.truncated.sum().item()
    return group_std


def _layer_3(w: Workload, out: dict[str, float], ratio: Tensor, group_std: Tensor) -> Tensor:
    """Ratios, ESS, clipping by bound and sign, zero-variance groups; the tokens' advantages."""
    m = w.mask
    adv_t = w.advantages[:, None].expand_as(m)[m]
    for q, v in zip((0.0, 0.5, 0.95, 0.99, 1.0), _quantiles(ratio, (0.0, 0.5, 0.95, 0.99, 1.0)), strict=True):
        out[f"ratio_q{q}"] = v
    out["ess_token"] = (ratio.sum() ** 2 / (ratio.numel() * (ratio**2).sum())).item()
    seq = torch.exp(((w.new - w.old) * m).sum(1) / m.sum(1))
    out["ess_sequence"] = (seq.sum() ** 2 / (seq.numel() * (seq**2).sum())).item()
    pos, neg = adv_t > 0, adv_t < 0
    out["clip_upper"] = ((ratio > 1 + EPS_HIGH) & pos).sum().item() / max(pos.sum().item(), 1)
    out["clip_lower"] = ((ratio < 1 - EPS_LOW) & neg).sum().item() / max(neg.sum().item(), 1)
    out["zero_adv_tokens"] = (adv_t == 0).float().mean().item()
    out["zero_variance"] = (group_std == 0).float().mean().item()
    p = w.correct.view(-1, G).float().mean(1)
    out["zero_variance_expected"] = (p**G + (1 - p) ** G).mean().item()
    return adv_t


def _layer_4(w: Workload, out: dict[str, float]) -> tuple[Tensor, Tensor]:
    """Entropy, KL, pass@k, distinct completions; the masked entropy and the groups' outcomes."""
    m = w.mask
    ent = w.entropy[m]
    out["entropy_mean"] = ent.mean().item()
    k = max(1, int(0.2 * ent.numel()))
    out["entropy_top"] = torch.topk(ent, k).values.mean().item()
    d = (w.ref - w.new)[m]
    out["kl"] = (torch.exp(d) - d - 1).mean().item()
    solved = w.correct.view(-1, G)
    out["pass_1"] = solved.float().mean().item()
    out["pass_G"] = solved.any(1).float().mean().item()
    distinct = 0
    ids = torch.where(m, w.completion_ids, -1)
    for group in ids.view(-1, G, w.t):
        distinct += torch.unique(group, dim=0).shape[0]
    out["distinct"] = distinct / w.n
    return ent, solved


def _buckets(values: Tensor, family: str) -> list[float]:
    """A classic histogram's cumulative bucket counts (le each catalogue bound, then +Inf), one pass."""
    bounds = torch.tensor(catalog.metric(family).buckets, dtype=values.dtype)
    counts = torch.bincount(torch.bucketize(values, bounds), minlength=len(bounds) + 1)
    return [float(c) for c in counts.cumsum(0).tolist()]


def _naive_groups(solved: Tensor, group_std: Tensor) -> dict[str, float]:
    """The group readings, naively: zero-variance groups by composition, the solve-rate histogram, pass@k, and
    the advantage bound (G-1)/sqrt(G)."""
    out: dict[str, float] = {}
    hits = solved.sum(1)
    out["groups"] = float(hits.shape[0])
    same = group_std == 0
    out["zero_variance_all_correct"] = (same & (hits == G)).sum().item()
    out["zero_variance_all_incorrect"] = (same & (hits == 0)).sum().item()
    mixed = (hits > 0) & (hits < G)
    rate = hits[mixed].double() / G
    for bound in (*catalog.SOLVE_RATE_BUCKETS, float("inf")):
        out[f"solve_rate_le{bound}"] = (rate <= bound).sum().item()
    out["solve_rate_sum"] = rate.sum().item()
    out["solve_rate_count"] = float(rate.numel())
    for k in sorted({1, G}):
        misses = G - hits.double()
        fail = torch.ones_like(misses)
        for i in range(k):
            fail = fail * ((misses - i).clamp(min=0) / (G - i))
        out[f"pass_at_{k}"] = (1 - fail).mean().item()
    out["advantage_bound"] = (G - 1) / G**0.5
    return out


def naive_step(w: Workload) -> dict[str, float]:
    """The monitor's metric set for one step, as naive code computes it: the core (:func:`naive_core_step`)
    and everything else the monitor publishes for this step (sums and counts, classic buckets, counts by
    sign and bound, the mask audit by cause, pass@k, the solve-rate histogram, grad norms)."""
    out, shared = _core(w)
    m = w.mask
    gap, log_ratio, ratio, adv_t, ent = shared.gap, shared.log_ratio, shared.ratio, shared.adv_t, shared.ent
    out["gap_sum"] = gap.sum().item()
    out["gap_count"] = float(gap.numel())
    out |= {f"gap_le{i}": v for i, v in enumerate(_buckets(gap, "grpo_token_engine_logprob_gap_nats"))}
    out["nonfinite_log_ratio"] = (~torch.isfinite(log_ratio)).sum().item()
    out["nonfinite_ratio"] = (~torch.isfinite(ratio)).sum().item()
    outside = ((ratio < 1 - EPS_LOW) | (ratio > 1 + EPS_HIGH)).sum().item()
    out["onpolicy_outside_tokens"] = outside
    out["onpolicy_checked_tokens"] = float(ratio.numel())
    out["clamp_hit_ratio"] = (log_ratio.abs() > 20).sum().item() / max(ratio.numel(), 1)
    tokens = m.sum(1)
    out["mask_empty"] = ((tokens == 0) & (w.lengths > 0)).sum().item()
    positions = w.completion_mask if w.completion_mask is not None else torch.arange(w.t)[None, :] < w.lengths[:, None]
    out["mask_outside_completion"] = (m & ~positions).sum().item()
    out["ratio_sum"] = ratio.sum().item()
    out["ratio_count"] = float(ratio.numel())
    out |= {f"ratio_le{i}": v for i, v in enumerate(_buckets(ratio, "grpo_token_importance_weight"))}
    pos, neg = adv_t > 0, adv_t < 0
    for sign, tokens_of_sign in (("pos", pos), ("neg", neg), ("zero", adv_t == 0)):
        out[f"update_tokens_{sign}"] = tokens_of_sign.sum().item()
    out["clipped_upper_tokens"] = ((ratio > 1 + EPS_HIGH) & pos).sum().item()
    out["clipped_lower_tokens"] = ((ratio < 1 - EPS_LOW) & neg).sum().item()
    out["unclipped_upper_tokens"] = ((ratio > 1 + EPS_HIGH) & neg).sum().item()
    out["unclipped_lower_tokens"] = ((ratio < 1 - EPS_LOW) & pos).sum().item()
    out["upper_reachable_tokens"] = (pos & (w.old[m] < -torch.log1p(torch.tensor(EPS_HIGH)))).sum().item()
    out["entropy_sum"] = ent.sum().item()
    out |= {f"entropy_le{i}": v for i, v in enumerate(_buckets(ent, "grpo_token_entropy_nats"))}
    lengths = w.lengths.double()
    for outcome, rows in (("all", torch.ones_like(w.correct)), ("correct", w.correct), ("incorrect", ~w.correct)):
        picked = lengths[rows]
        out[f"len_sum_{outcome}"] = picked.sum().item()
        out[f"len_count_{outcome}"] = float(picked.numel())
        buckets = _buckets(picked, "grpo_completion_length_distribution_tokens")
        out |= {f"len_{outcome}_le{i}": v for i, v in enumerate(buckets)}
    out |= _naive_groups(shared.solved, shared.group_std)
    out["completions"] = float(w.n)
    pre = torch.ones(())
    out["grad_norm_pre_clip"] = pre.item()
    out["grad_norm_post_clip"] = (pre * torch.clamp(1.0 / (pre + 1e-6), max=1.0)).item()
    out["grad_clip_active"] = float((pre > 1.0).item())
    return out


def floor_step(w: Workload) -> float:
    """The one-pass floor: one fused masked sum over the five (N, T) tensors, one host read."""
    return torch.where(w.mask, w.old + w.new + w.rollout + w.ref + w.entropy, 0.0).sum().item()
