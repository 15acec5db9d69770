"""verl's v1 trainer (verl 0.9's default, ``trainer.use_v1``) on a real TransferQueue in a local Ray: the
monitored subclass of verl's own ``PPOTrainerSync``, built by verl's ``__init__`` from verl's generated config,
runs verl's real ``step``: ``_balance_batch`` (with the padding rows ``upsample_batch_to_divisible_size``
appends), ``_compute_old_log_prob``, ``_compute_advantage`` (rollout correction and GRPO advantages) and
``_update_actor``. The parts a CPU test cannot run answer as verl's answer: the replay buffer hands the keys the
agent loop stand-in put (with the agent loop's fields, keys and tags), the actor worker writes ``log_probs`` /
``entropy`` as verl's engine workers do (over prompt + response, shifted by one) and returns its metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import verl
from doc_snippets import assert_never_as_documented
from omegaconf import OmegaConf

from grpo_exporter.integrations.verl_v1 import install, monitored_task_runner, monitored_v1_trainer

G, PROMPTS, P, WINDOW = 4, 3, 5, 10
DRIFT = 0.02


@pytest.fixture(scope="module")
def tq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import os

    import ray
    import transfer_queue

    os.environ["RAY_worker_niceness"] = "0"  # noqa: SIM112 (Ray spells it so)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        yield transfer_queue
    finally:
        transfer_queue.close()
        ray.shutdown()


def config(**overrides: Any) -> Any:
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    cfg.trainer.experiment_name = "verl-v1"
    cfg.actor_rollout_ref.rollout.n = G
    cfg.actor_rollout_ref.rollout.response_length = WINDOW
    cfg.data.train_batch_size = PROMPTS
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2  # 2 x G = 8 rows a mini-batch: 12 rows pad to 16
    cfg.actor_rollout_ref.actor.optim.clip_grad = 1.0
    cfg.actor_rollout_ref.actor.use_kl_loss = False
    cfg.algorithm.use_kl_in_reward = False
    cfg.algorithm.adv_estimator = "grpo"
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def put_rollouts(tq: Any, step: int, lengths: list[int], acc: list[float], *, version: int | None = None,
                 tool: slice | None = None, start: int = 0, index: int | None = None) -> tuple[list[str], list[dict]]:
    """Rows as verl's AgentLoopWorkerTQ writes them: keys ``{uid}_{session}_{i}``, ``AgentLoopOutput.as_dict``'s
    fields (the score on the last response token; one prompt per group, of 3 to 5 tokens), the tags with the
    weight versions. ``index``: the dataset's index of every row (default: the group's)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    gen = torch.Generator().manual_seed(step * 100 + start)
    keys, fields, tags = [], [], []
    for i, (length, a) in enumerate(zip(lengths, acc, strict=True)):
        row = start + i
        uid = f"uid-{step}-{row // G}"
        mask = torch.ones(length, dtype=torch.int64)
        if tool is not None:
            mask[tool] = 0  # a tool's output inside the response: off the model's tokens
        scores = torch.zeros(length)
        scores[-1] = a
        v = step - 1 if version is None else version
        prompt_gen = torch.Generator().manual_seed(step * 1000 + row // G)
        prompts = torch.randint(3, 50, (P - (row // G) % 3,), generator=prompt_gen)
        responses = torch.randint(3, 50, (length,), generator=gen)
        keys.append(f"{uid}_{row % G}_0")
        fields.append({
            "prompts": prompts, "responses": responses, "response_mask": mask, "loss_mask": mask,
            "rollout_log_probs": -torch.rand(length, generator=gen) * 3, "rm_scores": scores, "num_turns": 2,
            "input_ids": torch.cat([prompts, responses]),
            "attention_mask": torch.ones(len(prompts) + length, dtype=torch.int64),
            "position_ids": torch.arange(len(prompts) + length),
            "extra_fields": {"reward_extra_info": {"acc": a}, "min_global_steps": v, "max_global_steps": v},
            "uid": uid, "index": row // G if index is None else index, "session_id": row % G,
        })
        tags.append({"status": "success", "prompt_len": len(prompts), "response_len": length,
                     "seq_len": len(prompts) + length,
                     "global_steps": step, "min_global_steps": v, "max_global_steps": v})
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
    return keys, tags


class Workers:
    """The actor worker group's answers: ``compute_log_prob`` writes ``log_probs`` and ``entropy`` over prompt +
    response (the response's at positions P-1 .. P+R-2, as ``response_from_nested`` reads them back), the old
    log-probs ``DRIFT`` above the engine's plus ``off(key, R)``; ``update_actor`` returns the engine's metrics."""

    def __init__(self, tq: Any, off: Callable[[str, int], torch.Tensor] | None = None) -> None:
        self.tq, self.off = tq, off
        self._dispatch_info = {"actor": [0]}  # one data-parallel rank
        self.snapshots: list[tuple[str, int]] = []  # separate_async's weight snapshots on CPU

    def save_model_to_cpu(self, n: int) -> None:
        self.snapshots.append(("save", n))

    def restore_model_from_cpu(self, n: int) -> None:
        self.snapshots.append(("restore", n))

    def clear_cpu_model(self, n: int) -> None:
        self.snapshots.append(("clear", n))

    def compute_ref_log_prob(self, batch: Any) -> Any:
        """The reference's log-probs, 0 to 0.5 nats below the old ones per trajectory (a KL that differs from
        trajectory to trajectory), written where verl's workers write them (``log_probs``)."""
        data = self.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                    select_fields=["old_log_probs", "prompts", "response_mask"])
        from tensordict import TensorDict

        rows = []
        for key, prompt, old in zip(batch.keys, data["prompts"].unbind(), data["old_log_probs"].unbind(),
                                    strict=True):
            shift = 0.5 * torch.rand(1, generator=torch.Generator().manual_seed(sum(map(ord, key))))
            full = torch.zeros(prompt.shape[0] + old.shape[0])
            full[prompt.shape[0] - 1: prompt.shape[0] + old.shape[0] - 1] = old - shift
            rows.append(full)
        self.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(
            {"log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=len(batch.keys)))
        return batch

    def compute_log_prob(self, batch: Any) -> Any:
        from tensordict import TensorDict

        data = self.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                    select_fields=["prompts", "rollout_log_probs"])
        log_probs, entropy = [], []
        for key, prompt, engine in zip(batch.keys, data["prompts"].unbind(), data["rollout_log_probs"].unbind(),
                                       strict=True):
            p, r = prompt.shape[0], engine.shape[0]
            old = engine + DRIFT + (self.off(key, r) if self.off is not None else 0.0)
            lp, ent = torch.zeros(p + r), torch.zeros(p + r)
            lp[p - 1: p + r - 1] = old
            ent[p - 1: p + r - 1] = 0.75
            log_probs.append(lp)
            entropy.append(ent)
        nested = {name: torch.nested.as_nested_tensor(v, layout=torch.jagged)
                  for name, v in (("log_probs", log_probs), ("entropy", entropy))}
        self.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                             fields=TensorDict(nested, batch_size=len(batch.keys)))
        return batch

    def update_actor(self, batch: Any) -> dict:
        return {"metrics": {"grad_norm": [4.0, 2.0], "mfu": 0.0, "pg_clipfrac": [0.1, 0.1]}}


def trainer(tq: Any, cfg: Any, batches: list[tuple[list[str], list[dict]]], workers: Workers,
            base: type | None = None, **settings: Any) -> Any:
    """verl's own PPOTrainerSync (or ``base``), monitored, built by its ``__init__``; ``step`` samples
    ``batches`` in turn."""
    from transfer_queue import KVBatchMeta

    cls = monitored_v1_trainer(base, port=None, close_linger_s=0, strict=True, **settings)
    t = cls(cfg)
    queue = list(batches)
    t.replay_buffer = SimpleNamespace(sample=lambda **kw: (
        KVBatchMeta(partition_id="train", keys=queue[0][0], tags=queue.pop(0)[1]), {}))
    t.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["reward loop"])  # rm_scores come written
    t.actor_rollout_wg = t.ref_policy_wg = workers
    t.ref_in_actor = False
    t.tokenizer = SimpleNamespace(eos_token_id=2)
    t.prepare_step = dict
    t.on_sample_begin = t.on_sample_end = lambda: None  # the rollout replicas' sleep and wake
    return t


def run_step(t: Any, step: int) -> tuple[Any, dict]:
    t.global_steps = step
    metrics: dict = {}
    batch = t.step(metrics, {})
    return batch, metrics


def test_a_sync_step_is_read_from_the_transfer_queue(tq: Any) -> None:
    """One global step of verl's sync trainer: 12 trajectories of 3 prompts, padded by verl to 16 rows; no
    response reaches the 10-token window, so none is truncated although the batch pads to its longest."""
    lengths = [3, 4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 9]
    acc = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # prompt 0 all correct, prompt 2 none
    keys, tags = put_rollouts(tq, 1, lengths, acc)
    t = trainer(tq, config(), [(keys, tags)], Workers(tq))
    batch, metrics = run_step(t, 1)
    assert sum(tag.get("is_padding", False) for tag in batch.tags) == 4  # verl padded to its mini-batch multiple
    advantages = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])["advantages"]
    m = t.monitor.metrics()
    t.monitor.close()
    tq.kv_clear(keys=batch.keys, partition_id="train")
    assert m["grpo_groups_total"] == PROMPTS  # the padding rows are no group
    assert m["grpo_completions_total"] == 12
    assert m["grpo_truncated_completions_total"] == 0  # not the batch's longest (9): verl's window is 10
    assert m['grpo_pass_at_k_ratio{k="1"}'] == pytest.approx(sum(acc) / 12)
    assert m['grpo_zero_variance_groups_total{outcome="all_correct"}'] == 1
    assert m['grpo_zero_variance_groups_total{outcome="all_incorrect"}'] == 1
    assert m['grpo_reward_mean{component="total"}'] == pytest.approx(sum(acc) / 12)
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-5)
    assert m["grpo_entropy_mean_nats"] == pytest.approx(0.75)  # per token, from the old-log-prob pass
    assert_never_as_documented(m, "verl v1 (`PPOTrainer`, TransferQueue)")
    assert m["grpo_advantage_abs_max"] == pytest.approx(float(torch.cat(advantages.unbind()).abs().max()))
    assert m['grpo_completion_length_tokens_sum{outcome="all"}'] == sum(lengths)
    assert m["grpo_grad_norm_pre_clip"] == pytest.approx(3.0)  # verl's reduce_metrics: the mini-batch mean
    assert m["grpo_grad_norm_post_clip"] == pytest.approx(1.0, abs=1e-5)  # optim.clip_grad
    assert m["grpo_rollout_staleness_versions"] == 0
    assert m["grpo_steps_total"] == 1
    assert m["grpo_last_step"] == 1
    assert metrics["actor/grad_norm"] == pytest.approx(3.0)  # verl's own logging is untouched


