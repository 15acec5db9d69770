"""The publication keeps a flat copy of the replaced families for its snapshots; whatever the sequence of merges,
a snapshot holds exactly what the family-by-family rule says (additive samples summed, each replaced family its
last values, an absent value dropped)."""

from __future__ import annotations

import random

from grpo_exporter import catalog
from grpo_exporter.serving.publication import Publication


def test_snapshots_follow_the_family_rule_through_any_sequence_of_merges():
    gauges = [m for m in catalog.CATALOG if m.type == catalog.MetricType.GAUGE and not m.labels][:6]
    counters = [m for m in catalog.CATALOG if m.type == catalog.MetricType.COUNTER and not m.labels][:3]
    assert len(gauges) == 6
    assert len(counters) == 3
    rng = random.Random(7)
    pub = Publication()
    expected_add: dict[catalog.SampleKey, float] = {}
    expected_families: dict[str, dict[catalog.SampleKey, float]] = {}
    for _ in range(300):
        given = rng.sample(gauges, rng.randint(0, 4))
        computed = {m.name for m in given} | {m.name for m in rng.sample(gauges, rng.randint(0, 2))}
        metrics = {m.key(): rng.random() for m in given if rng.random() < 0.8}  # some computed families absent
        metrics |= {m.key(): float(rng.randint(0, 3)) for m in rng.sample(counters, rng.randint(0, 3))}
        pub.merge(metrics, computed)
        for key, value in metrics.items():
            if catalog.is_additive(key):
                expected_add[key] = expected_add.get(key, 0.0) + value
        for name in computed | {catalog.family_of(k.sample).name for k in metrics if not catalog.is_additive(k)}:
            expected_families[name] = {k: v for k, v in metrics.items() if catalog.family_of(k.sample).name == name}
        if rng.random() < 0.5:
            pub.publish()
            expected = dict(expected_add)
            for values in expected_families.values():
                expected.update(values)
            assert dict(pub.snapshot()) == expected
