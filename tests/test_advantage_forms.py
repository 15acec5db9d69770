"""The advantage form is a checked precondition (seed 2.2): the (G-1)/sqrt(G) bound holds for group z-scores,
and estimators compute other forms whose healthy advantages exceed it. Through the public API with the default
config (advantage_norm="unbiased"), G=8, 64 prompts, 6 steps, solve rates 0.5..0.95: batch-whitened, KL-shaped
and Dr. GRPO advantages count nothing over the bound and nothing inconsistent; a x3 scale after normalisation,
misaligned groups and advantages of another batch still count (critical pages)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.catalog import ADVANTAGE_FORMS
from grpo_exporter.functional.advantage_form import FORMS, advantage_form
from grpo_exporter.functional.groups import advantage_bound, contiguous_groups, group_normalized_advantages
from monitor_helpers import registry_value

G, PROMPTS, STEPS, T = 8, 64, 6, 48
N = G * PROMPTS
SOLVE_RATES = (0.5, 0.7, 0.9, 0.95)
SETTINGS = {"group_size": G, "port": None, "guard": "off", "edit_distance_groups": 0, "close_linger_s": 0.0}
OVER = "grpo_advantage_over_bound_sequences_total"
INCONSISTENT = "grpo_advantage_inconsistent_sequences_total"


def _rewards(p: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(N, generator=gen) < p).float()


def _mask(seed: int) -> torch.Tensor:
    lengths = torch.randint(4, T + 1, (N,), generator=torch.Generator().manual_seed(seed + 1000))
    return torch.arange(T)[None, :] < lengths[:, None]


def _token_whitened(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's and verl's batch whitening: mean and std over every loss token of the batch."""
    values = x[mask]
    return torch.where(mask, (x - values.mean()) / (values.std() + 1e-8), 0.0)


def _kl_shaped(rewards: torch.Tensor, mask: torch.Tensor, seed: int, coef: float = 0.01) -> torch.Tensor:
    """OpenRLHF's default REINFORCE++: the KL penalty in the reward (-coef x KL per token, the score on the last
    token), returns to go (gamma 1), whitened over the batch's tokens."""
    kl = torch.rand(N, T, generator=torch.Generator().manual_seed(seed + 7)) * 0.02 * mask
    per_token = -coef * kl
    last = mask.sum(dim=1) - 1
    per_token[torch.arange(N), last] += rewards
    returns = per_token.flip(1).cumsum(1).flip(1) * mask
    return _token_whitened(returns, mask)


