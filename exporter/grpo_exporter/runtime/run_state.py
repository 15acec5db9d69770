"""The state one run keeps between steps, declared in one place, and what it derives from each step's readings.

The step (:mod:`grpo_exporter.step`) is pure: inputs in, readings out. Whatever needs the run's history lives
here and is updated by the runtime (:class:`~grpo_exporter.runtime.monitor.GRPOMonitor`) after each step's one
transfer: the prompts' solve rates (the zero-variance prediction), the reward components admitted so far, the
grad-norm spike detector, the frozen early-window means (the clean engine gap, the on-policy noise), the last
step number, the mask audit held until an update audits its own mask, the parameter snapshot of the last clip
and the published preflight verdicts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.functional.groups import Groups
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.runtime.anchors import FrozenMean
from grpo_exporter.runtime.components import ComponentNames
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.runtime.solve_rates import SolveRates
from grpo_exporter.runtime.spikes import Evidence, GradNormSpikes
from grpo_exporter.step import host_values

log = logging.getLogger("grpo_exporter")

SOLVE_TERMS = "solve_rate_terms"  # the rollout's solve-rate moment terms, carried to the host with its transfer



def engine_gap_notice(run: str, clean: float, stop: float, rollouts: int, runbook_url: str) -> str:
    """The one notice of a run whose own clean engine gap sits above the seed's stop line."""
    return (
        f"grpo-exporter notice [layer 1-gradient] run={run}: the clean engine log-prob gap of the first {rollouts} "
        f"rollouts is {clean:.4g} nats, above the stop line {stop:g}. A bf16/fp16 engine beside its trainer "
        "is often here (0.010-0.018 on healthy bf16 stacks); confirm it once with the A/B/C preflight "
        "(grpo_exporter.checks.abc_consistency: the trainer twice and the engine once on frozen weights). If it "
        "holds, record the accepted level, e.g. "
        f"reference_baseline={{'grpo_engine_logprob_gap_mean_nats': {clean:.4g}}} "
        "(a keyword, a YAML file, or GRPO_EXPORTER_REFERENCE_BASELINE), so later runs start from it. The run is "
        "judged against this level meanwhile: a jump or a systematic gap pages; this notice does not repeat. "
        f"runbook: {runbook_url}#grpoenginelogprobgapcleanlevelhigh"
    )


@dataclass
class Prediction:
    """What a rollout's zero-variance prediction used: the prompts' solve-rate slots and the groups (the update
    of the solve rates reads the same groups, never a second grouping)."""

    slots: Tensor | None = None
    groups: Groups | None = None


@dataclass
class Derived:
    """What a step's readings add to the publication through the run's state: gauges (replaced) and counter
    increments (added); ``spike``: the step confirmed a grad-norm spike (the flight recorder's trigger)."""

    gauges: dict[str, float] = field(default_factory=dict)
    increments: dict[str, float] = field(default_factory=dict)
    spike: bool = False


