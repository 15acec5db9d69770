"""OpenRLHF adapter on real ``Experience`` objects (run in .venv-frameworks by
tests/test_integration_frameworks.py): single-sample experiences batched by OpenRLHF's own
``make_experience_batch``, two batches of different widths concatenated by its ``concat_experiences``; the
advantages of each estimator computed by OpenRLHF's experience maker with the args its command line parses; the
async coordinator and its training actor, and a policy worker's PPO epochs on a real DeepSpeed engine (CPU,
gloo), run in this process where OpenRLHF would launch Ray actors on GPUs."""

from __future__ import annotations

import argparse
import runpy
import socket
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


class _LaunchingError(Exception):
    """train_ppo_ray.py got to ``train(args)``: its first call, ``ray.is_initialized``, stops it here."""


def openrlhf_cli(*argv: str) -> tuple[argparse.ArgumentParser, Any]:
    """OpenRLHF's own command line (cli/train_ppo_ray.py, whose parser and checks live under ``__main__``): its
    parser, and the args it hands ``train`` for ``argv`` (hierarchized and checked, its defaults filled in), taken
    when ``train`` starts, before it launches anything."""
    import openrlhf
    import openrlhf.utils.config as config
    import ray

    script = Path(openrlhf.__file__).parent / "cli" / "train_ppo_ray.py"
    seen: dict[str, Any] = {}
    parse, hierarchize = argparse.ArgumentParser.parse_args, config.hierarchize

    def parse_args(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        seen["parser"] = parser
        return parse(parser, *args, **kwargs)

    def hierarchized(flat: Any) -> Any:
        seen["args"] = hierarchize(flat)
        return seen["args"]

    def launch() -> bool:
        raise _LaunchingError

    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        m.setattr(config, "hierarchize", hierarchized)
        m.setattr(ray, "is_initialized", launch)
        m.setattr(sys, "argv", [str(script), *argv])
        with pytest.raises(_LaunchingError):
            runpy.run_path(str(script), run_name="__main__")
    return seen["parser"], seen["args"]


def cli_args(*argv: str) -> Any:
    """The args OpenRLHF's command line hands ``train`` for ``argv`` (a model and a reward model named: the
    critic of gae defaults to the reward model)."""
    return openrlhf_cli("--actor.model_name_or_path", "model", "--reward.model_name_or_path", "rm", *argv)[1]


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


def readings(experiences: list[Experience], run: str, group: int = G, **settings: Any) -> dict[str, float]:
    """One step of ``experiences`` through a fresh monitor (``settings``: the monitor's): its readings."""
    monitor = GRPOMonitor(run=run, group_size=group, port=None, strict=True, close_linger_s=0, **settings)
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

    def __init__(self, max_norm: float = 1.0, *argv: str) -> None:
        self.args = cli_args("--rollout.n_samples_per_prompt", str(G), "--actor.max_norm", str(max_norm),
                             "--algo.advantage.estimator", "group_norm", *argv)
        self.experience_maker = SimpleNamespace(
            make_experience_batch=lambda samples: real_batch(samples, torch.Generator().manual_seed(3)))

    def ppo_train(self, global_steps: int) -> dict:
        return {"actor_grad_norm": 3.0, "policy_loss": 0.1}

    def step(self, global_step: int) -> dict:
        """What BasePPOTrainer.train_step calls, in its order; the monitor's readings after it."""
        self.experience_maker.make_experience_batch(["a", "b"])
        self.ppo_train(global_step)
        return dict(self.monitor.metrics())

    def form(self) -> str:
        return str(self.monitor.config.advantage_norm)

    def close(self) -> None:
        self.monitor.close()


def test_the_monitored_trainer_is_a_ray_actor_class_whose_monitor_lives_in_the_trainer(monkeypatch) -> None:
    """OpenRLHF's PPOTrainer is @ray.remote and its launcher holds only the handle: monitored_ppo_trainer gives
    a Ray actor class over the trainer's own class, and a real Ray actor of it (a local Ray, one CPU) reports each
    train step from its own process, with the clip line from actor.max_norm. The quickstart's lines make the
    classes over OpenRLHF's own trainer (sync and async) and policy actor (its GPU option kept)."""
    import ray
    from openrlhf.trainer.ppo_trainer import PPOTrainer
    from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from grpo_exporter.integrations.openrlhf import monitored_ppo_trainer

    for async_enable, trainer in ((False, PPOTrainer), (True, PPOTrainerAsync)):
        names: dict = {"args": SimpleNamespace(train=SimpleNamespace(async_enable=async_enable))}
        exec(snippet("monitored_ppo_trainer"), names)  # docs/quickstart-openrlhf.md's lines, as written
        real, policy = names["PPOTrainer"], names["PolicyModelActor"]
        assert isinstance(real, ray.actor.ActorClass)
        assert issubclass(real.__ray_actor_class__, trainer.__ray_actor_class__)
        assert isinstance(policy, ray.actor.ActorClass)
        assert issubclass(policy.__ray_actor_class__, PolicyModelActor.__ray_actor_class__)
        assert policy._default_options == PolicyModelActor._default_options == {"num_gpus": 1}
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
        form = ray.get(actor.form.remote())
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()
    assert m["grpo_steps_total"] == 2
    assert m["grpo_groups_total"] == 4
    assert m["grpo_grad_norm_pre_clip"] == 3.0
    assert m["grpo_grad_norm_post_clip"] == pytest.approx(2.0, abs=1e-5)
    assert m["grpo_kl_penalty_coefficient"] == 0.01  # algo.kl.init_coef: the KL rules judge this run's KL
    assert form == "shaped"  # group_norm with OpenRLHF's default KL penalty in the reward


def test_the_trainer_actors_monitor_announces_its_target_on_the_node_ray_picks(monkeypatch, tmp_path) -> None:
    """train_ppo_ray.py creates the trainer with ``PPOTrainer.remote(...)``: Ray ships the class by value (its
    cloudpickle) to a node of its choice, whose environment is not the driver's. GRPO_EXPORTER_TARGETS_DIR and
    GRPO_EXPORTER_PORT, set where monitored_ppo_trainer is called and unset where the actor runs, travel with the
    class: the monitor built in the trainer's ``__init__`` announces ``<its address>:<the port it bound>`` in
    its target file with the job and run labels, and close() withdraws it. The variables were set for the
    monitor's construction only."""
    import json
    import os

    import ray

    from grpo_exporter.integrations.openrlhf import monitored_ppo_trainer

    monkeypatch.setattr(ray, "remote", local_remote)  # .remote() ships the class as Ray does, runs it here
    monkeypatch.setenv("GRPO_EXPORTER_TARGETS_DIR", str(tmp_path))
    monkeypatch.setenv("GRPO_EXPORTER_PORT", "0")
    actor_class = monitored_ppo_trainer(LocalActor(Trainer), run="openrlhf-targets", close_linger_s=0)
    monkeypatch.delenv("GRPO_EXPORTER_TARGETS_DIR")  # the actor's node has none of the driver's variables
    monkeypatch.delenv("GRPO_EXPORTER_PORT")
    trainer = actor_class.remote(max_norm=2.0)
    monitor = trainer.monitor
    try:
        assert "GRPO_EXPORTER_TARGETS_DIR" not in os.environ
        assert "GRPO_EXPORTER_PORT" not in os.environ
        (path,) = tmp_path.glob("grpo-*.json")
        (group,) = json.loads(path.read_text())
        assert path.name == f"grpo-openrlhf-targets@{monitor.target.replace(':', '_')}.json"
        assert monitor.port not in (None, 0, 9887)  # the free port port=0 bound, not the default
        assert group["targets"] == [monitor.target]
        assert monitor.target.rsplit(":", 1)[1] == str(monitor.port)
        assert (group["labels"]["job"], group["labels"]["run"]) == ("grpo", "openrlhf-targets")
        assert trainer.step(1)["grpo_steps_total"] == 1  # the monitor the trainer reports to
    finally:
        monitor.close()
    assert not path.exists()


#: OpenRLHF's estimators and the form of the advantages each computes with the KL penalty out of the reward
ESTIMATOR_FORM = {"group_norm": "unbiased", "dr_grpo": "none", "rloo": "batch", "reinforce": "whitened",
                  "reinforce_baseline": "whitened", "flash_reinforce": "whitened", "gae": "shaped"}
#: where the KL to the reference goes: in the reward (OpenRLHF's default), a loss, nowhere
KL_PLACES = {"reward": (), "loss": ("--algo.kl.use_loss",), "off": ("--algo.kl.init_coef", "0")}
GROUP, PROMPTS = 8, 64


def test_the_adapter_knows_every_estimator_openrlhfs_command_line_offers() -> None:
    from grpo_exporter.integrations.openrlhf import ESTIMATOR_FORMS

    parser, _ = openrlhf_cli("--reward.model_name_or_path", "rm")
    (choices,) = [a.choices for a in parser._actions if "--algo.advantage.estimator" in a.option_strings]
    assert set(choices) == set(ESTIMATOR_FORMS) == set(ESTIMATOR_FORM)


def rollout(gen: torch.Generator, prompts: int = PROMPTS, group: int = GROUP) -> list[Experience]:
    """``group`` samples of each prompt, solved at rates 0.5..0.95 (the best-solved groups have a lone failure:
    the extreme of a group bound), as OpenRLHF's generator hands them to the experience maker."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    samples = []
    for p, rate in enumerate(torch.linspace(0.5, 0.95, prompts).tolist()):
        for k in range(group):
            a = int(torch.randint(2, 7, (1,), generator=gen))
            r = response(f"prompt {p}", [(5, 5 + a)], 5 + a, float(k < round(rate * group)), gen)
            samples.append(SamplesGenerator._process_response_into_experience(None, r, max_len=64))
    return samples


def model_outputs(args: Any, gen: torch.Generator, policy: Any = None) -> Any:
    """``RemoteExperienceMaker.make_experience`` without its Ray groups of GPU models: the old and reference
    log-probs and the critic's values attached as it attaches them, the KL computed as it computes it (OpenRLHF's
    ``compute_approx_kl``; the reference 0.5 nats below the policy) where it computes one: a reference model runs
    (``init_coef > 0``) and the KL is no loss. ``policy``: a policy worker whose ``forward`` gives the old
    log-probs, as the actor group's does there (else random ones)."""
    from openrlhf.models.utils import compute_approx_kl, masked_mean

    def make_experience(samples_list: list[Experience]) -> list[Experience]:
        in_reward = args.algo.kl.init_coef > 0 and not args.algo.kl.use_loss
        for s in samples_list:
            old = (-torch.rand(s.action_mask.shape, generator=gen) * 2 if policy is None
                   else policy.forward(s.sequences, s.action_mask, s.attention_mask).float())
            base = old - 0.5
            s.action_log_probs = old
            s.base_action_log_probs = base if args.algo.kl.use_loss else None
            s.values = torch.rand(old.shape, generator=gen) if args.algo.advantage.estimator == "gae" else None
            s.kl = compute_approx_kl(old, base, kl_estimator=args.algo.kl.estimator) if in_reward else 0 * old
            s.info["kl"] = masked_mean(s.kl, s.action_mask, dim=-1)
        return samples_list

    return make_experience


