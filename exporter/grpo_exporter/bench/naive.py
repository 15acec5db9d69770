"""The reference the bench compares against: the seed's per-step metrics written the obvious way, one metric at
a time, a host read per scalar, ``torch.quantile`` for quantiles. The metric set is the monitor's core (layers
1-4 on the same inputs); the monitor computes a superset (edit distance, solve-rate prediction, mask audit by
cause, run anchors), so the comparison is conservative for the monitor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_exporter.bench.workload import MICRO_BATCHES, G, Workload

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> list[float]:
    """All quantiles of one distribution from one ``torch.quantile`` call (one sort), read one by one."""
    return [v.item() for v in torch.quantile(values.double(), torch.tensor(qs, dtype=torch.float64))]


def naive_step(w: Workload) -> dict[str, float]:
    """Every metric of one step, as naive code computes it (returns them so nothing is optimised away)."""
    out: dict[str, float] = {}
    m = w.mask
    # layer 1: engine gap, non-finite values, on-policy ratio, clamp hits
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
    # layer 2: rewards, groups, advantages, lengths, truncation
    grouped = w.rewards.view(-1, G)
    out["reward_mean"] = w.rewards.mean().item()
    out["group_std"] = grouped.std(1).mean().item()
    out["group_range"] = (grouped.max(1).values - grouped.min(1).values).mean().item()
    adv = w.advantages.abs().max().item()
    out["adv_max"] = adv
    out["adv_over_bound"] = (w.advantages.abs() > (G - 1) / G**0.5).sum().item()
    lengths = w.lengths.double()
    for outcome, rows in (("all", torch.ones_like(w.correct)), ("correct", w.correct), ("incorrect", ~w.correct)):
        if rows.sum().item() > 0:
            out[f"len_q99_{outcome}"] = torch.quantile(lengths[rows], 0.99).item()
            out[f"len_mean_{outcome}"] = lengths[rows].mean().item()
    out["truncated"] = w.truncated.sum().item()
    # layer 3: ratios, ESS, clipping by bound and sign, zero-variance groups
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
    zero_var = (grouped.std(1) == 0).float()
    out["zero_variance"] = zero_var.mean().item()
    p = w.correct.view(-1, G).float().mean(1)
    out["zero_variance_expected"] = (p**G + (1 - p) ** G).mean().item()
    # layer 4: entropy, KL, pass@k, distinct completions
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
    # the step's grad norm, as naive code reads it
    out["micro_batches"] = float(MICRO_BATCHES)
    return out


def floor_step(w: Workload) -> float:
    """The one-pass floor: one fused masked sum over the five (N, T) tensors, one host read."""
    return torch.where(w.mask, w.old + w.new + w.rollout + w.ref + w.entropy, 0.0).sum().item()
