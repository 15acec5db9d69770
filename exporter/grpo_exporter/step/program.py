"""A stage's device work as one compiled program: the blocks traced once into an operator graph, compiled by
``torch.compile`` (inductor: fused C++/OpenMP loops on a CPU, Triton kernels on CUDA), run at each later step
in place of the blocks' Python and operators.

The eager stage (:func:`~grpo_exporter.step.compute.compute_step_carrying`) stays the reference and the
fallback. A program is made from it: its Python runs once under ``make_fx`` with symbolic sizes (N, T and
every other dimension free), recording every operator up to the step's one packed block
(:meth:`~grpo_exporter.step.gather.Gather.staged`). The trace keeps the layout of that block, so a compiled
step reads its block on the host exactly as the eager step reads its own (:meth:`Gather.read`). What the
program may depend on is its :class:`Signature`: which inputs were given, their dtypes, ranks and device, the
stage and the config; numbers given on the host (a version, a group count) enter as 0-d tensors, never as
constants of the trace. Branches on sizes taken while tracing (a path for large tensors, a divisibility) are
the trace's guards, checked at every call: a step whose sizes fail them is computed eagerly and may earn a
program of its own.

Tracing bypasses the caches of device constants (:func:`~grpo_exporter.functional.constants.tracing`), and a
few functions take a form the compiler serves better (:func:`~grpo_exporter.functional.histogram.key_counts`: a
count of known size; plain sums and ``where`` instead of bit tricks that serve the eager CPU path); the readings
are the same numbers. The trace's whole-tensor reductions are rewritten row by row
(:func:`~grpo_exporter.step.fusion.rows_first`), so that they share the per-row loop nest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional.constants import prepare_tables, tracing
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step.compute import run_blocks
from grpo_exporter.step.dynamo_frames import exporter_frames
from grpo_exporter.step.fusion import rows_first
from grpo_exporter.step.gather import Gather, LateCounts, Merger, Staged, StepResult
from grpo_exporter.step.registry import Block

#: what a field of the inputs is, for a program: absent, a tensor (dtype, rank, device), a host number (a
#: 0-d fp64 input), a constant (``on_policy=True``), tensors in order, or named tensors
Leaf = tuple[Any, ...]

_FIELDS = tuple(f.name for f in dataclasses.fields(StepInputs) if f.name != "value_errors")


class Signature(NamedTuple):
    """What one program serves: a stage's inputs of these kinds (see :data:`Leaf`), these carried vectors and
    value checks, with or without failed inputs, merged across ranks by this layout (``merge``: the merger's
    :meth:`~grpo_exporter.step.gather.Merger.key`) or not. Two steps of one signature differ only in sizes and
    values."""

    stage: tuple[str, ...]
    fields: tuple[Leaf, ...]
    checks: tuple[str, ...]
    carried: tuple[tuple[str, torch.dtype, int], ...]
    failed: bool
    merge: Hashable = None


def _kind(value: Any) -> Leaf:
    if value is None:
        return ("none",)
    if isinstance(value, Tensor):
        return ("tensor", value.dtype, value.dim(), value.device)
    if isinstance(value, bool):
        return ("constant", value)
    if isinstance(value, (int, float)):
        return ("number",)
    if isinstance(value, dict) or hasattr(value, "items"):
        return ("named", tuple((k, v.dtype, v.dim(), v.device) for k, v in value.items()))
    return ("tensors", tuple((v.dtype, v.dim(), v.device) for v in value))


def signature(blocks: Sequence[Block], inputs: StepInputs, carry: dict[str, Tensor], failed: bool,
              merger: Merger | None = None) -> Signature:
    """The signature of a stage call (host facts only: no tensor is read)."""
    return Signature(
        tuple(b.name for b in blocks), tuple(_kind(getattr(inputs, name)) for name in _FIELDS),
        tuple(name for name, _ in inputs.value_errors),
        tuple((name, t.dtype, t.dim()) for name, t in carry.items()), failed,
        None if merger is None else merger.key(),
    )


def leaves(inputs: StepInputs, carry: dict[str, Tensor]) -> list[Tensor]:
    """The program's arguments for a stage call, in :class:`Signature` order: every tensor of the inputs, each
    host number as a 0-d fp64 tensor on the inputs' device (a fill, no copy from host memory), the value checks'
    counts, the carried vectors; detached (a view: the readings take no gradient, and a program compiled for
    tensors without one would recompile for each that has one)."""
    out: list[Tensor] = []
    device = inputs.device
    for name in _FIELDS:
        value = getattr(inputs, name)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (int, float)):
            out.append(torch.full((), float(value), dtype=torch.float64, device=device))
        elif hasattr(value, "items"):
            out.extend(value.values())
        else:
            out.extend(value)
    out.extend(count for _, count in inputs.value_errors)
    out.extend(carry.values())
    return [t.detach() if t.requires_grad else t for t in out]


def _rebuilt(sig: Signature, args: Sequence[Tensor], device: torch.device, n: int | None) -> tuple[
        StepInputs, dict[str, Tensor]]:
    """The inputs and carried vectors of :func:`leaves`'s ``args`` (inside a trace: tracer tensors), not
    validated again (they were, when the step was given)."""
    it = iter(args)
    values: dict[str, Any] = {}
    for name, kind in zip(_FIELDS, sig.fields, strict=True):
        tag = kind[0]
        if tag == "none":
            values[name] = {} if name == "reward_components" else None
        elif tag == "constant":
            values[name] = kind[1]
        elif tag == "named":
            values[name] = {key: next(it) for key, *_ in kind[1]}
        elif tag == "tensors":
            values[name] = [next(it) for _ in kind[1]]
        else:
            values[name] = next(it)
    checks = tuple((name, next(it)) for name in sig.checks)
    carry = {name: next(it) for name, *_ in sig.carried}
    inputs = object.__new__(StepInputs)
    inputs.__dict__.update(values, value_errors=checks, _n=n, _device=device)
    return inputs, carry


class Program(NamedTuple):
    """A traced stage: the operator graph (``graph``, arguments :func:`leaves`), the guards on sizes its trace
    took (``guards``: a Python expression over the arguments), the readings' layout (``gather``, ``staged``),
    and the merger its trace laid the merge parts out with (``merger``; None without a merge across ranks)."""

    graph: torch.fx.GraphModule
    guards: str | None
    gather: Gather
    staged: Staged
    merger: Merger | None = None

    def admits(self, args: Sequence[Tensor]) -> bool:
        """Whether these arguments' sizes satisfy every guard of the trace."""
        if not self.guards:
            return True
        shape_env = self.graph.shape_env
        assert shape_env is not None  # a symbolic trace has one
        return bool(shape_env.evaluate_guards_expression(self.guards, list(args)))


