"""Advantage drawn from reward noise (seed 第 4 篇 2.2): a tiny spread that sigma-normalisation scales to a
full-size advantage, and which component supplies the variance of groups whose correctness ties."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional.groups import contiguous_groups, group_normalized_advantages
from grpo_exporter.functional.reward import noise_signal
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step

G = 8


def _run(prompts: int = 16, tied: int = 15, jitter: float = 0.002, seed: int = 0) -> dict[str, torch.Tensor]:
    """``prompts`` groups of G: the first ``tied`` all-correct (a mastered pool), the rest half right; a format
    component that pays 0.1 for the layout every completion has, plus a uniform jitter ``jitter`` wide."""
    gen = torch.Generator().manual_seed(seed)
    correct = torch.zeros(prompts, G, dtype=torch.bool)
    correct[:tied] = True
    correct[tied:, : G // 2] = True
    correctness = correct.float().flatten()
    fmt = 0.1 + jitter * torch.rand(prompts * G, generator=gen)
    return {"rewards": correctness + fmt, "correct": correct.flatten(), "correctness": correctness, "format": fmt}


def test_the_seeds_example_a_ten_thousandth_apart_becomes_a_full_size_advantage():
    """Seed 2.2: every answer scores 0.5000 but one 0.5001; after sigma the lone one is near (G-1)/sqrt(G)
    (2.47 for G = 8), and the group counts as noise against a scale of 1 (a 0/1 verifier's)."""
    rewards = torch.tensor([0.5] * (G - 1) + [0.5001])
    groups = contiguous_groups(G, G)
    advantage = group_normalized_advantages(rewards, groups, "unbiased", eps=0.0)
    assert advantage[-1].item() == pytest.approx(2.47, abs=0.01)
    signal = noise_signal(rewards, groups, 0.01, 1.0, sigma_normalised=True)
    assert signal.noise_groups.value == 1.0
    # without sigma (Dr. GRPO) the advantage stays 1e-4: no group counts
    assert noise_signal(rewards, groups, 0.01, 1.0, sigma_normalised=False).noise_groups.value == 0.0
    assert group_normalized_advantages(rewards, groups, "none")[-1].item() == pytest.approx(8.75e-5, rel=1e-2)


def test_a_jittery_format_component_supplies_every_tied_groups_variance():
    """The issue's case: a weak format component with a 0.002-wide noise term supplies all the variance of the
    groups a mastered pool leaves tied (15 of 16 here), each with |A| ~0.8 after sigma."""
    r = _run()
    groups = contiguous_groups(r["rewards"].numel(), G)
    components = {"correctness": r["correctness"], "format": r["format"]}
    signal = noise_signal(r["rewards"], groups, 0.01, None, True, r["correct"], components)
    assert signal.noise_groups.value == 15 / 16
    assert signal.tied_variance["format"].value == pytest.approx(1.0, rel=1e-4)  # the fp32 sum rounds it
    assert signal.tied_variance["correctness"].value == 0.0
    advantage = group_normalized_advantages(r["rewards"], groups, "unbiased")
    assert advantage[: 15 * G].abs().mean().item() == pytest.approx(0.8, abs=0.1)


def test_real_preferences_and_a_zero_one_verifier_are_no_noise():
    """A format reward of 0 or 0.1 (10% of the scale) is a weak but real preference, and so is partial credit
    for one position of seven at weight 0.5 (the world sweep's partial family: 0.071 of a 1.6 scale, 4.5%); a
    0/1 verifier spreads a group by 0 or the whole scale: none counts at the default 1%."""
    r = _run(jitter=0.0)
    n = r["rewards"].numel()
    groups = contiguous_groups(n, G)
    fmt = torch.where(torch.arange(n) % 3 == 0, 0.0, 0.1)
    assert noise_signal(r["correctness"] + fmt, groups, 0.01, 1.0, True).noise_groups.value == 0.0
    partial = 0.5 * torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(1)) / 7
    rewards = r["correctness"] + 0.1 + partial
    assert noise_signal(rewards, groups, 0.01, None, True).noise_groups.value == 0.0
    assert noise_signal(r["correctness"], groups, 0.01, None, True).noise_groups.value == 0.0


def test_without_a_scale_the_batch_range_is_the_scale_and_a_configured_scale_wins():
    """Every group tied and jittered: the batch's own range is the jitter, so nothing is noise against it;
    reward_scale 1.0 (the verifier's) shows every group as noise."""
    r = _run(tied=16)
    groups = contiguous_groups(r["rewards"].numel(), G)
    assert noise_signal(r["rewards"], groups, 0.01, None, True).noise_groups.value == 0.0
    assert noise_signal(r["rewards"], groups, 0.01, 1.0, True).noise_groups.value == 1.0


def test_the_step_publishes_both_readings_by_the_configured_normalisation():
    r = _run()
    inputs = StepInputs(rewards=r["rewards"], correct=r["correct"],
                        reward_components={"correctness": r["correctness"], "format": r["format"]})
    metrics = compute_step(inputs, MetricsConfig(group_size=G))
    assert metrics["grpo_noise_advantage_groups_ratio"] == 15 / 16
    assert metrics['grpo_reward_tied_variance_ratio{component="format"}'] == pytest.approx(1.0, rel=1e-4)
    dr_grpo = compute_step(inputs, MetricsConfig(group_size=G, advantage_norm="none"))
    assert dr_grpo["grpo_noise_advantage_groups_ratio"] == 0.0
    scaled = compute_step(StepInputs(rewards=r["rewards"]), MetricsConfig(group_size=G, noise_range_fraction=0.001))
    assert scaled["grpo_noise_advantage_groups_ratio"] == 0.0  # the jitter is above 0.1% of the batch's range
    assert 'grpo_reward_tied_variance_ratio{component="format"}' not in scaled  # no correct, no components
