"""A prometheus-client collector that builds its metric families from the catalogue on every scrape."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from grpo_exporter.catalog import CATALOG, MetricType, sample_key
from grpo_exporter.serving.publication import Publication

_ORDER = {m.name: i for i, m in enumerate(CATALOG)}


class CatalogCollector(Collector):
    """Yields one family per catalogue metric present in the latest snapshot, each sample with ``run``.

    Summaries and histograms are assembled sample by sample (prometheus-client's ``HistogramMetricFamily``
    would drop ``_sum``/``_count`` as soon as a bucket bound is negative; ``SummaryMetricFamily`` has no
    quantiles). A scrape never raises: it yields what the snapshot holds.
    """

    def __init__(
        self,
        publication: Publication,
        run: str,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Register it with ``registry.register``: its :meth:`describe` names every family it may yield."""
        self._publication = publication
        self._run = run
        self._on_error = on_error
        self.scrapes = 0  # snapshots rendered: close() waits for one more after marking the run finished
        self._retire_from: CollectorRegistry | None = None

    def describe(self) -> Iterator[Metric]:
        """Every catalogue family, without samples: the registry's duplicate check sees the names this collector
        may yield (and registering never renders a snapshot, which would count as a scrape)."""
        for spec in CATALOG:
            yield Metric(_family_name(spec.name, spec.type), spec.help, spec.type.value)

    def retire_after_next_scrape(self, registry: CollectorRegistry) -> None:
        """Leave ``registry`` once one more scrape has rendered the snapshot (the run's end, published just
        before): a closed run's series leave a registry its user serves, after that server showed the end."""
        self._retire_from = registry

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for key, value in sorted(self._publication.snapshot().items()):
            try:
                parsed = sample_key(key)
                sample, labels = parsed.sample, parsed.label_dict
                spec = parsed.family
                family = families.get(spec.name)
                if family is None:
                    name = _family_name(spec.name, spec.type)
                    family = families[spec.name] = Metric(name, spec.help, spec.type.value)
                family.add_sample(sample, {"run": self._run, **labels}, value)
            except Exception as exc:  # a scrape never raises: skip the sample, report it
                if self._on_error is not None:
                    self._on_error(exc)
        self.scrapes += 1  # counted once the snapshot is rendered: close() waits for a scrape that saw the end
        retire, self._retire_from = self._retire_from, None
        if retire is not None:
            with contextlib.suppress(KeyError):  # already unregistered (a new monitor took the registry)
                retire.unregister(self)
        yield from (families[name] for name in sorted(families, key=_ORDER.__getitem__))


def _family_name(name: str, kind: MetricType) -> str:
    """The family name prometheus-client takes: it appends ``_total`` to a counter's samples itself."""
    return name.removesuffix("_total") if kind is MetricType.COUNTER else name


__all__ = ["CatalogCollector"]
