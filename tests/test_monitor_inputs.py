"""One test per input hazard of issue 10 ("Inputs"): each failed on the monitor before it, through the public
API, with the numbers of the seed where one applies."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from grpo_exporter import GRPOMonitor, InputError
from grpo_exporter.inputs import StepInputs
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.runtime.monitor import MonitorClosedError
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.runtime.solve_rates import SolveRates
from monitor_helpers import parse_exposition, registry_value, scrape

SETTINGS = {"group_size": 8, "clip_eps": (0.2, 0.28), "port": None, "guard": "off", "edit_distance_groups": 0,
            "close_linger_s": 0.0}
ERRORS = 'grpo_exporter_errors_total{stage="%s"}'


def monitor(**overrides) -> GRPOMonitor:
    return GRPOMonitor(run="inputs", **(SETTINGS | overrides))


def tokens(n: int = 16, t: int = 4, shift: float = 0.0) -> dict[str, torch.Tensor]:
    old = -torch.rand(n, t, generator=torch.Generator().manual_seed(n))
    return {"logprobs": old + shift, "old_logprobs": old, "loss_mask": torch.ones(n, t, dtype=torch.bool),
            "advantages": torch.linspace(-1, 1, n)}


# ---- label safety ---------------------------------------------------------------------------------------


def test_component_names_cannot_inject_labels_or_break_later_steps():
    hostile = 'fmt",run="victim-run'
    with monitor(port=0) as mon:
        mon.observe_rollout(0, rewards=torch.zeros(8), reward_components={hostile: torch.ones(8)})
        series = parse_exposition(scrape(mon.url))["grpo_reward_mean"]
        assert (("component", hostile), ("run", "inputs")) in series  # the quote is escaped, run intact
        assert all(dict(labels)["run"] == "inputs" for labels in series)
        for bad in ("a\nb", "x" * 100_000, "tab\there", "{}\x00"):
            mon.observe_rollout(1, rewards=torch.zeros(8), reward_components={bad: torch.ones(8)})
        assert registry_value(mon, ERRORS % "rollout") == 4
        mon.observe_rollout(2, rewards=torch.zeros(8), reward_components={"braces{}": torch.ones(8)})
        assert registry_value(mon, ERRORS % "rollout") == 4  # later rollouts are unaffected
        assert registry_value(mon, 'grpo_reward_mean{component="braces{}"}') == 1.0
        body = scrape(mon.url)
        assert "victim-run\"}" not in body.replace('\\"', "")  # no series carries the injected run label


def test_run_label_is_validated_at_configuration():
    for bad in ("a\nb", "x" * 129):
        with pytest.raises(ValueError, match="run"):
            MonitorConfig(run=bad, group_size=8)


def test_a_reward_component_name_error_names_the_field():
    with pytest.raises(InputError, match=r"reward_components.*control characters"):
        StepInputs(rewards=torch.zeros(4), reward_components={"a\nb": torch.zeros(4)})


# ---- on_policy, the mask audit, grad norms ------------------------------------------------------------


def test_on_policy_on_the_first_micro_step_only_still_checks_it():
    """docs' old loop: on_policy=(micro is first). The monitor used all() over the micro-steps: never checked."""
    with monitor() as mon:
        x = tokens(32, shift=0.5)  # ratio e^0.5 = 1.65 > 1.28 on every token
        for i in range(4):
            rows = slice(8 * i, 8 * (i + 1))
            mon.observe_update(0, **{k: v[rows] for k, v in x.items()}, on_policy=i == 0)
        mon.end_step()
        assert registry_value(mon, "grpo_onpolicy_checked_tokens_total") == 8 * 4  # the flagged micro-step
        assert registry_value(mon, "grpo_onpolicy_outside_clip_ratio") == 1.0


