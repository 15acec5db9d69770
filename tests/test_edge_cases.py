"""Empty masks, one-token sequences, all-correct / all-wrong batches, NaN and inf, and 16.7M tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batches import make_batch
from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional.histogram import RELATIVE_ERROR
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step

CFG = MetricsConfig(group_size=8, log_ratio_clamp=20.0)
TOKEN_GAUGES = (
    "grpo_engine_logprob_gap_mean_nats",
    'grpo_engine_logprob_gap_nats{quantile="0.5"}',
    'grpo_importance_weight{quantile="0.5"}',
    'grpo_ess_ratio{level="token"}',
    'grpo_ess_ratio{level="sequence"}',
    "grpo_entropy_mean_nats",
    "grpo_entropy_top_mean_nats",
    "grpo_kl_ref_nats",
    "grpo_onpolicy_outside_clip_ratio",
    "grpo_onpolicy_log_ratio_abs_max_nats",
    'grpo_clipped_tokens_ratio{bound="upper"}',
    "grpo_zero_advantage_tokens_ratio",
    "grpo_log_ratio_clamp_hit_ratio",
)


def no_nan(metrics: dict[str, float]) -> None:
    assert not [k for k, v in metrics.items() if math.isnan(v)]


def test_empty_loss_mask_makes_token_metrics_absent_not_zero():
    batch = make_batch(0)
    x = batch.inputs(loss_mask=torch.zeros_like(torch.from_numpy(batch.arrays["loss_mask"])))
    m = compute_step(x, CFG)
    no_nan(m)
    for key in TOKEN_GAUGES:
        assert key not in m, key
    assert m["grpo_engine_logprob_gap_nats_count"] == 0
    assert m['grpo_update_tokens_total{advantage_sign="positive"}'] == 0
    assert m['grpo_nonfinite_values_total{tensor="logprobs"}'] == 0
    assert m["grpo_loss_mask_empty_sequences_total"] == 48
    assert "grpo_reward_mean{component=\"total\"}" in m  # sequence-level metrics do not need the mask


def _cut(batch, rows: int | None = None, tokens: int | None = None) -> StepInputs:
    """``batch``'s inputs cut to its first ``rows`` completions and first ``tokens`` positions."""
    x = batch.inputs()
    cut = {}
    for name, value in vars(x).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and not name.startswith("_"):
            t = value[:rows] if rows is not None else value
            cut[name] = t[:, :tokens] if tokens is not None and t.dim() == 2 else t
    cut["reward_components"] = {k: v[:rows] for k, v in x.reward_components.items()}
    lengths = cut.get("completion_lengths")
    if tokens is not None and lengths is not None:
        cut["completion_lengths"] = lengths.clamp(max=tokens)
    return batch.inputs(**cut)


def test_an_empty_batch_is_skipped_without_errors_and_no_tokens_leaves_the_completions_measured():
    """N = 0 completions: nothing to measure, nothing raises (every block of the old code hit an amax() of no
    elements); T = 0 tokens: rewards and groups are measured, every per-token reading is absent."""
    batch = make_batch(0)
    empty = compute_step(_cut(batch, rows=0), CFG)  # strict: a block that raised would raise here
    assert empty == {}
    no_tokens = compute_step(_cut(batch, tokens=0), CFG)
    no_nan(no_tokens)
    assert no_tokens['grpo_reward_mean{component="total"}'] == pytest.approx(float(batch.arrays["rewards"].mean()))
    for key in TOKEN_GAUGES:
        assert key not in no_tokens, key


def test_one_token_sequences():
    n = 16
    lp = torch.full((n, 1), -0.5)
    x = StepInputs(
        rewards=torch.arange(n).float() % 2,
        loss_mask=torch.ones(n, 1, dtype=torch.bool),
        completion_lengths=torch.ones(n, dtype=torch.int64),
        logprobs=lp + 0.1,
        old_logprobs=lp,
        rollout_logprobs=lp,
        entropy=torch.linspace(0, 1, n).unsqueeze(1),
        advantages=torch.linspace(-1, 1, n),
    )
    m = compute_step(x, CFG)
    no_nan(m)
    assert m["grpo_engine_logprob_gap_mean_nats"] == 0
    assert m['grpo_importance_weight{quantile="1"}'] == pytest.approx(math.exp(0.1))
    assert m['grpo_ess_ratio{level="token"}'] == pytest.approx(1.0)
    assert m['grpo_ess_ratio{level="sequence"}'] == pytest.approx(1.0)
    assert m["grpo_entropy_top_mean_nats"] == pytest.approx(np.mean(np.linspace(0, 1, n)[-4:]), rel=RELATIVE_ERROR)
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0


