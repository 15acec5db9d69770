"""Reward-component names: registered once each, bounded by ``max_reward_components``.

Names are registered in sorted order within a call, so ranks that see the same names (in any dict order)
number them alike: the numbering is the component slots of :mod:`grpo_exporter.ranks.layout`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from grpo_exporter import catalog


class ComponentNames:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.names: list[str] = []

    def admit(self, components: Mapping[str, Tensor] | None) -> tuple[dict[str, Tensor], int]:
        """(the components to compute, how many were dropped for the limit). A name that is no valid label
        value is passed on for :class:`~grpo_exporter.inputs.StepInputs` to reject, naming the field."""
        if components is None:
            return {}, 0
        if not isinstance(components, Mapping):
            return components, 0
        kept: dict[str, Tensor] = {}
        dropped = 0
        for name in sorted(components, key=str):
            if not catalog.is_label_value(name) or name in ("total", ""):
                kept[name] = components[name]
                continue
            if name not in self.names and len(self.names) < self.limit:
                self.names.append(name)
            if name in self.names:
                kept[name] = components[name]
            else:
                dropped += 1
        return kept, dropped