def trace(blocks: Sequence[Block], config: MetricsConfig, sig: Signature, args: Sequence[Tensor],
          device: torch.device, merger: Merger | None = None) -> Program:
    """Trace the stage's blocks into a :class:`Program`, on ``args`` (:func:`leaves` of a step of signature
    ``sig``, or tensors of their sizes: only sizes, strides, dtypes and devices are read) and the inputs' device.
    Every block runs strictly: a block that raises makes no program (the eager step serves). ``merger``: a
    :meth:`~grpo_exporter.step.gather.Merger.fresh` merger of the signature's layout; its device parts are
    traced into the program's block, as the eager step packs them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    n_at = _n_position(sig)
    held: dict[str, Any] = {}

    def stage(*args: Tensor) -> Tensor:
        x, carried = _rebuilt(sig, args, device, None if n_at is None else args[n_at].shape[0])
        out = run_blocks(x, config, carried, tuple(blocks), True, sig.failed, traced=True)
        block_tensor, staged = out.staged(merger)
        held["gather"], held["staged"] = out, staged
        return block_tensor

    prepare_tables(device)
    with tracing():
        graph = make_fx(stage, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
    rows_first(graph)
    placeholders = [node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"]
    shape_env = graph.shape_env
    assert shape_env is not None  # a symbolic trace has one
    guards = shape_env.produce_guards_expression(placeholders) if shape_env.guards else None
    held["gather"].table(held["staged"].packed)  # the host read's table, made once for every step it serves
    return Program(graph, guards, held["gather"], held["staged"], merger)


def _n_position(sig: Signature) -> int | None:
    """Which argument carries N along its first dimension: the first per-completion tensor."""
    position = 0
    for name, kind in zip(_FIELDS, sig.fields, strict=True):
        tag = kind[0]
        if tag == "tensor":
            if name not in _NOT_PER_COMPLETION and kind[2] >= 1:
                return position
            position += 1
        elif tag == "number":
            position += 1
        elif tag in ("named", "tensors"):
            position += len(kind[1])
    return None


#: tensor fields whose first dimension is not N: 0-d scalars (the update's norms, loss and entropy)
_NOT_PER_COMPLETION = frozenset({
    "grad_norm_pre_clip", "grad_norm_post_clip", "max_grad_norm", "loss", "entropy_mean",
})


Runner = Callable[..., Tensor]


def compile_program(program: Program, options: dict[str, Any] | None = None) -> Runner:
    """``torch.compile`` of the program's graph, dynamic in every size (one compilation serves the sizes its
    guards admit); compiled at its first call. The frames it compiles count as the exporter's
    (:func:`~grpo_exporter.step.dynamo_frames.foreign_frames` tells the training's own apart)."""
    compiled = torch.compile(program.graph, dynamic=True, fullgraph=True, options=options)

    def runner(*args: Tensor) -> Tensor:
        with exporter_frames():
            return compiled(*args)

    return runner


def run(program: Program, runner: Runner, args: Sequence[Tensor], stage_tags: set[str],
        merger: Merger | None = None) -> StepResult:
    """One step by a compiled program: its block, moved to the host once and read with the trace's layout.
    ``merger`` (the step's, of the signature's layout) adopts what the trace's merger learnt, for the caller's
    merge. Raises :class:`~grpo_exporter.step.gather.LateCounts` when the step needs a count only the eager step
    can take (a non-finite log-prob on a loss token)."""
    if merger is not None and program.merger is not None:
        merger.adopt(program.merger)
    block = runner(*args)
    host = block if block.device.type == "cpu" else block.cpu()  # the one device-to-host transfer
    return program.gather.reader().read(host, program.staged, stage_tags)


__all__ = ["LateCounts", "Program", "Runner", "Signature", "compile_program", "leaves", "run", "signature", "trace"]
