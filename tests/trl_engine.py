"""A rollout engine for TRL's vLLM mode on CPU: stands in for ``trl.generation.vllm_generation.VLLMGeneration``
(the one class that needs vLLM), so every other line of TRL's vLLM path runs as users run it: the trainer's
``use_vllm`` branches, the None -> NaN placeholders, the old log-probs it recomputes, its importance-sampling
correction and the ``sampling/*`` metrics it logs.

The engine computes in bf16 (a copy of the trainer's model, as vLLM's bf16 weights beside an fp32 trainer),
re-copied at each of TRL's ``sync_weights`` calls, samples with TRL's temperature and top-p, and returns each
sampled token's processed log-prob (vLLM ``--logprobs-mode processed_logprobs``: after temperature and top-p).
``unscored_every`` hands every k-th token back without a log-prob (vLLM's None); ``syncs`` stops syncing after
that many syncs (stale weights).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ClassVar

import torch


class Bf16Engine:
    """Constructed by TRL with ``VLLMGeneration``'s keywords; class attributes set the faults of a test."""

    unscored_every: ClassVar[int | None] = None
    syncs: ClassVar[int | None] = None
    instances: ClassVar[list[Bf16Engine]] = []

    def __init__(self, model: Any, accelerator: Any, processing_class: Any, mode: str = "colocate",
                 temperature: float = 1.0, top_p: float = 1.0, max_completion_length: int = 16,
                 **_: Any) -> None:
        self.model, self.accelerator, self.mode = model, accelerator, mode
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_completion_length
        self.eos = processing_class.eos_token_id
        self.engine: torch.nn.Module | None = None
        self.synced = 0
        self.unscored = 0  # tokens handed back without a log-prob
        self.vllm_client = self  # server mode asks the server how it computes log-probs
        type(self).instances.append(self)

    def get_server_info(self) -> dict[str, Any]:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def sync_weights(self) -> None:
        if self.syncs is not None and self.synced >= self.syncs:
            return
        if self.engine is None:  # its own module: a deep copy would keep accelerate's forward, bound to the trainer's
            self.engine = type(self.model)(self.model.config).to(torch.bfloat16).eval()
        self.engine.load_state_dict(self.model.state_dict())  # cast to bf16 as vLLM's load_weights does
        self.synced += 1

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probs after temperature and top-p, renormalised over the nucleus (vLLM's processed log-probs)."""
        logp = torch.log_softmax(logits.float() / self.temperature, -1)
        if self.top_p < 1.0:
            sorted_lp, order = logp.sort(descending=True)
            outside = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() >= self.top_p
            logp = logp.scatter(-1, order, sorted_lp.masked_fill(outside, float("-inf")))
            logp = torch.log_softmax(logp, -1)
        return logp

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int,
                 profiler: Any = None) -> tuple[list[list[int]], list[list[int]], list[list[list[float | None]]],
                                                list[list[list[int]]]]:
        """One completion per entry of ``prompts`` (TRL hands each prompt ``num_generations`` times)."""
        assert self.engine is not None, "TRL generates before its first sync_weights"
        completions: list[list[int]] = []
        logprobs: list[list[list[float | None]]] = []
        with profiler or nullcontext(), torch.no_grad():
            for ids in prompts:
                seq: list[int] = list(ids)
                out: list[list[float | None]] = []
                for _ in range(self.max_tokens):
                    logp = self._processed(self.engine(torch.tensor([seq])).logits[0, -1])
                    token = int(torch.multinomial(logp.exp(), 1))
                    seq.append(token)
                    position = len(out) + 1
                    if self.unscored_every and position % self.unscored_every == 0:
                        out.append([None])
                        self.unscored += 1
                    else:
                        out.append([float(logp[token])])
                    if token == self.eos:
                        break
                completions.append(seq[len(ids):])
                logprobs.append(out)
        return prompts, completions, logprobs, [[[t] for t in c] for c in completions]
