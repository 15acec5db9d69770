"""verl adapter on real verl objects (run in .venv-frameworks by tests/test_integration_frameworks.py): a
``DataProto`` built by verl's own ``from_dict``, advantages from verl's ``compute_grpo_outcome_advantage`` and
every estimator verl registers (through verl's ``compute_advantage``), rows reordered as verl's
``balance_batch`` does, the v0 ``RayPPOTrainer`` hook, and verl's fully-async ``FullyAsyncTrainer`` run through
its own step methods."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import verl
from doc_snippets import assert_never_as_documented
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from grpo_exporter import GRPOMonitor
from grpo_exporter.integrations import IntegrationError
from grpo_exporter.integrations.verl import (
    VERL_METRICS,
    monitored_ray_trainer,
    observe_actor_metrics,
    observe_dataproto,
)
from grpo_exporter.integrations.verl_settings import ESTIMATOR_FORMS, advantage_form, monitor_settings

G, PROMPTS, T = 4, 6, 10
DRIFT = 0.02


def make_batch(seed: int = 0) -> tuple[DataProto, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    n = G * PROMPTS
    lengths = torch.randint(2, T + 1, (n,), generator=gen)
    lengths[0] = T  # at least one response fills the window: truncated
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    acc = (torch.rand(n, generator=gen) < 0.5).float()
    acc[:G] = 1.0  # prompt 0 solved by every sample: a zero-variance group
    scores = torch.zeros(n, T)
    scores[torch.arange(n), lengths - 1] = acc  # verl puts the sequence score on the last response token
    uid = np.array([f"uid-{i // G}" for i in range(n)], dtype=object)
    advantages, returns = compute_grpo_outcome_advantage(scores, mask, uid)
    old = -torch.rand(n, T, generator=gen) * 3
    tensors = {
        "responses": torch.randint(3, 50, (n, T), generator=gen),
        "prompts": torch.randint(3, 50, (n, 5), generator=gen),
        "response_mask": mask,
        "attention_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": scores,
        "old_log_probs": old,
        "rollout_log_probs": old - DRIFT,
        "ref_log_prob": old - 0.1,
        "advantages": advantages,
        "returns": returns,
    }
    non_tensors = {"uid": uid, "acc": acc.numpy().astype(bool), "index": np.array([i // G for i in range(n)])}
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    perm = torch.randperm(n, generator=gen)  # verl's balance_batch reorders rows: groups are not contiguous
    return data[perm.numpy()], {"acc": acc, "lengths": lengths, "advantages": advantages, "mask": mask}


def test_observe_dataproto_reads_verls_batch(tmp_path) -> None:
    data, truth = make_batch()
    monitor = GRPOMonitor(run="verl", group_size=G, port=None, strict=True, close_linger_s=0,
                          recorder_dir=tmp_path / "incidents", engine_gap_stop_nats=0.015)
    observe_dataproto(monitor, data, step=7)
    observe_actor_metrics(monitor, 7, {"actor/grad_norm": [3.0, 1.0], "actor/entropy": 1.5}, max_grad_norm=1.0)
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_groups_total"] == PROMPTS  # groups from the string uids, rows shuffled
    assert m['grpo_zero_variance_groups_total{outcome="all_correct"}'] >= 1
    assert m['grpo_pass_at_k_ratio{k="1"}'] == pytest.approx(float(truth["acc"].mean()))
    assert m['grpo_reward_mean{component="total"}'] == pytest.approx(float(truth["acc"].mean()))
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)
    assert m["grpo_truncated_completions_total"] == float((truth["lengths"] == T).sum())
    assert_never_as_documented(m, "verl v0 (`RayPPOTrainer`)")
    adv = truth["advantages"][truth["mask"].bool()].abs().max()
    assert m["grpo_advantage_abs_max"] == pytest.approx(float(adv), rel=1e-6)
    assert m["grpo_kl_ref_nats"] == pytest.approx(np.exp(-0.1) + 0.1 - 1, rel=1e-4)  # k3 of a constant 0.1 gap
    assert m["grpo_grad_norm_pre_clip"] == 2.0  # mini-batch mean, as verl's reduce_metrics
    assert m["grpo_entropy_mean_nats"] == 1.5
    assert m["grpo_steps_total"] == 1
    assert "grpo_importance_weight_count" not in m  # current log-probs stay in the workers: absent, not 1
    # the flight recorder: the engine 0.02 nats off on every token is a systematic gap (|k1| = 0.02 >= 0.01), and
    # above the stop line set here (0.015): the run's only step is its first anomalous one, written at close with
    # verl's prompt tokens in the rows
    from grpo_exporter.recorder.inspect import load

    incident = load(tmp_path / "incidents")
    assert incident["triggers"] == ["engine_gap"]
    assert incident["steps"] == {"last_normal": None, "first_anomalous": 7, "next": None}
    rows = incident["states"]["first_anomalous"]["rows"]["rollout"]
    assert all(len(r["prompt"]) == 5 for r in rows)
    assert rows[0]["engine_gap_mean"] == pytest.approx(DRIFT, abs=1e-5)


def test_mismatch_metrics_equal_verls_own_rollout_corr_diagnostics() -> None:
    """verl's own ``compute_offpolicy_metrics`` (rollout_corr/kl, k3_kl, chi2_token, chi2_seq, log_ppl_diff,
    ppl_ratio) on the batch the adapter reads, with a heavy-tailed engine noise: the same numbers."""
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    data, _ = make_batch(2)
    gen = torch.Generator().manual_seed(2)
    old = data.batch["old_log_probs"]
    torch.manual_seed(2)  # StudentT samples from the global generator
    noise = 0.05 * torch.distributions.StudentT(2.0).sample(old.shape)
    data.batch["rollout_log_probs"] = old + noise.clamp(-3, 3) + 0.01 * torch.rand(old.shape, generator=gen)
    theirs = compute_offpolicy_metrics(old, data.batch["rollout_log_probs"], data.batch["response_mask"])
    monitor = GRPOMonitor(run="verl-corr", group_size=G, port=None, strict=True, close_linger_s=0, guard="off")
    observe_dataproto(monitor, data, step=1)
    m = monitor.metrics()
    monitor.close()
    ours = {
        "kl": m['grpo_mismatch_kl_nats{estimator="k1"}'],
        "k3_kl": m['grpo_mismatch_kl_nats{estimator="k3"}'],
        "chi2_token": m['grpo_mismatch_chi_square{level="token"}'],
        "chi2_seq": m['grpo_mismatch_chi_square{level="sequence"}'],
        "log_ppl_diff": m["grpo_mismatch_log_ppl_diff_nats"],
        "ppl_ratio": m["grpo_mismatch_ppl_multiple"],
    }
    for name, value in ours.items():
        assert value == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


def _trainer(config: dict, entropy: float = 0.75) -> Any:
    """The v0 hook on verl's RayPPOTrainer with the worker calls answered as verl's workers answer them."""

    class Workers(RayPPOTrainer):
        def _compute_old_log_prob(self, batch: DataProto):
            result = DataProto.from_dict(tensors={
                "old_log_probs": batch.batch["old_log_probs"],
                "entropys": torch.full(batch.batch["responses"].shape, entropy)})
            return result, 0.0

        def _update_actor(self, batch: DataProto) -> DataProto:
            return DataProto.from_single_dict(data={}, meta_info={"metrics": {"actor/grad_norm": 4.0}})

    cls = monitored_ray_trainer(Workers)
    trainer = cls.__new__(cls)
    trainer.config = OmegaConf.create(config)
    trainer.global_steps = 1
    return trainer


def test_v0_trainer_hook_reports_each_step() -> None:
    """The v0 hook on verl's own RayPPOTrainer class hierarchy: the worker calls are the parts a CPU test
    cannot run (Ray worker groups), so the subclass answers them with what verl's workers return."""
    data, _ = make_batch(1)
    trainer = _trainer({"actor_rollout_ref": {"actor": {"grad_clip": 1.0}}})
    trainer.monitor = GRPOMonitor(run="verl-v0", group_size=G, port=None, strict=True, close_linger_s=0)
    for step in (1, 2):
        trainer.global_steps = step
        trainer._compute_old_log_prob(data)
        output = trainer._update_actor(data)
        assert output.meta_info["metrics"]["actor/grad_norm"] == 4.0
    m = trainer.monitor.metrics()
    trainer.monitor.close()
    assert m["grpo_steps_total"] == 2
    assert m["grpo_last_step"] == 2
    assert m["grpo_entropy_mean_nats"] == pytest.approx(0.75)  # per-token, from the old-log-prob pass
    assert m["grpo_grad_norm_pre_clip"] == 4.0
    assert m["grpo_grad_norm_post_clip"] == pytest.approx(1.0, abs=1e-5)  # grad_clip from verl's config
    assert m["grpo_grad_clip_active_steps_total"] == 2


