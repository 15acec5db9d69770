"""The run's own early window, frozen: anchors that a slow decline or a persistent fault cannot move.

A trailing baseline (a median of the last hour) follows a drift: the seed's collapse is gradual (渐进、中后期)
and never falls below half of its own recent past, and a fault that persists is absorbed into its baseline
within the hour. An anchor is the mean of a value's first N observations, frozen and published, so the rules
can compare against where the run started as well as where it was lately. The same idea gives the run's own
clean engine gap and on-policy recomputation noise (seed: measure your own clean baseline first).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from grpo_exporter import catalog
from grpo_exporter.catalog import SampleKey

ANCHORED_FAMILIES = (
    "grpo_entropy_mean_nats",
    "grpo_pass_at_k_ratio",
    "grpo_reward_mean",
    "grpo_ess_ratio",
    "grpo_edit_distance_median_ratio",
    "grpo_unique_completions_ratio",
    "grpo_repeated_wrong_groups_ratio",
    "grpo_regression_accuracy_ratio",
    "grpo_kept_groups_ratio",
    "grpo_routing_decision_mismatch_ratio",
    "grpo_routing_mismatch_ratio",
)


class FrozenMean:
    """The mean of the first ``count`` finite values, then frozen."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.total = 0.0
        self.seen = 0

    def observe(self, value: float) -> float | None:
        """Take one value (until frozen); the mean once ``count`` values were seen, else None."""
        if self.seen < self.count and math.isfinite(value):
            self.total += value
            self.seen += 1
        return self.value

    @property
    def value(self) -> float | None:
        return self.total / self.seen if self.seen >= self.count else None


class RunAnchors:
    """One :class:`FrozenMean` per sample of the anchored families, published as ``grpo_run_anchor``."""

    def __init__(self, count: int, counts: Mapping[str, int] | None = None) -> None:
        """``count`` values make an anchor; ``counts`` sets another number for a family (by name)."""
        self.count = count
        self.counts = dict(counts or {})
        self._means: dict[SampleKey, FrozenMean] = {}
        self._family = catalog.metric("grpo_run_anchor")
        self.samples: dict[str, float] = {}

    def observe(self, values: Mapping[SampleKey, float]) -> bool:
        """Feed the anchored samples among ``values`` (one step's published gauges); whether an anchor froze
        now (then :attr:`samples` holds every anchor so far)."""
        froze = False
        for key, value in values.items():
            name = key.family.name
            if name not in ANCHORED_FAMILIES or key.sample != name:
                continue
            mean = self._means.get(key)
            if mean is None:
                mean = self._means[key] = FrozenMean(self.counts.get(name, self.count))
            if mean.value is not None:
                continue
            anchored = mean.observe(value)
            if anchored is not None:
                text = ",".join(f"{k}='{v}'" for k, v in key.labels)
                self.samples[self._family.key(metric=name, labels=text)] = anchored
                froze = True
        return froze
