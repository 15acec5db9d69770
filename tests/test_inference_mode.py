"""The monitor computes under ``torch.inference_mode`` (cheaper operators), and none of that leaks into the
training: the user's autograd graph still backpropagates through the tensors it handed over, and every tensor the
package caches across calls is a normal tensor that autograd may save."""

from __future__ import annotations

import torch

from grpo_exporter.bench import monitor_step, new_monitor
from grpo_exporter.bench.workload import make
from grpo_exporter.functional import constants, diversity, histogram, reading
from grpo_exporter.functional.constants import constant
from monitor_helpers import registry_value


def test_the_training_graph_backpropagates_after_the_monitor_read_its_tensors():
    w = make(10_000)
    weight = torch.full((), 0.5, requires_grad=True)
    logprobs = w.new * weight  # a graph the training will backpropagate after the monitor saw it
    mon = new_monitor(edit_distance_groups=0)
    try:
        mon.observe_rollout(0, rewards=w.rewards, correct=w.correct, loss_mask=w.mask, old_logprobs=w.old)
        mon.observe_update(0, logprobs=logprobs, old_logprobs=w.old, advantages=w.advantages, loss_mask=w.mask)
        mon.end_step()
        loss = (logprobs * w.mask).sum()
        loss.backward()
        assert weight.grad is not None
        assert torch.allclose(weight.grad, (w.new * w.mask).sum())
        assert registry_value(mon, "grpo_steps_total") == 1
        assert not torch.is_inference_mode_enabled()  # the monitor left the mode as it found it
    finally:
        mon.close()


def test_constants_cached_during_a_step_are_normal_tensors_that_autograd_can_save():
    makers = (reading._true, histogram.midpoints, histogram._zero, histogram._row_offsets, diversity._multipliers,
              constants._cached)
    for make_constant in makers:
        make_constant.cache_clear()  # type: ignore[attr-defined]  # filled afresh below, whatever ran before
    w = make(10_000)
    mon = new_monitor(edit_distance_groups=0)
    try:
        monitor_step(mon, w, 0)  # fills every cache from inside the monitor's inference mode
    finally:
        mon.close()
    cpu = torch.device("cpu")
    cached = [
        reading._true(cpu),
        histogram.midpoints(cpu),
        histogram._zero(cpu),
        histogram._row_offsets(3, cpu),
        diversity._multipliers(w.t, "cpu"),
        constant((1.0, 2.0), torch.float32, cpu),
    ]
    assert [t.is_inference() for t in cached] == [False] * len(cached)
    x = torch.ones(2, requires_grad=True)
    (x * constant((1.0, 2.0), torch.float32, cpu)).sum().backward()  # mul saves the constant for backward
    assert x.grad is not None
    assert x.grad.tolist() == [1.0, 2.0]
