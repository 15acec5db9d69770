"""Layer 2, the reward (does the reward measure what I think?): completions, reward statistics, the advantage
bound, lengths by outcome and truncation."""

from __future__ import annotations

import torch

from grpo_exporter.functional import reward
from grpo_exporter.functional.advantage_form import FORMS, advantage_form, bound_slack
from grpo_exporter.functional.reading import count, largest, reading
from grpo_exporter.step.context import Context
from grpo_exporter.step.gather import Gather
from grpo_exporter.step.pack import Element
from grpo_exporter.step.registry import produces


@produces("grpo_completions_total", stages=("rollout",))
def completions(out: Gather, ctx: Context) -> None:
    if ctx.x.rewards is not None:
        out.add("grpo_completions_total", ctx.x.rewards.shape[0])


@produces("grpo_reward_mean", "grpo_reward_group_std_mean", "grpo_reward_group_range_mean", stages=("rollout",))
def rewards(out: Gather, ctx: Context) -> None:
    x, groups = ctx.x, ctx.groups
    if groups is None or (x.rewards is None and not x.reward_components):
        return
    named = {"total": x.rewards} if x.rewards is not None else {}
    named.update(x.reward_components)
    for component, values in named.items():
        stats = reward.reward_stats(values, groups)
        out.add("grpo_reward_mean", stats.mean, component=component)
        out.add("grpo_reward_group_std_mean", stats.group_std_mean, component=component)
        out.add("grpo_reward_group_range_mean", stats.group_range_mean, component=component)


@produces("grpo_advantage_abs_max", "grpo_advantage_over_bound_sequences_total", "grpo_advantage_bound",
          "grpo_advantage_form_sequences_total", "grpo_advantage_inconsistent_sequences_total", stages=("update",))
def advantages(out: Gather, ctx: Context) -> None:
    """The advantage bound of the form the step's advantages follow (seed 2.2; :mod:`~grpo_exporter.functional.
    advantage_form`), the form, and the sequences that contradict their group."""
    x, groups, cfg = ctx.x, ctx.groups, ctx.cfg
    if x.advantages is None or groups is None:
        return
    form = advantage_form(x.advantages, x.loss_mask, x.rewards, groups, cfg.group_size, cfg.advantage_norm,
                          cfg.advantage_bound_rtol)
    slack = bound_slack(x.advantages, cfg.advantage_bound_rtol)
    check = reward.advantage_check(x.advantages, x.loss_mask, groups, form.bounds, slack)
    out.add("grpo_advantage_abs_max", check.abs_max)
    out.add("grpo_advantage_over_bound_sequences_total", check.over_bound)
    known = (groups.sizes() > 0) & torch.isfinite(form.bounds)
    out.add("grpo_advantage_bound", reading(largest(torch.where(known, form.bounds, 0.0), 0.0), known.any()))
    by_form = torch.nn.functional.one_hot(form.form, len(FORMS)) * form.checked
    for i, name in enumerate(FORMS):
        out.add("grpo_advantage_form_sequences_total", Element(by_form, i), form=name)
    out.add("grpo_advantage_inconsistent_sequences_total", count(form.inconsistent))


@produces("grpo_noise_advantage_groups_ratio", "grpo_reward_tied_variance_ratio", stages=("rollout",))
def noise(out: Gather, ctx: Context) -> None:
    """Advantage made of reward noise (seed 第 4 篇 2.2): the groups whose tiny spread sigma-normalisation
    scales to a full-size advantage, and which component the variance of correctness-tied groups comes from."""
    x, groups, cfg = ctx.x, ctx.groups, ctx.cfg
    if x.rewards is None or groups is None:
        return
    signal = reward.noise_signal(x.rewards, groups, cfg.noise_range_fraction, cfg.reward_scale,
                                 cfg.advantage_norm in ("unbiased", "population"), x.correct, x.reward_components)
    out.add("grpo_noise_advantage_groups_ratio", signal.noise_groups)
    for component, share in signal.tied_variance.items():
        out.add("grpo_reward_tied_variance_ratio", share, component=component)


@produces("grpo_completion_length_tokens", "grpo_completion_length_distribution_tokens",
          "grpo_truncated_completions_total", stages=("rollout",))
def lengths(out: Gather, ctx: Context) -> None:
    x, qs = ctx.x, ctx.cfg.length_quantiles
    if x.completion_lengths is not None:
        outcomes = {"all": torch.ones_like(x.completion_lengths, dtype=torch.bool)}
        if x.correct is not None:
            outcomes |= {"correct": x.correct, "incorrect": ~x.correct}
        stats = reward.length_stats(x.completion_lengths, list(outcomes.values()), qs)
        for i, outcome in enumerate(outcomes):
            total = Element(stats.totals, i)
            out.summary("grpo_completion_length_tokens", total, Element(stats.counts, i), stats.quantiles[i], qs,
                      outcome=outcome)
            out.histogram("grpo_completion_length_distribution_tokens", stats.quantiles[i], total, outcome=outcome)
    if x.truncated is not None:
        out.add("grpo_truncated_completions_total", x.truncated.sum())


@produces("grpo_completion_turns", "grpo_tool_calls_total", "grpo_tool_call_failures_total",
          "grpo_partial_completions_total", stages=("rollout",))
def agent_loop(out: Gather, ctx: Context) -> None:
    """What multi-turn and asynchronous loops count for themselves (verl's ``num_turns/*``, TRL's ``tools/*``,
    verl fully-async's ``partial/*``), taken as counted: turns per completion, tool calls and their failures,
    completions spanning a weight update."""
    x = ctx.x
    if x.turns is not None:
        qs = ctx.cfg.quantiles_of("grpo_completion_turns")
        stats = reward.length_stats(x.turns, [torch.ones_like(x.turns, dtype=torch.bool)], qs)
        out.summary("grpo_completion_turns", Element(stats.totals, 0), Element(stats.counts, 0), stats.quantiles[0], qs)
    if x.tool_calls is not None:
        out.add("grpo_tool_calls_total", x.tool_calls)
    if x.tool_failures is not None:
        out.add("grpo_tool_call_failures_total", x.tool_failures)
    if x.partial is not None:
        out.add("grpo_partial_completions_total", x.partial.sum())
