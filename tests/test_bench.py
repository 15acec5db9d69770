"""`grpo-exporter bench` at its smallest size (a smoke test: the numbers are the bench's to report, never
asserted as times here) and its probes."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from grpo_exporter import bench, catalog
from grpo_exporter.bench import compiled as compiled_bench
from grpo_exporter.bench.kernel_passes import KernelNests, Nest
from grpo_exporter.bench.naive import floor_step, naive_core_step, naive_step
from grpo_exporter.bench.probes import counting, minor_faults, operators, passes
from grpo_exporter.bench.worker import worker_cost
from grpo_exporter.bench.workload import MICRO_BATCHES, G, make, shape_for
from grpo_exporter.cli import main


def test_workload_sizes_are_loss_tokens() -> None:
    for tokens in (10_000, 64_000, 1_000_000):
        n, t = shape_for(tokens)
        assert n % (G * MICRO_BATCHES) == 0
        w = make(tokens) if tokens <= 64_000 else None
        if w is not None:
            assert 0.8 * tokens <= w.loss_tokens <= 1.25 * tokens
            assert w.mask.shape == (n, t)


def test_naive_reference_computes_the_seed_metrics() -> None:
    w = make(10_000)
    out = naive_step(w)
    assert out["gap_mean"] > 0
    assert 0 < out["ess_token"] <= 1
    assert out["pass_G"] >= out["pass_1"]
    assert 0 < out["distinct"] <= 1
    assert floor_step(w) != 0


def test_naive_reference_covers_the_monitors_metric_set_and_agrees_with_it() -> None:
    """The naive code computes what the monitor publishes for the same step: its counts and classic buckets
    agree exactly with the monitor's, its sums to fp32 rounding."""
    w = make(10_000)
    out = naive_step(w)
    assert len(out) > 3 * len(naive_core_step(w))
    mon = bench.new_monitor()
    try:
        bench.monitor_step(mon, w, 2)  # an even step: the on-policy check runs
        got = mon.metrics()
    finally:
        mon.close()

    def buckets(family: str, prefix: str, **labels: str) -> None:
        bounds = [*catalog.metric(family).buckets, float("inf")]
        for i, bound in enumerate(bounds):
            le = "+Inf" if bound == float("inf") else catalog.format_quantile(bound)
            key = catalog.metric(family).key("_bucket", le=le, **labels)
            assert got[key] == out[f"{prefix}{i}"], (key, got[key], out[f"{prefix}{i}"])

    buckets("grpo_token_engine_logprob_gap_nats", "gap_le")
    buckets("grpo_token_importance_weight", "ratio_le")
    buckets("grpo_token_entropy_nats", "entropy_le")
    buckets("grpo_completion_length_distribution_tokens", "len_correct_le", outcome="correct")
    key = catalog.metric("grpo_clipped_tokens_total").key(bound="upper")
    assert got[key] == out["clipped_upper_tokens"]
    key = catalog.metric("grpo_upper_clip_reachable_tokens_total").key()
    assert got[key] == out["upper_reachable_tokens"]
    key = catalog.metric("grpo_engine_logprob_gap_nats").key("_sum")
    assert got[key] == pytest.approx(out["gap_sum"], rel=1e-5)
    key = catalog.metric("grpo_pass_at_k_ratio").key(k=str(G))
    assert got[key] == pytest.approx(out[f"pass_at_{G}"], rel=1e-12)
    key = catalog.metric("grpo_zero_variance_groups_total").key(outcome="all_correct")
    assert got[key] == out["zero_variance_all_correct"]


def test_probes_count_host_reads_and_python_data_and_restore_torch() -> None:
    x = torch.arange(4.0)
    item, tensor, as_tensor = torch.Tensor.item, torch.tensor, torch.as_tensor
    with counting() as counts:
        x.sum().item()
        x.tolist()
        float(x[0])
        torch.tensor([1, 2])
        torch.as_tensor(1.0)  # a number: a copy from host memory as well
        torch.tensor(x)  # from a tensor: not Python data
        torch.as_tensor(x)
        worker = threading.Thread(target=lambda: (x.tolist(), torch.tensor([3])))  # off the training thread
        worker.start()
        worker.join()
    assert counts.host_reads == 3
    assert counts.from_python == 2
    assert torch.Tensor.item is item
    assert torch.tensor is tensor
    assert torch.as_tensor is as_tensor
    assert operators(lambda: (x * 2).sum()) >= 2


def test_minor_faults_count_fresh_pages() -> None:
    before = minor_faults()
    # 64 MiB, above glibc's mmap threshold even where earlier frees raised it (to 32 MiB at most): fresh pages,
    # zeroed by the kernel (32 MiB could come back from the heap, already touched, after other tests)
    fresh = bytearray(64 * 2**20)
    fresh[:: 4096] = b"x" * len(range(0, len(fresh), 4096))
    assert minor_faults() - before >= 16  # one per touched 4 KiB page, or per 2 MiB huge page (THP)
    del fresh


