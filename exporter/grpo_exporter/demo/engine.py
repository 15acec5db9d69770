"""The rollout engine: its own copy of the weights and its own sampling code path (a KV-cached decode,
:meth:`TinyLM.decode_step`), synchronised after each update, as vLLM/SGLang beside FSDP/Megatron. Its log-probs
come from a different implementation than the trainer's, which is exactly what the engine log-prob gap measures.

By default it computes in bf16, as real engines do: its healthy gap to the fp32 trainer is numeric noise of
~0.015 nats mean (the range real bf16 stacks show, 0.010-0.018, TRL #5312), zero-mean per token. An FP8 engine
(W8A8, as FP8 rollouts of large MoE models run) is noisier still, and as healthy. The engine
faults users hit are systematic instead, and the demo injects them here: log-probs renormalised over the top-p
nucleus (TRL #6789), a sampling temperature the trainer does not apply (TRL #4159), weights that stop syncing
(TRL #5312: 0.015 -> 0.201). An MoE policy's engine also returns the experts it routed each position to, and its
fault is a weight sync that skips the routers (their gate weights stay the first ones while the trainer's move).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_exporter.demo.model import FP8, TinyLM
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
    tool_mask: Tensor | None = None  # (N, T) the positions the environment wrote (multi-turn), else None
    # an MoE policy's: the experts each fed position of prompt + completion was routed to (N, Lp + T - 1, layers,
    # k), the last token being never fed; the routing behind completion token t sits at Lp - 1 + t
    routing: Tensor | None = None


class RolloutEngine:
    def __init__(self, policy: TinyLM, precision: torch.dtype = torch.bfloat16) -> None:
        """``precision``: the engine's dtype; ``FP8`` holds bf16 weights and computes its GEMMs in FP8."""
        fp8 = precision == FP8
        self.model = copy.deepcopy(policy).to(torch.bfloat16 if fp8 else precision).eval()  # its own copy
        self.model.fp8 = fp8
        self.frozen = False  # the sync stops copying weights (stale weights after sleep/wake, a lost sync)
        self.skip_router = False  # an MoE policy's sync copies every weight but the routers' (they go stale)
        self.top_p = 1.0  # < 1: sample from the nucleus and report log-probs renormalised over it
        self.temperature = 1.0  # != 1: sample and report log-probs at this temperature (the trainer uses 1)
        self.version = 0

    def sync(self, policy: TinyLM, version: int) -> None:
        """Copy the trainer's weights (cast to the engine's precision); a frozen engine copies nothing but still
        reports the new version, as a sync that "succeeded"."""
        if not self.frozen:
            weights = policy.state_dict()
            if self.skip_router:
                weights = {k: v for k, v in weights.items() if ".router." not in k}
            self.model.load_state_dict(weights, strict=not self.skip_router)
        self.version = version

    def _logp(self, logits: Tensor) -> Tensor:
        """The engine's per-token log-probs (fp32) from its logits, after its temperature and nucleus."""
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            order = logp.argsort(dim=-1, descending=True)
            sorted_p = logp.gather(-1, order).exp()
            keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < self.top_p  # the nucleus: the first tokens reaching p
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            logp = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
        return logp

    @torch.no_grad()
    def generate(
        self, prompts: Tensor, prompt_ids: Tensor, group_size: int, max_new: int, generator: torch.Generator,
        tool: Tensor | None = None, tool_at: int = 0,
    ) -> Rollout:
        """Sample ``group_size`` completions per prompt, recording each token's log-prob. With ``tool`` (one
        reply per prompt, (P, L)): a completion still open after ``tool_at`` tokens gets the reply written into
        it, as the environment of a multi-turn rollout does (its tokens are prompt to the engine: no log-prob,
        0 as vLLM reports none), and the model goes on after it."""
        tokens = prompts.repeat_interleave(group_size, dim=0)
        n = tokens.shape[0]
        out = torch.full((n, max_new), PAD, dtype=torch.long)
        logps = torch.zeros(n, max_new)
        done = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), max_new, dtype=torch.long)
        replies = None if tool is None else tool.repeat_interleave(group_size, dim=0)
        tool_mask = None if replies is None else torch.zeros(n, max_new, dtype=torch.bool)
        cache = None
        step_tokens = tokens
        routes: list[Tensor] = []
        for t in range(max_new):
            logits, cache, routed = self.model.decode_step(step_tokens, cache)  # the engine's own KV-cached path
            if routed is not None:
                routes.append(routed)
            if replies is not None and tool_mask is not None and tool_at <= t < tool_at + replies.shape[1]:
                token = torch.where(done, PAD, replies[:, t - tool_at])
                out[:, t] = token
                tool_mask[:, t] = ~done
                step_tokens = token.unsqueeze(1)
                continue
            logp = self._logp(logits)  # computed in the engine's precision, widened to fp32 here
            choice = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            token = torch.where(done, PAD, choice)
            out[:, t] = token
            logps[:, t] = torch.where(done, 0.0, logp.gather(1, choice.unsqueeze(1)).squeeze(1))
            ended = ~done & (choice == EOS)
            lengths = torch.where(ended, t + 1, lengths)
            done |= ended
            step_tokens = token.unsqueeze(1)
        return Rollout(
            prompts.repeat_interleave(group_size, dim=0), prompt_ids.repeat_interleave(group_size), out, lengths,
            logps, ~done, self.version, tool_mask, torch.cat(routes, dim=1) if routes else None,
        )
