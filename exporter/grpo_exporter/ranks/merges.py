"""One implementation per catalogue merge kind (:class:`~grpo_exporter.catalog.Merge`): how a stage's samples of
that kind combine across ranks.

Each kind says what its slots add to the step's one device-to-host transfer (:meth:`KindMerge.device`), what
they add to the two reductions the rank merge runs on the host (one MAX, one SUM), and the merged value from
the reduced parts (:meth:`KindMerge.finish`). :class:`~grpo_exporter.ranks.distributed.StageMerge` lays the kinds
out in :data:`KINDS` order and calls the collectives; no kind knows another's offsets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from grpo_exporter.catalog import Merge
from grpo_exporter.functional import histogram, histogram_host, samples
from grpo_exporter.functional.histogram_host import Quantiles, TopMean
from grpo_exporter.functional.reading import Ratio
from grpo_exporter.ranks.layout import Layout
from grpo_exporter.step import Entry

F64 = torch.float64


class KindMerge:
    """The slots of one merge kind in a stage layout. Defaults: nothing transferred, nothing reduced."""

    kinds: tuple[Merge, ...] = ()
    #: the reading types the kind can merge (a reading carries what its merge needs); empty: any
    accepts: tuple[type, ...] = ()

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.slots = [i for i, s in enumerate(layout.slots) if s.merge in self.kinds]

    @property
    def transferred(self) -> int:
        """Floats this kind adds to the step's transfer."""
        return 0

    def device(self, readings: Mapping[int, Entry], device: torch.device) -> list[Tensor]:
        """The device parts (fp64) this kind adds to the step's one transfer; absent slots hold neutral values."""
        return []

    def to_max(self, host: Tensor, value: Tensor, present: Tensor) -> Tensor:
        """This kind's part of the MAX reduction: ``host`` its transferred floats, ``value``/``present`` the
        stage's local values by slot."""
        return torch.zeros(0, dtype=F64)

    def to_sum(self, host: Tensor, value: Tensor, reduced_max: Tensor) -> Tensor:
        """This kind's part of the SUM reduction (``reduced_max``: its part of the MAX reduction, reduced)."""
        return torch.zeros(0, dtype=F64)

    def finish(self, reduced_max: Tensor, reduced_sum: Tensor, merged: dict[int, float], present: Tensor) -> None:
        """The merged value of each slot into ``merged``; a slot the merge finds absent gets ``present`` 0."""


class ExtremeMerge(KindMerge):
    """MAX (and SAME, a value every rank shares): the largest present value."""

    kinds = (Merge.MAX, Merge.SAME)

    def to_max(self, host: Tensor, value: Tensor, present: Tensor) -> Tensor:
        return torch.where(present[self.slots] > 0, value[self.slots], -math.inf)

    def finish(self, reduced_max: Tensor, reduced_sum: Tensor, merged: dict[int, float], present: Tensor) -> None:
        for j, i in enumerate(self.slots):
            merged[i] = float(reduced_max[j])


class SumMerge(KindMerge):
    """SUM: counts and totals add up."""

    kinds = (Merge.SUM,)

    def to_sum(self, host: Tensor, value: Tensor, reduced_max: Tensor) -> Tensor:
        return value[self.slots]

    def finish(self, reduced_max: Tensor, reduced_sum: Tensor, merged: dict[int, float], present: Tensor) -> None:
        for j, i in enumerate(self.slots):
            merged[i] = float(reduced_sum[j])


class RatioMerge(KindMerge):
    """RATIO: numerators and denominators add up, then divide; absent where the summed denominator is 0."""

    kinds = (Merge.RATIO,)
    accepts = (Ratio,)

    @property
    def transferred(self) -> int:
        return 2 * len(self.slots)

    def device(self, readings: Mapping[int, Entry], device: torch.device) -> list[Tensor]:
        parts = []
        for i in self.slots:
            r = readings.get(i)
            parts.append(torch.stack([t.double() for t in r.reading.terms(r.index)])
                         if r is not None else torch.zeros(2, dtype=F64, device=device))
        return parts

    def to_sum(self, host: Tensor, value: Tensor, reduced_max: Tensor) -> Tensor:
        return host

    def finish(self, reduced_max: Tensor, reduced_sum: Tensor, merged: dict[int, float], present: Tensor) -> None:
        for j, i in enumerate(self.slots):
            num, den = float(reduced_sum[2 * j]), float(reduced_sum[2 * j + 1])
            if den > 0:
                merged[i] = num / den
            else:
                present[i] = 0.0


