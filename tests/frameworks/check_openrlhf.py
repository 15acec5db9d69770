"""OpenRLHF adapter on real ``Experience`` objects (run in .venv-frameworks by
tests/test_integration_frameworks.py): single-sample experiences batched by OpenRLHF's own
``make_experience_batch``, two batches of different widths concatenated by its ``concat_experiences``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gpu_only
import pytest
import torch
from doc_snippets import assert_never_as_documented, snippet

gpu_only.install()  # flash-attn, vLLM: imported by OpenRLHF's trainer modules, never run here

from openrlhf.trainer.ppo_trainer import BasePPOTrainer  # noqa: E402
from openrlhf.trainer.ppo_utils import Experience, make_experience_batch  # noqa: E402

from grpo_exporter import GRPOMonitor  # noqa: E402
from grpo_exporter.integrations.openrlhf import attach, observe_experiences  # noqa: E402

G = 4
DRIFT = 0.03


def sample(i: int, prompt: str, width: int, score: float, gen: torch.Generator) -> Experience:
    length = int(torch.randint(1, width + 1, (1,), generator=gen))
    mask = torch.arange(width) < length
    old = -torch.rand(width, generator=gen) * 2
    return Experience(
        sequences=torch.randint(3, 40, (5 + width,), generator=gen),
        attention_mask=torch.ones(5 + width, dtype=torch.long),
        action_mask=mask,
        action_log_probs=old,
        base_action_log_probs=old - 0.2,
        rollout_log_probs=old + DRIFT,
        advantages=torch.full((width,), score - 0.5),
        rewards=torch.tensor(score),
        scores=torch.tensor(score),
        response_length=torch.tensor(float(length)),
        truncated=torch.tensor(length == width),
        prompts=[prompt],
    )


def batches() -> tuple[list[Experience], list[float]]:
    gen = torch.Generator().manual_seed(0)
    experiences, scores = [], []
    for b, width in enumerate((6, 9)):  # two micro-batches of different response widths
        items = []
        for p in range(2):
            for k in range(G):
                score = float(k < p + 1)
                scores.append(score)
                items.append(sample(k, f"prompt {b}-{p}", width, score, gen))
        experiences.append(make_experience_batch(items))
    return experiences, scores


def test_observe_experiences_reads_openrlhfs_batches() -> None:
    experiences, scores = batches()
    monitor = GRPOMonitor(run="openrlhf", group_size=G, port=None, strict=True, close_linger_s=0)
    observe_experiences(monitor, experiences, step=3)
    monitor.end_step()
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_groups_total"] == 4  # groups by prompt text
    assert m['grpo_pass_at_k_ratio{k="1"}'] == pytest.approx(sum(scores) / len(scores))
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)
    assert m["grpo_kl_ref_nats"] == pytest.approx(torch.exp(torch.tensor(-0.2)).item() + 0.2 - 1, rel=1e-4)
    assert m["grpo_completions_total"] == 16
    assert_never_as_documented(m, "OpenRLHF (`monitored_ppo_trainer`)")
    assert m["grpo_advantage_abs_max"] == pytest.approx(0.5)


def test_attach_reports_each_train_step() -> None:
    """``attach`` on a trainer's two methods, as OpenRLHF's ``train_step`` calls them."""
    experiences, _ = batches()
    monitor = GRPOMonitor(run="openrlhf-attach", group_size=G, port=None, strict=True, close_linger_s=0)
    trainer = SimpleNamespace(
        experience_maker=SimpleNamespace(make_experience_batch=lambda samples: experiences),
        ppo_train=lambda global_step: {"actor_grad_norm": 2.0, "entropy_loss": 0.9, "policy_loss": 0.1},
    )
    attach(trainer, monitor, max_grad_norm=1.0)
    for step in (1, 2):
        assert trainer.experience_maker.make_experience_batch(None) is experiences
        assert trainer.ppo_train(step)["actor_grad_norm"] == 2.0
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_steps_total"] == 2
    assert m["grpo_last_step"] == 2
    assert m["grpo_grad_norm_pre_clip"] == 2.0
    assert m["grpo_grad_clip_active_steps_total"] == 2
    assert m["grpo_entropy_mean_nats"] == pytest.approx(0.9)
    assert m["grpo_groups_total"] == 8


def response(prompt: str, actions: list[tuple[int, int]], length: int, reward: float, gen: torch.Generator) -> dict:
    """A vLLM agent response as OpenRLHF's generation hands it over: the observation tokens (prompt, actions,
    environment feedback), the action ranges, the engine's log-prob per observation token (0.0 off actions)."""
    return {
        "observation_tokens": torch.randint(3, 40, (length,), generator=gen).tolist(),
        "action_ranges": actions,
        "reward": reward,
        "scores": reward,
        "rollout_log_probs": [0.0] * length,
        "truncated": False,
        "prompt": prompt,
        "label": "",
    }


