"""The fine histogram: quantiles and top-fraction means within the documented relative error (2^-8) of the exact
ones on random, heavy-tailed and constant inputs; classic buckets exact; merged counts read as one sample."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_exporter.functional import histogram as hist
from grpo_exporter.functional import histogram_host as host
from grpo_exporter.functional import reading
from grpo_exporter.functional.reading import filled, keep_bits, sum64, zeroed

QS = (0.0, 0.001, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
TOL = hist.RELATIVE_ERROR
in_range = st.floats(min_value=2.0**-30, max_value=2.0**31, allow_nan=False, width=32)


def within(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.all(np.abs(got - want) <= TOL * np.abs(want) + hist.ABSOLUTE_FLOOR))


def test_documented_error_is_at_most_one_percent():
    assert TOL == 2.0**-8 < 0.01


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(in_range | st.just(0.0), min_size=1, max_size=300),
    keep=st.lists(st.booleans(), min_size=300, max_size=300),
)
def test_quantiles_within_the_documented_error_of_numpy(values, keep):
    x = torch.tensor(values, dtype=torch.float32)
    valid = torch.tensor(keep[: len(values)])
    r = host.masked_quantiles(x, valid, QS)
    chosen = x[valid].double().numpy()
    assert bool(r.present) is bool(chosen.size)
    if chosen.size:
        got = r.value.double().numpy()
        assert within(got, np.quantile(chosen, QS)), (got, np.quantile(chosen, QS))
        assert got[0] == chosen.min()
        assert got[-1] == chosen.max()
    else:
        assert torch.all(r.value == 0)


@pytest.mark.parametrize("seed", range(3))
def test_heavy_tailed_sample_of_a_million(seed):
    """Log-normal with sigma 4 (values from ~e^-20 to ~e^20): every quantile within 2^-8."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(1_000_000, generator=gen) * 4)
    valid = torch.rand(1_000_000, generator=gen) < 0.7
    qs = (0.0, 1e-4, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 0.9999, 1.0)
    chosen = x[valid].double().numpy()
    assert within(host.masked_quantiles(x, valid, qs).value.double().numpy(), np.quantile(chosen, qs))


@pytest.mark.parametrize("value", [0.0, 1e-3, 1.0, 1.2, 4096.0])
def test_constant_input_reads_back_exactly(value):
    x = torch.full((10_000,), value)
    exact = x[0].item()  # the value in fp32
    r = host.masked_quantiles(x, torch.ones_like(x, dtype=torch.bool), QS)
    assert r.value.tolist() == [exact] * len(QS)  # clamped into [min, max] = [value, value]
    top = host.top_fraction_mean(x, torch.ones_like(x, dtype=torch.bool), 0.2).value.item()
    assert top == pytest.approx(exact, rel=TOL)  # no minimum is kept for it: within the bucket's error


@settings(max_examples=100, deadline=None)
@given(values=st.lists(in_range, min_size=1, max_size=200), fraction=st.sampled_from([0.05, 0.2, 0.5, 1.0]))
def test_top_fraction_mean_within_the_documented_error(values, fraction):
    x = torch.tensor(values, dtype=torch.float32)
    got = host.top_fraction_mean(x, torch.ones_like(x, dtype=torch.bool), fraction).value.item()
    k = max(1, math.ceil(Fraction(str(fraction)) * len(values)))
    want = float(np.mean(np.sort(x.double().numpy())[::-1][:k]))
    assert abs(got - want) <= TOL * want * (1 + 1e-6)


def test_infinities_and_empty_samples():
    x = torch.tensor([0.0, 1.0, 1.0, math.inf])
    r = host.masked_quantiles(x, torch.ones(4, dtype=torch.bool), (0.0, 0.2, 0.5, 0.9, 1.0))
    assert r.value.tolist() == [0.0, pytest.approx(0.6, rel=TOL), pytest.approx(1.0, rel=TOL), math.inf, math.inf]
    empty = host.masked_quantiles(x, torch.zeros(4, dtype=torch.bool), (0.5, 1.0))
    assert not empty.present
    assert empty.value.tolist() == [0.0, 0.0]