class RunState:
    """Everything a run remembers between steps (see the module docstring)."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.solve_rates = SolveRates(config.solve_rate_slots, config.solve_rate_prior, config.solve_rate_halflife)
        self.components = ComponentNames(config.max_reward_components)
        self.spikes = GradNormSpikes(config)
        self.clean_gap = FrozenMean(config.gap_baseline_steps)
        self.onpolicy_noise = FrozenMean(config.anchor_steps)
        self.last_step: int | None = None
        self.held_audit: dict[str, float] | None = None
        self.param_snapshot: list[Tensor] | None = None
        self.checks: dict[str, float] = {}
        self.dropped_stale_total: int | None = None  # the loop's own running total, as last seen
        self.forms_said: set[str] = set()  # the advantage forms against the configured one, each said once

    def unexpected_forms(self, metrics: Mapping[str, float]) -> list[str]:
        """The known advantage forms other than the configured ``advantage_norm`` that this step's advantages
        follow (``grpo_advantage_form_sequences_total``), each returned once per run: the log line beside
        GRPOAdvantageFormUnexpected."""
        family = catalog.metric("grpo_advantage_form_sequences_total")
        found = [form for form in catalog.ADVANTAGE_FORMS
                 if form != self.config.advantage_norm and form not in self.forms_said
                 and metrics.get(family.key(form=form), 0.0) > 0]
        self.forms_said.update(found)
        return found

    def dropped_stale(self, total: int) -> Derived:
        """The completions dropped as stale since the last rollout, from the loop's running ``total`` (a total
        below the last one is a restarted loop: all of it is new)."""
        last, self.dropped_stale_total = self.dropped_stale_total, total
        new = total if last is None or total < last else total - last
        return Derived(increments={catalog.key("grpo_dropped_stale_completions_total"): float(new)})

    def advance(self, step: int) -> bool:
        """Record the step number; whether it is a new largest one (``grpo_steps_total`` counts those once and
        ``grpo_last_step`` never runs backwards: a late update of step k after rollout k+1 is no new step)."""
        if self.last_step is None or step > self.last_step:
            self.last_step = step
            return True
        return False

    def predict_zero_variance(
        self, inputs: StepInputs, prompt_ids: Tensor | None
    ) -> tuple[StepInputs, Prediction, dict[str, Tensor]]:
        """The rollout's inputs with each sample's predicted zero-variance and all-incorrect chance of its group
        (from its prompt's solve-rate history: E[p^G + (1-p)^G]), what the prediction used, and the device
        vectors to carry in the step's transfer (the batch's solve-rate moment terms)."""
        slots = self.solve_rates.slots_of(inputs, prompt_ids)
        if slots is None:
            return inputs, Prediction(), {}
        groups = None
        with contextlib.suppress(InputError):  # a grouping error is the metric blocks' to count and log
            groups = inputs.groups(self.config.group_size)
        outcomes = inputs.correct
        if groups is None or outcomes is None:
            return inputs, Prediction(slots, groups), {}
        extremes = self.solve_rates.predict(slots, groups)
        inputs = inputs.replaced(zero_variance_prob=extremes.sum(dim=0).clamp_(0.0, 1.0),
                                 all_incorrect_prob=extremes[1])
        return inputs, Prediction(slots, groups), {SOLVE_TERMS: SolveRates.moment_terms(outcomes, groups)}

    def learn_solve_rates(self, prediction: Prediction, inputs: StepInputs, carried: Mapping[str, Tensor]) -> None:
        """Update the prompts' solve rates with the rollout's outcomes, on the groups the prediction used."""
        if prediction.slots is None or prediction.groups is None or inputs.correct is None:
            return
        terms = carried.get(SOLVE_TERMS)
        moments = None if terms is None else host_values(terms)
        self.solve_rates.update(prediction.slots, inputs.correct, prediction.groups, moments)

    def after_rollout(self, metrics: Mapping[str, float]) -> Derived:
        """The run's clean engine gap (frozen after ``gap_baseline_steps`` rollouts) and the accepted level the
        gap is judged against: the reference run's gap when configured, else the clean gap. When the clean gap
        freezes above the seed's stop line with no accepted level configured, one notice says so (a bf16/fp16
        engine's noise can sit there; the A/B/C preflight confirms it, and the reference records it)."""
        out = Derived()
        gap = metrics.get(catalog.key("grpo_engine_logprob_gap_mean_nats"))
        if gap is None:
            return out
        was_frozen = self.clean_gap.value is not None
        clean = self.clean_gap.observe(gap)
        if clean is not None:
            out.gauges[catalog.key("grpo_engine_logprob_gap_clean_baseline_nats")] = clean
        reference = self.config.reference_baseline.get("grpo_engine_logprob_gap_mean_nats")
        accepted = reference if reference is not None else clean
        if accepted is not None:
            out.gauges[catalog.key("grpo_engine_logprob_gap_accepted_nats")] = accepted
        if clean is not None and not was_frozen and reference is None and clean >= self.config.engine_gap_stop_nats:
            log.warning(engine_gap_notice(self.config.run, clean, self.config.engine_gap_stop_nats,
                                          self.config.gap_baseline_steps, self.config.runbook_url))
        return out

    def after_update(self, metrics: Mapping[str, float], step: int | None = None) -> Derived:
        """A grad-norm spike (against the run's recent norms, judged with the step's share of tokens that carry
        signal) and its confirmation, the on-policy noise frozen over the run's first steps, and a stale update
        (rollouts more than ``staleness_max_versions`` policy versions old)."""
        out = Derived()
        norm = metrics.get(catalog.key("grpo_grad_norm_pre_clip"))
        zero_share = metrics.get(catalog.key("grpo_zero_advantage_tokens_ratio"))
        reading = self.spikes.observe(norm, None if zero_share is None else 1.0 - zero_share, Evidence.of(metrics),
                                      step)
        out.spike = reading.confirmed
        if reading.spike:
            out.increments[catalog.key("grpo_grad_norm_spike_steps_total")] = 1.0
        if reading.update_jump:
            out.increments[catalog.key("grpo_param_update_jump_steps_total")] = 1.0
        if reading.confirmed:
            out.increments[catalog.key("grpo_grad_norm_spike_confirmed_steps_total")] = 1.0
            log.warning("grpo_exporter: run %s: a grad-norm spike confirmed by %s (GRPOGradNormSpike; pre-clip norm "
                        "%s)", self.config.run, reading.evidence, norm)
        on_policy = metrics.get(catalog.key("grpo_onpolicy_log_ratio_abs_max_nats"))
        noise = self.onpolicy_noise.observe(on_policy) if on_policy is not None else None
        if noise is not None:
            out.gauges[catalog.key("grpo_onpolicy_log_ratio_clean_baseline_nats")] = noise
        staleness = metrics.get(catalog.key("grpo_rollout_staleness_versions"))
        if staleness is not None and staleness > self.config.staleness_max_versions:
            out.increments[catalog.key("grpo_stale_update_steps_total")] = 1.0
        return out
