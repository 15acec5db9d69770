"""The raw rows the flight recorder keeps of a step: which rows, taken how, and what each says.

On a normal step the recorder keeps ``rows`` rows spread evenly over the batch: one ``index_select`` per input,
no host read. On an anomalous step (known from the step's host metrics, before the inputs are released) it
first takes the rows that drove the trigger, by a per-row score of the trigger (one host read on such steps
only), then fills up with spread rows. Taken rows are new device tensors: the training loop may reuse its
buffers; they reach the host on the recorder's writer thread.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_exporter.config import MetricsConfig
from grpo_exporter.functional.advantage_form import advantage_form, bound_slack
from grpo_exporter.functional.constants import cached_constant
from grpo_exporter.functional.gradient import completion_positions
from grpo_exporter.functional.reward import over_bound, sequence_abs_advantage
from grpo_exporter.inputs import SEQUENCE_BOOLS, SEQUENCE_FLOATS, TOKEN_BOOLS, TOKEN_FLOATS, StepInputs

ROW_FIELDS = (*SEQUENCE_FLOATS, *SEQUENCE_BOOLS, "group_ids", "completion_lengths", "completion_ids", *TOKEN_BOOLS,
              *TOKEN_FLOATS, "advantages")
Decode = Callable[[list[int]], str]

# which per-row score finds the rows behind each trigger (seed 三态保存: the offending rows first)
SCORES_OF = {
    "nonfinite": ("nonfinite",),
    "mask_mismatch": ("mask",),
    "engine_gap": ("engine_gap",),
    "clipped_before_update": ("log_ratio",),
    "grad_norm_spike": ("log_ratio", "advantage"),
    "advantage_bound": ("advantage",),
}
TEXT_CHARS = 2000  # prompt/completion text kept per row in incident.json (the .pt file keeps every token)
TEXT_IDS = 512  # token ids kept per row in incident.json when there is no decode function


@functools.lru_cache(maxsize=64)
def spread_rows(n: int, rows: int) -> tuple[int, ...]:
    """``min(rows, n)`` row indices spread evenly over ``0..n-1`` (first and last included), cached."""
    k = min(rows, n)
    return tuple(round(i * (n - 1) / (k - 1)) for i in range(k)) if k > 1 else tuple(range(k))


@cached_constant(maxsize=64)
def _spread_index(n: int, rows: int, device: torch.device) -> Tensor:
    return torch.tensor(spread_rows(n, rows), dtype=torch.long, device=device)  # made once per shape and device


def positions_of(x: StepInputs) -> Tensor | None:
    """(N, T) completion positions: the completion mask, else positions below the completion lengths."""
    if x.completion_mask is not None:
        return x.completion_mask
    width = next((t.shape[1] for t in (x.loss_mask, x.logprobs, x.old_logprobs, x.rollout_logprobs, x.completion_ids)
                  if t is not None), None)
    if x.completion_lengths is None or width is None:
        return None
    return completion_positions(x.completion_lengths, width)


def tokens_of(x: StepInputs) -> Tensor | None:
    """The (N, T) tokens the step's metrics read: the loss mask, else the completion positions."""
    return x.loss_mask if x.loss_mask is not None else positions_of(x)


def _masked_abs(a: Tensor, b: Tensor, mask: Tensor | None) -> Tensor:
    d = (a.float() - b.float()).abs()
    d = torch.nan_to_num(d, nan=math.inf)  # a NaN log-prob is as far off as can be
    return d if mask is None else torch.where(mask, d, torch.zeros_like(d))


def row_scores(x: StepInputs, cfg: MetricsConfig | None = None) -> dict[str, Tensor]:
    """(N,) float scores per kind, each > 0 only on rows that can drive its trigger; kinds whose inputs are
    missing are absent. With ``cfg`` the advantage score is |A| only on rows above their group's normalisation
    bound (the rows the ``advantage_bound`` trigger counted), else |A| on every row."""
    mask = tokens_of(x)
    scores: dict[str, Tensor] = {}
    bad = None
    for name in TOKEN_FLOATS:
        t = getattr(x, name)
        if t is not None:
            nf = ~torch.isfinite(t)
            c = (nf & mask if mask is not None else nf).sum(1)
            bad = c if bad is None else bad + c
    sequences = [x.rewards, *x.reward_components.values()]
    if x.advantages is not None:
        a = x.advantages
        sequences.append(a if a.dim() == 1 else torch.where(mask, a, torch.zeros_like(a)) if mask is not None else a)
    for t in sequences:
        if t is not None:
            c = ~torch.isfinite(t)
            c = c.sum(1) if c.dim() == 2 else c.long()
            bad = c if bad is None else bad + c
    if bad is not None:
        scores["nonfinite"] = bad.float()
    positions = positions_of(x)
    if x.loss_mask is not None and positions is not None:
        outside = (x.loss_mask & ~positions).sum(1)
        scores["mask"] = (outside + (x.loss_mask.sum(1) - positions.sum(1)).abs()).float()
    if x.old_logprobs is not None and x.rollout_logprobs is not None:
        d = _masked_abs(x.old_logprobs, x.rollout_logprobs, mask)
        count = mask.sum(1).clamp(min=1) if mask is not None else d.shape[1]
        scores["engine_gap"] = d.sum(1) / count
    if x.logprobs is not None and x.old_logprobs is not None:
        scores["log_ratio"] = _masked_abs(x.logprobs, x.old_logprobs, mask).amax(1)
    if x.advantages is not None:
        a = torch.nan_to_num(x.advantages.float().abs(), nan=math.inf)
        if a.dim() == 2:
            a = (torch.where(mask, a, torch.zeros_like(a)) if mask is not None else a).amax(1)
        over = _over_bound(x, cfg)
        scores["advantage"] = a if over is None else torch.where(over, a, torch.zeros_like(a))
    return scores


