"""Layer 1, the router of mixture-of-experts models: trainer and engine routing the same token to different experts
is a second probability path. With routing replay on, a difference is a replay that fell back (a 0/1 gate, whose
page mutes the layers behind it); with it off, the difference is never 0 and only its rise against the run's own
early level is a fault (a weight sync that skips the routers shows here first), the whole model's or one
layer's."""

from __future__ import annotations

from grpo_exporter.catalog import Layer
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.promql import BY, Alert, anchor, template_query, template_value

FALLBACK = "run:grpo_routing_fallback_decisions:window_ratio"
RATIO = "run:grpo_routing_differing_decisions:window_ratio"
LAYER = "run:grpo_routing_mismatch_ratio:window_mean"
EARLY = "grpo_routing_decision_mismatch_ratio"


def _replay_on(c: MixinConfig) -> str:
    return f"max by ({BY}) (grpo_routing_replay_enabled{c.matchers()}) == 1"


def _layer_anchor(c: MixinConfig) -> str:
    """Each MoE layer's early level (grpo_run_anchor of grpo_routing_mismatch_ratio, its labels text parsed)."""
    anchors = f'grpo_run_anchor{c.matchers(metric="grpo_routing_mismatch_ratio")}'
    return (f"max by ({BY}, moe_layer) (label_replace({anchors}, \"moe_layer\", \"$1\", \"labels\", "
            "\"moe_layer='([0-9]+)'\"))")


def _rise(c: MixinConfig) -> str:
    """The model's share of differing decisions above its early level, or one layer's above its own."""
    early, layer_early = anchor(c, EARLY), _layer_anchor(c)
    factor, floor = c.routing_rise_factor, c.routing_rise_floor_ratio
    model = (f"{RATIO} > on({BY}) ({factor:g} * ({early})) and {RATIO} > on({BY}) (({early}) + {floor:g})")
    layer = (f"max by ({BY}) ({LAYER} > on({BY}, moe_layer) ({factor:g} * {layer_early}) and {LAYER} > "
             f"on({BY}, moe_layer) ({layer_early} + {floor:g}))")
    return f"(({model}) or on({BY}) {layer}) unless on({BY}) {_replay_on(c)}"


def _worst_layers(fmt: str = "%.3g") -> str:
    """Template text: the (up to 5) MoE layers of the alert's run whose last rollout differed most, with shares."""
    expr = 'topk(5, max by (moe_layer) (grpo_routing_mismatch_ratio{run=%q}) > 0)'
    return (f'{{{{ range $i, $s := printf "{expr}" $labels.run | query }}}}{{{{ if $i }}}}, {{{{ end }}}}layer '
            f'{{{{ $s.Labels.moe_layer }}}} ({{{{ $s.Value | printf "{fmt}" }}}}){{{{ else }}}}none{{{{ end }}}}')


def _early_level() -> str:
    """Template text: the run's early share of differing decisions, else the reference run's."""
    sel = f'run=%q,metric=\\"{EARLY}\\"'
    return template_query(f"max(grpo_run_anchor{{{sel}}}) or max(grpo_reference_baseline{{{sel}}})", "%.3g")


def alerts(c: MixinConfig) -> list[Alert]:
    """This part's alerts, in the order they are written to the rule file."""
    w = c.window()
    return [
        Alert(
            "GRPORoutingReplayFellBack", Layer.GRADIENT, "routing", "critical",
            f"{FALLBACK} > {c.routing_replay_tolerance_ratio:g} and on({BY}) {_replay_on(c)}", 60,
            "Routing replay fell back: the trainer routed tokens to other experts than the engine did.",
            "With routing replay on, " + template_value("%.3g") + f" of run {{{{ $labels.run }}}}'s routing "
            f"decisions over {w} were not the engine's (expected 0: the trainer replays the engine's experts); "
            + template_query(f"sum(increase(grpo_routing_unrecorded_decisions_total{{run=%q}}[{w}]))", "%.0f")
            + " of them had no route recorded by the engine. Layers that differed in the last rollout, with "
            "their share of loss tokens: " + _worst_layers()
            + ". The replay data was missing or misaligned for these tokens (a rollout that did not return its "
            "routed experts, prompt/response offsets, a layer the replay does not cover) and the trainer routed "
            "them itself: its log-probs, ratios and gradient are not the engine's policy.",
            for_steps=1,
        ),
        Alert(
            "GRPORoutingMismatchRising", Layer.GRADIENT, "routing", "warning", _rise(c), 600,
            "Trainer and engine route tokens to different experts more and more: the router drifts apart.",
            "Run {{ $labels.run }} reads " + template_value("%.3g") + " (the share of routing decisions that "
            f"differ between trainer and engine over {w}, or of one MoE layer's tokens), above "
            f"{c.routing_rise_factor:g}x its early level and {c.routing_rise_floor_ratio:g} above it: the whole "
            "model's now " + template_query(f"max({RATIO}{{run=%q}})", "%.3g") + " against "
            + _early_level() + " early (the reference run's when the run has none). The level alone is never 0 "
            "for an MoE engine in bf16 or FP8; a rise is a router that no longer matches: a weight sync that "
            "skips the routers or the expert weights, a changed top-k or capacity setting on one side. Worst "
            "layers in the last rollout: " + _worst_layers() + ". Engine gap share on differently routed "
            "tokens: " + template_query("max(grpo_engine_logprob_gap_routing_share_ratio{run=%q})", "%.2g") + ".",
            for_steps=2,
        ),
    ]
