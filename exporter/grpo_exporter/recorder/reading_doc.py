"""The reading set as a person reads it: which rollouts each page needs, the document the exporter serves and the
flight recorder writes, and its terminal form (``grpo-exporter read``). Read without torch (the CLI).

The document (JSON)::

    {"format": 1, "run": "exp-42", "rank": 0, "world": 8, "text_kept": true, "window_steps": 20,
     "for": {"alert": "GRPORewardHackSuspected", "layer": "2-reward"},
     "windows": [{"first_step": 120, "last_step": 139,           # newest first
                  "rows": {"highest_reward": [{"step": 133, "row": 5, "group": 1, "reward": 2.0, ...}, ...]}}]}

A row: ``step``, ``row`` (in the rank's batch), ``group``, ``prompt_id``, ``reward``, ``reward_components``,
``correct``, ``truncated``, ``length`` (completion tokens), ``why`` (what put it in its kind; ``copies`` of a
repeated group's completion, ``group_entropy_nats`` of a low-entropy group), and with
``reading_text`` its ``prompt`` and ``completion`` (text with ``decode``, token ids otherwise; long ones keep
their head and tail).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

FORMAT = 1
#: what each kind of row is, in the notes' terms (the order a page lists them)
KINDS = {
    "highest_reward": "the highest total reward, read by hand: a well-formed answer that skirts the task is a hack",
    "rising_component": "the rows the fastest-rising reward component lifts most above their group: what the "
                        "gradient is paid for",
    "truncated": "truncated completions, the latest: cut mid-sentence, unclosed brackets?",
    "repeated_groups": "the groups with the most copies of one completion: one row each, with its copies",
    "lowest_entropy_groups": "the groups of lowest mean entropy: one row each (its lowest-entropy row)",
    "control": "rows at random over the window: the control to read the others against",
}
#: the kinds each layer's pages need (liveness pages have no rollouts to read)
BY_LAYER = {
    "1-gradient": ("control", "highest_reward"),
    "1-optimizer": ("control", "highest_reward"),
    "2-reward": ("highest_reward", "rising_component", "truncated", "control"),
    "3-samples": ("repeated_groups", "highest_reward", "control"),
    "4-diversity": ("repeated_groups", "lowest_entropy_groups", "highest_reward", "control"),
}
#: where an alert needs other kinds than its layer's, or fewer
BY_ALERT = {
    "GRPORewardHackSuspected": ("highest_reward", "rising_component", "control"),
    "GRPOTruncationSurge": ("truncated", "control"),
    "GRPOLengthHack": ("highest_reward", "truncated", "control"),
    "GRPOLengthGrowthIncorrectOnly": ("truncated", "highest_reward", "control"),
    "GRPODiversityCollapse": ("repeated_groups", "lowest_entropy_groups", "control"),
    "GRPOEntropyCollapse": ("lowest_entropy_groups", "repeated_groups", "control"),
    "GRPOPolicyCollapseOnset": ("repeated_groups", "lowest_entropy_groups", "highest_reward", "control"),
}
MAX_QUERY_CHARS = 128  # an alert or layer name in a query


class ReadingQueryError(ValueError):
    """A query naming no known alert, layer or format: the message says which was expected."""


def kinds_for(alert: str | None = None, layer: str | None = None) -> tuple[str, ...]:
    """The kinds a page of ``alert`` (else of ``layer``) needs; every kind without either."""
    if layer and layer not in BY_LAYER:
        raise ReadingQueryError(f"layer: expected one of {', '.join(BY_LAYER)}, got {layer[:MAX_QUERY_CHARS]!r}")
    if alert:
        if alert in BY_ALERT:
            return BY_ALERT[alert]
        if not layer:
            raise ReadingQueryError(f"alert: expected an alert of ours with rollouts to read "
                                    f"({', '.join(BY_ALERT)}, or any with its layer), got {alert[:MAX_QUERY_CHARS]!r}")
    if layer:
        return BY_LAYER[layer]
    return tuple(KINDS)


def for_page(document: Mapping[str, Any], alert: str | None = None, layer: str | None = None,
             windows: int | None = None) -> dict[str, Any]:
    """``document`` with only the kinds the page needs (and the newest ``windows`` windows)."""
    kinds = kinds_for(alert, layer)
    kept = list(document.get("windows", []))[: windows if windows is not None else None]
    return {**document, "for": {"alert": alert, "layer": layer, "kinds": list(kinds)},
            "windows": [{**w, "rows": {k: w.get("rows", {}).get(k, []) for k in kinds}} for w in kept]}


# ---- the terminal form ------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escaped(text: str) -> str:
    """``text`` safe for a terminal: control characters (an ANSI escape, a carriage return that overwrites the
    line, a bidirectional override) shown as ``\\xNN`` / ``\\uNNNN``; newlines and tabs kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}",
                        text)


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "ids " + " ".join(str(i) for i in value)
    return str(value)


