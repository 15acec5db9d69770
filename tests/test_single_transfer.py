"""One step, one device-to-host transfer: every way a tensor reaches the host is counted during the call, on the
training thread (the monitor's own threads, e.g. the reading set's, take their rows off the step), except the
step's reads of its own host copy after the transfer (``reading_host_copy``: on the CPU the host copy is the
device block itself, so only the step can tell those apart)."""

from __future__ import annotations

import threading

import pytest
import torch

from batches import make_batch
from grpo_exporter.config import MetricsConfig
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step, reading_host_copy

HOST_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def host_calls(monkeypatch):
    calls: list[str] = []
    training = threading.get_ident()
    for name in HOST_METHODS:
        original = getattr(torch.Tensor, name)

        def spy(self, *args, __name=name, __original=original, **kwargs):
            if not reading_host_copy() and threading.get_ident() == training:
                calls.append(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_step_makes_exactly_one_transfer(host_calls, dtype):
    """A step whose inputs are finite on the loss tokens: one transfer. The test batch's own mask bug (row 7
    trains on a -inf padding position of every log-prob input, NaN entropy) is the exception the non-finite
    counters exist for: their per-input counts, witnessed by the log-prob differences, take one more transfer,
    and stay exact."""
    batch = make_batch(0, dtype=dtype, shuffled_groups=True)
    experts = torch.randint(0, 8, (*batch.arrays["loss_mask"].shape, 4, 2), generator=torch.Generator().manual_seed(0))
    extra = {"grads": [torch.randn(3, 4), torch.randn(5)], "grad_norm_pre_clip": None,
             "params_before": [torch.ones(4)], "params_after": [torch.full((4,), 1.01)], "loss": torch.tensor(0.3),
             "routed_experts": experts, "rollout_routed_experts": experts.flip(0), "routing_replay": False}
    faulty, healthy = batch.inputs(**extra), batch.healthy_inputs(**extra)
    names = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy")
    cfg = MetricsConfig(group_size=8, log_ratio_clamp=20.0, pass_k=(2, 4), moe_experts=8)
    host_calls.clear()
    metrics = compute_step(healthy, cfg)
    assert "grpo_routing_decision_mismatch_ratio" in metrics
    assert 'grpo_expert_load_peak_multiple{side="engine"}' in metrics
    assert host_calls == ["tolist"]
    assert len(metrics) > 90
    assert all(metrics[f'grpo_nonfinite_values_total{{tensor="{name}"}}'] == 0 for name in names)
    host_calls.clear()
    metrics = compute_step(faulty, cfg)
    assert host_calls == ["tolist", "tolist"]
    for name in names:
        expected = int((~torch.isfinite(getattr(faulty, name)) & faulty.loss_mask).sum())
        assert expected == 1
        assert metrics[f'grpo_nonfinite_values_total{{tensor="{name}"}}'] == expected, name


def test_the_spy_sees_hidden_syncs(host_calls):
    """The counter would catch a metric that branched on data."""
    t = torch.ones(3)
    if t.sum() > 0:
        float(t[0])
    assert host_calls == ["__bool__", "__float__"]


def test_monitor_calls_transfer_once_per_step(host_calls):
    """observe_rollout: one transfer (history lookup and update stay on the device); observe_update: none
    (kept for the step); clip_grad_norm_: one, for the whole optimizer step."""
    from grpo_exporter import GRPOMonitor
    from monitor_helpers import rollout_kwargs, update_kwargs

    x = make_batch(0).healthy_inputs()
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    with GRPOMonitor(run="t", group_size=8, port=None, guard="off", edit_distance_groups=0) as mon:
        for step in range(2):
            host_calls.clear()
            mon.observe_rollout(step, **rollout_kwargs(x), prompt_ids=torch.arange(48) // 8)
            assert host_calls == ["tolist"]
            host_calls.clear()
            mon.observe_update(step, **update_kwargs(x, slice(0, 24)))
            mon.observe_update(step, **update_kwargs(x, slice(24, 48)))
            assert host_calls == []
            mon.clip_grad_norm_(model.parameters(), 1.0)
            assert host_calls == ["tolist"]


def test_only_the_steps_own_host_copy_is_exempt(host_calls, monkeypatch):
    """The exemption covers the step's reads of its block after the transfer, nothing else: a metric block that
    reads the device (a hidden sync) is still counted, and the flag is down once the step returns."""
    import grpo_exporter.step.compute as stages
    from grpo_exporter.step import produces

    @produces(stages=("rollout", "update"))
    def syncing(out, ctx):
        float(ctx.x.rewards.sum())

    monkeypatch.setattr(stages, "BLOCKS", (*stages.BLOCKS, syncing))
    inputs = make_batch(0).healthy_inputs()
    host_calls.clear()
    compute_step(inputs, MetricsConfig(group_size=8))
    assert host_calls == ["__float__", "tolist"]
    assert not reading_host_copy()


def test_numbers_a_framework_reports_never_become_tensors_from_host_memory():
    """Grad norms, the clip limit and a framework's entropy mean given as Python numbers enter the step by a
    fill on the device, never ``torch.tensor``/``as_tensor`` of the number (on an accelerator a blocking copy
    that waits for the training stream); the clip flag and the post-clip norm are as torch computes them."""
    from grpo_exporter.bench.probes import counting

    for pre, post in ((2.5, None), (0.5, None), (2.5, 1.0)):
        inputs = StepInputs(grad_norm_pre_clip=pre, grad_norm_post_clip=post, max_grad_norm=1.0, entropy_mean=0.7)
        with counting() as counts:
            m = compute_step(inputs, MetricsConfig(group_size=8))
        assert counts.from_python == 0
        assert m["grpo_grad_clip_active_steps_total"] == float(pre > 1.0)
        assert m["grpo_grad_norm_post_clip"] == pytest.approx(post or min(pre, pre * 1.0 / (pre + 1e-6)))
        assert m["grpo_entropy_mean_nats"] == pytest.approx(0.7)
