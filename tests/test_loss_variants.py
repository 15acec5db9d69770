"""Loss variants the exporter measures as the loss does (issue 29): GSPO's sequence-level ratio, CISPO's ratio cap,
SAPO's and VESPO's soft weights with no hard clip. Each reading is checked against the variant's own formula as
TRL 1.16 writes it (``GRPOTrainer._compute_loss``), recomputed here independently of the exporter's functions."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from grpo_exporter.config import DEFAULT_ONPOLICY_EPS, MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step

UPPER, LOWER = 'grpo_clipped_tokens_ratio{bound="upper"}', 'grpo_clipped_tokens_ratio{bound="lower"}'
GSPO_EPS = (3e-4, 4e-4)  # the GSPO paper's and TRL's documented sequence-level clip range


def _batch(seed: int, n: int = 16, t: int = 24, noise: float = 0.05, heavy: bool = False):
    """Old log-probs, new log-probs (old + zero-mean per-token noise: bf16 recomputation, heavy-tailed when
    asked), a ragged loss mask and per-sequence advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3.0
    d = torch.randn(n, t, generator=g) * noise
    if heavy:
        d = d * torch.distributions.StudentT(2.0).sample((n, t)).clamp(-30, 30) / 2.0
    lengths = torch.randint(4, t + 1, (n,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(n, generator=g)
    return old, old + d, mask, adv


def _trl_sequence_ratio(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL: log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1); coef_1 = exp(...)."""
    log_ratio = new - old
    return torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))


def _config(clip_eps: tuple[float, float] = (0.2, 0.2), **cfg) -> MetricsConfig:
    return MetricsConfig(group_size=1, clip_eps_low=clip_eps[0], clip_eps_high=clip_eps[1], **cfg)


def _metrics(new, old, mask, adv, **cfg):
    x = StepInputs(logprobs=new, old_logprobs=old, loss_mask=mask, advantages=adv)
    return compute_step(x, _config(**cfg))


def _reference_clip(coef: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, upper_line: float,
                    lower_line: float | None) -> tuple[float, float | None]:
    """Clipped loss tokens over the loss tokens of the gating sign, from per-token (N, T) or per-sequence (N, 1)
    ratios, by the PPO sign rule (upper: A > 0 and r above the line; lower: A < 0 and r below)."""
    coef = coef.expand_as(mask)
    a = adv.unsqueeze(1).expand_as(mask)
    pos, neg = mask & (a > 1e-2), mask & (a < -1e-2)
    upper = ((coef > upper_line) & pos).sum() / pos.sum()
    lower = None if lower_line is None else float(((coef < lower_line) & neg).sum() / neg.sum())
    return float(upper), lower


@pytest.mark.parametrize("heavy", [False, True])
def test_gspo_sequence_ratio_is_what_the_clip_and_ess_read(heavy):
    """GSPO clips s_i = exp(mean_t log r_it) at a tiny epsilon (3e-4 / 4e-4). Read per token, zero-mean noise of
    0.05 nats puts ~all tokens outside that band; read per sequence, as the loss does, the share is TRL's."""
    old, new, mask, adv = _batch(1, noise=0.05, heavy=heavy)
    per_token = _metrics(new, old, mask, adv, clip_eps=GSPO_EPS)
    m = _metrics(new, old, mask, adv, clip_eps=GSPO_EPS, ratio_level="sequence")
    coef = _trl_sequence_ratio(new, old, mask).unsqueeze(1)
    upper, lower = _reference_clip(coef, adv, mask, 1 + GSPO_EPS[1], 1 - GSPO_EPS[0])
    assert m[UPPER] == pytest.approx(upper, rel=1e-6)
    assert m[LOWER] == pytest.approx(lower, rel=1e-6)
    assert per_token[UPPER] > 0.4  # the token reading of the same batch: the wrong quantity
    # ESS of the weights the loss applies: s_i on each of its tokens, and over sequences
    s = coef.squeeze(1).double()
    w = s.unsqueeze(1).expand_as(mask)[mask]
    assert m['grpo_ess_ratio{level="token"}'] == pytest.approx(float(w.sum() ** 2 / (w**2).sum() / w.numel()),
                                                                rel=1e-5)
    assert m['grpo_ess_ratio{level="sequence"}'] == pytest.approx(float(s.sum() ** 2 / (s**2).sum() / len(s)),
                                                                   rel=1e-5)
    # the importance-weight distribution is that of the sequence ratios, token-weighted
    assert m['grpo_importance_weight{quantile="1"}'] == pytest.approx(float(w.max()), rel=1e-5)
    assert m['grpo_importance_weight{quantile="0"}'] == pytest.approx(float(w.min()), rel=1e-5)


def test_gspo_counts_a_clipped_sequences_every_loss_token_and_judges_reach_by_its_mean():
    """One sequence of 4 loss tokens, A > 0, log ratios (+0.3, -0.3, +0.3, -0.29): its mean 0.0025 nats puts
    s = 1.0025 above 1 + 4e-4, so all 4 tokens are cut; per token only the two at +0.3 are above 1.0004... and the
    two at -0.3 would be 'out of range, unclipped'. The mean old log-prob -1.0 < -log(1.0004): reachable."""
    old = torch.full((1, 4), -1.0)
    new = old + torch.tensor([[0.3, -0.3, 0.3, -0.29]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    m = _metrics(new, old, mask, torch.tensor([1.0]), clip_eps=GSPO_EPS, ratio_level="sequence")
    assert m['grpo_clipped_tokens_total{bound="upper"}'] == 4
    assert m[UPPER] == 1.0
    assert m['grpo_out_of_range_unclipped_tokens_total{bound="lower"}'] == 0
    assert m["grpo_upper_clip_reachable_tokens_total"] == 4
    token = _metrics(new, old, mask, torch.tensor([1.0]), clip_eps=GSPO_EPS)
    assert token['grpo_clipped_tokens_total{bound="upper"}'] == 2
    assert token['grpo_out_of_range_unclipped_tokens_total{bound="lower"}'] == 2


def test_gspo_a_sequence_with_a_nonfinite_token_has_no_ratio():
    """TRL's mean over a row with a NaN log-prob is NaN: the sequence has no ratio, none of its tokens counts."""
    old = torch.full((2, 3), -1.0)
    new = old.clone()
    new[0, 1] = float("nan")
    new[1] += 0.01
    mask = torch.ones(2, 3, dtype=torch.bool)
    m = _metrics(new, old, mask, torch.tensor([1.0, 1.0]), clip_eps=GSPO_EPS, ratio_level="sequence")
    assert m['grpo_clipped_tokens_total{bound="upper"}'] == 3  # row 1 only: s = exp(0.01)
    assert m['grpo_importance_weight_count'] == 3


def test_the_onpolicy_check_keeps_a_token_band_when_the_loss_has_none():
    """On-policy, bf16 recomputation noise (sd 0.05 nats) is inside the seed's [0.8, 1.2] band per token but
    outside GSPO's 4e-4: judged by GSPO's band the check would page a healthy run. The on-policy check reads each
    token against the clip band of a token-level loss, else the seed's default band; a second probability path
    (a 1/0.8 temperature on one side: |log r| ~ 0.25-0.75 here) still leaves it."""
    old, new, mask, adv = _batch(2, noise=0.05)
    x = StepInputs(logprobs=new, old_logprobs=old, loss_mask=mask, advantages=adv, on_policy=True)
    ratio = 'grpo_onpolicy_outside_clip_ratio'
    for cfg in ({"ratio_level": "sequence", "clip_eps": GSPO_EPS}, {"clip": "none"},
                {"clip": "cap", "ratio_cap": 5.0, "clip_eps": (0.2, 5.0)}):
        config = _config(**cfg)
        assert config.onpolicy_eps == DEFAULT_ONPOLICY_EPS
        assert compute_step(x, config)[ratio] < 0.001, cfg
    assert compute_step(x, _config(clip_eps=GSPO_EPS))[ratio] > 0.9  # a token-level loss
    path = StepInputs(logprobs=old / 0.8, old_logprobs=old, loss_mask=mask, advantages=adv, on_policy=True)
    assert compute_step(path, _config(ratio_level="sequence", clip_eps=GSPO_EPS))[ratio] > 0.5


def test_cispo_counts_the_weights_its_cap_truncates_and_has_no_lower_bound():
    """CISPO (TRL loss_type='cispo'): weight = min(r, epsilon_high) with its gradient stopped, epsilon_high a ratio
    (5 in TRL's docs), never an epsilon: r = 1.3 is not clipped (PPO's [0.8, 1.2] would cut it), r = 6 with A > 0
    is (TRL's cispo_clip_ratio: coef_1 > epsilon_high and A > 0), r = 6 with A < 0 is out of range but keeps
    its gradient, and r = 0.5 with A < 0 is nothing: no lower line, no lower series."""
    old = torch.full((4, 1), -3.0)  # p_old 0.05 < 1/5: each can reach the cap
    new = old + torch.tensor([[math.log(1.3)], [math.log(6.0)], [math.log(6.0)], [math.log(0.5)]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    m = _metrics(new, old, mask, adv, clip="cap", ratio_cap=5.0, clip_eps=(0.2, 5.0))
    coef = torch.exp(new - old)
    trl_numerator = ((coef > 5.0) & (adv.unsqueeze(1) > 0)).sum()
    assert m['grpo_clipped_tokens_total{bound="upper"}'] == trl_numerator == 1
    assert m[UPPER] == 0.5  # of the two A > 0 tokens
    assert m['grpo_out_of_range_unclipped_tokens_total{bound="upper"}'] == 1
    assert m["grpo_upper_clip_reachable_tokens_total"] == 2
    assert not any("bound=\"lower\"" in k for k in m if k.startswith(("grpo_clipped", "grpo_out_of_range")))
    ppo = _metrics(new, old, mask, adv, clip_eps=(0.2, 0.2))
    assert ppo['grpo_clipped_tokens_total{bound="upper"}'] == 2  # the 1.3 too: the wrong reading for CISPO


def test_a_loss_without_a_hard_clip_publishes_no_clip_metric_and_keeps_the_weights():
    """SAPO's sigmoid gate and VESPO's gamma weights clip nothing: no clipped-token series at all, while the
    importance weights and the ESS (the ratios the loss still reads) stay."""
    old, new, mask, adv = _batch(3, noise=0.3)
    m = _metrics(new, old, mask, adv, clip="none")
    assert not [k for k in m if k.startswith(("grpo_clipped", "grpo_out_of_range", "grpo_upper_clip"))]
    w = torch.exp(new - old)[mask].double()
    assert m['grpo_ess_ratio{level="token"}'] == pytest.approx(float(w.sum() ** 2 / (w**2).sum() / w.numel()),
                                                                rel=1e-5)


def test_a_cap_clip_needs_its_cap():
    with pytest.raises(ValidationError, match="ratio_cap"):
        MetricsConfig(group_size=4, clip="cap")
    with pytest.raises(ValidationError, match="ratio_level"):
        MetricsConfig(group_size=4, ratio_level="seq")  # type: ignore[arg-type]
