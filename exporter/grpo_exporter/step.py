"""One step in, every applicable metric out, with exactly one device-to-host transfer.

:func:`compute_step` runs each metric whose inputs were given, collects the device readings, packs every value
and presence flag into a single fp64 tensor and moves it to the host once (``tolist``). Keys are catalogue
sample keys (``Metric.key``): a metric name plus ``_sum``/``_count``/``_bucket`` suffixes and labels. Counter
and ``_sum``/``_count`` values are this step's increments; gauges and quantiles are this step's values.
Absent metrics (empty masks, no token of the gating sign...) are left out of the mapping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.catalog import format_quantile
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import diversity, gradient, reward, samples
from grpo_exporter.functional.groups import Groups, advantage_bounds
from grpo_exporter.functional.reading import Extreme, Ratio, always, reading
from grpo_exporter.functional.selection import Quantiles, TopMean
from grpo_exporter.inputs import StepInputs

StepMetrics = dict[str, float]


class Entry(NamedTuple):
    """One sample of the step: its key, the reading it came from, and how it merges across ranks
    (``sum``, ``ratio``, ``max``, ``min``, ``ess``, ``quantile`` with its ``index``, or ``top``)."""

    key: str
    reading: Any
    merge: str
    index: int = 0

    def local(self) -> tuple[Tensor, Tensor]:
        """(value, present) on this rank, as 0-d fp64 tensors."""
        value = self.reading.value[self.index] if self.merge == "quantile" else self.reading.value
        return value.reshape(()).double(), self.reading.present.reshape(()).double()


Reducer = Callable[[list[Entry]], list[tuple[Tensor, Tensor]]]


def _merge_of(key: str, value: Any) -> str:
    if isinstance(value, Ratio):
        return "ratio"
    if isinstance(value, Extreme):
        return "max" if value.largest else "min"
    if isinstance(value, samples.Effective):
        return "ess"
    if isinstance(value, TopMean):
        return "top"
    return "sum" if catalog.is_additive(key) else "max"


class _Gather:
    """Collects readings keyed by catalogue sample keys, then transfers them to the host in one go."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[Entry] = []
        self.carried: dict[str, Tensor] = {}
        self.errors: list[tuple[str, Exception]] = []

    def add(self, name: str, value: Any, suffix: str = "", **labels: str) -> None:
        key = catalog.metric(name).key(suffix, **labels)
        if isinstance(value, int | float):
            value = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        if isinstance(value, Tensor):
            value = always(value)
        self.entries.append(Entry(key, value, _merge_of(key, value)))

    def summary(
        self, name: str, total: Tensor, count: Tensor, r: Quantiles, qs: Sequence[float], **labels: str
    ) -> None:
        family = catalog.metric(name)
        for i, q in enumerate(qs):
            self.entries.append(Entry(family.key(quantile=format_quantile(q), **labels), r, "quantile", i))
        self.add(name, total, "_sum", **labels)
        self.add(name, count, "_count", **labels)

    def run(self, block: Callable[[_Gather, _Context], None], ctx: _Context, strict: bool) -> None:
        """Run one metric block; on error drop what it added (strict: re-raise)."""
        mark = len(self.entries)
        try:
            block(self, ctx)
        except Exception as exc:
            if strict:
                raise
            del self.entries[mark:]
            self.errors.append((block.__name__.lstrip("_"), exc))

    def transfer(self, reduce: Reducer | None) -> tuple[StepMetrics, dict[str, list[float]]]:
        """The single device-to-host transfer of the step: every reading (reduced across ranks first when
        ``reduce`` is given), and the carried vectors."""
        pairs = reduce(self.entries) if reduce is not None else [e.local() for e in self.entries]
        parts = [torch.stack([v for v, _ in pairs]), torch.stack([p for _, p in pairs])] if pairs else []
        parts += [t.reshape(-1).to(self.device, torch.float64) for t in self.carried.values()]
        if not parts:
            return {}, {}
        packed = torch.cat([p.to(self.device) for p in parts]).tolist()
        m = len(pairs)
        out = {e.key: packed[i] for i, e in enumerate(self.entries) if packed[m + i]}
        carried, offset = {}, 2 * m
        for name, t in self.carried.items():
            carried[name] = packed[offset : offset + t.numel()]
            offset += t.numel()
        return out, carried


