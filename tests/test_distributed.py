"""Two real processes on gloo: each rank observes half of the groups; the published values equal those of
the concatenated batch (quantiles too: histogram counts add exactly), with two collectives."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batches import make_batch
from grpo_exporter.demo.stack import free_port
from grpo_exporter.inputs import StepInputs
from grpo_exporter.runtime.monitor_config import MonitorConfig
from monitor_helpers import assert_merged, expected_step, rollout_kwargs, scrape, update_kwargs

WORLD = 2
SETTINGS = {"group_size": 8, "clip_eps": (0.2, 0.28), "log_ratio_clamp": 20.0, "guard": "off", "pass_k": (2, 4),
            "rollout_correction_cap": 1.002, "close_linger_s": 0.0}  # the cap: ~16% of tokens above it


def halves(x: StepInputs, rank: int) -> slice:
    n = x.loss_mask.shape[0] // WORLD  # whole groups of 8 on each rank
    return slice(rank * n, (rank + 1) * n)


def _worker(rank: int, port: int, out: str, test_path: str) -> None:
    sys.path.insert(0, test_path)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    calls: list[str] = []
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(str(op))
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    from grpo_exporter import GRPOMonitor

    x = make_batch(5).inputs()
    rows = halves(x, rank)
    result: dict = {"rank": rank}
    with GRPOMonitor(run="ddp", port=0, **SETTINGS) as mon:
        rollout = {k: (v[rows] if isinstance(v, torch.Tensor) else {c: t[rows] for c, t in v.items()})
                   for k, v in rollout_kwargs(x).items()}
        mon.observe_rollout(0, **rollout, prompt_ids=torch.arange(48)[rows] // 8)
        result["rollout_collectives"] = list(calls)
        calls.clear()
        mon.observe_update(0, **update_kwargs(x, rows))
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        model(torch.randn(5, 4)).square().sum().backward()
        mon.clip_grad_norm_(model.parameters(), 0.5)
        result["update_collectives"] = list(calls)
        result["metrics"] = dict(mon.metrics())
        result["served"] = mon.port is not None
        if rank == 0:
            result["scraped"] = 'grpo_completions_total{run="ddp"} 48.0' in scrape(mon.url)
    # the flight recorder on both ranks, on clean batches of 3 groups per rank: a NaN reward in rank 1's half
    # at step 1; both ranks judge the merged count
    with GRPOMonitor(run="ddp-rec", port=None, recorder_dir=Path(out, "incidents"), **SETTINGS) as mon:
        g = torch.Generator().manual_seed(rank)
        for step in range(3):
            logprobs = -torch.rand(24, 16, generator=g)
            rewards = torch.rand(24, generator=g)
            if step == 1 and rank == 1:
                rewards[3] = float("nan")
            mon.observe_rollout(step, rewards=rewards, rollout_logprobs=logprobs, old_logprobs=logprobs.clone(),
                                loss_mask=torch.ones(24, 16, dtype=torch.bool), group_ids=torch.arange(24) // 8
                                + 3 * rank)
    from grpo_exporter.recorder.inspect import load

    [own] = [p for p in Path(out, "incidents").iterdir() if p.name.endswith(f"-r{rank}")]
    incident = load(own)
    result["incident"] = {"steps": incident["steps"], "triggers": incident["triggers"], "world": incident["world"],
                          "drivers": [r["row"] for r in incident["states"]["first_anomalous"]["rows"]["rollout"]
                                      if r["driver"]]}
    # a monitor on rank 0 only, said explicitly: no collective waits for the ranks that have none
    if rank == 0:
        with GRPOMonitor(run="rank0", port=None, distributed="rank0", **SETTINGS) as mon:
            mon.observe_rollout(0, rewards=torch.rand(16))
            result["rank0_completions"] = dict(mon.metrics())["grpo_completions_total"]
    else:
        try:
            GRPOMonitor(run="rank0", port=None, distributed="rank0", **SETTINGS)
        except ValueError as exc:
            result["rank0_refused"] = str(exc)
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_worker, args=(free_port(), str(out), str(Path(__file__).parent)), nprocs=WORLD,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def expected() -> dict[str, float]:
    x = make_batch(5).inputs()
    cfg = MonitorConfig(run="single", port=None, **SETTINGS)
    # before any batch every prompt has the Beta(1, 1) prior around 0.5: P(k = 0 or k = G) = 2 / (G + 1)
    rollout = StepInputs(**rollout_kwargs(x), zero_variance_prob=torch.full((48,), 2 / 9, dtype=torch.float64))
    update = StepInputs(**update_kwargs(x))
    return expected_step(rollout, update, cfg)


def test_two_ranks_publish_the_concatenated_batch(ranks):
    got = ranks[0]["metrics"]
    want = expected()
    assert_merged(got, want)


def test_every_rank_holds_the_reduced_values_and_only_rank_zero_serves(ranks):
    # per-process self metrics, the edit distance of rank-local sampled groups (computed off-thread), and the
    # rollouts the serving rank's reading set holds (published where it serves)
    local = ("grpo_observe_duration_seconds", "grpo_last_step_timestamp_seconds", "grpo_edit_distance",
             "grpo_reading_rollouts")
    step_metrics = [{k: v for k, v in r["metrics"].items() if not k.startswith(local)} for r in ranks]
    assert step_metrics[0] == step_metrics[1]
    assert ranks[0]["served"]
    assert ranks[0]["scraped"]
    assert not ranks[1]["served"]
    assert any(k.startswith("grpo_reading_rollouts{") for k in ranks[0]["metrics"])
    assert not any(k.startswith("grpo_reading_rollouts") for k in ranks[1]["metrics"])


def test_two_collectives_per_reduction(ranks):
    for r in ranks:
        assert r["rollout_collectives"] == [str(dist.ReduceOp.MAX), str(dist.ReduceOp.SUM)]
        assert r["update_collectives"] == [str(dist.ReduceOp.MAX), str(dist.ReduceOp.SUM)]


def test_each_rank_records_its_own_rows_of_the_same_incident(ranks):
    """The NaN reward sits in rank 1's half: the merged count fires the trigger on both ranks, so both write
    the same three states (their own rows, -r0 and -r1 in one shared directory the two ranks created at the
    same moment); only rank 1 holds the offending row (its local row 3)."""
    for r in ranks:
        assert r["incident"]["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": 2}
        assert r["incident"]["triggers"] == ["nonfinite"]
        assert r["incident"]["world"] == WORLD
    assert ranks[0]["incident"]["drivers"] == []
    assert ranks[1]["incident"]["drivers"] == [3]


def test_a_monitor_on_rank_zero_only_is_explicit(ranks):
    assert ranks[0]["rank0_completions"] == 16.0  # rank 0's own batch, no merge
    assert ranks[1]["rank0_refused"].startswith("distributed: expected a monitor on rank 0 only with "
                                                "distributed='rank0', got one constructed on rank 1 of 2")
