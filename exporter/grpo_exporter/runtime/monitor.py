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
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.checks import ABCReport, AccumulationReport, MaskTableReport, ReachReport
from grpo_exporter.functional.diversity import retrieval_accuracy
from grpo_exporter.ids import id_tensor
from grpo_exporter.inputs import InputError, StepInputs, describe, fields_where
from grpo_exporter.ranks import distributed
from grpo_exporter.ranks.layout import Layout
from grpo_exporter.recorder import FlightRecorder
from grpo_exporter.recorder.store import FreeFloor
from grpo_exporter.runtime import guard
from grpo_exporter.runtime.anchors import RunAnchors
from grpo_exporter.runtime.background import EditDistanceWorker, edit_distance_carry
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.runtime.param_sample import sample_parameters
from grpo_exporter.runtime.reporting import Reporter
from grpo_exporter.runtime.run_info import static_values
from grpo_exporter.runtime.run_state import Prediction, RunState
from grpo_exporter.serving.collector import CatalogCollector
from grpo_exporter.serving.publication import Publication, duration_increments
from grpo_exporter.serving.server import MetricsServer
from grpo_exporter.step import (
    MASK_AUDIT_FAMILIES,
    ROLLOUT_BLOCKS,
    UPDATE_BLOCKS,
    StepResult,
    compute_step_carrying,
    families_of,
)
from grpo_exporter.stitching import StepStitcher

PreflightReport = ABCReport | AccumulationReport | ReachReport | MaskTableReport

log = logging.getLogger("grpo_exporter")

_STAGE_BLOCKS = {"rollout": ROLLOUT_BLOCKS, "update": UPDATE_BLOCKS}
# the loss-mask audit of the rollout is published only when the update does not audit its own mask
_AUDIT = frozenset(MASK_AUDIT_FAMILIES)
UPDATE_FIELDS = frozenset(fields_where(update=True))  # what observe_update takes as keywords