def compute_step(inputs: StepInputs, config: MetricsConfig) -> StepMetrics:
    """Every metric the given inputs allow, as ``{sample key: float}``, with one host transfer.

    Raises :class:`~grpo_exporter.inputs.InputError` for grouping that contradicts the config (N not a
    multiple of ``group_size`` without ``group_ids``), and any error of a metric block (strict).
    """
    return compute_step_carrying(inputs, config, {}, strict=True).metrics


class StepResult(NamedTuple):
    """What one computation produced: values of present metrics, carried vectors, the errors of metric
    blocks (non-strict), and every family computed, present or absent (what the publication replaces)."""

    metrics: StepMetrics
    carried: dict[str, list[float]]
    errors: list[tuple[str, Exception]]
    families: frozenset[str]


def compute_step_carrying(
    inputs: StepInputs,
    config: MetricsConfig,
    carry: dict[str, Tensor],
    strict: bool = True,
    reduce: Reducer | None = None,
    blocks: tuple[Block, ...] | None = None,
) -> StepResult:
    """:func:`compute_step`, plus device vectors ``carry`` brought to the host in the same single transfer
    (the monitor carries prompt ids and outcomes for its solve-rate history this way).

    Each metric block runs on its own: with ``strict=False`` a block that raises is dropped whole and
    returned in the error list, and every other block is still computed and transferred. ``reduce`` merges
    the readings across ranks before the transfer (see :mod:`grpo_exporter.distributed`). ``blocks`` limits
    the computation to one stage (``ROLLOUT_BLOCKS``, ``UPDATE_BLOCKS``), so a tensor handed to both observe
    calls never counts a rollout-level quantity twice.
    """
    g = _Gather(inputs.device)
    g.carried = dict(carry)
    with torch.no_grad():
        ctx = _Context(inputs, config, inputs.groups(config.group_size))
        for block in BLOCKS if blocks is None else blocks:
            g.run(block, ctx, strict)
    metrics, carried = g.transfer(reduce)
    families = frozenset(catalog.family_of(catalog.parse_key(e.key)[0]).name for e in g.entries)
    return StepResult(metrics, carried, g.errors, families)


class _Context:
    """The step's inputs, config, groups, and the log ratio and per-token advantages computed once."""

    def __init__(self, x: StepInputs, cfg: MetricsConfig, groups: Groups | None) -> None:
        self.x, self.cfg, self.groups = x, cfg, groups
        mask = x.loss_mask
        self.lr = None
        if mask is not None and x.logprobs is not None and x.old_logprobs is not None:
            self.lr = gradient.log_ratio(x.logprobs, x.old_logprobs, mask)
        self.token_adv = None
        if mask is not None and x.advantages is not None:
            self.token_adv = samples.token_advantages(x.advantages, mask.shape)


# ---- layer 1 ----------------------------------------------------------------------------------------------


def _nonfinite_inputs(g: _Gather, c: _Context) -> None:
    x, mask = c.x, c.x.loss_mask
    if mask is not None:
        for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy"):
            value = getattr(x, name)
            if value is not None:
                g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(value, mask), tensor=name)
    if x.advantages is not None and (x.advantages.dim() == 1 or mask is not None):
        adv_mask = None if x.advantages.dim() == 1 else mask
        g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.advantages, adv_mask), tensor="advantages")
    if x.rewards is not None:
        g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.rewards), tensor="rewards")
    if isinstance(x.loss, Tensor):
        g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(x.loss), tensor="loss")
    elif x.loss is not None:
        g.add("grpo_nonfinite_values_total", 0.0 if math.isfinite(x.loss) else 1.0, tensor="loss")


