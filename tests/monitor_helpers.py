"""Feeding a GRPOMonitor from test batches, reading it back, and a few HTTP helpers."""

from __future__ import annotations

import ssl
import urllib.request
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from batches import make_batch
from grpo_exporter import GRPOMonitor
from grpo_exporter.catalog import is_additive, parse_key
from grpo_exporter.inputs import StepInputs

ROLLOUT_FIELDS = (
    "rewards", "group_ids", "correct", "truncated", "rollout_logprobs", "old_logprobs", "loss_mask",
    "completion_lengths", "completion_ids", "turns", "partial",
)
UPDATE_FIELDS = ("logprobs", "old_logprobs", "advantages", "loss_mask", "entropy", "ref_logprobs", "completion_lengths",
                 "staleness")


def rollout_kwargs(x: StepInputs) -> dict[str, Any]:
    kw = {name: getattr(x, name) for name in ROLLOUT_FIELDS if getattr(x, name) is not None}
    kw["reward_components"] = dict(x.reward_components)
    return kw


def update_kwargs(x: StepInputs, rows: slice = slice(None)) -> dict[str, Any]:
    kw = {name: getattr(x, name)[rows] for name in UPDATE_FIELDS if getattr(x, name) is not None}
    kw["on_policy"] = x.on_policy
    return kw


def feed(mon: GRPOMonitor, step: int, seed: int, micro: int = 1, **batch_kw: Any) -> StepInputs:
    """One rollout + ``micro`` update micro-steps + a grad clip; returns the batch's inputs."""
    x = make_batch(seed, **batch_kw).inputs()
    mon.observe_rollout(step, **rollout_kwargs(x))
    n = x.loss_mask.shape[0]
    size = n // micro
    for i in range(micro):
        mon.observe_update(step, **update_kwargs(x, slice(i * size, (i + 1) * size)))
    model = torch.nn.Linear(4, 3)
    torch.manual_seed(step)
    model(torch.randn(5, 4)).square().sum().backward()
    mon.clip_grad_norm_(model.parameters(), 0.5)
    return x


def registry_value(mon: GRPOMonitor, key: str) -> float | None:
    """A sample of the monitor's registry, by catalogue key, with the run label added."""
    name, labels = parse_key(key)
    return mon.registry.get_sample_value(name, {"run": mon.config.run, **labels})


def scrape(url: str, context: ssl.SSLContext | None = None, headers: dict[str, str] | None = None) -> str:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return response.read().decode()


def parse_exposition(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def expected_step(rollout: StepInputs, update: StepInputs, cfg: Any) -> dict[str, float]:
    """What a monitor publishes for one step: rollout-stage blocks on the rollout inputs, update-stage blocks
    on the update inputs, additive samples summed."""
    from grpo_exporter.catalog import family_of, is_additive
    from grpo_exporter.step import MASK_AUDIT_FAMILIES, ROLLOUT_BLOCKS, UPDATE_BLOCKS, compute_step_carrying

    want = dict(compute_step_carrying(rollout, cfg, {}, blocks=ROLLOUT_BLOCKS).metrics)
    updated = compute_step_carrying(update, cfg, {}, blocks=UPDATE_BLOCKS).metrics
    if any(family_of(parse_key(k)[0]).name in MASK_AUDIT_FAMILIES for k in updated):
        # the update audited the mask it trains with: the rollout's audit is not published
        want = {k: v for k, v in want.items() if family_of(parse_key(k)[0]).name not in MASK_AUDIT_FAMILIES}
    for key, value in updated.items():
        want[key] = want.get(key, 0.0) + value if is_additive(key) else value
    return want


def assert_merged(got: dict[str, float], want: dict[str, float], absent: tuple[str, ...] = ()) -> None:
    """Ranks' merged readings ``got`` against the single process's ``want`` over the concatenated batch:
    counts and histogram readings exactly, ratios of fp32 weights to 1e-6, the rest to 1e-9; families in
    ``absent`` must not be published."""
    for key, value in want.items():
        name = parse_key(key)[0]
        if name.startswith(absent):
            assert key not in got, key
            continue
        assert key in got, key
        if "quantile" in parse_key(key)[1] or name.startswith("grpo_entropy_top"):
            assert got[key] == value, key  # read from the summed histogram: the single process's reading
        elif is_additive(key):
            assert got[key] == value, key
        elif key.startswith("grpo_ess_ratio"):  # fp32 weights, shifted by each rank's own max before the merge
            assert got[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