def healthy(kind: str, rewards: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    groups = contiguous_groups(N, G)
    if kind == "whitened":  # REINFORCE++-baseline: group-centred, then whitened over the batch's tokens
        centred = group_normalized_advantages(rewards, groups, "none")
        return _token_whitened(centred[:, None].expand(N, T).clone(), mask)
    if kind == "shaped":
        return _kl_shaped(rewards, mask, seed)
    if kind == "dr_grpo":
        return group_normalized_advantages(rewards, groups, "none")
    if kind == "batch":  # TRL scale_rewards="batch"
        return group_normalized_advantages(rewards, groups, "batch")
    return group_normalized_advantages(rewards, groups, "unbiased")


def buggy(kind: str, rewards: torch.Tensor, seed: int) -> torch.Tensor:
    groups = contiguous_groups(N, G)
    if kind == "x3":  # a per-sample scale applied after normalisation
        return 3.0 * group_normalized_advantages(rewards, groups, "unbiased")
    if kind == "misaligned":  # normalised over groups shifted by one row against the ones handed over
        return group_normalized_advantages(rewards.roll(-1), groups, "unbiased").roll(1)
    other = _rewards(0.7, seed + 500)  # the advantages of another batch
    return group_normalized_advantages(other, groups, "unbiased")


def run(advantages_of, p: float, with_rewards: bool, **settings) -> GRPOMonitor:
    """STEPS steps through the public API as docs/quickstart-loop.md writes them: rewards to observe_rollout,
    advantages to observe_update (with the rewards too when ``with_rewards``), one micro-step per step."""
    mon = GRPOMonitor(run=f"forms-{p}", **(SETTINGS | settings))
    for step in range(STEPS):
        rewards, mask = _rewards(p, step), _mask(step)
        advantages = advantages_of(rewards, mask, step)
        mon.observe_rollout(step, rewards=rewards, loss_mask=mask, completion_lengths=mask.sum(dim=1))
        extra = {"rewards": rewards} if with_rewards else {}
        mon.observe_update(step, advantages=advantages, loss_mask=mask, **extra)
        mon.end_step()
    return mon


@pytest.mark.parametrize("with_rewards", [False, True], ids=["advantages", "with-rewards"])
@pytest.mark.parametrize("kind", ["whitened", "shaped", "dr_grpo", "batch", "unbiased"])
def test_healthy_advantages_of_every_estimator_count_nothing_under_the_default_config(kind, with_rewards):
    for p in SOLVE_RATES:
        with run(lambda r, m, s, kind=kind: healthy(kind, r, m, s), p, with_rewards) as mon:
            assert registry_value(mon, OVER) == 0, (kind, p)
            assert registry_value(mon, INCONSISTENT) == 0, (kind, p)
            read = sum(registry_value(mon, f'grpo_advantage_form_sequences_total{{form="{f}"}}') or 0.0
                       for f in FORMS)
            assert read == STEPS * N, (kind, p)


def test_healthy_forms_above_the_group_bound_are_the_cases_the_old_check_paged():
    """The premise matters: at solve rate 0.9 a lone failure's batch-whitened advantage is far above the
    (G-1)/sqrt(G) = 2.47 of G=8 (seed: 'above it is a data or reward bug'), yet nothing is wrong."""
    rewards, mask = _rewards(0.9, 0), _mask(0)
    whitened = healthy("whitened", rewards, mask, 0)
    assert whitened.abs().max().item() > advantage_bound(G, "unbiased") * 1.2
    check = advantage_form(whitened, mask, None, contiguous_groups(N, G), G, "unbiased", 1e-3)
    assert FORMS[int(check.form)] == "whitened"
    assert not torch.isfinite(check.bounds).any()


@pytest.mark.parametrize("with_rewards", [False, True], ids=["advantages", "with-rewards"])
@pytest.mark.parametrize("bug", ["x3", "misaligned", "other-batch"])
def test_real_advantage_bugs_still_count(bug, with_rewards):
    """x3 after normalisation: over the configured bound at every solve rate. Misaligned groups: groups that do
    not sum to 0. Another batch's advantages are z-scores of the same layout, so only the rewards of the same
    sequences tell them apart: counted with rewards, and documented as needing them."""
    for p in SOLVE_RATES:
        with run(lambda r, m, s: buggy(bug, r, s), p, with_rewards) as mon:
            over, inconsistent = registry_value(mon, OVER), registry_value(mon, INCONSISTENT)
            if bug == "x3":
                assert over > 0, p
            elif bug == "misaligned":
                assert inconsistent > STEPS * N / 4, p
            elif with_rewards:
                assert inconsistent > STEPS * N / 10, p
            else:
                assert inconsistent == 0, p
                assert over == 0, p


def test_the_form_is_published_and_a_contradiction_is_said_once(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"), run(
            lambda r, m, s: healthy("whitened", r, m, s), 0.9, False) as mon:
        assert registry_value(mon, 'grpo_advantage_form_sequences_total{form="whitened"}') == STEPS * N
        assert registry_value(mon, 'grpo_advantage_form_sequences_total{form="unbiased"}') == 0
        assert registry_value(mon, "grpo_advantage_bound") is None  # no group bound under whitening
    said = [r.getMessage() for r in caplog.records if "advantage_norm='unbiased'" in r.getMessage()]
    assert len(said) == 1, said
    assert "'whitened'" in said[0], said


def test_the_configured_form_is_not_news():
    with run(lambda r, m, s: healthy("whitened", r, m, s), 0.9, False, advantage_norm="whitened") as mon:
        assert registry_value(mon, 'grpo_advantage_form_sequences_total{form="whitened"}') == STEPS * N
        assert registry_value(mon, OVER) == 0


G16 = contiguous_groups(16 * 4, 16)


@pytest.mark.parametrize("norm", ["unbiased", "population", "none", "batch"])
def test_each_group_form_is_told_from_its_data(norm):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0] * 4 + [1.0] * 8 + [0.0] * 8 + [1.0, 1.0, 0.0, 0.0] * 4
                           + [0.3, 0.9, 0.1, 0.5] * 4)
    adv = group_normalized_advantages(rewards, G16, norm)
    for given in (rewards, None):
        form = FORMS[int(advantage_form(adv, None, given, G16, 16, "unbiased", 1e-3).form)]
        if norm == "batch":  # here its mean square is 0.93: batch whitening's look, and neither has a group bound
            assert form in ("batch", "whitened") if given is not None else form == "whitened", form
            configured = advantage_form(adv, None, given, G16, 16, "batch", 1e-3)
            assert FORMS[int(configured.form)] == "batch"
            continue
        expected = norm if given is not None or norm in ("unbiased", "population") else "none"
        assert form == expected, (norm, given is None)


