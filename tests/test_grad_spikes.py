"""The grad-norm spike in the seed's terms: "危险信号：突然出现 10 倍以上的尖刺" (a sudden spike of 10x or more) and
"预警看 ESS ratio，确认看 grad norm" (ESS warns, the grad norm confirms). A spike sudden for the run's own norms is
recorded (grpo_grad_norm_spike_steps_total); it pages (grpo_grad_norm_spike_confirmed_steps_total) only when
what a real instability moves with it moved too, at the spike or within grad_spike_confirm_steps (2) optimizer
steps, or when it is beyond grad_spike_extreme_factor (100x) the median."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.runtime.spikes import Evidence, GradNormSpikes, Reading
from monitor_helpers import registry_value

CONFIG = MonitorConfig(run="r", group_size=8)
QUIET = Evidence(ess=1.0, update=1e-3)


def steady(spikes: GradNormSpikes, steps: int = 30) -> None:
    """A healthy stretch: norms ~1 within a few percent, ESS 1, nothing clipped, |dθ|/|θ| 1e-3."""
    for i in range(steps):
        assert spikes.observe(1.0 + 0.02 * (i % 5), None, QUIET) == Reading()


def test_a_lone_spike_is_recorded_and_not_paged():
    spikes = GradNormSpikes(CONFIG)
    steady(spikes)
    assert spikes.observe(50.0, None, QUIET) == Reading(spike=True)  # 50x the median: sudden, alone
    assert [spikes.observe(1.0, None, QUIET) for _ in range(5)] == [Reading()] * 5


@pytest.mark.parametrize(("evidence", "why"), [
    (Evidence(ess=0.4, update=1e-3), "ess"),  # the weights concentrate: ESS below half its window minimum
    (Evidence(ess=1.0, update=4e-3), "update"),  # a violent update: 4x the window's largest |dθ|/|θ|
    (Evidence(nonfinite=True), "nonfinite"),
    (Evidence(fuse=True), "fuse"),
])
def test_a_spike_with_what_an_instability_moves_is_confirmed_at_once(evidence, why):
    spikes = GradNormSpikes(CONFIG)
    steady(spikes)
    assert spikes.observe(50.0, None, evidence) == Reading(spike=True, confirmed=True, evidence=why)


def test_a_spike_is_confirmed_by_the_next_steps_and_not_after_them():
    """The update a spike makes shows one optimizer step later (|dθ|/|θ| is measured at the next clip, the ratio
    moves at the next epoch): the 2 steps after a spike still confirm it; the third does not."""
    late = GradNormSpikes(CONFIG)
    steady(late)
    late.observe(50.0, None, QUIET)
    assert late.observe(1.0, None, QUIET) == Reading()
    assert late.observe(1.0, None, Evidence(nonfinite=True)) == Reading(confirmed=True, evidence="nonfinite")
    too_late = GradNormSpikes(CONFIG)
    steady(too_late)
    too_late.observe(50.0, None, QUIET)
    for _ in range(CONFIG.grad_spike_confirm_steps):
        too_late.observe(1.0, None, QUIET)
    assert too_late.observe(1.0, None, Evidence(nonfinite=True)) == Reading()


def test_a_repeated_spike_and_an_extreme_one_confirm_themselves():
    """A second spike within the window is no heavy tail's lone event (a gradient scaled from some step on); a
    spike of 500x is beyond anything a healthy run reaches (grad_spike_extreme_factor 100)."""
    repeated = GradNormSpikes(CONFIG)
    steady(repeated)
    assert repeated.observe(50.0, None, QUIET) == Reading(spike=True)
    assert repeated.observe(60.0, None, QUIET) == Reading(spike=True, confirmed=True, evidence="repeat")
    extreme = GradNormSpikes(CONFIG)
    steady(extreme)
    assert extreme.observe(500.0, None, QUIET) == Reading(spike=True, confirmed=True, evidence="extreme")


def test_a_loop_whose_healthy_norms_swing_past_10x_spikes_only_beyond_its_own_swing():
    """Four epochs on each rollout: the first carries the signal (norm ~1), the three after it are mostly clipped
    (~0.02-0.05). The median sits with the later epochs, so every first epoch is 20-50x it (the old rule's
    spike, every rollout); none is 3x the norm one step in ten reaches (the 90th percentile: a first epoch's).
    A crash still is: 1000x."""
    spikes = GradNormSpikes(CONFIG)
    epochs = [(1.0, 0.02, 0.03, 0.05), (0.8, 0.04, 0.02, 0.03), (1.2, 0.03, 0.05, 0.02)]
    readings = [spikes.observe(norm, None, QUIET) for _ in range(20) for cycle in epochs for norm in cycle]
    median = sorted(n for cycle in epochs for n in cycle)[6]
    assert 1.0 / median > CONFIG.grad_spike_factor
    assert not any(r.spike for r in readings)
    assert spikes.observe(1000.0, None, QUIET).confirmed


def test_a_converging_run_whose_signal_swings_is_no_spike_and_a_crash_still_is():
    """A converging run: most steps carry one mixed group of sixteen (1/16 of the loss tokens have signal, norm
    ~0.05), some several (1/2, norm ~0.6: twelve times the norm for eight times the signal). Judged per signal
    share (seed: zero-advantage tokens dilute the gradient) nothing spikes; judged raw, the dense steps do."""
    steps = [(0.05 + 0.002 * (i % 3), 1 / 16) for i in range(30)] + [(0.6, 0.5), (0.05, 1 / 16), (0.55, 0.5)] * 5
    per_signal, raw = GradNormSpikes(CONFIG), GradNormSpikes(CONFIG)
    assert not any(per_signal.observe(norm, share, QUIET).spike for norm, share in steps)
    assert any(raw.observe(norm, None, QUIET).spike for norm, _ in steps)
    assert per_signal.observe(6.0, 1 / 16, QUIET).spike  # 120 times the sparse steps' norm at their signal
    assert per_signal.observe(0.3, 0.0, QUIET) == Reading()  # no signal at all: not judged


def test_nothing_is_judged_before_enough_norms_or_without_a_finite_norm():
    spikes = GradNormSpikes(CONFIG)
    early = [spikes.observe(x, None, QUIET) for x in [0.01] * 19 + [1.0]]
    assert early == [Reading()] * 20  # 19 tiny early norms: no baseline yet
    assert spikes.observe(float("nan"), None, QUIET) == Reading()
    assert spikes.observe(None, None, QUIET) == Reading()
    assert spikes.observe(0.0, None, QUIET) == Reading()


def test_the_monitor_records_the_lone_spike_and_pages_the_confirmed_one(caplog):
    """Through the public API: a lone 50x spike counts in grpo_grad_norm_spike_steps_total only; a 50x spike
    whose next step has a NaN loss counts in the confirmed counter too, with one log line naming the evidence."""
    def run(confirm: bool) -> GRPOMonitor:
        mon = GRPOMonitor(run="spikes", group_size=8, port=None, guard="off", close_linger_s=0.0)
        norms = [1.0 + 0.01 * (i % 7) for i in range(30)] + [50.0, 1.0, 1.0]
        for step, norm in enumerate(norms):
            loss = math.nan if confirm and step == 31 else 0.5
            mon.observe_update(step, grad_norm_pre_clip=torch.tensor(norm), max_grad_norm=100.0, loss=loss)
            mon.end_step()
        return mon

    with run(confirm=False) as lone:
        assert registry_value(lone, "grpo_grad_norm_spike_steps_total") == 1
        assert registry_value(lone, "grpo_grad_norm_spike_confirmed_steps_total") == 0
    with caplog.at_level("WARNING", logger="grpo_exporter"), run(confirm=True) as confirmed:
        assert registry_value(confirmed, "grpo_grad_norm_spike_steps_total") == 1
        assert registry_value(confirmed, "grpo_grad_norm_spike_confirmed_steps_total") == 1
    assert sum("spike confirmed by nonfinite" in r.getMessage() for r in caplog.records) == 1
