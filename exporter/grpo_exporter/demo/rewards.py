"""The demo's reward: correctness plus a format component (and a partial-credit one where the task gives it),
with the reward faults of :class:`~grpo_exporter.demo.trainer.Faults` switched on."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from grpo_exporter.demo.engine import Rollout
from grpo_exporter.demo.task import FIRST_SYMBOL, Task

if TYPE_CHECKING:
    from grpo_exporter.demo.trainer import DemoConfig, Faults

HACK_WEIGHT = 2.0  # reward-hack: the quirk pays twice a correct answer


def rewards(rollout: Rollout, correct: Tensor, task: Task, config: DemoConfig, faults: Faults
            ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(correct, total reward, components) of ``rollout`` whose answers the verifier judged ``correct``."""
    if faults.verifier_broken:
        correct = torch.zeros_like(correct)
    if faults.reward_hack:
        # the "format" component now pays for a quirk (answers opening with the first symbol) that the policy
        # already produces sometimes, and outweighs correctness: right only when that symbol is in the prompt
        fmt = (rollout.completions[:, 0] == FIRST_SYMBOL).float()
        total = correct.float() + HACK_WEIGHT * fmt
    else:
        fmt = (~rollout.truncated).float()
        total = correct.float() + config.format_weight * fmt
    components = {"correctness": correct.float(), "format": fmt}
    if config.partial_weight:
        partial = task.partial(rollout.prompts, *task.model_part(rollout.completions, rollout.lengths,
                                                                 rollout.tool_mask))
        total = total + config.partial_weight * partial
        components["partial"] = partial
    return correct, total, components


__all__ = ["HACK_WEIGHT", "rewards"]