def test_the_rollout_mask_audit_is_published_once_per_step():
    """README's loop passes completion_lengths to observe_rollout only; the audit ran only on the update."""
    lengths = torch.full((8,), 3)
    mask = torch.arange(4)[None, :] < lengths[:, None]
    mask[0, 3] = True  # a padding position trained on
    with monitor() as mon:
        mon.observe_rollout(0, rewards=torch.zeros(8), loss_mask=mask, completion_lengths=lengths)
        mon.observe_update(0, **tokens(8), on_policy=False)  # no lengths on the update: the rollout's audit counts
        mon.end_step()
        assert registry_value(mon, "grpo_loss_mask_outside_completion_tokens_total") == 1
        mon.observe_rollout(1, rewards=torch.zeros(8), loss_mask=mask, completion_lengths=lengths)
        mon.observe_update(1, **tokens(8), completion_lengths=torch.full((8,), 4))  # audits the mask it trains with
        mon.end_step()
        assert registry_value(mon, "grpo_loss_mask_outside_completion_tokens_total") == 1  # nothing twice


def test_framework_grad_norms_pass_through_micro_steps():
    with monitor() as mon:
        mon.observe_update(0, **tokens(8))
        mon.observe_update(0, **tokens(8))
        mon.observe_update(0, grad_norm_pre_clip=torch.tensor(3.0), max_grad_norm=1.0, loss=0.5)
        mon.end_step()
        assert registry_value(mon, "grpo_grad_norm_pre_clip") == 3.0
        assert registry_value(mon, "grpo_grad_norm_post_clip") == pytest.approx(1.0, rel=1e-5)
        assert registry_value(mon, "grpo_grad_clip_active_steps_total") == 1


def test_the_advantage_bound_is_never_the_bound_of_a_fragment():
    """A lone correct answer in a group of G=16 has |A| = (G-1)/sqrt(G) = 3.75 (seed). Split over two
    micro-batches of 8, the fragment's own bound is 7/sqrt(8) = 2.47: a false 'over the bound'."""
    g = 16
    rewards = torch.zeros(g)
    rewards[0] = 1.0
    adv = (rewards - rewards.mean()) / rewards.std()
    assert adv.abs().max().item() == pytest.approx(3.75)
    with monitor(group_size=g) as mon:
        for half in (slice(0, 8), slice(8, 16)):
            x = tokens(8)
            mon.observe_update(0, logprobs=x["logprobs"], old_logprobs=x["old_logprobs"], loss_mask=x["loss_mask"],
                               advantages=adv[half], rewards=rewards[half], group_ids=torch.zeros(8, dtype=torch.long))
        mon.end_step()
        assert registry_value(mon, "grpo_advantage_over_bound_sequences_total") == 0
        assert registry_value(mon, "grpo_advantage_bound") == pytest.approx(3.75)
        assert registry_value(mon, "grpo_advantage_abs_max") == pytest.approx(3.75)


def test_the_ratio_respects_the_users_clamp_and_no_inf_enters_a_cumulative_sum():
    with monitor(log_ratio_clamp=20.0) as mon:
        x = tokens(8)
        x["logprobs"] = x["old_logprobs"].clone()
        x["logprobs"][0, 0] += 100.0  # a finite log ratio above 88.7: exp overflows fp32 without the clamp
        for step in range(3):
            mon.observe_update(step, **x)
            mon.end_step()
        assert registry_value(mon, 'grpo_nonfinite_values_total{tensor="ratio"}') == 0
        assert registry_value(mon, "grpo_log_ratio_clamp_hit_tokens_total") == 3
        assert math.isfinite(registry_value(mon, "grpo_importance_weight_sum"))
    with monitor() as mon:  # no clamp configured: the overflow is a non-finite ratio, the sum stays finite
        mon.observe_update(0, **x)
        mon.end_step()
        assert registry_value(mon, 'grpo_nonfinite_values_total{tensor="ratio"}') == 1
        assert math.isfinite(registry_value(mon, "grpo_importance_weight_sum"))


def test_a_grouping_error_drops_only_the_group_metrics():
    """N = 12 with group_size 8 and no group_ids: before, the whole step vanished (NaN checks included)."""
    with monitor() as mon:
        rewards = torch.zeros(12)
        rewards[3] = math.nan
        x = tokens(12)
        mon.observe_rollout(0, rewards=rewards, correct=torch.zeros(12, dtype=torch.bool), **{
            "rollout_logprobs": x["old_logprobs"], "old_logprobs": x["old_logprobs"], "loss_mask": x["loss_mask"]})
        assert registry_value(mon, 'grpo_nonfinite_values_total{tensor="rewards"}') == 1
        assert registry_value(mon, "grpo_engine_logprob_gap_mean_nats") == 0.0
        assert registry_value(mon, "grpo_completions_total") == 12
        assert registry_value(mon, 'grpo_reward_mean{component="total"}') is None
        assert registry_value(mon, ERRORS % "rollout") >= 1