def test_bench_smallest_size_runs_and_reports(capsys) -> None:
    results, long = bench.run([10_000], rounds=1, long_steps=30, warm_allocator=False, framework_sizes=[10_000])
    r, framework = results
    assert framework.shape == "framework"
    assert framework.t == r.t - 3
    assert framework.fixed_s > 0
    assert framework.floor_passes == r.floor_passes == 6  # four adds, the where, the sum
    assert r.passes > 10 * r.floor_passes
    assert r.monitor_s > 0
    assert r.naive_s > 0
    assert r.naive_core_s > 0
    assert r.same_set_s > 0
    assert r.floor_s > 0
    assert r.operators > 0
    assert r.host_reads >= 1
    assert r.from_python == 0  # constant vectors are cached per device: no host-to-device copy in the step
    assert r.recorder_s > 0
    assert r.recorder_host_reads == r.host_reads  # the flight recorder reads nothing on a healthy step
    assert r.anomalous_host_reads == r.host_reads + 1  # an anomalous step: its offending rows, in one read
    assert r.exposition_bytes > 0
    assert r.page_faults >= 0
    assert long.steps == 30
    assert long.series_late >= long.series_early > 0
    text = bench.table(results, long)
    lines = text.splitlines()
    main_table = lines[: lines.index("")]
    assert len(main_table) == 4
    assert len({line.count("|") for line in main_table}) == 1
    assert "| 10," in text
    assert f"| {framework.n} x {framework.t}, framework |" in text
    floor_table = lines[lines.index("") + 1 :][:4]
    assert floor_table[0].startswith("| loss tokens | N x T | same metric set / floor | fixed cost")
    assert len({line.count("|") for line in floor_table}) == 1
    assert "After 30 steps" in text
    assert main(["bench", "--sizes", "1e4", "--framework-sizes", "", "--rounds", "1", "--long-steps", "20",
                 "--worker-widths", "64"]) == 0
    out = capsys.readouterr().out
    assert "framework" not in out
    assert "fixed cost / floor" in out
    assert "naive / monitor" in out
    assert "malloc thresholds of a training process" in out
    assert "naive, core / monitor step" in out
    assert "naive / monitor, same metric set" in out
    assert "recorder on / off" in out
    assert "page faults / step" in out
    assert "| 64 |" in out  # the edit-distance job's row
    assert "The compiled step" in out
    assert "| 0.0 of 0 | 0 | 0 | 0 | - |" in out  # 10K: below compile_min_positions, eager is chosen


def test_compiled_bench_serves_every_stage_compiled_and_counts_what_it_launches() -> None:
    """The compiled column's counts (the times are the bench's to report): with the threshold at 0 every stage
    call of the timed rounds is compiled, none falls back or recompiles, the three programs (rollout, update on
    and off policy) are made once, and a compiled step launches fused kernels and fewer aten operators."""
    r = compiled_bench.measure(10_000, rounds=2, device=torch.device("cpu"), min_positions=0)
    assert (r.compiled_calls, r.stage_calls) == (2.0, 2)
    assert r.fallbacks == {}
    assert r.recompiles == 0
    assert r.compiles == 3
    assert r.first_compile_s is not None
    assert r.first_compile_s > 0
    assert r.kernels > 0
    assert 0 < r.compiled_operators < r.eager_operators / 2
    assert r.compiled_passes is not None
    assert r.floor_passes <= r.compiled_passes < r.eager_passes / 3
    assert r.eager_s > 0
    assert r.compiled_s > 0
    assert r.floor_s > 0
    lines = compiled_bench.table([r]).splitlines()
    assert len(lines) == 3
    assert len({line.count("|") for line in lines}) == 1
    assert "| 2.0 of 2 | 0 | 0 | 3 |" in lines[2]


_KERNEL_SOURCE = (Path(__file__).parent / "data" / "inductor_kernel.cpp").read_text(encoding="utf-8")


def test_compiled_passes_are_the_loop_nests_over_n_by_t() -> None:
    """A kernel in inductor's C++ form: the flat vector loop (its lane and tail loops cover its positions again)
    and the row-by-column nest are passes over (N, T); the loop over N, the accumulators' and the 8194 buckets'
    are not, and the sizes are the call's last arguments."""
    layout = KernelNests(_KERNEL_SOURCE)
    assert layout.sizes == ["ks0", "ks1"]
    assert [n.positions({"ks0": 384, "ks1": 1024}) for n in layout.nests] == [1, 384 * 1024, 384 * 1024, 384, 8194]
    assert layout.passes(("in", "out", 384, 1024), 384 * 1024) == 2
    assert layout.passes(("in", "out", 4, 8), 32) == 3  # at a tiny step the buckets' loop is as large as the step
    with pytest.raises(ValueError, match="loop bound: expected an expression of \\['ks0'\\], came 'ks9'"):
        Nest("x0", "0", "ks9", []).positions({"ks0": 4})