@pytest.mark.parametrize(("value", "outcome"), [(True, "all_correct"), (False, "all_incorrect")])
def test_all_correct_and_all_wrong_batches(value, outcome):
    n = 32
    correct = torch.full((n,), value)
    rewards = correct.float()
    mask = torch.ones(n, 5, dtype=torch.bool)
    lp = torch.full((n, 5), -1.0)
    x = StepInputs(
        rewards=rewards, correct=correct, advantages=torch.zeros(n), loss_mask=mask, logprobs=lp + 0.3,
        old_logprobs=lp,
    )
    m = compute_step(x, CFG)
    no_nan(m)
    assert m[f'grpo_zero_variance_groups_total{{outcome="{outcome}"}}'] == 4
    assert m["grpo_zero_variance_groups_ratio"] == 1.0
    assert m["grpo_zero_advantage_tokens_ratio"] == 1.0
    assert m['grpo_reward_group_std_mean{component="total"}'] == 0.0
    assert m["grpo_mixed_group_solve_rate_ratio_count"] == 0
    assert m['grpo_pass_at_k_ratio{k="8"}'] == float(value)
    # no positive or negative advantage token: the per-step clip fractions do not exist
    assert 'grpo_clipped_tokens_ratio{bound="upper"}' not in m
    assert 'grpo_clipped_tokens_ratio{bound="lower"}' not in m
    assert m['grpo_clipped_tokens_total{bound="upper"}'] == 0


def test_nan_and_inf_inside_inputs_are_counted_and_skipped():
    batch = make_batch(1)
    base = batch.inputs()
    mask = base.loss_mask.clone()
    i, t = 2, 0
    assert mask[i, t]
    poisoned = {
        "logprobs": base.logprobs.clone(),
        "rollout_logprobs": base.rollout_logprobs.clone(),
        "entropy": base.entropy.clone(),
    }
    poisoned["logprobs"][i, t] = math.nan
    poisoned["rollout_logprobs"][i, t] = math.inf
    poisoned["entropy"][i, t] = -math.inf
    m = compute_step(batch.inputs(**poisoned), CFG)
    before = compute_step(base, CFG)  # the batch already trains on one -inf padding position (row 7)
    no_nan(m)
    for tensor in ("logprobs", "rollout_logprobs", "entropy", "log_ratio", "ratio"):
        key = f'grpo_nonfinite_values_total{{tensor="{tensor}"}}'
        assert m[key] - before[key] == 1, tensor
    # everything else equals the same batch with that token masked out
    mask[i, t] = False
    clean = compute_step(batch.inputs(loss_mask=mask), CFG)
    for key in (*TOKEN_GAUGES[:8], 'grpo_importance_weight{quantile="0.99"}'):
        assert m[key] == pytest.approx(clean[key], rel=1e-6), key


def test_infinite_quantile_endpoints_never_give_nan():
    from grpo_exporter.functional.histogram_host import masked_quantiles

    x = torch.tensor([1.0, 1.0, math.inf, math.inf])
    r = masked_quantiles(x, torch.ones(4, dtype=torch.bool), (0.0, 0.2, 0.5, 0.9, 1.0))
    assert r.value.tolist() == [1.0, 1.0, math.inf, math.inf, math.inf]


