"""Layer 1, the router of mixture-of-experts models (a second probability path between engine and trainer): which
experts each side routed the loss tokens to, the engine gap split by that, and each side's expert load."""

from __future__ import annotations

from grpo_exporter.functional import routing
from grpo_exporter.functional.reading import finite
from grpo_exporter.inputs import InputError
from grpo_exporter.step.context import Context
from grpo_exporter.step.gather import Gather
from grpo_exporter.step.registry import produces


@produces(
    "grpo_routing_compared_decisions_total", "grpo_routing_differing_decisions_total",
    "grpo_routing_unrecorded_decisions_total", "grpo_routing_mismatch_ratio",
    "grpo_routing_decision_mismatch_ratio", "grpo_routing_mismatch_tokens_ratio",
    "grpo_engine_logprob_gap_by_routing_mean_nats", "grpo_engine_logprob_gap_routing_share_ratio",
    stages=("rollout",))
def routing_mismatch(out: Gather, ctx: Context) -> None:
    x = ctx.x
    if x.routed_experts is None or x.rollout_routed_experts is None or x.loss_mask is None:
        return
    layers = x.routed_experts.shape[2]
    if layers > ctx.cfg.max_moe_layers:
        raise InputError("routed_experts", f"at most max_moe_layers={ctx.cfg.max_moe_layers} MoE layers (raise the "
                         "setting for a deeper model)", f"{layers} layers")
    m = routing.routing_mismatch(x.routed_experts, x.rollout_routed_experts, x.loss_mask)
    out.add("grpo_routing_compared_decisions_total", m.compared)
    out.add("grpo_routing_differing_decisions_total", m.differing)
    out.add("grpo_routing_unrecorded_decisions_total", m.unrecorded)
    out.each("grpo_routing_mismatch_ratio", m.layers, "moe_layer", [str(layer) for layer in range(layers)])
    out.add("grpo_routing_decision_mismatch_ratio", m.decisions)
    out.add("grpo_routing_mismatch_tokens_ratio", m.tokens)
    difference = ctx.gap_difference
    if difference is not None:
        split = routing.gap_by_routing(difference.abs(), x.loss_mask & finite(difference), m)
        out.add("grpo_engine_logprob_gap_by_routing_mean_nats", split.agrees, routing="agrees")
        out.add("grpo_engine_logprob_gap_by_routing_mean_nats", split.differs, routing="differs")
        out.add("grpo_engine_logprob_gap_routing_share_ratio", split.differs_share)


@produces("grpo_routing_replay_enabled", stages=("rollout",))
def routing_replay(out: Gather, ctx: Context) -> None:
    if ctx.x.routing_replay is not None:
        out.add("grpo_routing_replay_enabled", float(ctx.x.routing_replay))


@produces("grpo_expert_load_peak_multiple", stages=("rollout",))
def expert_load(out: Gather, ctx: Context) -> None:
    x, experts = ctx.x, ctx.cfg.moe_experts
    if experts is None or x.loss_mask is None:
        return
    for side, ids in (("trainer", x.routed_experts), ("engine", x.rollout_routed_experts)):
        if ids is not None:
            out.add("grpo_expert_load_peak_multiple", routing.expert_load_peak(ids, x.loss_mask, experts), side=side)