def real_batch(prompts: list[str], gen: torch.Generator, multi_turn: bool = False) -> list[Experience]:
    """Experiences made by OpenRLHF's own code: SamplesGenerator._process_response_into_experience (the (B, T-1)
    action mask over sequences[1:], the response_length span, the truncated flag), then the experience maker's
    split_rollout_samples (each sample's index) and OpenRLHF's concatenation, with the trainer's old log-probs and
    advantages filled as make_experience and compute_advantages_and_returns leave them."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    samples = []
    for p, prompt in enumerate(prompts):
        for k in range(G):
            reward = float(k <= p % G)
            # single turn: prompt 5 tokens, action 5..5+a; multi-turn: action, 3 feedback tokens, action
            a = int(torch.randint(2, 6, (1,), generator=gen))
            actions = [(5, 5 + a), (8 + a, 10 + a)] if multi_turn else [(5, 5 + a)]
            r = response(prompt, actions, actions[-1][1], reward, gen)
            sample = SamplesGenerator._process_response_into_experience(None, r, max_len=64)
            mask = sample.action_mask.bool()
            old = -torch.rand(mask.shape, generator=gen) * 2
            sample.rollout_log_probs = torch.where(mask, old + DRIFT, 0.0)  # 0.0 off the actions, as vLLM's
            sample.action_log_probs = old
            sample.advantages = torch.where(mask, reward - 0.5, 0.0).float()
            samples.append(sample)
    maker = SimpleNamespace(args=SimpleNamespace(train=SimpleNamespace(dynamic_batch_enable=False),
                                                 rollout=SimpleNamespace(micro_batch_size=4)),
                            tokenizer=SimpleNamespace(pad_token_id=0))
    return RemoteExperienceMaker.split_rollout_samples(maker, samples)


def readings(experiences: list[Experience], run: str) -> dict[str, float]:
    """One step of ``experiences`` through a fresh monitor: its readings."""
    monitor = GRPOMonitor(run=run, group_size=G, port=None, strict=True, close_linger_s=0)
    observe_experiences(monitor, experiences, step=1)
    monitor.end_step()
    m = dict(monitor.metrics())
    monitor.close()
    return m


def test_duplicate_prompts_stay_separate_groups_as_openrlhf_groups_by_sample_index() -> None:
    """OpenRLHF's advantage reshapes rewards by sample index (index // n_samples_per_prompt): the same prompt
    text twice in a batch is two groups (here with different outcomes), not one group of 2G."""
    experiences = real_batch(["same prompt", "same prompt", "other"], torch.Generator().manual_seed(1))
    assert [i for e in experiences for i in e.index] == list(range(3 * G))
    m = readings(experiences, "openrlhf-dup")
    assert m["grpo_groups_total"] == 3
    assert m["grpo_completions_total"] == 3 * G
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)
    assert m["grpo_advantage_over_bound_sequences_total"] == 0


def test_a_multi_turn_agent_batch_reads_no_loss_mask_fault_from_environment_feedback() -> None:
    """A multi-turn agent's observation: action, environment feedback, action. OpenRLHF's response_length spans
    the feedback (first to last action token); the loss mask rightly leaves it out. No loss-mask fault is read
    (a false GRPOLossMaskMismatch, layer-1 critical, would mute every other page), lengths are the model's
    tokens, and the engine's 0.0 placeholders on feedback tokens are not part of the gap."""
    experiences = real_batch(["p0", "p1"], torch.Generator().manual_seed(2), multi_turn=True)
    batch = Experience.concat_experiences(experiences, pad_token_id=0)
    model_tokens = batch.action_mask.sum(dim=1)
    assert bool((batch.response_length > model_tokens).all())  # OpenRLHF's span includes the feedback
    m = readings(experiences, "openrlhf-agent")
    assert m["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    assert m["grpo_loss_mask_outside_completion_tokens_total"] == 0
    assert m['grpo_completion_length_tokens_sum{outcome="all"}'] == float(model_tokens.sum())
    assert m["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(DRIFT, abs=1e-6)


def test_a_grad_norm_deepspeed_did_not_compute_is_no_reading(caplog) -> None:
    """OpenRLHF's get_grad_norm returns 0.0 when DeepSpeed gives None: absent here, said once; a real norm is
    published."""
    import logging

    from grpo_exporter.integrations.openrlhf import observe_status

    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    monitor = GRPOMonitor(run="openrlhf-norm", group_size=G, port=None, strict=True, close_linger_s=0)
    for step in (1, 2):
        observe_status(monitor, step, {"actor_grad_norm": 0.0, "policy_loss": 0.1}, max_grad_norm=1.0)
    assert "grpo_grad_norm_pre_clip" not in monitor.metrics()
    assert sum("actor_grad_norm 0.0" in r.getMessage() for r in caplog.records) == 1
    observe_status(monitor, 3, {"actor_grad_norm": 2.5}, max_grad_norm=1.0)
    assert monitor.metrics()["grpo_grad_norm_pre_clip"] == 2.5
    monitor.close()


def test_every_openrlhf_status_key_the_mapping_names_is_in_openrlhfs_source() -> None:
    import openrlhf

    from grpo_exporter.catalog import family_of
    from grpo_exporter.integrations.openrlhf import OPENRLHF_METRICS

    text = "\n".join(p.read_text() for p in Path(openrlhf.__file__).parent.rglob("*.py"))
    for key, (sample, _) in OPENRLHF_METRICS.items():
        assert f'"{key}"' in text, key
        family_of(sample.split("{")[0])


class Trainer(BasePPOTrainer):
    """OpenRLHF's trainer base with the parts a CPU test cannot build (DeepSpeed strategy, Ray worker groups,
    vLLM engines) answered as they answer: the args OpenRLHF's CLI parses, the experience maker's batches."""

    def __init__(self, max_norm: float = 1.0) -> None:
        self.args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=G),
                                    actor=SimpleNamespace(max_norm=max_norm),
                                    algo=SimpleNamespace(kl=SimpleNamespace(init_coef=0.01)))
        self.experience_maker = SimpleNamespace(
            make_experience_batch=lambda samples: real_batch(samples, torch.Generator().manual_seed(3)))

    def ppo_train(self, global_steps: int) -> dict:
        return {"actor_grad_norm": 3.0, "policy_loss": 0.1}

    def step(self, global_step: int) -> dict:
        """What BasePPOTrainer.train_step calls, in its order; the monitor's readings after it."""
        self.experience_maker.make_experience_batch(["a", "b"])
        self.ppo_train(global_step)
        return dict(self.monitor.metrics())

    def close(self) -> None:
        self.monitor.close()


