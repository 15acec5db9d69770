"""Moved to :mod:`grpo_exporter.runtime.monitor_config`; kept so that imports written against this path still
work."""

from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.serving.settings import hash_password, verify_password

__all__ = ["MonitorConfig", "hash_password", "verify_password"]
