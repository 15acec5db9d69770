"""The step: one stage's inputs in, every applicable metric out, with exactly one device-to-host transfer.

:func:`compute_step` runs each metric whose inputs were given, collects the device readings, packs every value
and presence flag into a single fp64 tensor and moves it to the host once (``tolist``). Keys are catalogue
sample keys (``Metric.key``): a metric name plus ``_sum``/``_count``/``_bucket`` suffixes and labels. Counter
and ``_sum``/``_count`` values are this step's increments; gauges and quantiles are this step's values.
Absent metrics (empty masks, no token of the gating sign...) are left out of the mapping.

The package, by job: :mod:`~grpo_exporter.step.compute` (entry points, the two stages' block lists),
:mod:`~grpo_exporter.step.registry` (what a block is and declares), :mod:`~grpo_exporter.step.context` (what
blocks share), :mod:`~grpo_exporter.step.blocks` (one module per signal-chain layer),
:mod:`~grpo_exporter.step.gather` (readings and the transfer) and :mod:`~grpo_exporter.step.pack` (where each
reading lies in the transferred block).
"""

from grpo_exporter.step.compute import (
    BLOCKS,
    MASK_AUDIT_FAMILIES,
    ROLLOUT_BLOCKS,
    UPDATE_BLOCKS,
    StepResult,
    compute_step,
    compute_step_carrying,
)
from grpo_exporter.step.gather import Merger
from grpo_exporter.step.pack import Element, Entry, StepMetrics, host_values, reading_host_copy
from grpo_exporter.step.registry import Block, families_of, produces

__all__ = [
    "BLOCKS",
    "MASK_AUDIT_FAMILIES",
    "ROLLOUT_BLOCKS",
    "UPDATE_BLOCKS",
    "Block",
    "Element",
    "Entry",
    "Merger",
    "StepMetrics",
    "StepResult",
    "compute_step",
    "compute_step_carrying",
    "families_of",
    "host_values",
    "produces",
    "reading_host_copy",
]
