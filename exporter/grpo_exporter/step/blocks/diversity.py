"""Layer 4, diversity (does the policy still read the question?): entropy, pass@k, distinct completions."""

from __future__ import annotations

import torch

from grpo_exporter.functional import diversity
from grpo_exporter.functional.reading import fraction
from grpo_exporter.step.context import Context
from grpo_exporter.step.gather import Gather
from grpo_exporter.step.pack import scalar
from grpo_exporter.step.registry import produces


@produces("grpo_entropy_mean_nats", "grpo_entropy_top_mean_nats", "grpo_token_entropy_nats", stages=("update",))
def entropy(out: Gather, ctx: Context) -> None:
    x = ctx.x
    if x.loss_mask is not None and x.entropy is not None:
        masked = ctx.masked("entropy")
        ent = diversity.entropy_stats(masked, ctx.tokens - ctx.nonfinite(masked), ctx.cfg.entropy_top_fraction)
        out.add("grpo_entropy_mean_nats", ent.mean)
        out.add("grpo_entropy_top_mean_nats", ent.top_mean)
        out.histogram("grpo_token_entropy_nats", ent.top_mean, ent.mean.numerator)
    elif x.entropy is None and x.entropy_mean is not None:  # a framework's own token mean (verl, OpenRLHF)
        mean = scalar(x.entropy_mean, torch.float64, out.device)
        ok = torch.isfinite(mean)  # a non-finite report is absent, never published
        out.add("grpo_entropy_mean_nats", fraction(torch.where(ok, mean, 0.0), ok.double()))


@produces("grpo_pass_at_k_ratio", stages=("rollout",))
def pass_at_k(out: Gather, ctx: Context) -> None:
    if ctx.x.correct is not None and ctx.groups is not None:
        ks = ctx.cfg.pass_ks
        out.each("grpo_pass_at_k_ratio", diversity.pass_at_ks(ctx.x.correct, ctx.groups, ks), "k", [str(k) for k in ks])


@produces("grpo_unique_completions_ratio", "grpo_repeated_wrong_groups_ratio", stages=("rollout",))
def distinct_completions(out: Gather, ctx: Context) -> None:
    x = ctx.x
    positions = ctx.positions
    if x.completion_ids is None or ctx.groups is None or positions is None:
        return
    out.add("grpo_unique_completions_ratio", diversity.unique_completion_ratio(x.completion_ids, positions, ctx.groups))
    if x.correct is not None:
        copies = diversity.copies_in_group(x.completion_ids, positions, ctx.groups)
        out.add("grpo_repeated_wrong_groups_ratio", diversity.repeated_wrong_groups(copies, x.correct, ctx.groups))