def test_a_multi_turn_step_with_rejection_sampling_reads_every_model_token(tq: Any) -> None:
    """Tool output at response positions 1-2 (off the model's tokens) and verl's token_k1 rejection sampling
    (ratio outside [0.5, 2]) on three tokens 1.5 nats off: verl writes the kept mask back into the
    TransferQueue; the gap and the lengths are read on every model token, no loss-mask fault from the tools."""
    lengths = [6] * 12
    off_keys: set[str] = set()

    def off(key: str, r: int) -> torch.Tensor:
        o = torch.zeros(r)
        if key in off_keys:
            o[0] = 1.5
        return o

    keys, tags = put_rollouts(tq, 2, lengths, [float(i % 2) for i in range(12)], tool=slice(1, 3))
    off_keys.update(keys[:3])
    cfg = config(**{"algorithm.rollout_correction.rollout_rs": "token_k1",
                    "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0"})
    t = trainer(tq, cfg, [(keys, tags)], Workers(tq, off))
    batch, metrics = run_step(t, 2)
    kept = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["response_mask"])["response_mask"]
    m = t.monitor.metrics()
    t.monitor.close()
    tq.kv_clear(keys=batch.keys, partition_id="train")
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] > 0  # verl rejected ...
    assert int(torch.cat(kept.unbind()).sum()) == 12 * 4 - 3  # ... exactly the three tokens
    model_tokens = 12 * 4
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT + 3 * 1.5 / model_tokens, rel=1e-4)
    assert m['grpo_completion_length_tokens_sum{outcome="all"}'] == model_tokens
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    assert m["grpo_loss_mask_outside_completion_tokens_total"] == 0
    # the agent loop's num_turns (2 a rollout here), read from the TransferQueue as verl's num_turns/* reads it
    assert (m["grpo_completion_turns_sum"], m["grpo_completion_turns_count"]) == (2 * 12, 12)
    assert m['grpo_completion_turns{quantile="1"}'] == 2


