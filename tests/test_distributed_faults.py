"""Two real gloo processes that disagree: an input on one rank only, an input error on one rank only (also at
the last step), a metric block that raises on one rank only, reward components in another order, one rank
closing early, configs that differ. Each scenario runs under a hard timeout: none may abort or hang past the
exporter's collective timeout, and every published value equals a single-process run of the union (or of
the values given) or is absent."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batches import make_batch
from grpo_exporter.catalog import is_additive
from grpo_exporter.demo.stack import free_port
from grpo_exporter.inputs import StepInputs
from grpo_exporter.runtime.monitor_config import MonitorConfig
from monitor_helpers import assert_merged, expected_step, rollout_kwargs, update_kwargs

WORLD = 2
TIMEOUT_S = 4.0  # the exporter's collective timeout in these tests
HARD_LIMIT_S = 60.0  # a scenario that runs longer has hung
SETTINGS = {"group_size": 8, "clip_eps": (0.2, 0.28), "log_ratio_clamp": 20.0, "guard": "off", "pass_k": (2, 4),
            "port": None, "edit_distance_groups": 0, "distributed_timeout_s": TIMEOUT_S}
ERRORS = "grpo_exporter_errors_total"


def _half(rank: int) -> slice:
    return slice(rank * 24, (rank + 1) * 24)  # three whole groups of 8 on each rank


def _shard(kwargs: dict, rows: slice) -> dict:
    return {k: (v[rows] if isinstance(v, torch.Tensor) else {c: t[rows] for c, t in v.items()})
            for k, v in kwargs.items()}


def _worker(rank: int, scenario: str, port: int, out: str, test_path: str) -> None:
    sys.path.insert(0, test_path)
    logging.basicConfig(level=logging.WARNING, filename=str(Path(out, f"rank{rank}.log")))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from grpo_exporter import GRPOMonitor

    settings = dict(SETTINGS)
    if scenario == "config-differs" and rank == 1:
        settings["pass_k"] = (2,)
    if scenario == "block-raises" and rank == 1:
        import grpo_exporter.functional.diversity as diversity

        def broken(*args, **kwargs):
            raise RuntimeError("injected on rank 1")

        diversity.entropy_stats = broken
    x = make_batch(5).inputs()
    rows = _half(rank)
    result: dict = {"rank": rank, "steps": []}
    start = time.monotonic()
    if scenario == "rank-zero-only":
        if rank == 0:  # the user watches rank 0 alone: no collective may wait for the others
            with GRPOMonitor(run="ddp", **(settings | {"distributed": "local"})) as mon:
                mon.observe_rollout(0, **_shard(rollout_kwargs(x), rows))
                result["steps"].append(dict(mon.metrics()))
            result["merging"] = mon._stages.reducer is not None
        result["seconds"] = time.monotonic() - start
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        return
    mon = GRPOMonitor(run="ddp", **settings)
    if scenario == "empty-rank" and rank == 1:
        rows = slice(0, 0)  # this rank's shard came out empty: no completion
    for step in range(2):
        rollout = _shard(rollout_kwargs(x), rows)
        if scenario == "component-order" and rank == 1:
            rollout["reward_components"] = dict(reversed(list(rollout["reward_components"].items())))
        mon.observe_rollout(step, **rollout)
        update = update_kwargs(x, rows)
        if scenario == "input-on-one-rank" and rank == 1:
            update.pop("entropy")
        last = step == 1
        if scenario == ("input-error-last-step" if last else "input-error") and rank == 1:
            update["old_logprobs"] = update["old_logprobs"][:, :3]  # a shape bug on one rank only
        if scenario == "close-early" and rank == 1 and last:
            mon.close()
            break
        for half in (slice(0, 12), slice(12, 24)):  # two micro-steps
            mon.observe_update(step, **{k: (v[half] if isinstance(v, torch.Tensor) else v) for k, v in update.items()})
        mon.end_step()
        result["steps"].append(dict(mon.metrics()))
    mon.close()
    result["seconds"] = time.monotonic() - start
    result["merging"] = mon._stages.reducer.active
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_scenario(scenario: str, tmp_path: Path) -> list[dict]:
    context = mp.start_processes(_worker, args=(scenario, free_port(), str(tmp_path), str(Path(__file__).parent)),
                                 nprocs=WORLD, start_method="spawn", join=False)
    deadline = time.monotonic() + HARD_LIMIT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"{scenario}: the ranks hung past {HARD_LIMIT_S} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def single_process(rows: slice = slice(None), **drop: bool) -> dict[str, float]:
    x = make_batch(5).inputs()
    cfg = MonitorConfig(run="single", **SETTINGS)
    update = update_kwargs(x, rows)
    for name in drop:
        update.pop(name)
    return expected_step(StepInputs(**_shard(rollout_kwargs(x), rows)), StepInputs(**update), cfg)


def step_values(metrics: dict[str, float]) -> dict[str, float]:
    """A step's own values: counters differenced by the caller; the monitor's self metrics left out."""
    skip = ("grpo_observe_duration", "grpo_last_step", "grpo_steps_total", "grpo_build_info", "grpo_run_info",
            ERRORS, "grpo_edit_distance", "grpo_dropped")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def first_step(result: dict) -> dict[str, float]:
    return step_values(result["steps"][0])


def errors(result: dict) -> float:
    return sum(v for k, v in result["steps"][-1].items() if k.startswith(ERRORS)) if result["steps"] else 0.0


def test_an_input_on_one_rank_only_merges_over_the_ranks_that_gave_it(tmp_path):
    ranks = run_scenario("input-on-one-rank", tmp_path)
    got = first_step(ranks[0])
    union_without_entropy = single_process(entropy=True)
    assert_merged(got, union_without_entropy)
    entropy_of_rank0 = {k: v for k, v in single_process(_half(0)).items() if k.startswith("grpo_entropy")}
    assert entropy_of_rank0
    assert_merged(got, entropy_of_rank0)
    assert first_step(ranks[1]) == got
    assert ranks[0]["merging"]
    assert ranks[1]["merging"]


@pytest.mark.parametrize("scenario", ["input-error", "input-error-last-step"])
def test_an_input_error_on_one_rank_never_aborts_or_hangs(tmp_path, scenario):
    ranks = run_scenario(scenario, tmp_path)
    step = 0 if scenario == "input-error" else 1
    union = single_process()
    for r in ranks:
        assert r["merging"]  # the collectives stayed in step
        assert r["seconds"] < TIMEOUT_S  # nobody waited for a collective that never came
        values = step_values(r["steps"][step])
        update_only = ("grpo_ess", "grpo_importance_weight", "grpo_clipped", "grpo_entropy", "grpo_kl",
                       "grpo_onpolicy", "grpo_advantage", "grpo_update_tokens")
        # the step's update gauges are not computed on any rank: absent at the first step, still those of the
        # last complete step at the last (a family not computed keeps describing its last computation)
        gauges = {k: v for k, v in values.items() if k.startswith(update_only) and not is_additive(k)}
        before = {} if step == 0 else step_values(r["steps"][0])
        assert gauges == {k: v for k, v in before.items() if k in gauges or (
            k.startswith(update_only) and not is_additive(k))}
        assert values["grpo_completions_total"] == union["grpo_completions_total"] * (step + 1)
    assert errors(ranks[1]) == 2  # each rejected micro-step counted, on the rank that failed
    assert errors(ranks[0]) == 0
    assert "old_logprobs" in (tmp_path / "rank1.log").read_text()


def test_a_block_that_raises_on_one_rank_is_absent_everywhere(tmp_path):
    ranks = run_scenario("block-raises", tmp_path)
    got = first_step(ranks[0])
    assert_merged(got, single_process(), absent=("grpo_entropy", "grpo_token_entropy"))
    assert first_step(ranks[1]) == got
    assert errors(ranks[1]) >= 1


def test_an_empty_rank_adds_nothing_and_the_others_are_published(tmp_path):
    """A rank with no completion (N = 0) is no error on either rank; the merge publishes rank 0's values, as a
    single process of rank 0's shard would."""
    ranks = run_scenario("empty-rank", tmp_path)
    for r in ranks:
        assert r["merging"]
        assert r["seconds"] < TIMEOUT_S
        assert errors(r) == 0
    assert_merged(first_step(ranks[0]), single_process(_half(0)))
    assert first_step(ranks[1]) == first_step(ranks[0])


