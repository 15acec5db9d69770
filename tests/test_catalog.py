"""The catalogue: conventions, completeness against the step computation, and the generated reference."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch

from batches import make_batch
from grpo_exporter.catalog import CATALOG, Label, Layer, Metric, MetricType, Source, metric, validate
from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.metric_docs import metrics_markdown
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.step import compute_step

ROOT = Path(__file__).resolve().parents[1]
KEY = re.compile(r'^(?P<sample>[a-z0-9_]+)(\{(?P<labels>.*)\})?$')
SUFFIXES = {MetricType.SUMMARY: ("", "_sum", "_count"), MetricType.HISTOGRAM: ("_bucket", "_sum", "_count")}


def parse(key: str) -> tuple[str, dict[str, str]]:
    match = KEY.match(key)
    assert match, key
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
    return match["sample"], labels


def family_of(sample: str) -> Metric:
    for m in CATALOG:
        if sample in (m.name + s for s in SUFFIXES.get(m.type, ("",))):
            return m
    raise AssertionError(f"sample {sample!r} belongs to no catalogue metric")


def full_step() -> dict[str, float]:
    batch = make_batch(0, shuffled_groups=True)
    no_tools = torch.zeros(batch.arrays["loss_mask"].shape, dtype=torch.bool)  # a multi-turn layout, no tool span
    experts = torch.randint(0, 8, (*no_tools.shape, 3, 2), generator=torch.Generator().manual_seed(0))
    inputs = batch.inputs(
        params_before=[torch.ones(3)], params_after=[torch.full((3,), 1.1)], completion_mask=None, tool_mask=no_tools,
        routed_experts=experts, rollout_routed_experts=experts.roll(1, dims=0), routing_replay=False,
    )
    cfg = MetricsConfig(
        group_size=8, log_ratio_clamp=20.0, pass_k=(2,), rollout_correction_cap=3.0, rollout_logprob_nan="unscored",
        moe_experts=8,
    )
    return compute_step(inputs, cfg)


def test_every_step_key_is_a_catalogue_sample_with_allowed_labels():
    for key in full_step():
        sample, labels = parse(key)
        m = family_of(sample)
        allowed = set(m.label_names)
        if m.type is MetricType.SUMMARY and sample == m.name:
            allowed.add("quantile")
        if sample.endswith("_bucket"):
            allowed.add("le")
        assert set(labels) == allowed, key
        for label in m.labels:
            if label.values:
                assert labels[label.name] in label.values, key


def test_every_step_metric_is_computed_from_a_full_batch():
    produced = {family_of(parse(k)[0]).name for k in full_step()}
    expected = {m.name for m in CATALOG if m.source is Source.STEP}
    assert expected - produced == set()


def test_metric_inputs_are_step_fields_or_config():
    known = {f.name for f in dataclasses.fields(StepInputs)} | set(MonitorConfig.model_fields)
    # arguments of observe_retrieval, observe_regression and publish_check, and observe_rollout's running total
    # the monitor counts
    known |= {"retrieval_scores", "regression_correct", "preflight_report", "dropped_stale_total"}
    for m in CATALOG:
        for spec in m.inputs:
            assert set(spec.split("|")) <= known, (m.name, spec)


def test_every_layer_has_metrics_and_the_catalogue_is_valid():
    validate(CATALOG)
    assert {m.layer for m in CATALOG} == set(Layer)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (Metric("grpo_things", MetricType.COUNTER, "h", Layer.SAMPLES), "_total"),
        (Metric("grpo_things_total", MetricType.GAUGE, "h", Layer.SAMPLES), "_total"),
        (Metric("grpo_gap", MetricType.GAUGE, "h", Layer.GRADIENT, "nats"), "suffix"),
        (Metric("grpo_share_ratio", MetricType.GAUGE, "h", Layer.SAMPLES), "_ratio"),
        (Metric("grpo:rec", MetricType.GAUGE, "h", Layer.SAMPLES), "name must match"),
        (Metric("things", MetricType.GAUGE, "h", Layer.SAMPLES), "name must match"),
        (Metric("grpo_xy", MetricType.GAUGE, "h", Layer.SAMPLES, labels=(Label("prompt"),)), "bound"),
        (Metric("grpo_xy", MetricType.GAUGE, "h", Layer.SAMPLES, labels=(Label("run", ("a",)),)), "reserved"),
        (Metric("grpo_xy", MetricType.SUMMARY, "h", Layer.SAMPLES), "quantiles"),
        (Metric("grpo_xy", MetricType.GAUGE, " ", Layer.SAMPLES), "help"),
    ],
)
def test_validate_rejects_convention_breaks(bad, message):
    with pytest.raises(ValueError, match=message):
        validate((bad,))


def test_duplicate_names_are_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        validate((CATALOG[0], CATALOG[0]))


def test_key_rejects_undeclared_labels_and_values():
    m = metric("grpo_clipped_tokens_total")
    assert m.key(bound="upper") == 'grpo_clipped_tokens_total{bound="upper"}'
    with pytest.raises(ValueError, match="expected one of"):
        m.key(bound="middle")
    with pytest.raises(ValueError, match="no label"):
        m.key(prompt="p1")
    with pytest.raises(KeyError, match="no catalogue metric"):
        metric("grpo_clip_fraction")


def test_a_key_pickles_as_its_sample_and_labels_without_its_cached_family():
    key = metric("grpo_clipped_tokens_total").key(bound="upper")
    fresh = len(pickle.dumps(key))
    assert key.family is metric("grpo_clipped_tokens_total")
    assert key.additive
    back = pickle.loads(pickle.dumps(key))
    assert len(pickle.dumps(key)) == fresh  # what a rank sends is not grown by the cached catalogue entry
    assert (back, back.sample, back.labels) == (key, key.sample, key.labels)
    assert back.family is key.family  # looked up again in this process's catalogue, not a copy


def test_generated_metric_reference_is_up_to_date():
    committed = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert committed == metrics_markdown(), "docs/metrics.md drifted: run `grpo-exporter catalog --out docs/metrics.md`"
    for m in CATALOG:
        assert f"`{m.name}`" in committed
