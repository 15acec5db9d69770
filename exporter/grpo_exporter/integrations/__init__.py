"""Adapters that hand a framework's own step tensors to :class:`~grpo_exporter.monitor.GRPOMonitor`.

One module per framework, each imported on demand (``from grpo_exporter.integrations.trl import
MonitoredGRPOTrainer``); none is imported by ``grpo_exporter`` itself, so the core never needs a framework.
What each can and cannot give is in docs/integrations.md.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from types import ModuleType


class IntegrationError(ImportError):
    """The framework is missing, or lacks a method or signature the adapter wraps."""


def require(module: str, extra: str, tested: str) -> ModuleType:
    """Import ``module`` or raise :class:`IntegrationError` with the install command for the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise IntegrationError(
            f"grpo_exporter.integrations.{extra} needs {module!r} ({tested} is the tested range), which is not "
            f"importable here: {exc}. Install it with: pip install 'grpo-exporter[{extra}]'"
        ) from exc


def check_signature(
    owner: type, name: str, params: Sequence[str], framework: str, tested: str
) -> Callable[..., object]:
    """The method ``owner.name``, after checking that its first parameters are ``params`` (the private names an
    adapter wraps move between releases: fail at import, naming the method, not mid-training)."""
    method = getattr(owner, name, None)
    if method is None or not callable(method):
        raise IntegrationError(
            f"{framework}: {owner.__name__}.{name} is missing; the adapter wraps it. Tested with {tested}."
        )
    found = list(inspect.signature(method).parameters)
    if found[: len(params)] != list(params):
        raise IntegrationError(
            f"{framework}: {owner.__name__}.{name}{inspect.signature(method)} does not start with the parameters "
            f"({', '.join(params)}) the adapter wraps. Tested with {tested}."
        )
    return method
