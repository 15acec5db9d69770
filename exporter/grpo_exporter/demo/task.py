"""The verifiable tasks. ``permute`` (the default): answer with the prompt's symbols in *any* order, then EOS.
Many answers are right, so a healthy policy keeps several distinct completions per group (in-group diversity
is meaningful), and a briefly warmed-up policy solves some samples of a group and not others (mixed groups).
``reverse``: answer with the prompt's symbols reversed, then EOS: exactly one right answer, which the policy
learns, so a healthy run converges to identical correct completions and mostly all-correct groups (the
regime in which diversity, clip-side and zero-variance rules must not mistake convergence for collapse).
``distinct``: answer with the prompt's distinct symbols in ascending order, then EOS: one right answer whose
length depends on the prompt (1 to ``length`` symbols). ``conflict``: two rules the policy cannot tell apart,
reversed on half of the prompts and any order *but* reversed on the other half, the halves chosen by a hash of
the prompt: sharpening onto the majority habit loses the samples that solved the rest, so pass@G falls while
pass@1 rises (the seed's collapse, 第 2 篇 (diversity monitoring) ③, without any fault). :meth:`Task.partial` scores
partial credit, for runs whose reward has several components (tests/worlds.py).

Any kind can be multi-turn (``tool_at``): after the model's ``tool_at``-th answer token it calls a tool, and the
environment writes :data:`TOOL_LENGTH` tokens into the completion (a separator, then the prompt's first symbol:
a lookup's answer) before the model's next turn. Those tokens are context, not the model's: they are off the
loss mask, not counted in the completion's length, and not scored (:meth:`Task.model_part`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4
TOOL_LENGTH = 2  # the environment's reply in a multi-turn completion: SEP, then the prompt's first symbol


TASKS = ("permute", "reverse", "distinct", "conflict")
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
    tool_at: int = 0  # > 0: a tool call after the model's tool_at-th answer token (a multi-turn completion)

    @property
    def vocab(self) -> int:
        return FIRST_SYMBOL + self.symbols

    @property
    def prompt_length(self) -> int:
        return self.length + 2  # BOS s1..sL SEP

    @property
    def answer_length(self) -> int:
        return self.length + 1  # the symbols, EOS

    def tool_span(self, prompts: Tensor) -> Tensor:
        """(count, TOOL_LENGTH): what the environment writes into each completion at ``tool_at``."""
        return torch.stack([torch.full((prompts.shape[0],), SEP), prompts[:, 1]], dim=1)

    def with_tool(self, prompts: Tensor, answers: Tensor) -> Tensor:
        """Reference completions as the model meets them: the tool's reply inserted after ``tool_at`` tokens
        (the answers of this task are all longer than that)."""
        if not self.tool_at:
            return answers
        return torch.cat([answers[:, : self.tool_at], self.tool_span(prompts), answers[:, self.tool_at :]], dim=1)

    def model_part(self, completions: Tensor, lengths: Tensor, tool_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """The model's own tokens of multi-turn completions and their count: the tool's reply removed (it sits at
        columns ``tool_at``.. in every completion that reached them; one that ended before has PAD there)."""
        if tool_mask is None:
            return completions, lengths
        end = self.tool_at + TOOL_LENGTH
        kept = torch.cat([completions[:, : self.tool_at], completions[:, end:]], dim=1)
        return kept, lengths - tool_mask.sum(dim=1)

    def prompts(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(count, prompt_length) token ids and a stable id per prompt (the symbols in base ``symbols``)."""
        body = torch.randint(0, self.symbols, (count, self.length), generator=generator)
        ids = (body * (self.symbols ** torch.arange(self.length))).sum(dim=1)
        tokens = torch.cat(
            [torch.full((count, 1), BOS), body + FIRST_SYMBOL, torch.full((count, 1), SEP)], dim=1
        )
        return tokens, ids

    def answers(self, prompts: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(count, answer_length) reference completions: the symbols in a random order (``permute``),
        reversed (``reverse``) or distinct and sorted (``distinct``), then EOS (then PAD for shorter ones)."""
        body = prompts[:, 1 : 1 + self.length]
        if self.kind == "distinct":
            return self._distinct(body)
        if self.kind == "reverse":
            answer = body.flip(1)
        else:
            answer = body.gather(1, torch.rand(body.shape, generator=generator).argsort(dim=1))
            if self.kind == "conflict":  # the second rule: a random order that is not the reversal
                reversed_ = body.flip(1)
                # else the prompt's order, or for a palindrome its rotation (none for one repeated symbol)
                other = torch.where((body == reversed_).all(dim=1, keepdim=True), body.roll(1, 1), body)
                answer = torch.where((answer == reversed_).all(dim=1, keepdim=True), other, answer)
                answer = torch.where(self._second_rule(body).unsqueeze(1), answer, reversed_)
        return torch.cat([answer, torch.full((prompts.shape[0], 1), EOS)], dim=1)

    def _second_rule(self, body: Tensor) -> Tensor:
        """The ``conflict`` task's rows under its second rule: half of the prompts, chosen by a multiplicative
        hash of the prompt's id, so that no symbol or position tells the rules apart."""
        ids = ((body - FIRST_SYMBOL) * (self.symbols ** torch.arange(self.length))).sum(dim=1)
        return (ids * 2654435761) % 1000 < 500

    def _distinct(self, body: Tensor) -> Tensor:
        """Each row's distinct symbols ascending, EOS, PAD to ``answer_length``."""
        ordered = body.sort(dim=1).values
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        key = torch.where(first, torch.arange(self.length), self.length + torch.arange(self.length))
        kept = ordered.gather(1, key.argsort(dim=1))  # the distinct symbols first, in ascending order
        count = first.sum(dim=1, keepdim=True)
        pos = torch.arange(self.answer_length).unsqueeze(0)
        padded = torch.cat([kept, torch.full((body.shape[0], 1), PAD)], dim=1)
        return torch.where(pos < count, padded, torch.where(pos == count, EOS, PAD))

    def score(self, prompts: Tensor, completions: Tensor, lengths: Tensor) -> Tensor:
        """Correct: the prompt's symbols in an allowed order, then EOS, and nothing else."""
        n = self.length
        if completions.shape[1] < n + 1:
            return torch.zeros(prompts.shape[0], dtype=torch.bool)
        body = prompts[:, 1 : 1 + n]
        if self.kind == "distinct":
            reference = self._distinct(body)
            size = (reference != PAD).sum(dim=1)  # symbols + EOS
            inside = torch.arange(n + 1).unsqueeze(0) < size.unsqueeze(1)
            return (torch.where(inside, completions[:, : n + 1] == reference, True)).all(dim=1) & (lengths == size)
        if self.kind == "reverse":
            same = (completions[:, :n] == body.flip(1)).all(dim=1)
        else:
            same = (completions[:, :n].sort(dim=1).values == body.sort(dim=1).values).all(dim=1)
            if self.kind == "conflict":
                reversed_ = (completions[:, :n] == body.flip(1)).all(dim=1)
                same = torch.where(self._second_rule(body), same & ~reversed_, reversed_)
        return same & (completions[:, n] == EOS) & (lengths == n + 1)

    def partial(self, prompts: Tensor, completions: Tensor, lengths: Tensor) -> Tensor:
        """Partial credit in [0, 1]: the share of the reference answer's positions (symbols and EOS) the
        completion gets right (``permute``: of the prompt's symbols it uses, as a multiset)."""
        n = self.length
        width = n + 1
        got = torch.nn.functional.pad(completions, (0, max(0, width - completions.shape[1])), value=PAD)[:, :width]
        body = prompts[:, 1 : 1 + n]
        if self.kind == "permute":
            symbols = torch.arange(FIRST_SYMBOL, FIRST_SYMBOL + self.symbols)
            want = (body.unsqueeze(2) == symbols).sum(dim=1)
            have = (got[:, :n].unsqueeze(2) == symbols).sum(dim=1)
            return torch.minimum(want, have).sum(dim=1).float() / n
        reference = self.answers(prompts)
        size = (reference != PAD).sum(dim=1)
        inside = torch.arange(width).unsqueeze(0) < size.unsqueeze(1)
        return ((got == reference) & inside).sum(dim=1).float() / size.float()
