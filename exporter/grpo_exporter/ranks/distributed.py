"""Merging one step's readings across data-parallel ranks, on the host, without ever hurting training.

Every rank computes its shard's readings on its device and lays them out in the stage's fixed
:class:`~grpo_exporter.ranks.layout.Layout` (built from the catalogue and the config, never from what this rank
computed), each slot with a presence flag. What the merge needs travels to the host inside the step's one
transfer; the merge then runs on the host, on a dedicated gloo group with its own timeout (the training's
process group is never used), with one packed MAX and one packed SUM ``all_reduce``. Each kind of sample
merges as the catalogue says (:class:`~grpo_exporter.catalog.Merge`):

* SUM: counters and ``_sum``/``_count``/``_bucket`` samples add; RATIO: numerators and denominators add, then
  divide; MAX/SAME: the largest; ESS: each rank's weight sums, shifted by its own largest log weight, are
  rescaled to the global largest (from the MAX phase) and added; HISTOGRAM: the fine histograms
  (:mod:`grpo_exporter.functional.histogram`) add, min and max merge exactly.
* A slot absent on a rank (an input that rank did not pass) merges over the ranks that have it. A slot whose
  metric block raised on any rank, or whose inputs failed validation there, is absent on every rank (so no
  value ever mixes the union with a part of it). A reward-component slot whose name differs between ranks
  (component names registered in another order) is absent, and the error is counted.

Counts, sums, means, fractions and extremes equal those of the concatenated batch (up to fp64 rounding), ESS
within 1e-6 (its weights are fp32);
quantiles and top-fraction means are exactly those the single process reads from the concatenated batch's
histogram (within relative error 2^-8 of the exact order statistics, min and max exact).
Group metrics assume every group lives on one rank, as GRPO data loaders do.

Safety: the layouts' fingerprints are compared once, at construction; on a mismatch every rank logs the
differing slots and publishes rank-local values, never entering a mismatched collective. A collective that
fails or times out (a rank that closed early, a rank that stopped calling) switches merging off for the rest
of the run on that rank, which says so once and publishes rank-local values from then on.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Hashable, Sequence
from datetime import timedelta

import torch
from torch import Tensor

from grpo_exporter.catalog import Merge
from grpo_exporter.functional.reading import Extreme
from grpo_exporter.ranks.layout import Layout
from grpo_exporter.ranks.merges import kind_merges, split
from grpo_exporter.step import Entry, Merger, StepMetrics, StepResult

log = logging.getLogger("grpo_exporter")

class MergeError(RuntimeError):
    """Merging across ranks failed (or a part of it was dropped); ``logged`` when the reducer said so."""

    def __init__(self, message: str | None, logged: bool = False) -> None:
        super().__init__(message)
        self.logged = logged


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def name_hash(name: str) -> float:
    """A 48-bit hash of a component name, exact in fp64: equal on two ranks iff (almost surely) the names are."""
    return float(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big"))


class Reducer:
    """The merge of every stage of one monitor across the ranks of the default process group."""

    def __init__(self, layouts: dict[str, Layout], timeout_s: float) -> None:
        dist = torch.distributed
        self.layouts = layouts
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failure: str | None = None
        self.group: object | None = None
        try:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            mine = {stage: (layout.fingerprint, layout.describe()) for stage, layout in layouts.items()}
            everyone: list[object] = [None] * self.world
            dist.all_gather_object(everyone, mine, group=self.group)
        except Exception as exc:
            self._fail(f"setting up the exporter's gloo group failed ({type(exc).__name__}: {exc})")
            return
        for rank, theirs in enumerate(everyone):
            differing = _differences(mine, theirs)  # type: ignore[arg-type]
            if differing:
                self._fail(
                    f"metric layout of rank {self.rank} differs from rank {rank} (the config differs between "
                    f"ranks: group_size, pass_k, quantiles, max_reward_components...): {'; '.join(differing)}"
                )
                return

    @property
    def active(self) -> bool:
        return self.failure is None

    def _fail(self, why: str) -> None:
        self.failure = why
        log.error(
            "grpo-exporter: merging across ranks is OFF for the rest of this run on rank %d: %s. Every rank "
            "publishes its own values; the training's process group is untouched.", self.rank, why,
        )

    def for_stage(self, stage: str, components: Sequence[str]) -> StageMerge | None:
        """The merger of one computation of ``stage``, or None once merging is off."""
        if not self.active:
            return None
        return StageMerge(self, self.layouts[stage], tuple(components))

    def all_reduce(self, pack: Tensor, op: object) -> Tensor:
        """One collective on the exporter's own group; any failure switches merging off and raises."""
        dist = torch.distributed
        try:
            dist.all_reduce(pack, op=op, group=self.group)
        except Exception as exc:
            self._fail(f"an exporter collective failed ({type(exc).__name__}: {str(exc)[:300]})")
            raise MergeError(self.failure, logged=True) from exc
        return pack