def test_nan_outside_the_valid_positions_is_never_counted():
    x = torch.tensor([math.nan, 2.0, -0.0, math.nan])
    h = hist.histogram(x, torch.tensor([False, True, True, False]))
    assert int(h.counts.sum()) == 2
    assert h.counts[0] == 1


@pytest.mark.parametrize("shape", [(64,), (1, 1), (5, 1), (3, 2), (7, 3), (4, 7), (33, 256), (2, 1000)])
def test_counts_equal_the_bucket_of_each_value_searched_in_the_edges(shape):
    """The banked bincount (neighbours count into different copies of the buckets) and the clamped keys give
    each valid value exactly the bucket a search in the upper edges does, for every width (a multiple of the
    bank count or not), with negatives and -0.0 in bucket 0, values beyond 2^32 and +inf in the top one."""
    gen = torch.Generator().manual_seed(sum(shape))
    n = math.prod(shape)
    x = torch.exp(torch.randn(n, generator=gen) * 12).float()  # ~e^-50 .. e^50: beyond both ends
    specials = torch.tensor([0.0, -0.0, -1.0, math.inf, 2.0**-32, 2.0**32, 1.0, 3e38, 1e-45])
    x[: min(n, len(specials))] = specials[: min(n, len(specials))]
    x = x.reshape(shape)
    valid = torch.rand(shape, generator=gen) < 0.7
    h = hist.histogram(x, valid)
    edges = hist._upper_edges()  # the bucket definition itself
    picked = x[valid].double().clamp(min=0.0)
    want = torch.bincount(torch.searchsorted(edges, picked, right=False), minlength=hist.BUCKETS)
    assert torch.equal(h.counts, want)


def test_buckets_are_half_open_from_below_so_le_is_exact():
    bounds = (1.0, 2.0, 256.0)
    x = torch.tensor([0.5, 1.0, 1.0000001, 2.0, 255.0, 256.0, 257.0, 1e12])
    counts = host.cumulative_buckets(hist.histogram(x, torch.ones(8, dtype=torch.bool)), bounds)
    assert counts.tolist() == [2, 4, 6, 8]


def test_bounds_must_be_fine_edges():
    assert hist.edge_index(1.0) - hist.edge_index(0.5) == 2**hist.MANTISSA_BITS
    with pytest.raises(ValueError, match=r"bucket bound 0\.8: .*nearest edges 0\.796875 and 0\.80078125"):
        hist.edge_index(0.8)
    with pytest.raises(ValueError, match="expected a value in"):
        hist.edge_index(1e12)


def test_summed_counts_read_exactly_as_the_concatenated_sample():
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(3, 5000, generator=gen).pow(4) * 2
    valid = torch.rand(3, 5000, generator=gen) < 0.5
    parts = [hist.histogram(x[i], valid[i]) for i in range(3)]
    merged = hist.Histogram(sum(p.counts for p in parts), min(p.minimum for p in parts), max(p.maximum for p in parts))
    whole = hist.histogram(x, valid)
    assert torch.equal(merged.counts, whole.counts)
    assert torch.equal(host.quantile_values(merged, QS), host.quantile_values(whole, QS))
    assert torch.equal(host.top_mean_value(merged, 0.2), host.top_mean_value(whole, 0.2))


@pytest.mark.parametrize("small", [1 << 16, 0], ids=["where", "bit-masks"])
def test_masking_helpers_drop_nan_and_infinities_outside_the_mask(small, monkeypatch):
    """``zeroed`` / ``filled`` (torch.where on small tensors, bit masks on large ones; ``small`` = 0 takes the
    bit masks at any size) keep the values on the mask exactly, in any input dtype, and never let NaN or
    +-inf through from outside."""
    monkeypatch.setattr(reading, "SMALL", small)
    x = torch.tensor([[1.5, float("nan"), -float("inf"), -2.0], [float("inf"), 0.25, -0.0, 3.0]])
    mask = torch.tensor([[True, False, False, True], [False, True, True, True]])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        z = zeroed(x.to(dtype), mask)
        assert z.dtype == torch.float32
        assert torch.equal(z, torch.tensor([[1.5, 0.0, 0.0, -2.0], [0.0, 0.25, -0.0, 3.0]]))
        assert torch.equal(filled(x.to(dtype), mask, -math.inf),
                           torch.tensor([[1.5, -math.inf, -math.inf, -2.0], [-math.inf, 0.25, -0.0, 3.0]]))
    rows = torch.tensor([[True], [False]])  # a per-row mask broadcasts
    assert torch.equal(zeroed(x, rows)[1], torch.zeros(4))
    assert torch.equal(zeroed(x, keep_bits(mask)), zeroed(x, mask))