def test_the_monitored_trainer_is_a_ray_actor_class_whose_monitor_lives_in_the_trainer(monkeypatch) -> None:
    """OpenRLHF's PPOTrainer is @ray.remote and its launcher holds only the handle: monitored_ppo_trainer gives
    a Ray actor class over the trainer's own class, and a real Ray actor of it (a local Ray, one CPU) reports each
    train step from its own process, with the clip line from actor.max_norm. The docs' two lines make the class
    over OpenRLHF's own trainer."""
    import ray
    from openrlhf.trainer.ppo_trainer import PPOTrainer

    from grpo_exporter.integrations.openrlhf import monitored_ppo_trainer

    names: dict = {}
    exec(snippet("monitored_ppo_trainer"), names)  # docs/integrations.md's lines, as written
    real = names["PPOTrainer"]
    assert isinstance(real, ray.actor.ActorClass)
    assert issubclass(real.__ray_actor_class__, PPOTrainer.__ray_actor_class__)
    actor_class = monitored_ppo_trainer(ray.remote(Trainer), run="openrlhf-ray", port=None, close_linger_s=0)
    # the local Ray's workers inherit this environment and import this module for the Trainer class
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))
    # Ray nices its workers; on a busy CI core a niced worker took minutes to import OpenRLHF, not seconds
    monkeypatch.setenv("RAY_worker_niceness", "0")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actor = actor_class.remote(max_norm=2.0)
        ray.get(actor.step.remote(1))
        m = ray.get(actor.step.remote(2))
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()
    assert m["grpo_steps_total"] == 2
    assert m["grpo_groups_total"] == 4
    assert m["grpo_grad_norm_pre_clip"] == 3.0
    assert m["grpo_grad_norm_post_clip"] == pytest.approx(2.0, abs=1e-5)
    assert m["grpo_kl_penalty_coefficient"] == 0.01  # algo.kl.init_coef: the KL rules judge this run's KL
