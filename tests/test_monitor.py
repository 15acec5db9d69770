"""GRPOMonitor end to end inside one process: values through a fresh registry, counters over many steps,
micro-step accumulation, the never-crash policy, the guard, and configuration sources."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from batches import make_batch
from grpo_exporter import GRPOMonitor, InputError, MonitorConfig, TrainingSignalError
from grpo_exporter.catalog import CATALOG, MetricType, is_additive, parse_key
from grpo_exporter.functional.groups import contiguous_groups
from grpo_exporter.inputs import StepInputs
from grpo_exporter.step import compute_step
from monitor_helpers import expected_step, feed, registry_value, rollout_kwargs, update_kwargs

SETTINGS = {"group_size": 8, "clip_eps": (0.2, 0.28), "log_ratio_clamp": 20.0, "port": None, "guard": "off"}


def monitor(**overrides) -> GRPOMonitor:
    return GRPOMonitor(run="exp-42", **(SETTINGS | overrides))


def rollout_inputs(x: StepInputs) -> StepInputs:
    return StepInputs(**rollout_kwargs(x))


def update_inputs(x: StepInputs) -> StepInputs:
    return StepInputs(**update_kwargs(x))


def test_registry_values_equal_the_functional_metrics():
    with monitor() as mon:
        x = feed(mon, 0, seed=0)
        cfg = mon.config
        expected = expected_step(rollout_inputs(x), update_inputs(x), cfg)
        for key, value in expected.items():
            got = registry_value(mon, key)
            assert got == pytest.approx(value, rel=1e-12, abs=1e-15), key
        assert registry_value(mon, "grpo_steps_total") == 1
        assert registry_value(mon, "grpo_last_step") == 0
        assert registry_value(mon, "grpo_grad_norm_pre_clip") > 0


def test_counters_agree_exactly_over_a_multistep_run_and_pool_like_tokens():
    steps = range(5)
    with monitor() as mon:
        inputs = [feed(mon, step, seed=10 + step) for step in steps]
        totals: dict[str, float] = {}
        for x in inputs:
            for key, value in expected_step(rollout_inputs(x), update_inputs(x), mon.config).items():
                if is_additive(key):
                    totals[key] = totals.get(key, 0.0) + value
        for key, value in totals.items():
            assert registry_value(mon, key) == value, key
        # a fraction computed as a ratio of counters equals the per-token fraction of the pooled batch
        names = [name for name in update_kwargs(inputs[0]) if name != "on_policy"]
        pooled = StepInputs(**{name: torch.cat([update_kwargs(x)[name] for x in inputs]) for name in names})
        pooled_metrics = compute_step(pooled, mon.config)
        for bound, sign in (("upper", "positive"), ("lower", "negative")):
            ratio = registry_value(mon, f'grpo_clipped_tokens_total{{bound="{bound}"}}') / registry_value(
                mon, f'grpo_update_tokens_total{{advantage_sign="{sign}"}}'
            )
            assert ratio == pytest.approx(pooled_metrics[f'grpo_clipped_tokens_ratio{{bound="{bound}"}}'], rel=1e-12)
        sums = [registry_value(mon, f"grpo_importance_weight_{s}") for s in ("sum", "count")]
        assert sums == pytest.approx([pooled_metrics[f"grpo_importance_weight_{s}"] for s in ("sum", "count")])
        assert registry_value(mon, "grpo_steps_total") == 5


def test_micro_steps_are_accumulated_into_the_step():
    """Four micro-batches of one optimizer step publish what the whole batch gives, with one computation."""
    with monitor() as whole, monitor() as split:
        x = feed(whole, 0, seed=3)
        feed(split, 0, seed=3, micro=4)
        token_level = ("grpo_ess", "grpo_importance", "grpo_entropy", "grpo_clipped", "grpo_kl", "grpo_onpolicy")
        for m in CATALOG:
            if m.type in (MetricType.GAUGE, MetricType.SUMMARY) and m.name.startswith(token_level):
                for key in (k for k in whole.metrics() if parse_key(k)[0].startswith(m.name)):
                    assert split.metrics()[key] == pytest.approx(whole.metrics()[key], rel=1e-6), key
        assert split.metrics()["grpo_update_tokens_total{advantage_sign=\"positive\"}"] == whole.metrics()[
            "grpo_update_tokens_total{advantage_sign=\"positive\"}"
        ]
        assert x.loss_mask is not None


def test_update_metrics_wait_for_the_end_of_the_step():
    with monitor() as mon:
        x = make_batch(0).inputs()
        mon.observe_update(0, **update_kwargs(x))
        assert "grpo_ess_ratio{level=\"token\"}" not in mon.metrics()
        mon.observe_rollout(1, **rollout_kwargs(x))  # a rollout never ends an update step (async pipelines)
        assert "grpo_ess_ratio{level=\"token\"}" not in mon.metrics()
        mon.observe_update(1, **update_kwargs(x))  # an update of the next step ends it
        assert "grpo_ess_ratio{level=\"token\"}" in mon.metrics()


def test_an_exception_in_one_metric_does_not_stop_the_others(monkeypatch):
    import grpo_exporter.functional.diversity as diversity

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(diversity, "pass_at_ks", broken)
    with monitor() as mon:
        for step in range(3):
            feed(mon, step, seed=step)
        m = mon.metrics()
        assert not [k for k in m if k.startswith("grpo_pass_at_k_ratio")]
        assert 'grpo_reward_mean{component="total"}' in m
        assert 'grpo_ess_ratio{level="token"}' in m
        assert registry_value(mon, 'grpo_exporter_errors_total{stage="rollout"}') == 3
        assert registry_value(mon, "grpo_steps_total") == 3
    with monitor(strict=True) as mon, pytest.raises(RuntimeError, match="injected"):
        feed(mon, 0, seed=0)


def test_wrong_shapes_are_counted_or_raised_in_strict_mode(caplog):
    x = make_batch(0).inputs()
    bad = update_kwargs(x) | {"logprobs": x.logprobs[:, :-1]}
    with monitor() as mon, caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        mon.observe_update(0, **bad)
        mon.observe_update(0, **bad)
        assert registry_value(mon, 'grpo_exporter_errors_total{stage="update"}') == 2
        assert sum("InputError" in r.getMessage() for r in caplog.records) == 1  # once per stage per minute
        feed(mon, 1, seed=1)  # training goes on
        assert registry_value(mon, "grpo_steps_total") == 2
    with monitor(strict=True) as mon, pytest.raises(InputError, match="`old_logprobs`: expected"):
        mon.observe_update(0, **bad)


def test_nan_inputs_are_counted_and_never_published_as_nan():
    x = make_batch(1).inputs()
    kw = update_kwargs(x)
    kw["logprobs"] = kw["logprobs"].clone()
    kw["logprobs"][0, 0] = math.nan
    with monitor() as mon:
        mon.observe_update(0, **kw)
        mon.flush()
        assert registry_value(mon, 'grpo_nonfinite_values_total{tensor="logprobs"}') >= 1
        assert not [k for k, v in mon.metrics().items() if math.isnan(v)]


def clean_rollout(gap: float = 1e-4) -> dict:
    n, t = 16, 6
    old = torch.full((n, t), -1.0)
    return {
        "rewards": (torch.arange(n) % 3 == 0).float(),
        "loss_mask": torch.ones(n, t, dtype=torch.bool),
        "completion_lengths": torch.full((n,), t),
        "old_logprobs": old,
        "rollout_logprobs": old + gap,
    }


def test_guard_warns_with_layer_and_runbook(caplog):
    with monitor(guard="warn") as mon, caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        mon.observe_rollout(0, **clean_rollout())
        assert not caplog.records
        mon.observe_rollout(1, **clean_rollout(gap=0.05))
        (record,) = caplog.records
        line = record.getMessage()
        assert "[layer 1-gradient]" in line
        assert "runbook: docs/runbooks.md#grpoenginelogprobgapcritical" in line
        assert "\n" not in line


def test_guard_raises_at_the_end_of_observe_after_publishing():
    with monitor(guard="raise") as mon:
        mon.observe_rollout(0, **clean_rollout())
        systematic = r"engine log-prob gap is systematic: mismatch KL k1 \(the mean signed gap\) 0\.05"
        with pytest.raises(TrainingSignalError, match=systematic) as err:
            mon.observe_rollout(1, **clean_rollout(gap=0.05))
        assert [v.alert for v in err.value.violations] == ["GRPOEngineLogprobGapCritical"]
        assert mon.metrics()["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(0.05, rel=1e-4)


def test_guard_catches_a_ratio_clipped_before_any_update():
    n, t = 8, 4
    old = torch.full((n, t), -1.0)
    with monitor(guard="raise") as mon:
        mask = torch.ones(n, t, dtype=torch.bool)
        mon.observe_update(0, logprobs=old + 0.5, old_logprobs=old, loss_mask=mask, on_policy=True)
        with pytest.raises(TrainingSignalError, match="outside the clip range before any update"):
            mon.flush()


def test_reward_components_are_capped_and_overflow_counted():
    x = make_batch(0).inputs()
    components = {f"c{i}": x.rewards for i in range(5)}
    with monitor(max_reward_components=3) as mon:
        mon.observe_rollout(0, rewards=x.rewards, reward_components=components)
        mon.observe_rollout(1, rewards=x.rewards, reward_components=components)
        names = {parse_key(k)[1]["component"] for k in mon.metrics() if k.startswith("grpo_reward_mean")}
        assert names == {"total", "c0", "c1", "c2"}
        assert registry_value(mon, "grpo_dropped_reward_components_total") == 4


def test_solve_rate_history_predicts_zero_variance():
    """A prompt solved every time drives its posterior to p ~ 1 and its predicted zero-variance share to 1;
    a prompt solved half the time stays mixed."""
    g = 4
    ids = torch.arange(2).repeat_interleave(g)
    correct = torch.tensor([True] * g + [True, False] * (g // 2))
    with monitor(group_size=g, solve_rate_halflife=4.0) as mon:
        predictions = []
        for step in range(30):
            mon.observe_rollout(step, rewards=correct.float(), correct=correct, prompt_ids=ids)
            predictions.append(mon.metrics()["grpo_zero_variance_groups_expected_ratio"])
        # before any batch: Beta(1, 1) around the 0.5 prior -> P(k=0 or k=4) = 2/5
        assert predictions[0] == pytest.approx(0.4)
        rates = mon._stages.state.solve_rates
        solved = float(rates.predict(torch.tensor([0]), contiguous_groups(g, g)).sum(0)[0])
        half = float(rates.predict(torch.tensor([1]), contiguous_groups(g, g)).sum(0)[0])
        unseen = float(rates.predict(torch.tensor([7]), contiguous_groups(g, g)).sum(0)[0])
        # shrunk toward the population (p in {1, 0.5}: Beta(6, 2)), within a discounted history of ~25 samples
        assert solved > 0.75, (solved, half, unseen)
        assert half < 0.2, (solved, half, unseen)
        assert half < unseen < solved
        # the parts: a solved prompt's zero-variance chance is all-correct, almost none all-incorrect
        correct_part, incorrect_part = rates.predict(torch.tensor([0]), contiguous_groups(g, g))[:, 0]
        assert float(correct_part) > 0.75
        assert float(incorrect_part) < 0.01


def test_population_moments_follow_the_discounted_group_shares():
    """The population's E[p] and E[p^2] (kept on the host, moved by three sums that come back with the
    rollout's transfer) equal a Python reference: per rollout, move by (1 - keep) toward the mean over groups of
    two or more of k/n and k(k-1)/(n(n-1)); groups of one say nothing, a batch of only such groups moves nothing."""
    g, halflife = 4, 3.0
    keep = 0.5 ** (1.0 / halflife)
    rng = np.random.default_rng(5)
    mean, second = 0.5, 1.0 * 2.0 / 6.0  # the prior 0.5: Beta(1, 1)
    with monitor(group_size=g, solve_rate_halflife=halflife) as mon:
        for step in range(12):
            ids = torch.arange(3 * step, 3 * step + 3).repeat_interleave(g)
            correct = torch.from_numpy(rng.random(3 * g) < rng.random(3).repeat(g))
            mon.observe_rollout(step, rewards=correct.float(), correct=correct, prompt_ids=ids)
            hits = correct.view(3, g).sum(1).double()
            mean += (1 - keep) * (float((hits / g).mean()) - mean)
            second += (1 - keep) * (float((hits * (hits - 1) / (g * (g - 1))).mean()) - second)
            rates = mon._stages.state.solve_rates
            assert rates.mean == pytest.approx(mean, rel=1e-12), step
            assert rates.second == pytest.approx(second, rel=1e-12), step
        single = torch.tensor([True, False, True])
        mon.observe_rollout(12, rewards=single.float(), correct=single, prompt_ids=torch.arange(3),
                            group_ids=torch.arange(3))
        assert (rates.mean, rates.second) == pytest.approx((mean, second), rel=1e-12)


@pytest.mark.parametrize("shape", [(0.3, 0.3), (4.0, 1.0), (0.5, 3.0)], ids=["spread", "mostly-solved", "hard"])
def test_zero_variance_prediction_holds_for_spread_difficulty(shape):
    """The seed's averaging trap: prompts of spread difficulty (p ~ Beta(0.3, 0.3), G = 16) give ~0.43
    zero-variance groups; p at the mean predicts ~0. The Beta-binomial prediction (per prompt from its history,
    unseen prompts averaged over the fitted population) must track the observed share within far less than
    the default margin 0.1, for a task that is solved, unsolved or spread, prompts seen again or new."""
    g, per_batch = 16, 16
    rng = np.random.default_rng(11)
    pool = rng.beta(*shape, size=400)
    observed, predicted = [], []
    with monitor(group_size=g) as mon:
        for step in range(120):
            prompts = rng.choice(len(pool), size=per_batch, replace=False)
            p = np.repeat(pool[prompts], g)
            correct = torch.from_numpy(rng.random(per_batch * g) < p)
            mon.observe_rollout(step, rewards=correct.float(), correct=correct,
                                prompt_ids=torch.from_numpy(np.repeat(prompts, g)))
            if step >= 40:
                metrics = mon.metrics()
                observed.append(metrics["grpo_zero_variance_groups_ratio"])
                predicted.append(metrics["grpo_zero_variance_groups_expected_ratio"])
    truth = float(np.mean(pool**g + (1 - pool) ** g))
    mean_p = float(pool.mean())
    assert abs(np.mean(predicted) - np.mean(observed)) < 0.05, (np.mean(predicted), np.mean(observed), truth)
    assert abs(np.mean(predicted) - truth) < 0.05
    if shape == (0.3, 0.3):
        assert mean_p**g + (1 - mean_p) ** g < 0.01 < truth - 0.3  # the mean-p prediction the issue saw


def test_config_sources_and_precedence(tmp_path):
    file = tmp_path / "grpo.yaml"
    file.write_text("run: from-file\ngroup_size: 4\nclip_eps_high: 0.3\nport: null\n")
    env = {"GRPO_EXPORTER_GROUP_SIZE": "8", "GRPO_EXPORTER_PASS_K": "[2, 4]", "OTHER": "x"}
    cfg = MonitorConfig.load(file, environ=env, clip_eps=(0.1, 0.2))
    assert (cfg.run, cfg.group_size, cfg.pass_k) == ("from-file", 8, (2, 4))
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (0.1, 0.3)  # the file's explicit eps_high wins over clip_eps
    with pytest.raises(ValueError, match="group_size"):
        MonitorConfig.load(environ={"GRPO_EXPORTER_GROUP_SIZE": "zero"}, run="r")
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        MonitorConfig(run="r", group_size=4, tls_cert=file)
    with pytest.raises(ValueError, match="from `grpo-exporter hash-password`"):
        MonitorConfig(run="r", group_size=4, basic_auth_user="u", basic_auth_password_hash="secret")
    # an empty recorder_dir is off (not the current directory); a newline in it is an error naming the field
    assert MonitorConfig.load(environ={"GRPO_EXPORTER_RECORDER_DIR": ""}, run="r", group_size=4).recorder_dir is None
    assert MonitorConfig(run="r", group_size=4, recorder_dir="  ").recorder_dir is None
    with pytest.raises(ValueError, match=r"recorder_dir\n.*expected a directory path without control characters, "
                                         r"got '/tmp/a\\nb'"):
        MonitorConfig(run="r", group_size=4, recorder_dir="/tmp/a\nb")


def test_reference_baseline_file_is_checked_and_published(tmp_path):
    file = tmp_path / "baseline.yaml"
    file.write_text('grpo_engine_logprob_gap_mean_nats: 0.0004\ngrpo_pass_at_k_ratio{k="8"}: 0.61\n')
    with monitor(reference_baseline=str(file)) as mon:
        assert registry_value(
            mon, 'grpo_reference_baseline{metric="grpo_engine_logprob_gap_mean_nats",labels=""}'
        ) == pytest.approx(0.0004)
        assert registry_value(
            mon, "grpo_reference_baseline{metric=\"grpo_pass_at_k_ratio\",labels=\"k='8'\"}"
        ) == pytest.approx(0.61)
    file.write_text("grpo_engine_logprob_gap_mean: 0.0004\n")
    with pytest.raises(ValueError, match="did you mean 'grpo_engine_logprob_gap_mean_nats'"):
        monitor(reference_baseline=str(file))


def test_gauges_are_replaced_per_family():
    """A family computed this step takes its new values (absent ones dropped); a family whose inputs were not
    given keeps describing its last computation (the last on-policy update)."""
    n, t = 8, 4
    old = torch.full((n, t), -1.0)
    mask = torch.ones(n, t, dtype=torch.bool)
    with monitor() as mon:
        mon.observe_update(0, logprobs=old + 0.01, old_logprobs=old, advantages=torch.linspace(-1, 1, n),
                           loss_mask=mask, on_policy=True)
        mon.observe_update(1, logprobs=old + 0.3, old_logprobs=old, advantages=torch.linspace(-1, 1, n),
                           loss_mask=mask, on_policy=False)
        mon.flush()
        m = mon.metrics()
        assert m["grpo_onpolicy_log_ratio_abs_max_nats"] == pytest.approx(0.01, rel=1e-4)  # from step 0
        assert m['grpo_importance_weight{quantile="0.5"}'] == pytest.approx(math.exp(0.3), rel=1e-5)  # step 1
        assert 'grpo_clipped_tokens_ratio{bound="upper"}' in m
        mon.observe_update(2, logprobs=old, old_logprobs=old, advantages=torch.zeros(n), loss_mask=mask)
        mon.flush()
        assert 'grpo_clipped_tokens_ratio{bound="upper"}' not in mon.metrics()  # computed, absent: dropped
