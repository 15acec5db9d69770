"""verl adapter on real verl objects (run in .venv-frameworks by tests/test_integration_frameworks.py): a
``DataProto`` built by verl's own ``from_dict``, advantages from verl's ``compute_grpo_outcome_advantage``,
rows reordered as verl's ``balance_batch`` does, and the v0 ``RayPPOTrainer`` hook."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from doc_snippets import assert_never_as_documented
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from grpo_exporter import GRPOMonitor
from grpo_exporter.integrations.verl import (
    VERL_METRICS,
    monitored_ray_trainer,
    observe_actor_metrics,
    observe_dataproto,
)

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
    from grpo_exporter.integrations.verl import _grad_clip

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
    data.meta_info["count/dropped_stale_samples"] = 4  # what assemble_batch_from_rollout_samples copies in
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


def test_the_docs_v0_lines_run_as_written(monkeypatch) -> None:
    """docs/integrations.md's v0 lines, as written but for a free port, where verl's TaskRunner builds
    RayPPOTrainer: the object is verl's trainer class with the hooks and a monitor of the run's group size.
    (RayPPOTrainer's __init__ builds Ray worker groups: it is stood in by one that keeps the config.)"""
    from doc_snippets import snippet

    seen: dict[str, Any] = {}

    def init(self: Any, config: Any, **kwargs: Any) -> None:
        self.config = config
        seen.update(kwargs)

    monkeypatch.setattr(RayPPOTrainer, "__init__", init)
    names: dict[str, Any] = {"config": OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": G}}}),
                             "trainer_kwargs": {"tokenizer": "the tokenizer"}}
    exec(snippet("monitored_ray_trainer").replace("port=9400", "port=0"), names)
    trainer = names["trainer"]
    try:
        assert isinstance(trainer, RayPPOTrainer)
        assert type(trainer).__name__ == "MonitoredRayPPOTrainer"
        assert seen == {"tokenizer": "the tokenizer"}
        assert trainer.monitor.config.group_size == G
        assert trainer.monitor.url is not None
    finally:
        trainer.monitor.close()


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
