"""docs/quickstart-loop.md runs as written (the port aside) against a vLLM-shaped bf16 engine on CPU: the engine
gap it publishes is the bf16 noise and the guard names no fault; the same page with vLLM's default raw log-probs
(the temperature on one side only) is the systematic gap the page warns of, and the guard names it."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch

import fake_vllm
from doc_examples import examples

LAYER1 = ("GRPOEngineLogprobGapCritical", "GRPORatioClippedBeforeUpdate", "GRPOLossMaskMismatch",
          "GRPONonFiniteValues")
PROMPTS, PROMPT_LEN, STEPS, MAX_NEW = 4, 5, 3, 8


def _names() -> dict[str, Any]:
    model = fake_vllm.TinyLM()
    fake_vllm.LLM.MODELS["tiny"] = model
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(1, 24, (PROMPTS, PROMPT_LEN), generator=gen), torch.arange(PROMPTS) + 10 * s)
               for s in range(STEPS)]

    def reward_fn(ids: torch.Tensor, lengths: torch.Tensor, pids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        correct = (ids[:, 0] % 3 == 0) & (lengths > 1)  # a task the policy solves sometimes
        return correct.float(), correct

    return {"model_path": "tiny", "MAX_NEW": MAX_NEW, "EOS": fake_vllm.LLM.EOS, "prompt_batches": batches,
            "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01), "reward_fn": reward_fn,
            "sync_weights": lambda llm, m: llm.load_weights()}


@pytest.fixture
def vllm_module():
    fake_vllm.install()
    yield
    del sys.modules["vllm"]


def _run(code: str, caplog: pytest.LogCaptureFixture) -> tuple[dict[str, float], set[str]]:
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    names = _names()
    exec(compile(code.replace("port=9887", "port=0"), "docs/quickstart-loop.md", "exec"), names)
    named = {alert for alert in LAYER1 if alert.lower() in caplog.text.lower()}
    return names["mon"].metrics(), named


def test_the_loop_quickstart_runs_as_written_and_reads_bf16_noise(vllm_module, caplog):
    [code] = examples("docs/quickstart-loop.md")
    metrics, named = _run(code, caplog)
    assert metrics["grpo_steps_total"] == STEPS
    gap = metrics["grpo_engine_logprob_gap_mean_nats"]
    assert 1e-4 < gap < 0.05, gap  # a bf16 engine beside an fp32 trainer: noise, not zero, not a fault
    assert abs(metrics['grpo_mismatch_kl_nats{estimator="k1"}']) < 0.01
    assert metrics["grpo_onpolicy_checked_tokens_total"] > 0
    assert not named, named
    assert "failed in stage" not in caplog.text


def test_raw_engine_logprobs_are_the_systematic_gap_the_page_warns_of(vllm_module, caplog):
    [code] = examples("docs/quickstart-loop.md")
    raw = code.replace('logprobs_mode="processed_logprobs"', 'logprobs_mode="raw_logprobs"')
    assert raw != code
    metrics, named = _run(raw, caplog)
    assert metrics["grpo_engine_logprob_gap_mean_nats"] > 0.05  # ten times the bf16 noise and more
    assert "GRPOEngineLogprobGapCritical" in named  # the guard, from the first step (its signed leg)