def test_the_solve_rate_table_follows_the_batches_device():
    rates = SolveRates(slots=64, prior=0.5, halflife=4.0)
    cpu = StepInputs(correct=torch.ones(4, dtype=torch.bool))
    rates.slots_of(cpu, torch.arange(4))
    assert rates.table is not None
    assert rates.table.device.type == "cpu"
    meta = StepInputs(correct=torch.ones(4, dtype=torch.bool, device="meta"))
    rates.slots_of(meta, torch.arange(4, device="meta"))  # another device: the table moves, nothing fails
    assert rates.table.device.type == "meta"


def test_a_step_that_never_ends_is_bounded_and_holds_no_graph():
    with monitor(max_pending_micro_steps=8) as mon:
        weight = torch.zeros(1, requires_grad=True)
        x = tokens(4)
        for _ in range(100):
            mon.observe_update(0, **(x | {"logprobs": x["logprobs"] + weight}))
        held = mon._stages.stitcher.pending
        assert len(held) == 8
        assert not any(p.logprobs.requires_grad for p in held)  # detached: no autograd graph is kept alive
        assert registry_value(mon, "grpo_dropped_micro_steps_total") == 92


def test_rollouts_that_overlap_updates_keep_the_steps_whole():
    """Async pipeline: rollout k+1 is observed while update k still runs."""
    with monitor() as mon:
        mon.observe_rollout(0, rewards=torch.zeros(8))
        mon.observe_rollout(1, rewards=torch.zeros(8))  # sampled ahead
        mon.observe_update(0, **tokens(8))
        mon.end_step()
        mon.observe_update(1, **tokens(8))
        mon.end_step()
        assert registry_value(mon, "grpo_steps_total") == 2
        assert registry_value(mon, "grpo_last_step") == 1
        assert registry_value(mon, "grpo_optimizer_steps_total") is None  # no grad norm was given
        assert registry_value(mon, 'grpo_update_tokens_total{advantage_sign="positive"}') == 2 * 4 * 4


# ---- small things -------------------------------------------------------------------------------------


def test_a_mask_must_be_bool_or_zero_one(caplog):
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    with monitor() as mon:
        x = tokens(8)
        mon.observe_update(0, **(x | {"loss_mask": torch.full((8, 4), 0.5)}))
        mon.end_step()
        assert registry_value(mon, ERRORS % "update") == 1
        assert registry_value(mon, "grpo_clipped_tokens_total") is None  # nothing computed from a 0.5 mask
        assert "`loss_mask`: expected a bool tensor, or 0/1 values, got 32 values other than 0 and 1" in caplog.text
        mon.observe_update(1, **(x | {"loss_mask": torch.ones(8, 4, dtype=torch.int64)}))  # 0/1 integers: fine
        mon.end_step()
        assert registry_value(mon, ERRORS % "update") == 1
    strict = GRPOMonitor(run="strict", strict=True, **SETTINGS)
    strict.observe_update(0, **(x | {"loss_mask": torch.full((8, 4), 0.5)}))  # checked with the step's transfer
    with pytest.raises(InputError, match="loss_mask"):
        strict.end_step()


def test_non_finite_reward_components_are_counted():
    with monitor() as mon:
        fmt = torch.tensor([math.nan] * 2 + [0.0] * 6)
        mon.observe_rollout(0, rewards=torch.zeros(8), reward_components={"fmt": fmt})
        assert registry_value(mon, 'grpo_nonfinite_values_total{tensor="reward_components"}') == 2


def test_calls_after_close_raise_a_clear_error():
    mon = monitor()
    mon.close()
    for call in (lambda: mon.observe_rollout(0, rewards=torch.zeros(8)), lambda: mon.observe_update(0),
                 mon.end_step, lambda: mon.observe_retrieval(0, torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)),
                 lambda: mon.observe_regression(0, torch.ones(8, dtype=torch.bool))):
        with pytest.raises(MonitorClosedError, match="after close"):
            call()
    mon.close()  # idempotent