def test_local_updates_and_stale_rollouts_give_staleness_and_no_engine_gap(tq: Any, caplog) -> None:
    """``parameter_sync_step`` 2: one global step is two local updates, each on its own half of the rollouts,
    the second's old log-probs from weights the engine never had, and some trajectories generated two versions
    back. One monitor step holds both halves; the staleness is read; the engine gap is absent (it would be the
    policy lag), said once."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    first = put_rollouts(tq, 5, [4] * 8, [1.0, 0.0] * 4)
    second = put_rollouts(tq, 5, [5] * 8, [1.0, 0.0] * 4, version=2, start=8)
    cfg = config(**{"trainer.v1.sync.parameter_sync_step": 2, "data.train_batch_size": 4,
                    "actor_rollout_ref.actor.ppo_mini_batch_size": 2})
    t = trainer(tq, cfg, [first, second], Workers(tq))
    assert t.parameter_sync_step == 2
    batch, _ = run_step(t, 5)
    m = t.monitor.metrics()
    t.monitor.close()
    tq.kv_clear(keys=batch.keys, partition_id="train")
    assert m["grpo_steps_total"] == 1
    assert m["grpo_groups_total"] == 4
    assert m["grpo_completions_total"] == 16
    assert m["grpo_rollout_staleness_versions"] == 2  # policy version 4, the oldest trajectory on version 2
    assert "grpo_engine_logprob_gap_mean_nats" not in m
    assert sum("policy lag" in r.getMessage() for r in caplog.records) == 1


def test_an_async_step_of_one_update_on_older_weights_reads_no_engine_gap(tq: Any, caplog) -> None:
    """An async trainer's step (one local update) on trajectories generated one version back: the difference
    between their engine log-probs and the old log-probs is the policy lag, not an engine fault: no gap, said
    once; the staleness is 1."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    keys, tags = put_rollouts(tq, 7, [5] * 12, [1.0, 0.0] * 6, version=5)
    t = trainer(tq, config(), [(keys, tags)], Workers(tq))
    batch, _ = run_step(t, 7)
    m = t.monitor.metrics()
    t.monitor.close()
    tq.kv_clear(keys=batch.keys, partition_id="train")
    assert m["grpo_rollout_staleness_versions"] == 1
    assert "grpo_engine_logprob_gap_mean_nats" not in m
    assert m["grpo_completions_total"] == 12
    assert sum("policy lag" in r.getMessage() for r in caplog.records) == 1


