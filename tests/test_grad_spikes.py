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
    reading = spikes.observe(50.0, None, evidence)
    assert (reading.spike, reading.confirmed, reading.evidence) == (True, True, why)
    assert reading.update_jump == (why == "update")  # the violent update is also an event of its own


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


def test_a_violent_update_is_its_own_event_whatever_the_norm():
    """The field notes' shape "grad norm normal, parameter delta abnormal": |dθ|/|θ| 4x the largest of the last 50
    steps is an update jump (GRPOParamUpdateJump) with a norm that did not move; a warm-up's growth by (k+1)/k
    a step is none."""
    spikes = GradNormSpikes(CONFIG)
    warmup = [spikes.observe(1.0, None, Evidence(ess=1.0, update=1e-4 * (k + 1))) for k in range(40)]
    assert not any(r.update_jump for r in warmup)
    jump = spikes.observe(1.0, None, Evidence(ess=1.0, update=4e-4 * 40 * 1.05))
    assert jump == Reading(update_jump=True)


def test_the_monitor_counts_an_update_jump_from_the_parameters_it_samples():
    """A learning rate multiplied by 100 from step 30 (plain SGD on a small model): the monitor's
    clip_grad_norm_ samples the parameters, the next step's |dθ|/|θ| jumps, and
    grpo_param_update_jump_steps_total counts it once; the steps before count nothing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(64, 16), torch.randn(64, 4)
    with GRPOMonitor(run="jump", group_size=8, port=None, guard="off", close_linger_s=0.0) as mon:
        counts = []
        for step in range(40):
            if step == 30:
                optimizer.param_groups[0]["lr"] = 0.1
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            mon.observe_update(step, loss=loss.detach())
            optimizer.zero_grad()
            loss.backward()
            mon.clip_grad_norm_(model.parameters(), 1e9)
            optimizer.step()
            counts.append(registry_value(mon, "grpo_param_update_jump_steps_total"))
        assert counts[30] == 0
        assert counts[-1] == 1


def test_a_second_spike_on_the_same_rollout_is_no_repeat():
    """Two epochs on one rollout share its batch: a spike on both is one fixed batch's (the notes' other shape:
    replay it), not a repeat. A spike on the next rollout is."""
    spikes = GradNormSpikes(CONFIG)
    for step in range(30):
        spikes.observe(1.0 + 0.02 * (step % 5), None, QUIET, step=step)
    assert spikes.observe(50.0, None, QUIET, step=30) == Reading(spike=True)
    assert spikes.observe(60.0, None, QUIET, step=30) == Reading(spike=True)  # its second epoch
    assert spikes.observe(70.0, None, QUIET, step=31) == Reading(spike=True, confirmed=True, evidence="repeat")


def test_the_flight_recorder_opens_an_incident_for_a_confirmed_spike_only(tmp_path):
    """The recorder's grad_norm_spike trigger follows the alert: a lone 50x spike opens no incident; a 50x spike
    whose next step has a NaN loss does (the incident opens at the confirming step)."""
    def run(folder, confirm: bool) -> float:
        with GRPOMonitor(run="rec", group_size=8, port=None, guard="off", recorder_dir=folder, close_linger_s=0.0,
                         recorder_triggers=("grad_norm_spike",)) as mon:
            for step, norm in enumerate([1.0 + 0.01 * (i % 7) for i in range(30)] + [50.0, 1.0, 1.0]):
                loss = math.nan if confirm and step == 31 else 0.5
                mon.observe_update(step, grad_norm_pre_clip=norm, max_grad_norm=100.0, loss=loss)
                mon.end_step()
            mon.wait_for_workers()
            return mon.metrics()["grpo_recorder_incidents_total"]

    assert run(tmp_path / "lone", confirm=False) == 0
    assert run(tmp_path / "confirmed", confirm=True) == 1
