"""The dashboards' panels as data (:class:`PanelSpec` in :class:`RowSpec` in :class:`DashboardSpec`), so tests can
inspect every query, and :func:`q`, which scopes every series selector of a query to the dashboard's ``$job`` and
``$run`` variables. :mod:`grpo_exporter.mixin.dashboards` declares the dashboards and builds them with the SDK."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SEL = 'job=~"$job",run=~"$run"'
W = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str
    kind: str = "timeseries"  # or "stat"
    thresholds: tuple[tuple[float, str], ...] = ()  # (value, color) above the base
    base: str = "green"  # the color below the first threshold
    width: int = 8
    min: float | None = None


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: tuple[RowSpec, ...]
    multi_run: bool = True
    tags: tuple[str, ...] = field(default=("grpo", "grpo-exporter"))


_SELECTOR = re.compile(r'(?<![\w:"])(run:[a-z0-9_:]+|grpo_[a-z0-9_]+|ALERTS)(\{[^}]*\})?')


def scoped(expr: str) -> str:
    """``expr`` with every series selector (raw ``grpo_*``, recorded ``run:*``, ``ALERTS``) filtered by the
    dashboard's ``$job`` and ``$run`` variables, so no panel shows runs the viewer did not pick."""

    def add(match: re.Match[str]) -> str:
        name, braces = match[1], match[2]
        if braces is None:
            return f"{name}{{{SEL}}}"
        inner = braces[1:-1]
        if 'job=~"$job"' in inner and 'run=~"$run"' in inner:
            return match[0]
        return f"{name}{{{inner + ',' if inner else ''}{SEL}}}"

    return _SELECTOR.sub(add, expr)


def q(expr: str, legend: str = "{{run}}") -> Query:
    return Query(scoped(expr), legend)
