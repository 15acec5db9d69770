"""Rules, alerts, Alertmanager routing (and dashboards) generated from one config, like a monitoring mixin."""

from grpo_exporter.mixin.config import MixinConfig

__all__ = ["MixinConfig"]