def experiences_of(args: Any, samples: list[Experience], policy: Any = None) -> list[Experience]:
    """OpenRLHF's ``make_experience_batch`` on ``samples`` (split_rollout_samples, the model outputs above, then
    its own ``compute_advantages_and_returns``: length penalties, the estimator, the KL in the reward, the
    batch whitening), with the KL controller ``BasePPOTrainer`` makes."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    maker = RemoteExperienceMaker(None, None, None, None, FixedKLController(args.algo.kl.init_coef),
                                  SimpleNamespace(args=args), SimpleNamespace(pad_token_id=0))
    maker.make_experience = model_outputs(args, torch.Generator().manual_seed(5), policy)
    return maker.make_experience_batch(samples)


@pytest.mark.parametrize("kl", list(KL_PLACES))
@pytest.mark.parametrize("estimator", list(ESTIMATOR_FORM))
def test_openrlhfs_advantages_keep_the_bound_of_the_form_the_adapter_sets(estimator: str, kl: str) -> None:
    """Each estimator's advantages as OpenRLHF computes them, G=8, 64 prompts solved at 0.5..0.95, the args its
    command line gives: the form the adapter sets is the one the monitor reads off them (every sequence), none
    is over its bound, and where the form has a group bound the lone failure of a best-solved group sits on it."""
    from grpo_exporter.integrations.openrlhf import advantage_form

    args = cli_args("--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", str(GROUP),
                    "--rollout.micro_batch_size", "16", *KL_PLACES[kl])
    expected = "shaped" if kl == "reward" or estimator == "gae" else ESTIMATOR_FORM[estimator]
    assert advantage_form(args) == expected
    experiences = experiences_of(args, rollout(torch.Generator().manual_seed(1)))
    m = readings(experiences, f"openrlhf-{estimator}-{kl}", group=GROUP, advantage_norm=expected)
    assert m[f'grpo_advantage_form_sequences_total{{form="{expected}"}}'] == GROUP * PROMPTS
    assert m["grpo_advantage_over_bound_sequences_total"] == 0
    assert m["grpo_advantage_inconsistent_sequences_total"] == 0
    bound = {"unbiased": (GROUP - 1) / GROUP**0.5, "none": (GROUP - 1) / GROUP}.get(expected)
    if bound is None:
        assert "grpo_advantage_bound" not in m
    else:
        assert m["grpo_advantage_bound"] == pytest.approx(bound)
        assert m["grpo_advantage_abs_max"] == pytest.approx(bound, rel=1e-5)


def test_a_form_the_user_sets_wins_and_an_estimator_the_adapter_does_not_know_refuses() -> None:
    from grpo_exporter.integrations import IntegrationError
    from grpo_exporter.integrations.openrlhf import monitored_ppo_trainer

    settings = {"port": None, "close_linger_s": 0}
    trainer = monitored_ppo_trainer(Trainer, run="openrlhf-loss", **settings)(1.0, "--algo.kl.use_loss")
    assert trainer.form() == "unbiased"  # group_norm, the KL a loss
    trainer.close()
    trainer = monitored_ppo_trainer(Trainer, run="openrlhf-set", advantage_norm="population", **settings)()
    assert trainer.form() == "population"
    trainer.close()

    class Newer(Trainer):
        """A trainer whose args name an estimator of a later OpenRLHF."""

        def __init__(self) -> None:
            super().__init__()
            self.args.algo.advantage.estimator = "grpo_plus"

    with pytest.raises(IntegrationError, match=r"'grpo_plus'.*advantage_norm="):
        monitored_ppo_trainer(Newer, run="openrlhf-newer", **settings)()
    trainer = monitored_ppo_trainer(Newer, run="openrlhf-newer-set", advantage_norm="whitened", **settings)()
    assert trainer.form() == "whitened"
    trainer.close()


def test_a_class_with_no_trainer_state_refuses_at_construction_naming_what_is_missing() -> None:
    """A coordinator the adapter does not know (it launches the actors that train, holds no args, no experience
    maker, no ppo_train): constructing its monitored class raises, naming them, instead of an AttributeError."""
    from grpo_exporter.integrations import IntegrationError
    from grpo_exporter.integrations.openrlhf import monitored_ppo_trainer

    class Coordinator:
        def __init__(self, pretrain: str) -> None:
            self.trainer_actor = None

    with pytest.raises(IntegrationError, match="Coordinator has no args, experience_maker, ppo_train"):
        monitored_ppo_trainer(Coordinator, run="openrlhf-coordinator", port=None, close_linger_s=0)("model")


class LocalActor:
    """A Ray actor class run in this process (the actors OpenRLHF launches need GPUs, vLLM, a model on disk):
    ``remote`` constructs the class here, shipped as Ray ships it to an actor's process (Ray's cloudpickle: a
    class that is not importable by name travels by value, its functions with globals of their own), and its
    methods are called directly."""

    def __init__(self, cls: type) -> None:
        self.__ray_actor_class__ = cls
        self.made: list[Any] = []

    def options(self, **_: Any) -> LocalActor:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        from ray import cloudpickle

        self.made.append(cloudpickle.loads(cloudpickle.dumps(self.__ray_actor_class__))(*args, **kwargs))
        return self.made[-1]


def local_remote(*args: Any, **options: Any) -> Any:
    """``ray.remote`` making :class:`LocalActor` classes (``ray.remote(cls)`` and ``ray.remote(**options)(cls)``)."""
    return LocalActor(args[0]) if args else LocalActor


class LocalQueue:
    """``ray.util.queue.Queue`` (itself a Ray actor) in this process: one thread puts and gets, so unbounded."""

    def __init__(self, maxsize: int = 0) -> None:
        self.items: deque[Any] = deque()

    def put(self, item: Any, block: bool = True) -> None:
        self.items.append(item)

    def get(self, block: bool = True) -> Any:
        return self.items.popleft()


class PolicyGroup:
    """The policy's ``RayActorGroup``, answering ``append`` and ``fit`` as its workers do (``fit``: ``status``)."""

    def __init__(self, status: dict[str, float]) -> None:
        self.status = status

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list[Any]:
        assert method_name == "append"
        return []

    def async_run_method(self, method_name: str, **kwargs: Any) -> list[Any]:
        assert method_name == "fit"
        return [dict(self.status)]


