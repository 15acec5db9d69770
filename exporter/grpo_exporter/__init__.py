"""grpo-exporter: health metrics of GRPO/PPO training signals, computed on device and published to Prometheus."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("grpo-exporter")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
