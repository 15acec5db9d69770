"""One step in, every applicable metric out, with exactly one device-to-host transfer.

:func:`compute_step` runs each metric whose inputs were given, collects the device readings, packs every value
and presence flag into a single fp64 tensor and moves it to the host once (``tolist``). Keys are catalogue
sample keys (``Metric.key``): a metric name plus ``_sum``/``_count``/``_bucket`` suffixes and labels. Counter
and ``_sum``/``_count`` values are this step's increments; gauges and quantiles are this step's values.
Absent metrics (empty masks, no token of the gating sign...) are left out of the mapping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.catalog import format_quantile
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import diversity, gradient, reward, samples
from grpo_exporter.functional.groups import Groups, advantage_bounds
from grpo_exporter.functional.reading import Reading, always, reading
from grpo_exporter.inputs import StepInputs

StepMetrics = dict[str, float]


class _Gather:
    """Collects readings keyed by catalogue sample keys, then transfers them to the host in one go."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[str] = []
        self.values: list[Tensor] = []
        self.present: list[Tensor] = []
        self.host: StepMetrics = {}

    def add(self, name: str, value: Reading | Tensor | float, suffix: str = "", **labels: str) -> None:
        key = catalog.metric(name).key(suffix, **labels)
        if isinstance(value, int | float):
            self.host[key] = float(value)
            return
        r = value if isinstance(value, Reading) else always(value)
        self.keys.append(key)
        self.values.append(r.value.reshape(()).to(self.device, torch.float64))
        self.present.append(r.present.reshape(()).to(self.device, torch.float64))

    def quantiles(self, name: str, r: Reading, quantiles: Sequence[float], **labels: str) -> None:
        for i, q in enumerate(quantiles):
            self.add(name, Reading(r.value[i], r.present), quantile=format_quantile(q), **labels)

    def summary(self, name: str, total: Tensor, count: Tensor, r: Reading, qs: Sequence[float], **labels: str) -> None:
        self.quantiles(name, r, qs, **labels)
        self.add(name, total, "_sum", **labels)
        self.add(name, count, "_count", **labels)

    def transfer(self) -> StepMetrics:
        """The single device-to-host transfer of the step."""
        out = dict(self.host)
        if not self.keys:
            return out
        packed = torch.cat([torch.stack(self.values), torch.stack(self.present)]).tolist()
        m = len(self.keys)
        for i, key in enumerate(self.keys):
            if packed[m + i]:
                out[key] = packed[i]
        return out


def compute_step(inputs: StepInputs, config: MetricsConfig) -> StepMetrics:
    """Every metric the given inputs allow, as ``{sample key: float}``, with one host transfer.

    Raises :class:`~grpo_exporter.inputs.InputError` only for grouping that contradicts the config (N not
    a multiple of ``group_size`` without ``group_ids``); shapes and dtypes were checked by ``StepInputs``.
    """
    g = _Gather(inputs.device)
    groups = inputs.groups(config.group_size)
    mask = inputs.loss_mask
    with torch.no_grad():
        lr = None
        if mask is not None and inputs.logprobs is not None and inputs.old_logprobs is not None:
            lr = gradient.log_ratio(inputs.logprobs, inputs.old_logprobs, mask)
        token_adv = None
        if mask is not None and inputs.advantages is not None:
            token_adv = samples.token_advantages(inputs.advantages, mask.shape)
        _gradient_layer(g, inputs, config, lr)
        _reward_layer(g, inputs, config, groups)
        _samples_layer(g, inputs, config, groups, lr, token_adv)
        _diversity_layer(g, inputs, config, groups)
    return g.transfer()


def _nonfinite(g: _Gather, tensor: str, value: Tensor, mask: Tensor | None = None) -> None:
    g.add("grpo_nonfinite_values_total", gradient.nonfinite_count(value, mask), tensor=tensor)


