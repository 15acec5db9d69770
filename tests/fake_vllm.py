"""A vLLM-shaped rollout engine on CPU, for running docs/quickstart-loop.md verbatim: ``vllm.LLM`` and
``vllm.SamplingParams`` with the fields the page uses, and vLLM's output structure (``RequestOutput.outputs``,
``CompletionOutput.token_ids`` and ``.logprobs``: one ``{token_id: Logprob}`` per position). The engine is a bf16
copy of the trainer's model, as vLLM's bf16 weights beside a trainer; ``logprobs_mode`` is vLLM's: ``raw_logprobs``
(its default) before the temperature, ``processed_logprobs`` after it."""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


class TinyLM(torch.nn.Module):
    """A causal LM small enough for a test: the logits at index j read the mean embedding of tokens 0..j."""

    def __init__(self, vocab: int = 24, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)
        with torch.no_grad():
            self.head.weight.mul_(4.0)  # peaked enough that a temperature of 0.8 changes log-probs visibly

    def forward(self, ids: torch.Tensor) -> types.SimpleNamespace:
        h = self.embed(ids).cumsum(dim=1) / torch.arange(1, ids.shape[1] + 1, device=ids.device)[None, :, None]
        return types.SimpleNamespace(logits=self.head(h))


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None


class LLM:
    """``model``: a name registered in ``MODELS`` (the trainer's model; copied to bf16)."""

    MODELS: ClassVar[dict[str, torch.nn.Module]] = {}
    EOS: ClassVar[int] = 0

    def __init__(self, model: str, dtype: str = "auto", logprobs_mode: str = "raw_logprobs", **_: Any) -> None:
        assert dtype == "bfloat16", dtype
        self.source = self.MODELS[model]
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator().manual_seed(1)
        self.load_weights()

    def load_weights(self) -> None:
        self.model = copy.deepcopy(self.source).to(torch.bfloat16)

    @torch.no_grad()
    def generate(self, prompts: list[dict[str, list[int]]], params: SamplingParams) -> list[RequestOutput]:
        out = []
        for prompt in prompts:
            request = RequestOutput()
            for _ in range(params.n):
                ids = torch.tensor([prompt["prompt_token_ids"]])
                tokens: list[int] = []
                logprobs: list[dict[int, Logprob]] = []
                for _ in range(params.max_tokens):
                    logits = self.model(ids).logits[0, -1].float()
                    processed = torch.log_softmax(logits / params.temperature, dim=-1)
                    token = int(torch.multinomial(processed.exp(), 1, generator=self.generator))
                    shown = processed if self.logprobs_mode == "processed_logprobs" else torch.log_softmax(logits, -1)
                    tokens.append(token)
                    logprobs.append({token: Logprob(float(shown[token]))})
                    ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
                    if token == self.EOS:
                        break
                request.outputs.append(CompletionOutput(tokens, logprobs))
            out.append(request)
        return out


def install() -> types.ModuleType:
    """Make ``import vllm`` give this engine (until the test removes it)."""
    module = types.ModuleType("vllm")
    module.LLM = LLM  # type: ignore[attr-defined]
    module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sys.modules["vllm"] = module
    return module
