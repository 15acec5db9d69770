"""The layer-1 stop lines, in one place: the in-process guard and the Prometheus alerts read these fields.

``MonitorConfig`` (the guard) and ``MixinConfig`` (the rules, alerts and dashboards) both inherit this model,
so a line has one name, one default and one description wherever it is set. The numbers are the seed's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StopLines(BaseModel):
    """Layer-1 stop criteria (seed 第 6 篇: fix, never tune). Documented once, in docs/exporter.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_gap_stop_nats: float = Field(
        0.01, gt=0, description="mean engine log-prob gap at or above which training stops: the guard's stop and "
        "GRPOEngineLogprobGapCritical (seed: mean >= 0.01 stop; the line applies to the mean, never the max)",
    )
    engine_gap_healthy_nats: float = Field(
        0.001, gt=0, description="mean engine gap below which a run is usually healthy: above it "
        "GRPOEngineLogprobGapWarning (seed: mean < 0.001)",
    )
    onpolicy_clip_stop_ratio: float = Field(
        0.01, ge=0, lt=1, description="share of loss tokens outside the clip range on an on-policy update above "
        "which training stops: the guard's stop and GRPORatioClippedBeforeUpdate (seed: clipping before any "
        "update = stop; 1% leaves room for a stray rounding token, not for a second probability path)",
    )

    @property
    def stop_lines(self) -> StopLines:
        """Just the stop lines of a config that inherits them."""
        return StopLines(**{name: getattr(self, name) for name in StopLines.model_fields})