def _row_lines(i: int, row: Mapping[str, Any]) -> list[str]:
    head = [f"[{i}] step {row.get('step')}"]
    for key, name in (("group", "group"), ("prompt_id", "prompt"), ("reward", "reward")):
        if key in row:
            head.append(f"{name} {_number(row[key])}")
    components = row.get("reward_components") or {}
    if components:
        head.append(" ".join(f"{k}={_number(v)}" for k, v in components.items()))
    for key, name in (("correct", "correct"), ("truncated", "truncated"), ("length", "length")):
        if key in row:
            head.append(f"{name} {_number(row[key])}")
    lines = ["  ".join(head)]
    if row.get("why"):
        lines.append(f"    why: {row['why']}")
    for key in ("prompt", "completion"):
        if key in row:
            body = _text(row[key]).replace("\n", "\n" + " " * 16)
            lines.append(f"    {key + ':':<12}{body}")
    return lines


def render_text(document: Mapping[str, Any], rows: int | None = None) -> str:
    """The document for a terminal, one rollout at a time with its reward components beside it; ``rows`` caps
    the rows per kind and window."""
    who = f"run {document.get('run')}, rank {document.get('rank')} of {document.get('world')}"
    page = document.get("for") or {}
    lines = [f"reading set of {who}" + (f", for {page['alert']}" if page.get("alert") else "")
             + (f" (layer {page['layer']})" if page.get("layer") else "")]
    if not document.get("text_kept"):
        lines.append("text not kept: rows show numbers only (set reading_text=True to keep prompts and completions; "
                     "they may be private data)")
    windows = document.get("windows") or []
    if not windows:
        lines.append("no rollouts kept yet")
    for window in windows:
        lines.append(f"\n=== steps {window.get('first_step')}..{window.get('last_step')} ===")
        for kind, kept in (window.get("rows") or {}).items():
            lines.append(f"\n-- {kind}: {KINDS.get(kind, '')}")
            if not kept:
                lines.append("   (none in this window)")
            for i, row in enumerate(kept[:rows] if rows is not None else kept, 1):
                lines.extend(_row_lines(i, row))
    return escaped("\n".join(lines)) + "\n"  # whatever a document read from a file or a URL holds


def dumps(document: Mapping[str, Any]) -> bytes:
    """The document as JSON bytes (ASCII: every character of a prompt or completion escaped)."""
    return json.dumps(document, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def query_value(query: Mapping[str, Sequence[str]], name: str) -> str | None:
    """The first value of ``name`` in a parsed query string, bounded."""
    values = query.get(name) or []
    if not values:
        return None
    value = values[0]
    if len(value) > MAX_QUERY_CHARS:
        raise ReadingQueryError(f"{name}: expected at most {MAX_QUERY_CHARS} characters, got {len(value)}")
    return value


def respond(document: Mapping[str, Any], query: Mapping[str, Sequence[str]]) -> tuple[str, bytes]:
    """``/reading``'s answer to ``query`` (``alert``, ``layer``, ``format`` json or text, ``windows``): content type
    and body; a ReadingQueryError (a ValueError) says what was expected."""
    fmt = query_value(query, "format") or "json"
    if fmt not in ("json", "text"):
        raise ReadingQueryError(f"format: expected json or text, got {fmt!r}")
    count = query_value(query, "windows")
    if count is not None and not (count.isdigit() and int(count) >= 1):
        raise ReadingQueryError(f"windows: expected a whole number of at least 1, got {count!r}")
    page = for_page(document, query_value(query, "alert"), query_value(query, "layer"),
                    int(count) if count is not None else None)
    if fmt == "text":
        return "text/plain; charset=utf-8", render_text(page).encode()
    return "application/json", dumps(page)


__all__ = ["BY_ALERT", "BY_LAYER", "KINDS", "ReadingQueryError", "dumps", "escaped", "for_page", "kinds_for",
           "render_text", "respond"]
