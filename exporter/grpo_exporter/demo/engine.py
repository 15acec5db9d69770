"""The rollout engine: its own copy of the weights and its own sampling code path, synchronised after each
update, as vLLM/SGLang beside FSDP/Megatron. Its log-probs come from a different implementation than the
trainer's, which is exactly what the engine log-prob gap measures."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_exporter.demo.model import TinyLM
from grpo_exporter.demo.task import EOS, PAD


@dataclass
class Rollout:
    prompts: Tensor  # (N, Lp), each prompt repeated G times
    prompt_ids: Tensor  # (N,)
    completions: Tensor  # (N, T)
    lengths: Tensor  # (N,) tokens generated, EOS included
    rollout_logprobs: Tensor  # (N, T), 0 after the completion
    truncated: Tensor  # (N,) no EOS within T tokens
    policy_version: int


class RolloutEngine:
    def __init__(self, policy: TinyLM) -> None:
        self.model = copy.deepcopy(policy).eval()
        self.precision = torch.float32
        self.skip: tuple[str, ...] = ()
        self.version = 0

    def sync(self, policy: TinyLM, version: int) -> None:
        """Copy the trainer's weights. A name in ``skip`` is silently left behind (the desync fault)."""
        target = self.model.state_dict()
        for name, value in policy.state_dict().items():
            if name not in self.skip:
                target[name].copy_(value)
        self.version = version

    @torch.no_grad()
    def generate(
        self, prompts: Tensor, prompt_ids: Tensor, group_size: int, max_new: int, generator: torch.Generator
    ) -> Rollout:
        """Sample ``group_size`` completions per prompt at temperature 1, recording each token's log-prob."""
        model = self.model if self.precision == torch.float32 else copy.deepcopy(self.model).to(self.precision)
        tokens = prompts.repeat_interleave(group_size, dim=0)
        n = tokens.shape[0]
        out = torch.full((n, max_new), PAD, dtype=torch.long)
        logps = torch.zeros(n, max_new)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), max_new, dtype=torch.long)
        for t in range(max_new):
            logits = model(tokens)[:, -1]
            logp = torch.log_softmax(logits, dim=-1).float()  # in the engine's precision, then widened
            choice = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            token = torch.where(done, PAD, choice)
            out[:, t] = token
            logps[:, t] = torch.where(done, 0.0, logp.gather(1, choice.unsqueeze(1)).squeeze(1))
            ended = ~done & (choice == EOS)
            lengths = torch.where(ended, t + 1, lengths)
            done |= ended
            tokens = torch.cat([tokens, token.unsqueeze(1)], dim=1)
        return Rollout(
            prompts.repeat_interleave(group_size, dim=0), prompt_ids.repeat_interleave(group_size), out, lengths,
            logps, ~done, self.version,
        )
