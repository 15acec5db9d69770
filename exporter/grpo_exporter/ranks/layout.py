"""The fixed layout of one stage's samples, derived from the catalogue and the config alone.

Ranks merge their readings position by position, so every rank must lay out the same slots in the same order
whatever it happened to compute: a missing input, a metric block that raised, or reward components in another
dict order on one rank must leave an *absent* slot, never a shorter pack. The layout is therefore built from
what a stage *could* produce (the families its metric blocks declare, expanded over the label values the
catalogue fixes and the config bounds), never from what this rank produced. Reward-component labels are the
one value set that comes from data: they take numbered slots ``0 .. max_reward_components-1``, filled in the
order the monitor registers names, and each slot's name is checked across ranks when merging.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from grpo_exporter import catalog
from grpo_exporter.catalog import Merge, MetricType, SampleKey, format_quantile
from grpo_exporter.config import MetricsConfig

TOTAL = "total"


@dataclass(frozen=True)
class Slot:
    """One sample position. ``component`` is the reward-component slot number (None: no such label, or the
    fixed ``total``); ``distribution`` indexes the layout's distributions for a HISTOGRAM slot, whose
    ``quantile`` is set for a summary quantile and ``top_fraction`` for a top-fraction mean."""

    family: str
    sample: str
    labels: tuple[tuple[str, str], ...]
    merge: Merge
    component: int | None = None
    distribution: int = -1
    quantile: float | None = None
    top_fraction: float | None = None

    @property
    def tags(self) -> tuple[str, str]:
        """What a failed metric block marks (see :func:`grpo_exporter.step.produces`): the family, and the
        family/tensor of the shared non-finite counter."""
        return self.family, f"{self.family}/{dict(self.labels).get('tensor', '')}"

    def key(self, components: Sequence[str]) -> SampleKey | None:
        """This slot's key for the component names registered on this rank (None for an unfilled slot)."""
        labels = self.labels
        if self.component is not None:
            if self.component >= len(components):
                return None
            labels = tuple((n, components[self.component] if n == "component" else v) for n, v in labels)
        return SampleKey(self.sample, labels)


class Layout:
    """The slots of the families a stage produces, in catalogue-declared order."""

    def __init__(self, families: Sequence[str], config: MetricsConfig) -> None:
        slots: list[Slot] = []
        distributions: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        for name in families:
            family = catalog.metric(name)
            for combo in _label_combinations(family, config):
                labels = tuple((n, v if isinstance(v, str) else f"#{v}") for n, v in combo)
                component = next((v for n, v in combo if n == "component" and isinstance(v, int)), None)
                for suffix, extra, quantile in _samples(family, config):
                    sample = name + suffix
                    merge = family.merge_of(sample)
                    distribution, top = -1, None
                    if merge is Merge.HISTOGRAM:
                        distribution = distributions.setdefault((name, labels), len(distributions))
                        top = config.entropy_top_fraction if quantile is None else None
                    slots.append(
                        Slot(name, sample, (*labels, *extra), merge, component, distribution, quantile, top)
                    )
        self.slots = tuple(slots)
        self.distributions = len(distributions)
        self.families = tuple(families)
        text = "\n".join(f"{s.sample}{dict(s.labels)}:{s.merge}:{s.top_fraction}" for s in self.slots)
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> list[str]:
        """One line per slot (component slots numbered ``#i``): what a fingerprint mismatch is explained by."""
        return [f"{s.sample}{{{','.join(f'{n}={v}' for n, v in s.labels)}}}" for s in self.slots]

    @functools.lru_cache(maxsize=64)  # noqa: B019 -- layouts live as long as their monitor
    def index(self, components: tuple[str, ...]) -> dict[SampleKey, int]:
        """Slot number of every key this rank can produce with its registered component names."""
        out: dict[SampleKey, int] = {}
        for i, slot in enumerate(self.slots):
            key = slot.key(components)
            if key is not None:
                out[key] = i
        return out


def _label_combinations(family: catalog.Metric, config: MetricsConfig) -> list[tuple[tuple[str, str | int], ...]]:
    combos: list[tuple[tuple[str, str | int], ...]] = [()]
    for label in family.labels:
        values: tuple[str | int, ...]
        if label.values:
            values = label.values
        elif label.name == "component":
            values = (TOTAL, *range(config.max_reward_components))
        elif label.name == "k":
            values = tuple(str(k) for k in config.pass_ks)
        elif label.name == "moe_layer":
            values = tuple(str(layer) for layer in range(config.max_moe_layers))
        else:
            raise ValueError(f"no layout for label {label.name!r} of {family.name!r}: it is not computed per step")
        combos = [(*c, (label.name, v)) for c in combos for v in values]
    return combos


def _samples(
    family: catalog.Metric, config: MetricsConfig
) -> list[tuple[str, tuple[tuple[str, str], ...], float | None]]:
    """(suffix, extra labels, quantile) of each sample of one label combination."""
    if family.type is MetricType.SUMMARY:
        qs = config.quantiles_of(family.name)
        quantiles = [("", (("quantile", format_quantile(q)),), q) for q in qs]
        return [*quantiles, ("_sum", (), None), ("_count", (), None)]
    if family.type is MetricType.HISTOGRAM:
        bounds = [format_quantile(b) for b in config.buckets_of(family.name, family.buckets)]
        buckets = [("_bucket", (("le", le),), None) for le in (*bounds, "+Inf")]
        return [*buckets, ("_sum", (), None), ("_count", (), None)]
    return [("", (), None)]
