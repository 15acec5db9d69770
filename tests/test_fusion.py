"""Whole-tensor reductions rewritten row by row in a traced stage (:mod:`grpo_exporter.step.fusion`): the same
values and dtypes, nothing of rank >= 2 reduced whole left, reductions along some dimensions untouched, and
every stage program traced with it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from grpo_exporter.bench import workload
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import program as step_program
from grpo_exporter.step.fusion import _reduced_rank, rows_first
from test_compiled_step import CFG, _stages


def _whole(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every whole-tensor reduction form a stage's code takes, of 2-d and 3-d tensors."""
    kept = torch.where(mask, x, 0.0)
    return (
        kept.sum(),  # fp32
        mask.sum(),  # a count: int64
        mask.sum(dtype=torch.int32),
        x.amax(),  # NaN propagates
        kept.amin(),
        torch.max(kept),
        torch.min(kept),
        kept.sum(dim=(0, 1)),
        (x.abs() < math.inf).sum(),
        torch.stack([kept, x]).sum(),  # rank 3
        kept.sum(dim=1),  # along one dimension: not whole, left as is
        kept.amax(dim=-1),
        kept.sum(dim=(0, 1), keepdim=True),
    )


WHOLE_OF_RANK_2_OR_MORE = 10


def _traced() -> torch.fx.GraphModule:
    x, mask = torch.randn(6, 8), torch.rand(6, 8) > 0.3
    return make_fx(_whole, tracing_mode="symbolic")(x, mask)


def _remaining(graph: torch.fx.GraphModule) -> int:
    return sum((_reduced_rank(n) or 0) >= 2 for n in graph.graph.nodes)


def test_every_whole_reduction_of_a_token_tensor_is_rewritten_and_no_other() -> None:
    graph = _traced()
    assert _remaining(graph) == WHOLE_OF_RANK_2_OR_MORE
    partial = [n for n in graph.graph.nodes if n.op == "call_function" and _reduced_rank(n) is None]
    assert rows_first(graph) == WHOLE_OF_RANK_2_OR_MORE
    assert _remaining(graph) == 0
    assert rows_first(graph) == 0  # idempotent
    assert all(n in graph.graph.nodes for n in partial)


@pytest.mark.parametrize("shape", [(6, 8), (4, 1), (10, 37)])
@pytest.mark.parametrize("kind", ["random", "heavy", "nonfinite", "masked"])
def test_rewritten_reductions_read_the_same(shape: tuple[int, int], kind: str) -> None:
    original, rewritten = _traced(), _traced()
    rows_first(rewritten)
    g = torch.Generator().manual_seed(shape[0] * 31 + len(kind))
    x = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    if kind == "heavy":
        x = torch.distributions.Cauchy(0.0, 1e3).sample(shape).clamp(-1e30, 1e30)
    elif kind == "nonfinite":
        x[0, 0], x[-1, -1] = math.nan, math.inf
    elif kind == "masked":
        mask = torch.zeros_like(mask)
    expected, got = original(x, mask), rewritten(x, mask)
    for e, r in zip(expected, got, strict=True):
        assert r.dtype == e.dtype
        assert r.shape == e.shape
        if e.is_floating_point():
            torch.testing.assert_close(r, e, rtol=1e-6, atol=1e-6 * float(x.abs().nan_to_num(0, 0, 0).sum()),
                                       equal_nan=True)
        else:
            assert torch.equal(r, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrow_float_sum_is_rounded_once(dtype: torch.dtype) -> None:
    """Rows of [256, 1]: each row's 257 rounds to 256 in bf16, so rounding per row would read 25,600 for the
    100 rows' 25,700; summed in fp32 and rounded once, both graphs read 25,728 (bf16) or 25,696 (fp16). A
    wider float cast narrow before its sum is left whole."""
    def sums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return a.sum(), a.sum(dtype=dtype), torch.stack([a, a]).sum(), b.sum(dtype=dtype)

    narrow, wide = torch.tensor([[256.0, 1.0]] * 100, dtype=dtype), torch.tensor([[256.0, 1.0]] * 100)
    original = make_fx(sums, tracing_mode="symbolic")(narrow, wide)
    rewritten = make_fx(sums, tracing_mode="symbolic")(narrow, wide)
    assert rows_first(rewritten) == 3
    assert _remaining(rewritten) == 1  # the wide float cast narrow
    expected = 25_728.0 if dtype == torch.bfloat16 else 25_696.0
    for e, r in zip(original(narrow, wide), rewritten(narrow, wide), strict=True):
        assert r.dtype == e.dtype == dtype
        assert float(r) == float(e)
    assert float(rewritten(narrow, wide)[0]) == expected


@pytest.mark.parametrize("stage", ["rollout", "update"])
def test_a_traced_stage_reduces_no_token_tensor_whole(stage: str) -> None:
    """The wiring: :func:`~grpo_exporter.step.program.trace` rewrites the stage's graph (its compiled step's
    readings are tests/test_compiled_step.py's)."""
    fields, blocks = _stages(workload.make(60_000))[stage]
    x = StepInputs(**fields)
    program = step_program.trace(blocks, CFG, step_program.signature(blocks, x, {}, False),
                                 step_program.leaves(x, {}), x.device)
    token_reductions = [n for n in program.graph.graph.nodes if n.op == "call_function"
                        and n.args and isinstance(n.args[0], torch.fx.Node)
                        and isinstance(n.args[0].meta.get("val"), torch.Tensor) and n.args[0].meta["val"].dim() >= 2
                        and n.target in (torch.ops.aten.sum.dim_IntList, torch.ops.aten.amax.default)]
    assert token_reductions  # the stage reduces its token tensors row by row
    assert _remaining(program.graph) == 0