class Logged:
    """OpenRLHF's tensorboard logger: what ``save_logs_and_checkpoints`` logs of each step's status."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def log_train(self, global_step: int, logs: dict[str, Any]) -> None:
        self.logs.append(dict(logs))

    def close(self) -> None:
        pass


def test_async_mode_monitors_the_training_actor_the_coordinator_launches(monkeypatch, caplog) -> None:
    """--train.async_enable: ``PPOTrainerAsync`` holds no trainer state; it launches a generator and a
    ``TrainingActor``. The monitored coordinator (OpenRLHF's own ``__init__``) launches the monitored training
    actor, and only for its ``__init__``; OpenRLHF's ``TrainingActor.fit`` then trains on a queued rollout
    (``train_step``: the experience maker up to its model forward, ``ppo_train``, the logs) and the monitor in the
    training actor reports it: the estimator's form, each optimizer step's norm that a monitored policy worker
    returned (as its own optimizer step), and OpenRLHF's loggers never see those norms' keys. The engine's
    log-probs the rollout carries are not read (said once): the old ones come from the trainer's newer weights."""
    import logging

    import ray
    from openrlhf.trainer import ppo_trainer_async as module

    from grpo_exporter.integrations.openrlhf import STEP_GRAD_NORM, monitored_ppo_trainer

    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    training_actor = module.TrainingActor
    monkeypatch.setattr(ray, "remote", local_remote)
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the stand-in groups answer with values, not object refs
    monkeypatch.setattr(module, "Queue", LocalQueue)
    monkeypatch.setattr(module, "VLLMLock", LocalActor(module.VLLMLock.__ray_actor_class__))
    monkeypatch.setattr(module, "GenerateSamplesActor", LocalActor(dict))  # reads prompts and a tokenizer from disk
    monkeypatch.setattr(module, "get_tokenizer",
                        lambda *_, **__: SimpleNamespace(pad_token_id=0, decode=lambda ids, **_: ["text"]))
    norms = (3.0, 0.5, 2.0)
    group = PolicyGroup({"policy_loss": 0.1, "actor_grad_norm": norms[-1],
                         **{f"{STEP_GRAD_NORM}{i}": norm for i, norm in enumerate(norms)}})
    args = cli_args("--train.async_enable", "--algo.advantage.estimator", "dr_grpo", "--algo.kl.use_loss",
                    "--rollout.n_samples_per_prompt", str(GROUP), "--rollout.micro_batch_size", "16",
                    "--actor.max_norm", "1.0")
    coordinator_class = monitored_ppo_trainer(module.PPOTrainerAsync, run="openrlhf-async", port=None,
                                              close_linger_s=0)
    coordinator = coordinator_class.remote("model", SimpleNamespace(args=args), group, None, None, None, None)
    assert module.TrainingActor is training_actor  # rebound for the coordinator's __init__ only
    trainer = coordinator.trainer_actor  # shipped by value: OpenRLHF's TrainingActor under its own name
    assert [c.__name__ for c in type(trainer).__mro__[:3]] == ["MonitoredTrainingActor", "TrainingActor",
                                                                "BasePPOTrainer"]
    assert trainer.monitor.config.advantage_norm == "none"
    trainer.experience_maker.make_experience = model_outputs(args, torch.Generator().manual_seed(0))
    trainer.tensorboard_logger = logged = Logged()
    samples = rollout(torch.Generator().manual_seed(1))
    assert all(s.rollout_log_probs is not None for s in samples)
    trainer.rollout_queue.put((samples, {}, 1.0, 0.5))
    trainer.rollout_queue.put("done")
    trainer.fit(global_step=0)
    m = dict(trainer.monitor.metrics())
    trainer.monitor.close()
    assert m["grpo_steps_total"] == 1
    assert m["grpo_groups_total"] == PROMPTS
    assert m['grpo_advantage_form_sequences_total{form="none"}'] == GROUP * PROMPTS
    assert m["grpo_advantage_over_bound_sequences_total"] == 0
    assert m["grpo_optimizer_steps_total"] == len(norms)
    assert m["grpo_grad_clip_active_steps_total"] == 2  # 3.0 and 2.0 above actor.max_norm 1.0
    assert m["grpo_grad_norm_pre_clip"] == norms[-1]
    assert "grpo_engine_logprob_gap_mean_nats" not in m
    assert_never_as_documented(m, "OpenRLHF async (`PPOTrainerAsync`)")
    assert sum("policy lag" in r.getMessage() for r in caplog.records) == 1
    (logs,) = logged.logs
    assert logs["actor_grad_norm"] == norms[-1]
    assert not [key for key in logs if key.startswith(STEP_GRAD_NORM)]


@pytest.fixture
def deepspeed_world(monkeypatch):
    """This process as a DeepSpeed world of one CPU rank (gloo), as OpenRLHF's ``setup_distributed`` makes one
    per GPU worker, without the C++ shared-memory collective DeepSpeed compiles for CPU ranks (over a minute of a
    core, for a world of one). Torn down after the test."""
    import importlib

    import deepspeed

    ds_comm = importlib.import_module("deepspeed.comm.comm")
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield port
    finally:
        torch.distributed.destroy_process_group()
        ds_comm.cdb = None


def test_each_optimizer_step_of_a_policy_workers_ppo_train_hands_back_its_grad_norm(deepspeed_world, monkeypatch,
                                                                                      tmp_path) -> None:
    """OpenRLHF's ``PolicyModelActor.fit`` → ``ActorPPOTrainer.ppo_train`` (2 epochs x 4 micro-batches,
    DeepSpeed accumulating 2: 4 optimizer steps) on a real DeepSpeed engine (OpenRLHF's ZeRO config, stage 1) over
    a random 1-layer Llama, on experiences from OpenRLHF's experience maker: the monitored worker's status carries
    the norm of each optimizer step (DeepSpeed's, at each boundary; not the cached one it repeats on the micro-
    batches between), OpenRLHF's own ``actor_grad_norm`` is the last of them, and the monitored trainer publishes
    each as an optimizer step and takes them out of the status."""
    import deepspeed
    from openrlhf.models import Actor
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils import get_strategy
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_exporter.integrations.openrlhf import (
        STEP_GRAD_NORM,
        monitored_policy_actor,
        optimizer_steps_per_update,
        pop_step_grad_norms,
    )

    args = cli_args("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(G),
                    "--rollout.batch_size", "2", "--rollout.micro_batch_size", "4", "--train.batch_size", "4",
                    "--train.micro_batch_size", "2", "--train.max_epochs", "2", "--ds.zero_stage", "1",
                    "--actor.max_norm", "0.8", "--actor.adam.lr", "1e-3", "--actor.num_gpus_per_node", "1",
                    "--ds.attn_implementation", "eager")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)
    boundaries: list[float] = []

    def init_model_from_pretrained(self: Any, strategy: Any, pretrain: str, *_: Any) -> None:
        """``PolicyModelActor.init_model_from_pretrained`` on CPU: OpenRLHF's ``Actor`` loaded as it loads it (a
        random 1-layer Llama saved in ``tmp_path``), DeepSpeed's engine over it from OpenRLHF's ZeRO config (torch's
        AdamW for DeepSpeed's fused Adam, a GPU kernel), then OpenRLHF's ``ActorPPOTrainer`` as it builds it."""
        actor = Actor(pretrain, attn_implementation=args.ds.attn_implementation, param_dtype=args.ds.param_dtype,
                      ds_config=strategy.get_ds_train_config(), packing_samples=args.ds.packing_samples,
                      temperature=args.rollout.temperature)
        config = strategy.get_ds_train_config(max_norm=args.actor.max_norm) | {"zero_allow_untested_optimizer": True}
        engine, optim, _, scheduler = deepspeed.initialize(
            model=actor.model, optimizer=torch.optim.AdamW(actor.model.parameters(), lr=args.actor.adam.lr),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), config=config)
        step = engine.step

        def engine_step(*a: Any, **k: Any) -> None:  # DeepSpeed's own record of its optimizer steps' norms
            before = engine.global_steps
            step(*a, **k)
            if engine.global_steps != before:
                boundaries.append(float(engine.get_global_grad_norm()))

        engine.step = engine_step
        actor.model = engine
        self.strategy, self.actor = strategy, actor
        with monkeypatch.context() as at_init:  # the replay buffer names its GPU; nothing is moved there
            at_init.setattr(torch.cuda, "current_device", lambda: 0)
            self.trainer = ppo_actor.ActorPPOTrainer(
                strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=scheduler,
                micro_train_batch_size=args.train.micro_batch_size, eps_clip=args.actor.eps_clip,
                ema_beta=args.train.ema_beta, vllm_engines=None)

    base = ppo_actor.PolicyModelActor.__ray_actor_class__
    monkeypatch.setattr(base, "init_model_from_pretrained", init_model_from_pretrained)
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", torch.distributed.barrier)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where OpenRLHF moves batches and reduces
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setitem(sys.modules, "flash_attn.ops.triton.cross_entropy", None)  # OpenRLHF's fallback: torch's
    strategy = get_strategy(args)
    strategy.world_size = 1  # what setup_distributed sets from the world, with its device mesh (CUDA)
    strategy.accumulated_gradient = args.train.batch_size // args.train.micro_batch_size

    worker = monitored_policy_actor(ppo_actor.PolicyModelActor.__ray_actor_class__)(1, 0, "127.0.0.1",
                                                                                     deepspeed_world)
    worker.init_model_from_pretrained(strategy, str(tmp_path))
    for experience in experiences_of(args, rollout(torch.Generator().manual_seed(2), prompts=2, group=G), worker):
        worker.append(experience)
    torch.manual_seed(0)  # the order ppo_train's DataLoader shuffles the replay buffer in
    status = worker.fit(kl_ctl=0.0)
    assert len(set(boundaries)) == len(boundaries) == optimizer_steps_per_update(args) == 4
    assert status["actor_grad_norm"] == pytest.approx(boundaries[-1])
    assert pop_step_grad_norms(dict(status)) == pytest.approx(boundaries)

    monitor = GRPOMonitor(run="openrlhf-steps", group_size=G, port=None, strict=True, close_linger_s=0)
    trainer = SimpleNamespace(args=args, experience_maker=SimpleNamespace(make_experience_batch=lambda s: s),
                              ppo_train=lambda global_step: dict(status))
    attach(trainer, monitor, max_grad_norm=args.actor.max_norm)
    assert not [key for key in trainer.ppo_train(1) if key.startswith(STEP_GRAD_NORM)]
    m = monitor.metrics()
    monitor.close()
    assert m["grpo_optimizer_steps_total"] == 4
    assert m["grpo_grad_clip_active_steps_total"] == sum(n > args.actor.max_norm for n in boundaries) == 2
    assert m["grpo_grad_norm_pre_clip"] == pytest.approx(boundaries[-1])
