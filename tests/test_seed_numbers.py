"""The seed's own numbers, reproduced by the library (seed = shared/seed/000_8a3487d064520aca.txt)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import diversity, gradient, samples
from grpo_exporter.functional.groups import (
    advantage_bound,
    contiguous_groups,
    group_normalized_advantages,
)
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step


def binary_group(correct: int, size: int) -> torch.Tensor:
    return torch.tensor([1.0] * correct + [0.0] * (size - correct))


@pytest.mark.parametrize(
    ("p", "a_correct", "a_incorrect"),
    [(0.5, 1.00, -1.00), (0.9, 0.33, -3.00), (0.1, 3.00, -0.33)],
)
def test_sigma_normalised_binary_advantages(p, a_correct, a_incorrect):
    """Seed §二 table (population std, 10 answers): p=0.5 -> +-1.00; 0.9 -> +0.33/-3.00; 0.1 -> +3.00/-0.33."""
    rewards = binary_group(round(p * 10), 10)
    adv = group_normalized_advantages(rewards, contiguous_groups(10, 10), "population", eps=0.0)
    assert round(adv[0].item(), 2) == a_correct
    assert round(adv[-1].item(), 2) == a_incorrect
    assert math.isclose(adv[0].item(), math.sqrt((1 - p) / p), rel_tol=1e-6)  # seed 2.1 general formula
    assert math.isclose(adv.sum().item(), 0.0, abs_tol=1e-5)


def test_dr_grpo_advantages_drop_sigma():
    """Seed §三: without sigma the 9-right-1-wrong group gets +0.1 / -0.9."""
    adv = group_normalized_advantages(binary_group(9, 10), contiguous_groups(10, 10), "none")
    assert adv[0].item() == pytest.approx(0.1)
    assert adv[-1].item() == pytest.approx(-0.9)


def test_advantage_bounds():
    """Seed 2.2: unbiased std bound (G-1)/sqrt(G): G=16 -> 3.75, G=8 -> 2.47; population std sqrt(G-1)."""
    assert advantage_bound(16, "unbiased") == 3.75
    assert round(advantage_bound(8, "unbiased"), 2) == 2.47
    for g in (2, 4, 8, 16, 64):
        assert advantage_bound(g, "population") == pytest.approx(math.sqrt(g - 1))


@pytest.mark.parametrize("norm", ["unbiased", "population"])
@pytest.mark.parametrize("g", [2, 8, 16, 33])
def test_bound_is_attained_by_a_lone_minority(norm, g):
    adv = group_normalized_advantages(binary_group(1, g), contiguous_groups(g, g), norm, eps=0.0)
    assert adv.abs().max().item() == pytest.approx(advantage_bound(g, norm), rel=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    g=st.integers(2, 64),
    prompts=st.integers(1, 6),
    binary=st.booleans(),
    norm=st.sampled_from(["unbiased", "population"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_no_group_ever_exceeds_the_bound(g, prompts, binary, norm, seed):
    """Randomised: binary or continuous rewards (the bound holds for both, seed 2.2), any G."""
    gen = torch.Generator().manual_seed(seed)
    n = g * prompts
    rewards = (torch.rand(n, generator=gen) < torch.rand(1, generator=gen)).float() if binary else torch.rand(
        n, generator=gen
    ) * 10 ** torch.randint(-4, 3, (1,), generator=gen).float()
    groups = contiguous_groups(n, g)
    adv = group_normalized_advantages(rewards, groups, norm, eps=0.0)
    assert adv.abs().max().item() <= advantage_bound(g, norm) * (1 + 1e-5)
    cfg = MetricsConfig(group_size=g, advantage_norm=norm)
    metrics = compute_step(StepInputs(rewards=rewards, advantages=adv), cfg)
    assert metrics["grpo_advantage_over_bound_sequences_total"] == 0


def test_advantage_above_bound_is_counted():
    rewards = binary_group(1, 16)
    adv = group_normalized_advantages(rewards, contiguous_groups(16, 16), "unbiased", eps=0.0)
    adv[0] = 5.0  # the "A=5" of the seed's notes: above 3.75, a data or reward bug
    metrics = compute_step(StepInputs(rewards=rewards, advantages=adv), MetricsConfig(group_size=16))
    assert metrics["grpo_advantage_over_bound_sequences_total"] == 1
    assert metrics["grpo_advantage_bound"] == 3.75
    assert metrics["grpo_advantage_abs_max"] == 5.0


def test_batch_scaled_advantages_exceed_the_group_bound_legitimately_and_are_not_judged_by_it():
    """TRL's scale_rewards="batch" divides group-centred rewards by the whole batch's std, which can be far below
    one group's: here one group's lone 10 gets |A| 4.24, above (G-1)/sqrt(G) = 1.5 for G=4, with nothing wrong.
    Checked as group-normalised (the default) it counts as over the bound (a critical page); as ``batch`` it has
    no per-group bound: grpo_advantage_bound is absent and nothing counts."""
    g, prompts = 4, 8
    rewards = torch.zeros(g * prompts)
    rewards[0] = 10.0
    groups = contiguous_groups(g * prompts, g)
    adv = group_normalized_advantages(rewards, groups, "batch", eps=1e-4)
    centred = 10.0 - 2.5
    assert adv[0].item() == pytest.approx(centred / (rewards.std().item() + 1e-4), rel=1e-5)
    assert adv.abs().max().item() > 2.8 * advantage_bound(g, "unbiased")
    wrong = compute_step(StepInputs(rewards=rewards, advantages=adv), MetricsConfig(group_size=g))
    assert wrong["grpo_advantage_over_bound_sequences_total"] == 1  # the lone 10 (its group mates: -1.41)
    right = compute_step(StepInputs(rewards=rewards, advantages=adv),
                         MetricsConfig(group_size=g, advantage_norm="batch"))
    assert right["grpo_advantage_over_bound_sequences_total"] == 0
    assert "grpo_advantage_bound" not in right
    assert right["grpo_advantage_abs_max"] == pytest.approx(adv.abs().max().item())


@pytest.mark.parametrize(
    ("advantage", "ratio", "truncated", "bound"),
    [
        (+1.0, 1.5, True, "upper"),  # wants up, already above 1+eps: gradient cut
        (-1.0, 0.5, True, "lower"),  # wants down, already below 1-eps: gradient cut
        (+1.0, 0.5, False, "lower"),  # wants up from below: min keeps r*A, gradient flows
        (-1.0, 1.5, False, "upper"),  # wants down from above: min keeps r*A, gradient flows
    ],
)
def test_four_sign_side_cases_of_the_ppo_clip(advantage, ratio, truncated, bound):
    """Seed 第 5 篇 §四: the clip truly cuts the gradient only when ratio and advantage point the same way.
    Checked against autograd on the PPO-clip objective with eps = 0.2."""
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    adv = torch.tensor([[advantage]])
    r = torch.exp(logp - old)
    objective = torch.min(r * adv, torch.clamp(r, 0.8, 1.2) * adv).sum()
    objective.backward()
    assert (logp.grad.abs().item() == 0.0) is truncated

    log_ratios = gradient.log_ratio(logp.detach(), old, torch.ones(1, 1, dtype=torch.bool))
    counts = samples.clip_counts(log_ratios, adv, old, 0.2, 0.2)
    clipped = {"upper": counts.upper.item(), "lower": counts.lower.item()}
    unclipped = {"upper": counts.upper_unclipped.item(), "lower": counts.lower_unclipped.item()}
    assert clipped[bound] == int(truncated)
    assert unclipped[bound] == int(not truncated)
    assert sum(clipped.values()) + sum(unclipped.values()) == 1


def test_the_upper_clip_is_unreachable_for_tokens_the_policy_already_owns():
    """r = p_new / p_old <= 1 / p_old: with eps_high = 0.2 a positive token at p_old >= 1/1.2 ~ 0.833 can never be
    clipped above, whatever the update (a solved task's regime); only tokens below it count as reachable."""
    p_old = torch.tensor([[0.5, 0.8, 0.83, 0.84, 0.9, 0.99]])
    old = p_old.log()
    best = torch.zeros_like(old)  # the most any update can do: p_new = 1
    log_ratios = gradient.log_ratio(best, old, torch.ones_like(old, dtype=torch.bool))
    counts = samples.clip_counts(log_ratios, torch.ones_like(old), old, 0.2, 0.2)
    assert counts.reachable.item() == 3  # 0.5, 0.8, 0.83 < 1/1.2
    assert counts.upper.item() == 3  # exactly those can exceed 1.2 even at p_new = 1
    assert (log_ratios.ratio[p_old >= 1 / 1.2] <= 1.2).all()


def test_log_space_asymmetry_of_the_default_clip():
    """Seed 第 5 篇 §1.1: log 0.8 ~ -0.223, log 1.2 ~ +0.182, ratio ~1.225."""
    lower, upper = samples.clip_log_widths(0.2, 0.2)
    assert round(lower, 3) == 0.223
    assert round(upper, 3) == 0.182
    assert round(lower / upper, 3) == 1.224  # exact
    assert round(round(lower, 3) / round(upper, 3), 3) == 1.225  # the seed's ~1.225, from its rounded widths


@pytest.mark.parametrize(("eps_low", "eps_high"), [(0.20, 0.25), (0.25, 0.333), (0.28, 0.389), (0.32, 0.471)])
def test_geometric_symmetry_table(eps_low, eps_high):
    """Seed §1.2 table: eps_high = eps_low / (1 - eps_low) makes both sides equal in log space."""
    assert round(samples.symmetric_eps_high(eps_low), 3) == eps_high
    lower, upper = samples.clip_log_widths(eps_low, samples.symmetric_eps_high(eps_low))
    assert lower == pytest.approx(upper)


def test_expected_zero_variance_ratio_matches_simulation():
    """Seed 第 3 篇 §1: the zero-variance share is E[p^G + (1-p)^G], a function of G and difficulty."""
    rng = np.random.default_rng(7)
    for g in (4, 8, 32):
        p = rng.choice([0.05, 0.3, 0.5, 0.8, 0.97], size=64)
        prob = samples.zero_variance_probability(torch.from_numpy(np.repeat(p, g)), g)
        groups = contiguous_groups(64 * g, g)
        expected = samples.expected_zero_variance_ratio(prob, groups).value.item()
        shares = []
        for _ in range(400):
            correct = torch.from_numpy(rng.random(64 * g) < np.repeat(p, g))
            shares.append(samples.zero_variance_groups(correct.float(), groups, correct).share.value.item())
        se = np.std(shares) / math.sqrt(len(shares))
        assert abs(np.mean(shares) - expected) < 4 * se + 1e-9, (g, np.mean(shares), expected)
        assert expected == pytest.approx(float(np.mean(p**g + (1 - p) ** g)), rel=1e-6)


def test_fifty_percent_zero_variance_line_is_wrong():
    """Same prompts at p=0.5: G=4 gives 12.5% expected, G=32 gives ~0: a fixed line cannot serve both."""
    for g, want in ((4, 0.125), (32, 2 * 0.5**32)):
        groups = contiguous_groups(g, g)
        prob = samples.zero_variance_probability(torch.full((g,), 0.5), g)
        got = samples.expected_zero_variance_ratio(prob, groups).value.item()
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_pass_at_k_against_closed_form():
    """Unbiased estimator 1 - C(n-c, k)/C(n, k) for every c and k at n = 16."""
    n = 16
    correct = torch.cat([binary_group(c, n) for c in range(n + 1)]).bool()
    groups = contiguous_groups(correct.numel(), n)
    every_k = diversity.pass_at_ks(correct, groups, range(1, n + 1))
    for k in range(1, n + 1):
        reading = diversity.pass_at_k(correct, groups, k)
        assert reading.value.dim() == 0
        got = reading.value.item()
        want = np.mean([1 - math.comb(n - c, k) / math.comb(n, k) for c in range(n + 1)])
        assert got == pytest.approx(want, rel=1e-6), k
        assert (every_k.numerator[k - 1] / every_k.denominator[k - 1]).item() == pytest.approx(got, rel=1e-12)
        if k == 1:
            assert got == pytest.approx(0.5)


def test_the_averaging_trap_in_closed_form():
    """Seed 第 3 篇 §1: p ~ Beta(0.3, 0.3), G = 16 gives ~0.43 zero-variance groups where p = 0.5 plugged in gives
    3e-5. The log-gamma form gives the former as the product form E[p^G] = prod_i (a + i) / (a + b + i) does,
    with one G for all samples (contiguous groups) or a G per sample."""
    alpha, beta = torch.full((3,), 0.3, dtype=torch.float64), torch.full((3,), 0.3, dtype=torch.float64)
    one_g = samples.beta_binomial_zero_variance(alpha, beta, 16.0)
    per_sample = samples.beta_binomial_zero_variance(alpha, beta, torch.full((3,), 16))
    exact = 2 * math.prod((0.3 + i) / (0.6 + i) for i in range(16))
    assert torch.equal(one_g, per_sample)
    assert one_g.tolist() == pytest.approx([exact] * 3, rel=1e-12)
    assert round(exact, 2) == 0.43
    assert float(samples.zero_variance_probability(torch.tensor(0.5), 16)) == pytest.approx(3.05e-5, rel=1e-2)
