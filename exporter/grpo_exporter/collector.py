"""A prometheus-client collector that builds its metric families from the catalogue on every scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from grpo_exporter.catalog import CATALOG, family_of, parse_key
from grpo_exporter.publication import Publication

_ORDER = {m.name: i for i, m in enumerate(CATALOG)}


class CatalogCollector(Collector):
    """Yields one family per catalogue metric present in the latest snapshot, each sample with ``run``.

    Summaries and histograms are assembled sample by sample (prometheus-client's ``HistogramMetricFamily``
    would drop ``_sum``/``_count`` as soon as a bucket bound is negative; ``SummaryMetricFamily`` has no
    quantiles). A scrape never raises: it yields what the snapshot holds.
    """

    def __init__(self, publication: Publication, run: str, registry: CollectorRegistry | None = None) -> None:
        self._publication = publication
        self._run = run
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for key, value in sorted(self._publication.snapshot().items()):
            sample, labels = parse_key(key)
            spec = family_of(sample)
            family = families.get(spec.name)
            if family is None:
                family = families[spec.name] = Metric(spec.name, spec.help, spec.type.value)
            family.add_sample(sample, {"run": self._run, **labels}, value)
        yield from sorted(families.values(), key=lambda f: _ORDER[_spec_name(f)])


def _spec_name(family: Metric) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


__all__ = ["CatalogCollector"]
