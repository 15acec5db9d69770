"""Layer 1, the router of mixture-of-experts models: trainer and engine routing the same token to different experts
is a second probability path. With routing replay on, a difference is a replay that fell back (a 0/1 gate, whose
page mutes the layers behind it); with it off, the difference is never 0 and only its rise against the run's own
early level is a fault (a weight sync that skips the router shows here first)."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import BY, Alert, anchor, template_query, template_value

RATIO = "run:grpo_routing_differing_decisions:window_ratio"
EARLY = "grpo_routing_decision_mismatch_ratio"


def _replay_on(c: MixinConfig) -> str:
    return f"max by ({BY}) (grpo_routing_replay_enabled{c.matchers()}) == 1"


def _worst_layers(fmt: str = "%.3g") -> str:
    """Template text: the (up to 5) MoE layers of the alert's run whose last rollout differed most, with shares."""
    expr = 'topk(5, max by (moe_layer) (grpo_routing_mismatch_ratio{run=%q}) > 0)'
    return (f'{{{{ range $i, $s := printf "{expr}" $labels.run | query }}}}{{{{ if $i }}}}, {{{{ end }}}}layer '
            f'{{{{ $s.Labels.moe_layer }}}} ({{{{ $s.Value | printf "{fmt}" }}}}){{{{ else }}}}none{{{{ end }}}}')


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    w = c.window()
    early = anchor(c, EARLY)
    return [
        Alert(
            "GRPORoutingReplayFellBack", Layer.GRADIENT, "routing", "critical",
            f"{RATIO} > {c.routing_replay_tolerance_ratio:g} and on({BY}) {_replay_on(c)}", 60,
            "Routing replay fell back: the trainer routed tokens to other experts than the engine did.",
            "With routing replay on, " + template_value("%.3g") + f" of run {{{{ $labels.run }}}}'s routing "
            f"decisions over {w} differ from the engine's (expected 0: the trainer replays the engine's experts). "
            "Layers that differed in the last rollout, with their share of loss tokens: " + _worst_layers()
            + ". The replay data was missing or misaligned for these tokens (a rollout that did not return its "
            "routed experts, prompt/response offsets, a layer the replay does not cover) and the trainer routed "
            "them itself: its log-probs, ratios and gradient are not the engine's policy.",
            for_steps=1,
        ),
        Alert(
            "GRPORoutingMismatchRising", Layer.GRADIENT, "routing", "warning",
            f"{RATIO} > on({BY}) ({c.routing_rise_factor:g} * ({early})) and {RATIO} > on({BY}) "
            f"(({early}) + {c.routing_rise_floor_ratio:g}) unless on({BY}) {_replay_on(c)}", 600,
            "Trainer and engine route tokens to different experts more and more: the router drifts apart.",
            "Run {{ $labels.run }}: " + template_value("%.3g") + f" of routing decisions over {w} differ between "
            f"trainer and engine, above {c.routing_rise_factor:g}x the run's own early level "
            + template_query(f'max(grpo_run_anchor{{run=%q,metric=\\"{EARLY}\\"}})', "%.3g")
            + f" (and {c.routing_rise_floor_ratio:g} above it; the reference run's level when the run has none). "
            "The level alone is never 0 for an MoE engine in bf16 or FP8; a rise is a router that no longer "
            "matches: a weight sync that skips the router or the expert weights, a changed top-k or capacity "
            "setting on one side. Worst layers in the last rollout: " + _worst_layers()
            + ". Engine gap share on differently routed tokens: "
            + template_query("max(grpo_engine_logprob_gap_routing_share_ratio{run=%q})", "%.2g") + ".",
            for_steps=2,
        ),
    ]
