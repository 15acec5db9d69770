"""The verifiable task: answer with the prompt's symbols in *any* order (a permutation), then EOS. Many
answers are right, so a healthy policy keeps several distinct completions per group (in-group diversity is
meaningful), and a briefly warmed-up policy solves some samples of a group and not others (mixed groups)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4


@dataclass(frozen=True)
class Task:
    symbols: int = 6
    length: int = 4

    @property
    def vocab(self) -> int:
        return FIRST_SYMBOL + self.symbols

    @property
    def prompt_length(self) -> int:
        return self.length + 2  # BOS s1..sL SEP

    @property
    def answer_length(self) -> int:
        return self.length + 1  # reversed symbols, EOS

    def prompts(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(count, prompt_length) token ids and a stable id per prompt (the symbols in base ``symbols``)."""
        body = torch.randint(0, self.symbols, (count, self.length), generator=generator)
        ids = (body * (self.symbols ** torch.arange(self.length))).sum(dim=1)
        tokens = torch.cat(
            [torch.full((count, 1), BOS), body + FIRST_SYMBOL, torch.full((count, 1), SEP)], dim=1
        )
        return tokens, ids

    def answers(self, prompts: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(count, answer_length) reference completions: the symbols in a random order, then EOS."""
        body = prompts[:, 1 : 1 + self.length]
        order = torch.rand(body.shape, generator=generator).argsort(dim=1)
        return torch.cat([body.gather(1, order), torch.full((prompts.shape[0], 1), EOS)], dim=1)

    def score(self, prompts: Tensor, completions: Tensor, lengths: Tensor) -> Tensor:
        """Correct: a permutation of the prompt's symbols, then EOS, and nothing else."""
        n = self.length
        if completions.shape[1] < n + 1:
            return torch.zeros(prompts.shape[0], dtype=torch.bool)
        same = (completions[:, :n].sort(dim=1).values == prompts[:, 1 : 1 + n].sort(dim=1).values).all(dim=1)
        return same & (completions[:, n] == EOS) & (lengths == n + 1)
