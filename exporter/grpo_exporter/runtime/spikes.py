"""Grad-norm spikes, judged per optimizer step in the process. A scrape every 30 s sees one step in many and a
step of minutes empties a rate window, so the event is counted where every step is seen; the alert pages on the
counter's increase.

The seed's terms: "危险信号：突然出现 10 倍以上的尖刺" (the danger sign is a sudden spike of 10x or more, 第 3 篇 4.2),
and "预警看 ESS ratio，确认看 grad norm" (ESS warns, the grad norm confirms, 第 3 篇 5.1): a spike is the moment a
concentration of risk has produced a violent update. A healthy loop's heavy-tailed norm is not that event: the
first epoch on a rollout carries the signal and the later ones (the ratio clipped) little, a solved task swings
between one mixed group and several, and the norm swings past 10x its median without anything else moving. So:

- **spike** (recorded: ``grpo_grad_norm_spike_steps_total``): the norm is above ``grad_spike_factor`` times the
  median of the previous non-zero norms *and* sudden for this run's own distribution of norms: above
  ``grad_spike_tail_factor`` times their 90th percentile (the norm one step in ten already reaches), so a loop
  whose healthy norms swing by 10x spikes only beyond its own swing;
- **confirmed** (paged: ``grpo_grad_norm_spike_confirmed_steps_total``, GRPOGradNormSpike, the flight recorder's
  trigger): the spike's training step (its later epochs too) or one of the next ``grad_spike_confirm_steps``
  also shows what a real instability moves with it, each beyond anything the run's last
  ``grad_spike_window_steps`` optimizer steps showed: a non-finite value, the log-ratio fuse hit, the token ESS
  ratio below ``grad_spike_ess_factor`` of its smallest, |Δθ|/|θ| above ``grad_spike_update_factor`` times its
  largest (the violent update), or a spike on another rollout (a gradient scaled from some step on); or the
  spike is above ``grad_spike_extreme_factor`` times the median, which nothing healthy reaches. The clipped
  share is no evidence: with several epochs per rollout it swings between 0 (the first) and a third (the last)
  on every healthy rollout.

The jump of |Δθ|/|θ| is also an event of its own (``grpo_param_update_jump_steps_total``, GRPOParamUpdateJump): a
learning rate multiplied moves the weights violently under Adam with a norm that stays normal (the field notes'
shape "grad norm 正常但参数 delta 异常": the optimizer state, the loss scale, a sharded update, the schedule).

The judged quantity is the norm per share of loss tokens that carry signal (non-zero advantage). In a token-level
loss the zero-advantage tokens sit in the denominator and scale the gradient down like a smaller batch (seed
第 3 篇 (signal health), gradient dilution): a step with ten times the signal is no crash.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from grpo_exporter import catalog
from grpo_exporter.thresholds import EventLines

TAIL_QUANTILE = 0.9  # a spike is beyond grad_spike_tail_factor times the norm one step in ten reaches

_NONFINITE = catalog.metric("grpo_nonfinite_values_total").name
_CLAMP = catalog.key("grpo_log_ratio_clamp_hit_tokens_total")
_ESS = catalog.metric("grpo_ess_ratio").key(level="token")
_UPDATE = catalog.key("grpo_param_relative_update")


@dataclass(frozen=True)
class Evidence:
    """What one optimizer step's metrics show of an instability, beside its norm."""

    nonfinite: bool = False  # a NaN/Inf among the step's tensors
    fuse: bool = False  # the log-ratio clamp was hit
    ess: float | None = None  # token ESS ratio
    update: float | None = None  # |Δθ|/|θ| of the optimizer step before this one

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> Evidence:
        return cls(
            nonfinite=any(getattr(k, "sample", k) == _NONFINITE and v > 0 for k, v in metrics.items()),
            fuse=metrics.get(_CLAMP, 0.0) > 0,
            ess=metrics.get(_ESS),
            update=metrics.get(_UPDATE),
        )


@dataclass(frozen=True)
class Reading:
    """One optimizer step's verdict: ``spike`` (sudden for the run, recorded), ``confirmed`` (paged: this step
    confirms a spike of this step or of the last ``grad_spike_confirm_steps``) and ``evidence`` (what confirmed
    it: nonfinite, fuse, ess, update, repeat or extreme); ``update_jump``: the step's |Δθ|/|θ| jumped (a violent
    update whatever the norm did: the field notes' "grad norm normal but parameter delta abnormal")."""

    spike: bool = False
    confirmed: bool = False
    evidence: str = ""
    update_jump: bool = False  # |Δθ|/|θ| above grad_spike_update_factor x its window maximum, spike or not


