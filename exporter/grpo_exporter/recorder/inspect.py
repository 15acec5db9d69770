"""``grpo-exporter inspect DIR``: an incident read the way the seed says to read a crash, before any curve.

First the three states side by side (the key metrics of the last normal step, the first anomalous step and
the next one), then the kept rows of the first anomalous step, the rows that drove the trigger first: prompt,
completion, rewards by component, correctness, truncation, per-row log-ratio extremes, |A|, non-finite inputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_exporter.recorder.flight import KEY_FAMILIES, ROLES
from grpo_exporter.recorder.store import MANIFEST, incidents

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
    except (OSError, ValueError) as exc:
        raise InspectError(f"{chosen / MANIFEST}: expected the recorder's JSON manifest, got unreadable content "
                           f"({exc})") from exc
    if not isinstance(manifest, dict) or "states" not in manifest:
        raise InspectError(f"{chosen / MANIFEST}: expected an incident manifest with 'states', got another JSON value")
    manifest["path"] = str(chosen)
    return manifest


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _short(value: Any, width: int = TEXT_WIDTH) -> str:
    text = value if isinstance(value, str) else " ".join(map(str, value)) if isinstance(value, list) else _fmt(value)
    text = text.replace("\n", "\\n")
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
        f"incident {manifest.get('id')}  run {manifest.get('run')}  rank {manifest.get('rank')} of "
        f"{manifest.get('world')}  ({manifest.get('path')})",
        f"triggers: {', '.join(manifest.get('triggers', []))}",
        "steps: " + "  ".join(f"{ROLE_TITLES[r]} {_fmt(steps.get(r))}" for r in ROLES),
    ]
    if manifest.get("next_missing"):
        out.append(f"next step: not recorded ({manifest['next_missing']})")
    if manifest.get("raw_rows"):
        out.append(f"raw rows (.pt): {manifest['raw_rows']}")
    present = [r for r in ROLES if r in states]
    keys = sorted({k for r in present for k in states[r]["metrics"]}, key=_family_order)
    out += ["", "== the three states =="]
    out += _table(["metric", *(f"{ROLE_TITLES[r]} ({steps.get(r)})" for r in present)],
                  [[k, *(_fmt(states[r]["metrics"].get(k)) for r in present)] for k in keys])
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
        table.append([stage, str(r["row"]), r.get("driver") or "", _fmt(r.get("rewards")), components or "-",
                      _fmt(r.get("correct")), _fmt(r.get("truncated")), _fmt(r.get("loss_tokens")), ratio,
                      _fmt(r.get("engine_gap_mean")), _fmt(r.get("advantage")), ",".join(r.get("nonfinite", [])) or "-",
                      _short(r.get("prompt", "-")), _short(r.get("completion", "-"))])
    out += _table(header, table) if table else ["(no rows kept)"]
    return "\n".join(out) + "\n"
