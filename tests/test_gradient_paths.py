"""Layer-1 paths the random-batch reference does not reach: completion masks, gradient lists, |dtheta|/|theta|."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step

CFG = MetricsConfig(group_size=2)


def test_loss_mask_audited_against_a_completion_mask():
    """Multi-turn layout: tool output (positions 2-3) is visible but not a completion token (seed 3.2)."""
    completion = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    loss = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # row 0 trains on a tool token
    lengths = completion.sum(1)
    m = compute_step(StepInputs(loss_mask=loss, completion_mask=completion, completion_lengths=lengths), CFG)
    assert m["grpo_loss_mask_outside_completion_tokens_total"] == 1
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 1
    fixed = compute_step(StepInputs(loss_mask=completion, completion_mask=completion, completion_lengths=lengths), CFG)
    assert fixed["grpo_loss_mask_outside_completion_tokens_total"] == 0
    assert fixed["grpo_loss_mask_length_mismatch_sequences_total"] == 0


def test_distinct_completions_use_the_completion_mask_when_given():
    ids = torch.tensor([[5, 6, 9, 9], [5, 6, 1, 2], [7, 7, 7, 7], [7, 7, 7, 8]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    m = compute_step(StepInputs(completion_ids=ids, completion_mask=mask), CFG)
    assert m["grpo_unique_completions_ratio"] == pytest.approx((1 / 2 + 2 / 2) / 2)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_grad_norms_from_a_gradient_list_match_torch_clipping(max_norm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model(torch.randn(11, 7)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    m = compute_step(StepInputs(grads=grads, max_grad_norm=max_norm), CFG)
    pre = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    post = math.sqrt(sum(p.grad.square().sum().item() for p in model.parameters()))
    assert m["grpo_grad_norm_pre_clip"] == pytest.approx(pre, rel=1e-6)
    assert m["grpo_grad_norm_post_clip"] == pytest.approx(post, rel=1e-5)
    assert m["grpo_grad_clip_active_steps_total"] == float(pre > max_norm)
    assert m["grpo_optimizer_steps_total"] == 1


def test_nonfinite_grad_norm_is_counted():
    m = compute_step(StepInputs(grad_norm_pre_clip=torch.tensor(math.inf), max_grad_norm=1.0), CFG)
    assert m['grpo_nonfinite_values_total{tensor="grad_norm"}'] == 1


def test_relative_parameter_update():
    before = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    after = [torch.tensor([3.0, 0.5]), torch.tensor([[4.0]])]
    m = compute_step(StepInputs(params_before=before, params_after=after), CFG)
    assert m["grpo_param_relative_update"] == pytest.approx(0.5 / 5.0)
    zero = compute_step(StepInputs(params_before=[torch.zeros(2)], params_after=[torch.ones(2)]), CFG)
    assert "grpo_param_relative_update" not in zero  # |theta| = 0: undefined, absent
