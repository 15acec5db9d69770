"""Staleness as asynchronous frameworks define it (verl fully-async's trajectory staleness, PR #7569): per
completion, the policy versions since its oldest token was generated, weighted by its loss tokens; and the
completions a rollout aborted."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.step import compute_step
from monitor_helpers import registry_value


def _mask(lengths: list[int], width: int = 8) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def test_a_long_old_trajectory_weighs_its_tokens():
    """Two completions: 6 loss tokens 3 versions old (a partial rollout resumed twice), 2 tokens fresh: the
    token-weighted mean is (6 x 3 + 2 x 0) / 8 = 2.25 where their per-completion mean says 1.5; the max is 3. A
    row without a loss token (an aborted sample left in the batch) weighs nothing and sets no max."""
    inputs = StepInputs(loss_mask=_mask([6, 2, 0]), staleness=torch.tensor([3, 0, 9]))
    metrics = compute_step(inputs, MetricsConfig(group_size=3))
    assert metrics["grpo_token_staleness_mean_versions"] == 2.25
    assert metrics["grpo_token_staleness_max_versions"] == 3.0


def test_micro_steps_join_into_the_steps_token_weighted_staleness():
    """Two micro-batches of one optimizer step read as one batch: the mean over all their tokens, the max of
    both (the stitched rows, not the mean of two means)."""
    with GRPOMonitor(run="stale", group_size=2, port=None, guard="off") as mon:
        mon.observe_update(0, loss_mask=_mask([6, 2]), staleness=torch.tensor([3, 0]))
        mon.observe_update(0, loss_mask=_mask([8, 8]), staleness=torch.tensor([1, 1]))
        mon.end_step()
        assert registry_value(mon, "grpo_token_staleness_mean_versions") == pytest.approx((18 + 16) / 24)
        assert registry_value(mon, "grpo_token_staleness_max_versions") == 3.0


def test_aborted_completions_are_counted_and_bad_values_named():
    with GRPOMonitor(run="aborted", group_size=2, port=None, guard="off") as mon:
        for step in range(2):
            mon.observe_rollout(step, rewards=torch.tensor([1.0, 0.0]), aborted_completions=3)
        assert registry_value(mon, "grpo_aborted_completions_total") == 6.0
    with pytest.raises(InputError, match="aborted_completions"):
        StepInputs(aborted_completions=-1)
    with pytest.raises(InputError, match=r"staleness.*integer"):
        StepInputs(loss_mask=_mask([1, 1]), staleness=torch.tensor([0.5, 1.0]))
    with pytest.raises(InputError, match="staleness"):
        StepInputs(loss_mask=_mask([1, 1]), staleness=torch.tensor([1, 2, 3]))
