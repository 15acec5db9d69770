"""Independent, deliberately plain reference for every per-step metric: Python loops and numpy in float64.

It shares no code with the library (not even key formatting) so that a bug has to be made twice to hide.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from batches import Batch
from grpo_exporter.catalog import ADVANTAGE_FORMS


def _q(x: float) -> str:
    return repr(float(x)).removesuffix(".0")


def _quantiles(values: list[float], qs: tuple[float, ...]) -> list[float]:
    return [float(v) for v in np.quantile(np.asarray(values, dtype=np.float64), qs)]


GAP_BOUNDS = [2.0**e for e in range(-20, 2)]
RATIO_BOUNDS = [0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 1.0, 1.0078125, 1.015625, 1.03125,
                1.0625, 1.125, 1.25, 1.5, 2.0, 4.0]
ENTROPY_BOUNDS = [2.0**-7, 2.0**-5, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
LENGTH_BOUNDS = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def _histogram(out: dict[str, float], name: str, values: list[float], bounds: list[float], total: float,
               labels: str = "") -> None:
    """A classic histogram's increments: values <= each bound, +Inf, _sum, _count (by counting)."""
    sep = "," if labels else ""
    for b in bounds:
        out[f'{name}_bucket{{{labels}{sep}le="{_q(b)}"}}'] = float(sum(1 for v in values if v <= b))
    out[f'{name}_bucket{{{labels}{sep}le="+Inf"}}'] = float(len(values))
    out[f"{name}_sum{{{labels}}}" if labels else f"{name}_sum"] = total
    out[f"{name}_count{{{labels}}}" if labels else f"{name}_count"] = float(len(values))


def mismatch_reference(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray, cfg: Any) -> dict[str, float]:
    """Trainer against engine, after verl's compute_offpolicy_metrics (log w clamped at 20): float64 loops over the
    loss tokens where rollout - old is finite; ``cfg``: ratio_quantiles, rollout_correction_cap."""
    out: dict[str, float] = {}
    n, width = mask.shape
    diffs = {(i, t): rollout[i, t] - old[i, t] for i in range(n) for t in range(width) if mask[i, t]}
    diffs = {c: v for c, v in diffs.items() if math.isfinite(v)}
    if not diffs:
        return out
    logw = {c: min(max(-v, -20.0), 20.0) for c, v in diffs.items()}
    out['grpo_mismatch_kl_nats{estimator="k1"}'] = float(np.mean(list(diffs.values())))
    out['grpo_mismatch_kl_nats{estimator="k3"}'] = float(np.mean([math.exp(v) - 1 - v for v in logw.values()]))
    out['grpo_mismatch_chi_square{level="token"}'] = float(np.mean([math.exp(2 * v) for v in logw.values()])) - 1
    rows: dict[int, list[tuple[float, float]]] = {}
    for (i, t), v in diffs.items():
        rows.setdefault(i, []).append((v, logw[(i, t)]))
    row_mean = [float(np.mean([d for d, _ in r])) for r in rows.values()]
    row_logw = [min(max(sum(w for _, w in r), -20.0), 20.0) for r in rows.values()]
    out['grpo_mismatch_chi_square{level="sequence"}'] = float(np.mean([math.exp(2 * v) for v in row_logw])) - 1
    out["grpo_mismatch_log_ppl_diff_nats"] = float(np.mean(row_mean))
    out["grpo_mismatch_ppl_multiple"] = float(np.mean([math.exp(v) for v in row_mean]))
    weights = [math.exp(v) for v in logw.values()]
    out["grpo_rollout_correction_weight_sum"] = float(sum(weights))
    out["grpo_rollout_correction_weight_count"] = float(len(weights))
    for q, v in zip(cfg.ratio_quantiles, _quantiles(weights, cfg.ratio_quantiles), strict=True):
        out[f'grpo_rollout_correction_weight{{quantile="{_q(q)}"}}'] = v
    _histogram(out, "grpo_token_rollout_correction_weight", weights, RATIO_BOUNDS, float(sum(weights)))
    geometric = [math.exp(-v) for v in row_mean]
    _histogram(out, "grpo_sequence_rollout_correction_weight", geometric, RATIO_BOUNDS, float(sum(geometric)))
    if cfg.rollout_correction_cap is not None:
        cap = cfg.rollout_correction_cap
        tokens_over = sum(1 for w in weights if w > cap)
        rows_over = sum(1 for w in geometric if w > cap)
        out["grpo_rollout_correction_capped_tokens_total"] = float(tokens_over)
        out["grpo_rollout_correction_capped_sequences_total"] = float(rows_over)
        out['grpo_rollout_correction_capped_ratio{level="token"}'] = tokens_over / len(weights)
        out['grpo_rollout_correction_capped_ratio{level="sequence"}'] = rows_over / len(geometric)
    return out


