"""What makes a step anomalous for the flight recorder: the guard's layer-1 stop criteria at the same lines,
plus the per-step events the exporter counts in process (seed 第 6 篇 (crash triage) 三态保存: lock the first
anomalous step).

The triggers read the step's host metrics only, so judging a step costs nothing on the device.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from grpo_exporter import catalog
from grpo_exporter.runtime import guard
from grpo_exporter.thresholds import StopLines

TRIGGERS = (
    "nonfinite",  # a NaN/Inf on a loss token, a reward, an advantage, the loss or the grad norm
    "mask_mismatch",  # the loss mask disagrees with the completions
    "engine_gap",  # mean engine log-prob gap at or above the stop line (seed: >= 0.01 nats)
    "clipped_before_update",  # ratio outside the clip range on an on-policy update (seed: stop)
    "grad_norm_spike",  # a sudden pre-clip grad-norm spike (seed: 10x), confirmed (runtime.spikes): no lone one
    "advantage_bound",  # |A| above (G-1)/sqrt(G) (seed: the group normalisation's bound)
)

# the families whose presence in a step's metrics means the step judged the trigger: a step that did not (an
# update-only step of num_iterations > 1 has no engine gap) neither fires it nor clears it
JUDGED_BY = {
    "nonfinite": ("grpo_nonfinite_values_total",),
    "mask_mismatch": (
        "grpo_loss_mask_length_mismatch_sequences_total", "grpo_loss_mask_outside_completion_tokens_total",
        "grpo_loss_mask_tool_tokens_total",
    ),
    "engine_gap": ("grpo_engine_logprob_gap_mean_nats",),
    "clipped_before_update": ("grpo_onpolicy_outside_clip_ratio",),
    "grad_norm_spike": ("grpo_grad_norm_pre_clip",),
    "advantage_bound": ("grpo_advantage_over_bound_sequences_total",),
}

_BY_ALERT = {
    "GRPONonFiniteValues": "nonfinite",
    "GRPOLossMaskMismatch": "mask_mismatch",
    "GRPOLossOnToolTokens": "mask_mismatch",  # the same trigger: the loss mask covers what it should not
    "GRPOEngineLogprobGapCritical": "engine_gap",
    "GRPORatioClippedBeforeUpdate": "clipped_before_update",
}
_OVER_BOUND = catalog.metric("grpo_advantage_over_bound_sequences_total").key()


def triggers_of(
    metrics: Mapping[str, float], lines: StopLines, spike: bool, enabled: Collection[str] = TRIGGERS
) -> tuple[str, ...]:
    """The enabled triggers one stage's metrics fire, in :data:`TRIGGERS` order. ``spike``: the grad-norm spike
    judge (:class:`~grpo_exporter.runtime.spikes.GradNormSpikes`) confirmed a spike at this step: a lone spike
    of a heavy-tailed healthy loop opens no incident."""
    found = {_BY_ALERT[v.alert] for v in guard.check(metrics, lines)}
    if spike:
        found.add("grad_norm_spike")
    if metrics.get(_OVER_BOUND, 0.0) > 0:
        found.add("advantage_bound")
    return tuple(t for t in TRIGGERS if t in found and t in enabled)


def judged(trigger: str, metrics: Mapping[str, float]) -> bool:
    """Whether a step with these metrics judged ``trigger`` (its inputs were there)."""
    families = JUDGED_BY[trigger]
    return any(getattr(k, "sample", k) in families for k in metrics)
