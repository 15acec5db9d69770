"""Exact selection quantiles against numpy, including sizes beyond torch.quantile's 2^24 limit."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_exporter.functional.selection import (
    keys_to_values,
    masked_quantiles,
    sortable_keys,
    top_fraction_mean,
)

QS = (0.0, 0.001, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)


def test_keys_preserve_order_and_round_trip():
    x = torch.tensor([-math.inf, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, 3e38, math.inf])
    keys = sortable_keys(x)
    assert torch.all(keys[1:] >= keys[:-1])
    assert torch.equal(keys_to_values(keys).view(torch.int32), x.view(torch.int32))


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(finite_floats, min_size=1, max_size=300),
    keep=st.lists(st.booleans(), min_size=300, max_size=300),
)
def test_masked_quantiles_match_numpy(values, keep):
    x = torch.tensor(values, dtype=torch.float32)
    valid = torch.tensor(keep[: len(values)])
    r = masked_quantiles(x, valid, QS)
    chosen = x[valid].double().numpy()
    assert bool(r.present) is bool(chosen.size)
    if chosen.size:
        np.testing.assert_allclose(r.value.double().numpy(), np.quantile(chosen, QS), rtol=1e-6, atol=1e-30)
    else:
        assert torch.all(r.value == 0)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(finite_floats, min_size=1, max_size=200), fraction=st.sampled_from([0.05, 0.2, 0.5, 1.0]))
def test_top_fraction_mean_matches_sorted_reference(values, fraction):
    x = torch.tensor(values, dtype=torch.float32)
    got = top_fraction_mean(x, torch.ones_like(x, dtype=torch.bool), fraction).value.item()
    k = max(1, math.ceil(Fraction(str(fraction)) * len(values)))
    want = float(np.mean(np.sort(x.double().numpy())[::-1][:k]))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-30)


def test_ties_and_duplicates():
    x = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
    r = masked_quantiles(x, torch.ones(5, dtype=torch.bool), (0.0, 0.5, 0.6, 1.0))
    np.testing.assert_allclose(r.value.numpy(), np.quantile(x.numpy(), (0.0, 0.5, 0.6, 1.0)))
    assert top_fraction_mean(x, torch.ones(5, dtype=torch.bool), 0.2).value.item() == 2.0


def test_infinite_values_never_give_nan():
    x = torch.tensor([1.0, math.inf, math.inf])
    r = masked_quantiles(x, torch.ones(3, dtype=torch.bool), (0.5, 0.9, 1.0))
    assert not torch.isnan(r.value).any()
    assert r.value.tolist() == [math.inf, math.inf, math.inf]


@pytest.mark.slow
def test_sixteen_million_tokens():
    """2^24 + 5003 elements with a ragged mask: torch.quantile refuses this size; selection does not."""
    gen = torch.Generator().manual_seed(3)
    n = (1 << 24) + 5003
    x = torch.randn(n, generator=gen)
    valid = torch.rand(n, generator=gen) < 0.9
    with pytest.raises(RuntimeError):
        torch.quantile(x, 0.5)
    qs = (0.5, 0.99, 0.999)
    r = masked_quantiles(x, valid, qs)
    want = np.quantile(x.numpy()[valid.numpy()].astype(np.float64), qs)
    np.testing.assert_allclose(r.value.double().numpy(), want, rtol=1e-6)