def test_exp_overflow_is_counted_as_nonfinite_ratio_not_nan():
    """Without a configured clamp a finite log ratio of 100 overflows exp: a non-finite ratio (seed 4.2), yet
    no +Inf enters the cumulative _sum. With the user's clamp (20) it is a fuse hit, not an overflow."""
    lp = torch.zeros(8, 2)
    x = StepInputs(
        rewards=torch.zeros(8), loss_mask=torch.ones(8, 2, dtype=torch.bool), logprobs=lp + torch.tensor([0.0, 100.0]),
        old_logprobs=lp, advantages=torch.ones(8),
    )
    unclamped = compute_step(x, MetricsConfig(group_size=8))
    no_nan(unclamped)
    assert unclamped['grpo_nonfinite_values_total{tensor="ratio"}'] == 8
    assert unclamped['grpo_importance_weight{quantile="1"}'] == math.inf
    assert unclamped["grpo_importance_weight_sum"] == 8.0  # the eight finite ratios exp(0) only
    assert unclamped["grpo_importance_weight_count"] == 8
    m = compute_step(x, CFG)
    no_nan(m)
    assert m['grpo_nonfinite_values_total{tensor="ratio"}'] == 0
    assert m['grpo_nonfinite_values_total{tensor="log_ratio"}'] == 0
    assert m["grpo_log_ratio_clamp_hit_tokens_total"] == 8
    assert m['grpo_importance_weight{quantile="1"}'] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert math.isfinite(m["grpo_importance_weight_sum"])
    assert m['grpo_ess_ratio{level="token"}'] == pytest.approx(0.5)


def test_negative_infinity_padding_is_not_a_fault():
    batch = make_batch(2)
    assert np.isneginf(batch.arrays["logprobs"][~batch.arrays["loss_mask"]]).any()
    m = compute_step(batch.inputs(), CFG)
    no_nan(m)
    for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
        # the batch's one wrongly masked padding position (row 7) is the only non-finite loss token
        assert m[f'grpo_nonfinite_values_total{{tensor="{name}"}}'] == 1


@pytest.mark.slow
def test_sixteen_million_token_step():
    """A 4100 x 4096 (16.79M tokens) ragged bf16 step: every token metric; quantiles within the histogram's
    documented error, the maximum exact."""
    gen = torch.Generator().manual_seed(5)
    n, width = 4100, 4096
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    old = (-torch.rand(n, width, generator=gen) * 4).to(torch.bfloat16)
    rollout = (old.float() + torch.randn(n, width, generator=gen) * 1e-3).to(torch.bfloat16)
    x = StepInputs(loss_mask=mask, old_logprobs=old, rollout_logprobs=rollout, completion_lengths=lengths)
    m = compute_step(x, MetricsConfig(group_size=4))
    assert mask.numel() > 1 << 24
    gap = (rollout.float() - old.float()).abs()[mask].double().numpy()
    assert m["grpo_engine_logprob_gap_nats_count"] == gap.size
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(gap.mean(), rel=1e-6)
    for q in (0.5, 0.99, 0.999, 1.0):
        key = f'grpo_engine_logprob_gap_nats{{quantile="{repr(q).removesuffix(".0")}"}}'
        assert m[key] == pytest.approx(float(np.quantile(gap, q)), rel=RELATIVE_ERROR if q < 1 else 1e-7), q


def test_token_ess_shift_holds_for_huge_and_tiny_ratios():
    """The token weights are shifted by the log of the largest ratio (docs: samples.ess_ratio). Uniform log
    ratios of -5, -95 (subnormal ratios) and +100 (overflowed ratios) on every loss token all read ESS 1, never
    a garbage value from squares that underflow; below -103.9 every ratio is 0 and the token ESS reads 0."""
    def step(log_ratio: float) -> dict[str, float]:
        lp = torch.zeros(8, 4)
        x = StepInputs(rewards=torch.zeros(8), loss_mask=torch.tensor([[True] * 3 + [False]] * 8),
                       logprobs=lp + log_ratio, old_logprobs=lp, advantages=torch.ones(8))
        return compute_step(x, MetricsConfig(group_size=8))

    for log_ratio in (-5.0, -95.0, 100.0):
        m = step(log_ratio)
        assert m['grpo_ess_ratio{level="token"}'] == pytest.approx(1.0, rel=1e-6), log_ratio
        assert m['grpo_ess_ratio{level="sequence"}'] == pytest.approx(1.0, rel=1e-6), log_ratio
    assert step(-110.0)['grpo_ess_ratio{level="token"}'] == 0.0


