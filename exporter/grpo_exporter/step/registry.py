"""What a metric block is, and what it may produce.

A block is a function of the step's :class:`~grpo_exporter.step.gather.Gather` (where it adds readings) and
:class:`~grpo_exporter.step.context.Context` (the inputs and what several blocks share), declared with
:func:`produces`: the catalogue families it may add, the stages it runs at, and the ``tensor`` labels of the
non-finite counter it owns. The stages' block lists and the stage layout of the rank merge are built from these
declarations, and a block that raises drops exactly these samples, on every rank (see
:attr:`grpo_exporter.ranks.layout.Slot.tags`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_exporter import catalog

if TYPE_CHECKING:
    from grpo_exporter.step.context import Context
    from grpo_exporter.step.gather import Gather

NONFINITE = "grpo_nonfinite_values_total"


@dataclass(frozen=True)
class Block:
    """One metric block: ``compute`` adds its readings; ``families`` the catalogue families it may add (the
    non-finite counter's when it owns labels of it); ``tags`` what fails with it (its families, and
    ``grpo_nonfinite_values_total/<tensor>`` per label it owns); ``stages`` the stages it runs at
    (:data:`STAGES`)."""

    compute: Callable[[Gather, Context], None]
    families: tuple[str, ...]
    tags: tuple[str, ...]
    stages: tuple[str, ...]

    @property
    def name(self) -> str:
        """The block's name in error reports (its function's)."""
        return self.compute.__name__

    def __call__(self, out: Gather, ctx: Context) -> None:
        self.compute(out, ctx)


#: the step's stages: once per rollout batch, once per optimizer step
STAGES = ("rollout", "update")


def produces(
    *families: str, stages: tuple[str, ...], nonfinite: tuple[str, ...] = ()
) -> Callable[[Callable[[Gather, Context], None]], Block]:
    """Declare a block: the catalogue families it may add, the stages it runs at (it joins them by this
    declaration alone), and the ``tensor`` labels of the non-finite counter it owns (several blocks share that
    family). Every name is checked against the catalogue at import."""
    unknown = set(stages) - set(STAGES)
    if not stages or unknown:
        raise ValueError(f"produces(stages=...): expected some of {STAGES}, got {stages!r}")

    def declare(compute: Callable[[Gather, Context], None]) -> Block:
        for name in families:
            catalog.metric(name)
        for tensor in nonfinite:
            catalog.metric(NONFINITE).key(tensor=tensor)
        return Block(compute, (*families, *((NONFINITE,) if nonfinite else ())),
                     (*families, *(f"{NONFINITE}/{t}" for t in nonfinite)), tuple(stages))

    return declare


def families_of(blocks: Sequence[Block]) -> tuple[str, ...]:
    """The families a stage's blocks may produce, in block order, each once."""
    return tuple(dict.fromkeys(name for block in blocks for name in block.families))
