"""Tool spans inside multi-turn completions (``tool_mask``: the positions the environment wrote): the mask audit
tells loss on tool output (a layer-1 fault of its own) and a length that counts tool tokens (a span) from a mask
bug, and every other reading is of the model's own tokens."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.recorder.triggers import triggers_of
from grpo_exporter.runtime import guard
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.step import compute_step

# two completions of one turn-tool-turn layout, 9 positions: model 3, tool 2, model 2, padding 2
MODEL = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0, 0]] * 2, dtype=torch.bool)
TOOL = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0, 0]] * 2, dtype=torch.bool)
WINDOW = MODEL | TOOL
LENGTHS = torch.tensor([5, 5])  # the model's tokens


def _audit(loss_mask: torch.Tensor, lengths: torch.Tensor = LENGTHS, tool: bool = True) -> dict[str, float]:
    inputs = StepInputs(loss_mask=loss_mask, completion_lengths=lengths, completion_mask=WINDOW,
                        tool_mask=TOOL if tool else None)
    return compute_step(inputs, MetricsConfig(group_size=2))


def test_a_right_mask_over_tool_spans_is_no_fault():
    m = _audit(MODEL)
    assert m["grpo_loss_mask_tool_tokens_total"] == 0
    assert m["grpo_completion_length_tool_span_sequences_total"] == 0
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    assert m["grpo_loss_mask_outside_completion_tokens_total"] == 0


def test_without_a_completion_mask_a_completion_spans_its_model_and_tool_tokens():
    """The lengths are the model's tokens (5), the completion is 7 positions (3 model, 2 tool, 2 model): a loss
    mask on the model's tokens is inside it (before, t < 5 put the last turn outside), one on the padding
    after it is not."""
    def audit(loss_mask: torch.Tensor) -> dict[str, float]:
        return compute_step(StepInputs(loss_mask=loss_mask, completion_lengths=LENGTHS, tool_mask=TOOL),
                            MetricsConfig(group_size=2))

    assert audit(MODEL)["grpo_loss_mask_outside_completion_tokens_total"] == 0
    padded = MODEL.clone()
    padded[:, 7] = True
    assert audit(padded)["grpo_loss_mask_outside_completion_tokens_total"] == 2


def test_loss_on_tool_output_is_its_own_reason():
    """verl #4412, slime #1370: the loss mask covers the tool's response (2 tokens a completion). The lengths
    still match the model's tokens: the fault is the tool tokens, named, not a length mismatch."""
    m = _audit(WINDOW)
    assert m["grpo_loss_mask_tool_tokens_total"] == 4
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    violations = guard.check(m, MonitorConfig(run="r", group_size=2))
    assert [v.alert for v in violations] == ["GRPOLossOnToolTokens"]
    # and the flight recorder's mask trigger keeps the steps around it
    assert triggers_of(m, MonitorConfig(run="r", group_size=2), spike=False) == ("mask_mismatch",)


def test_a_length_measured_as_a_span_is_told_from_a_mask_bug():
    """OpenRLHF PR #1252: the length counts the tool tokens (7 = 5 model + 2 tool). With the tool mask it is a
    length convention (its own counter, layer 2); without it, the same batch reads as a loss-mask mismatch, the
    false layer-1 page this input removes. A length wrong in another way is still a mismatch."""
    span = torch.tensor([7, 7])
    m = _audit(MODEL, span)
    assert m["grpo_completion_length_tool_span_sequences_total"] == 2
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    assert guard.check(m, MonitorConfig(run="r", group_size=2)) == []
    assert _audit(MODEL, span, tool=False)["grpo_loss_mask_length_mismatch_sequences_total"] == 2
    odd = _audit(MODEL, torch.tensor([6, 5]))
    assert (odd["grpo_loss_mask_length_mismatch_sequences_total"],
            odd["grpo_completion_length_tool_span_sequences_total"]) == (1, 0)


def test_the_engine_gap_and_non_finite_counts_read_the_models_tokens_only():
    """The engine reports no log-prob for tokens it did not sample (NaN on tool output, as verl's agent loop
    leaves them) and the loss covers the tool span: with the tool mask the gap is that of the model's 5 tokens
    and no NaN is counted (the fault is the audit's); without it the NaN would read as a numeric fault."""
    old = torch.full((2, 9), -1.0)
    rollout = old + 0.01
    rollout[TOOL] = float("nan")
    inputs = {"loss_mask": WINDOW, "old_logprobs": old, "rollout_logprobs": rollout, "completion_mask": WINDOW}
    m = compute_step(StepInputs(**inputs, tool_mask=TOOL), MetricsConfig(group_size=2))
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(0.01, abs=1e-6)
    assert m["grpo_engine_logprob_gap_nats_count"] == 10
    assert m['grpo_nonfinite_values_total{tensor="rollout_logprobs"}'] == 0
    bare = compute_step(StepInputs(**inputs), MetricsConfig(group_size=2))
    assert bare['grpo_nonfinite_values_total{tensor="rollout_logprobs"}'] == 4
    assert math.isclose(bare["grpo_engine_logprob_gap_nats_count"], 10)  # the NaN tokens leave the gap's count


def test_a_tool_mask_of_the_wrong_shape_is_named():
    with pytest.raises(InputError, match="tool_mask"):
        StepInputs(loss_mask=MODEL, tool_mask=TOOL[:, :5])


def test_the_engine_gap_per_turn_shows_a_gap_that_compounds_at_each_tool_boundary():
    """verl PR #6921: a separator dropped at each tool boundary, the mismatch "compounds each turn". Six model
    turns of 2 tokens between five tool spans of 1: the gap 0.01 x the turn; turns 5 and 6 read together as 5+
    (0.055), and the one mean over all tokens (0.035) hides where it grows."""
    width = 6 * 3 - 1
    turn_of = torch.arange(width) // 3 + 1
    tool = (torch.arange(width) % 3 == 2).unsqueeze(0).repeat(2, 1)
    model = ~tool
    old = torch.full((2, width), -1.0)
    rollout = old + 0.01 * turn_of.float()
    rollout[tool] = float("nan")
    m = compute_step(StepInputs(loss_mask=model, old_logprobs=old, rollout_logprobs=rollout, tool_mask=tool),
                     MetricsConfig(group_size=2))
    got = [m[f'grpo_engine_logprob_gap_turn_mean_nats{{turn="{t}"}}'] for t in ("1", "2", "3", "4", "5+")]
    assert got == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.055], abs=1e-6)
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(0.035, abs=1e-6)
    # one turn only: turns 2.. are absent, not 0
    flat = torch.zeros(2, 9)
    single = compute_step(StepInputs(loss_mask=MODEL, old_logprobs=flat, rollout_logprobs=flat,
                                     tool_mask=torch.zeros(2, 9, dtype=torch.bool)), MetricsConfig(group_size=2))
    assert 'grpo_engine_logprob_gap_turn_mean_nats{turn="1"}' in single
    assert 'grpo_engine_logprob_gap_turn_mean_nats{turn="2"}' not in single
