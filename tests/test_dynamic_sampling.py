"""A dynamic-sampling loop's own counts (seed 第 4 篇 4.1: the groups generated to fill the batch, beside the
zero-variance share): published as counted, the kept share per batch and its frozen early window, and a wrong
count is an input error naming the field."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter import GRPOMonitor, InputError
from monitor_helpers import registry_value

SETTINGS = {"group_size": 4, "port": None, "guard": "off", "edit_distance_groups": 0, "close_linger_s": 0.0,
            "anchor_steps": 3}


def kept_batch(groups: int) -> dict[str, object]:
    """A post-filter batch: every group mixed (one correct of four), as a DAPO filter leaves it."""
    n = groups * 4
    correct = torch.arange(n) % 4 == 0
    return {"rewards": correct.float(), "correct": correct, "group_ids": torch.arange(n) // 4}


def test_generated_and_filtered_groups_are_counted_and_the_kept_share_anchored() -> None:
    with GRPOMonitor(run="dapo", strict=True, **SETTINGS) as mon:
        # 8 groups kept of 10 generated for three batches (the early window), then of 32 (a mastered pool)
        for step, (generated, solved, unsolved) in enumerate(((10, 1, 1), (10, 2, 0), (10, 0, 2), (32, 20, 4))):
            mon.observe_rollout(step, **kept_batch(8), generated_groups=generated,
                                filtered_all_correct_groups=solved, filtered_all_incorrect_groups=unsolved)
            mon.end_step()
        value = lambda key: registry_value(mon, key)  # noqa: E731
        assert value("grpo_generated_groups_total") == 62
        assert value('grpo_filtered_groups_total{outcome="all_correct"}') == 23
        assert value('grpo_filtered_groups_total{outcome="all_incorrect"}') == 7
        assert value("grpo_groups_total") == 32
        assert value("grpo_kept_groups_ratio") == pytest.approx(8 / 32)
        assert value('grpo_run_anchor{labels="",metric="grpo_kept_groups_ratio"}') == pytest.approx(0.8)
        # the kept batch has no zero-variance group: the filter's composition is in its own counter
        assert value("grpo_zero_variance_groups_ratio") == 0.0


def test_a_loop_without_a_filter_publishes_none_of_them() -> None:
    with GRPOMonitor(run="plain", strict=True, **SETTINGS) as mon:
        mon.observe_rollout(0, **kept_batch(2))
        mon.end_step()
        found = mon.metrics()
    assert not [k for k in found if "generated_groups" in k or "filtered_groups" in k or "kept_groups" in k]


@pytest.mark.parametrize(("bad", "field", "expected"), [
    ({"generated_groups": 4, "filtered_all_correct_groups": 3, "filtered_all_incorrect_groups": 2},
     "generated_groups", "at least the groups filtered (5)"),
    ({"filtered_all_correct_groups": 3}, "filtered_all_correct_groups", "generated_groups beside it"),
    ({"generated_groups": -1}, "generated_groups", "a Python int in 0..1099511627776"),
    ({"generated_groups": 8, "filtered_all_incorrect_groups": 2.0}, "filtered_all_incorrect_groups",
     "a Python int in 0..1099511627776"),
    ({"generated_groups": torch.tensor(8)}, "generated_groups", "a Python int in 0..1099511627776"),
])
def test_a_wrong_count_names_the_field_and_is_counted_outside_strict_mode(bad, field, expected, caplog) -> None:
    with GRPOMonitor(run="dapo", strict=True, **SETTINGS) as mon, pytest.raises(InputError) as raised:
        mon.observe_rollout(0, **kept_batch(2), **bad)
    assert raised.value.field == field
    assert expected in raised.value.expected
    with GRPOMonitor(run="dapo", **SETTINGS) as mon:
        mon.observe_rollout(0, **kept_batch(2), **bad)  # training goes on: counted and logged
        mon.end_step()
        assert registry_value(mon, 'grpo_exporter_errors_total{stage="rollout"}') == 1
    assert f"`{field}`" in caplog.text


def test_the_demos_filled_batch_keeps_each_rows_moe_routing() -> None:
    """The demo's DAPO loop picks groups out of several rounds: an MoE rollout's routing follows its rows (the
    routing replay and the monitor's comparison read it row by row)."""
    from grpo_exporter.demo.dynamic_sampling import fill
    from grpo_exporter.demo.engine import Rollout

    rounds = iter(range(3))

    def draw() -> Rollout:
        r = next(rounds)
        n = 8  # 2 groups of 4
        routing = torch.full((n, 5, 2, 2), r)  # each round's routing tells its round
        routing[:, :, 0, 0] = torch.arange(n).unsqueeze(1)  # and its row
        return Rollout(torch.zeros(n, 2, dtype=torch.long), torch.arange(n) // 4, torch.zeros(n, 3, dtype=torch.long),
                       torch.full((n,), 3), torch.zeros(n, 3), torch.zeros(n, dtype=torch.bool), 0, None, routing)

    def correct(rollout: Rollout) -> torch.Tensor:
        first = int(rollout.routing[0, 0, 1, 1])  # round 0: group 0 mixed; round 1: group 1 mixed
        return torch.tensor([True, False, False, False, False, False, False, False]) if first == 0 else \
            torch.tensor([False] * 4 + [True, False, False, False])

    batch, counts = fill(draw, correct, prompts=2, group_size=4, rounds=3)
    assert counts["generated_groups"] == 4
    assert batch.routing is not None
    assert batch.routing[:, 0, 1, 1].tolist() == [0] * 4 + [1] * 4  # round 0's group 0, then round 1's group 1
    assert batch.routing[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
