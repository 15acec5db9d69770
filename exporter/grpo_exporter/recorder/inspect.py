"""``grpo-exporter inspect DIR``: an incident read the way the seed says to read a crash, before any curve.

First the three states side by side (the key metrics of the last normal step, the first anomalous step and
the next one), then the kept rows of the first anomalous step, the rows that drove the trigger first: prompt,
completion, rewards by component, correctness, truncation, per-row log-ratio extremes, |A|, non-finite inputs.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_exporter.recorder.store import KEY_FAMILIES, MANIFEST, ROLES, incidents

ROLE_TITLES = {"last_normal": "last normal", "first_anomalous": "first anomalous", "next": "next"}
TEXT_WIDTH = 40


class InspectError(ValueError):
    """DIR holds no complete incident."""


def load(path: Path) -> dict[str, Any]:
    """The manifest of the incident at ``path``, or of the latest complete incident when ``path`` is a recorder
    directory (partial directories, a killed write's, are never read)."""
    if (path / MANIFEST).is_file():
        chosen = path
    elif path.is_dir():
        found = incidents(path)
        if not found:
            raise InspectError(f"DIR: expected an incident directory or a recorder_dir holding incidents, got {path} "
                               f"(no {MANIFEST} in it and no complete incident-* directory under it)")
        chosen = found[-1]
    else:
        raise InspectError(f"DIR: expected a directory, got {path} (does not exist or is not one)")
    try:
        manifest = json.loads((chosen / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than any manifest's
        raise InspectError(f"{chosen / MANIFEST}: expected the recorder's JSON manifest, got unreadable content "
                           f"({_safe(str(exc))[:200]})") from exc
    if not isinstance(manifest, dict) or "states" not in manifest:
        raise InspectError(f"{chosen / MANIFEST}: expected an incident manifest with 'states', got another JSON value")
    _check_manifest(manifest, chosen / MANIFEST)
    manifest["path"] = str(chosen)
    return manifest


# ---- the manifest's schema: what render() reads, each value of the type the recorder writes ----

def _is_number(v: Any) -> bool:
    """A number as the recorder writes one: finite, or 'nan' / 'inf' / '-inf' (json_number), or null."""
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool)) or v in ("nan", "inf", "-inf")


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def _is_text(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, int | str) for x in v))


ROW_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "driver": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "rewards": ("a number", _is_number),
    "reward_components": ("an object of numbers",
                          lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values())),
    "correct": ("a boolean or number", lambda v: isinstance(v, bool) or _is_number(v)),
    "truncated": ("a boolean or number", lambda v: isinstance(v, bool) or _is_number(v)),
    "loss_tokens": ("a number", _is_number),
    "log_ratio_min": ("a number", _is_number),
    "log_ratio_max": ("a number", _is_number),
    "engine_gap_mean": ("a number", _is_number),
    "advantage": ("a number", _is_number),
    "nonfinite": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "prompt": ("text or a list of token ids", _is_text),
    "completion": ("text or a list of token ids", _is_text),
}


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, int | float) else type(v).__name__)


def _expect(ok: bool, where: str, expected: str, got: Any) -> None:
    if not ok:
        raise InspectError(f"{where}: expected {expected}, got {_kind(got)}")


def _check_manifest(m: dict[str, Any], path: Path) -> None:
    """Every value render() reads has the recorder's type; anything else is an InspectError naming it."""
    at = f"{path}: "
    for key in ("id", "run", "rank", "world", "next_missing", "raw_rows"):
        _expect(_is_scalar(m.get(key)), at + key, "a string or number", m.get(key))
    _expect(isinstance(m.get("triggers", []), list) and all(isinstance(t, str) for t in m.get("triggers", [])),
            at + "triggers", "a list of strings", m.get("triggers"))
    steps = m.get("steps", {})
    _expect(isinstance(steps, dict) and all(_is_number(v) for v in steps.values()), at + "steps",
            "an object of step numbers", steps)
    states = m["states"]
    _expect(isinstance(states, dict), at + "states", "an object", states)
    for role, state in states.items():
        if role not in ROLES:
            raise InspectError(f"{at}states: expected roles among {list(ROLES)}, got {_safe(repr(role))[:80]}")
        _expect(isinstance(state, dict), at + f"states.{role}", "an object", state)
        metrics = state.get("metrics")
        _expect(isinstance(metrics, dict) and all(_is_scalar(v) for v in metrics.values()),
                at + f"states.{role}.metrics", "an object of numbers", metrics)
        rows = state.get("rows", {})
        _expect(isinstance(rows, dict), at + f"states.{role}.rows", "an object of stages", rows)
        for stage, kept in rows.items():
            _expect(isinstance(kept, list), at + f"states.{role}.rows.{_safe(stage)}", "a list of rows", kept)
            for i, row in enumerate(kept):
                where = at + f"states.{role}.rows.{_safe(stage)}[{i}]"
                _expect(isinstance(row, dict), where, "an object", row)
                _expect(isinstance(row.get("row"), int) and not isinstance(row.get("row"), bool), where + ".row",
                        "a row index", row.get("row"))
                for name, (expected, ok) in ROW_FIELDS.items():
                    if name in row:
                        _expect(ok(row[name]), f"{where}.{name}", expected, row[name])


