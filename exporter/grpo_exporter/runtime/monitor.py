"""GRPOMonitor: the public face. A training loop hands it each step's tensors; Prometheus scrapes the result.

* ``observe_rollout`` once per rollout batch: rewards, groups, outcomes, engine vs trainer log-probs, masks.
* ``observe_update`` for every optimizer (micro)step: the micro-steps of one optimizer step are kept
  (detached, validated at once) and computed together, in one pass with one host transfer, when the step
  ends (:mod:`grpo_exporter.stitching`): at ``clip_grad_norm_``, ``end_step``, ``flush``/``close``, or an
  ``observe_update`` of another step number.
* ``clip_grad_norm_`` clips like ``torch.nn.utils.clip_grad_norm_`` and records the norm before and after.
* With ``recorder_dir`` set, the flight recorder (:mod:`grpo_exporter.recorder`) keeps a few rows of each step
  and writes the last normal, first anomalous and next step of each layer-1 episode from a background thread.

Inside a training process the monitor never crashes or stalls training: an exception is caught, counted in
``grpo_exporter_errors_total{stage}``, logged at most once per stage per minute, and training goes on;
``strict=True`` raises instead. Misuse of the API itself (an unknown keyword, a call after ``close``) raises
at once, like any Python call. The layer-1 guard is the one deliberate exception: with ``guard="raise"`` a
failed stop criterion raises :class:`~grpo_exporter.runtime.guard.TrainingSignalError` at the end of observe.
With several ranks every rank makes exactly one merge per rollout and per ended update step, whatever
failed on it (:mod:`grpo_exporter.ranks.distributed`).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import torch
from prometheus_client.registry import CollectorRegistry
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.checks import ABCReport, AccumulationReport, MaskTableReport, ReachReport
from grpo_exporter.inputs import check_step, describe
from grpo_exporter.keywords import UPDATE_FIELDS, RolloutFields, UpdateFields, check_keywords
from grpo_exporter.runtime import evaluations, guard
from grpo_exporter.runtime.assembly import assemble
from grpo_exporter.runtime.compilation import CompiledStages
from grpo_exporter.runtime.monitor_config import MonitorConfig

PreflightReport = ABCReport | AccumulationReport | ReachReport | MaskTableReport

log = logging.getLogger("grpo_exporter")

__all__ = ["UPDATE_FIELDS", "GRPOMonitor", "MonitorClosedError", "PreflightReport"]


def step_number(step: object) -> int:
    """``step`` as an int: a Python int, a numpy or 0-d tensor integer (with data); anything else raises
    ``TypeError`` (its range is checked in the call: :meth:`~grpo_exporter.runtime.stages.Stages.advance`)."""
    if isinstance(step, bool | float) or (isinstance(step, Tensor) and (
            step.is_floating_point() or step.dtype == torch.bool or step.is_meta or step.is_complex())):
        raise TypeError(f"`step`: expected an integer, got {describe(step)}")
    try:
        return operator.index(step)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):
        raise TypeError(f"`step`: expected an integer, got {describe(step)}") from None


class MonitorClosedError(RuntimeError):
    """An observe call after :meth:`GRPOMonitor.close`."""


class GRPOMonitor:
    """Health metrics of a GRPO/PPO run, published with prometheus-client.

    ``GRPOMonitor(run="exp-42", group_size=16, clip_eps=(0.2, 0.28), port=0)``; any
    :class:`~grpo_exporter.runtime.monitor_config.MonitorConfig` field is a keyword, ``config_file`` reads YAML and
    ``GRPO_EXPORTER_*`` variables apply. Use as a context manager or call :meth:`close`. With
    ``torch.distributed`` initialised, every rank constructs its monitor at the same point of the program.
    """

    def __init__(
        self,
        run: str | None = None,
        *,
        config: MonitorConfig | None = None,
        config_file: str | Path | None = None,
        registry: CollectorRegistry | None = None,
        decode: Callable[[list[int]], str] | None = None,
        **settings: Any,
    ) -> None:
        if config is None:
            config = MonitorConfig.load(config_file, None, **({"run": run} if run is not None else {}), **settings)
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry: expected a prometheus_client CollectorRegistry (or None for the monitor's "
                            f"own), got {type(registry).__name__}")
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stages, self._endpoint = assemble(config, self.registry, decode)
        self._publication, self._report = self._stages.publication, self._stages.report
        self._closed = False

    # ---- public API ------------------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The bound port (the free one picked for ``port=0``), or None when not serving."""
        return self._endpoint.port

    @property
    def url(self) -> str | None:
        return self._endpoint.url

    @property
    def target(self) -> str | None:
        """The ``host:port`` this run announces in ``targets_dir`` for Prometheus to discover (a failed write is
        counted and tried again every minute); None without ``targets_dir`` or on a rank that does not serve."""
        return self._endpoint.target

    def observe_rollout(
        self, step: int, *, prompt_ids: Tensor | Sequence[Any] | None = None, prompt_tokens: Tensor | None = None,
        dropped_stale_total: int | None = None, **fields: Unpack[RolloutFields],
    ) -> None:
        """Rollout-level metrics, once per rollout batch (one host transfer). ``fields``: rewards, groups,
        outcomes, engine and trainer log-probs, masks, lengths (:class:`~grpo_exporter.keywords.RolloutFields`).

        ``group_ids`` and ``prompt_ids`` may be integer tensors or sequences of strings or integers (verl's
        ``uid``, prompt text): strings are hashed stably (:mod:`grpo_exporter.ids`), a host-to-device copy of N
        integers. ``prompt_tokens`` (N, S) prompt token ids are read only by the flight recorder
        (``recorder_dir``) and the reading set (with ``reading_text``), for their rows. Multi-turn and
        asynchronous loops add what they count themselves: ``turns`` (N,) model turns per completion, ``partial``
        (N,) completions generated over more than one policy version, ``tool_calls`` and ``tool_failures`` this
        batch's tool calls and failed ones (ints), ``tool_mask`` (N, T) the positions tools wrote (the readings
        are of the model's tokens; the mask audit names loss on tool output and lengths that count tool tokens),
        ``aborted_completions`` the completions the rollout aborted (an int), and ``dropped_stale_total`` the
        loop's running total of completions it dropped as too stale (an int). A dynamic-sampling loop (DAPO)
        hands the kept batch with ``generated_groups`` and
        ``filtered_all_correct_groups``/``filtered_all_incorrect_groups``, what its filter counted (ints)."""
        step = self._check_call("observe_rollout", step)
        check_keywords("observe_rollout", fields)
        violations: list[guard.Violation] = []
        with self._report.stage("rollout"):
            self._stages.advance(step)
            violations = self._stages.rollout(step, dict(fields), prompt_ids, prompt_tokens, dropped_stale_total)
        self._stages.enforce(violations)

    def observe_update(self, step: int, **fields: Unpack[UpdateFields]) -> None:
        """Update-level tensors of one optimizer (micro)step, accumulated into the step (validated now,
        computed when the step ends). ``fields``: :class:`~grpo_exporter.keywords.UpdateFields`.

        ``on_policy``: True on every micro-step of the first optimizer step on a fresh rollout (the weights
        have not changed since the old log-probs were computed); the on-policy ratio check runs on the
        micro-steps flagged. ``completion_lengths`` gives the mask audit of the mask you train with (with
        ``tool_mask`` where tools wrote); ``staleness`` (N,) the policy versions since each completion's oldest
        token was generated (asynchronous loops), read per loss token;
        ``grad_norm_pre_clip``/``grad_norm_post_clip``/``max_grad_norm`` when the framework clips. An unknown
        keyword raises ``TypeError``.
        """
        step = self._check_call("observe_update", step)
        check_keywords("observe_update", fields)
        violations: list[guard.Violation] = []
        with self._report.stage("update"):
            self._stages.advance(step)
            violations = self._stages.add_update(step, dict(fields))
        self._stages.enforce(violations)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter] | Tensor, max_norm: float, norm_type: float = 2.0
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that records the norm before and after clipping; ends the step.

        Returns the pre-clip total norm, like torch. The clipping itself always happens, even when recording
        fails or the monitor is closed.
        """
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        pre_clip = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        self._check_open("clip_grad_norm_")
        violations: list[guard.Violation] = []
        with self._report.stage("grad"):
            violations = self._stages.record_grad(params, pre_clip, max_norm)
        self._stages.enforce(violations)
        return pre_clip

    def end_step(self) -> None:
        """End the current optimizer step now: compute and publish its update metrics.

        Call it after ``optimizer.step()`` when ``clip_grad_norm_`` is not called through the monitor (the
        framework clips, and you pass ``grad_norm_pre_clip=`` to ``observe_update``), or when rollouts and
        updates overlap (asynchronous pipelines): without it the step ends only at the next update call of
        another step number."""
        self._check_open("end_step")
        violations: list[guard.Violation] = []
        with self._report.stage("update"):
            violations = self._stages.finish_update()
        self._stages.enforce(violations)

    def observe_retrieval(self, step: int, scores: Tensor, own_prompt: Tensor) -> None:
        """Retrieval accuracy: ``scores`` (N, P) of each completion under each of the batch's P prompts (e.g.
        log-probs from one extra forward pass), ``own_prompt`` (N,) the column of its own prompt. Call every
        K steps; chance level 1/P is published beside it. Rank-local (not merged across ranks). An evaluation
        is beside training: its ``step`` is checked, not counted as the run's step (``grpo_steps_total`` and
        ``grpo_last_step`` follow the training calls alone)."""
        step = self._check_call("observe_retrieval", step)
        with self._report.stage("rollout"):
            check_step(step)
            self._stages.evaluation(evaluations.retrieval(scores, own_prompt))

    def observe_regression(self, step: int, correct: Tensor) -> None:
        """A mastered-prompt regression set (seed 第 4 篇 4.3): ``correct`` (N,) bool or 0/1, one per completion of
        a small fixed set of prompts the policy already solves, evaluated every K steps. A run that filters
        all-correct groups (dynamic sampling) never trains on them again, so their forgetting shows here or
        nowhere. The first ``regression_anchor_evaluations`` make its anchor; GRPOMasteredPromptsRegressed warns
        on a drop beyond the set's binomial noise. Rank-local: call it on rank 0 with the whole set. Its ``step``
        is checked, not counted as the run's step (as :meth:`observe_retrieval`)."""
        step = self._check_call("observe_regression", step)
        with self._report.stage("rollout"):
            check_step(step)
            self._stages.evaluation(evaluations.regression(correct))

    def publish_check(self, report: PreflightReport) -> None:
        """Publish a preflight check's verdict (:mod:`grpo_exporter.checks`) as
        ``grpo_preflight_check_passed{check}`` and ``grpo_preflight_check_cannot_tell{check}``; the last report of
        each check stays published."""
        if not isinstance(report, ABCReport | AccumulationReport | ReachReport | MaskTableReport):
            raise TypeError("publish_check: report: expected a report of grpo_exporter.checks (ABCReport, "
                            f"AccumulationReport, ReachReport, MaskTableReport), got {type(report).__name__}")
        with self._publication.writing:
            self._stages.check(report.CHECK, report.passed, report.cannot_tell)
            self._publication.publish()

    def flush(self) -> None:
        """Compute and publish the pending update step now (:meth:`end_step`)."""
        self.end_step()

    def metrics(self) -> Mapping[str, float]:
        """The published values (sample key -> value, without the run label): what a scrape would see."""
        return self._publication.snapshot()

    def wait_for_workers(self, timeout: float = 10.0) -> None:
        """Block until the off-thread jobs (the edit-distance job, the reading set's merges, the flight recorder's
        writes) are done; for tests and shutdown."""
        self._stages.edit_worker.wait(timeout)
        if self._stages.reading is not None:
            self._stages.reading.wait(timeout)
        if self._stages.recorder is not None:
            self._stages.recorder.wait(timeout)

    @property
    def compilation(self) -> CompiledStages:
        """The compiled stages' state (``compile_step``): programs ready, compilations, fallbacks by reason;
        ``compilation.wait()`` blocks until the compiler thread is idle (a warm-up before timing)."""
        return self._stages.compiled

    def close(self) -> None:
        """Publish what is pending, mark the run finished (``grpo_run_finished`` 1: a normal end pages nothing),
        and stop serving once a scrape has seen it. Idempotent; observe calls after it raise."""
        if self._closed:
            return
        with contextlib.suppress(guard.TrainingSignalError):
            self.end_step()
        self._stages.close_readers()
        with self._publication.writing:
            self._stages.publish_held_audit()
            self._publication.merge({catalog.key("grpo_run_finished"): 1.0})
            self._publication.publish()
        self._closed = True
        self._stages.compiled.close()
        self._stages.edit_worker.shutdown()
        self._endpoint.close(self.config.close_linger_s)

    def __enter__(self) -> GRPOMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- step life cycle -------------------------------------------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise MonitorClosedError(
                f"GRPOMonitor(run={self.config.run!r}).{call}() after close(): the monitor no longer computes "
                "or serves; create a new monitor for a new run"
            )

    def _check_call(self, call: str, step: object) -> int:
        """API misuse raises at once, before anything is computed: a call after close, a step that is no
        integer."""
        self._check_open(call)
        return step_number(step)

    def contained(self, stage: str, where: str) -> contextlib.AbstractContextManager[None]:
        """For framework adapters: an exception inside (reading the framework's objects) is counted in
        ``grpo_exporter_errors_total{stage}``, published, and logged naming ``where``, and training goes on;
        strict mode raises. ``stage`` is one of :data:`~grpo_exporter.catalog.STAGES`."""
        return self._report.contained(stage, where, publish=True)
