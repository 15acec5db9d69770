"""The in-process guard: layer-1 stop criteria checked on every step, with no Prometheus involved.

These are the seed's 0/1 engineering checks (第 6 篇: "前一层不通过，后一层曲线没有解释意义"): when one
fails, every downstream curve is meaningless, so the guard says so inside the training process itself: a
one-line warning naming the layer and the runbook, or :class:`TrainingSignalError` at the end of observe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from grpo_exporter.catalog import parse_key
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
    engine_gap_stop_nats, onpolicy_clip_stop_ratio = lines.engine_gap_stop_nats, lines.onpolicy_clip_stop_ratio
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
    share = metrics.get("grpo_onpolicy_outside_clip_ratio")
    if share is not None and share > onpolicy_clip_stop_ratio:
        found.append(
            Violation(
                "GRPORatioClippedBeforeUpdate",
                f"{share:.2%} of loss tokens are outside the clip range before any update: old and new "
                "log-probs do not come from the same probability path; stop and fix it",
            )
        )
    gap = metrics.get("grpo_engine_logprob_gap_mean_nats")
    if gap is not None and gap >= engine_gap_stop_nats:
        found.append(
            Violation(
                "GRPOEngineLogprobGapCritical",
                f"engine log-prob gap mean {gap:.4g} nats >= {engine_gap_stop_nats:g}: trainer and rollout "
                "engine disagree; stop training",
            )
        )
    return found
