"""Moved to :mod:`grpo_exporter.runtime.monitor`; kept so that imports written against this path still work."""

from grpo_exporter.runtime.monitor import GRPOMonitor, MonitorClosedError

__all__ = ["GRPOMonitor", "MonitorClosedError"]
