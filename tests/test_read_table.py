"""The read table (made once per layout) reads a packed block exactly as the per-entry rule says: PLAIN where its
flag is set, RATIO divided where the denominator is positive, each HOST reading read once, WITNESSED 0 or late.
Random layouts, with the one-position and empty cases of every kind among them."""

from __future__ import annotations

import random
from typing import Any

from grpo_exporter import catalog
from grpo_exporter.step.pack import HOST, PLAIN, RATIO, WITNESSED, Entry, Position, Witnessed
from grpo_exporter.step.read_table import ReadTable


class _Hist:
    """A histogram reading: its values, or None (an empty histogram), and how often it was read."""

    def __init__(self, values: list[float] | None) -> None:
        self.values, self.reads = values, 0

    def read(self, hists: Any, row: int) -> list[float] | None:
        self.reads += 1
        return None if self.values is None else [v + row for v in self.values]


def _reference(entries: list[Entry], positions: list[Position], packed: list[float]) -> tuple[dict, list]:
    out: dict = {}
    late: list = []
    for e, (v, p, kind) in zip(entries, positions, strict=True):
        if kind == PLAIN and packed[p]:
            out[e.key] = packed[v]
        elif kind == RATIO and packed[p] > 0:
            out[e.key] = packed[v] / packed[p]
        elif kind == HOST:
            values = e.reading.values
            if values is not None:
                out[e.key] = values[e.index] + v
        elif kind == WITNESSED:
            if packed[v]:
                late.append((e.key, e.reading))
            else:
                out[e.key] = 0.0
    return out, late


def test_the_table_reads_any_layout_as_the_per_entry_rule():
    keys = [m.key() for m in catalog.CATALOG
            if not m.labels and m.type in (catalog.MetricType.GAUGE, catalog.MetricType.COUNTER)]
    rng = random.Random(33)
    for _ in range(300):
        counts = {kind: rng.choice([0, 1, 1, 2, 5]) for kind in (PLAIN, RATIO, WITNESSED)}
        hists = [_Hist(rng.choice([None, [rng.random() for _ in range(3)]])) for _ in range(rng.choice([0, 1, 2]))]
        chosen = iter(rng.sample(keys, sum(counts.values()) + 3 * len(hists)))
        packed = [rng.choice([0.0, 0.0, -1.0, rng.random(), float(rng.randint(1, 9))]) for _ in range(40)]
        entries: list[Entry] = []
        positions: list[Position] = []
        for kind, n in counts.items():
            for _ in range(n):
                reading = Witnessed(None, None) if kind == WITNESSED else None  # type: ignore[arg-type]
                entries.append(Entry(next(chosen), reading))
                positions.append(Position(rng.randrange(40), rng.randrange(40), kind))
        for row, hist in enumerate(hists):
            for index in range(3):
                entries.append(Entry(next(chosen), hist, index))
                positions.append(Position(row, 0, HOST))
        order = list(range(len(entries)))
        rng.shuffle(order)
        entries, positions = [entries[i] for i in order], [positions[i] for i in order]
        table = ReadTable(entries, positions)
        out, late = table.read(packed, None)
        want, want_late = _reference(entries, positions, packed)
        assert out == want
        assert sorted(late, key=lambda kv: kv[0]) == sorted(want_late, key=lambda kv: kv[0])
        assert all(h.reads == 1 for h in hists)  # each histogram reading once, whatever its sample count
        assert table.families == {catalog.family_of(e.key.sample).name for e in entries}
