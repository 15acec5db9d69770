"""The two stages of a step, run for the monitor: validate the inputs, compute the step (merged across ranks),
update the run's state, publish, hand rows to the flight recorder and the reading set, and say the guard's verdict.

A rollout is computed at once (:meth:`Stages.rollout`); an update's micro-steps are held by the stitcher
(:meth:`Stages.add_update`, :meth:`Stages.record_grad`) and computed together when the step ends
(:meth:`Stages.finish_update`). Every method runs inside the monitor's observe call (the publication's lock,
contained errors, :meth:`~grpo_exporter.runtime.reporting.Reporter.stage`) and returns the stop criteria the
published values fail, which the monitor enforces at the end of the call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.ids import id_tensor
from grpo_exporter.inputs import InputError, StepInputs, check_count, check_step, describe
from grpo_exporter.ranks import distributed
from grpo_exporter.recorder.flight import FlightRecorder
from grpo_exporter.recorder.reading_set import ReadingSet
from grpo_exporter.runtime import guard
from grpo_exporter.runtime.background import EditDistanceWorker, edit_distance_carry
from grpo_exporter.runtime.compilation import CompiledStages
from grpo_exporter.runtime.evaluations import Evaluation
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.runtime.param_sample import sample_parameters
from grpo_exporter.runtime.reporting import Reporter
from grpo_exporter.runtime.run_state import Prediction, RunState
from grpo_exporter.serving.publication import Publication
from grpo_exporter.step import MASK_AUDIT_FAMILIES, ROLLOUT_BLOCKS, UPDATE_BLOCKS, StepResult, compute_step_carrying
from grpo_exporter.stitching import StepStitcher

log = logging.getLogger("grpo_exporter")

STAGE_BLOCKS = {"rollout": ROLLOUT_BLOCKS, "update": UPDATE_BLOCKS}
# the loss-mask audit of the rollout is published only when the update does not audit its own mask
AUDIT = frozenset(MASK_AUDIT_FAMILIES)
# the rollout tensors whose device the string ids are moved to
_DEVICE_FIELDS = ("rewards", "correct", "truncated", "rollout_logprobs", "old_logprobs", "loss_mask",
                  "completion_lengths", "completion_ids")


def prompt_tokens_for(tokens: Tensor | None, inputs: StepInputs | None) -> Tensor | None:
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


class Stages:
    """The stage computations of one monitor, over the parts it owns (state, publication, reporter, rank
    reducer, stitcher, edit-distance worker, flight recorder, reading set)."""

    def __init__(
        self, config: MonitorConfig, state: RunState, publication: Publication, report: Reporter,
        reducer: distributed.Reducer | None, stitcher: StepStitcher, edit_worker: EditDistanceWorker,
        recorder: FlightRecorder | None, reading: ReadingSet | None = None,
    ) -> None:
        self.config, self.state, self.publication, self.report = config, state, publication, report
        self.reducer, self.stitcher, self.edit_worker, self.recorder = reducer, stitcher, edit_worker, recorder
        self.reading = reading
        if recorder is not None and reading is not None:  # written beside each incident, and in recorder_dir
            recorder.reading, reading.directory = reading.document, recorder.root
        self.compiled = CompiledStages(config, config.compile_step, config.compile_min_positions)
        if config.compile_step != "off":  # the counters exist from the start, at 0, so that rate() sees them
            fallbacks = catalog.metric("grpo_exporter_compiled_fallbacks_total")
            zeros: dict[str, float] = {fallbacks.key(reason=reason): 0.0 for reason in catalog.COMPILE_FALLBACKS}
            zeros[catalog.metric("grpo_exporter_compiled_stage_calls_total").key()] = 0.0
            self.publication.add(zeros)

    # ---- the rollout -----------------------------------------------------------------------------------

    def rollout(self, step: int, fields: dict[str, Any], prompt_ids: Any, prompt_tokens: Tensor | None,
                dropped_stale_total: int | None = None) -> list[guard.Violation]:
        """One rollout batch: ``fields`` are observe_rollout's StepInputs keywords (ids as given)."""
        violations = self.publish_held_audit()  # the last step had no update to audit its mask
        if dropped_stale_total is not None:
            with self.report.contained("rollout"):
                check_count("dropped_stale_total", dropped_stale_total, "the loop's running total")
                self.publication.add(self.state.dropped_stale(dropped_stale_total).increments)
        inputs: StepInputs | None = None
        prediction, carry = Prediction(), dict[str, Tensor]()
        with self.report.contained("rollout"):
            device = next((t.device for t in (fields.get(k) for k in _DEVICE_FIELDS) if isinstance(t, Tensor)), None)
            fields["group_ids"] = id_tensor("group_ids", fields.get("group_ids"), device)
            prompt_ids = id_tensor("prompt_ids", prompt_ids, device)
            fields["reward_components"], dropped = self.state.components.admit(fields.get("reward_components"))
            if dropped:
                self.publication.add({catalog.key("grpo_dropped_reward_components_total"): float(dropped)})
            inputs = StepInputs(**fields)
            inputs, prediction, carry = self.state.predict_zero_variance(inputs, prompt_ids)
            carry |= edit_distance_carry(inputs, self.config.edit_distance_groups, self.config.group_size)
        result = self.compute("rollout", inputs, carry)
        if inputs is not None:
            with self.report.contained("rollout", "solve-rate update"):
                self.state.learn_solve_rates(prediction, inputs, result.carried)
            if inputs.completion_ids is not None:
                self.edit_worker.submit(result.carried, inputs.completion_ids.shape[1])
        violations += self._publish_rollout(result)
        if self.recorder is None and self.reading is None:
            return violations
        tokens = None
        if self.recorder is not None or self.config.reading_text:  # read for their text only
            with self.report.contained("recorder" if self.recorder else "reading",
                                       "prompt_tokens (the rows are kept without)"):
                tokens = prompt_tokens_for(prompt_tokens, inputs)
        extra = {"prompt_ids": prompt_ids, "prompt_tokens": tokens}
        if self.recorder is not None:
            with self.report.contained("recorder", "flight recorder"):
                self.recorder.observe("rollout", step, inputs, result.metrics, extra)
        if self.reading is not None:
            with self.report.contained("reading", "reading set"):
                self.reading.observe(step, inputs, result.metrics, extra)
        return violations

    def _publish_rollout(self, result: StepResult) -> list[guard.Violation]:
        """The rollout's readings and what the run's state derives from them; its mask audit is held until an
        update audits the mask it trains with (published at the next step otherwise)."""
        audit = {k: v for k, v in result.metrics.items()
                 if catalog.sample_key(k).family.name in AUDIT}
        self.state.held_audit = audit or None
        metrics = {k: v for k, v in result.metrics.items() if k not in audit}
        metrics |= self.state.after_rollout(metrics).gauges
        return self.publish(metrics, result.families - AUDIT)

    # ---- the update ------------------------------------------------------------------------------------

    def add_update(self, step: int, fields: dict[str, Any]) -> list[guard.Violation]:
        """One update micro-step, held for its step (a micro-step of a new step ends the one before)."""
        violations = self.finish_update() if self.stitcher.begin(step) else []
        self.stitcher.mark(step)
        with self.report.contained("update"):
            try:
                inputs = StepInputs(**fields)
            except Exception:
                self.stitcher.failed = True
                raise
            if not self.stitcher.add(step, inputs):
                self.publication.add({catalog.key("grpo_dropped_micro_steps_total"): 1.0})
                if self.report.due("dropped-micro-steps"):
                    log.warning(
                        "grpo-exporter: more than %d micro-steps in step %d; further ones are dropped and counted "
                        "(grpo_dropped_micro_steps_total). Call clip_grad_norm_() or end_step() once per optimizer "
                        "step.", self.config.max_pending_micro_steps, step,
                    )
        return violations

    def record_grad(self, params: list[Tensor], pre_clip: Tensor, max_norm: float) -> list[guard.Violation]:
        """The clip's norms and the parameter sample (the update the last step made); ends the step."""
        current = sample_parameters(params)
        grad: dict[str, Any] = {"grad_norm_pre_clip": pre_clip.detach(), "max_grad_norm": float(max_norm)}
        before = self.state.param_snapshot
        if before is not None and [t.shape for t in before] == [t.shape for t in current]:
            # taken at the previous clip, before that step's optimizer.step(): the update it made
            grad |= {"params_before": before, "params_after": current}
        self.stitcher.record_grad(grad)
        self.state.param_snapshot = current
        return self.finish_update()

    def finish_update(self) -> list[guard.Violation]:
        """Compute the pending update step, if one is open (every rank opens and ends steps alike)."""
        if not self.stitcher.open:
            return []
        failed, step = self.stitcher.failed, self.stitcher.step
        try:
            inputs = self.stitcher.take()
        except Exception as exc:  # micro-steps that cannot be stitched: the step still merges, as failed
            if self.config.strict:
                raise
            self.report.error("update", exc, "stitching the micro-steps")
            inputs = None  # merged as failed, like a rank whose inputs were rejected
        result = self.compute("update", inputs, {}, failed=failed)
        for form in self.state.unexpected_forms(result.metrics):
            log.warning("grpo_exporter: run %s: the advantages follow the form %r, not the configured "
                        "advantage_norm=%r: the |A| bound follows the data (GRPOAdvantageFormUnexpected, info); "
                        "set advantage_norm to your estimator's form (docs/runbooks.md#grpoadvantageformunexpected)",
                        self.config.run, form, self.config.advantage_norm)
        derived = self.state.after_update(result.metrics, step)
        if self.recorder is not None and step is not None:
            with self.report.contained("recorder", "flight recorder"):
                self.recorder.observe("update", step, inputs, result.metrics, spike=derived.spike)
        if derived.increments:
            self.publication.add(derived.increments)
        if derived.gauges:
            self.publication.merge(derived.gauges)
        violations = self.publish(result.metrics, result.families)
        if AUDIT & result.families:
            self.state.held_audit = None  # the update audited the mask it trains with
        return violations + self.publish_held_audit()

    # ---- both, and the monitor's other readings -----------------------------------------------------

    def advance(self, step: int) -> None:
        """Record the step number: ``grpo_steps_total`` counts each new largest step once and
        ``grpo_last_step`` never runs backwards (a late update of step k after rollout k+1 is no new step). A
        step outside 0..2^53-1 is an input error of the call (counted; nothing of it is computed) and leaves the
        run's state as it was."""
        check_step(step)
        if self.state.advance(step):
            self.publication.add({catalog.key("grpo_steps_total"): 1.0})
        last = float(step if self.state.last_step is None else self.state.last_step)
        self.publication.merge({catalog.key("grpo_last_step"): last,
                                catalog.key("grpo_last_step_timestamp_seconds"): time.time()})

    def evaluation(self, evaluation: Evaluation) -> None:
        """An evaluation beside training (:mod:`~grpo_exporter.runtime.evaluations`), published as it came."""
        if evaluation.increments:
            self.publication.add(evaluation.increments)
        self.publication.merge(evaluation.gauges, evaluation.families)

    def check(self, name: str, passed: bool, cannot_tell: bool) -> None:
        """A preflight check's verdict; every check's last verdict stays published."""
        passed_f, unknown_f = catalog.metric("grpo_preflight_check_passed"), catalog.metric(
            "grpo_preflight_check_cannot_tell")
        self.state.checks[passed_f.key(check=name)] = 1.0 if passed else 0.0
        self.state.checks[unknown_f.key(check=name)] = 1.0 if cannot_tell else 0.0
        self.publication.merge(dict(self.state.checks), [passed_f.name, unknown_f.name])

    def publish_held_audit(self) -> list[guard.Violation]:
        held, self.state.held_audit = self.state.held_audit, None
        return self.publish(held, set()) if held else []

    def _count_compiled(self) -> None:
        """Add the compiled stage calls and fallbacks counted since the last step to the published counters."""
        if self.compiled.mode == "off":
            return
        compiled, fallbacks = self.compiled.unpublished()
        increments: dict[str, float] = {
            catalog.metric("grpo_exporter_compiled_fallbacks_total").key(reason=reason): float(n)
            for reason, n in fallbacks.items()
        }
        if compiled:
            increments[catalog.metric("grpo_exporter_compiled_stage_calls_total").key()] = float(compiled)
        if increments:
            self.publication.add(increments)

    def compute(self, stage: str, inputs: StepInputs | None, carry: dict[str, Tensor], failed: bool = False
                ) -> StepResult:
        """The stage's step on this rank, merged across ranks (every rank merges once, whatever failed on it);
        errors counted and logged (strict: the first raised)."""
        merger = self.reducer.for_stage(stage, self.state.components.names) if self.reducer is not None else None
        if inputs is not None and inputs.empty and self.report.due(f"empty:{stage}"):
            log.info("grpo-exporter: stage %r got an empty batch (N=0 completions): its metrics are skipped for "
                     "this step, not counted as an error (said at most once a minute)", stage)
        result = None
        if inputs is not None:
            result = self.compiled.compute(STAGE_BLOCKS[stage], inputs, carry, failed, merger)
            self._count_compiled()
        if result is None:
            result = compute_step_carrying(
                inputs if inputs is not None else StepInputs(), self.config, carry, self.config.strict, merger,
                STAGE_BLOCKS[stage], failed_inputs=failed or inputs is None,
            )
        if merger is not None:
            result = merger.apply(result)
            if self.config.strict and result.errors:
                raise result.errors[0][1]
        for block, exc in result.errors:
            if getattr(exc, "logged", False):  # the reducer said it once, with why merging is off
                self.report.count("distributed")
            elif block == "distributed":
                self.report.error("distributed", exc)
            else:
                where = "input values" if block == "input values" else f"metric block {block!r}"
                self.report.error(stage, exc, where)
        return result

    def publish(self, metrics: Mapping[str, float], families: Iterable[str]) -> list[guard.Violation]:
        self.publication.merge(metrics, families)
        return self.report.check(metrics)

    def stop_workers(self) -> None:
        """End the off-thread parts (compiler, edit-distance worker, flight recorder, reading set), waiting a
        bounded time."""
        self.compiled.close()
        self.edit_worker.shutdown()
        self.close_readers()

    def close_readers(self) -> None:
        """Write what the reading set and the flight recorder hold (the reading set first: an incident written at
        close carries it), then end their threads."""
        if self.reading is not None:
            with self.report.contained("reading", "reading set", publish=True):
                self.reading.close()
        if self.recorder is not None:
            with self.report.contained("recorder", "flight recorder", publish=True):
                self.recorder.close()

    def enforce(self, violations: list[guard.Violation]) -> None:
        """The guard's verdict; before it raises (training is about to stop), the flight recorder writes what
        it holds."""
        if violations and self.config.guard == "raise" and self.recorder is not None:
            with self.report.contained("recorder", "flight recorder", publish=True):
                self.recorder.flush("the guard raised TrainingSignalError")
        self.report.enforce(violations, self.state.last_step)


