"""OpenRLHF adapter on real ``Experience`` objects (run in .venv-frameworks by
tests/test_integration_frameworks.py): single-sample experiences batched by OpenRLHF's own
``make_experience_batch``, two batches of different widths concatenated by its ``concat_experiences``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer.ppo_utils import Experience, make_experience_batch

from grpo_exporter import GRPOMonitor
from grpo_exporter.integrations.openrlhf import attach, observe_experiences

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