class _Rolling:
    """The last ``size`` values of one reading, judged on once ``minimum`` were seen."""

    def __init__(self, size: int, minimum: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.minimum = minimum

    @property
    def ready(self) -> bool:
        return len(self.values) >= self.minimum

    def add(self, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.values.append(value)


class GradNormSpikes:
    """The run's previous non-zero pre-clip norms and the readings a spike is confirmed with."""

    def __init__(self, lines: EventLines) -> None:
        self.lines = lines
        size, minimum = lines.grad_spike_window_steps, lines.grad_spike_min_steps
        self.norms, self.ess, self.update = _Rolling(size, minimum), _Rolling(size, minimum), _Rolling(size, minimum)
        self.pending: int | None = None  # the training step of the last unconfirmed spike
        self.calls = 0  # optimizer steps seen: the step of a call that names none

    def observe(self, norm: float | None, signal_share: float | None, evidence: Evidence,
                step: int | None = None) -> Reading:
        """Judge one optimizer step of training step ``step`` (None: each call its own step): ``norm`` its
        pre-clip norm (None: not given), ``signal_share`` the share of its loss tokens with non-zero advantage
        (None: unknown), ``evidence`` its other readings; then remember them. A zero norm or a step without
        signal (a solved task) is not judged as a spike; a non-finite norm is counted elsewhere
        (grpo_nonfinite_values_total{tensor="grad_norm"}) and is evidence here.

        A spike waits for its evidence over the rest of its step (the later epochs on the same rollout) and the
        next ``grad_spike_confirm_steps`` steps. A second spike confirms it only from another step: the epochs
        of one rollout share its batch, and a spike on one fixed batch is the notes' other shape (an outlier
        reward or sequence: replay the batch), no instability."""
        self.calls += 1
        step = self.calls if step is None else step
        if self.pending is not None and step > self.pending + self.lines.grad_spike_confirm_steps:
            self.pending = None
        unstable = self._instability(evidence)
        jump = self._update_jump(evidence.update)
        unstable = unstable or ("update" if jump else "")
        spike, extreme = self._spike(judged := _judged(norm, signal_share))
        repeat = "repeat" if spike and self.pending is not None and step != self.pending else ""
        confirmed_by = ("extreme" if extreme else unstable or repeat) if spike else \
            (unstable if self.pending is not None else "")
        if confirmed_by:
            self.pending = None
        elif spike and self.pending is None:
            self.pending = step
        reading = Reading(spike, bool(confirmed_by), confirmed_by, jump)
        self.norms.add(judged)
        self.ess.add(evidence.ess)
        self.update.add(None if evidence.update is None or evidence.update <= 0 else evidence.update)
        return reading

    def _spike(self, norm: float | None) -> tuple[bool, bool]:
        """(a spike, beyond the extreme line) of a judged norm against the previous ones."""
        if norm is None or not self.norms.ready:
            return False, False
        ordered = sorted(self.norms.values)
        median = statistics.median(ordered)
        tail = ordered[min(len(ordered) - 1, int(TAIL_QUANTILE * len(ordered)))]
        lines = self.lines
        spike = norm > lines.grad_spike_factor * median and norm > lines.grad_spike_tail_factor * tail
        return spike, spike and norm > lines.grad_spike_extreme_factor * median

    def _instability(self, e: Evidence) -> str:
        """The first reading of ``e`` that a real instability moves, beyond the run's recent extremes, or ''."""
        lines = self.lines
        if e.nonfinite:
            return "nonfinite"
        if e.fuse:
            return "fuse"
        if e.ess is not None and self.ess.ready and e.ess < lines.grad_spike_ess_factor * min(self.ess.values):
            return "ess"
        return ""

    def _update_jump(self, update: float | None) -> bool:
        """|Δθ|/|θ| above grad_spike_update_factor times its largest over the window (healthy updates change by
        less from one optimizer step to the next: a learning-rate warm-up by (k+1)/k)."""
        return (update is not None and self.update.ready
                and update > self.lines.grad_spike_update_factor * max(self.update.values))


def _judged(norm: float | None, signal_share: float | None) -> float | None:
    """The norm per signal share, or None for a step that is not judged (no norm, no signal, zero, non-finite)."""
    if norm is None:
        return None
    if signal_share is not None:
        if not signal_share > 0.0:
            return None
        norm = norm / min(signal_share, 1.0)
    if not math.isfinite(norm) or norm <= 0.0:
        return None
    return norm


__all__ = ["Evidence", "GradNormSpikes", "Reading"]