def test_the_task_runner_installs_the_monitored_trainer_in_its_process() -> None:
    """verl builds the trainer in its TaskRunnerV1 Ray actor from the registry: monitored_task_runner is that
    actor class, and its run installs the monitored subclass under the configured trainer mode first."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    runner = monitored_task_runner(port=None)
    assert isinstance(runner, ray.actor.ActorClass)
    assert issubclass(runner.__ray_actor_class__, TaskRunnerV1.__ray_actor_class__)
    try:
        monitored = install("sync", port=None)
        assert get_trainer_cls("sync") is monitored
        assert issubclass(monitored, PPOTrainerSync)
        assert install("sync") is monitored  # idempotent
    finally:
        TRAINER_REGISTRY["sync"] = PPOTrainerSync


def stand_in_verls_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's own TaskRunnerV1.run, with TransferQueue's init, the worker groups and the training stood in."""
    import transfer_queue
    import verl.trainer.main_ppo as main_ppo
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    monkeypatch.setattr(transfer_queue, "init", lambda conf: None)
    monkeypatch.setattr(transfer_queue, "close", lambda: None)
    monkeypatch.setattr(PPOTrainerSync, "init", lambda self: None)  # worker groups, checkpoint engine
    monkeypatch.setattr(PPOTrainerSync, "fit", lambda self, manager: None)
    monkeypatch.setattr(main_ppo.TaskRunnerV1.__ray_actor_class__, "init_agent_loop_manager", lambda self: None)