def test_finiteness_and_counts_agree_with_torch_in_every_dtype():
    """``finite`` / ``nonfinite`` / ``count_nonfinite`` (|x| < inf, the bits of x - x) and ``count`` along a
    dimension (bytes summed) give torch's own answers on NaN, +-inf, -0.0, the largest and smallest floats, any
    float dtype, integers, and non-contiguous tensors and masks."""
    values = [1.5, float("nan"), -float("inf"), float("inf"), -0.0, 0.0, 3.0e38, -3.0e38, 1e-45, -2.0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = torch.tensor(values).to(dtype).reshape(2, 5)
        assert torch.equal(reading.finite(x), torch.isfinite(x)), dtype
        assert torch.equal(reading.nonfinite(x), ~torch.isfinite(x)), dtype
        assert reading.count_nonfinite(x).item() == (~torch.isfinite(x)).sum().item(), dtype
        assert reading.count_nonfinite(x.t()[1:]).item() == (~torch.isfinite(x.t()[1:])).sum().item(), dtype
        scratch = torch.full((4, 2), 7.0, dtype=dtype)  # a reused buffer: its old values never count
        for _ in range(2):
            expected = (~torch.isfinite(x.t()[1:])).sum().item()
            assert reading.count_nonfinite(x.t()[1:], scratch).item() == expected, dtype
    ints = torch.arange(6).reshape(2, 3)
    assert reading.finite(ints).all()
    assert reading.count_nonfinite(ints).item() == 0
    mask = (torch.rand(7, 300, generator=torch.Generator().manual_seed(2)) < 0.4).t()  # (300, 7), strided
    for dim in (0, 1):
        assert torch.equal(reading.count(mask, dim).long(), mask.sum(dim)), dim
    assert reading.count(mask).item() == mask.sum().item()


def test_sum64_of_rows_split_across_ranks_adds_up_to_the_whole():
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(64, 333, generator=gen) * 10
    whole = sum64(x)
    assert whole.dtype == torch.float64
    assert abs(whole.item() - x.double().sum().item()) <= 1e-6 * whole.item()
    assert (sum64(x[:20]) + sum64(x[20:])).item() == pytest.approx(whole.item(), rel=1e-15)


def test_a_stack_of_histograms_reads_as_each_one_alone():
    """``histograms`` (one sample, k subsets: completion lengths by outcome) counts and reads each row exactly
    as ``histogram`` and ``quantile_values`` do for that subset alone, empty subsets included."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(1, 4097, (300,), generator=gen).float()
    correct = torch.rand(300, generator=gen) < 0.3
    members = torch.stack([torch.ones_like(correct), correct, ~correct, torch.zeros_like(correct)])
    stack = hist.histograms(x, members)
    qs = (0.0, 0.5, 0.99, 1.0)
    batched = host.quantile_values(stack, qs)
    buckets = host.cumulative_buckets(stack, (32.0, 256.0, 1024.0))
    for i, subset in enumerate(members):
        alone = hist.histogram(x, subset)
        assert torch.equal(stack.counts[i], alone.counts)
        assert stack.minimum[i] == alone.minimum
        assert stack.maximum[i] == alone.maximum
        assert torch.equal(batched[i], host.quantile_values(alone, qs))
        assert torch.equal(buckets[i], host.cumulative_buckets(alone, (32.0, 256.0, 1024.0)))
    assert batched[3].eq(0).all()
    assert buckets[3].eq(0).all()