@pytest.mark.parametrize("scale", [0.05, 3.0, 40.0, 120.0])
@pytest.mark.parametrize("offset", [0.0, -60.0, -95.0, 95.0])
def test_token_ess_from_the_largest_ratio_equals_the_exact_shift(scale, offset):
    """The shift from the ratio histogram's max gives the ESS of the exact max-log-weight shift (1e-6), on
    spread log ratios with NaN / inf tokens and padding, huge and tiny ratios included."""
    from grpo_exporter.functional import gradient, samples
    from grpo_exporter.functional.histogram import histogram

    gen = torch.Generator().manual_seed(int(scale * 10 + offset))
    value = torch.randn(16, 32, generator=gen) * scale + offset
    mask = torch.rand(16, 32, generator=gen) < 0.7
    value[0, 0], value[1, 1], value[2, 2] = math.nan, math.inf, -math.inf
    value = torch.where(mask, value, 0.0)
    log_ratios = gradient.log_ratio_of(value, mask)
    tokens = log_ratios.valid.sum()
    largest = histogram(log_ratios.ratio, log_ratios.valid, exact_min=False).maximum
    fast = samples.ess_ratio(log_ratios, tokens, largest).token
    exact = samples.ess_ratio(log_ratios).token
    assert float(fast.value) == pytest.approx(float(exact.value), rel=1e-6)


def test_distinct_completions_match_a_set_of_token_sequences():
    """Completions drawn from a few templates (repeats within and across groups), groups in any order, masks that
    are prefixes or arbitrary: the share of distinct completions per group equals a Python set's count of the
    (position, token) sequences; the same completion in two groups counts in each."""
    from grpo_exporter.functional import diversity
    from grpo_exporter.functional.groups import groups_from_ids

    gen = torch.Generator().manual_seed(5)
    for trial in range(60):
        n, t = int(torch.randint(1, 48, (1,), generator=gen)), int(torch.randint(1, 24, (1,), generator=gen))
        ids = torch.randint(0, 3, (4, t), generator=gen)[torch.randint(0, 4, (n,), generator=gen)]
        if trial % 2:
            positions = torch.arange(t)[None] < torch.randint(0, t + 1, (n,), generator=gen)[:, None]
        else:
            positions = (torch.rand(n, t, generator=gen) < 0.8) | (torch.rand(n, 1, generator=gen) < 0.5)
        group_ids = torch.randint(0, 5, (n,), generator=gen)
        got = diversity.unique_completion_ratio(ids, positions, groups_from_ids(group_ids))
        shares = []
        for g in group_ids.unique().tolist():
            rows = (group_ids == g).nonzero().flatten().tolist()
            seen = {tuple((j, int(ids[i, j])) for j in range(t) if positions[i, j]) for i in rows}
            shares.append(len(seen) / len(rows))
        assert float(got.value) == pytest.approx(sum(shares) / len(shares), abs=1e-12), trial
    same = torch.ones(4, 6, dtype=torch.int64)  # one completion, twice in each of two groups
    two_groups = groups_from_ids(torch.tensor([0, 1, 0, 1]))
    got = diversity.unique_completion_ratio(same, torch.ones(4, 6, dtype=torch.bool), two_groups)
    assert float(got.value) == 0.5