def _engine_gap(g: _Gather, c: _Context) -> None:
    x, cfg = c.x, c.cfg
    if x.loss_mask is not None and x.rollout_logprobs is not None and x.old_logprobs is not None:
        gap = gradient.engine_gap(x.rollout_logprobs, x.old_logprobs, x.loss_mask, cfg.gap_quantiles)
        g.summary("grpo_engine_logprob_gap_nats", gap.total, gap.count, gap.quantiles, cfg.gap_quantiles)
        g.add("grpo_engine_logprob_gap_mean_nats", gap.mean)


def _log_ratio_checks(g: _Gather, c: _Context) -> None:
    lr, cfg = c.lr, c.cfg
    if lr is None:
        return
    bad_lr, bad_ratio = gradient.nonfinite_ratio_count(lr)
    g.add("grpo_nonfinite_values_total", bad_lr, tensor="log_ratio")
    g.add("grpo_nonfinite_values_total", bad_ratio, tensor="ratio")
    if c.x.on_policy:
        check = gradient.onpolicy_check(lr, cfg.clip_eps_low, cfg.clip_eps_high)
        g.add("grpo_onpolicy_outside_clip_tokens_total", check.outside)
        g.add("grpo_onpolicy_checked_tokens_total", check.checked)
        g.add("grpo_onpolicy_outside_clip_ratio", check.outside_ratio)
        g.add("grpo_onpolicy_log_ratio_abs_max_nats", check.abs_log_ratio_max)
    if cfg.log_ratio_clamp is not None:
        hits = gradient.clamp_hits(lr, cfg.log_ratio_clamp)
        g.add("grpo_log_ratio_clamp_hit_tokens_total", hits.hits)
        g.add("grpo_log_ratio_clamp_hit_ratio", hits.hit_ratio)