def test_the_docs_v1_lines_run_as_written(monkeypatch, tmp_path) -> None:
    """docs/integrations.md's v1 lines, as written but for a free port and a targets directory of this test's
    own: run_ppo gets the monitored task runner, and in the runner's run (verl's own TaskRunnerV1.run, with
    TransferQueue's init and the training stood in) verl's registry lookup builds the monitored trainer with its
    monitor, which announces its target. (run_ppo itself starts Ray and the actor: stood in by one that calls
    the runner's class directly.)"""
    import verl.trainer.main_ppo as main_ppo
    from doc_snippets import snippet
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    built: list[Any] = []

    def run_ppo(config: Any, task_runner_class: Any) -> None:
        runner = task_runner_class.__ray_actor_class__()
        runner.run(config)
        built.append(runner.trainer)

    monkeypatch.setattr(main_ppo, "run_ppo", run_ppo)
    stand_in_verls_run(monkeypatch)
    code, shared = snippet("monitored_task_runner"), 'targets_dir="/shared/prometheus/targets"'
    assert shared in code
    try:
        exec(code.replace(shared, f"targets_dir={str(tmp_path)!r}, port=0"), {"config": config()})
        (trainer,) = built
        assert isinstance(trainer, PPOTrainerSync)
        assert type(trainer).__name__ == "MonitoredPPOTrainerSync"
        assert trainer.monitor.config.group_size == G
        assert trainer.monitor.url is not None
        assert (tmp_path / f"grpo-verl-v1@{trainer.monitor.target.replace(':', '_')}.json").exists()
        trainer.monitor.close()
    finally:
        TRAINER_REGISTRY["sync"] = PPOTrainerSync


def test_the_task_runners_monitor_announces_its_target_on_the_node_ray_picks(monkeypatch, tmp_path) -> None:
    """run_ppo creates the task runner with ``task_runner_class.remote()``: Ray ships the class by value (its
    cloudpickle) to a node of its choice, whose environment is not the driver's. GRPO_EXPORTER_TARGETS_DIR and
    GRPO_EXPORTER_PORT, set where the class is made and unset where it runs, travel with it: the trainer verl's
    run builds there announces ``<its address>:<the port it bound>`` in its target file with the job and run
    labels, and close() withdraws it. The variables were set for the monitor's construction only."""
    import json
    import os

    from ray import cloudpickle
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    stand_in_verls_run(monkeypatch)
    monkeypatch.setenv("GRPO_EXPORTER_TARGETS_DIR", str(tmp_path))
    monkeypatch.setenv("GRPO_EXPORTER_PORT", "0")
    runner_class = monitored_task_runner(close_linger_s=0)
    shipped = cloudpickle.loads(cloudpickle.dumps(runner_class.__ray_actor_class__))
    monkeypatch.delenv("GRPO_EXPORTER_TARGETS_DIR")  # the actor's node has none of the driver's variables
    monkeypatch.delenv("GRPO_EXPORTER_PORT")
    try:
        runner = shipped()
        runner.run(config())
        monitor = runner.trainer.monitor
        assert "GRPO_EXPORTER_TARGETS_DIR" not in os.environ
        assert "GRPO_EXPORTER_PORT" not in os.environ
        (path,) = tmp_path.glob("grpo-*.json")
        (group,) = json.loads(path.read_text())
        assert path.name == f"grpo-verl-v1@{monitor.target.replace(':', '_')}.json"
        assert monitor.port not in (None, 0, 9887)  # the free port port=0 bound, not the default
        assert group["targets"] == [monitor.target]
        assert monitor.target.rsplit(":", 1)[1] == str(monitor.port)
        assert (group["labels"]["job"], group["labels"]["run"]) == ("grpo", "verl-v1")
        monitor.close()
        assert not path.exists()
    finally:
        TRAINER_REGISTRY["sync"] = PPOTrainerSync


def test_the_kl_coefficient_is_the_one_verl_applies() -> None:
    """The actor's kl_loss_coef with use_kl_loss, else the reward's kl_ctrl.kl_coef with use_kl_in_reward, else 0:
    the KL rules judge the KL to the reference only where a penalty is applied."""
    from grpo_exporter.integrations.verl_settings import _kl_coef

    actor = {"actor_rollout_ref": {"actor": {"use_kl_loss": True, "kl_loss_coef": 0.001}},
             "algorithm": {"use_kl_in_reward": False, "kl_ctrl": {"kl_coef": 0.5}}}
    assert _kl_coef(OmegaConf.create(actor)) == 0.001
    reward = {"actor_rollout_ref": {"actor": {"use_kl_loss": False, "kl_loss_coef": 0.001}},
              "algorithm": {"use_kl_in_reward": True, "kl_ctrl": {"kl_coef": 0.5}}}
    assert _kl_coef(OmegaConf.create(reward)) == 0.5
    assert _kl_coef(OmegaConf.create({"actor_rollout_ref": {"actor": {"kl_loss_coef": 0.001}}})) == 0.0


