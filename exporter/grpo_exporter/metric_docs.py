"""The metric reference (docs/metrics.md), generated from the catalogue; a test fails when the file drifts."""

from __future__ import annotations

import ast
from pathlib import Path

from grpo_exporter.catalog import CATALOG, ONE_PER_RUN, Layer, Metric, MetricType
from grpo_exporter.runtime.anchors import ANCHORED_FAMILIES
from grpo_exporter.runtime.monitor_config import MonitorConfig

_LAYER_TITLES = {
    Layer.GRADIENT: "Layer 1 — does the gradient match what I think?",
    Layer.REWARD: "Layer 2 — does the reward measure what I think?",
    Layer.SAMPLES: "Layer 3 — how many samples decide this update?",
    Layer.DIVERSITY: "Layer 4 — does the policy still read the question?",
    Layer.LIVENESS: "Liveness and the exporter itself",
}


def _samples(m: Metric) -> str:
    if m.type is MetricType.SUMMARY:
        qs = ", ".join(repr(q).removesuffix(".0") for q in m.quantiles)
        return f"quantile {qs}; `_sum`, `_count`"
    if m.type is MetricType.HISTOGRAM:
        return f"`_bucket` le {', '.join(repr(b) for b in m.buckets)}, +Inf; `_sum`, `_count`"
    return ""


def _labels(m: Metric) -> str:
    parts = []
    for label in m.labels:
        values = "\\|".join(label.values) if label.values else f"bounded by {label.bound}"
        parts.append(f"`{label.name}`: {values}")
    return "; ".join(parts)


def _inputs(m: Metric) -> str:
    return ", ".join(" or ".join(f"`{name}`" for name in spec.split("|")) for spec in m.inputs) or "—"


def series_per_run(cfg: MonitorConfig) -> dict[str, int]:
    """Upper bound of the series one run publishes, per catalogue metric (the ``run`` label adds none), from
    the label bounds of the config: what a fleet of runs costs a Prometheus."""
    bounded = {
        "component": cfg.max_reward_components + 1,
        "k": len(cfg.pass_ks),
        "moe_layer": cfg.max_moe_layers,
        "metric": len(cfg.reference_baseline),
        "labels": 1,
        "version": 1, "torch_version": 1, "group_size": 1, "clip_eps_low": 1, "clip_eps_high": 1,
        "incident": 1, "directory": 1,  # the latest incident only
    }
    counts: dict[str, int] = {}
    for m in CATALOG:
        combos = 1
        for label in m.labels:
            one = label.bound == ONE_PER_RUN  # e.g. the correctness component's name: one, not a component each
            combos *= 1 if one else len(label.values) if label.values else bounded[label.name]
        if m.type is MetricType.SUMMARY:
            per = len(cfg.quantiles_of(m.name)) + 2
        elif m.type is MetricType.HISTOGRAM:
            per = len(cfg.buckets_of(m.name, m.buckets)) + 3
        else:
            per = 1
        counts[m.name] = combos * per
    # one frozen anchor per sample of each anchored family
    counts["grpo_run_anchor"] = sum(counts[name] for name in ANCHORED_FAMILIES)
    return counts


def _signatures() -> dict[str, ast.arguments]:
    """GRPOMonitor's method signatures, read from its source: importing the monitor would import torch, which
    ``grpo-exporter catalog`` does not need."""
    tree = ast.parse((Path(__file__).parent / "runtime" / "monitor.py").read_text(encoding="utf-8"))
    monitor = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOMonitor")
    return {n.name: n.args for n in monitor.body if isinstance(n, ast.FunctionDef)}


def _calls() -> list[str]:
    """Which GRPOMonitor call takes which input, read from the signatures themselves."""
    from grpo_exporter.keywords import TYPED

    signatures = _signatures()
    lines = ["## Which call takes which input", "", "| call | inputs |", "|---|---|"]
    for name in ("observe_rollout", "observe_update", "clip_grad_norm_", "observe_retrieval", "observe_regression"):
        args = signatures[name]
        params = [*args.posonlyargs, *args.args, *([args.vararg] if args.vararg else []), *args.kwonlyargs]
        shown = [p.arg for p in params if p.arg not in ("self", "step")]
        if args.kwarg is not None:
            shown = list(TYPED[name].__annotations__) + shown  # the step fields (a TypedDict) come first
        lines.append(f"| `{name}` | {', '.join(f'`{p}`' for p in shown)} |")
    lines += [
        "",
        "`clip_grad_norm_` supplies `grads`/`grad_norm_pre_clip`, `max_grad_norm` and, from the second call on,",
        "`params_before`/`params_after` (a bounded sample of the parameters around the previous optimizer step).",
        "`prompt_ids` feeds the per-prompt solve-rate history behind the predicted zero-variance share",
        "(a Beta-binomial per prompt, unseen prompts averaged over the observed distribution of solve rates).",
        "",
    ]
    return lines


def metrics_markdown() -> str:
    """The whole reference page as Markdown."""
    lines = [
        "# Metric reference",
        "",
        "<!-- Generated from grpo_exporter.catalog by `grpo-exporter catalog --out docs/metrics.md`. Do not edit. -->",
        "",
        "Every series also carries the `run` label. Counters count this run's events since the exporter started;",
        "gauges and summary quantiles describe the last step; summary and histogram `_sum`/`_count` are",
        "cumulative, so `rate(x_sum[w]) / rate(x_count[w])` is an exact windowed mean.",
        "`step` metrics are computed from the step's tensors with one host transfer per stage (the rollout, the end "
        "of the optimizer step); `monitor` metrics are",
        "kept by the stateful exporter around them.",
        "",
    ]
    lines += _calls()
    for layer, title in _LAYER_TITLES.items():
        lines += [f"## {title}", "", "| metric | type | labels | needs | source | meaning |", "|---" * 6 + "|"]
        for m in (m for m in CATALOG if m.layer is layer):
            kind = f"{m.type.value} ({_samples(m)})" if _samples(m) else m.type.value
            help_text = m.help.replace("|", "\\|")
            lines.append(
                f"| `{m.name}` | {kind} | {_labels(m) or '—'} | {_inputs(m)} | {m.source.value} | {help_text} |"
            )
        lines.append("")
    return "\n".join(lines)