def reference(batch: Batch, cfg: Any) -> dict[str, float]:
    with np.errstate(invalid="ignore", over="ignore"):  # -inf - -inf at a wrongly masked padding position
        return _reference(batch, cfg)


def _reference(batch: Batch, cfg: Any) -> dict[str, float]:
    a, comps, sc = batch.arrays, batch.components, batch.scalars
    out: dict[str, float] = {}
    mask = a["loss_mask"]
    n, width = mask.shape
    cells = [(i, t) for i in range(n) for t in range(width) if mask[i, t]]

    # grouping
    gids = a["group_ids"] if "group_ids" in a else np.arange(n) // cfg.group_size
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids.tolist()):
        groups.setdefault(g, []).append(i)
    members = list(groups.values())

    # ---- layer 1 --------------------------------------------------------------------------------------
    def nonfinite(name: str, x: np.ndarray, token: bool) -> None:
        bad = sum(1 for i, t in cells if not math.isfinite(x[i, t])) if token else int((~np.isfinite(x)).sum())
        out[f'grpo_nonfinite_values_total{{tensor="{name}"}}'] = float(bad)

    for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy"):
        nonfinite(name, a[name], True)
    nonfinite("advantages", a["advantages"], a["advantages"].ndim == 2)
    nonfinite("rewards", a["rewards"], False)
    if comps:
        out['grpo_nonfinite_values_total{tensor="reward_components"}'] = float(
            sum(int((~np.isfinite(v)).sum()) for v in comps.values())
        )
    out['grpo_nonfinite_values_total{tensor="loss"}'] = 0.0 if math.isfinite(sc["loss"]) else 1.0

    gap = [abs(a["rollout_logprobs"][i, t] - a["old_logprobs"][i, t]) for i, t in cells]
    gap = [v for v in gap if math.isfinite(v)]
    out["grpo_engine_logprob_gap_nats_sum"] = float(sum(gap))
    out["grpo_engine_logprob_gap_nats_count"] = float(len(gap))
    _histogram(out, "grpo_token_engine_logprob_gap_nats", gap, GAP_BOUNDS, float(sum(gap)))
    if gap:
        out["grpo_engine_logprob_gap_mean_nats"] = float(np.mean(gap))
        for q, v in zip(cfg.gap_quantiles, _quantiles(gap, cfg.gap_quantiles), strict=True):
            out[f'grpo_engine_logprob_gap_nats{{quantile="{_q(q)}"}}'] = v

    out.update(mismatch_reference(a["old_logprobs"], a["rollout_logprobs"], mask, cfg))

    log_ratio = {c: a["logprobs"][c] - a["old_logprobs"][c] for c in cells}
    finite_lr = {c: v for c, v in log_ratio.items() if math.isfinite(v)}
    fuse = cfg.log_ratio_clamp if cfg.log_ratio_clamp is not None else math.inf
    clamped = {c: min(max(v, -fuse), fuse) for c, v in finite_lr.items()}  # the loss clamps before exp
    ratio = {c: math.exp(v) if v < 700 else math.inf for c, v in clamped.items()}
    out['grpo_nonfinite_values_total{tensor="log_ratio"}'] = float(len(log_ratio) - len(finite_lr))
    out['grpo_nonfinite_values_total{tensor="ratio"}'] = float(
        len(log_ratio) - sum(1 for v in clamped.values() if v < 88.72)
    )
    lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    if sc.get("on_policy"):
        outside = sum(1 for r in ratio.values() if r > hi or r < lo)
        out["grpo_onpolicy_outside_clip_tokens_total"] = float(outside)
        out["grpo_onpolicy_checked_tokens_total"] = float(len(ratio))
        if ratio:
            out["grpo_onpolicy_outside_clip_ratio"] = outside / len(ratio)
            out["grpo_onpolicy_log_ratio_abs_max_nats"] = max(abs(v) for v in finite_lr.values())
    if cfg.log_ratio_clamp is not None:
        hits = sum(1 for c in cells if not abs(log_ratio[c]) < cfg.log_ratio_clamp * (1 - 1e-6))
        out["grpo_log_ratio_clamp_hit_tokens_total"] = float(hits)
        if cells:
            out["grpo_log_ratio_clamp_hit_ratio"] = hits / len(cells)

    lengths = a["completion_lengths"]
    mismatch = empty = outside_completion = 0
    for i in range(n):
        count = int(mask[i].sum())
        mismatch += count > 0 and count != lengths[i]
        empty += count == 0 and lengths[i] > 0
        outside_completion += sum(1 for t in range(width) if mask[i, t] and t >= lengths[i])
    out["grpo_loss_mask_length_mismatch_sequences_total"] = float(mismatch)
    out["grpo_loss_mask_empty_sequences_total"] = float(empty)
    out["grpo_loss_mask_outside_completion_tokens_total"] = float(outside_completion)

    kl = []
    for c in cells:
        d = a["ref_logprobs"][c] - a["logprobs"][c]
        if math.isfinite(d):
            kl.append(math.exp(d) - d - 1)
    if kl:
        out["grpo_kl_ref_nats"] = float(np.mean(kl))

    pre, max_norm = sc["grad_norm_pre_clip"], sc["max_grad_norm"]
    out["grpo_grad_norm_pre_clip"] = pre
    out["grpo_grad_norm_post_clip"] = pre * min(1.0, max_norm / (pre + 1e-6))
    out["grpo_optimizer_steps_total"] = 1.0
    out["grpo_grad_clip_active_steps_total"] = float(pre > max_norm)
    out['grpo_nonfinite_values_total{tensor="grad_norm"}'] = float(not math.isfinite(pre))
    out["grpo_rollout_staleness_versions"] = float(sc["policy_version"] - sc["rollout_policy_version"])

    # ---- layer 2 --------------------------------------------------------------------------------------
    out["grpo_completions_total"] = float(n)
    for component, values in {"total": a["rewards"], **comps}.items():
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            out[f'grpo_reward_mean{{component="{component}"}}'] = float(np.mean(finite))
        stds, ranges = [], []
        for idx in members:
            r = [values[i] for i in idx if math.isfinite(values[i])]
            if r:
                stds.append(float(np.std(r)))
                ranges.append(max(r) - min(r))
        if stds:
            out[f'grpo_reward_group_std_mean{{component="{component}"}}'] = float(np.mean(stds))
            out[f'grpo_reward_group_range_mean{{component="{component}"}}'] = float(np.mean(ranges))

    out.update(_noise_reference(a, comps, members, cfg))

    adv = a["advantages"]
    per_seq: dict[int, float] = {}
    for i in range(n):
        if adv.ndim == 1:
            if math.isfinite(adv[i]):
                per_seq[i] = abs(adv[i])
        else:
            vals = [abs(adv[i, t]) for t in range(width) if mask[i, t] and math.isfinite(adv[i, t])]
            if vals:
                per_seq[i] = max(vals)
    # the bound's slack: the setting, or the advantages' own rounding where coarser (bf16)
    slack = max(cfg.advantage_bound_rtol, float(torch.finfo(batch.dtype).eps))
    form, read, inconsistent = _form_reference(a, members, mask, cfg, slack)
    checked = len(read)
    bounds = {}
    for idx in members:
        judged = cfg.advantage_norm
        if form != "unknown" and len(idx) == cfg.group_size:  # the detected form judges every whole group
            judged = form if form in ("unbiased", "population", "none") else ""
            if form == "batch" and cfg.advantage_norm == "none":
                judged = "none"
        g = max(len(idx), cfg.group_size)
        if judged == "unbiased":
            b = (g - 1) / math.sqrt(g)
        elif judged == "population":
            b = math.sqrt(g - 1)
        elif judged == "none":
            r = [a["rewards"][i] for i in idx if math.isfinite(a["rewards"][i])]
            b = (max(r) - min(r)) * (g - 1) / g if r and len(idx) >= cfg.group_size else math.inf
        else:
            b = math.inf
        for i in idx:
            bounds[i] = b
    for name in (*ADVANTAGE_FORMS, "unknown"):
        out[f'grpo_advantage_form_sequences_total{{form="{name}"}}'] = float(checked if name == form else 0)
    out["grpo_advantage_inconsistent_sequences_total"] = float(inconsistent)
    if per_seq:
        out["grpo_advantage_abs_max"] = max(per_seq.values())
    out["grpo_advantage_over_bound_sequences_total"] = float(
        sum(1 for i, v in per_seq.items() if v > bounds[i] * (1 + slack) + 1e-6)
    )
    if any(math.isfinite(b) for b in bounds.values()):
        out["grpo_advantage_bound"] = max(b for b in bounds.values() if math.isfinite(b))

    outcomes = {"all": [True] * n, "correct": list(a["correct"]), "incorrect": [not c for c in a["correct"]]}
    for outcome, chosen in outcomes.items():
        ls = [float(lengths[i]) for i in range(n) if chosen[i]]
        out[f'grpo_completion_length_tokens_sum{{outcome="{outcome}"}}'] = float(sum(ls))
        out[f'grpo_completion_length_tokens_count{{outcome="{outcome}"}}'] = float(len(ls))
        _histogram(out, "grpo_completion_length_distribution_tokens", ls, LENGTH_BOUNDS, float(sum(ls)),
                   f'outcome="{outcome}"')
        if ls:
            for q, v in zip(cfg.length_quantiles, _quantiles(ls, cfg.length_quantiles), strict=True):
                out[f'grpo_completion_length_tokens{{outcome="{outcome}",quantile="{_q(q)}"}}'] = v
    out["grpo_truncated_completions_total"] = float(a["truncated"].sum())
    turns = [float(t) for t in a["turns"]]
    out["grpo_completion_turns_sum"], out["grpo_completion_turns_count"] = float(sum(turns)), float(len(turns))
    out['grpo_completion_turns{quantile="0"}'], out['grpo_completion_turns{quantile="1"}'] = min(turns), max(turns)
    out["grpo_partial_completions_total"] = float(sum(bool(p) for p in a["partial"]))
    out["grpo_tool_calls_total"] = float(sc["tool_calls"])
    out["grpo_tool_call_failures_total"] = float(sc["tool_failures"])
    out["grpo_aborted_completions_total"] = float(sc["aborted_completions"])
    # staleness over loss tokens: each completion weighs its tokens; the max over completions with one
    row_tokens = [int(mask[i].sum()) for i in range(n)]
    if sum(row_tokens):
        stale = [float(v) for v in a["staleness"]]
        pairs = list(zip(stale, row_tokens, strict=True))
        out["grpo_token_staleness_mean_versions"] = sum(s * k for s, k in pairs) / sum(row_tokens)
        out["grpo_token_staleness_max_versions"] = max(s for s, k in pairs if k)

    # ---- layer 3 --------------------------------------------------------------------------------------
    def token_adv(i: int, t: int) -> float:
        return float(adv[i] if adv.ndim == 1 else adv[i, t])

    signed = [(c, token_adv(*c)) for c in cells if math.isfinite(token_adv(*c))]
    atol = cfg.zero_advantage_atol  # an advantage within it of 0 is zero (the rounding of equal rewards)
    pos = [c for c, v in signed if v > atol]
    neg = [c for c, v in signed if v < -atol]
    zero = [c for c, v in signed if abs(v) <= atol]
    out['grpo_update_tokens_total{advantage_sign="positive"}'] = float(len(pos))
    out['grpo_update_tokens_total{advantage_sign="negative"}'] = float(len(neg))
    out['grpo_update_tokens_total{advantage_sign="zero"}'] = float(len(zero))
    if signed:
        out["grpo_zero_advantage_tokens_ratio"] = len(zero) / len(signed)

    w = np.asarray(list(ratio.values()))
    if w.size:
        out['grpo_ess_ratio{level="token"}'] = float(w.sum() ** 2 / (w**2).sum() / w.size)
    seq_w = []
    for i in range(n):
        lrs = [clamped[(i, t)] for t in range(width) if (i, t) in clamped]
        if lrs:
            seq_w.append(sum(lrs))
    if seq_w:
        sw = np.exp(np.asarray(seq_w) - max(seq_w))
        out['grpo_ess_ratio{level="sequence"}'] = float(sw.sum() ** 2 / (sw**2).sum() / sw.size)
    if ratio:
        for q, v in zip(cfg.ratio_quantiles, _quantiles(list(ratio.values()), cfg.ratio_quantiles), strict=True):
            out[f'grpo_importance_weight{{quantile="{_q(q)}"}}'] = v
    finite_ratio = [r for r in ratio.values() if math.isfinite(r)]  # an overflow never enters the cumulative sum
    out["grpo_importance_weight_sum"] = float(sum(finite_ratio))
    out["grpo_importance_weight_count"] = float(len(finite_ratio))
    _histogram(out, "grpo_token_importance_weight", list(ratio.values()), RATIO_BOUNDS, float(sum(finite_ratio)))

    upper = sum(1 for c in pos if c in ratio and ratio[c] > hi)
    lower = sum(1 for c in neg if c in ratio and ratio[c] < lo)
    out['grpo_clipped_tokens_total{bound="upper"}'] = float(upper)
    out['grpo_clipped_tokens_total{bound="lower"}'] = float(lower)
    out['grpo_out_of_range_unclipped_tokens_total{bound="upper"}'] = float(
        sum(1 for c in neg if c in ratio and ratio[c] > hi)
    )
    out['grpo_out_of_range_unclipped_tokens_total{bound="lower"}'] = float(
        sum(1 for c in pos if c in ratio and ratio[c] < lo)
    )
    # the upper clip is reachable only where p_old < 1/(1+eps_high): exp(old) * (1+eps_high) < 1
    out["grpo_upper_clip_reachable_tokens_total"] = float(
        sum(1 for c in pos if math.exp(a["old_logprobs"][c]) * hi < 1.0)
    )
    pos_n, neg_n = len(pos), len(neg)  # the update_tokens_total denominators
    if pos_n:
        out['grpo_clipped_tokens_ratio{bound="upper"}'] = upper / pos_n
    if neg_n:
        out['grpo_clipped_tokens_ratio{bound="lower"}'] = lower / neg_n

    counts = {"all_correct": 0, "all_incorrect": 0, "unknown": 0}
    for idx in members:
        r = [a["rewards"][i] for i in idx if math.isfinite(a["rewards"][i])]
        if max(r) == min(r):
            hits = sum(bool(a["correct"][i]) for i in idx)
            key = "all_correct" if hits == len(idx) else "all_incorrect" if hits == 0 else "unknown"
            counts[key] += 1
    out["grpo_groups_total"] = float(len(members))
    out["grpo_generated_groups_total"] = float(sc["generated_groups"])
    out['grpo_filtered_groups_total{outcome="all_correct"}'] = float(sc["filtered_all_correct_groups"])
    out['grpo_filtered_groups_total{outcome="all_incorrect"}'] = float(sc["filtered_all_incorrect_groups"])
    out["grpo_kept_groups_ratio"] = len(members) / sc["generated_groups"]
    for key, value in counts.items():
        out[f'grpo_zero_variance_groups_total{{outcome="{key}"}}'] = float(value)
    out["grpo_zero_variance_groups_ratio"] = sum(counts.values()) / len(members)
    expected = []
    for idx in members:
        expected.append(float(np.mean([a["zero_variance_prob"][i] for i in idx])))
    out["grpo_zero_variance_groups_expected_ratio"] = float(np.mean(expected))
    if a.get("all_incorrect_prob") is not None:
        out["grpo_all_incorrect_groups_expected_ratio"] = float(np.mean(
            [np.mean([a["all_incorrect_prob"][i] for i in idx]) for idx in members]))

    rates = []
    for idx in members:
        hits = sum(bool(a["correct"][i]) for i in idx)
        if 0 < hits < len(idx):
            rates.append(hits / len(idx))
    for b in cfg.solve_rate_buckets:
        out[f'grpo_mixed_group_solve_rate_ratio_bucket{{le="{_q(b)}"}}'] = float(sum(1 for r in rates if r <= b))
    out['grpo_mixed_group_solve_rate_ratio_bucket{le="+Inf"}'] = float(len(rates))
    out["grpo_mixed_group_solve_rate_ratio_sum"] = float(sum(rates))
    out["grpo_mixed_group_solve_rate_ratio_count"] = float(len(rates))

    # ---- layer 4 --------------------------------------------------------------------------------------
    ent = [a["entropy"][c] for c in cells if math.isfinite(a["entropy"][c])]
    _histogram(out, "grpo_token_entropy_nats", ent, ENTROPY_BOUNDS, float(sum(ent)))
    if ent:
        out["grpo_entropy_mean_nats"] = float(np.mean(ent))
        k = max(1, math.ceil(Fraction(str(cfg.entropy_top_fraction)) * len(ent)))
        out["grpo_entropy_top_mean_nats"] = float(np.mean(sorted(ent, reverse=True)[:k]))
    for k in sorted({1, cfg.group_size, *cfg.pass_k}):
        values = []
        for idx in members:
            size, hits = len(idx), sum(bool(a["correct"][i]) for i in idx)
            if size >= k:
                values.append(1 - math.comb(size - hits, k) / math.comb(size, k))
        if values:
            out[f'grpo_pass_at_k_ratio{{k="{k}"}}'] = float(np.mean(values))
    unique, repeated_wrong = [], []
    for idx in members:
        seqs = [tuple(a["completion_ids"][i, : lengths[i]].tolist()) for i in idx]
        unique.append(len(set(seqs)) / len(idx))
        most = max(seqs.count(q) for q in seqs)
        repeated_wrong.append(not any(bool(a["correct"][i]) for i in idx) and most >= 2 and 2 * most >= len(idx))
    out["grpo_unique_completions_ratio"] = float(np.mean(unique))
    out["grpo_repeated_wrong_groups_ratio"] = float(np.mean(repeated_wrong))
    return out


