"""Issue 54: what a careless or hostile loop hands over cannot falsify, poison or duplicate what is published.

Each case is a reproduction from the issue, a few lines each: counts validated for their meaning (kept <= generated,
non-negative, versions ordered, in a range a run can reach), steps bounded so that one wrong number never poisons
the run's state, evaluations' arguments checked, an error counted once in strict mode, and the registry left as
it was found by close() and by a failed construction.
"""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from grpo_exporter import GRPOMonitor
from grpo_exporter.inputs import MAX_COUNT, MAX_INTEGER, MAX_ROW_COUNT, InputError
from grpo_exporter.serving.server import PortInUseError

ROLLOUT_ERRORS = 'grpo_exporter_errors_total{stage="rollout"}'
UPDATE_ERRORS = 'grpo_exporter_errors_total{stage="update"}'


def _monitor(**settings: object) -> GRPOMonitor:
    return GRPOMonitor(run="bounds", group_size=4, port=None, **settings)


def _rewards(n: int = 8) -> torch.Tensor:
    return torch.tensor([1.0, 0.0, 0.0, 1.0] * (n // 4))


def _update(n: int = 8, t: int = 5, **more: object) -> dict[str, object]:
    lp = torch.full((n, t), -1.0)
    return {"logprobs": lp, "old_logprobs": lp.clone(), "loss_mask": torch.ones(n, t, dtype=torch.bool),
            "advantages": torch.ones(n), **more}


# ---- dynamic-sampling counts: kept <= generated ---------------------------------------------------------------

@pytest.mark.parametrize(("counts", "kept"), [
    ({"generated_groups": 1}, 2),  # published a kept ratio of 2.0
    ({"generated_groups": 0}, 2),  # removed the ratio silently
])
def test_more_kept_groups_than_were_generated_is_an_input_error(counts: dict[str, int], kept: int) -> None:
    with _monitor() as mon:
        mon.observe_rollout(0, rewards=_rewards(), generated_groups=8)
        assert mon.metrics()["grpo_kept_groups_ratio"] == 2 / 8
        mon.observe_rollout(1, rewards=_rewards(), **counts)
        m = mon.metrics()
        assert m[ROLLOUT_ERRORS] == 1
        assert m["grpo_kept_groups_ratio"] == 2 / 8, "the rejected rollout publishes nothing"
        assert m["grpo_generated_groups_total"] == 8
    with _monitor(strict=True) as strict, pytest.raises(InputError, match="`generated_groups`") as info:
        strict.observe_rollout(0, rewards=_rewards(), **counts)
    assert f"{kept} groups kept" in str(info.value)


def test_a_batch_topped_up_with_filtered_groups_is_true() -> None:
    """3 generated, 3 filtered, 2 kept: a loop whose rounds could not fill the batch tops it up with groups it had
    filtered (the demo's DAPO loop does), so kept + filtered may pass generated; kept alone may not."""
    with _monitor(strict=True) as mon:
        mon.observe_rollout(0, rewards=_rewards(), generated_groups=3, filtered_all_correct_groups=3)
        assert mon.metrics()["grpo_kept_groups_ratio"] == 2 / 3
        mon.observe_rollout(1, rewards=_rewards(), generated_groups=5, filtered_all_correct_groups=2,
                            filtered_all_incorrect_groups=1)
        assert mon.metrics()["grpo_kept_groups_ratio"] == 2 / 5


def test_kept_groups_are_checked_with_group_ids_too() -> None:
    with _monitor(strict=True) as mon, pytest.raises(InputError, match="3 groups kept"):
        mon.observe_rollout(0, rewards=torch.rand(6), group_ids=torch.tensor([5, 5, 9, 9, 2, 2]), generated_groups=2)


# ---- per-completion counts: 0..2^24 ------------------------------------------------------------------------

@pytest.mark.parametrize(("call", "name", "value"), [
    ("rollout", "turns", torch.full((8,), -3)),  # published a sum of -24
    ("rollout", "completion_lengths", torch.tensor([5, 5, -40, 5, 5, 5, 5, 5])),  # a histogram _sum below 0
    ("update", "staleness", torch.full((8,), -5)),  # a mean and max of -5 versions
    ("update", "staleness", torch.full((8,), MAX_ROW_COUNT + 1)),  # a max below its mean (fp32)
])
def test_a_count_per_completion_outside_its_range_is_an_input_error(call: str, name: str, value: torch.Tensor) -> None:
    with _monitor() as mon:
        if call == "rollout":
            mon.observe_rollout(0, rewards=_rewards(), **{name: value})
        else:
            mon.observe_update(0, **_update(**{name: value}))
            mon.end_step()
        m = mon.metrics()
        assert m[ROLLOUT_ERRORS if call == "rollout" else UPDATE_ERRORS] == 1
        assert not any(key.startswith(("grpo_completion_turns", "grpo_completion_length", "grpo_token_staleness"))
                       for key in m), m
    with _monitor(strict=True) as strict:
        observe = (lambda: strict.observe_rollout(0, rewards=_rewards(), **{name: value})) if call == "rollout" \
            else (lambda: (strict.observe_update(0, **_update(**{name: value})), strict.end_step()))
        with pytest.raises(InputError, match=rf"`{name}`: expected integers in 0\.\."):
            observe()


def test_the_largest_staleness_is_published_exactly() -> None:
    with _monitor(strict=True) as mon:
        mon.observe_update(0, **_update(staleness=torch.tensor([MAX_ROW_COUNT] + [1] * 7)))
        mon.end_step()
        assert mon.metrics()["grpo_token_staleness_max_versions"] == MAX_ROW_COUNT


def test_a_learner_older_than_the_rollout_is_an_input_error() -> None:
    with _monitor(strict=True) as mon, pytest.raises(InputError, match="`policy_version`: expected at least "
                                                                       r"rollout_policy_version \(10\)"):
        mon.observe_update(0, **_update(policy_version=3, rollout_policy_version=10))  # published staleness -7


@pytest.mark.parametrize(("keyword", "value"), [
    ("tool_calls", 2**70), ("dropped_stale_total", 2**70), ("aborted_completions", MAX_COUNT + 1),
    ("tool_calls", -1), ("generated_groups", True),
])
def test_a_count_beyond_what_a_run_can_reach_never_enters_a_counter(keyword: str, value: int) -> None:
    with _monitor() as mon:
        mon.observe_rollout(0, rewards=_rewards(), **{keyword: value})
        m = mon.metrics()
        assert m[ROLLOUT_ERRORS] == 1
        assert all(v < 1e12 for k, v in m.items() if k.endswith("_total")), m
    expected = rf"`{keyword}`: expected a Python int in 0\.\."
    with _monitor(strict=True) as strict, pytest.raises(InputError, match=expected):
        strict.observe_rollout(0, rewards=_rewards(), **{keyword: value})


# ---- step numbers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [10**400, 2**63 - 1, 2**64, MAX_INTEGER + 1, -1, np.uint64(2**64 - 1)])
def test_a_step_beyond_the_range_never_poisons_the_run(bad: int) -> None:
    with _monitor() as mon:
        mon.observe_rollout(0, rewards=_rewards())
        mon.observe_rollout(bad, rewards=_rewards())
        assert mon.metrics()[ROLLOUT_ERRORS] == 1
        for step in (1, 2):  # 10**400 made every later call raise OverflowError; 2**63-1 froze the step
            mon.observe_rollout(step, rewards=_rewards())
        m = mon.metrics()
        assert (m["grpo_steps_total"], m["grpo_last_step"], m[ROLLOUT_ERRORS]) == (3, 2, 1)
    with _monitor(strict=True) as strict, pytest.raises(InputError, match=r"`step`: expected a Python int in 0\.\."):
        strict.observe_update(bad, **_update())


def test_the_largest_step_is_published_exactly() -> None:
    with _monitor(strict=True) as mon:
        mon.observe_rollout(MAX_INTEGER, rewards=_rewards())
        assert mon.metrics()["grpo_last_step"] == MAX_INTEGER


def test_an_evaluation_does_not_move_the_runs_step() -> None:
    """observe_regression(10**6) before training froze grpo_steps_total and grpo_last_step for 10**6 steps."""
    with _monitor() as mon:
        mon.observe_regression(10**6, torch.ones(16, dtype=torch.bool))
        mon.observe_retrieval(10**6, torch.randn(8, 3), torch.arange(8) % 3)
        for step in range(3):
            mon.observe_rollout(step, rewards=_rewards())
        m = mon.metrics()
        assert (m["grpo_steps_total"], m["grpo_last_step"]) == (3, 2)
        mon.observe_regression(10**400, torch.ones(16, dtype=torch.bool))
        assert mon.metrics()[ROLLOUT_ERRORS] == 1


# ---- evaluations' arguments ----------------------------------------------------------------------------------

@pytest.mark.parametrize("own", [
    torch.ones(8, dtype=torch.bool), torch.zeros(8), torch.full((8,), 7), torch.full((8,), -1),
    np.zeros(8, dtype=np.int64), [0] * 8, None, torch.zeros(8, dtype=torch.long, device="meta"),
    torch.zeros(5, dtype=torch.long),
])
def test_a_wrong_own_prompt_is_an_input_error_naming_it(own: object) -> None:
    with _monitor() as mon:
        mon.observe_retrieval(0, torch.randn(8, 3), own)  # type: ignore[arg-type]
        m = mon.metrics()
        assert m[ROLLOUT_ERRORS] == 1
        assert "grpo_retrieval_accuracy_ratio" not in m
    with _monitor(strict=True) as strict, pytest.raises(InputError, match="`own_prompt`: expected"):
        strict.observe_retrieval(0, torch.randn(8, 3), own)  # type: ignore[arg-type]


@pytest.mark.parametrize("scores", [torch.randn(8, 1), torch.randn(8), torch.ones(8, 3, dtype=torch.long),
                                    torch.randn(8, 3, device="meta"), [[0.0] * 3] * 8])
def test_wrong_scores_are_an_input_error_naming_them(scores: object) -> None:
    with _monitor(strict=True) as strict, pytest.raises(InputError, match="`scores`: expected"):
        strict.observe_retrieval(0, scores, torch.zeros(8, dtype=torch.long))  # type: ignore[arg-type]


def test_a_regression_set_on_the_meta_device_is_an_input_error() -> None:
    with _monitor(strict=True) as strict, pytest.raises(InputError, match="`correct`"):
        strict.observe_regression(0, torch.ones(8, dtype=torch.bool, device="meta"))


# ---- strict mode counts once ----------------------------------------------------------------------------------

def test_strict_mode_counts_a_rejected_input_once_and_says_it_raised(caplog: pytest.LogCaptureFixture) -> None:
    with _monitor(strict=True) as mon, caplog.at_level(logging.WARNING, "grpo_exporter"):
        with pytest.raises(InputError):
            mon.observe_rollout(0, rewards=torch.rand(7))  # 7 completions in groups of 4
        assert mon.metrics()[ROLLOUT_ERRORS] == 1  # was 2: the stage and its inner block each counted it
    said = [r.getMessage() for r in caplog.records if "failed in stage" in r.getMessage()]
    assert len(said) == 1
    assert "raised: strict=True" in said[0]
    assert "training continues" not in said[0]


# ---- the registry: as close() and a failed construction found it ------------------------------------------------

def _families(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if line.startswith("# TYPE grpo_")]


def test_a_second_monitor_on_the_same_registry_after_close_publishes_no_duplicate() -> None:
    registry = CollectorRegistry()
    with GRPOMonitor(run="first", group_size=4, port=None, registry=registry) as first:
        first.observe_rollout(0, rewards=_rewards())
    assert _families(registry) == []  # never scraped: its collector left at close
    with GRPOMonitor(run="second", group_size=4, port=None, registry=registry) as second:
        second.observe_rollout(0, rewards=_rewards())
        text = generate_latest(registry).decode()
        assert 'run="first"' not in text
        families = _families(registry)
        assert families
        assert len(families) == len(set(families))


def test_a_registry_its_user_serves_shows_the_end_once_then_is_left_clean() -> None:
    registry = CollectorRegistry()
    mon = GRPOMonitor(run="served", group_size=4, port=None, registry=registry)
    mon.observe_rollout(0, rewards=_rewards())
    assert _families(registry)  # the user's server scraped it
    mon.close()
    assert 'grpo_run_finished{run="served"} 1.0' in generate_latest(registry).decode()  # the end, seen once
    assert _families(registry) == []


def test_a_new_monitor_takes_a_registry_whose_last_run_waits_for_its_final_scrape() -> None:
    registry = CollectorRegistry()
    first = GRPOMonitor(run="first", group_size=4, port=None, registry=registry)
    first.observe_rollout(0, rewards=_rewards())
    generate_latest(registry)
    first.close()
    with GRPOMonitor(run="second", group_size=4, port=None, registry=registry) as second:
        second.observe_rollout(0, rewards=_rewards())
        text = generate_latest(registry).decode()
        assert 'run="first"' not in text
        assert 'run="second"' in text


def test_two_open_monitors_on_one_registry_are_an_error_naming_it() -> None:
    registry = CollectorRegistry()
    with GRPOMonitor(run="first", group_size=4, port=None, registry=registry):
        with pytest.raises(ValueError, match=r"registry: expected a registry without another open .*'first'"):
            GRPOMonitor(run="second", group_size=4, port=None, registry=registry)
        assert len(_families(registry)) == len(set(_families(registry)))


def test_the_default_registry_takes_one_monitor_after_another() -> None:
    """prometheus-client's own registry raised DuplicateTimeseries for the second monitor; it also holds its own
    process collector, which a serving monitor leaves in place."""
    for run in ("first", "second"):
        with GRPOMonitor(run=run, group_size=4, port=0, close_linger_s=0, registry=REGISTRY) as mon:
            mon.observe_rollout(0, rewards=_rewards())
            assert REGISTRY.get_sample_value("grpo_steps_total", {"run": run}) == 1
    assert _families(REGISTRY) == []
    assert REGISTRY.get_sample_value("process_start_time_seconds") is not None


def test_a_strict_construction_that_fails_on_a_busy_port_leaves_the_registry_clean() -> None:
    registry = CollectorRegistry()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError):
            GRPOMonitor(run="strict", group_size=4, port=port, strict=True, registry=registry)
    assert generate_latest(registry) == b""  # left 11 duplicated lines (the process collector's) behind
    with GRPOMonitor(run="again", group_size=4, port=0, close_linger_s=0, registry=registry) as mon:
        mon.observe_rollout(0, rewards=_rewards())
        lines = generate_latest(registry).decode().splitlines()
        assert len(lines) == len(set(lines))


def test_the_compiled_step_checks_the_kept_groups_too() -> None:
    """The kept-groups check is a block's value check: a compiled stage carries it in its program's transfer."""
    n, t = 16, 8
    lp = torch.full((n, t), -1.0)
    fields = {"rewards": _rewards(n), "correct": _rewards(n).bool(), "rollout_logprobs": lp, "old_logprobs": lp.clone(),
              "loss_mask": torch.ones(n, t, dtype=torch.bool), "completion_lengths": torch.full((n,), t)}
    with _monitor(compile_step="auto", compile_min_positions=0) as mon:
        mon.observe_rollout(0, generated_groups=8, **fields)
        assert mon.compilation.wait(300)
        mon.observe_rollout(1, generated_groups=8, **fields)
        mon.observe_rollout(2, generated_groups=2, **fields)
        m = mon.metrics()
        assert m["grpo_exporter_compiled_stage_calls_total"] == 2
        assert (m["grpo_kept_groups_ratio"], m[ROLLOUT_ERRORS]) == (4 / 8, 1)


# ---- found by a hostile probe of the fixes above ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_a_narrow_integer_count_is_read_without_wrapping(dtype: torch.dtype) -> None:
    """2^24 does not fit an int8: comparing with it wrapped, and every valid length of 5 was 'out of range'."""
    with _monitor(strict=True) as mon:
        mon.observe_rollout(0, rewards=_rewards(), completion_lengths=torch.full((8,), 5, dtype=dtype),
                            turns=torch.full((8,), 2, dtype=dtype))
        assert mon.metrics()["grpo_completion_turns_sum"] == 16
    if dtype.is_signed:
        with _monitor(strict=True) as mon, pytest.raises(InputError, match="`turns`"):
            mon.observe_rollout(0, rewards=_rewards(), turns=torch.full((8,), -1, dtype=dtype))


def test_one_call_with_several_wrong_fields_is_one_error_naming_them() -> None:
    with _monitor() as mon:
        mon.observe_rollout(0, rewards=_rewards(), completion_lengths=torch.full((8,), -1),
                            turns=torch.full((8,), -2))
        assert mon.metrics()[ROLLOUT_ERRORS] == 1
    with _monitor(strict=True) as strict, pytest.raises(InputError, match="also wrong: `turns`"):
        strict.observe_rollout(0, rewards=_rewards(), completion_lengths=torch.full((8,), -1),
                               turns=torch.full((8,), -2))


def test_a_grouping_error_is_one_error_however_many_blocks_need_the_groups() -> None:
    with _monitor() as mon:
        mon.observe_rollout(0, rewards=torch.rand(7), correct=torch.ones(7, dtype=torch.bool))  # 7 in groups of 4
        assert mon.metrics()[ROLLOUT_ERRORS] == 1  # was 4: each block that groups counted it


@pytest.mark.parametrize("norms", [{"grad_norm_pre_clip": -1.0}, {"grad_norm_post_clip": torch.tensor(-5.0)},
                                   {"max_grad_norm": -2}])
def test_a_negative_norm_is_an_input_error(norms: dict[str, object]) -> None:
    name = next(iter(norms))
    with _monitor() as mon:
        mon.observe_update(0, **_update(**norms))
        mon.end_step()
        m = mon.metrics()
        assert m[UPDATE_ERRORS] == 1
        assert not {"grpo_grad_norm_pre_clip", "grpo_grad_norm_post_clip"} & set(m), m
    with _monitor(strict=True) as strict, pytest.raises(InputError, match=rf"`{name}`: expected a number >= 0"):
        _one_step(strict, **norms)  # a tensor's sign is read with the step's transfer, when the step ends


def _one_step(mon: GRPOMonitor, **fields: object) -> None:
    mon.observe_update(0, **_update(**fields))
    mon.end_step()


@pytest.mark.parametrize("step", [torch.tensor(True), torch.tensor(3, device="meta"), torch.tensor(2 + 0j)])
def test_a_step_tensor_without_an_integer_is_a_type_error(step: torch.Tensor) -> None:
    with _monitor() as mon, pytest.raises(TypeError, match="`step`: expected an integer"):
        mon.observe_rollout(step, rewards=_rewards())  # type: ignore[arg-type]


def test_a_registry_of_another_type_is_an_error_naming_it() -> None:
    with pytest.raises(TypeError, match="registry: expected a prometheus_client CollectorRegistry"):
        GRPOMonitor(run="r", group_size=4, port=None, registry="not a registry")  # type: ignore[arg-type]


def test_a_busy_port_is_counted_where_the_first_scrape_sees_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        mon = GRPOMonitor(run="busy", group_size=4, port=taken.getsockname()[1], close_linger_s=0,
                          registry=CollectorRegistry())
        with mon:
            assert mon.registry.get_sample_value("grpo_exporter_errors_total", {"run": "busy", "stage": "scrape"}) == 1


def test_a_failed_construction_gives_back_the_closed_runs_last_scrape() -> None:
    registry = CollectorRegistry()
    first = GRPOMonitor(run="first", group_size=4, port=None, registry=registry)
    generate_latest(registry)  # its user's server scrapes it
    first.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PortInUseError):
            GRPOMonitor(run="second", group_size=4, port=taken.getsockname()[1], strict=True, registry=registry)
    assert 'grpo_run_finished{run="first"} 1.0' in generate_latest(registry).decode()
    assert _families(registry) == []