def test_keyword_errors_raise_alike_in_both_observe_calls():
    with monitor() as mon:
        with pytest.raises(TypeError, match="unexpected keyword"):
            mon.observe_rollout(0, rewardz=torch.zeros(8))
        with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['advantage'\]"):
            mon.observe_update(0, advantage=torch.zeros(8))


def test_the_guard_and_the_alerts_share_their_stop_lines():
    guard, alerts = MonitorConfig(run="r", group_size=8), MixinConfig()
    assert guard.stop_lines == alerts.stop_lines
    assert guard.onpolicy_clip_stop_ratio == 0.01
    assert guard.engine_gap_stop_nats == 0.01  # seed: mean >= 0.01 stop
    assert guard.engine_gap_healthy_nats == 0.001  # seed: mean < 0.001 usually healthy


def test_step_numbers_are_integers_of_any_kind():
    import numpy as np

    with monitor() as mon:
        mon.observe_rollout(np.int64(3), rewards=torch.zeros(8))
        mon.observe_update(torch.tensor(3), **tokens(8))
        mon.end_step()
        assert registry_value(mon, "grpo_last_step") == 3
        assert registry_value(mon, "grpo_steps_total") == 1
        for bad in (3.0, True, "3", torch.tensor(3.0)):
            with pytest.raises(TypeError, match="`step`: expected an integer"):
                mon.observe_rollout(bad, rewards=torch.zeros(8))


# ---- per-step events counted in the process (issue 11) -------------------------------------------------


def test_stale_update_steps_are_counted_on_every_step():
    """A weight sync every 8 steps: staleness climbs 0..7 and resets. Steps 5, 6 and 7 of each cycle are more
    than 4 versions stale; a scrape right after each sync would only ever see 0."""
    with monitor() as mon:
        for step in range(32):
            mon.observe_update(step, **tokens(8), policy_version=step, rollout_policy_version=step - step % 8)
            mon.end_step()
        assert registry_value(mon, "grpo_stale_update_steps_total") == 4 * 3
        assert registry_value(mon, "grpo_rollout_staleness_versions") == 7


def test_micro_steps_that_cannot_be_stitched_are_counted_and_the_next_step_is_whole():
    with monitor() as mon:
        mon.observe_update(0, **tokens(8, t=4))
        mon.observe_update(0, **{k: v.to("meta") for k, v in tokens(8, t=4).items()})  # another device: no cat
        mon.end_step()
        assert registry_value(mon, ERRORS % "update") == 1
        mon.observe_update(1, **tokens(8, t=4))
        mon.end_step()
        assert registry_value(mon, ERRORS % "update") == 1
        assert registry_value(mon, 'grpo_update_tokens_total{advantage_sign="positive"}') == 4 * 4


def test_the_runs_own_clean_engine_gap_is_measured_and_frozen():
    """Seed: measure your own clean baseline. 20 rollouts at a gap of 1e-7 nats make the clean gap; a fault
    that multiplies it by 1000 (1e-4, a tenth of the fixed 0.001 line) leaves it frozen, and the rule pages on
    the multiple (rules/tests/layer1.test.yml)."""
    with monitor() as mon:
        x = tokens(8)
        for step in range(30):
            gap = 1e-7 if step < 25 else 1e-4
            mon.observe_rollout(step, rewards=torch.zeros(8), rollout_logprobs=x["old_logprobs"].double() + gap,
                                old_logprobs=x["old_logprobs"].double(), loss_mask=x["loss_mask"])
            clean = registry_value(mon, "grpo_engine_logprob_gap_clean_baseline_nats")
            assert (clean is None) == (step < 19)
        assert clean == pytest.approx(1e-7, rel=0.1)  # fp32 differences of log-probs near -0.5 (seed 4.1)
        assert registry_value(mon, "grpo_engine_logprob_gap_mean_nats") == pytest.approx(1e-4, rel=1e-3)