def _form_reference(a: dict[str, np.ndarray], members: list[list[int]], mask: np.ndarray,
                    cfg: Any, slack: float) -> tuple[str, set[int], int]:
    """The advantage form, the sequences read (those of complete groups) and the number of inconsistent ones, as
    functional.advantage_form states them, on plain floats: per-sequence advantages, group means and stds."""
    adv = a["advantages"]
    seq: dict[int, float] = {}
    spread_of: dict[int, float] = {}
    for i in range(adv.shape[0]):
        if adv.ndim == 1:
            if math.isfinite(adv[i]):
                seq[i], spread_of[i] = float(adv[i]), 0.0
            continue
        vals = [float(adv[i, t]) for t in range(adv.shape[1]) if mask[i, t] and math.isfinite(adv[i, t])]
        if vals:
            seq[i] = float(np.mean(vals))
            spread_of[i] = max(vals) - min(vals) if len(vals) > 1 else 0.0
    complete = [idx for idx in members if len(idx) == cfg.group_size and all(i in seq for i in idx)]
    rows = [i for idx in complete for i in idx]
    if not rows:
        return "unknown", set(), 0
    scale = math.sqrt(np.mean([seq[i] ** 2 for i in rows]))
    atol = 1e-2 * scale + 1e-12
    mean = {tuple(idx): float(np.mean([seq[i] for i in idx])) for idx in complete}
    std = {tuple(idx): float(np.std([seq[i] for i in idx], ddof=1)) for idx in complete}
    pop = {tuple(idx): float(np.std([seq[i] for i in idx])) for idx in complete}
    mixed = [k for k in std if std[k] > atol]
    top = max(abs(seq[i]) for i in rows)
    at_top = [i for i in rows if abs(seq[i]) >= top * (1 - 1e-6)]
    judged = [k for k in mixed if not (set(k) & set(at_top) and abs(mean[k]) > atol)]  # nor are clipped groups
    centred = all(abs(mean[k]) <= atol for k in judged)  # nor are tied groups
    shifted = not all(abs(mean[k]) <= atol for k in mixed)
    upper = 1 + max(1e-5, min(slack, 1 / (4 * cfg.group_size)))

    def unit(s: dict[tuple[int, ...], float]) -> bool:
        at_one = sum(1 for k in judged if 0.98 <= s[k] <= upper)
        return centred and at_one > 0 and all(s[k] <= upper for k in judged)

    multi = sum(1 for i in rows if adv.ndim == 2 and int(mask[i].sum()) > 1)
    varying = sum(1 for i in rows if spread_of[i] > 1e-5 * scale)
    r = a["rewards"]
    rewarded = [idx for idx in complete if all(math.isfinite(r[i]) for i in idx)]
    r_tol = 1e-5 * max(abs(float(r[i])) for i in rows if math.isfinite(r[i])) + 1e-12
    spread = [tuple(idx) for idx in rewarded if tuple(idx) in mixed and np.std([r[i] for i in idx], ddof=1) > r_tol]
    k = {g: std[g] / float(np.std([r[i] for i in g], ddof=1)) for g in spread}
    unit_scale = min(1e-2, 0.5 / max(cfg.group_size - 1, 1))
    forms = {
        "shaped": varying > 0 and varying > 0.5 * multi,
        "unbiased": unit(std), "population": unit(pop),
        "none": centred and len(spread) > 1 and all(abs(v - 1) <= unit_scale for v in k.values()),
        "batch": centred and len(spread) > 1 and all(abs(v - np.mean(list(k.values())))
                                                      <= 1e-2 * abs(np.mean(list(k.values()))) for v in k.values()),
    }
    means = list(mean.values())
    common = all(abs(m - np.mean(means)) <= atol for m in means) and bool(mixed) and len(means) > 1
    unit_batch = abs(scale ** 2 - 1) <= 0.08
    rescaled = forms["batch"] and unit_batch  # the batches here hold rewards: none is never rescaled
    forms["none"] = forms["none"] and not rescaled
    forms["batch"] = forms["batch"] and not rescaled
    # the batches here hold no affine-in-r case
    forms["whitened"] = (shifted and common) or rescaled or (centred and unit_batch and len(mixed) == 1)
    form = next((f for f, hit in forms.items() if hit), "unknown")
    form = {"batch": dict.fromkeys(("none", "whitened", "unbiased", "population"), "batch"),
            "whitened": dict.fromkeys(("none", "batch", "unbiased", "population"), "whitened")}.get(
        cfg.advantage_norm, {}).get(form, form)
    bad: set[int] = set()
    for idx in rewarded:
        m_r = float(np.mean([r[i] for i in idx]))
        tied = max(r[i] for i in idx) == min(r[i] for i in idx)
        for i in idx:
            d, c = seq[i] - mean[tuple(idx)], float(r[i]) - m_r
            if (d * c < 0 and abs(d) > atol and abs(c) > r_tol) or (tied and abs(d) > atol):
                bad.add(i)
    if cfg.advantage_norm in ("unbiased", "population", "none", "batch") and form == "unknown":
        bad |= {i for idx in complete if tuple(idx) in judged and abs(mean[tuple(idx)]) > atol for i in idx}
    if cfg.advantage_norm in ("whitened", "shaped") or form == "shaped":
        bad = set()
    return form, {i for idx in complete for i in idx}, len(bad)


