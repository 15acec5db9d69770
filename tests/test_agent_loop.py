"""What multi-turn and asynchronous loops count for themselves (turns per completion, tool calls and their
failures, partial rollouts) reaches the monitor's series as counted, through the public API; a wrong count is an
input error naming the field."""

from __future__ import annotations

import pytest
import torch

from grpo_exporter import GRPOMonitor, InputError
from monitor_helpers import registry_value

SETTINGS = {"group_size": 4, "port": None, "guard": "off", "edit_distance_groups": 0, "close_linger_s": 0.0}


def rollout(turns: list[int], partial: list[bool], **counts: int) -> dict[str, object]:
    n = len(turns)
    return {"rewards": torch.arange(n, dtype=torch.float32) % 2, "group_ids": torch.arange(n) // 4,
            "turns": torch.tensor(turns), "partial": torch.tensor(partial), **counts}


def test_turns_tool_calls_and_partial_rollouts_are_published_as_counted() -> None:
    with GRPOMonitor(run="agent", strict=True, **SETTINGS) as mon:
        mon.observe_rollout(0, **rollout([1, 3, 2, 2, 4, 1, 1, 2], [False] * 6 + [True] * 2,
                                         tool_calls=7, tool_failures=2))
        mon.end_step()
        mon.observe_rollout(1, **rollout([2, 2, 5, 1], [True, False, False, False], tool_calls=4, tool_failures=0))
        mon.end_step()
        value = lambda key: registry_value(mon, key)  # noqa: E731
        assert value("grpo_completion_turns_sum") == 16 + 10  # cumulative, as a summary's _sum
        assert value("grpo_completion_turns_count") == 12
        assert value('grpo_completion_turns{quantile="0"}') == 1  # min and max of the last rollout
        assert value('grpo_completion_turns{quantile="1"}') == 5
        assert value("grpo_tool_calls_total") == 11
        assert value("grpo_tool_call_failures_total") == 2
        assert value("grpo_partial_completions_total") == 3
        assert value("grpo_completions_total") == 12


def test_a_loop_without_these_counts_publishes_none_of_them() -> None:
    with GRPOMonitor(run="single-turn", strict=True, **SETTINGS) as mon:
        mon.observe_rollout(0, rewards=torch.tensor([0.0, 1.0, 1.0, 0.0]), group_ids=torch.zeros(4, dtype=torch.long))
        mon.end_step()
        found = mon.metrics()
    assert not [k for k in found if "turns" in k or "tool_call" in k or "partial" in k]


@pytest.mark.parametrize(("bad", "field", "expected"), [
    ({"tool_calls": 2, "tool_failures": 3}, "tool_failures", "at most tool_calls"),
    ({"tool_calls": -1}, "tool_calls", "a Python int in 0..1099511627776"),
    ({"tool_calls": 2.0}, "tool_calls", "a Python int in 0..1099511627776"),
    ({"turns": torch.tensor([1.0, 2.0, 1.0, 1.0])}, "turns", "an integer tensor"),
    ({"partial": torch.tensor([0.5, 0.0, 0.0, 0.0])}, "partial", ""),
])
def test_a_wrong_count_names_the_field_and_is_counted_outside_strict_mode(bad, field, expected, caplog) -> None:
    good = rollout([1, 1, 2, 2], [False] * 4)
    with GRPOMonitor(run="agent", strict=True, **SETTINGS) as mon, pytest.raises(InputError) as raised:
        mon.observe_rollout(0, **(good | bad))
    assert raised.value.field == field
    assert expected in raised.value.expected
    with GRPOMonitor(run="agent", **SETTINGS) as mon:
        mon.observe_rollout(0, **(good | bad))  # training goes on: counted and logged
        mon.end_step()
        assert registry_value(mon, 'grpo_exporter_errors_total{stage="rollout"}') == 1
    assert f"`{field}`" in caplog.text


def test_completions_dropped_as_stale_are_counted_from_the_loops_running_total() -> None:
    """verl's fully-async rollouter reports a running total (count/dropped_stale_samples); the counter adds what
    is new at each rollout, and a total that falls (the rollouter restarted) is all new."""
    with GRPOMonitor(run="async", strict=True, **SETTINGS) as mon:
        for step, total in enumerate((5, 5, 9, 2)):
            mon.observe_rollout(step, **rollout([1, 1, 1, 1], [False] * 4), dropped_stale_total=total)
            mon.end_step()
        assert registry_value(mon, "grpo_dropped_stale_completions_total") == 5 + 0 + 4 + 2
    with GRPOMonitor(run="async", strict=True, **SETTINGS) as mon, pytest.raises(InputError) as raised:
        mon.observe_rollout(0, **rollout([1, 1, 1, 1], [False] * 4), dropped_stale_total=-1)
    assert raised.value.field == "dropped_stale_total"
