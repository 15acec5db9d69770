"""grpo-exporter: health metrics of GRPO/PPO training signals, computed on device and published to Prometheus."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("grpo-exporter")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

from grpo_exporter.config_files import ConfigFileError
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.integrations import IntegrationError
from grpo_exporter.recorder.inspect import InspectError
from grpo_exporter.runtime.guard import TrainingSignalError
from grpo_exporter.runtime.monitor import GRPOMonitor, MonitorClosedError
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.serving.server import AddressUnavailableError, PortInUseError
from grpo_exporter.serving.settings import hash_password

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