def _safe(text: str) -> str:
    """``text`` with every control character and lone surrogate escaped (\\x1b, \\r, \\ud800): model text and
    crafted manifests never reach the terminal raw."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs", "Cf", "Zl", "Zp") and ch != " ":
            out.append(ascii(ch)[1:-1])
        else:
            out.append(ch)
    return "".join(out)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return _safe(str(value))


def _short(value: Any, width: int = TEXT_WIDTH) -> str:
    text = value if isinstance(value, str) else " ".join(map(str, value)) if isinstance(value, list) else _fmt(value)
    text = _safe(text)
    return text if len(text) <= width else text[: width - 1] + "~"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join
    return [line(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(),
            *(line(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)]


def _family_order(key: str) -> tuple[int, str]:
    name = key.split("{", 1)[0]
    return (KEY_FAMILIES.index(name) if name in KEY_FAMILIES else len(KEY_FAMILIES), key)


def render(manifest: dict[str, Any], max_rows: int = 20) -> str:
    states = manifest["states"]
    steps = manifest.get("steps", {})
    out = [
        f"incident {_fmt(manifest.get('id'))}  run {_fmt(manifest.get('run'))}  rank {_fmt(manifest.get('rank'))} of "
        f"{_fmt(manifest.get('world'))}  ({_safe(str(manifest.get('path')))})",
        f"triggers: {_safe(', '.join(manifest.get('triggers', [])))}",
        "steps: " + "  ".join(f"{ROLE_TITLES[r]} {_fmt(steps.get(r))}" for r in ROLES),
    ]
    if manifest.get("next_missing"):
        out.append(f"next step: not recorded ({_fmt(manifest['next_missing'])})")
    if manifest.get("raw_rows"):
        out.append(f"raw rows (.pt): {_fmt(manifest['raw_rows'])}")
    present = [r for r in ROLES if r in states]
    keys = sorted({k for r in present for k in states[r]["metrics"]}, key=_family_order)
    out += ["", "== the three states =="]
    out += _table(["metric", *(f"{ROLE_TITLES[r]} ({steps.get(r)})" for r in present)],
                  [[_safe(k), *(_fmt(states[r]["metrics"].get(k)) for r in present)] for k in keys])
    anomalous = states.get("first_anomalous", {})
    rows = [(stage, row) for stage, rs in anomalous.get("rows", {}).items() for row in rs]
    rows.sort(key=lambda sr: sr[1].get("driver") is None)  # offending rows of every stage first
    shown = rows[:max_rows]
    out += ["", f"== rows of step {steps.get('first_anomalous')} (first anomalous), the rows that drove the trigger "
            f"first: {len(shown)} of {len(rows)} kept =="]
    header = ["stage", "row", "driver", "reward", "components", "correct", "trunc", "tokens", "log r min..max",
              "engine gap", "A", "non-finite", "prompt", "completion"]
    table = []
    for stage, r in shown:
        components = ",".join(f"{k}={_fmt(v)}" for k, v in r.get("reward_components", {}).items())
        ratio = f"{_fmt(r['log_ratio_min'])}..{_fmt(r['log_ratio_max'])}" if "log_ratio_min" in r else "-"
        components = _safe(components)
        table.append([_safe(stage), str(r["row"]), _safe(r.get("driver") or ""), _fmt(r.get("rewards")),
                      components or "-",
                      _fmt(r.get("correct")), _fmt(r.get("truncated")), _fmt(r.get("loss_tokens")), ratio,
                      _fmt(r.get("engine_gap_mean")), _fmt(r.get("advantage")), ",".join(r.get("nonfinite", [])) or "-",
                      _short(r.get("prompt", "-")), _short(r.get("completion", "-"))])
    out += _table(header, table) if table else ["(no rows kept)"]
    return "\n".join(out) + "\n"
