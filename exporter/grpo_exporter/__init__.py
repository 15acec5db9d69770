"""grpo-exporter: health metrics of GRPO/PPO training signals, computed on device and published to Prometheus.

The public names are imported on first access, so that importing the package (as every CLI command does) does not
import torch: the commands that need no tensors start in a fraction of a second."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("grpo-exporter")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

if TYPE_CHECKING:
    from grpo_exporter.config_files import ConfigFileError
    from grpo_exporter.inputs import InputError, StepInputs
    from grpo_exporter.integrations import IntegrationError
    from grpo_exporter.recorder.inspect import InspectError
    from grpo_exporter.runtime.guard import TrainingSignalError
    from grpo_exporter.runtime.monitor import GRPOMonitor, MonitorClosedError
    from grpo_exporter.runtime.monitor_config import MonitorConfig
    from grpo_exporter.serving.server import AddressUnavailableError, PortInUseError
    from grpo_exporter.serving.settings import hash_password

#: each public name and the module that defines it
_PUBLIC = {
    "AddressUnavailableError": "grpo_exporter.serving.server",
    "ConfigFileError": "grpo_exporter.config_files",
    "GRPOMonitor": "grpo_exporter.runtime.monitor",
    "InputError": "grpo_exporter.inputs",
    "InspectError": "grpo_exporter.recorder.inspect",
    "IntegrationError": "grpo_exporter.integrations",
    "MonitorClosedError": "grpo_exporter.runtime.monitor",
    "MonitorConfig": "grpo_exporter.runtime.monitor_config",
    "PortInUseError": "grpo_exporter.serving.server",
    "StepInputs": "grpo_exporter.inputs",
    "TrainingSignalError": "grpo_exporter.runtime.guard",
    "hash_password": "grpo_exporter.serving.settings",
}

__all__ = [
    "AddressUnavailableError",
    "ConfigFileError",
    "GRPOMonitor",
    "InputError",
    "InspectError",
    "IntegrationError",
    "MonitorClosedError",
    "MonitorConfig",
    "PortInUseError",
    "StepInputs",
    "TrainingSignalError",
    "__version__",
    "hash_password",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first access and kept in the package's namespace after."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names with the public ones not yet imported, so that completion and ``dir()`` list them."""
    return sorted(set(globals()) | set(__all__))