def _noise_reference(a: dict[str, np.ndarray], comps: dict[str, np.ndarray], members: list[list[int]],
                     cfg: Any) -> dict[str, float]:
    """Advantage from reward noise (seed 第 4 篇 2.2), group by group in float64."""
    rewards, out = a["rewards"], {}
    finite = [v for v in rewards if math.isfinite(v)]
    scale = cfg.reward_scale if cfg.reward_scale is not None else (max(finite) - min(finite) if finite else 0.0)
    sigma = cfg.advantage_norm in ("unbiased", "population")
    seen = noisy = 0
    tied = dict.fromkeys(comps, 0.0)
    for idx in members:
        kept = [i for i in idx if math.isfinite(rewards[i])]
        if not kept:
            continue
        seen += 1
        r = [float(rewards[i]) for i in kept]
        spread = max(r) - min(r)
        noisy += sigma and 0 < spread < cfg.noise_range_fraction * scale
        right = sum(bool(a["correct"][i]) for i in kept)
        if spread > 0 and right in (0, len(kept)):
            for name, values in comps.items():
                v = [float(values[i]) for i in idx if math.isfinite(values[i])]
                tied[name] += float(np.var(v)) if v else 0.0
    if seen:
        out["grpo_noise_advantage_groups_ratio"] = noisy / seen
    if sum(tied.values()) > 0:
        out.update({f'grpo_reward_tied_variance_ratio{{component="{name}"}}': v / sum(tied.values())
                    for name, v in tied.items()})
    return out
