"""DAPO's dynamic sampling for the demo's loop (seed 第 4 篇 4.1-4.3): generation rounds until the batch holds
only groups with both outcomes, and the filter's counts a real loop hands the monitor (``generated_groups``,
``filtered_all_correct_groups``, ``filtered_all_incorrect_groups``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_exporter.demo.engine import Rollout


def fill(draw: Callable[[], Rollout], correct: Callable[[Rollout], Tensor], prompts: int, group_size: int,
         rounds: int) -> tuple[Rollout, dict[str, int]]:
    """Rounds of ``draw()`` (``prompts`` groups each) until ``prompts`` groups with both outcomes are kept, at most
    ``rounds`` (then topped up with the last round's filtered groups); the batch, and the filter's counts."""
    counts = {"generated_groups": 0, "filtered_all_correct_groups": 0, "filtered_all_incorrect_groups": 0}
    parts: list[tuple[Rollout, Tensor]] = []
    kept = 0
    for _ in range(rounds):
        rollout = draw()
        hits = correct(rollout).view(-1, group_size).sum(dim=1)
        counts["generated_groups"] += len(hits)
        counts["filtered_all_correct_groups"] += int((hits == group_size).sum())
        counts["filtered_all_incorrect_groups"] += int((hits == 0).sum())
        mixed = ((hits > 0) & (hits < group_size)).nonzero().squeeze(1)
        parts.append((rollout, mixed[: prompts - kept]))
        kept += len(parts[-1][1])
        if kept == prompts:
            break
    if kept < prompts:  # the pool cannot fill the batch: the last round's filtered groups
        last, chosen = parts[-1]
        filtered = torch.ones(prompts, dtype=torch.bool)
        filtered[chosen] = False
        parts[-1] = (last, torch.cat([chosen, filtered.nonzero().squeeze(1)[: prompts - kept]]))
    return _concat([_groups(r, chosen, group_size) for r, chosen in parts]), counts


def _groups(rollout: Rollout, groups: Tensor, group_size: int) -> Rollout:
    """The rows of ``groups`` (group indices) of a rollout."""
    rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()
    return Rollout(rollout.prompts[rows], rollout.prompt_ids[rows], rollout.completions[rows], rollout.lengths[rows],
                   rollout.rollout_logprobs[rows], rollout.truncated[rows], rollout.policy_version,
                   None if rollout.tool_mask is None else rollout.tool_mask[rows],
                   None if rollout.routing is None else rollout.routing[rows])


def _concat(parts: list[Rollout]) -> Rollout:
    """Rollouts of one policy version, one after the other."""
    tool = [p.tool_mask for p in parts if p.tool_mask is not None]
    routing = [p.routing for p in parts if p.routing is not None]
    return Rollout(torch.cat([p.prompts for p in parts]), torch.cat([p.prompt_ids for p in parts]),
                   torch.cat([p.completions for p in parts]), torch.cat([p.lengths for p in parts]),
                   torch.cat([p.rollout_logprobs for p in parts]), torch.cat([p.truncated for p in parts]),
                   parts[0].policy_version, torch.cat(tool) if tool else None, torch.cat(routing) if routing else None)


__all__ = ["fill"]