def test_framework_shape_is_what_a_loop_hands_over() -> None:
    """Separate micro-batch outputs (the monitor copies them to stitch: exactly two more passes than the same
    step handed as views of one tensor), T no multiple of 8, a multi-turn mask whose tool spans the mask audit
    does not count as a mask bug, and the naive reference agreeing with the monitor on it."""
    w = make(10_000, shape="framework")
    assert w.t % 8 != 0
    assert all(p.untyped_storage().data_ptr() != w.new.untyped_storage().data_ptr() for p in w.new_parts)
    assert torch.equal(torch.cat(w.new_parts), w.new)
    assert torch.equal(torch.cat(w.entropy_parts), w.entropy)
    assert w.completion_mask is not None
    assert bool((w.completion_mask & ~w.mask).any())  # tool spans: completion positions off the loss mask
    assert torch.equal(w.mask.sum(1), w.lengths)  # lengths count the model's own tokens, as TRL's adapter does
    views = dataclasses.replace(w, new_parts=(), entropy_parts=())
    mon, same = bench.new_monitor(edit_distance_groups=0), bench.new_monitor(edit_distance_groups=0)
    try:
        bench.monitor_step(mon, w, 1)
        bench.monitor_step(same, views, 1)
        assert passes(lambda: bench.monitor_step(mon, w, 2), w.n * w.t) == passes(
            lambda: bench.monitor_step(same, views, 2), w.n * w.t) + 2
        got = mon.metrics()
    finally:
        mon.close()
        same.close()
    out = naive_step(w)
    for name, naive in (("grpo_loss_mask_length_mismatch_sequences_total", "mask_mismatch"),
                        ("grpo_loss_mask_outside_completion_tokens_total", "mask_outside_completion"),
                        ("grpo_clipped_tokens_total", "clipped_upper_tokens")):
        labels = {"bound": "upper"} if name == "grpo_clipped_tokens_total" else {}
        assert got[catalog.metric(name).key(**labels)] == out[naive]
    assert out["mask_mismatch"] == out["mask_outside_completion"] == 0
    key = catalog.metric("grpo_entropy_mean_nats").key()
    assert got[key] == pytest.approx(out["entropy_mean"], rel=1e-5)
    with pytest.raises(ValueError, match="`shape`"):
        make(10_000, shape="trl")


def test_multi_turn_lengths_that_count_the_tools_tokens_read_as_a_mask_bug() -> None:
    """docs/exporter.md: in multi-turn rollouts ``completion_lengths`` counts the model's own tokens; a length
    that counts the tool's tokens too makes every sequence with a tool span a length mismatch (which pages
    GRPOLossMaskMismatch: any increase)."""
    w = make(10_000, shape="framework")
    assert w.completion_mask is not None
    with_tools = dataclasses.replace(w, lengths=w.completion_mask.sum(1))
    spanned = int((w.completion_mask & ~w.mask).any(1).sum())
    assert spanned > 0
    mon = bench.new_monitor()
    try:
        bench.monitor_step(mon, with_tools, 2)
        got = mon.metrics()
    finally:
        mon.close()
    assert got[catalog.metric("grpo_loss_mask_length_mismatch_sequences_total").key()] == spanned
    assert got[catalog.metric("grpo_loss_mask_outside_completion_tokens_total").key()] == 0


def test_passes_count_operators_that_read_whole_step_tensors() -> None:
    x = torch.ones(100, 100)
    assert passes(lambda: (x * 2).sum(), x.numel()) == 2
    assert passes(lambda: x[:10].sum(), x.numel()) == 0  # a view, then a tenth of the values
    assert passes(lambda: x.view(-1).reshape(100, 100), x.numel()) == 0  # views only
    assert passes(lambda: x.to(torch.float32), x.numel()) == 0  # a no-op conversion
    assert passes(lambda: x.to(torch.float64), x.numel()) == 1
    assert passes(lambda: torch.cat([x[:50], x[50:]]), x.numel()) == 1  # no input shapes recorded for a list


def test_worker_cost_reports_every_pair_against_the_budgeted_draw() -> None:
    cost = worker_cost(4096)
    assert cost.full_pairs == 4 * G * (G - 1) // 2
    assert 1 <= cost.budgeted_pairs <= 8  # the pair cap at T = 4096


def test_constant_vectors_are_made_once_per_device_and_dtype() -> None:
    from grpo_exporter.functional.constants import constant

    a = constant([0.5, 0.99], torch.float64, torch.device("cpu"))
    assert constant((0.5, 0.99), torch.float64, torch.device("cpu")) is a
    assert constant([0.5, 0.99], torch.float32, torch.device("cpu")) is not a
    assert a.tolist() == [0.5, 0.99]