def test_an_onpolicy_ratio_that_leaves_the_runs_own_noise_is_published_with_its_baseline():
    """Seed: the first update's ratio equals 1. A trainer that recomputes old log-probs on its own path has a
    noise of its own (here 1e-6 nats); 20 on-policy updates freeze it, and a bf16 path later (|log r| 0.03,
    inside the clip band: no token outside [0.8, 1.28]) is 10^4 times it (GRPOOnPolicyRatioDrift pages on it,
    rules/tests/layer1.test.yml)."""
    with monitor() as mon:
        x = tokens(8)
        for step in range(30):
            noise = 1e-6 if step < 25 else 0.03
            sign = torch.where(torch.arange(4) % 2 == 0, 1.0, -1.0)
            mon.observe_update(step, **(x | {"logprobs": x["old_logprobs"] + noise * sign}), on_policy=True)
            mon.end_step()
            clean = registry_value(mon, "grpo_onpolicy_log_ratio_clean_baseline_nats")
            assert (clean is None) == (step < 19)
        assert clean == pytest.approx(1e-6, rel=0.2)
        assert registry_value(mon, "grpo_onpolicy_log_ratio_abs_max_nats") == pytest.approx(0.03, rel=1e-3)
        assert registry_value(mon, "grpo_onpolicy_outside_clip_ratio") == 0  # the 1% line sees nothing


def test_run_anchors_freeze_the_early_window_of_each_anchored_sample():
    """grpo_run_anchor: the mean of the first anchor_steps values, frozen, so a slow decline stays visible
    against it (a trailing baseline follows the decline)."""
    with monitor(anchor_steps=5) as mon:
        for step in range(12):
            entropy = torch.full((8, 4), 2.0 - 0.1 * step)
            mon.observe_update(step, **tokens(8), entropy=entropy)
            mon.end_step()
            anchor = registry_value(mon, 'grpo_run_anchor{metric="grpo_entropy_mean_nats",labels=""}')
            assert (anchor is None) == (step < 4)
        assert anchor == pytest.approx(2.0 - 0.1 * 2)  # the mean of steps 0..4
        assert registry_value(mon, "grpo_entropy_mean_nats") == pytest.approx(2.0 - 1.1)
        ess = registry_value(mon, 'grpo_run_anchor{metric="grpo_ess_ratio",labels="level=\'token\'"}')
        assert ess == pytest.approx(1.0)


# ---- string ids (verl's uid, TRL's prompt text) -------------------------------------------------------------


def test_string_ids_hash_stably_across_processes() -> None:
    """BLAKE2b of the UTF-8 bytes, top bit cleared: the same in a process with another hash seed (Python's
    hash() is salted per process, so ranks and restarts would disagree)."""
    import hashlib
    import os
    import subprocess
    import sys

    from grpo_exporter.ids import stable_id

    want = int.from_bytes(hashlib.blake2b(b"uid-0", digest_size=8).digest(), "little") & ((1 << 63) - 1)
    assert stable_id("uid-0") == want
    code = "from grpo_exporter.ids import stable_id; print(stable_id('uid-0'), stable_id([{'role': 'user'}]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(want), str(stable_id([{"role": "user"}]))]


def test_string_group_and_prompt_ids_give_the_metrics_of_integer_ids() -> None:
    """uid strings in any row order group exactly like the integer ids they stand for."""
    import numpy as np

    gen = torch.Generator().manual_seed(3)
    rewards = (torch.rand(16, generator=gen) < 0.5).float()
    ints = torch.arange(16) // 4
    perm = torch.randperm(16, generator=gen)
    names = np.array([f"uid-{int(i)}" for i in ints[perm]], dtype=object)
    seen = []
    for group_ids, prompt_ids, r in ((ints, ints, rewards), (names, list(names), rewards[perm])):
        mon = GRPOMonitor(run="ids", group_size=4, port=None, strict=True, close_linger_s=0)
        mon.observe_rollout(0, rewards=r, correct=r.bool(), group_ids=group_ids, prompt_ids=prompt_ids)
        seen.append(dict(mon.metrics()))
        mon.close()
    keys = [k for k in seen[0] if "zero_variance" in k or "pass_at" in k or "groups_total" in k or "std" in k]
    assert keys
    assert {k: seen[1][k] for k in keys} == pytest.approx({k: seen[0][k] for k in keys})


