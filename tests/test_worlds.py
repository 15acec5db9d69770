"""The world sweep's fixed CI sample (tests/worlds.py): 24 tiny GRPO worlds unlike the demo's, trained for real
and judged by the production rules in promtool. Healthy worlds page nothing; collapsing ones page layer 4 at
most; a control world with a fault injected half-way pages, so the reading of what fired can fail.

KNOWN_FAILURES are the worlds that still page against the verdict, each with what it pages and why (none at
present). The test asserts that exactly these fail, with exactly these pages: a new false page fails it,
and so does a fix (which must then remove its entry)."""

from __future__ import annotations

from collections import Counter

from grpo_exporter.demo.worlds import CADENCES, FAMILIES, GROUP_SIZES, LENGTHS, PRECISIONS, WARM, world
from grpo_exporter.mixin.config import MixinConfig
from worlds import alert_labels, pages, sweep, table, verdict

CI_WORLDS = 24
CONTROL = 24  # world 24 with a loss mask over the padding from half-way: layer 1, GRPOLossMaskMismatch
KNOWN_FAILURES: dict[str, dict[str, int]] = {}


def test_the_sample_covers_every_axis():
    worlds = [world(i) for i in range(CI_WORLDS)]
    axes = {"family": FAMILIES, "warm": WARM, "group_size": GROUP_SIZES, "length": LENGTHS,
            "precision": PRECISIONS, "cadence": CADENCES}
    for axis, values in axes.items():
        assert set(Counter(getattr(w, axis) for w in worlds)) == set(values), axis
    assert len({(w.family, w.warm) for w in worlds}) == len(FAMILIES) * len(WARM)


def test_healthy_worlds_page_nothing_and_collapsing_ones_only_layer_4(capsys):
    results = sweep([world(i) for i in range(CI_WORLDS + 1)], faults={CONTROL: "mask_covers_padding"})
    labels = alert_labels(MixinConfig())
    with capsys.disabled():
        print("\n" + table(results, labels))
    [control] = [r for r in results if r.fault is not None]
    assert set(pages(control, labels)) == {"GRPOLossMaskMismatch"}
    failures = {r.world.name: pages(r, labels) for r in results if verdict(r, labels) is not None}
    assert failures == KNOWN_FAILURES
    assert all(r.trajectory.kind == "healthy" for r in results if r.world.name in KNOWN_FAILURES)
