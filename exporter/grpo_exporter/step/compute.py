"""The step's entry points and its two stages: which metric blocks run at a rollout and at an update.

:func:`compute_step_carrying` runs a stage's blocks on the inputs (each on its own: a block that raises is
dropped whole), gathers their readings and moves them to the host in one transfer
(:class:`~grpo_exporter.step.gather.Gather`); with a merger, what the merge across ranks needs rides in that
transfer, and the runtime merges after the step (:attr:`StepResult.merge_host`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step.blocks import diversity, gradient, reward, routing, samples
from grpo_exporter.step.context import Context
from grpo_exporter.step.gather import Gather, Merger, StepResult
from grpo_exporter.step.pack import StepMetrics
from grpo_exporter.step.registry import Block


def compute_step(inputs: StepInputs, config: MetricsConfig) -> StepMetrics:
    """Every metric the given inputs allow, as ``{sample key: float}``, with one host transfer.

    Raises :class:`~grpo_exporter.inputs.InputError` for grouping that contradicts the config (N not a
    multiple of ``group_size`` without ``group_ids``), and any error of a metric block (strict).
    """
    return compute_step_carrying(inputs, config, {}, strict=True).metrics


def compute_step_carrying(
    inputs: StepInputs,
    config: MetricsConfig,
    carry: dict[str, Tensor],
    strict: bool = True,
    merger: Merger | None = None,
    blocks: tuple[Block, ...] | None = None,
    failed_inputs: bool = False,
) -> StepResult:
    """:func:`compute_step`, plus device vectors ``carry`` brought to the host in the same single transfer
    (the monitor carries its solve-rate moment terms and the edit-distance rows this way).

    Each metric block runs on its own: with ``strict=False`` a block that raises is dropped whole and
    returned in the error list, and every other block is still computed and transferred. ``merger``'s device
    parts join the transfer; its merge is the caller's (see :mod:`grpo_exporter.ranks.distributed`). ``blocks`` limits
    the computation to one stage (``ROLLOUT_BLOCKS``, ``UPDATE_BLOCKS``), so a tensor handed to both observe
    calls never counts a rollout-level quantity twice. ``failed_inputs``: some of this rank's inputs were
    rejected; the rank still takes part in the merge (so the ranks' collectives stay in step) with every
    family of the stage marked failed, hence absent on every rank; alone, a rank publishes what it has.
    """
    stage = BLOCKS if blocks is None else blocks
    tags = {tag for block in stage for tag in block.tags}
    with torch.inference_mode():
        out = run_blocks(inputs, config, carry, stage, strict, failed_inputs)
        result = out.transfer(merger, tags)
    if strict and result.errors and merger is None:  # with a merger, the caller raises after the ranks merged
        raise result.errors[0][1]
    return result


def run_blocks(inputs: StepInputs, config: MetricsConfig, carry: dict[str, Tensor], blocks: tuple[Block, ...],
               strict: bool, failed_inputs: bool, traced: bool = False) -> Gather:
    """A stage's blocks run on the inputs, their readings gathered (not yet transferred): the work that both the
    eager step and a traced program (:func:`~grpo_exporter.step.program.trace`, ``traced=True``) do.

    An empty batch (N = 0) runs no block: nothing to measure and no error; its families keep their last values,
    and merged across ranks this rank adds nothing to the others' union. A trace is only made of a step with
    completions, so it does not test N (which would add a guard on the symbolic size).
    """
    out = Gather(inputs.device)
    out.traced = traced
    out.carried = dict(carry)
    if failed_inputs:
        out.failed |= {tag for block in blocks for tag in block.tags}
    out.checks = list(inputs.value_errors)
    ctx = Context(inputs, config)
    for block in blocks if traced or not inputs.empty else ():
        out.run(block, ctx, strict)
    return out


#: the layers' block modules, in the order their blocks run and lay out the transfer (each module's blocks in
#: definition order): a block joins a stage by its ``produces(stages=...)`` declaration alone
LAYERS = (gradient, routing, reward, samples, diversity)


def stage_blocks(stage: str) -> tuple[Block, ...]:
    """The blocks declared for ``stage`` (:data:`~grpo_exporter.step.registry.STAGES`), layer by layer."""
    return tuple(block for module in LAYERS for block in vars(module).values()
                 if isinstance(block, Block) and stage in block.stages)


# Rollout-level metrics: once per rollout batch (groups, rewards, outcomes, lengths, engine vs trainer).
ROLLOUT_BLOCKS: tuple[Block, ...] = stage_blocks("rollout")
# Update-level metrics: per optimizer step (the ratio, the loss mask actually trained on, advantages, grads).
UPDATE_BLOCKS: tuple[Block, ...] = stage_blocks("update")
# the audit runs where the loss mask and completion lengths meet: the update's mask, else the rollout's
MASK_AUDIT_FAMILIES: tuple[str, ...] = gradient.mask_audit.families
BLOCKS: tuple[Block, ...] = (*ROLLOUT_BLOCKS, *(b for b in UPDATE_BLOCKS if b not in ROLLOUT_BLOCKS))