def test_the_real_v0_trainer_class_is_accepted() -> None:
    cls = monitored_ray_trainer()
    assert issubclass(cls, RayPPOTrainer)


def test_every_series_the_verl_mapping_names_is_in_the_catalogue() -> None:
    import re

    from grpo_exporter.catalog import family_of

    names = {n for expr, _ in VERL_METRICS.values() for n in re.findall(r"grpo_[a-z_]+", expr)}
    assert names
    for name in names:
        family_of(name)


def test_decoupled_rejection_sampling_leaves_the_engine_gap_on_every_model_token() -> None:
    """verl's own compute_rollout_correction_and_add_to_batch (token_k1 rejection outside ratio [0.5, 2]) runs
    between the old-log-prob pass and the update, as in RayPPOTrainer.fit, and overwrites response_mask with the
    kept tokens. Three tokens 1.5 nats off are the mismatch it rejects: the engine gap and the lengths are still
    read on every model token, not on the tokens kept for agreeing."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    data, truth = make_batch(3)
    engine = data.batch["rollout_log_probs"].clone()
    mask = data.batch["response_mask"].bool()
    rows = mask[:, 0].nonzero().squeeze(1)[:3]
    engine[rows, 0] = data.batch["old_log_probs"][rows, 0] - 1.5
    data.batch["rollout_log_probs"] = engine
    trainer = _trainer({"algorithm": {"rollout_correction": {"bypass_mode": False}}})
    trainer.monitor = GRPOMonitor(run="verl-rs", group_size=G, port=None, strict=True, close_linger_s=0, guard="off")
    trainer._compute_old_log_prob(data)
    config = OmegaConf.create({"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    data, rs = compute_rollout_correction_and_add_to_batch(data, config)
    kept = data.batch["response_mask"].bool()
    assert rs["rollout_corr/rollout_rs_masked_fraction"] > 0  # verl rejected ...
    assert int((mask & ~kept).sum()) == 3  # ... exactly the three tokens
    trainer._update_actor(data)
    m = trainer.monitor.metrics()
    trainer.monitor.close()
    gap = (data.batch["old_log_probs"] - engine).abs()
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(float(gap[mask].mean()), rel=1e-5)
    assert float(gap[kept].mean()) < 0.5 * float(gap[mask].mean())  # what the kept tokens alone would read
    assert m['grpo_completion_length_tokens_sum{outcome="all"}'] == pytest.approx(float(truth["lengths"].sum()))
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0


def test_bypass_mode_publishes_no_engine_gap_instead_of_a_false_zero(caplog) -> None:
    """verl's apply_bypass_mode makes old_log_probs the engine's rollout_log_probs: a gap of exactly 0 by
    construction, a false healthy reading. It is absent, and said once; the rest of the rollout is read."""
    import logging

    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    data, truth = make_batch(4)
    apply_bypass_mode(data, OmegaConf.create({"bypass_mode": True}), OmegaConf.create({}))
    monitor = GRPOMonitor(run="verl-bypass", group_size=G, port=None, strict=True, close_linger_s=0)
    observe_dataproto(monitor, data, step=1)
    m = monitor.metrics()
    monitor.close()
    assert "grpo_engine_logprob_gap_mean_nats" not in m
    assert 'grpo_mismatch_kl_nats{estimator="k1"}' not in m
    assert m['grpo_pass_at_k_ratio{k="1"}'] == pytest.approx(float(truth["acc"].mean()))
    assert sum("bypass mode" in r.getMessage() for r in caplog.records) == 1
    # the trainer hook knows it from verl's config too (the batch may hold a copy)
    trainer = _trainer({"algorithm": {"rollout_correction": {"bypass_mode": True}}})
    trainer.monitor = GRPOMonitor(run="verl-bypass-2", group_size=G, port=None, strict=True, close_linger_s=0)
    data, _ = make_batch(4)
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"].clone()
    trainer._update_actor(data)
    assert "grpo_engine_logprob_gap_mean_nats" not in trainer.monitor.metrics()
    trainer.monitor.close()
    assert sum("bypass mode" in r.getMessage() for r in caplog.records) == 2  # said once per monitor


def test_a_multi_turn_batch_counts_tool_filled_windows_and_leaves_aborted_samples_out() -> None:
    """The agent loop's layout: response_mask is 0 on tool output, the attention mask's response window holds
    model and tool tokens. A window filled partly by a tool's output is truncated (verl's
    response_length/clip_ratio counts it); a sample aborted with no response token is no completion (verl's
    response/aborted_ratio), not a reward of 0; no loss-mask fault is read from the tool tokens."""
    data, _ = make_batch(5)
    n = len(data)
    window = torch.ones(n, T, dtype=torch.long)
    window[:, 8:] = 0  # every response ends at 8 tokens ...
    window[1] = 1  # ... but row 1, whose tool output fills the window
    model = window.clone()
    model[:, 3:5] = 0  # tool output at positions 3-4 of every response
    aborted = 2
    window[aborted] = 0
    model[aborted] = 0
    scores = torch.zeros(n, T)
    acc = torch.ones(n)
    acc[aborted] = 0.0  # verl's reward of an aborted sample
    scores[:, 0] = acc
    data.batch["attention_mask"] = torch.cat([torch.ones(n, 5, dtype=torch.long), window], dim=1)
    data.batch["response_mask"] = model
    data.batch["token_level_scores"] = scores
    data.non_tensor_batch["acc"] = acc.numpy().astype(bool)
    turns = np.arange(n) % 3 + 1  # the agent loop's __num_turns__: 1-3 turns, 2 tool calls per extra turn
    turns[aborted] = 5
    data.non_tensor_batch["__num_turns__"] = turns.astype(np.int32)
    data.non_tensor_batch["tool_call_counts"] = (2 * (turns - 1)).astype(np.int32)
    monitor = GRPOMonitor(run="verl-agent", group_size=G, port=None, strict=True, close_linger_s=0)
    observe_dataproto(monitor, data, step=1)
    observe_actor_metrics(monitor, 1, {"actor/grad_norm": 1.0})
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_completions_total"] == n - 1
    assert m['grpo_pass_at_k_ratio{k="1"}'] == 1.0  # the aborted sample is no failed completion
    assert m["grpo_truncated_completions_total"] == 1
    assert m['grpo_completion_length_tokens_sum{outcome="all"}'] == float(model.sum())  # the model's tokens
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    assert m["grpo_loss_mask_outside_completion_tokens_total"] == 0
    # num_turns/* and tool_call_counts/* as verl's metrics read them, over the completions (the aborted one out)
    kept = np.delete(turns, aborted)
    assert m["grpo_completion_turns_count"] == n - 1
    assert m["grpo_completion_turns_sum"] == kept.sum()
    assert (m['grpo_completion_turns{quantile="0"}'], m['grpo_completion_turns{quantile="1"}']) == (1, 3)
    assert m["grpo_tool_calls_total"] == 2 * (kept - 1).sum()
    assert m["grpo_aborted_completions_total"] == 1  # and counted apart, as verl's response/aborted_ratio


def test_the_clip_line_is_read_where_verls_engines_read_it() -> None:
    """verl's engines clip at actor.optim.clip_grad (actor.grad_clip is deprecated and copied there)."""
    from grpo_exporter.integrations.verl_settings import _grad_clip

    assert _grad_clip(OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {"clip_grad": 0.5},
                                                                        "grad_clip": 1.0}}})) == 0.5
    assert _grad_clip(OmegaConf.create({"actor_rollout_ref": {"actor": {"grad_clip": 1.0}}})) == 1.0
    assert _grad_clip(OmegaConf.create({})) is None
    trainer = _trainer({"actor_rollout_ref": {"actor": {"optim": {"clip_grad": 2.0}}}})
    trainer.monitor = GRPOMonitor(run="verl-clip", group_size=G, port=None, strict=True, close_linger_s=0)
    data, _ = make_batch(1)
    trainer._compute_old_log_prob(data)
    trainer._update_actor(data)
    m = trainer.monitor.metrics()
    trainer.monitor.close()
    assert m["grpo_grad_norm_post_clip"] == pytest.approx(2.0, abs=1e-5)  # 4.0 clipped at 2.0


