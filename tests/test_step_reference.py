"""Every per-step metric against the independent reference, on random ragged batches in fp32 and bf16.

Tolerance: the library reduces in fp32 (fp64 for sums and counts), the reference in float64 on the very same
stored values, so results agree to fp32 rounding: rel 2e-5, abs 1e-6. Counts must agree exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from batches import make_batch
from grpo_exporter.catalog import parse_key
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional import histogram, reading
from grpo_exporter.step import compute_step
from reference import reference

CASES = [
    pytest.param(seed, dtype, shuffled, token_adv, norm, id=f"s{seed}-{str(dtype)[6:]}-{norm}{'-ids' * shuffled}"
                 f"{'-tokadv' * token_adv}")
    for seed, dtype, shuffled, token_adv, norm in [
        (0, torch.float32, False, False, "unbiased"),
        (1, torch.bfloat16, False, False, "unbiased"),
        (2, torch.float32, True, False, "population"),
        (3, torch.bfloat16, True, True, "none"),
        (4, torch.float16, False, True, "unbiased"),
        (5, torch.float32, True, True, "population"),
    ]
]


def _tolerance(key: str) -> float:
    """Quantiles (other than min and max) and top-fraction means are read from the fine histogram: within its
    documented relative error of the exact reference; everything else within fp32 rounding."""
    labels = parse_key(key)[1]
    if labels.get("quantile") not in (None, "0", "1") or key.startswith("grpo_entropy_top_mean"):
        return histogram.RELATIVE_ERROR
    return 2e-5


def assert_matches(got: dict[str, float], want: dict[str, float]) -> None:
    assert sorted(got) == sorted(want), (
        f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}"
    )
    wrong = {
        k: (got[k], want[k])
        for k in want
        if not (got[k] == want[k] or math.isclose(got[k], want[k], rel_tol=_tolerance(k), abs_tol=1e-6))
    }
    assert not wrong, wrong
    counts = [k for k in want if "_total" in k or k.endswith("_count") or "_bucket" in k]
    assert all(got[k] == want[k] for k in counts), {k: (got[k], want[k]) for k in counts if got[k] != want[k]}


@pytest.mark.parametrize(("seed", "dtype", "shuffled", "token_adv", "norm"), CASES)
def test_every_metric_matches_reference(seed, dtype, shuffled, token_adv, norm):
    batch = make_batch(seed, dtype=dtype, shuffled_groups=shuffled, token_advantages=token_adv)
    cfg = MetricsConfig(group_size=8, advantage_norm=norm, log_ratio_clamp=0.5, rollout_correction_cap=1.02,
                        pass_k=(2, 4), clip_eps_high=0.28)
    got = compute_step(batch.inputs(), cfg)
    assert_matches(got, reference(batch, cfg))


@pytest.mark.parametrize("large", [False, True], ids=["where", "bit-masks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_interleaved_multi_turn_loss_mask_matches_reference(dtype, large, monkeypatch):
    """Tool spans inside completions are off the loss mask and hold NaN / +-inf: the masked arithmetic keeps
    them out of every metric, on both of its paths (torch.where on small tensors, bit masks on large ones:
    ``large`` takes the bit masks at any size)."""
    if large:
        monkeypatch.setattr(reading, "SMALL", 0)
    batch = make_batch(6, dtype=dtype, interleaved=True)
    mask = batch.arrays["loss_mask"]
    assert (mask[:, 1:] & ~mask[:, :-1]).sum() > 2 * mask.shape[0]  # loss spans restart inside rows
    cfg = MetricsConfig(group_size=8, log_ratio_clamp=0.5, pass_k=(2, 4), clip_eps_high=0.28,
                        rollout_correction_cap=1.02)
    got = compute_step(batch.inputs(), cfg)
    assert_matches(got, reference(batch, cfg))
    assert got['grpo_nonfinite_values_total{tensor="logprobs"}'] == 1  # row 7's padding token, no tool token


def test_batch_exercises_every_branch():
    """The reference comparison is only as strong as the batch: check it hits the interesting cases."""
    batch = make_batch(0)
    cfg = MetricsConfig(group_size=8, log_ratio_clamp=0.5, pass_k=(2,))
    got = compute_step(batch.inputs(), cfg)
    for key in (
        'grpo_clipped_tokens_total{bound="upper"}',
        'grpo_clipped_tokens_total{bound="lower"}',
        'grpo_out_of_range_unclipped_tokens_total{bound="upper"}',
        'grpo_out_of_range_unclipped_tokens_total{bound="lower"}',
        'grpo_zero_variance_groups_total{outcome="all_correct"}',
        'grpo_zero_variance_groups_total{outcome="all_incorrect"}',
        "grpo_advantage_over_bound_sequences_total",
        "grpo_log_ratio_clamp_hit_tokens_total",
        "grpo_truncated_completions_total",
        "grpo_mixed_group_solve_rate_ratio_count",
    ):
        assert got[key] > 0, key
    assert got["grpo_unique_completions_ratio"] < 1.0