def _differences(mine: dict[str, tuple[str, list[str]]], theirs: dict[str, tuple[str, list[str]]]) -> list[str]:
    out = []
    for stage in sorted(set(mine) | set(theirs)):
        a, b = mine.get(stage, ("", [])), theirs.get(stage, ("", []))
        if a[0] == b[0]:
            continue
        only_a = [s for s in a[1] if s not in set(b[1])][:5]
        only_b = [s for s in b[1] if s not in set(a[1])][:5]
        out.append(f"{stage}: only here {only_a or 'none (order differs)'}, only there {only_b or 'none'}")
    return out


class StageMerge:
    """Device parts and host merge of one stage computation (the :class:`~grpo_exporter.step.Merger`): each
    catalogue merge kind's part is its :class:`~grpo_exporter.ranks.merges.KindMerge`'s; this class lays them out,
    checks the readings against the layout and runs the two reductions (MAX, then SUM)."""

    def __init__(self, reducer: Reducer, layout: Layout, components: tuple[str, ...]) -> None:
        self.reducer, self.layout, self.components = reducer, layout, components
        self.index = layout.index(components)
        self.kinds = kind_merges(layout)
        self.accepts = {merge: k.accepts for k in self.kinds for merge in k.kinds if k.accepts}
        self.problems: list[str] = []
        self.readings: dict[int, Entry] = {}

    def key(self) -> Hashable:
        return self.layout.families, self.components

    def fresh(self) -> StageMerge:
        return StageMerge(self.reducer, self.layout, self.components)

    def adopt(self, traced: Merger) -> None:
        assert isinstance(traced, StageMerge)  # made by fresh()
        self.readings, self.problems = dict(traced.readings), list(traced.problems)

    # ---- on the device, before the one transfer --------------------------------------------------------

    def device_parts(self, entries: list[Entry], device: torch.device) -> Tensor:
        """Each kind's device parts (fp64, absent = neutral). Each slot's own value and presence are not
        repeated here: they reach the host with the step's local values (:meth:`merge`)."""
        slots = self.layout.slots
        readings: dict[int, Entry] = {}
        for e in entries:  # a sample that does not fit the layout is dropped and reported, never a longer pack
            i = self.index.get(e.key)
            accepted = self.accepts.get(slots[i].merge) if i is not None else None
            if i is None:
                self.problems.append(f"sample {e.key} is not in the stage layout (undeclared family or component)")
            elif accepted is not None and not isinstance(e.reading, accepted):
                self.problems.append(f"{e.key}: merge {slots[i].merge} needs {accepted}, got {type(e.reading)}")
            elif slots[i].merge is Merge.MAX and isinstance(e.reading, Extreme) and not e.reading.largest:
                self.problems.append(f"{e.key}: a smallest-value reading cannot merge as a maximum")
            else:
                readings[i] = e
        self.readings = readings
        parts = [part for kind in self.kinds for part in kind.device(readings, device)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)

    # ---- on the host, after it -------------------------------------------------------------------------

    def apply(self, result: StepResult) -> StepResult:
        """``result`` of this rank's step, merged across ranks: the merged values, the merge's errors added, and
        the families every rank replaces (this rank's when the merge fails). Called by the runtime after the
        step, on every rank, whatever failed on this one (the ranks' collectives stay in step)."""
        metrics, errors, families = self.merge(result.merge_host or [], result.metrics, set(result.failed))
        return result._replace(metrics=metrics, errors=[*result.errors, *errors],
                               families=families if families is not None else result.families)

    def merge(
        self, host: list[float], local: StepMetrics, failed: set[str]
    ) -> tuple[StepMetrics, list[tuple[str, Exception]], frozenset[str] | None]:
        """The merged values of the stage, the errors, and the families to replace (rank-local ``local`` and
        None when the merge fails)."""
        dist = torch.distributed
        slots, n = self.layout.slots, len(self.layout.slots)
        value, present = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for i, e in self.readings.items():  # this rank's own values, transferred with the step's
            if e.key in local:
                value[i], present[i] = local[e.key], 1.0
        parts = split(torch.tensor(host, dtype=torch.float64), [kind.transferred for kind in self.kinds])

        failed_here = torch.tensor([float(any(tag in failed for tag in s.tags)) for s in slots], dtype=torch.float64)
        computed = torch.zeros(n, dtype=torch.float64)
        computed[list(self.readings)] = 1.0
        k = max((s.component or 0) + 1 for s in slots) if slots else 0
        names = torch.full((2 * k,), -math.inf, dtype=torch.float64)
        for j, name in enumerate(self.components[:k]):
            names[2 * j], names[2 * j + 1] = name_hash(name), -name_hash(name)
        maxes = [kind.to_max(part, value, present) for kind, part in zip(self.kinds, parts, strict=True)]
        try:
            max_pack = self.reducer.all_reduce(torch.cat([present, failed_here, computed, *maxes, names]),
                                               dist.ReduceOp.MAX)
            g_present, g_failed, g_computed = max_pack[:n], max_pack[n : 2 * n], max_pack[2 * n : 3 * n]
            *g_maxes, g_names = split(max_pack[3 * n :], [len(m) for m in maxes] + [names.numel()])
            sums = [kind.to_sum(part, value, g_max) for kind, part, g_max in zip(self.kinds, parts, g_maxes,
                                                                                 strict=True)]
            g_sums = split(self.reducer.all_reduce(torch.cat(sums), dist.ReduceOp.SUM), [len(x) for x in sums])
        except MergeError as exc:
            return local, [("distributed", exc)], None

        errors: list[tuple[str, Exception]] = [("distributed", MergeError(p)) for p in self.problems[:1]]
        g_names = g_names.view(-1, 2)
        highest, lowest = g_names[:, 0], -g_names[:, 1]
        disagree = {j for j in range(g_names.shape[0]) if math.isfinite(highest[j]) and highest[j] != lowest[j]}
        if disagree:
            errors.append(("distributed", MergeError(
                f"reward component slots {sorted(disagree)} hold different names on different ranks "
                f"(this rank: {[self.components[j] for j in sorted(disagree) if j < len(self.components)]}); "
                "those components are not published this step: pass the same component names on every rank"
            )))
        merged: dict[int, float] = {}
        for kind, g_max, g_sum in zip(self.kinds, g_maxes, g_sums, strict=True):
            kind.finish(g_max, g_sum, merged, g_present)
        out: StepMetrics = {}
        for i, s in enumerate(slots):
            if g_present[i] <= 0 or g_failed[i] > 0 or (s.component is not None and s.component in disagree):
                continue
            key = s.key(self.components)
            if key is not None:
                out[key] = merged[i]
        # computed on some rank and failed on none: the families the publication replaces, alike on every rank
        families = {s.family for i, s in enumerate(slots) if g_computed[i] > 0 and g_failed[i] == 0}
        failed_families = {s.family for i, s in enumerate(slots) if g_failed[i] > 0}
        return out, errors, frozenset(families - failed_families)