def test_fully_async_batches_give_the_rollout_staleness() -> None:
    """verl's fully-async trainer tags each trajectory with the parameter versions it started and ended on
    (non_tensor_batch min_global_steps / max_global_steps): the oldest start against the trainer's version is
    the staleness, past staleness_max_versions a stale update step."""
    data, _ = make_batch(6)
    n = len(data)
    data.non_tensor_batch["min_global_steps"] = np.array([10] * (n - 3) + [9, 9, 3])
    data.non_tensor_batch["max_global_steps"] = np.full(n, 10)
    # the key verl's assemble_batch_from_rollout_samples writes (the rollouter's status under fully_async/)
    data.meta_info["fully_async/count/dropped_stale_samples"] = 4
    monitor = GRPOMonitor(run="verl-async", group_size=G, port=None, strict=True, close_linger_s=0)
    observe_dataproto(monitor, data, step=5, policy_version=10)
    observe_actor_metrics(monitor, 5, {"actor/grad_norm": 1.0})
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_rollout_staleness_versions"] == 7
    assert m["grpo_stale_update_steps_total"] == 1
    assert m["grpo_partial_completions_total"] == 3  # begun on older weights, finished on 10: partial rollouts
    assert m["grpo_dropped_stale_completions_total"] == 4  # the rollouter's running total, first seen
    # fully_async/trajectory_staleness/{mean,max} (verl PR #7569): each trajectory's age from its oldest start,
    # weighted by its loss tokens
    tokens = data.batch["response_mask"].sum(dim=1).double()
    ages = 10 - torch.tensor(data.non_tensor_batch["min_global_steps"].astype(np.int64)).double()
    assert m["grpo_token_staleness_mean_versions"] == pytest.approx(float((ages * tokens).sum() / tokens.sum()))
    assert m["grpo_token_staleness_max_versions"] == 7
    assert "grpo_aborted_completions_total" not in m  # every row has a response token