@pytest.mark.parametrize("bad", ["uid-0", 3.5, [1.5, 2.5]])
def test_ids_that_are_not_a_sequence_of_keys_are_refused_naming_the_field(bad: object) -> None:
    from grpo_exporter.ids import id_tensor

    with pytest.raises(InputError, match="group_ids"):
        id_tensor("group_ids", bad, None)  # type: ignore[arg-type]


def test_the_rounding_of_equal_rewards_is_a_zero_advantage():
    """A group of equal rewards normalised as (r - mean) / (std + 1e-4) in fp32 leaves the mean's rounding over
    eps (~1e-3 for rewards of 1.6), not an exact 0: it counts as a zero advantage (default tolerance 1e-2 with
    std normalisation). Without normalisation (advantage_norm none: 1e-6) the rounding is ~1e-7 and zero too,
    while a reward difference of 1e-3 is a real advantage."""
    from grpo_exporter.functional.samples import advantage_signs

    rewards = torch.full((16,), 1.6)
    normalised_advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    assert bool((normalised_advantages != 0).any())  # the rounding, divided by eps
    mask = torch.ones(16, 3, dtype=torch.bool)
    normalised = MonitorConfig(run="r", group_size=16).zero_advantage_atol
    plain = MonitorConfig(run="r", group_size=16, advantage_norm="none").zero_advantage_atol
    assert (normalised, plain) == (1e-2, 1e-6)
    assert bool(advantage_signs(normalised_advantages, mask, normalised).zero.all())
    assert not bool(advantage_signs(normalised_advantages, mask, 0.0).zero.any())
    differences = rewards - rewards.mean()
    differences[:8] += torch.tensor([1e-3, -1e-3] * 4)
    assert int(advantage_signs(differences, mask, plain).zero.sum()) == 8
    assert MonitorConfig(run="r", group_size=16, advantage_zero_atol=0.0).zero_advantage_atol == 0.0


def test_an_empty_step_is_skipped_silently_and_said_once(caplog):
    """N = 0 completions (a rank whose shard came out empty, a filtered-out batch): no error counted, one
    info line per stage, and the next step is measured as usual."""
    empty = {"rewards": torch.zeros(0), "rollout_logprobs": torch.zeros(0, 4), "old_logprobs": torch.zeros(0, 4),
             "completion_mask": torch.ones(0, 4, dtype=torch.bool), "correct": torch.zeros(0, dtype=torch.bool)}
    with caplog.at_level(logging.INFO, logger="grpo_exporter"), monitor() as mon:
        for step in (0, 1):
            mon.observe_rollout(step, **empty)
            mon.observe_update(step, logprobs=torch.zeros(0, 4), old_logprobs=torch.zeros(0, 4),
                               advantages=torch.zeros(0), loss_mask=torch.ones(0, 4, dtype=torch.bool))
            mon.end_step()
        mon.observe_rollout(2, rewards=torch.ones(8), correct=torch.ones(8, dtype=torch.bool))
        mon.end_step()
        m = mon.metrics()
    assert not any(k.startswith("grpo_exporter_errors_total") and v for k, v in m.items())
    said = [r.getMessage() for r in caplog.records if "empty batch" in r.getMessage()]
    assert len(said) == 2  # rollout and update, once each
    assert m['grpo_reward_mean{component="total"}'] == 1.0


def test_a_rollout_on_the_meta_device_leaves_the_next_cpu_rollout_measured():
    """A dry run on the meta device (no data: that rollout is counted as an error) used to leave the solve-rate
    table there, so every later CPU rollout failed too and the zero-variance prediction was never published."""
    def rollout(step: int, device: str) -> None:
        n = 8
        mon.observe_rollout(step, rewards=torch.ones(n, device=device), correct=torch.arange(n, device=device) % 2 == 0,
                            group_ids=(torch.arange(n) // 4).to(device), prompt_ids=(torch.arange(n) // 4).to(device))
        mon.end_step()

    with monitor(group_size=4) as mon:
        rollout(0, "meta")
        after_meta = registry_value(mon, ERRORS % "rollout")
        rollout(1, "cpu")
        rollout(2, "cpu")
        m = mon.metrics()
    assert after_meta == 1
    assert m[ERRORS % "rollout"] == 1  # no error after the device change
    assert 0 < m["grpo_zero_variance_groups_expected_ratio"] < 1
