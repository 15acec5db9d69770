"""Every alert, one module per part of the signal chain (liveness, then layers 1-4), in that order."""

from __future__ import annotations

from grpo_exporter.mixin.alerts import diversity, gradient, liveness, reward, routing, samples
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import Alert

PARTS = (liveness, gradient, routing, reward, samples, diversity)


def alerts(c: MixinConfig) -> list[Alert]:
    """Every alert, in signal-chain order (liveness, then layers 1-4); an override naming no alert fails."""
    found = [alert for part in PARTS for alert in part.alerts(c)]
    unknown = (set(c.severities) | set(c.for_seconds)) - {a.name for a in found}
    if unknown:
        raise ValueError(f"severities/for_seconds: unknown alert(s) {sorted(unknown)}; expected GRPO... names "
                         f"of {[a.name for a in found]}")
    return found