def test_every_verl_metric_the_mapping_names_is_in_verls_source() -> None:
    """The verl keys of VERL_METRICS are the ones verl logs (rollout_corr/<key> is built from its helper's
    metric keys)."""
    from pathlib import Path

    import verl

    root = Path(verl.__file__).parent
    sources = {p: p.read_text() for folder in ("trainer/ppo", "experimental/fully_async_policy")  # v0, v1, async
               for p in (root / folder).rglob("*.py")}
    text = "\n".join(sources.values())
    for key in VERL_METRICS:
        if key.startswith("rollout_corr/"):
            name = key.removeprefix("rollout_corr/")
            assert f'metrics["{name}"]' in sources[root / "trainer" / "ppo" / "rollout_corr_helper.py"], key
        else:
            assert f'"{key}"' in text, key


def test_the_docs_v0_lines_run_as_written(monkeypatch, caplog, tmp_path) -> None:
    """docs/quickstart-verl.md's v0 lines, as written but for a free port and a targets directory of this test's
    own, where verl's TaskRunner builds
    RayPPOTrainer: the object is verl's trainer class with the hooks and a monitor of the run's group size and
    advantage form, and verl's deprecation of its v0 trainer is passed on. (RayPPOTrainer's __init__ builds Ray
    worker groups: it is stood in by one that keeps the config.)"""
    from doc_snippets import snippet

    seen: dict[str, Any] = {}

    def init(self: Any, config: Any, **kwargs: Any) -> None:
        self.config = config
        seen.update(kwargs)

    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    monkeypatch.setattr("grpo_exporter.integrations.verl._SAID_V0", [])
    monkeypatch.setattr(RayPPOTrainer, "__init__", init)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": G}},
                               "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False}})
    names: dict[str, Any] = {"config": config, "trainer_kwargs": {"tokenizer": "the tokenizer"}}
    code, shared = snippet("monitored_ray_trainer"), 'targets_dir="/shared/prometheus/targets"'
    assert shared in code
    exec(code.replace(shared, f"targets_dir={str(tmp_path)!r}, port=0"), names)
    trainer = names["trainer"]
    try:
        assert isinstance(trainer, RayPPOTrainer)
        assert type(trainer).__name__ == "MonitoredRayPPOTrainer"
        assert seen == {"tokenizer": "the tokenizer"}
        assert trainer.monitor.config.group_size == G
        assert trainer.monitor.config.advantage_norm == "none"  # Dr. GRPO: norm_adv_by_std_in_grpo=False
        assert trainer.monitor.config.run == "exp-42"  # the run the lines name, over the config's
        assert trainer.monitor.url is not None
        announced = f"grpo-exp-42@{trainer.monitor.target.replace(':', '_')}.json"
        assert (tmp_path / announced).exists()  # the target announced where the lines say
    finally:
        trainer.monitor.close()
    said = [r.getMessage() for r in caplog.records if "v0 trainer" in r.getMessage()]
    assert len(said) == 1
    assert "monitored_task_runner" in said[0]


def test_a_dapo_loops_filter_counts_are_published_with_its_kept_batch() -> None:
    """The DAPO recipe's filter (algorithm.filter_groups) hands the kept batch and what it generated and dropped:
    observe_dataproto passes the counts on, and the kept share is the batch's groups over those generated."""
    data, _ = make_batch(7)
    groups = len(set(data.non_tensor_batch["uid"]))
    monitor = GRPOMonitor(run="verl-dapo", group_size=G, port=None, strict=True, close_linger_s=0)
    counts = {"generated_groups": 3 * groups, "filtered_all_correct_groups": groups,
              "filtered_all_incorrect_groups": 1}
    observe_dataproto(monitor, data, step=1, filter_counts=counts)
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_generated_groups_total"] == 3 * groups
    assert m['grpo_filtered_groups_total{outcome="all_correct"}'] == groups
    assert m["grpo_kept_groups_ratio"] == pytest.approx(1 / 3)


GROUP, SOLVE_PROMPTS = 8, 64  # the estimator sweep: G=8, 64 prompts of solve rates 0.5 .. 0.95
CONFIG = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"


