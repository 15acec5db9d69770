"""The per-token mask table (seed 第 6 篇 (crash triage) 第 2 步, 逐 token 检查 mask).

Not the mask's shape: one real sample printed token by token (position, token, source, attention mask, loss
mask, advantage), with the runtime assertions the seed lists: the loss-mask sum equals the completion tokens
less tool tokens; no prompt, tool or padding token is a loss target; padding is not attended; EOS is trained
exactly when the engine's stop rule says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from grpo_exporter.checks.outcome import Outcome

SOURCES = ("prompt", "completion", "tool", "padding")


@dataclass(frozen=True)
class MaskRow:
    position: int
    token_id: int
    token: str
    source: str
    attention: bool
    loss: bool
    advantage: float | None


@dataclass(frozen=True)
class MaskTableReport(Outcome):
    """The table, the loss tokens against the completion tokens (less tool tokens), and every violated
    assertion (``passed`` when there is none)."""

    CHECK: ClassVar[str] = "mask_table"  # the ``check`` label of grpo_preflight_check_passed

    rows: tuple[MaskRow, ...]
    loss_tokens: int
    completion_tokens: int
    violations: tuple[str, ...]
    passed: bool
    diagnosis: str
    cannot_tell: bool = False

    def render(self) -> str:
        """The table as markdown, then the verdict."""
        lines = ["| position | token | source | attention | loss | advantage |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            advantage = "" if r.advantage is None else f"{r.advantage:.3g}"
            lines.append(f"| {r.position} | {r.token!r} | {r.source} | {int(r.attention)} | {int(r.loss)} "
                         f"| {advantage} |")
        return "\n".join([*lines, "", self.diagnosis])


def _trained_on(row: MaskRow, source: str) -> bool:
    return row.source == source and row.loss


def _positions(rows: Sequence[MaskRow], keep: Callable[[MaskRow], bool], limit: int = 8) -> str:
    hits = [r.position for r in rows if keep(r)]
    return ", ".join(map(str, hits[:limit])) + (f" (+{len(hits) - limit} more)" if len(hits) > limit else "")


def _as_list(values: Sequence[Any] | Tensor) -> list[Any]:
    return values.tolist() if isinstance(values, Tensor) else list(values)


def _rows(
    token_ids: Sequence[int] | Tensor, attention_mask: Sequence[int] | Tensor, loss_mask: Sequence[int] | Tensor,
    sources: Sequence[str], advantages: Sequence[float] | Tensor | float | None, decode: Callable[[int], str] | None,
) -> tuple[MaskRow, ...]:
    """The table's rows, the inputs' lengths and sources checked (a ``ValueError`` naming the argument)."""
    ids = [int(t) for t in _as_list(token_ids)]
    attention, loss = [bool(v) for v in _as_list(attention_mask)], [bool(v) for v in _as_list(loss_mask)]
    n = len(ids)
    for name, seq in (("attention_mask", attention), ("loss_mask", loss), ("sources", sources)):
        if len(seq) != n:
            raise ValueError(f"mask_table: {name}: expected {n} entries like token_ids, got {len(seq)}")
    unknown = sorted({s for s in sources if s not in SOURCES})
    if unknown:
        raise ValueError(f"mask_table: sources: expected values in {SOURCES}, got {unknown}")
    if advantages is None or isinstance(advantages, int | float):
        per_token: list[float | None] = [None if advantages is None else float(advantages)] * n
    else:
        values = _as_list(advantages)
        if len(values) != n:
            raise ValueError(f"mask_table: advantages: expected one value or {n} entries like token_ids, got "
                             f"{len(values)}")
        per_token = [float(v) for v in values]
    return tuple(
        MaskRow(i, ids[i], decode(ids[i]) if decode is not None else str(ids[i]), sources[i], attention[i], loss[i],
                per_token[i] if sources[i] in ("completion", "tool") else None)
        for i in range(n)
    )


def mask_table(
    token_ids: Sequence[int] | Tensor,
    attention_mask: Sequence[int] | Tensor,
    loss_mask: Sequence[int] | Tensor,
    sources: Sequence[str],
    advantages: Sequence[float] | Tensor | float | None = None,
    decode: Callable[[int], str] | None = None,
    eos_id: int | None = None,
    eos_in_loss: bool = True,
) -> MaskTableReport:
    """The table of one sample (1-d sequences of one length) and its assertions.

    ``sources``: per position one of ``prompt``, ``completion`` (tokens the policy generated), ``tool``
    (environment returns inside the completion) or ``padding``. ``advantages``: per token or one per sample.
    ``eos_id`` with ``eos_in_loss``: when the completion ends in EOS (the engine stopped on it), whether that
    token must be a loss target. A sample without a completion token and without a violation cannot tell
    anything (the outcome says so).
    """
    rows = _rows(token_ids, attention_mask, loss_mask, sources, advantages, decode)
    n = len(rows)
    generated = [r for r in rows if r.source in ("completion", "tool")]
    eos = generated[-1] if eos_id is not None and generated and generated[-1].token_id == eos_id else None
    untrained_eos = eos is not None and eos.source == "completion" and not eos_in_loss
    loss_tokens = sum(r.loss for r in rows)
    completion_tokens = sum(1 for r in rows if r.source == "completion") - int(untrained_eos)
    violations: list[str] = []
    if loss_tokens != completion_tokens:
        violations.append(f"loss-mask sum {loss_tokens} != completion tokens less tool tokens {completion_tokens}")
    for source in ("prompt", "tool", "padding"):
        where = _positions(rows, functools.partial(_trained_on, source=source))
        if where:
            violations.append(f"{source} tokens in the loss at positions {where}")
    where = _positions(rows, lambda r: r.source == "completion" and not r.loss and r is not eos)
    if where:
        violations.append(f"completion tokens left out of the loss at positions {where}")
    where = _positions(rows, lambda r: r.source == "padding" and r.attention)
    if where:
        violations.append(f"padding attended at positions {where}")
    where = _positions(rows, lambda r: r.source in ("prompt", "completion", "tool") and not r.attention)
    if where:
        violations.append(f"context the model must see is not attended at positions {where}")
    if eos is not None and eos.loss != eos_in_loss:
        violations.append(f"EOS at position {eos.position} is {'not ' if eos_in_loss else ''}a loss target, but the "
                          f"engine's stop rule says it should {'' if eos_in_loss else 'not '}be")
    if not violations and not generated:
        return MaskTableReport(rows, loss_tokens, completion_tokens, (), False,
                               f"cannot tell: the sample has no completion token ({n} positions): a table without "
                               "one checks nothing; pass a sample the policy generated", cannot_tell=True)
    diagnosis = ("every assertion holds: " if not violations else "mask faults: ") + (
        "; ".join(violations) if violations else f"{loss_tokens} loss tokens = completion tokens less tool tokens"
    )
    return MaskTableReport(rows, loss_tokens, completion_tokens, tuple(violations), not violations, diagnosis)