def test_reward_components_in_another_order_merge_by_name(tmp_path):
    ranks = run_scenario("component-order", tmp_path)
    got = first_step(ranks[0])
    assert_merged(got, single_process())
    key = 'grpo_reward_mean{component="format"}'
    assert got[key] == pytest.approx(single_process()[key])


def test_one_rank_closing_early_costs_one_bounded_wait(tmp_path):
    ranks = run_scenario("close-early", tmp_path)
    assert not ranks[0]["merging"]  # the collective timed out: merging is off, said once
    assert ranks[0]["seconds"] < TIMEOUT_S * 3 + 10
    assert "merging across ranks is OFF" in (tmp_path / "rank0.log").read_text()
    last = step_values(ranks[0]["steps"][1])
    assert "grpo_ess_ratio{level=\"token\"}" in last  # rank-local values are still published
    assert last["grpo_completions_total"] > 0


def test_configs_that_differ_never_enter_a_collective(tmp_path):
    ranks = run_scenario("config-differs", tmp_path)
    for r in ranks:
        assert not r["merging"]
        assert r["seconds"] < TIMEOUT_S
    text = (tmp_path / "rank0.log").read_text()
    assert "differs from rank 1" in text
    assert 'grpo_pass_at_k_ratio{k=4}' in text  # the differing entry is named
    local = single_process(_half(0))
    assert first_step(ranks[0])["grpo_completions_total"] == local["grpo_completions_total"]


def test_a_monitor_on_rank_zero_only_publishes_its_rank_without_waiting(tmp_path):
    ranks = run_scenario("rank-zero-only", tmp_path)
    assert not ranks[0]["merging"]
    assert ranks[0]["seconds"] < TIMEOUT_S
    assert first_step(ranks[0])["grpo_completions_total"] == 24
