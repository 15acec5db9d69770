"""Merging one step's readings across data-parallel ranks with exactly two collectives.

Every rank computes its readings on its own shard; :func:`all_reduce_entries` then merges them on the device,
before the step's single host transfer, with one packed MAX and one packed SUM ``all_reduce``:

* MAX: extremes (max, and min as max of the negation), gauges that are the same on every rank (grad norms,
  bounds), each distribution's min and max, and each ESS reading's largest log weight;
* SUM: counters and sums; numerators and denominators of every ratio (means, fractions, pass@k over groups);
  each ESS reading's weight sums, rescaled by the global largest log weight from the MAX phase; each
  distribution's log-bucket sketch (:mod:`grpo_exporter.functional.sketch`).

Result: counts, sums, means, fractions, extremes and ESS equal those of the concatenated batch (up to fp64
rounding); quantiles other than min and max, and top-fraction means, are within relative error
``sketch.ALPHA`` (0.5%). Group metrics assume every group lives on one rank, as GRPO data loaders do. Every
rank must pass the same fields (and reward component names) in the same calls, so the packs line up.
Not reduced: the exporter's own timings, and the in-group edit distance, which each rank computes off-thread
on its own sampled groups (rank 0's sample is the one served).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_exporter.functional import samples, sketch
from grpo_exporter.step import Entry


def _ids(entries: list[Entry], merge: str) -> dict[int, object]:
    """The distinct reading objects of one merge kind, in entry order (identical on every rank)."""
    seen: dict[int, object] = {}
    for e in entries:
        if e.merge == merge:
            seen.setdefault(id(e.reading), e.reading)
    return seen


def all_reduce_entries(entries: list[Entry], group: object | None = None) -> list[tuple[Tensor, Tensor]]:
    """(value, present) of every entry merged over the ranks of ``group``: two ``all_reduce`` calls."""
    dist = torch.distributed
    device = entries[0].reading.present.device if entries else torch.device("cpu")
    distributions = {**_ids(entries, "quantile"), **_ids(entries, "top")}

    # ---- phase 1: MAX ----
    maxes: list[Tensor] = []
    for e in entries:
        if e.merge in ("max", "min"):
            value, present = e.local()
            signed = value if e.merge == "max" else -value
            maxes += [torch.where(present > 0, signed, -math.inf), present]
        elif e.merge == "ess":
            maxes.append(torch.where(e.reading.valid, e.reading.log_weights.double(), -math.inf).amax())
    for d in distributions.values():
        x = torch.where(d.valid, d.sample.double(), -math.inf)
        maxes += [x.amax(), torch.where(d.valid, -d.sample.double(), -math.inf).amax()]
    max_pack = torch.stack(maxes).to(device) if maxes else torch.zeros(1, dtype=torch.float64, device=device)
    dist.all_reduce(max_pack, op=dist.ReduceOp.MAX, group=group)
    global_max = iter(max_pack.unbind())

    # ---- phase 2: SUM (ESS sums need the global shift from phase 1) ----
    sums: list[Tensor] = []
    for e in entries:
        if e.merge in ("max", "min"):
            next(global_max), next(global_max)
        elif e.merge == "ess":
            shift = next(global_max)
            shift = torch.where(torch.isfinite(shift), shift, 0.0)
            s1, s2 = samples.shifted_weight_sums(e.reading.log_weights, e.reading.valid, shift)
            sums += [s1, s2, e.reading.valid.sum().double()]
        elif e.merge == "ratio":
            sums += [e.reading.numerator.reshape(()).double(), e.reading.denominator.reshape(()).double()]
        elif e.merge == "sum":
            sums.append(e.local()[0])
    extremes = {}
    for key, d in distributions.items():
        extremes[key] = (next(global_max), -next(global_max))
        sums += [*sketch.sketch(d.sample, d.valid).unbind()]
    sum_pack = torch.stack(sums).to(device) if sums else torch.zeros(1, dtype=torch.float64, device=device)
    dist.all_reduce(sum_pack, op=dist.ReduceOp.SUM, group=group)

    # ---- rebuild, in entry order ----
    total = iter(sum_pack.unbind())
    max_again = iter(max_pack.unbind())
    out: list[tuple[Tensor, Tensor]] = []
    one = torch.ones((), dtype=torch.float64, device=device)
    for e in entries:
        if e.merge in ("max", "min"):
            value, present = next(max_again), next(max_again)
            value = value if e.merge == "max" else -value
            out.append((torch.where(present > 0, value, 0.0), present))
            continue
        if e.merge == "ess":
            next(max_again)
            s1, s2, n = next(total), next(total), next(total)
            r = samples.ess_from_sums(s1, s2, n)
            out.append((r.value, r.present.double()))
        elif e.merge == "ratio":
            num, den = next(total), next(total)
            present = den > 0
            out.append((torch.where(present, num / torch.where(present, den, 1.0), 0.0), present.double()))
        elif e.merge == "sum":
            out.append((next(total), one))
        else:
            out.append((torch.zeros((), dtype=torch.float64, device=device), one))  # a distribution: below
    counts = {key: torch.stack([next(total) for _ in range(sketch.BUCKETS)]) for key in distributions}
    for i, e in enumerate(entries):
        if e.merge not in ("quantile", "top"):
            continue
        hist, (largest, smallest) = counts[id(e.reading)], extremes[id(e.reading)]
        present = hist.sum() > 0
        if e.merge == "quantile":
            value = sketch.sketch_quantiles(hist, e.reading.quantiles, smallest, largest)[e.index]
        else:
            value = sketch.sketch_top_mean(hist, e.reading.fraction, largest)
        out[i] = (torch.where(present, value.double(), 0.0), present.double())
    return out


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