def _over_bound(x: StepInputs, cfg: MetricsConfig | None) -> Tensor | None:
    """(N,) rows whose |A| is above their group's bound, as the step's advantage check counts them; None
    without a config or groups."""
    groups = x.groups(cfg.group_size) if cfg is not None and x.advantages is not None else None
    if cfg is None or groups is None or x.advantages is None:
        return None
    bounds = advantage_form(x.advantages, x.loss_mask, x.rewards, groups, cfg.group_size, cfg.advantage_norm,
                            cfg.advantage_bound_rtol).bounds
    abs_a, exists = sequence_abs_advantage(x.advantages, x.loss_mask)
    return over_bound(abs_a, exists, groups, bounds, bound_slack(x.advantages, cfg.advantage_bound_rtol))


def select_rows(x: StepInputs, triggers: Sequence[str], rows: int,
                cfg: MetricsConfig | None = None) -> tuple[Tensor, dict[int, str]]:
    """The rows to keep (device index) and, for an anomalous step, which trigger each offending row drove
    (row -> trigger, offending rows first in the index). Normal steps: spread rows, no host read. ``cfg``
    (the monitor's) says which rows are above the advantage bound."""
    n = x.n
    if n is None or n == 0:
        return torch.zeros(0, dtype=torch.long), {}
    kinds = [(trigger, kind) for trigger in triggers for kind in SCORES_OF.get(trigger, ())]
    scores = row_scores(x, cfg) if kinds else {}
    kinds = [(trigger, kind) for trigger, kind in kinds if kind in scores]
    if not kinds:
        return _spread_index(n, rows, x.device), {}
    k = min(max(1, (rows // 2) // len(kinds)), n)
    tops = [torch.topk(scores[kind], k) for _, kind in kinds]
    # the anomalous step's one extra host read: scores and rows together (row indices < 2^53 are exact)
    read = torch.stack([torch.stack([t.values.double(), t.indices.double()]) for t in tops]).tolist()
    drivers: dict[int, str] = {}
    for (trigger, _), (values, ids) in zip(kinds, read, strict=True):
        for v, i in zip(values, ids, strict=True):
            if v > 0 and int(i) not in drivers and len(drivers) < rows:
                drivers[int(i)] = trigger
    chosen = list(drivers)
    chosen += [i for i in spread_rows(n, rows) if i not in drivers][: rows - len(chosen)]
    return torch.tensor(chosen, dtype=torch.long, device=x.device), drivers


def _row_tensors(x: StepInputs, extra: Mapping[str, Tensor | None] | None) -> dict[str, Tensor]:
    """The (N, ...) tensors a kept row is taken from, by the name it is kept under."""
    n = x.n
    found: dict[str, Tensor] = {}
    for name in ROW_FIELDS:
        t = getattr(x, name)
        if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == n:
            found[name] = t
    for name, t in x.reward_components.items():
        found[f"reward_components.{name}"] = t
    for name, t in (extra or {}).items():
        if isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == n:
            found[name] = t
    return found


def row_bytes(x: StepInputs, extra: Mapping[str, Tensor | None] | None = None) -> int:
    """Bytes one kept row takes (every field's row, on its device), from the shapes alone: no host read."""
    per_row = sum(t.numel() // t.shape[0] * t.element_size() for t in _row_tensors(x, extra).values() if t.shape[0])
    return per_row + 8  # the row's index


def take_rows(x: StepInputs, index: Tensor, extra: Mapping[str, Tensor | None] | None = None) -> dict[str, Tensor]:
    """The inputs' rows at ``index`` (new tensors, detached), plus ``extra`` (N, ...) tensors, ``row`` the index."""
    taken: dict[str, Tensor] = {"row": index}
    for name, t in _row_tensors(x, extra).items():
        taken[name] = t.detach().index_select(0, index)
    return taken


def json_number(value: float) -> float | str:
    """A JSON-safe number: non-finite values as the strings 'nan', 'inf', '-inf'."""
    return value if math.isfinite(value) else str(value)


def decoded(ids: list[int], decode: Decode) -> str:
    """The row's text by ``decode``, whatever it returns or raises: a string as given; bytes as UTF-8 (bad
    bytes replaced); anything else as its repr; an exception (SystemExit and a cancellation included: the user's
    callback must never end the writer or escape close()) as its ids, and why. Ctrl-C still stops it."""
    try:
        text: object = decode(ids)
        if isinstance(text, bytes | bytearray):
            return bytes(text).decode("utf-8", "replace")
        if not isinstance(text, str):
            return f"<decode returned {type(text).__name__}> {text!r}"
        return text
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a tokenizer that fails on this row: its ids instead, and why
        return f"<decode failed: {type(exc).__name__}> {ids}"


def _text(ids: list[int], decode: Decode | None) -> str | list[int]:
    """The row's text (:func:`decoded`), at most :data:`TEXT_CHARS`; its first :data:`TEXT_IDS` ids without
    ``decode``."""
    return ids[:TEXT_IDS] if decode is None else decoded(ids, decode)[:TEXT_CHARS]


def _on_tokens(t: Tensor, mask: Tensor | None) -> Tensor:
    """A row's values on its loss tokens (all of them when no mask of that shape is known)."""
    return t[mask] if mask is not None and mask.shape == t.shape else t


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def describe_rows(
    rows: Mapping[str, Tensor], drivers: Mapping[int, str], decode: Decode | None
) -> list[dict[str, Any]]:
    """One JSON-ready summary per kept row (host tensors): the row, what drove it, rewards by component,
    correctness, truncation, tokens, per-row log-ratio extremes (trainer vs old; old vs engine), |A|, the
    inputs holding a non-finite value on its tokens, and its prompt and completion (text with ``decode``)."""
    return [_describe_row(rows, pos, row, drivers.get(row), decode) for pos, row in enumerate(rows["row"].tolist())]


def _describe_row(rows: Mapping[str, Tensor], pos: int, row: int, driver: str | None,
                  decode: Decode | None) -> dict[str, Any]:
    r: dict[str, Any] = {"row": row, "driver": driver}
    for name, key in (("group_ids", "group"), ("prompt_ids", "prompt_id")):
        if name in rows:
            r[key] = int(rows[name][pos])
    for name in ("rewards", "correct", "truncated", "completion_lengths"):
        if name in rows:
            v = rows[name][pos]
            r[name] = bool(v) if v.dtype == torch.bool else json_number(float(v))
    components = {k.split(".", 1)[1]: json_number(float(v[pos])) for k, v in rows.items()
                  if k.startswith("reward_components.")}
    if components:
        r["reward_components"] = components
    mask = rows.get("loss_mask", rows.get("completion_mask"))
    m = mask[pos] if mask is not None else None
    if m is None and "completion_lengths" in rows:
        width = next((rows[k].shape[1] for k in ("logprobs", "old_logprobs", "completion_ids") if k in rows), 0)
        m = completion_positions(rows["completion_lengths"][pos : pos + 1], width)[0]
    if m is not None:
        r["loss_tokens"] = int(m.sum())
    if "logprobs" in rows and "old_logprobs" in rows:
        on_loss = _on_tokens(rows["logprobs"][pos].float() - rows["old_logprobs"][pos].float(), m)
        if on_loss.numel():
            r["log_ratio_min"] = json_number(float(on_loss.min()))
            r["log_ratio_max"] = json_number(float(on_loss.max()))
    if "old_logprobs" in rows and "rollout_logprobs" in rows:
        gap = _on_tokens(rows["old_logprobs"][pos].float() - rows["rollout_logprobs"][pos].float(), m)
        if gap.numel():
            r["engine_log_ratio_min"] = json_number(float(gap.min()))
            r["engine_log_ratio_max"] = json_number(float(gap.max()))
            r["engine_gap_mean"] = json_number(float(gap.abs().mean()))
    if "advantages" in rows:
        a = rows["advantages"][pos].float()
        a = _on_tokens(a, m) if a.dim() == 1 and rows["advantages"].dim() == 2 else a.reshape(1)
        if a.numel():
            r["advantage"] = json_number(float(a[a.abs().argmax()]) if _finite(a) else math.nan)
    nonfinite = [name for name in TOKEN_FLOATS if name in rows and not _finite(_on_tokens(rows[name][pos], m))]
    nonfinite += [name for name in ("rewards", "advantages") if name in rows and name not in nonfinite
                  and not _finite(rows[name][pos])]
    if nonfinite:
        r["nonfinite"] = nonfinite
    if "prompt_tokens" in rows:
        r["prompt"] = _text(rows["prompt_tokens"][pos].tolist(), decode)
    if "completion_ids" in rows:
        ids = rows["completion_ids"][pos]
        if "completion_lengths" in rows:
            ids = ids[: int(rows["completion_lengths"][pos])]
        elif "completion_mask" in rows:
            ids = ids[rows["completion_mask"][pos]]
        r["completion"] = _text(ids.tolist(), decode)
    return r
