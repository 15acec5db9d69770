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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from grpo_exporter.monitor import GRPOMonitor


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


def observe_rollout_time_update(
    monitor: GRPOMonitor, step: int, loss_mask: Tensor, advantages: Tensor | None, old: Tensor | None,
    ref: Tensor | None, entropy: Tensor | None = None,
) -> None:
    """The update inputs a driver holds at rollout time when current log-probs stay in the workers (verl,
    OpenRLHF): advantages, per-token entropy, and the KL of the sampling policy to the reference (``logprobs``
    = the old log-probs). No ``old_logprobs`` is passed, so no ratio of 1 by construction is published."""
    if advantages is not None or entropy is not None or (old is not None and ref is not None):
        monitor.observe_update(step, advantages=advantages, loss_mask=loss_mask, logprobs=old, entropy=entropy,
                               ref_logprobs=ref if old is not None else None)


def observe_reported_update(
    monitor: GRPOMonitor, step: int, grad_norm: float | None, entropy_mean: float | None,
    max_grad_norm: float | None,
) -> None:
    """A framework's reported update aggregates (pre-clip grad norm, mean token entropy), then end the step."""
    values: dict[str, float] = {}
    if grad_norm is not None:
        values["grad_norm_pre_clip"] = grad_norm
        if max_grad_norm is not None:
            values["max_grad_norm"] = float(max_grad_norm)
    if entropy_mean is not None:
        values["entropy_mean"] = entropy_mean
    if values:
        monitor.observe_update(step, **values)
    monitor.end_step()