def _prompt_tokens(tokens: Tensor | None, inputs: StepInputs | None) -> Tensor | None:
    """``prompt_tokens`` checked for the recorder: (N, S) integers, moved to the inputs' device when they are on
    another (a copy of a few ids, without waiting for the device: the recorder takes its rows there)."""
    if tokens is None:
        return None
    n = inputs.n if inputs is not None else None
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point() or (
        n is not None and tokens.shape[0] != n
    ):
        raise InputError("prompt_tokens", f"an (N, S) integer tensor with N = {n}", describe(tokens))
    if inputs is not None and tokens.device != inputs.device:
        try:
            return tokens.to(inputs.device, non_blocking=True)
        except (RuntimeError, NotImplementedError) as exc:
            raise InputError("prompt_tokens", f"a tensor that can move to the inputs' device {inputs.device}",
                             f"one on {tokens.device} ({exc})") from exc
    return tokens


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
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._publication = Publication(RunAnchors(config.anchor_steps))
        self._report = Reporter(self._publication, config)
        self._collector = CatalogCollector(
            self._publication, config.run, self.registry, on_error=lambda exc: self._report.error("scrape", exc)
        )
        self._rank, self._world = distributed.world()
        self._reducer: distributed.Reducer | None = None
        if self._world > 1 and config.distributed == "merge":
            layouts = {stage: Layout(families_of(blocks), config) for stage, blocks in _STAGE_BLOCKS.items()}
            self._reducer = distributed.Reducer(layouts, config.distributed_timeout_s)
            if not self._reducer.active:  # logged by the reducer; counted here
                self._report.count("distributed")
        self._state = RunState(config)
        self._stitcher = StepStitcher(config.max_pending_micro_steps)
        self._closed = False
        self._edit_worker = EditDistanceWorker(
            self._publication, lambda exc: self._report.error("rollout", exc, "edit distance worker"),
            self.config.edit_distance_budget_s,
        )
        self._recorder: FlightRecorder | None = None
        if config.recorder_dir is not None:
            self._recorder = FlightRecorder(
                config.recorder_dir, run=config.run, rank=self._rank, world=self._world, rows=config.recorder_rows,
                history_steps=config.recorder_history_steps, budget_bytes=config.recorder_disk_budget_bytes,
                triggers=config.recorder_triggers, lines=config.stop_lines,
                flush_timeout_s=config.recorder_flush_timeout_s, cooldown_steps=config.recorder_cooldown_steps,
                floor=FreeFloor(config.recorder_min_free_bytes, config.recorder_min_free_ratio),
                state_bytes=config.recorder_max_state_bytes,
                publication=self._publication,
                on_error=lambda exc: self._report.error("recorder", exc, "flight recorder"), decode=decode,
                metrics=config,
            )
        self._publication.merge(static_values(config))
        self._publication.publish()
        self._server: MetricsServer | None = None
        if self._rank == 0 and config.port is not None:
            ProcessCollector(registry=self.registry)
            self._server = MetricsServer(
                self.registry, config.host, config.port, config.tls_cert, config.tls_key,
                config.basic_auth_user, config.basic_auth_password_hash,
            )

    # ---- public API ------------------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The bound port (the free one picked for ``port=0``), or None when not serving."""
        return self._server.port if self._server else None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server else None

    def observe_rollout(
        self,
        step: int,
        *,
        rewards: Tensor | None = None,
        group_ids: Tensor | Sequence[Any] | None = None,
        correct: Tensor | None = None,
        truncated: Tensor | None = None,
        reward_components: Mapping[str, Tensor] | None = None,
        rollout_logprobs: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        loss_mask: Tensor | None = None,
        completion_lengths: Tensor | None = None,
        completion_ids: Tensor | None = None,
        completion_mask: Tensor | None = None,
        prompt_ids: Tensor | Sequence[Any] | None = None,
        prompt_tokens: Tensor | None = None,
        turns: Tensor | None = None,
        partial: Tensor | None = None,
        tool_calls: int | None = None,
        tool_failures: int | None = None,
    ) -> None:
        """Rollout-level metrics, once per rollout batch (one host transfer).

        ``group_ids`` and ``prompt_ids`` may be integer tensors or sequences of strings or integers (verl's
        ``uid``, prompt text): strings are hashed stably (:mod:`grpo_exporter.ids`), a host-to-device copy of N
        integers. ``prompt_tokens`` (N, S) prompt token ids are read only by the flight recorder
        (``recorder_dir``), for its rows. Multi-turn and asynchronous loops add what they count themselves:
        ``turns`` (N,) model turns per completion, ``partial`` (N,) completions generated over more than one
        policy version, ``tool_calls`` and ``tool_failures`` this batch's tool calls and failed ones (ints)."""
        step = self._check_call("observe_rollout", step)
        violations: list[guard.Violation] = []
        with self._stage("rollout"):
            self._advance(step)
            violations += self._publish_held_audit()  # the last step had no update to audit its mask
            inputs: StepInputs | None = None
            prediction, carry = Prediction(), dict[str, Tensor]()
            with self._contained("rollout"):
                device = next((t.device for t in (rewards, correct, truncated, rollout_logprobs, old_logprobs,
                                                   loss_mask, completion_lengths, completion_ids)
                               if isinstance(t, Tensor)), None)
                group_ids = id_tensor("group_ids", group_ids, device)
                prompt_ids = id_tensor("prompt_ids", prompt_ids, device)
                components, dropped = self._state.components.admit(reward_components)
                if dropped:
                    self._publication.add({catalog.key("grpo_dropped_reward_components_total"): float(dropped)})
                inputs = StepInputs(
                    rewards=rewards, group_ids=group_ids, correct=correct, truncated=truncated,
                    reward_components=components, rollout_logprobs=rollout_logprobs,
                    old_logprobs=old_logprobs, loss_mask=loss_mask, completion_lengths=completion_lengths,
                    completion_ids=completion_ids, completion_mask=completion_mask, turns=turns, partial=partial,
                    tool_calls=tool_calls, tool_failures=tool_failures,
                )
                inputs, prediction, carry = self._state.predict_zero_variance(inputs, prompt_ids)
                carry |= edit_distance_carry(inputs, self.config.edit_distance_groups, self.config.group_size)
            result = self._compute("rollout", inputs, carry)
            if inputs is not None:
                with self._contained("rollout", "solve-rate update"):
                    self._state.learn_solve_rates(prediction, inputs, result.carried)
                if inputs.completion_ids is not None:
                    self._edit_worker.submit(result.carried, inputs.completion_ids.shape[1])
            violations += self._publish_rollout(result)
            if self._recorder is not None:
                with self._contained("recorder", "flight recorder"):
                    tokens = None
                    with self._contained("recorder", "flight recorder: prompt_tokens (the rows are kept without)"):
                        tokens = _prompt_tokens(prompt_tokens, inputs)
                    extra = {"prompt_ids": prompt_ids, "prompt_tokens": tokens}
                    self._recorder.observe("rollout", step, inputs, result.metrics, extra)
        self._enforce(violations)

    def _publish_rollout(self, result: StepResult) -> list[guard.Violation]:
        """The rollout's readings and what the run's state derives from them; its mask audit is held until an
        update audits the mask it trains with (published at the next step otherwise)."""
        audit = {k: v for k, v in result.metrics.items()
                 if catalog.family_of(catalog.sample_key(k).sample).name in _AUDIT}
        self._state.held_audit = audit or None
        metrics = {k: v for k, v in result.metrics.items() if k not in audit}
        metrics |= self._state.after_rollout(metrics).gauges
        return self._publish(metrics, result.families - _AUDIT)

    def observe_update(
        self,
        step: int,
        *,
        logprobs: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        advantages: Tensor | None = None,
        loss_mask: Tensor | None = None,
        entropy: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        on_policy: bool | Tensor | None = None,
        **more: Any,
    ) -> None:
        """Update-level tensors of one optimizer (micro)step, accumulated into the step (validated now,
        computed when the step ends).

        ``on_policy``: True on every micro-step of the first optimizer step on a fresh rollout (the weights
        have not changed since the old log-probs were computed); the on-policy ratio check runs on the
        micro-steps flagged. ``more`` takes any other :class:`~grpo_exporter.inputs.StepInputs` field of the
        update: ``rewards``, ``group_ids``, ``completion_lengths`` (the mask audit of the mask you train
        with), ``grad_norm_pre_clip``/``grad_norm_post_clip``/``max_grad_norm`` when the framework clips,
        ``loss``, ``policy_version``, ``rollout_policy_version``. An unknown keyword raises ``TypeError``.
        """
        step = self._check_call("observe_update", step)
        unknown = sorted(set(more) - UPDATE_FIELDS)
        if unknown:
            raise TypeError(
                f"observe_update() got unexpected keyword argument(s) {unknown}; accepted: {sorted(UPDATE_FIELDS)}"
            )
        violations: list[guard.Violation] = []
        with self._stage("update"):
            self._advance(step)
            if self._stitcher.begin(step):
                violations += self._finish_update()
            self._stitcher.mark(step)
            with self._contained("update"):
                try:
                    inputs = StepInputs(
                        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask,
                        entropy=entropy, ref_logprobs=ref_logprobs, on_policy=on_policy, **more,
                    )
                except Exception:
                    self._stitcher.failed = True
                    raise
                if not self._stitcher.add(step, inputs):
                    self._publication.add({catalog.key("grpo_dropped_micro_steps_total"): 1.0})
                    if self._report.due("dropped-micro-steps"):
                        log.warning(
                            "grpo-exporter: more than %d micro-steps in step %d; further ones are dropped and "
                            "counted (grpo_dropped_micro_steps_total). Call clip_grad_norm_() or end_step() once "
                            "per optimizer step.", self.config.max_pending_micro_steps, step,
                        )
        self._enforce(violations)

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
        with self._stage("grad"):
            current = sample_parameters(params)
            grad = {"grad_norm_pre_clip": pre_clip.detach(), "max_grad_norm": float(max_norm)}
            before = self._state.param_snapshot
            if before is not None and [t.shape for t in before] == [t.shape for t in current]:
                # taken at the previous clip, before that step's optimizer.step(): the update it made
                grad |= {"params_before": before, "params_after": current}
            self._stitcher.record_grad(grad)
            self._state.param_snapshot = current
            violations = self._finish_update()
        self._enforce(violations)
        return pre_clip

    def end_step(self) -> None:
        """End the current optimizer step now: compute and publish its update metrics.

        Call it after ``optimizer.step()`` when ``clip_grad_norm_`` is not called through the monitor (the
        framework clips, and you pass ``grad_norm_pre_clip=`` to ``observe_update``), or when rollouts and
        updates overlap (asynchronous pipelines): without it the step ends only at the next update call of
        another step number."""
        self._check_open("end_step")
        violations: list[guard.Violation] = []
        with self._stage("update"):
            violations = self._finish_update()
        self._enforce(violations)

    def observe_retrieval(self, step: int, scores: Tensor, own_prompt: Tensor) -> None:
        """Retrieval accuracy: ``scores`` (N, P) of each completion under each of the batch's P prompts (e.g.
        log-probs from one extra forward pass), ``own_prompt`` (N,) the column of its own prompt. Call every
        K steps; chance level 1/P is published beside it. Rank-local (not merged across ranks)."""
        step = self._check_call("observe_retrieval", step)
        with self._stage("rollout"):
            self._advance(step)
            if scores.dim() != 2 or own_prompt.shape != scores.shape[:1]:
                raise ValueError(
                    f"`scores`/`own_prompt`: expected (N, P) and (N,), got {tuple(scores.shape)} and "
                    f"{tuple(own_prompt.shape)}"
                )
            r = retrieval_accuracy(scores, own_prompt)
            value, present = torch.stack([r.value.double(), r.present.double()]).tolist()
            accuracy = catalog.metric("grpo_retrieval_accuracy_ratio")
            values: dict[str, float] = {catalog.metric("grpo_retrieval_chance_ratio").key(): 1.0 / scores.shape[1]}
            if present:
                values[accuracy.key()] = value
            self._publication.merge(values, [accuracy.name])

    def publish_check(self, report: PreflightReport) -> None:
        """Publish a preflight check's verdict (:mod:`grpo_exporter.checks`) as
        ``grpo_preflight_check_passed{check}`` and ``grpo_preflight_check_cannot_tell{check}``; the last report of
        each check stays published."""
        if not isinstance(report, ABCReport | AccumulationReport | ReachReport | MaskTableReport):
            raise TypeError("publish_check: report: expected a report of grpo_exporter.checks (ABCReport, "
                            f"AccumulationReport, ReachReport, MaskTableReport), got {type(report).__name__}")
        passed, cannot_tell = catalog.metric("grpo_preflight_check_passed"), catalog.metric(
            "grpo_preflight_check_cannot_tell")
        with self._publication.writing:
            self._state.checks[passed.key(check=report.CHECK)] = 1.0 if report.passed else 0.0
            self._state.checks[cannot_tell.key(check=report.CHECK)] = 1.0 if report.cannot_tell else 0.0
            self._publication.merge(dict(self._state.checks), [passed.name, cannot_tell.name])
            self._publication.publish()

    def flush(self) -> None:
        """Compute and publish the pending update step now (:meth:`end_step`)."""
        self.end_step()

    def metrics(self) -> Mapping[str, float]:
        """The published values (sample key -> value, without the run label): what a scrape would see."""
        return self._publication.snapshot()

    def wait_for_workers(self, timeout: float = 10.0) -> None:
        """Block until the off-thread jobs (the edit-distance job, the flight recorder's writes) are done; for
        tests and shutdown."""
        self._edit_worker.wait(timeout)
        if self._recorder is not None:
            self._recorder.wait(timeout)

    def close(self) -> None:
        """Publish what is pending, mark the run finished (``grpo_run_finished`` 1: a normal end pages nothing),
        and stop serving once a scrape has seen it. Idempotent; observe calls after it raise."""
        if self._closed:
            return
        with contextlib.suppress(guard.TrainingSignalError):
            self.end_step()
        if self._recorder is not None:
            with self._contained("recorder", "flight recorder", publish=True):
                self._recorder.close()
        with self._publication.writing:
            self._publish_held_audit()
            self._publication.merge({catalog.key("grpo_run_finished"): 1.0})
            self._publication.publish()
        self._closed = True
        self._edit_worker.shutdown()
        if self._server is not None:
            self._linger()
            self._server.close()
            self._server = None

    def _linger(self) -> None:
        """Serve until one more scrape has seen the finished run (at most ``close_linger_s``; not at all when
        nothing ever scraped this exporter): otherwise Prometheus sees the target vanish and cannot tell a
        normal end from a crash."""
        seen = self._collector.scrapes
        if seen == 0:
            return
        deadline = time.monotonic() + self.config.close_linger_s
        while self._collector.scrapes == seen and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> GRPOMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- step life cycle -------------------------------------------------------------------------------

    def _enforce(self, violations: list[guard.Violation]) -> None:
        """The guard's verdict; before it raises (training is about to stop), the flight recorder writes what
        it holds."""
        if violations and self.config.guard == "raise" and self._recorder is not None:
            with self._contained("recorder", "flight recorder", publish=True):
                self._recorder.flush("the guard raised TrainingSignalError")
        self._report.enforce(violations, self._state.last_step)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise MonitorClosedError(
                f"GRPOMonitor(run={self.config.run!r}).{call}() after close(): the monitor no longer computes "
                "or serves; create a new monitor for a new run"
            )

    def _check_call(self, call: str, step: object) -> int:
        """API misuse raises at once, before anything is computed: a call after close, a step that is no
        integer (a Python int, a numpy or 0-d tensor integer)."""
        self._check_open(call)
        if isinstance(step, bool | float) or (isinstance(step, Tensor) and step.is_floating_point()):
            raise TypeError(f"`step`: expected an integer, got {type(step).__name__} {step!r}")
        try:
            return operator.index(step)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"`step`: expected an integer, got {type(step).__name__} {step!r:.80}") from None

    def _advance(self, step: int) -> None:
        """Record the step number: ``grpo_steps_total`` counts each new largest step once and
        ``grpo_last_step`` never runs backwards (a late update of step k after rollout k+1 is no new step)."""
        if self._state.advance(step):
            self._publication.add({catalog.key("grpo_steps_total"): 1.0})
        self._publication.merge({catalog.key("grpo_last_step"): float(step if self._state.last_step is None
                                                              else self._state.last_step),
                                 catalog.key("grpo_last_step_timestamp_seconds"): time.time()})

    def _finish_update(self) -> list[guard.Violation]:
        """Compute the pending update step, if one is open (every rank opens and ends steps alike)."""
        if not self._stitcher.open:
            return []
        failed, step = self._stitcher.failed, self._stitcher.step
        try:
            inputs = self._stitcher.take()
        except Exception as exc:  # micro-steps that cannot be stitched: the step still merges, as failed
            if self.config.strict:
                raise
            self._report.error("update", exc, "stitching the micro-steps")
            inputs = None  # merged as failed, like a rank whose inputs were rejected
        result = self._compute("update", inputs, {}, failed=failed)
        derived = self._state.after_update(result.metrics)
        if self._recorder is not None and step is not None:
            with self._contained("recorder", "flight recorder"):
                self._recorder.observe("update", step, inputs, result.metrics, spike=derived.spike)
        if derived.increments:
            self._publication.add(derived.increments)
        if derived.gauges:
            self._publication.merge(derived.gauges)
        violations = self._publish(result.metrics, result.families)
        if _AUDIT & result.families:
            self._state.held_audit = None  # the update audited the mask it trains with
        return violations + self._publish_held_audit()

    def _publish_held_audit(self) -> list[guard.Violation]:
        held, self._state.held_audit = self._state.held_audit, None
        return self._publish(held, set()) if held else []

    def _compute(
        self, stage: str, inputs: StepInputs | None, carry: dict[str, Tensor], failed: bool = False
    ) -> StepResult:
        merger = self._reducer.for_stage(stage, self._state.components.names) if self._reducer is not None else None
        if inputs is not None and inputs.empty and self._report.due(f"empty:{stage}"):
            log.info("grpo-exporter: stage %r got an empty batch (N=0 completions): its metrics are skipped for "
                     "this step, not counted as an error (said at most once a minute)", stage)
        result = compute_step_carrying(
            inputs if inputs is not None else StepInputs(), self.config, carry, self.config.strict, merger,
            _STAGE_BLOCKS[stage], failed_inputs=failed or inputs is None,
        )
        for block, exc in result.errors:
            if getattr(exc, "logged", False):  # the reducer said it once, with why merging is off
                self._report.count("distributed")
            elif block == "distributed":
                self._report.error("distributed", exc)
            else:
                where = "input values" if block == "input values" else f"metric block {block!r}"
                self._report.error(stage, exc, where)
        return result

    def _publish(self, metrics: Mapping[str, float], families: Iterable[str]) -> list[guard.Violation]:
        self._publication.merge(metrics, families)
        return self._report.check(metrics)

    def contained(self, stage: str, where: str) -> contextlib.AbstractContextManager[None]:
        """For framework adapters: an exception inside (reading the framework's objects) is counted in
        ``grpo_exporter_errors_total{stage}``, published, and logged naming ``where``, and training goes on;
        strict mode raises. ``stage`` is one of :data:`~grpo_exporter.catalog.STAGES`."""
        return self._contained(stage, where, publish=True)

    # ---- helpers ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _contained(self, stage: str, where: str = "", publish: bool = False) -> Iterator[None]:
        """An exception inside is counted and logged under ``stage`` and the call goes on (strict: raised);
        ``publish``: publish the count now (outside an observe call, which publishes at its end)."""
        try:
            yield
        except guard.TrainingSignalError:
            raise
        except Exception as exc:
            with self._publication.writing:
                self._report.error(stage, exc, where)
                if publish:
                    self._publication.publish()
            if self.config.strict:
                raise

    @contextlib.contextmanager
    def _stage(self, stage: str) -> Iterator[None]:
        """One observe call: contained, timed, and published at the end."""
        start = time.perf_counter()
        with self._publication.writing:
            try:
                with self._contained(stage), torch.inference_mode():
                    yield
            finally:
                self._publication.add(duration_increments(stage, time.perf_counter() - start))
                self._publication.publish()
