"""The mastered-prompt regression set (seed 第 4 篇 (collapse root causes) 4.3: dynamic sampling hides the
shrinking prompt pool; a small held set of solved prompts, checked every K steps, is the alarm, not a ruler)."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.inputs import InputError

ANCHOR = 'grpo_run_anchor{metric="grpo_regression_accuracy_ratio",labels=""}'


def _monitor(**settings) -> GRPOMonitor:
    return GRPOMonitor(run="reg", group_size=4, port=None, guard="off", close_linger_s=0.0, **settings)


def _set(hits: int, n: int = 64, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    return (torch.arange(n) < hits).to(dtype)


def test_each_evaluation_is_counted_and_the_first_ones_make_the_anchor():
    with _monitor() as mon:
        for step, hits in zip((0, 50, 100), (62, 60, 58), strict=True):
            assert ANCHOR not in mon.metrics()  # the early window is three evaluations by default
            mon.observe_regression(step, _set(hits))
        m = mon.metrics()
        assert m[ANCHOR] == pytest.approx((62 + 60 + 58) / 3 / 64, rel=1e-12)
        mon.observe_regression(150, _set(40, dtype=torch.float32))  # 0/1 floats are taken as well
        m = mon.metrics()
        assert m[ANCHOR] == pytest.approx(180 / 192, rel=1e-12), "frozen after its evaluations"
        assert m["grpo_regression_accuracy_ratio"] == 40 / 64
        assert m["grpo_regression_evaluated_completions"] == 64
        assert m["grpo_regression_completions_total"] == 4 * 64
        assert m["grpo_regression_correct_completions_total"] == 62 + 60 + 58 + 40
        assert "grpo_last_step" not in m, "an evaluation beside training is not a step of the run"


def test_the_anchor_takes_its_own_number_of_evaluations():
    with _monitor(regression_anchor_evaluations=1) as mon:
        mon.observe_regression(0, _set(32, n=40, dtype=torch.int64))
        assert mon.metrics()[ANCHOR] == 32 / 40


@pytest.mark.parametrize(("bad", "got"), [
    (torch.ones(4, 2, dtype=torch.bool), "shape (4, 2)"),
    (torch.zeros(0, dtype=torch.bool), "shape (0,)"),
    ([True, False], "list"),
    (torch.tensor([1.0, 2.0, 0.0]), "1 of its 3 values neither 0 nor 1"),
    (torch.tensor([1.0, float("nan")]), "1 of its 2 values neither 0 nor 1 (NaN included)"),
])
def test_a_bad_evaluation_names_the_field_and_is_counted_outside_strict_mode(bad, got):
    with _monitor(strict=True) as strict, pytest.raises(InputError, match=r"`correct`") as raised:
        strict.observe_regression(0, bad)
    assert got in str(raised.value)
    with _monitor() as mon:
        mon.observe_regression(0, bad)
        m = mon.metrics()
        assert m['grpo_exporter_errors_total{stage="rollout"}'] == 1
        assert "grpo_regression_completions_total" not in m
        assert "grpo_regression_accuracy_ratio" not in m


def test_one_host_read_per_evaluation(monkeypatch):
    reads: list[str] = []
    original = torch.Tensor.tolist

    def spy(self):
        reads.append("tolist")
        return original(self)

    with _monitor() as mon:
        monkeypatch.setattr(torch.Tensor, "tolist", spy)
        for name in ("item", "__float__", "__int__", "__bool__", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, lambda *_, __n=name: pytest.fail(f"hidden sync: {__n}"))
        mon.observe_regression(0, _set(50))
        monkeypatch.undo()
    assert reads == ["tolist"]