def verl_config(**overrides: Any) -> Any:
    """verl's generated PPO trainer config with ``overrides`` (dotted keys)."""
    cfg = OmegaConf.load(CONFIG)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def solve_rate_batch(seed: int) -> DataProto:
    """G=8 samples of 64 prompts whose solve rates run 0.5 .. 0.95 (a 0/1 score on the last response token, a
    second reward key for GDPO), with what verl's estimators read besides: values (GAE), greedy baselines
    (ReMax), old log-probs and sum pi^2 (the optimal token baseline), ref log-probs (the KL in the reward)."""
    gen = torch.Generator().manual_seed(seed)
    n = GROUP * SOLVE_PROMPTS
    rates = torch.linspace(0.5, 0.95, SOLVE_PROMPTS).repeat_interleave(GROUP)
    acc = (torch.rand(n, generator=gen) < rates).float()
    lengths = torch.randint(3, T + 1, (n,), generator=gen)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    scores = torch.zeros(n, T)
    scores[torch.arange(n), lengths - 1] = acc
    old = -torch.rand(n, T, generator=gen) * 2
    tensors = {
        "responses": torch.randint(3, 50, (n, T), generator=gen),
        "prompts": torch.randint(3, 50, (SOLVE_PROMPTS, 4), generator=gen).repeat_interleave(GROUP, 0),
        "response_mask": mask, "attention_mask": torch.cat([torch.ones(n, 4, dtype=torch.long), mask], dim=1),
        "token_level_scores": scores, "old_log_probs": old,
        "ref_log_prob": old - 0.3 * torch.rand(n, T, generator=gen),
        "values": 0.1 * torch.randn(n, T, generator=gen), "reward_baselines": torch.rand(n, generator=gen).round(),
        "sum_pi_squared": torch.rand(n, T, generator=gen),
    }
    non_tensors = {"uid": np.array([f"uid-{i // GROUP}" for i in range(n)], dtype=object), "acc": acc.numpy(),
                   "index": np.arange(n) // GROUP, "format": torch.rand(n, generator=gen).numpy()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def estimate(estimator: str, norm: bool, kl_in_reward: bool, seed: int = 0) -> tuple[Any, DataProto]:
    """verl's own advantages for a config: its KL penalty in the reward (``apply_kl_penalty``, as RayPPOTrainer.fit
    applies it) and its ``compute_advantage`` dispatch, with the arguments RayPPOTrainer.fit passes."""
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage

    cfg = verl_config(**{"algorithm.adv_estimator": estimator, "algorithm.norm_adv_by_std_in_grpo": norm,
                         "algorithm.use_kl_in_reward": kl_in_reward, "algorithm.kl_ctrl.kl_coef": 0.1,
                         "algorithm.gdpo_reward_keys": ["acc", "format"], "actor_rollout_ref.rollout.n": GROUP})
    data = solve_rate_batch(seed)
    if kl_in_reward:
        data, _ = apply_kl_penalty(data, core_algos.get_kl_controller(cfg.algorithm.kl_ctrl), kl_penalty="kl")
    else:
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    if estimator == "grpo_vectorized":  # its signature takes no reward_baselines, which the dispatch passes on
        data.batch.pop("reward_baselines")
    data = compute_advantage(data, adv_estimator=cfg.algorithm.adv_estimator, gamma=cfg.algorithm.gamma,
                             lam=cfg.algorithm.lam, num_repeat=GROUP,
                             norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, config=cfg.algorithm)
    return cfg, data


def advantage_readings(data: DataProto, **settings: Any) -> dict[str, float]:
    """The advantage check's readings of one step of ``data`` (the form found, counted per sequence)."""
    monitor = GRPOMonitor(port=None, strict=True, close_linger_s=0, **settings)
    observe_dataproto(monitor, data, step=1)
    monitor.end_step()
    m = monitor.metrics()
    monitor.close()
    forms = {k.split('"')[1] for k, v in m.items() if k.startswith("grpo_advantage_form_sequences_total") and v}
    return {"over": m["grpo_advantage_over_bound_sequences_total"],
            "inconsistent": m["grpo_advantage_inconsistent_sequences_total"], "forms": forms}


def test_every_estimator_verl_registers_is_checked_as_the_form_it_computes() -> None:
    """Every estimator verl 0.9.1 registers (core_algos.ADV_ESTIMATOR_REGISTRY), with and without
    norm_adv_by_std_in_grpo and the KL penalty in the reward, on G=8 x 64 prompts of solve rates 0.5 .. 0.95:
    verl's advantages handed to a monitor made by monitor_settings(config) count nothing over the bound and
    nothing inconsistent (both critical alerts), and follow the form configured (GRPOAdvantageFormUnexpected
    stays silent). Where the form matters, the GRPO z-score or Dr. GRPO form would have paged."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    from grpo_exporter.functional.advantage_form import COMPATIBLE

    assert set(ESTIMATOR_FORMS) == set(ADV_ESTIMATOR_REGISTRY)  # a new estimator is a form to map
    paged = {}
    for estimator in sorted(ADV_ESTIMATOR_REGISTRY):
        for norm in (True, False):
            for kl in (False, True):
                cfg, data = estimate(estimator, norm, kl)
                settings = monitor_settings(cfg, run="verl-forms")
                form = settings["advantage_norm"]
                read = advantage_readings(data, **settings)
                case = (estimator, norm, kl, form, read)
                assert read["over"] == 0, case
                assert read["inconsistent"] == 0, case
                assert read["forms"] <= {form, "unknown", *COMPATIBLE.get(form, ())}, case
                if form not in ("unbiased", "none"):
                    naive = "unbiased" if norm else "none"
                    wrong = advantage_readings(data, run="verl-naive", group_size=GROUP, advantage_norm=naive)
                    if wrong["over"] or wrong["inconsistent"]:
                        paged[(estimator, norm, kl)] = naive
    assert advantage_form(verl_config(**{"algorithm.adv_estimator": "grpo"})) == "unbiased"
    assert advantage_form(verl_config(**{"algorithm.adv_estimator": "grpo",
                                         "algorithm.norm_adv_by_std_in_grpo": False})) == "none"
    # Dr. GRPO's bound is of the rewards the advantage came from: score - KL with the KL in the reward
    assert advantage_form(verl_config(**{"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": True,
                                         "algorithm.norm_adv_by_std_in_grpo": False})) == "none"
    assert {e for e, _, _ in paged} >= {"gdpo", "opo", "remax", "grpo_passk"}, paged


def test_the_rewards_handed_with_the_advantages_are_those_they_came_from() -> None:
    """Dr. GRPO with the KL in the reward (verl: r - mean_g of score - beta x KL): the rollout's reward is the
    score (verl's critic/score), the update's the summed token_level_rewards, so that the group-centred form and
    its (G-1)/G x range bound hold; judged on the scores, the same advantages page."""
    cfg, data = estimate("grpo", norm=False, kl_in_reward=True)
    read = advantage_readings(data, **monitor_settings(cfg, run="verl-kl"))
    assert read == {"over": 0, "inconsistent": 0, "forms": {"none"}}
    monitor = GRPOMonitor(run="verl-kl-2", group_size=GROUP, port=None, strict=True, close_linger_s=0)
    observe_dataproto(monitor, data, step=1)
    m = monitor.metrics()
    monitor.close()
    scores = data.batch["token_level_scores"].sum(dim=-1)
    assert m['grpo_reward_mean{component="total"}'] == pytest.approx(float(scores.mean()))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # the scores as the update's rewards
    assert advantage_readings(data, **monitor_settings(cfg, run="verl-kl-3"))["over"] > 0


def test_an_estimator_verl_does_not_register_is_refused_and_your_settings_win(monkeypatch, tmp_path) -> None:
    """An estimator of yours (verl's register_adv_est) has no known form: refused, unless you name it. What you
    set wins over what the config derives: a keyword, a GRPO_EXPORTER_* variable, the config file's."""
    cfg = verl_config(**{"algorithm.adv_estimator": "my_estimator", "actor_rollout_ref.rollout.n": GROUP,
                         "trainer.experiment_name": "exp-7"})
    with pytest.raises(IntegrationError, match="my_estimator"):
        monitor_settings(cfg)
    assert monitor_settings(cfg, advantage_norm="none") == {
        "group_size": GROUP, "run": "exp-7", "kl_coef": 0.0, "advantage_norm": "none"}
    monkeypatch.setenv("GRPO_EXPORTER_ADVANTAGE_NORM", "population")
    monkeypatch.setenv("GRPO_EXPORTER_RUN", "from-env")
    assert monitor_settings(cfg) == {"group_size": GROUP, "kl_coef": 0.0}
    monkeypatch.delenv("GRPO_EXPORTER_ADVANTAGE_NORM")
    monkeypatch.delenv("GRPO_EXPORTER_RUN")
    settings_file = tmp_path / "exporter.yaml"
    settings_file.write_text("advantage_norm: batch\ngroup_size: 16\n")
    assert monitor_settings(cfg, config_file=str(settings_file)) == {
        "run": "exp-7", "kl_coef": 0.0, "config_file": str(settings_file)}


def test_a_handed_in_monitor_of_another_form_is_told_once(caplog) -> None:
    """v0: the monitor is yours. Checked as z-scores, RLOO's advantages would be judged against the wrong
    bound: one warning names verl's form (the step is still read)."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    trainer = _trainer({"algorithm": {"adv_estimator": "rloo"}})
    trainer.monitor = GRPOMonitor(run="verl-v0-form", group_size=G, port=None, strict=True, close_linger_s=0)
    data, _ = make_batch(1)
    for step in (1, 2):
        trainer.global_steps = step
        trainer._update_actor(data)
    m = trainer.monitor.metrics()
    trainer.monitor.close()
    said = [r.getMessage() for r in caplog.records if "adv_estimator" in r.getMessage()]
    assert len(said) == 1
    assert "'batch'" in said[0]
    assert "'unbiased'" in said[0]
    assert m["grpo_steps_total"] == 2


def test_v0_rollouts_tagged_by_verls_weight_sync_are_fresh_and_give_the_engine_gap() -> None:
    """verl's v0 fit syncs the weights to the rollout servers as global_steps after each update (update_weights(
    global_steps); the servers tag their outputs with it): a fresh rollout of step s carries s - 1. It is read as
    fresh (staleness 0) and gives the engine gap; a server that never had its version set writes None: no
    version is read, the gap still is."""
    data, _ = make_batch(8)
    n = len(data)
    trainer = _trainer({})
    trainer.monitor = GRPOMonitor(run="verl-v0-tags", group_size=G, port=None, strict=True, close_linger_s=0)
    trainer.global_steps = 5
    data.non_tensor_batch["min_global_steps"] = np.full(n, 4, dtype=object)
    data.non_tensor_batch["max_global_steps"] = np.full(n, 4, dtype=object)
    trainer._compute_old_log_prob(data)
    trainer._update_actor(data)
    m = trainer.monitor.metrics()
    assert m["grpo_rollout_staleness_versions"] == 0
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)
    assert m["grpo_partial_completions_total"] == 0
    trainer.global_steps = 6
    data.non_tensor_batch["min_global_steps"] = np.full(n, None, dtype=object)
    data.non_tensor_batch["max_global_steps"] = np.full(n, None, dtype=object)
    trainer._update_actor(data)
    m = trainer.monitor.metrics()
    trainer.monitor.close()
    assert m["grpo_steps_total"] == 2
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)
    assert m["grpo_stale_update_steps_total"] == 0


def dataset_rows(prompts: list[str], extra_info: list[dict | None]) -> dict[str, Any]:
    """The batch dict verl's dataloader hands RayPPOTrainer.fit: verl's own RLHFDataset.__getitem__ on these rows
    (a parquet's rows, without multimodal columns; the dataset's file loading and prompt filtering, which need a
    tokenizer, are left out) through verl's collate_fn."""
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    dataset = RLHFDataset.__new__(RLHFDataset)
    dataset.dataframe = [{"prompt": [{"role": "user", "content": p}], "data_source": "test", "extra_info": e}
                         for p, e in zip(prompts, extra_info, strict=True)]
    dataset.prompt_key, dataset.image_key, dataset.video_key, dataset.audio_key = "prompt", "images", "videos", "audios"
    dataset.processor, dataset.need_tools_kwargs = None, False
    return collate_fn([dataset[i] for i in range(len(prompts))])


def test_verls_default_index_is_no_prompt_identity_and_the_prompt_tokens_are(caplog) -> None:
    """verl's RLHFDataset sets index 0 where a row's extra_info has none: every prompt would be one prompt (its
    solve-rate history merged). Such a batch (one index over several uid groups) is identified by its prompt
    token ids instead, the padding left out (v0 left-pads to the batch's longest prompt), from then on; said
    once. A dataset that sets extra_info.index keeps it."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    rows = dataset_rows(["1+1?", "2+2?", "3+3?"], [None, {"split": "train"}, None])
    assert list(rows["index"]) == [0, 0, 0]  # verl's default
    kept = dataset_rows(["1+1?", "2+2?"], [{"index": 11}, {"index": 12}])
    assert list(kept["index"]) == [11, 12]

    def batch_of(index: np.ndarray, prompt_tokens: list[list[int]], pad_to: int) -> DataProto:
        data, _ = make_batch(9)
        data = data[np.arange(len(prompt_tokens) * G)]
        prompts = torch.zeros(len(prompt_tokens) * G, pad_to, dtype=torch.long)
        prompt_mask = torch.zeros_like(prompts)
        for i, tokens in enumerate(prompt_tokens):
            prompts[i * G:(i + 1) * G, pad_to - len(tokens):] = torch.tensor(tokens)  # verl's left padding
            prompt_mask[i * G:(i + 1) * G, pad_to - len(tokens):] = 1
        data.batch["prompts"] = prompts
        data.batch["attention_mask"] = torch.cat([prompt_mask, data.batch["attention_mask"]], dim=1)
        data.non_tensor_batch["index"] = np.repeat(index, G)
        data.non_tensor_batch["uid"] = np.array([f"uid-{pad_to}-{i // G}" for i in range(len(data))], dtype=object)
        return data

    monitor = GRPOMonitor(run="verl-index", group_size=G, port=None, strict=True, close_linger_s=0)
    handed: list[Any] = []
    observe = monitor.observe_rollout
    monitor.observe_rollout = lambda step, **kw: (handed.append(kw.get("prompt_ids")), observe(step, **kw))[1]
    a, b, c = [5, 6, 7], [8, 9], [5, 6, 7, 1]
    observe_dataproto(monitor, batch_of(rows["index"], [a, b, c], 4), step=1)
    observe_dataproto(monitor, batch_of(np.array([0]), [b], 6), step=2)  # one group: the index says nothing
    monitor.close()
    first, second = handed
    assert len(set(first)) == 3  # three prompts, not one
    assert all(len(set(first[i * G:(i + 1) * G])) == 1 for i in range(3))
    assert first[G] == second[0]  # prompt b, padded to 4 and to 6
    assert sum("index" in r.getMessage() and "prompt token ids" in r.getMessage() for r in caplog.records) == 1
    monitor = GRPOMonitor(run="verl-index-2", group_size=G, port=None, strict=True, close_linger_s=0)
    handed.clear()
    observe = monitor.observe_rollout
    monitor.observe_rollout = lambda step, **kw: (handed.append(kw.get("prompt_ids")), observe(step, **kw))[1]
    observe_dataproto(monitor, batch_of(np.asarray(kept["index"]), [a, b], 4), step=1)
    monitor.close()
    assert list(handed[0][::G]) == [11, 12]


def test_the_v0_hook_refuses_verls_fully_async_trainer() -> None:
    """verl's FullyAsyncTrainer is a Ray actor class whose rollouts carry parameter versions: the v0 hook, which
    would count versions in steps, refuses it at once, naming the hook that works."""
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer

    for base in (FullyAsyncTrainer, FullyAsyncTrainer.__ray_actor_class__):
        with pytest.raises(IntegrationError, match="monitored_fully_async_task_runner"):
            monitored_ray_trainer(base)


def fully_async_config(**overrides: Any) -> Any:
    """verl's fully-async trainer config (its recipe's yaml over the PPO trainer's), decoupled rollout correction,
    GRPO of G samples, two local updates per parameter sync."""
    recipe = OmegaConf.load(Path(verl.__file__).parent / "experimental" / "fully_async_policy" / "config"
                            / "fully_async_ppo_trainer.yaml")
    for key in ("hydra", "defaults"):
        recipe.pop(key)
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG), recipe)
    settings = {"actor_rollout_ref.hybrid_engine": False, "actor_rollout_ref.rollout.n": G,
                "algorithm.adv_estimator": "grpo", "algorithm.rollout_correction.bypass_mode": False,
                "async_training.trigger_parameter_sync_step": 2, "trainer.logger": ["console"],
                "trainer.experiment_name": "verl-fully-async", **overrides}
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def rollout_samples(versions: list[tuple[int, int]], dropped: int, seed: int) -> list[Any]:
    """One RolloutSample per prompt as verl's FullyAsyncRollouter puts it in its queue: the agent loop's G rows
    (prompt, response, rm_scores on the last token, the engine's log-probs, the weight versions each trajectory
    started and ended on, the reward's extra info) and the rollouter's statistics."""
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for p, (start, end) in enumerate(versions):
        lengths = torch.randint(2, T + 1, (G,), generator=gen)
        mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
        acc = (torch.rand(G, generator=gen) < 0.5).float()
        scores = torch.zeros(G, T)
        scores[torch.arange(G), lengths - 1] = acc
        tensors = {"prompts": torch.randint(3, 50, (1, 5), generator=gen).repeat(G, 1),
                   "responses": torch.randint(3, 50, (G, T), generator=gen), "response_mask": mask,
                   "attention_mask": torch.cat([torch.ones(G, 5, dtype=torch.long), mask], dim=1),
                   "rm_scores": scores, "rollout_log_probs": -torch.rand(G, T, generator=gen) * 3}
        non_tensors = {"uid": np.array([f"uid_sample_{seed}_{p}"] * G, dtype=object), "index": np.full(G, 100 + p),
                       "acc": acc.numpy(), "min_global_steps": np.full(G, start, dtype=object),
                       "max_global_steps": np.full(G, end, dtype=object)}
        full = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={
            "metrics": [{"generate_sequences": 0.1, "tool_calls": 0.0}] * G, "reward_extra_keys": ["acc"]})
        samples.append(RolloutSample(full_batch=full, sample_id=f"sample_{seed}_{p}", epoch=0,
                                     rollout_status={"count/dropped_stale_samples": dropped}))
    return samples


class ActorWorkers:
    """The actor worker group's answers to the fully-async trainer: the weight snapshots it keeps on CPU."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def save_model_to_cpu(self, n: int) -> None:
        self.calls.append(("save", n))

    def restore_model_from_cpu(self, n: int) -> None:
        self.calls.append(("restore", n))

    def clear_cpu_model(self, n: int) -> None:
        self.calls.append(("clear", n))


def test_the_fully_async_trainer_steps_in_parameter_versions(monkeypatch) -> None:
    """verl's own FullyAsyncTrainer (its __init__ from its recipe's config, its _fit_* steps, its
    _compute_old_log_prob restoring pi_old, its _fit_update_local_step counting parameter versions), monitored
    by the class monitored_fully_async_trainer wraps as verl does (@ray.remote(num_cpus=10)); batches assembled
    by verl's assemble_batch_from_rollout_samples. Two local updates per sync: the monitor step is each local
    update, the staleness is in parameter versions (0 on the fresh batches of both local updates, 1 on a stale
    one; counted in steps it would be 2 on the second update and page GRPORolloutsStale at staleness_max 1),
    the engine gap is read on the fresh batches (the old log-probs are on the weights the engine had) and absent
    on the stale one, and the rollouter's dropped-stale total is taken from the key verl writes."""
    import ray
    from verl.experimental.fully_async_policy.detach_utils import assemble_batch_from_rollout_samples
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer

    from grpo_exporter.integrations.verl_fully_async import monitored_fully_async_trainer

    def old_log_prob(self: Any, batch: DataProto) -> tuple[DataProto, float]:  # the actor's forward pass
        return DataProto.from_dict(tensors={"old_log_probs": batch.batch["rollout_log_probs"] + DRIFT,
                                            "entropys": torch.full(batch.batch["responses"].shape, 0.75)}), 0.0

    def update_actor(self: Any, batch: DataProto) -> DataProto:
        return DataProto.from_single_dict(data={}, meta_info={"metrics": {"actor/grad_norm": 2.0}})

    monkeypatch.setattr(RayPPOTrainer, "_compute_old_log_prob", old_log_prob)
    monkeypatch.setattr(RayPPOTrainer, "_update_actor", update_actor)
    actor = monitored_fully_async_trainer(port=None, strict=True, close_linger_s=0, staleness_max_versions=1)
    assert isinstance(actor, ray.actor.ActorClass)
    assert actor._default_options == FullyAsyncTrainer._default_options == {"num_cpus": 10}
    assert issubclass(actor.__ray_actor_class__, FullyAsyncTrainer.__ray_actor_class__)
    cfg = fully_async_config()
    trainer = actor.__ray_actor_class__(cfg, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)
    trainer.actor_rollout_wg = workers = ActorWorkers()
    trainer.message_queue_client = SimpleNamespace(get_queue_size_sync=lambda: 0)
    trainer.progress_bar = SimpleNamespace(update=lambda n: None)
    monitor = trainer.monitor
    assert (monitor.config.group_size, monitor.config.advantage_norm, monitor.config.run) == (
        G, "unbiased", "verl-fully-async")
    trainer.global_steps = 1  # what fit() starts from
    schedule = [([(0, 0)] * 3, 0), ([(0, 0)] * 3, 0), ([(0, 1), (1, 1), (0, 0)], 2), ([(1, 1)] * 3, 3)]
    readings = []
    for seed, (versions, dropped) in enumerate(schedule):
        trainer.metrics, trainer.timing_raw = {}, {}
        batch = assemble_batch_from_rollout_samples(rollout_samples(versions, dropped, seed), None, cfg, None)
        trainer._collect_metrics_from_samples(batch, trainer.metrics)
        for stage in ("_fit_compute_reward", "_fit_compute_log_prob", "_fit_compute_ref_log_prob",
                      "_fit_compute_critic", "_fit_compute_advantage", "_fit_update_critic", "_fit_update_actor"):
            batch = getattr(trainer, stage)(batch)
        trainer._fit_update_local_step()
        trainer._fit_postprocess_step()
        m = monitor.metrics()
        readings.append((m["grpo_last_step"], m["grpo_rollout_staleness_versions"],
                         m.get("grpo_engine_logprob_gap_nats_count", 0.0)))
    m = monitor.metrics()
    monitor.close()
    assert (trainer.current_param_version, trainer.global_steps) == (2, 5)  # verl's own counting
    assert ("restore", 1) in workers.calls  # pi_old restored for the second local update
    assert [r[:2] for r in readings] == [(1, 0), (2, 0), (3, 1), (4, 0)]
    gap_tokens = np.diff([0.0] + [r[2] for r in readings])  # the engine gap's tokens, step by step
    assert list(gap_tokens > 0) == [True, True, False, True]
    assert m["grpo_stale_update_steps_total"] == 0
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)  # the last, fresh batch
    assert m["grpo_partial_completions_total"] == G  # one trajectory group began on 0 and ended on 1
    assert m["grpo_dropped_stale_completions_total"] == 3
    assert m["grpo_entropy_mean_nats"] == pytest.approx(0.75)
    assert m["grpo_steps_total"] == 4
    assert_never_as_documented(m, "verl fully-async (`monitored_fully_async_task_runner`)")


def test_the_fully_async_task_runner_creates_the_monitored_trainer(monkeypatch, tmp_path) -> None:
    """monitored_fully_async_task_runner is verl's FullyAsyncTaskRunner actor class (its options kept) whose
    _create_trainer, verl's own, creates the monitored trainer. The task runner class goes to its actor's process
    as Ray ships it (cloudpickle, by value: verl's _create_trainer then reads FullyAsyncTrainer from a copy of
    fully_async_main's globals): the name is rebound in that copy, the module's left as it is; install_fully_async
    in this process rebinds the module's (once). ``targets_dir`` travels with the classes: the trainer's monitor
    announces its target there. (Ray is not started: the actor creation builds the class in this process.)"""
    import ray
    import verl.experimental.fully_async_policy.fully_async_main as main
    from ray import cloudpickle

    from grpo_exporter.integrations.verl_fully_async import install_fully_async, monitored_fully_async_task_runner

    original = main.FullyAsyncTrainer
    created: list[Any] = []

    def remote(self: Any, *args: Any, **kwargs: Any) -> Any:
        created.append(self.__ray_actor_class__(*args, **kwargs))
        return SimpleNamespace(init_workers=SimpleNamespace(remote=lambda: None))

    monkeypatch.setattr(ray.actor.ActorClass, "remote", remote)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    runner_class = monitored_fully_async_task_runner(port=0, close_linger_s=0, run="fa-run", targets_dir=tmp_path)
    try:
        assert isinstance(runner_class, ray.actor.ActorClass)
        assert runner_class._default_options == main.FullyAsyncTaskRunner._default_options
        runner = cloudpickle.loads(cloudpickle.dumps(runner_class.__ray_actor_class__))()
        runner.components.update(tokenizer=None, role_worker_mapping={}, ray_worker_group_cls=None)
        monkeypatch.setattr(main, "create_resource_pool_manager", lambda config, roles: None)
        runner._create_trainer(fully_async_config())
        (trainer,) = created
        assert type(trainer).__name__ == "MonitoredFullyAsyncTrainer"
        assert trainer.monitor.config.run == "fa-run"
        assert trainer.monitor.config.group_size == G
        assert (tmp_path / f"grpo-fa-run@{trainer.monitor.target.replace(':', '_')}.json").exists()
        trainer.monitor.close()
        assert main.FullyAsyncTrainer is original
        monitored = install_fully_async()
        assert main.FullyAsyncTrainer is monitored is not original
        assert install_fully_async() is monitored  # idempotent
    finally:
        main.FullyAsyncTrainer = original


def test_routing_replay_r3_hands_the_engines_routed_experts_behind_each_response_token(caplog) -> None:
    """verl's R3 batch holds the engine's routed experts over prompt + response positions, aligned to
    ``input_ids`` (verl's agent loop, int16): the adapter hands the positions behind the response tokens as the
    engine's, with replay on; verl records no trainer side, so the mismatch is absent and said once, and the
    engine's expert load is published. The hook reads R3 from verl's config."""
    from grpo_exporter.integrations.verl_settings import _routing_replay

    data, _ = make_batch(3)
    n, prompt = data.batch["prompts"].shape
    experts, layers = 4, 3
    routed = torch.zeros(n, prompt + T, layers, 2, dtype=torch.int16)
    routed[..., 1] = 1
    routed[:, prompt - 1 : prompt - 1 + T, :, :] = torch.tensor([2, 3], dtype=torch.int16)  # behind the response
    data.batch["routed_experts"] = routed
    monitor = GRPOMonitor(run="verl-r3", group_size=G, port=None, strict=True, close_linger_s=0, moe_experts=experts)
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        observe_dataproto(monitor, data, step=1, routing_replay=True)
        observe_dataproto(monitor, data, step=2, routing_replay=True)
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_routing_replay_enabled"] == 1
    assert m['grpo_expert_load_peak_multiple{side="engine"}'] == pytest.approx(experts / 2)  # experts 2, 3 only
    assert "grpo_routing_decision_mismatch_ratio" not in m
    assert sum("verl records the engine's routed experts only" in r.getMessage() for r in caplog.records) == 1
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"enable_rollout_routing_replay": True}}})
    assert _routing_replay(config) is True
    assert _routing_replay(OmegaConf.create({})) is False
