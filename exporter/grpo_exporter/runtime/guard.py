"""The in-process guard: layer-1 stop criteria checked on every step, with no Prometheus involved.

These are the seed's 0/1 engineering checks (第 6 篇 (crash triage): "前一层不通过，后一层曲线没有解释意义"): when one
fails, every downstream curve is meaningless, so the guard says so inside the training process itself: a
one-line warning naming the layer and the runbook, or :class:`TrainingSignalError` at the end of observe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from grpo_exporter.catalog import metric, parse_key
from grpo_exporter.thresholds import StopLines


@dataclass(frozen=True)
class Violation:
    """One failed criterion: the alert it corresponds to, and a one-line explanation."""

    alert: str
    message: str

    def line(self, run: str, step: int | None, runbook_url: str) -> str:
        return (
            f"grpo-exporter guard [layer 1-gradient] run={run} step={step}: {self.message}; "
            f"runbook: {runbook_url}#{self.alert.lower()}"
        )


class TrainingSignalError(RuntimeError):
    """A layer-1 stop criterion failed and the guard is configured to raise."""

    def __init__(self, violations: list[Violation], lines: list[str]) -> None:
        self.violations = violations
        super().__init__("\n".join(lines))


def check(metrics: Mapping[str, float], lines: StopLines) -> list[Violation]:
    """The layer-1 criteria this step's metrics fail, at the lines the alerts use too."""
    onpolicy_clip_stop_ratio = lines.onpolicy_clip_stop_ratio
    found: list[Violation] = []
    bad = {k: v for k, v in metrics.items() if parse_key(k)[0] == "grpo_nonfinite_values_total" and v > 0}
    if bad:
        what = ", ".join(f"{parse_key(k)[1]['tensor']}: {v:g}" for k, v in sorted(bad.items()))
        found.append(Violation("GRPONonFiniteValues", f"non-finite values on loss tokens ({what})"))
    mismatch = metrics.get("grpo_loss_mask_length_mismatch_sequences_total", 0.0)
    outside = metrics.get("grpo_loss_mask_outside_completion_tokens_total", 0.0)
    if mismatch or outside:
        found.append(
            Violation(
                "GRPOLossMaskMismatch",
                f"loss mask disagrees with the completions ({mismatch:g} sequences with the wrong token count, "
                f"{outside:g} loss tokens outside completions)",
            )
        )
    on_tool = metrics.get("grpo_loss_mask_tool_tokens_total", 0.0)
    if on_tool:
        found.append(Violation("GRPOLossOnToolTokens", f"{on_tool:g} loss tokens on tool output (tool_mask)"))
    share = metrics.get("grpo_onpolicy_outside_clip_ratio")
    if share is not None and share > onpolicy_clip_stop_ratio:
        found.append(
            Violation(
                "GRPORatioClippedBeforeUpdate",
                f"{share:.2%} of loss tokens are outside the clip range before any update: old and new "
                "log-probs do not come from the same probability path; stop and fix it",
            )
        )
    engine = engine_verdict(metrics, lines)
    if engine is not None:
        found.append(Violation("GRPOEngineLogprobGapCritical", engine))
    return found


_K1 = metric("grpo_mismatch_kl_nats").key(estimator="k1")
_K3 = metric("grpo_mismatch_kl_nats").key(estimator="k3")


def engine_verdict(metrics: Mapping[str, float], lines: StopLines) -> str | None:
    """Why this rollout's engine gap stops training, or None: the judgement GRPOEngineLogprobGapCritical makes
    over a window, on one step.

    Noise or fault (seed 第 3 篇 (signal health): the 0.01 line is where you stop and check, after measuring your own
    clean baseline). A bf16 engine's gap is zero-mean noise and never stops a run at any level; what stops it:

    * systematic: the mismatch KL (|k1|, the mean *signed* gap, or k3, its lower-variance non-negative estimator)
      >= ``mismatch_kl_stop_nats``, from the first step, with no baseline (top-p renormalised log-probs, a
      temperature the trainer does not apply, wrong weights);
    * a jump: the mean gap at or above the stop line and ``engine_gap_jump_factor`` x the accepted level
      (``grpo_engine_logprob_gap_accepted_nats``: the reference run's, else the run's clean gap), as stale
      weights after a sync leave it.
    """
    kl = {name: v for name, v in (("k1 (the mean signed gap)", metrics.get(_K1)), ("k3", metrics.get(_K3)))
          if v is not None}
    if kl and max(abs(v) for v in kl.values()) >= lines.mismatch_kl_stop_nats:
        read = ", ".join(f"{name} {v:.4g} nats" for name, v in kl.items())
        return (f"engine log-prob gap is systematic: mismatch KL {read}, at or above {lines.mismatch_kl_stop_nats:g} "
                "(noise averages out; top-p/top-k renormalised log-probs, a temperature the trainer does not apply or "
                "other weights do not); stop training")
    gap = metrics.get("grpo_engine_logprob_gap_mean_nats")
    accepted = metrics.get("grpo_engine_logprob_gap_accepted_nats")
    if gap is not None and accepted is not None and gap >= lines.engine_gap_stop_nats and (
        gap >= lines.engine_gap_jump_factor * accepted
    ):
        return (f"engine log-prob gap mean {gap:.4g} nats jumped to >= {lines.engine_gap_jump_factor:g}x the "
                f"accepted level {accepted:.3g} (and >= the stop line {lines.engine_gap_stop_nats:g}): stale or "
                "partially synced engine weights; stop training")
    return None