def _mask_audit(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.loss_mask is not None and x.completion_lengths is not None:
        audit = gradient.mask_audit(x.loss_mask, x.completion_lengths, x.completion_mask)
        g.add("grpo_loss_mask_length_mismatch_sequences_total", audit.length_mismatch)
        g.add("grpo_loss_mask_empty_sequences_total", audit.empty)
        g.add("grpo_loss_mask_outside_completion_tokens_total", audit.outside_completion)


def _kl(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.loss_mask is not None and x.logprobs is not None and x.ref_logprobs is not None:
        g.add("grpo_kl_ref_nats", gradient.kl_k3(x.logprobs, x.ref_logprobs, x.loss_mask))


def _grad_norms(g: _Gather, c: _Context) -> None:
    x = c.x
    pre = x.grad_norm_pre_clip
    if pre is None and x.grads is not None:
        pre = gradient.total_norm(x.grads)
    if pre is None:
        return
    pre_t = torch.as_tensor(pre, dtype=torch.float32, device=g.device)
    g.add("grpo_nonfinite_values_total", (~torch.isfinite(pre_t)).to(torch.int64), tensor="grad_norm")
    g.add("grpo_optimizer_steps_total", torch.ones((), device=g.device))
    g.add("grpo_grad_norm_pre_clip", pre_t)
    post = x.grad_norm_post_clip
    if post is None and x.max_grad_norm is not None:
        post = gradient.clipped_norm(pre_t, x.max_grad_norm)
    if post is not None:
        g.add("grpo_grad_norm_post_clip", torch.as_tensor(post, dtype=torch.float32, device=g.device))
    if x.max_grad_norm is not None:
        limit = torch.as_tensor(x.max_grad_norm, dtype=torch.float32, device=g.device)
        g.add("grpo_grad_clip_active_steps_total", (pre_t > limit).to(torch.int64))


def _update_size(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.params_before is not None and x.params_after is not None:
        g.add("grpo_param_relative_update", gradient.relative_update(x.params_before, x.params_after))
    if x.policy_version is not None and x.rollout_policy_version is not None:
        g.add("grpo_rollout_staleness_versions", float(x.policy_version - x.rollout_policy_version))


# ---- layer 2 ----------------------------------------------------------------------------------------------


def _rewards(g: _Gather, c: _Context) -> None:
    x, groups = c.x, c.groups
    if x.rewards is not None:
        g.add("grpo_completions_total", float(x.rewards.shape[0]))
    if groups is None:
        return
    named = {"total": x.rewards} if x.rewards is not None else {}
    named.update(x.reward_components)
    for component, values in named.items():
        stats = reward.reward_stats(values, groups)
        g.add("grpo_reward_mean", stats.mean, component=component)
        g.add("grpo_reward_group_std_mean", stats.group_std_mean, component=component)
        g.add("grpo_reward_group_range_mean", stats.group_range_mean, component=component)


def _advantages(g: _Gather, c: _Context) -> None:
    x, groups, cfg = c.x, c.groups, c.cfg
    if x.advantages is None or groups is None:
        return
    bounds = advantage_bounds(x.rewards, groups, cfg.advantage_norm)
    check = reward.advantage_check(x.advantages, x.loss_mask, groups, bounds, cfg.advantage_bound_rtol)
    g.add("grpo_advantage_abs_max", check.abs_max)
    g.add("grpo_advantage_over_bound_sequences_total", check.over_bound)
    populated = groups.sizes() > 0
    g.add("grpo_advantage_bound", reading(torch.where(populated, bounds, 0.0).amax(), populated.any()))


def _lengths(g: _Gather, c: _Context) -> None:
    x, qs = c.x, c.cfg.length_quantiles
    if x.completion_lengths is not None:
        outcomes = {"all": torch.ones_like(x.completion_lengths, dtype=torch.bool)}
        if x.correct is not None:
            outcomes |= {"correct": x.correct, "incorrect": ~x.correct}
        for outcome, members in outcomes.items():
            stats = reward.length_stats(x.completion_lengths, members, qs)
            g.summary("grpo_completion_length_tokens", stats.total, stats.count, stats.quantiles, qs, outcome=outcome)
    if x.truncated is not None:
        g.add("grpo_truncated_completions_total", x.truncated.sum())


# ---- layer 3 ----------------------------------------------------------------------------------------------


def _advantage_signs(g: _Gather, c: _Context) -> None:
    mask, token_adv = c.x.loss_mask, c.token_adv
    if mask is None or token_adv is None:
        return
    signs = samples.advantage_sign_tokens(token_adv, mask)
    for sign, value in zip(catalog.ADVANTAGE_SIGNS, signs, strict=True):
        g.add("grpo_update_tokens_total", value, advantage_sign=sign)
    g.add("grpo_zero_advantage_tokens_ratio", samples.zero_advantage_share(token_adv, mask))


def _importance_weights(g: _Gather, c: _Context) -> None:
    lr, qs = c.lr, c.cfg.ratio_quantiles
    if lr is None:
        return
    ess = samples.ess_ratio(lr)
    g.add("grpo_ess_ratio", ess.token, level="token")
    g.add("grpo_ess_ratio", ess.sequence, level="sequence")
    weights = samples.importance_weight_quantiles(lr, qs)
    total = torch.where(lr.valid, lr.ratio, 0.0).double().sum()
    g.summary("grpo_importance_weight", total, lr.valid.sum(), weights, qs)


def _clipping(g: _Gather, c: _Context) -> None:
    if c.lr is None or c.token_adv is None:
        return
    clip = samples.clip_counts(c.lr, c.token_adv, c.cfg.clip_eps_low, c.cfg.clip_eps_high)
    g.add("grpo_clipped_tokens_total", clip.upper, bound="upper")
    g.add("grpo_clipped_tokens_total", clip.lower, bound="lower")
    g.add("grpo_out_of_range_unclipped_tokens_total", clip.upper_unclipped, bound="upper")
    g.add("grpo_out_of_range_unclipped_tokens_total", clip.lower_unclipped, bound="lower")
    g.add("grpo_clipped_tokens_ratio", clip.upper_ratio, bound="upper")
    g.add("grpo_clipped_tokens_ratio", clip.lower_ratio, bound="lower")


def _zero_variance(g: _Gather, c: _Context) -> None:
    x, groups = c.x, c.groups
    if groups is None:
        return
    if x.rewards is not None:
        zv = samples.zero_variance_groups(x.rewards, groups, x.correct)
        g.add("grpo_groups_total", zv.groups)
        g.add("grpo_zero_variance_groups_total", zv.all_correct, outcome="all_correct")
        g.add("grpo_zero_variance_groups_total", zv.all_incorrect, outcome="all_incorrect")
        g.add("grpo_zero_variance_groups_total", zv.unknown, outcome="unknown")
        g.add("grpo_zero_variance_groups_ratio", zv.share)
    if x.prompt_solve_rate is not None:
        expected = samples.expected_zero_variance_ratio(x.prompt_solve_rate, groups)
        g.add("grpo_zero_variance_groups_expected_ratio", expected)


def _solve_rates(g: _Gather, c: _Context) -> None:
    x, groups, buckets = c.x, c.groups, c.cfg.solve_rate_buckets
    if x.correct is None or groups is None:
        return
    hist = samples.mixed_group_solve_rates(x.correct, groups, buckets)
    name = "grpo_mixed_group_solve_rate_ratio"
    for i, bound in enumerate((*buckets, math.inf)):
        g.add(name, hist.cumulative[i], "_bucket", le="+Inf" if bound == math.inf else format_quantile(bound))
    g.add(name, hist.total, "_sum")
    g.add(name, hist.count, "_count")


# ---- layer 4 ----------------------------------------------------------------------------------------------


def _entropy(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.loss_mask is not None and x.entropy is not None:
        ent = diversity.entropy_stats(x.entropy, x.loss_mask, c.cfg.entropy_top_fraction)
        g.add("grpo_entropy_mean_nats", ent.mean)
        g.add("grpo_entropy_top_mean_nats", ent.top_mean)


def _pass_at_k(g: _Gather, c: _Context) -> None:
    if c.x.correct is not None and c.groups is not None:
        for k in c.cfg.pass_ks:
            g.add("grpo_pass_at_k_ratio", diversity.pass_at_k(c.x.correct, c.groups, k), k=str(k))


def _distinct_completions(g: _Gather, c: _Context) -> None:
    x = c.x
    if x.completion_ids is None or c.groups is None:
        return
    positions = x.completion_mask
    if positions is None and x.completion_lengths is not None:
        positions = gradient.completion_positions(x.completion_lengths, x.completion_ids.shape[1])
    if positions is not None:
        ratio = diversity.unique_completion_ratio(x.completion_ids, positions, c.groups)
        g.add("grpo_unique_completions_ratio", ratio)


Block = Callable[[_Gather, _Context], None]

# Rollout-level metrics: once per rollout batch (groups, rewards, outcomes, lengths, engine vs trainer).
ROLLOUT_BLOCKS: tuple[Block, ...] = (
    _nonfinite_inputs,
    _engine_gap,
    _rewards,
    _lengths,
    _zero_variance,
    _solve_rates,
    _pass_at_k,
    _distinct_completions,
)
# Update-level metrics: per optimizer step (the ratio, the loss mask actually trained on, advantages, grads).
UPDATE_BLOCKS: tuple[Block, ...] = (
    _nonfinite_inputs,
    _log_ratio_checks,
    _mask_audit,
    _kl,
    _grad_norms,
    _update_size,
    _advantages,
    _advantage_signs,
    _importance_weights,
    _clipping,
    _entropy,
)
BLOCKS: tuple[Block, ...] = (*ROLLOUT_BLOCKS, *(b for b in UPDATE_BLOCKS if b not in ROLLOUT_BLOCKS))
