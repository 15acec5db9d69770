"""Trainer against engine: the mismatch readings against an independent reference on random and heavy-tailed
inputs, and the guard's noise-or-fault judgement on the engines people run (ANCHORS.md: a healthy bf16 gap of
0.010-0.018 nats, TRL #5312; top-p renormalisation puts the mean correction weight at the kept mass, 0.895 at
top_p 0.8, TRL #6789; stale weights after a sync, 0.015 -> 0.201, TRL #5312)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo_exporter import GRPOMonitor, TrainingSignalError
from grpo_exporter.catalog import parse_key
from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import ROLLOUT_BLOCKS, compute_step_carrying
from reference import mismatch_reference
from test_step_reference import assert_matches

MISMATCH = ("grpo_mismatch_", "grpo_rollout_correction_", "grpo_token_rollout_correction_",
            "grpo_sequence_rollout_correction_")


def _rollout(seed: int, n: int = 32, t: int = 24, noise: str = "normal", shift: float = 0.0,
             bad: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, size=(n, t)))
    # heavy: Student-t with 2 degrees of freedom (infinite variance, a few huge tokens)
    d = 0.01 * rng.standard_t(2.0, size=(n, t)) if noise == "heavy" else rng.normal(0.0, 0.05, size=(n, t))
    rollout = old + d + shift
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, size=n)[:, None]
    mask[0] = False  # a sequence without loss tokens is no sequence of the per-sequence readings
    for i in range(bad):  # non-finite engine log-probs on loss tokens leave every count
        rollout[1 + i, 0] = [np.nan, np.inf, -np.inf][i % 3]
    return {"old_logprobs": torch.tensor(old, dtype=torch.float32),
            "rollout_logprobs": torch.tensor(rollout, dtype=torch.float32),
            "loss_mask": torch.tensor(mask), "rewards": torch.zeros(n)}


@pytest.mark.parametrize(("noise", "shift", "bad"), [("normal", 0.0, 0), ("heavy", 0.0, 3), ("heavy", 0.3, 0),
                                                     ("normal", -25.0, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_mismatch_readings_match_a_plain_reference(noise, shift, bad, seed):
    """Normal, heavy-tailed (t2), shifted (a systematic gap), and beyond the +-20 safety bound, with NaN/inf
    engine tokens: every reading within float32 rounding of the float64 reference (quantiles within the fine
    histogram's error), every count exact."""
    x = _rollout(seed, noise=noise, shift=shift, bad=bad)
    cfg = MetricsConfig(group_size=4, rollout_correction_cap=1.05)
    got = compute_step_carrying(StepInputs(**x), cfg, {}, blocks=ROLLOUT_BLOCKS).metrics
    want = mismatch_reference(x["old_logprobs"].double().numpy(), x["rollout_logprobs"].double().numpy(),
                              x["loss_mask"].numpy(), cfg)
    assert_matches({k: v for k, v in got.items() if parse_key(k)[0].startswith(MISMATCH)}, want)


@pytest.mark.parametrize("seed", [0, 1])
def test_unscored_engine_tokens_leave_the_readings_without_counting_as_non_finite(seed):
    """vLLM can hand a token back without a log-prob; TRL turns it into NaN and leaves it out of its own
    sampling metrics. Under rollout_logprob_nan="unscored" such NaN loss tokens are counted as unscored, never
    as non-finite (a layer-1 critical that mutes every other page); the gap and the mismatch equal the
    reference on the scored tokens; +-inf is still non-finite. The default mode counts NaN as non-finite."""
    x = _rollout(seed, noise="heavy")
    mask = x["loss_mask"]
    rng = np.random.default_rng(seed + 10)
    holes = torch.tensor(rng.random(mask.shape) < 0.1) & mask
    holes[2:4, :] = False
    holes[2, 0] = mask[2, 0] = True  # one more NaN on a loss token, one +inf beside it
    x["rollout_logprobs"] = x["rollout_logprobs"].masked_fill(holes, float("nan"))
    x["rollout_logprobs"][3, 0], mask[3, 0] = float("inf"), True
    x["rollout_logprobs"][0, 0] = float("nan")  # row 0 has no loss token: padding NaN is never counted
    cfg = MetricsConfig(group_size=4, rollout_correction_cap=1.05, rollout_logprob_nan="unscored")
    got = compute_step_carrying(StepInputs(**x), cfg, {}, blocks=ROLLOUT_BLOCKS).metrics
    unscored = int(holes.sum())
    assert unscored > 20
    assert got["grpo_rollout_unscored_tokens_total"] == unscored
    assert got['grpo_nonfinite_values_total{tensor="rollout_logprobs"}'] == 1  # the +inf
    assert got['grpo_nonfinite_values_total{tensor="old_logprobs"}'] == 0
    scored = mask & torch.isfinite(x["rollout_logprobs"])
    gap = (x["rollout_logprobs"] - x["old_logprobs"]).abs()[scored].double()
    assert got["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(float(gap.mean()), rel=1e-5)
    assert got["grpo_engine_logprob_gap_nats_count"] == int(scored.sum())
    want = mismatch_reference(x["old_logprobs"].double().numpy(), x["rollout_logprobs"].double().numpy(),
                              mask.numpy(), cfg)
    assert_matches({k: v for k, v in got.items() if parse_key(k)[0].startswith(MISMATCH)}, want)
    default = compute_step_carrying(StepInputs(**x), cfg.model_copy(update={"rollout_logprob_nan": "nonfinite"}),
                                    {}, blocks=ROLLOUT_BLOCKS).metrics
    assert default['grpo_nonfinite_values_total{tensor="rollout_logprobs"}'] == unscored + 1
    assert "grpo_rollout_unscored_tokens_total" not in default


def test_top_p_renormalisation_reads_the_kept_mass_and_stops_from_the_first_step():
    """An engine reporting log-probs renormalised over a nucleus of mass 0.895 (top_p 0.8, TRL #6789): each
    kept token's weight p/q is the kept mass itself, so the mean weight is 0.895 and k1 = -log 0.895 = 0.111
    nats; the guard stops at the first rollout, with no baseline."""
    x = _rollout(0, shift=-math.log(0.895))
    x["rollout_logprobs"] = x["old_logprobs"] - math.log(0.895)
    with GRPOMonitor(run="top-p", group_size=4, port=None, guard="raise") as mon:
        with pytest.raises(TrainingSignalError, match="systematic"):
            mon.observe_rollout(0, **x)
        m = mon.metrics()
    assert m['grpo_mismatch_kl_nats{estimator="k1"}'] == pytest.approx(-math.log(0.895), rel=1e-4)
    mean_weight = m["grpo_rollout_correction_weight_sum"] / m["grpo_rollout_correction_weight_count"]
    assert mean_weight == pytest.approx(0.895, rel=1e-5)
    assert m['grpo_mismatch_kl_nats{estimator="k3"}'] < 0.1 * m['grpo_mismatch_kl_nats{estimator="k1"}']


def _bf16_noise(seed: int, level: float = 1.0) -> dict[str, torch.Tensor]:
    """A bf16 engine's per-token noise (TRL #6789's shape: sd ~0.05, p95 ~0.1, most tokens near 0), sampled
    from the engine: mean |gap| ~0.016, the signed mean its second-order KL."""
    rng = np.random.default_rng(seed)
    x = _rollout(seed)
    tail = rng.random(x["old_logprobs"].shape) < 0.15
    noise = level * np.where(tail, rng.normal(0, 0.12, tail.shape), rng.normal(0, 0.003, tail.shape))
    x["rollout_logprobs"] = x["old_logprobs"] + torch.tensor(noise + 0.5 * noise**2, dtype=torch.float32)
    return x


def test_a_healthy_bf16_engine_never_stops_and_a_jump_does(caplog):
    """guard="raise" on a healthy bf16 engine (mean gap ~0.016, above the seed's 0.01): 40 rollouts pass, one
    notice is logged when the clean gap freezes; then the weights go stale (the gap x12, TRL #5312) and the
    guard stops it at once."""
    with GRPOMonitor(run="bf16", group_size=4, port=None, guard="raise") as mon:
        for step in range(40):
            mon.observe_rollout(step, **_bf16_noise(step))
        m = mon.metrics()
        assert 0.010 < m["grpo_engine_logprob_gap_mean_nats"] < 0.025
        assert abs(m['grpo_mismatch_kl_nats{estimator="k1"}']) < 0.003
        assert m["grpo_engine_logprob_gap_accepted_nats"] == m["grpo_engine_logprob_gap_clean_baseline_nats"] > 0.01
        notices = [r.getMessage() for r in caplog.records if "notice" in r.getMessage()]
        assert len(notices) == 1
        assert "reference_baseline" in notices[0]
        assert "A/B/C" in notices[0]
        with pytest.raises(TrainingSignalError, match=r"jumped|systematic"):
            mon.observe_rollout(40, **_bf16_noise(40, level=12.0))


def test_a_recorded_level_silences_the_notice_and_is_the_accepted_level(caplog):
    with GRPOMonitor(run="bf16-known", group_size=4, port=None, guard="raise",
                     reference_baseline={"grpo_engine_logprob_gap_mean_nats": 0.016}) as mon:
        for step in range(25):
            mon.observe_rollout(step, **_bf16_noise(step))
        assert mon.metrics()["grpo_engine_logprob_gap_accepted_nats"] == 0.016
    assert not [r for r in caplog.records if "notice" in r.getMessage()]