def _gradient_layer(g: _Gather, x: StepInputs, cfg: MetricsConfig, lr: gradient.LogRatio | None) -> None:
    mask = x.loss_mask
    if mask is not None:
        for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy"):
            value = getattr(x, name)
            if value is not None:
                _nonfinite(g, name, value, mask)
    if x.advantages is not None and (x.advantages.dim() == 1 or mask is not None):
        _nonfinite(g, "advantages", x.advantages, None if x.advantages.dim() == 1 else mask)
    if x.rewards is not None:
        _nonfinite(g, "rewards", x.rewards)
    if isinstance(x.loss, Tensor):
        _nonfinite(g, "loss", x.loss)
    elif x.loss is not None:
        g.add("grpo_nonfinite_values_total", 0.0 if math.isfinite(x.loss) else 1.0, tensor="loss")

    if mask is not None and x.rollout_logprobs is not None and x.old_logprobs is not None:
        gap = gradient.engine_gap(x.rollout_logprobs, x.old_logprobs, mask, cfg.gap_quantiles)
        g.summary("grpo_engine_logprob_gap_nats", gap.total, gap.count, gap.quantiles, cfg.gap_quantiles)
        g.add("grpo_engine_logprob_gap_mean_nats", gap.mean)

    if lr is not None:
        bad_lr, bad_ratio = gradient.nonfinite_ratio_count(lr)
        g.add("grpo_nonfinite_values_total", bad_lr, tensor="log_ratio")
        g.add("grpo_nonfinite_values_total", bad_ratio, tensor="ratio")
        if x.on_policy:
            check = gradient.onpolicy_check(lr, cfg.clip_eps_low, cfg.clip_eps_high)
            g.add("grpo_onpolicy_outside_clip_tokens_total", check.outside)
            g.add("grpo_onpolicy_checked_tokens_total", check.checked)
            g.add("grpo_onpolicy_outside_clip_ratio", check.outside_ratio)
            g.add("grpo_onpolicy_log_ratio_abs_max_nats", check.abs_log_ratio_max)
        if cfg.log_ratio_clamp is not None:
            hits = gradient.clamp_hits(lr, cfg.log_ratio_clamp)
            g.add("grpo_log_ratio_clamp_hit_tokens_total", hits.hits)
            g.add("grpo_log_ratio_clamp_hit_ratio", hits.hit_ratio)

    if mask is not None and x.completion_lengths is not None:
        audit = gradient.mask_audit(mask, x.completion_lengths, x.completion_mask)
        g.add("grpo_loss_mask_length_mismatch_sequences_total", audit.length_mismatch)
        g.add("grpo_loss_mask_empty_sequences_total", audit.empty)
        g.add("grpo_loss_mask_outside_completion_tokens_total", audit.outside_completion)

    if mask is not None and x.logprobs is not None and x.ref_logprobs is not None:
        g.add("grpo_kl_ref_nats", gradient.kl_k3(x.logprobs, x.ref_logprobs, mask))

    _grad_norms(g, x)
    if x.params_before is not None and x.params_after is not None:
        g.add("grpo_param_relative_update", gradient.relative_update(x.params_before, x.params_after))
    if x.policy_version is not None and x.rollout_policy_version is not None:
        g.add("grpo_rollout_staleness_versions", float(x.policy_version - x.rollout_policy_version))


def _grad_norms(g: _Gather, x: StepInputs) -> None:
    pre = x.grad_norm_pre_clip
    if pre is None and x.grads is not None:
        pre = gradient.total_norm(x.grads)
    if pre is None:
        return
    pre_t = torch.as_tensor(pre, dtype=torch.float32, device=g.device)
    finite = torch.isfinite(pre_t)
    g.add("grpo_nonfinite_values_total", (~finite).to(torch.int64), tensor="grad_norm")
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


def _reward_layer(g: _Gather, x: StepInputs, cfg: MetricsConfig, groups: Groups | None) -> None:
    if x.rewards is not None:
        g.add("grpo_completions_total", float(x.rewards.shape[0]))
    if groups is not None:
        named = {"total": x.rewards} if x.rewards is not None else {}
        named.update(x.reward_components)
        for component, values in named.items():
            stats = reward.reward_stats(values, groups)
            g.add("grpo_reward_mean", stats.mean, component=component)
            g.add("grpo_reward_group_std_mean", stats.group_std_mean, component=component)
            g.add("grpo_reward_group_range_mean", stats.group_range_mean, component=component)

    if x.advantages is not None and groups is not None:
        bounds = advantage_bounds(x.rewards, groups, cfg.advantage_norm)
        check = reward.advantage_check(x.advantages, x.loss_mask, groups, bounds, cfg.advantage_bound_rtol)
        g.add("grpo_advantage_abs_max", check.abs_max)
        g.add("grpo_advantage_over_bound_sequences_total", check.over_bound)
        populated = groups.sizes() > 0
        g.add("grpo_advantage_bound", reading(torch.where(populated, bounds, 0.0).amax(), populated.any()))

    if x.completion_lengths is not None:
        outcomes = {"all": torch.ones_like(x.completion_lengths, dtype=torch.bool)}
        if x.correct is not None:
            outcomes |= {"correct": x.correct, "incorrect": ~x.correct}
        for outcome, members in outcomes.items():
            stats = reward.length_stats(x.completion_lengths, members, cfg.length_quantiles)
            g.summary(
                "grpo_completion_length_tokens", stats.total, stats.count, stats.quantiles, cfg.length_quantiles,
                outcome=outcome,
            )
    if x.truncated is not None:
        g.add("grpo_truncated_completions_total", x.truncated.sum())