def test_repeated_wrong_groups_match_a_count_of_token_sequences():
    """A group counts when every sample is incorrect and its most repeated completion (as a Python Counter of the
    (position, token) sequences sees it) has at least two copies and half the group: groups in any order and of
    any size, masks arbitrary. By hand: a group of 4 with one wrong completion twice counts; with one of them
    right, or with each wrong completion once, it does not."""
    from collections import Counter

    from grpo_exporter.functional import diversity
    from grpo_exporter.functional.groups import groups_from_ids

    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        n, t = int(torch.randint(1, 48, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        ids = torch.randint(0, 2, (3, t), generator=gen)[torch.randint(0, 3, (n,), generator=gen)]
        positions = torch.rand(n, t, generator=gen) < 0.9
        group_ids = torch.randint(0, 6, (n,), generator=gen)
        correct = torch.rand(n, generator=gen) < (0.1 if trial % 2 else 0.4)
        groups = groups_from_ids(group_ids)
        got = diversity.repeated_wrong_groups(diversity.copies_in_group(ids, positions, groups), correct, groups)
        counted = []
        for g in group_ids.unique().tolist():
            rows = (group_ids == g).nonzero().flatten().tolist()
            most = max(Counter(tuple((j, int(ids[i, j])) for j in range(t) if positions[i, j]) for i in rows).values())
            counted.append(not correct[rows].any() and most >= 2 and 2 * most >= len(rows))
        assert float(got.value) == pytest.approx(sum(counted) / len(counted), abs=1e-12), trial
    ids = torch.tensor([[5, 6], [5, 6], [7, 8], [9, 9]] * 2)
    groups = groups_from_ids(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    copies = diversity.copies_in_group(ids, torch.ones(8, 2, dtype=torch.bool), groups)
    correct = torch.tensor([0, 0, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    assert float(diversity.repeated_wrong_groups(copies, correct, groups).value) == 0.5
    once = diversity.copies_in_group(torch.arange(16).reshape(8, 2), torch.ones(8, 2, dtype=torch.bool), groups)
    assert float(diversity.repeated_wrong_groups(once, torch.zeros(8, dtype=torch.bool), groups).value) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_contiguous_groups_reduce_as_the_scatter_of_their_ids(seed):
    """Contiguous groups reduce by a reshape; the same groups given as ids reduce by scatters: per-group sums,
    counts, max, min, sizes and statistics agree (NaN and empty groups included), and so does every metric of
    a whole step (fp64 sums in another order: to 1e-12)."""
    from grpo_exporter.functional.groups import Groups, contiguous_groups, group_stats, groups_from_ids

    gen = torch.Generator().manual_seed(seed)
    bins, size = 7, 5
    fast = contiguous_groups(bins * size, size)
    slow = groups_from_ids(fast.index.clone())
    assert fast.size == size
    assert slow.size is None
    values = torch.randn(bins * size, generator=gen).double()
    values[torch.rand(bins * size, generator=gen) < 0.2] = math.nan
    values[size : 2 * size] = math.nan  # a group with no finite value
    valid = torch.isfinite(values)
    for a, b in ((fast.sum(torch.where(valid, values, 0.0)), slow.sum(torch.where(valid, values, 0.0))),
                 (fast.count(valid), slow.count(valid)), (fast.sizes(), slow.sizes()),
                 (fast.amax(values, valid), slow.amax(values, valid)[:bins]),
                 (fast.amin(values, valid), slow.amin(values, valid)[:bins])):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b[:bins], rtol=1e-12, atol=0.0, equal_nan=True)
    for got, want in zip(group_stats(values, fast), group_stats(values, slow), strict=True):
        torch.testing.assert_close(got, want[:bins], rtol=1e-12, atol=1e-15, equal_nan=True)
    assert isinstance(slow, Groups)
    assert slow.bins == bins * size

    batch = make_batch(seed)
    plain = batch.inputs()
    n = plain.n
    given = batch.inputs(group_ids=torch.arange(n) // CFG.group_size)
    got, want = compute_step(plain, CFG), compute_step(given, CFG)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15, nan_ok=True), key


@pytest.mark.parametrize("case", range(8))
def test_nonfinite_input_counts_are_exact_whichever_input_holds_them(case):
    """The log-prob inputs' non-finite counts are witnessed by the differences they enter (0 there: 0, no
    count taken); otherwise counted after the transfer. Either way each input's count is its own exact count on
    loss tokens: NaN, +-inf in one input alone (cases 0-4), in every input (5), the same +inf in two inputs of
    one difference (6: inf - inf), off the mask (never counted), and finite values whose differences overflow
    (7: witnesses > 0, counts 0)."""
    names = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy")
    gen = torch.Generator().manual_seed(case)
    batch = make_batch(case % 3)
    base = batch.healthy_inputs()
    hits = torch.rand(base.loss_mask.shape, generator=gen) < 0.05
    bad = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (int(hits.sum()),), generator=gen)]
    changed = {name: getattr(base, name).clone() for name in names}
    if case < 5:
        changed[names[case]][hits] = bad
    elif case == 5:
        for name in names:
            changed[name][hits] = bad
    elif case == 6:
        for name in ("logprobs", "ref_logprobs"):
            changed[name][hits] = math.inf
    else:
        for name in names:
            changed[name][base.loss_mask] = 3e38 if name in ("rollout_logprobs", "ref_logprobs") else -3e38
    x = batch.inputs(**changed, loss_mask=base.loss_mask)
    m = compute_step(x, CFG)
    for name in names:
        expected = int((~torch.isfinite(changed[name]) & x.loss_mask).sum())
        if case < 5:
            assert (expected > 0) == (name == names[case])
        assert m[f'grpo_nonfinite_values_total{{tensor="{name}"}}'] == expected, (case, name)
