"""A traced stage's whole-tensor reductions rewritten row by row, so the compiler fuses them with the rest.

Inductor fuses reductions whose iteration spaces are the same. A stage reduces its (N, T) token tensors both
per row (loss tokens per completion, per-sequence sums: ranges (N) x (T)) and over every element (a count of
non-finite values, a max, a masked sum: one range of N x T). The two kinds land in separate loop nests, and
each loop nest is one more pass over the token tensors: on a CPU it reads them from memory again, on a GPU it
is one more kernel. Written as a reduction along the last dimension followed by one over the (N,) partial
results, a whole-tensor reduction shares the per-row loop nest, and what is left is over N only.

The readings are the same: integer and boolean sums, maxima and minima are exact either way (NaN propagates
through both levels; a row's count of true values is taken in int32, as a row has far fewer than 2^31
positions, and summed over rows in int64, the count's own dtype), and a float sum of per-row partial sums is
at least as accurate as one running sum. A bf16 or fp16 sum is accumulated in fp32 at both levels and
rounded once, as the whole-tensor sum does (rounding each row's partial sum would round twice: 0.5% off in
bf16); a wider float cast to bf16 or fp16 before its sum is left whole. docs/benchmarks.md (the compiled
step) gives the passes and times before and after.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

#: the reductions that may reduce a tensor whole, and the one that takes their place along one dimension (the
#: same operator for sums, maxima and minima: they compose)
_SUM, _AMAX, _AMIN = aten.sum.dim_IntList, aten.amax.default, aten.amin.default
_ALONG: dict[Any, Any] = {aten.sum.default: _SUM, _SUM: _SUM, aten.max.default: _AMAX, _AMAX: _AMAX,
                          aten.min.default: _AMIN, _AMIN: _AMIN}
_ALWAYS_WHOLE = (aten.sum.default, aten.max.default, aten.min.default)


def _reduced_rank(node: Node) -> int | None:
    """The rank of the tensor ``node`` reduces over all its dimensions, or None when it is not a whole-tensor
    reduction (a reduction along some dimensions, ``keepdim``, not a reduction)."""
    if node.op != "call_function" or node.target not in _ALONG or not isinstance(node.args[0], Node):
        return None
    value = node.args[0].meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    rank = value.dim()
    if node.target in _ALWAYS_WHOLE:
        return rank
    dims: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim: Any = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if keepdim or rank == 0:
        return None
    return rank if not dims or sorted(d % rank for d in dims) == list(range(rank)) else None


def rows_first(graph: GraphModule) -> int:
    """Rewrite every whole-tensor sum, max and min of a tensor of rank >= 2 in ``graph`` (a traced stage) as
    the same reduction along the last dimension, then over what remains. Returns how many were rewritten."""
    rewritten = 0
    for node in list(graph.graph.nodes):
        rank = _reduced_rank(node)
        if rank is None or rank < 2:
            continue
        source = node.args[0]
        assert isinstance(source, Node)
        along = _ALONG[node.target]
        inner: dict[str, Any] = {}
        outer: dict[str, Any] = {}
        narrowed: torch.dtype | None = None  # a narrow float sum's own dtype, restored after an fp32 sum
        if along is _SUM:
            dtype = node.kwargs.get("dtype")
            read = source.meta["val"].dtype
            summed = dtype if dtype is not None else read
            if dtype is None and read == torch.bool:
                inner["dtype"], outer["dtype"] = torch.int32, torch.int64  # a count per row: int32 lanes
            elif summed.is_floating_point and summed.itemsize < 4:
                if summed != read:
                    continue  # a wider float cast narrow before it is summed: left whole
                inner["dtype"] = outer["dtype"] = torch.float32
                narrowed = summed
            elif dtype is not None:
                inner["dtype"] = outer["dtype"] = dtype
        with graph.graph.inserting_before(node):
            rows = graph.graph.call_function(along, (source, [-1]), inner)
            whole = graph.graph.call_function(along, (rows, list(range(rank - 1))), outer)
            if narrowed is not None:
                whole = graph.graph.call_function(aten._to_copy.default, (whole,), {"dtype": narrowed})
        node.replace_all_uses_with(whole)
        graph.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.graph.lint()
        graph.recompile()
    return rewritten