def _samples_layer(
    g: _Gather,
    x: StepInputs,
    cfg: MetricsConfig,
    groups: Groups | None,
    lr: gradient.LogRatio | None,
    token_adv: Tensor | None,
) -> None:
    mask = x.loss_mask
    if mask is not None and token_adv is not None:
        signs = samples.advantage_sign_tokens(token_adv, mask)
        for sign, value in zip(catalog.ADVANTAGE_SIGNS, signs, strict=True):
            g.add("grpo_update_tokens_total", value, advantage_sign=sign)
        g.add("grpo_zero_advantage_tokens_ratio", samples.zero_advantage_share(token_adv, mask))

    if lr is not None:
        ess = samples.ess_ratio(lr)
        g.add("grpo_ess_ratio", ess.token, level="token")
        g.add("grpo_ess_ratio", ess.sequence, level="sequence")
        weights = samples.importance_weight_quantiles(lr, cfg.ratio_quantiles)
        count = lr.valid.sum()
        total = torch.where(lr.valid, torch.exp(lr.value), 0.0).double().sum()
        g.summary("grpo_importance_weight", total, count, weights, cfg.ratio_quantiles)
        if token_adv is not None:
            clip = samples.clip_counts(lr, token_adv, cfg.clip_eps_low, cfg.clip_eps_high)
            g.add("grpo_clipped_tokens_total", clip.upper, bound="upper")
            g.add("grpo_clipped_tokens_total", clip.lower, bound="lower")
            g.add("grpo_out_of_range_unclipped_tokens_total", clip.upper_unclipped, bound="upper")
            g.add("grpo_out_of_range_unclipped_tokens_total", clip.lower_unclipped, bound="lower")
            g.add("grpo_clipped_tokens_ratio", clip.upper_ratio, bound="upper")
            g.add("grpo_clipped_tokens_ratio", clip.lower_ratio, bound="lower")

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
    if x.correct is not None:
        hist = samples.mixed_group_solve_rates(x.correct, groups, cfg.solve_rate_buckets)
        name = "grpo_mixed_group_solve_rate_ratio"
        for i, bound in enumerate((*cfg.solve_rate_buckets, float("inf"))):
            g.add(name, hist.cumulative[i], "_bucket", le="+Inf" if bound == float("inf") else format_quantile(bound))
        g.add(name, hist.total, "_sum")
        g.add(name, hist.count, "_count")


def _diversity_layer(g: _Gather, x: StepInputs, cfg: MetricsConfig, groups: Groups | None) -> None:
    if x.loss_mask is not None and x.entropy is not None:
        ent = diversity.entropy_stats(x.entropy, x.loss_mask, cfg.entropy_top_fraction)
        g.add("grpo_entropy_mean_nats", ent.mean)
        g.add("grpo_entropy_top_mean_nats", ent.top_mean)
    if groups is None:
        return
    if x.correct is not None:
        for k in cfg.pass_ks:
            g.add("grpo_pass_at_k_ratio", diversity.pass_at_k(x.correct, groups, k), k=str(k))
    positions = x.completion_mask
    if positions is None and x.completion_lengths is not None and x.completion_ids is not None:
        positions = gradient.completion_positions(x.completion_lengths, x.completion_ids.shape[1])
    if x.completion_ids is not None and positions is not None:
        g.add("grpo_unique_completions_ratio", diversity.unique_completion_ratio(x.completion_ids, positions, groups))