class EssMerge(KindMerge):
    """ESS: the weight sums of every rank, shifted by the largest log weight across ranks (reduced by MAX
    first), add up; the ESS of the sums."""

    kinds = (Merge.ESS,)
    accepts = (samples.Effective,)

    @property
    def transferred(self) -> int:
        return 4 * len(self.slots)

    def device(self, readings: Mapping[int, Entry], device: torch.device) -> list[Tensor]:
        """[max log weight, sum w, sum w^2, n] per slot, the sums shifted by this rank's max."""
        parts = []
        for i in self.slots:
            r = readings.get(i)
            if r is None:
                parts.append(torch.cat([torch.full((1,), -math.inf, dtype=F64, device=device),
                                        torch.zeros(3, dtype=F64, device=device)]))
                continue
            log_w, valid = r.reading.log_weights, r.reading.valid
            top = torch.where(valid, log_w.double(), -math.inf).amax()
            s1, s2 = samples.shifted_weight_sums(log_w, valid, torch.where(torch.isfinite(top), top, 0.0))
            parts.append(torch.stack([top, s1, s2, valid.sum().double()]))
        return parts

    def to_max(self, host: Tensor, value: Tensor, present: Tensor) -> Tensor:
        return host.view(-1, 4)[:, 0]

    def to_sum(self, host: Tensor, value: Tensor, reduced_max: Tensor) -> Tensor:
        ess = host.view(-1, 4)
        shift = torch.where(torch.isfinite(reduced_max), reduced_max, 0.0)
        scale = torch.where(torch.isfinite(ess[:, 0]), torch.exp((ess[:, 0] - shift).clamp(max=0.0)), 0.0)
        return torch.stack([ess[:, 1] * scale, ess[:, 2] * scale.square(), ess[:, 3]], dim=1).reshape(-1)

    def finish(self, reduced_max: Tensor, reduced_sum: Tensor, merged: dict[int, float], present: Tensor) -> None:
        for j, i in enumerate(self.slots):
            s1, s2, count = reduced_sum[3 * j], reduced_sum[3 * j + 1], reduced_sum[3 * j + 2]
            r = samples.ess_from_sums(s1, s2, count)
            merged[i] = float(r.value)
            present[i] = float(r.present)


class HistogramMerge(KindMerge):
    """HISTOGRAM: each distribution's fine counts add up and its extremes take the MAX; every quantile or top
    mean of it is read from the merged histogram (fp32, as on one rank)."""

    kinds = (Merge.HISTOGRAM,)
    accepts = (Quantiles, TopMean)
    WIDTH = 2 + histogram.BUCKETS

    @property
    def transferred(self) -> int:
        return self.layout.distributions * self.WIDTH

    def device(self, readings: Mapping[int, Entry], device: torch.device) -> list[Tensor]:
        """[max, -min, counts...] per distribution."""
        parts = []
        for d in range(self.layout.distributions):
            member = next((readings[i] for i in self.slots if self.layout.slots[i].distribution == d
                           and i in readings), None)
            if member is None:
                parts.append(torch.cat([torch.full((2,), -math.inf, dtype=F64, device=device),
                                        torch.zeros(histogram.BUCKETS, dtype=F64, device=device)]))
                continue
            h = member.reading.histogram
            parts.append(torch.cat([h.maximum.double().reshape(1), -h.minimum.double().reshape(1), h.counts.double()]))
        return parts

    def to_max(self, host: Tensor, value: Tensor, present: Tensor) -> Tensor:
        return host.view(self.layout.distributions, self.WIDTH)[:, :2].reshape(-1)

    def to_sum(self, host: Tensor, value: Tensor, reduced_max: Tensor) -> Tensor:
        return host.view(self.layout.distributions, self.WIDTH)[:, 2:].reshape(-1)

    def finish(self, reduced_max: Tensor, reduced_sum: Tensor, merged: dict[int, float], present: Tensor) -> None:
        extremes = reduced_max.view(-1, 2)
        hists = histogram_host.HostHistograms(reduced_sum, (-extremes[:, 1]).tolist(), extremes[:, 0].tolist())
        for i in self.slots:
            s = self.layout.slots[i]
            values: list[float] | None
            if s.top_fraction is not None:
                top = hists.top_mean(s.distribution, s.top_fraction)
                values = None if top is None else [top]
            else:
                assert s.quantile is not None  # a histogrammed slot reads a top mean or a quantile
                values = hists.quantiles(s.distribution, (s.quantile,))
            if values is None:
                present[i] = 0.0
            else:
                merged[i] = histogram_host.f32(values[0])


#: the kinds in the order they lie in the transfer and in each reduction
KINDS: tuple[type[KindMerge], ...] = (ExtremeMerge, SumMerge, RatioMerge, EssMerge, HistogramMerge)


def kind_merges(layout: Layout) -> list[KindMerge]:
    """One :class:`KindMerge` per kind for ``layout``; every slot belongs to exactly one."""
    merges = [kind(layout) for kind in KINDS]
    covered = sorted(i for m in merges for i in m.slots)
    if covered != list(range(len(layout.slots))):
        raise ValueError(f"merge kinds cover slots {covered[:8]}..., not each of the {len(layout.slots)} once")
    return merges


def split(t: Tensor, widths: Sequence[int]) -> list[Tensor]:
    """``t`` cut into consecutive parts of ``widths``."""
    parts, offset = [], 0
    for width in widths:
        parts.append(t[offset : offset + width])
        offset += width
    return parts
