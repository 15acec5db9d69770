"""The verifiable tasks. ``permute`` (the default): answer with the prompt's symbols in *any* order, then EOS.
Many answers are right, so a healthy policy keeps several distinct completions per group (in-group diversity
is meaningful), and a briefly warmed-up policy solves some samples of a group and not others (mixed groups).
``reverse``: answer with the prompt's symbols reversed, then EOS: exactly one right answer, which the policy
learns, so a healthy run converges to identical correct completions and mostly all-correct groups (the
regime in which diversity, clip-side and zero-variance rules must not mistake convergence for collapse)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4


TASKS = ("permute", "reverse")
_SPECIAL = {PAD: "<pad>", BOS: "<bos>", SEP: "|", EOS: "<eos>"}


def decode(tokens: list[int]) -> str:
    """Token ids as text: symbols as letters (4 -> a, 5 -> b, ...), specials in angle brackets (the flight
    recorder's ``decode``)."""
    return "".join(_SPECIAL.get(t, chr(ord("a") + t - FIRST_SYMBOL)) for t in tokens)


@dataclass(frozen=True)
class Task:
    symbols: int = 6
    length: int = 4
    kind: str = "permute"  # one of TASKS

    @property
    def vocab(self) -> int:
        return FIRST_SYMBOL + self.symbols

    @property
    def prompt_length(self) -> int:
        return self.length + 2  # BOS s1..sL SEP

    @property
    def answer_length(self) -> int:
        return self.length + 1  # the symbols, EOS

    def prompts(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(count, prompt_length) token ids and a stable id per prompt (the symbols in base ``symbols``)."""
        body = torch.randint(0, self.symbols, (count, self.length), generator=generator)
        ids = (body * (self.symbols ** torch.arange(self.length))).sum(dim=1)
        tokens = torch.cat(
            [torch.full((count, 1), BOS), body + FIRST_SYMBOL, torch.full((count, 1), SEP)], dim=1
        )
        return tokens, ids

    def answers(self, prompts: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(count, answer_length) reference completions: the symbols in a random order (``permute``) or
        reversed (``reverse``), then EOS."""
        body = prompts[:, 1 : 1 + self.length]
        if self.kind == "reverse":
            answer = body.flip(1)
        else:
            answer = body.gather(1, torch.rand(body.shape, generator=generator).argsort(dim=1))
        return torch.cat([answer, torch.full((prompts.shape[0], 1), EOS)], dim=1)

    def score(self, prompts: Tensor, completions: Tensor, lengths: Tensor) -> Tensor:
        """Correct: the prompt's symbols in an allowed order, then EOS, and nothing else."""
        n = self.length
        if completions.shape[1] < n + 1:
            return torch.zeros(prompts.shape[0], dtype=torch.bool)
        body = prompts[:, 1 : 1 + n]
        if self.kind == "reverse":
            same = (completions[:, :n] == body.flip(1)).all(dim=1)
        else:
            same = (completions[:, :n].sort(dim=1).values == body.sort(dim=1).values).all(dim=1)
        return same & (completions[:, n] == EOS) & (lengths == n + 1)