def test_the_seed_bound_judges_z_scores_only_while_no_group_exceeds_unit_std():
    """Seed 2.2: G=16, a lone correct answer, |A| = 3.75 with unbiased std. A group z-score's std is 1, so
    the form is unbiased only while every group's std is at most 1 (+ the bound's slack): then no group can
    exceed (G-1)/sqrt(G), and a scale after normalisation never passes for a z-score."""
    rewards = torch.zeros(16 * 4)
    rewards[::16] = 1.0
    adv = group_normalized_advantages(rewards, G16, "unbiased", eps=0.0)
    assert adv.abs().max().item() == pytest.approx(3.75)
    assert FORMS[int(advantage_form(adv, None, None, G16, 16, "unbiased", 1e-3).form)] == "unbiased"
    scaled = advantage_form(adv * 1.01, None, None, G16, 16, "unbiased", 1e-3)
    assert FORMS[int(scaled.form)] == "unknown"
    assert float(scaled.bounds.max()) == pytest.approx(3.75)


def test_fragments_of_groups_are_read_by_no_form_test():
    """Micro-batches that split groups (TRL on several ranks): no complete group, no form reading, and the
    configured form's bound with G members judges the fragments."""
    rewards = _rewards(0.5, 3)[:64]
    adv = group_normalized_advantages(rewards, contiguous_groups(64, G), "unbiased")
    half = contiguous_groups(32, 4)
    check = advantage_form(adv[::2].contiguous(), None, None, half, G, "unbiased", 1e-3)
    assert int(check.checked) == 0
    assert FORMS[int(check.form)] == "unknown"
    assert float(check.bounds.max()) == pytest.approx((G - 1) / math.sqrt(G))
    assert int(check.inconsistent.sum()) == 0


def test_per_token_advantages_that_vary_are_shaped_whatever_the_configured_form():
    rewards, mask = _rewards(0.7, 4), _mask(4)
    shaped = healthy("shaped", rewards, mask, 4)
    for configured in ("unbiased", "none", "whitened"):
        check = advantage_form(shaped, mask, rewards, contiguous_groups(N, G), G, configured, 1e-3)
        assert FORMS[int(check.form)] == "shaped"
        assert int(check.inconsistent.sum()) == 0


def test_forms_are_the_settings_values():
    assert (*ADVANTAGE_FORMS, "unknown") == FORMS
