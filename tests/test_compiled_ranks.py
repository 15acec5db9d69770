"""The compiled stage merged across ranks: two real processes on gloo, each with a compiled and an eager monitor
on its own shard; the merge's device parts ride in the program's block, so the merged values every rank
publishes are the eager monitors' (the ranks' collectives are the same calls either way)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_exporter.bench import workload
from grpo_exporter.demo.stack import free_port
from test_compiled_step import _close

WORLD = 2
STEPS = 6  # on_policy alternates: a rollout program and two update programs, each served compiled afterwards


def _worker(rank: int, port: int, out: str, test_path: str) -> None:
    sys.path.insert(0, test_path)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from grpo_exporter.bench import monitor_step, new_monitor
    from test_compiled_step import _published

    w = workload.make(10_000, seed=rank)  # each rank its own rows
    compiled = new_monitor(edit_distance_groups=0, compile_step="auto", compile_min_positions=0)
    eager = new_monitor(edit_distance_groups=0)
    try:
        for step in range(STEPS):
            for mon in (compiled, eager):
                monitor_step(mon, w, step)
            compiled.compilation.wait(600)
            dist.barrier()  # both ranks' programs ready before the next step (not needed for correctness)
        state = compiled.compilation
        result = {"compiled": _published(compiled), "eager": _published(eager), "steps": state.compiled_steps,
                  "refused": [str(v) for v in state.refused.values()], "fallbacks": dict(state.fallbacks),
                  "merging": compiled._stages.reducer is not None and compiled._stages.reducer.active}
    finally:
        compiled.close()
        eager.close()
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_compiled_stages_merge_across_ranks_as_the_eager_ones(tmp_path) -> None:
    mp.start_processes(_worker, args=(free_port(), str(tmp_path), str(Path(__file__).parent)), nprocs=WORLD,
                       start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in ranks:
        assert r["merging"]
        assert not r["refused"]
        assert set(r["fallbacks"]) == {"pending"}
        assert r["steps"] >= 2 * STEPS - 3  # every stage call after its program was made
        got, want = r["compiled"], r["eager"]
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == _close(value, key), key
    merged = STEPS * WORLD * workload.make(10_000).n  # every rank publishes both ranks' completions
    assert [r["compiled"]["grpo_completions_total[('run', 'bench')]"] for r in ranks] == [merged] * WORLD