def test_separate_async_restores_pi_old_so_its_local_updates_give_the_engine_gap(tq: Any, caplog) -> None:
    """verl's separate_async trainer with parameter_sync_step 2: its _compute_old_log_prob saves the weights of
    the step's first local update and restores them for the second, so the old log-probs of both are on the
    weights the engine sampled the fresh rollouts with. The engine gap is read (the sync trainer's later local
    updates have no such pi_old: absent there, test above); nothing is said of a policy lag."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    first = put_rollouts(tq, 6, [4] * 8, [1.0, 0.0] * 4)
    second = put_rollouts(tq, 6, [5] * 8, [0.0, 1.0] * 4, start=8)
    cfg = config(**{"trainer.v1.trainer_mode": "separate_async", "trainer.v1.separate_async.parameter_sync_step": 2,
                    "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
                    "actor_rollout_ref.rollout.nnodes": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 1,
                    "actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl"})
    workers = Workers(tq)
    t = trainer(tq, cfg, [first, second], workers, base=PPOTrainerSeparateAsync)
    assert t.parameter_sync_step == 2
    batch, _ = run_step(t, 6)
    m = t.monitor.metrics()
    t.monitor.close()
    tq.kv_clear(keys=batch.keys, partition_id="train")
    assert ("restore", 0) in workers.snapshots  # verl restored pi_old for the second local update
    assert m["grpo_completions_total"] == 16
    assert m["grpo_rollout_staleness_versions"] == 0
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-5)
    assert not any("policy lag" in r.getMessage() for r in caplog.records)


def test_kl_in_reward_and_verls_default_index_are_read_as_verl_means_them(tq: Any, caplog) -> None:
    """Dr. GRPO (norm_adv_by_std_in_grpo=False) with the KL penalty in the reward: verl's _compute_advantage
    centres score - beta x KL per group and writes those token_level_rewards to the TransferQueue. The monitor is
    made with advantage_norm none, and the advantages are checked against the rewards they came from: nothing
    over Dr. GRPO's bound, although the all-correct group (score range 0) carries KL-driven advantages. And
    every row has verl's dataset default index 0: the prompts are told apart by their token ids (said once)."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    acc = [1.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [0.0, 1.0, 1.0, 1.0]  # prompt 0: all correct
    keys, tags = put_rollouts(tq, 8, [5] * 12, acc, index=0)
    cfg = config(**{"algorithm.use_kl_in_reward": True, "algorithm.norm_adv_by_std_in_grpo": False,
                    "algorithm.kl_ctrl.kl_coef": 0.1})
    t = trainer(tq, cfg, [(keys, tags)], Workers(tq))
    assert t.monitor.config.advantage_norm == "none"
    handed: list[Any] = []
    observe = t.monitor.observe_rollout
    t.monitor.observe_rollout = lambda step, **kw: (handed.append(kw.get("prompt_ids")), observe(step, **kw))[1]
    batch, metrics = run_step(t, 8)
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages", "token_level_rewards"])
    m = t.monitor.metrics()
    t.monitor.close()
    tq.kv_clear(keys=batch.keys, partition_id="train")
    assert metrics["actor/reward_kl_penalty"] > 0  # verl applied the penalty
    assert float(data["advantages"].unbind()[0].abs().max()) > 0  # the all-correct group moves by its KL
    assert m["grpo_advantage_over_bound_sequences_total"] == 0
    assert m["grpo_advantage_inconsistent_sequences_total"] == 0  # judged on the scores, the tied group would be
    assert m['grpo_advantage_form_sequences_total{form="none"}'] == 12
    assert m['grpo_reward_mean{component="total"}'] == pytest.approx(sum(acc) / 12)  # the score, not score - KL
    (prompt_ids,) = handed
    assert len(set(prompt_ids)) == PROMPTS  # not one prompt
    assert sum("prompt token ids" in r.getMessage() for r in caplog.records) == 1
