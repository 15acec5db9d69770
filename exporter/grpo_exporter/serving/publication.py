"""Cumulative and last-step values, published to scrapers as immutable snapshots.

Keys are :class:`~grpo_exporter.catalog.SampleKey` (a plain string is checked against the catalogue and
converted here, once). Written by the training thread (and the edit-distance worker, under ``writing``);
read by scrape threads. The read lock guards nothing but the swap of the snapshot reference, so a slow or
concurrent scrape never blocks an observe call beyond that swap.

Counter samples and the ``_sum``/``_count``/``_bucket`` samples of summaries and histograms are *additive*:
each step's increment is added. Gauges and summary quantiles are *replaced* family by family: a family that
a computation produced (present or absent) takes exactly its new values, so an absent value is dropped rather
than left stale; a family whose inputs were not given this time keeps its last values ("the last on-policy
update", "the last retrieval evaluation"). Every replaced value passes the run's anchors (the first values of the
anchored families, :mod:`grpo_exporter.runtime.anchors`) on its way in, whichever thread writes it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType

from grpo_exporter.catalog import SampleKey, format_quantile, metric, sample_key
from grpo_exporter.runtime.anchors import RunAnchors

_ANCHOR = "grpo_run_anchor"


class Publication:
    def __init__(self, anchors: RunAnchors | None = None) -> None:
        self._anchors = anchors
        self._lock = threading.Lock()
        self.writing = threading.RLock()  # the training thread and the edit-distance worker both write
        self._additive: dict[str, float] = {}
        self._replaced: dict[str, dict[str, float]] = {}  # family -> its current samples
        self._gauges: dict[str, float] = {}  # the same samples, flat: what every publish copies
        self._snapshot: Mapping[str, float] = MappingProxyType({})

    def add(self, increments: Mapping[str, float]) -> None:
        """Add increments to additive samples."""
        for key, value in increments.items():
            key = sample_key(key)
            self._additive[key] = self._additive.get(key, 0.0) + value

    def merge(self, metrics: Mapping[str, float], families: Iterable[str] = ()) -> None:
        """Add the additive samples; replace every family in ``families`` (and every family with a value
        in ``metrics``) by the values given for it."""
        fresh: dict[str, dict[str, float]] = {name: {} for name in families}
        gauges: dict[SampleKey, float] = {}
        additive = self._additive
        for key, value in metrics.items():
            key = sample_key(key)
            if key.additive:
                additive[key] = additive.get(key, 0.0) + value
            else:
                fresh.setdefault(key.family.name, {})[key] = value
                gauges[key] = value
        for name, values in fresh.items():
            self._replace(name, values)
        if self._anchors is not None and self._anchors.observe(gauges):
            self._replace(_ANCHOR, dict(self._anchors.samples))

    def _replace(self, family: str, values: dict[str, float]) -> None:
        """``family``'s samples become ``values``, in the per-family map and the flat one alike (a sample key
        belongs to one family, so its old keys are exactly the ones to drop)."""
        for key in self._replaced.get(family, ()):
            del self._gauges[key]
        self._gauges.update(values)
        self._replaced[family] = values

    def publish(self) -> None:
        """Make the current state visible to scrapers (one reference swap under the lock): a copy of the
        additive samples and of the flat replaced ones (each observe call publishes)."""
        merged = dict(self._additive)
        merged.update(self._gauges)
        snapshot = MappingProxyType(merged)
        with self._lock:
            self._snapshot = snapshot

    def snapshot(self) -> Mapping[str, float]:
        with self._lock:
            return self._snapshot

    def commit(self, add: Mapping[str, float] | None = None, merge: Mapping[str, float] | None = None,
               families: Iterable[str] = ()) -> None:
        """A background writer's changes, made under ``writing`` and published at once."""
        with self.writing:
            if add:
                self.add(add)
            if merge is not None:
                self.merge(merge, families)
            self.publish()

    @contextlib.contextmanager
    def guarded(self, on_error: Callable[[Exception], None]) -> Iterator[None]:
        """A background writer's unit of work (a worker thread has no caller to raise to): an exception inside
        is handed to ``on_error`` (which counts and logs it) under ``writing``, and the count is published."""
        try:
            yield
        except Exception as exc:
            with self.writing:
                on_error(exc)
                self.publish()


def duration_increments(stage: str, seconds: float) -> dict[str, float]:
    """One observation of ``grpo_observe_duration_seconds{stage}`` as histogram increments."""
    total, number, buckets = _duration_keys(stage)
    increments: dict[str, float] = {total: seconds, number: 1.0}
    for key, bound in buckets:
        increments[key] = float(seconds <= bound)
    return increments


@functools.lru_cache(maxsize=32)
def _duration_keys(stage: str) -> tuple[SampleKey, SampleKey, tuple[tuple[SampleKey, float], ...]]:
    family = metric("grpo_observe_duration_seconds")
    buckets = tuple(
        (family.key("_bucket", stage=stage, le="+Inf" if bound == math.inf else format_quantile(bound)), bound)
        for bound in (*family.buckets, math.inf)
    )
    return family.key("_sum", stage=stage), family.key("_count", stage=stage), buckets
