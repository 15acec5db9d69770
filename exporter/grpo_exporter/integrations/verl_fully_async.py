"""verl's fully-async trainer (``verl.experimental.fully_async_policy``), monitored: ``FullyAsyncTrainer`` is a Ray
actor class, so the v0 hooks of :mod:`grpo_exporter.integrations.verl` go on the class under its ``@ray.remote``,
and verl's task runner is made to create that one (:func:`monitored_fully_async_task_runner`). One monitor step
per local update, the policy version counted in parameter versions (``current_param_version``), not in steps."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from grpo_exporter.integrations import IntegrationError, carried_variables, carrying, check_signature, require
from grpo_exporter.integrations.verl import _hooked
from grpo_exporter.integrations.verl_settings import TESTED, monitor_settings
from grpo_exporter.runtime.monitor import GRPOMonitor


def monitored_fully_async_trainer(base: Any = None, **settings: Any) -> Any:
    """The Ray actor class to create in place of verl's fully-async ``FullyAsyncTrainer`` (what
    :func:`monitored_fully_async_task_runner` has verl's task runner create): the class under verl's
    ``@ray.remote`` with the v0 hooks, wrapped again with verl's actor options (a plain ``base`` comes back
    plain). It makes a :class:`GRPOMonitor` in the trainer's process after verl's ``__init__``
    (:func:`monitor_settings` with ``settings``) and reports every local update as one step (``global_steps``).

    The policy version is ``current_param_version``: the version the rollouter tags its trajectories with
    (``min_global_steps``/``max_global_steps``), and the weights of the old log-probs (verl's
    ``_compute_old_log_prob`` restores them for every local update of a sync cycle). The staleness is thus
    counted in parameter versions, 0 on a fresh batch whatever ``trigger_parameter_sync_step``; the engine gap is
    read on batches generated on that version alone (decoupled mode: verl's fully-async config defaults to
    ``rollout_correction.bypass_mode``, where the old log-probs are the engine's and no gap exists).

    The trainer actor runs on a node Ray picks: ``settings`` and the ``GRPO_EXPORTER_*`` variables of the process
    that calls this travel with the class (:func:`~grpo_exporter.integrations.carrying`), so that
    ``targets_dir`` reaches the monitor there."""
    if base is None:
        base = require("verl.experimental.fully_async_policy.fully_async_trainer", "verl", TESTED).FullyAsyncTrainer
    cls = getattr(base, "__ray_actor_class__", base)
    hooked: Any = _hooked(cls, "MonitoredRayPPOTrainer")
    carried = carried_variables()

    class MonitoredFullyAsyncTrainer(hooked):
        _grpo_made_monitor = True
        _grpo_monitored = True

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            if not hasattr(self, "current_param_version"):
                raise IntegrationError(
                    f"verl fully-async: {cls.__name__} has no current_param_version after __init__: the policy "
                    f"version cannot be read (the staleness would be counted in steps). Tested with {TESTED}.")
            with carrying(carried):
                self.monitor = GRPOMonitor(**monitor_settings(config, **settings))

        def _grpo_versions(self) -> tuple[int, int]:
            return int(self.global_steps), int(self.current_param_version)

    MonitoredFullyAsyncTrainer.__name__ = MonitoredFullyAsyncTrainer.__qualname__ = f"Monitored{cls.__name__}"
    return _as_actor(base, MonitoredFullyAsyncTrainer)


def _as_actor(base: Any, cls: type) -> Any:
    """``cls`` as ``base`` is: a Ray actor class with ``base``'s options (``@ray.remote(num_cpus=...)``), or
    plain."""
    if getattr(base, "__ray_actor_class__", None) is None:
        return cls
    import ray

    options = dict(getattr(base, "_default_options", None) or {})
    return ray.remote(**options)(cls) if options else ray.remote(cls)


def install_fully_async(names: MutableMapping[str, Any] | None = None, /, **settings: Any) -> Any:
    """Make verl's ``FullyAsyncTaskRunner`` create the monitored trainer (:func:`monitored_fully_async_trainer`
    of the ``FullyAsyncTrainer`` it names), in this process (idempotent): its ``_create_trainer`` creates the
    trainer by the name ``FullyAsyncTrainer`` of its globals, ``names`` (default: ``fully_async_main``'s own). A
    task runner class Ray shipped to the actor's process (cloudpickle, by value: the module's name is the actor
    class, not the class) reads a copy of those globals made when it was pickled, which rebinding the module's
    name leaves alone: :func:`monitored_fully_async_task_runner` passes the globals its base's
    ``_create_trainer`` reads."""
    main = require("verl.experimental.fully_async_policy.fully_async_main", "verl", TESTED)
    names = vars(main) if names is None else names
    current = names.get("FullyAsyncTrainer")
    if current is None:
        raise IntegrationError("verl fully-async: verl.experimental.fully_async_policy.fully_async_main names no "
                               f"FullyAsyncTrainer to replace. Tested with {TESTED}.")
    if getattr(getattr(current, "__ray_actor_class__", current), "_grpo_monitored", False):
        return current
    monitored = monitored_fully_async_trainer(current, **settings)
    names["FullyAsyncTrainer"] = monitored
    return monitored


def monitored_fully_async_task_runner(**settings: Any) -> Any:
    """A Ray actor class to pass as ``run_ppo(config, task_runner_class=...)`` in place of verl's
    ``FullyAsyncTaskRunner`` (in your copy of ``fully_async_main.main``): before verl's ``_create_trainer``
    builds the trainer (in the task runner's own process), the trainer class is replaced by its monitored one
    (:func:`install_fully_async`; ``settings`` go to :func:`monitor_settings`). ``settings`` (``targets_dir=``)
    and the ``GRPO_EXPORTER_*`` variables of the process that calls this travel with the class to the task
    runner, and on with the trainer's class to the trainer actor, wherever Ray places each."""
    main = require("verl.experimental.fully_async_policy.fully_async_main", "verl", TESTED)
    base = main.FullyAsyncTaskRunner
    cls = getattr(base, "__ray_actor_class__", base)
    check_signature(cls, "_create_trainer", ("self", "config"), "verl", TESTED)
    carried = carried_variables()

    class MonitoredFullyAsyncTaskRunner(cls):  # type: ignore[misc, valid-type]
        def _create_trainer(self, config: Any) -> Any:
            with carrying(carried):  # the monitored trainer class takes them along
                install_fully_async(cls._create_trainer.__globals__, **settings)
            return super()._create_trainer(config)

    return _as_actor(base, MonitoredFullyAsyncTaskRunner)
