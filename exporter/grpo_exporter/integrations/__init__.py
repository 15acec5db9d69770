"""Adapters that hand a framework's own step tensors to :class:`~grpo_exporter.runtime.monitor.GRPOMonitor`.

One module per framework, each imported on demand (``from grpo_exporter.integrations.trl import
MonitoredGRPOTrainer``); none is imported by ``grpo_exporter`` itself, so the core never needs a framework.
What each can and cannot give is in docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from grpo_exporter.runtime.monitor import GRPOMonitor


class IntegrationError(ImportError):
    """The framework is missing, or lacks a method or signature the adapter wraps."""


#: comma-separated distributions (or "all") whose installed version may lie outside an adapter's tested range
ALLOW_UNTESTED_ENV = "GRPO_EXPORTER_ALLOW_UNTESTED"
_RANGE = re.compile(r"([A-Za-z][A-Za-z0-9_.-]*?)((?:(?:>=|<=|==|!=|<|>)[0-9][0-9A-Za-z.+-]*,?)+)(?=\s|$)")
_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b, ">": lambda a, b: a > b,
}


def tested_ranges(tested: str) -> dict[str, str]:
    """distribution -> its version specifier in an adapter's ``TESTED`` text ("trl>=1.16,<1.17 with ...")."""
    return {name.lower(): spec.rstrip(",") for name, spec in _RANGE.findall(tested)}


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a PEP 440 version ("1.16.0rc1+cpu" -> (1, 16, 0)); trailing zeros dropped so
    that 1.16 == 1.16.0."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    numbers = [int(n) for n in found.group(0).split(".")] if found else [0]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every clause of ``spec`` (">=1.16,<1.17"; release numbers only)."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next(o for o in (">=", "<=", "==", "!=", "<", ">") if clause.startswith(o))
        if not _COMPARE[op](_release(version), _release(clause[len(op):])):
            return False
    return True


def check_version(distribution: str, version: str, extra: str, tested: str) -> None:
    """Raise :class:`IntegrationError` when ``version`` of ``distribution`` lies outside the range ``tested``
    names for it, unless :data:`ALLOW_UNTESTED_ENV` lists it (then one warning is logged). The adapters wrap
    private methods that move between releases: an untested release fails at import, not mid-training."""
    spec = tested_ranges(tested).get(distribution.lower())
    if spec is None or in_range(version, spec):
        return
    allowed = {a.strip().lower() for a in os.environ.get(ALLOW_UNTESTED_ENV, "").split(",") if a.strip()}
    if allowed & {"all", "1", "true", distribution.lower()}:
        logging.getLogger("grpo_exporter").warning(
            "%s %s is outside the tested range %s (%s); %s allows it: the wrapped signatures are still checked",
            distribution, version, spec, tested, ALLOW_UNTESTED_ENV)
        return
    raise IntegrationError(
        f"grpo_exporter.integrations.{extra}: {distribution} {version} is installed, outside the tested range "
        f"{distribution}{spec} ({tested}). The adapter wraps private methods that move between releases. Install "
        f"a tested version (pip install '{distribution}{spec}', or '.[{extra}]' in grpo-exporter's folder: "
        f"docs/install.md), or set {ALLOW_UNTESTED_ENV}={distribution} to "
        "try this one (the signatures it wraps are still checked at import)."
    )


def require(module: str, extra: str, tested: str) -> ModuleType:
    """Import ``module`` or raise :class:`IntegrationError` with the install command for the extra; its
    distribution's installed version must lie in the range ``tested`` names for it (:func:`check_version`)."""
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise IntegrationError(
            f"grpo_exporter.integrations.{extra} needs {module!r} ({tested} is the tested range), which is not "
            f"importable here: {exc}. Install it with: pip install "
            f"{' '.join(repr(name + spec) for name, spec in tested_ranges(tested).items())} (or '.[{extra}]' in "
            "grpo-exporter's folder: docs/install.md)"
        ) from exc
    distribution = module.split(".")[0]
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        version = str(getattr(sys.modules.get(distribution), "__version__", ""))
    if version:
        check_version(distribution, version, extra, tested)
    return found


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


_SAID: weakref.WeakKeyDictionary[GRPOMonitor, set[str]] = weakref.WeakKeyDictionary()


def say_once(monitor: GRPOMonitor, key: str, message: str) -> None:
    """Log ``message`` (a framework mode the adapter reads differently, or cannot read) once per monitor."""
    said = _SAID.setdefault(monitor, set())
    if key not in said:
        said.add(key)
        logging.getLogger("grpo_exporter").warning(message)


def observe_rollout_time_update(
    monitor: GRPOMonitor, step: int, loss_mask: Tensor, advantages: Tensor | None, old: Tensor | None,
    ref: Tensor | None, entropy: Tensor | None = None, more: Mapping[str, Any] | None = None,
) -> None:
    """The update inputs a driver holds at rollout time when current log-probs stay in the workers (verl,
    OpenRLHF): advantages, per-token entropy, and the KL of the sampling policy to the reference (``logprobs``
    = the old log-probs). No ``old_logprobs`` is passed, so no ratio of 1 by construction is published.
    ``more``: other update fields the driver knows (``group_ids``; ``policy_version`` and
    ``rollout_policy_version`` where the framework tags its rollouts)."""
    more = dict(more or {})
    if advantages is not None or entropy is not None or (old is not None and ref is not None) or more:
        monitor.observe_update(step, advantages=advantages, loss_mask=loss_mask, logprobs=old, entropy=entropy,
                               ref_logprobs=ref if old is not None else None, **more)


def observe_reported_update(
    monitor: GRPOMonitor, step: int, grad_norm: float | None, entropy_mean: float | None,
    max_grad_norm: float | None,
) -> None:
    """A framework's reported update aggregates (pre-clip grad norm, mean token entropy), then end the step."""
    values: dict[str, Any] = {}
    if grad_norm is not None:
        values["grad_norm_pre_clip"] = grad_norm
        if max_grad_norm is not None:
            values["max_grad_norm"] = float(max_grad_norm)
    if entropy_mean is not None:
        values["entropy_mean"] = entropy_mean
    if values:
        monitor.observe_update(step, **values)
    monitor.end_step()


#: ``GRPO_EXPORTER_*`` variables that name the node they are set on: never carried to an actor's process, which may
#: run on another node (there the monitor binds and announces that node's own address)
NODE_VARIABLES = frozenset({"GRPO_EXPORTER_HOST", "GRPO_EXPORTER_ADVERTISE_HOST"})


def carried_variables() -> dict[str, str]:
    """This process's ``GRPO_EXPORTER_*`` variables but :data:`NODE_VARIABLES`: what an adapter's actor class
    takes along when it is made (in the driver), to apply with :func:`carrying` where its monitor is built. A Ray
    actor on another node does not inherit the driver's environment (only a ``runtime_env``'s ``env_vars``), while
    the class, and whatever it holds, is shipped to it: ``GRPO_EXPORTER_TARGETS_DIR`` set where the training is
    launched reaches the monitor wherever Ray places it."""
    return {name: value for name, value in os.environ.items()
            if name.startswith("GRPO_EXPORTER_") and name not in NODE_VARIABLES}


@contextlib.contextmanager
def carrying(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` (:func:`carried_variables` of the process that made the class) set for the duration where
    this process has none of its own: the actor's own environment (a ``runtime_env``'s ``env_vars``) wins, and
    keywords win over both, as everywhere. Removed again on exit: only the monitor's construction (and the
    classes made in it, which carry them on) sees them."""
    added = {name: value for name, value in variables.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
