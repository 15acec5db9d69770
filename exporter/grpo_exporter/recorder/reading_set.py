"""The run's reading set (seed: 读原文在读曲线之前, read the raw rollouts before the curves): for each recent window of
steps, the few rollouts each kind of page needs (:mod:`.reading_doc`), kept as the run goes so that a page brings
text, not only a curve.

On the training thread, once per rollout: the picks of :mod:`grpo_exporter.functional.rows_to_read` (a few
``topk`` over per-row scores) and one ``index_select`` of the picked rows, on the tensors' device, with no host
read; the step's transfer is unchanged. The picked rows reach the host on the reading thread (which waits for the
device there, as the flight recorder's writer does), which merges them into the window: per kind the ``rows`` best
(the latest for truncation; a uniform sample for the control), decoding only the rows that are kept. Memory is
bounded: ``windows`` windows of at most ``rows`` rows per kind, each text clipped to its head and tail.

Prompts and completions are kept only with ``text`` (``reading_text``): they can be private data. Without it a
row holds its numbers only (rewards by component, correctness, truncation, length) and no token id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo_exporter import catalog
from grpo_exporter.functional import rows_to_read as pick
from grpo_exporter.functional.diversity import copies_in_group
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.recorder.reading_doc import FORMAT, KINDS, dumps
from grpo_exporter.recorder.rows import Decode, decoded, json_number, positions_of, tokens_of
from grpo_exporter.runtime.background import DaemonExecutor, worker_thread

log = logging.getLogger("grpo_exporter")

PROMPT_CHARS, COMPLETION_CHARS = 2000, 4000  # text kept per row: the head and the tail (where truncation shows)
TEXT_IDS = 1024  # token ids kept per text without decode: the head and the tail
MAX_PENDING = 8  # steps whose picks wait for the reading thread; later steps are skipped until it catches up
RANKED = ("highest_reward", "rising_component", "repeated_groups", "lowest_entropy_groups")
_REWARD_MEAN = "grpo_reward_mean"


def clipped(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: its head and its tail, the cut said in between."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters left out ...] {text[-half:]}"


def _text(ids: list[int], decode: Decode | None, limit: int) -> str | list[int]:
    """Token ids as text (:func:`~grpo_exporter.recorder.rows.decoded`), head and tail within ``limit``; without
    ``decode`` the ids themselves, head and tail."""
    if decode is None:
        return ids if len(ids) <= TEXT_IDS else [*ids[: TEXT_IDS // 2], *ids[-TEXT_IDS // 2:]]
    return clipped(decoded(ids, decode), limit)


@dataclass
class Window:
    """The kept rows of steps ``first_step``..``last_step`` (``first_step`` a multiple of the window's length)."""

    first_step: int
    last_step: int
    kept: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {k: [] for k in KINDS})
    control_seen: int = 0

    def place(self, kind: str, row: dict[str, Any], rows: int, rng: random.Random) -> int | None:
        """Where ``row`` goes among the kind's kept rows, or None when it does not rank among the ``rows`` best (by
        its ``_key``; the control is a uniform sample of the window: a reservoir). Changes nothing but the
        control's count: :meth:`put` keeps it."""
        kept = self.kept[kind]
        if any(r["_id"] == row["_id"] for r in kept):
            return None
        if kind == "control":
            self.control_seen += 1
            slot = len(kept) if len(kept) < rows else rng.randrange(self.control_seen)
            return slot if slot < rows else None
        if len(kept) >= rows and row["_key"] <= kept[-1]["_key"]:
            return None
        return len(kept)

    def put(self, kind: str, row: dict[str, Any], slot: int, rows: int) -> None:
        """Keep ``row`` at the slot :meth:`place` chose: the kind's rows stay ranked, at most ``rows``."""
        kept = self.kept[kind]
        if slot < len(kept) and kind == "control":
            kept[slot] = row
            return
        kept.append(row)
        if kind != "control":
            kept.sort(key=lambda r: r["_key"], reverse=True)
            del kept[rows:]

    def document(self) -> dict[str, Any]:
        return {"first_step": self.first_step, "last_step": self.last_step,
                "rows": {k: [{n: v for n, v in r.items() if not n.startswith("_")} for r in rows]
                         for k, rows in self.kept.items()}}


@dataclass
class Picked:
    """One step's picks, on the device until the reading thread takes them."""

    step: int
    kinds: tuple[str, ...]
    taken: dict[str, Tensor]  # field -> (kinds x k, ...) rows
    score: Tensor  # (kinds, k) fp64
    detail: Tensor  # (kinds, k) fp64
    rising: str | None  # the component the rising kind followed
    rise: float
    entropy_source: str
    ready: Any = None  # a CUDA event after the rows were taken


class ReadingSet:
    """The rollouts to read first, per window of ``window_steps`` steps (the last ``windows`` windows), at most
    ``rows`` per kind. With a ``directory`` (the flight recorder's) it is also written there (:func:`file_name`)
    when a window closes and at close: the set outlives the process."""

    def __init__(self, *, run: str, rank: int, world: int, rows: int, window_steps: int, windows: int, text: bool,
                 group_size: int, decode: Decode | None, on_error: Callable[[BaseException], None]) -> None:
        self._run, self._rank, self._world = run, rank, world
        self._rows, self._window_steps, self._text, self._group_size = rows, window_steps, text, group_size
        self._decode, self._on_error = decode, on_error
        self.directory: Path | None = None
        self._windows: deque[Window] = deque(maxlen=windows)
        self._means: dict[str, deque[float]] = {}  # component -> its last 2 x window_steps step means
        self._random = random.Random(f"{run}/{rank}")
        self._lock = threading.Lock()  # the windows, against readers (the server, an incident's writer)
        self._pending: list[Any] = []
        self._pool = DaemonExecutor("grpo-exporter-reading", initializer=worker_thread, stopped_at_exit=True)
        self.skipped = 0  # steps whose picks were skipped: the reading thread was behind
        self.on_held: Callable[[int], None] | None = None  # told the rows held after each merge (the served gauge)

    # ---- the training thread ----------------------------------------------------------------------------

    def observe(self, step: int, inputs: StepInputs | None, metrics: Mapping[str, float],
                extra: Mapping[str, Tensor | None]) -> None:
        """Pick this rollout's rows to read (device only) and hand them to the reading thread."""
        rising, rise = self._rising(metrics)
        if inputs is None or not inputs.n:
            return
        self._pending = [job for job in self._pending if not job.done()]
        if len(self._pending) >= MAX_PENDING:  # the reading thread is behind (a slow decode): this step is not read
            if not self.skipped:
                log.warning("grpo-exporter reading set: the reading thread is %d steps behind (a slow decode?); "
                            "steps are left out of the reading set until it catches up", MAX_PENDING)
            self.skipped += 1
            return
        picked = self._pick(step, inputs, extra, rising, rise)
        if picked is not None:
            self._pending.append(self._pool.submit(self._merge, picked))

    def _rising(self, metrics: Mapping[str, float]) -> tuple[str | None, float]:
        """The reward component whose step mean rose most over the last window against the window before (each
        component's own units: the reward sums them), from the step's host metrics; None without components."""
        present = set()
        for key, value in metrics.items():
            if not key.startswith(_REWARD_MEAN + "{"):
                continue
            component = catalog.sample_key(key).label_dict.get("component")
            if component and component != "total":
                self._means.setdefault(component, deque(maxlen=2 * self._window_steps)).append(value)
                present.add(component)
        best: tuple[str | None, float] = (None, -float("inf"))
        for component, means in self._means.items():
            if component not in present:  # a component this step does not have cannot be read in its rows
                continue
            half = len(means) // 2
            recent, before = list(means)[half:], list(means)[:half] or list(means)[:1]
            rise = sum(recent) / len(recent) - sum(before) / len(before)
            if rise == rise and rise > best[1]:  # a NaN mean is no rise
                best = (component, rise)
        return best if best[0] is not None else (None, 0.0)

    def _pick(self, step: int, x: StepInputs, extra: Mapping[str, Tensor | None], rising: str | None,
              rise: float) -> Picked | None:
        n, k = x.n or 0, self._rows
        try:
            groups = x.groups(self._group_size)
        except InputError:  # counted once, by the rollout's own step
            return None
        if groups is None:
            return None
        picks: dict[str, pick.Pick] = {}
        if x.rewards is not None:
            picks["highest_reward"] = pick.highest_reward(x.rewards, groups, k)
        component = x.reward_components.get(rising) if rising is not None else None
        if component is not None or x.rewards is not None:
            picks["rising_component"] = pick.rising_component(
                component if component is not None else x.rewards, groups, k)  # type: ignore[arg-type]
        if x.truncated is not None:
            picks["truncated"] = pick.truncated_rows(x.truncated, groups, k)
        positions = positions_of(x)
        if x.completion_ids is not None and positions is not None:
            picks["repeated_groups"] = pick.repeated_groups(
                copies_in_group(x.completion_ids, positions, groups), groups, k)
        entropy, source = self._entropy(x)
        if entropy is not None:
            picks["lowest_entropy_groups"] = pick.lowest_entropy_groups(entropy, groups, k)
        picks["control"] = pick.control_rows(n, k, step, x.device)
        index = torch.cat([p.rows for p in picks.values()])
        fields = self._fields(x, groups, positions, extra)
        taken = {name: t.detach().index_select(0, index) for name, t in fields.items()}
        taken["_row"] = index
        picked = Picked(step, tuple(picks), taken, torch.stack([p.score for p in picks.values()]),
                        torch.stack([p.detail for p in picks.values()]), rising if component is not None else None,
                        rise, source)
        if index.is_cuda:
            picked.ready = torch.cuda.Event()
            picked.ready.record()
        return picked

    @staticmethod
    def _entropy(x: StepInputs) -> tuple[Tensor | None, str]:
        """(N,) row entropy: the policy's, else the sampled tokens' -log p (the engine's, else the trainer's)."""
        tokens = tokens_of(x)
        if tokens is None:
            return None, ""
        if x.entropy is not None:
            return pick.row_entropy(x.entropy, tokens), "entropy"
        lp = x.rollout_logprobs if x.rollout_logprobs is not None else x.old_logprobs
        if lp is None:
            return None, ""
        return pick.row_entropy(lp, tokens, sign=-1.0), "the sampled tokens' -log p"

    def _fields(self, x: StepInputs, groups: Any, positions: Tensor | None,
                extra: Mapping[str, Tensor | None]) -> dict[str, Tensor]:
        """The (N, ...) tensors a read row is taken from: numbers always, prompt and completion ids (and the
        completion's positions, to cut it) with text."""
        found: dict[str, Tensor] = {"_group": groups.index, "_group_size": groups.sizes()[groups.index]}
        for name in ("rewards", "correct", "truncated", "completion_lengths", "group_ids"):
            t = getattr(x, name)
            if isinstance(t, Tensor) and t.dim() == 1:
                found[name] = t
        for name, t in x.reward_components.items():
            found[f"reward_components.{name}"] = t
        ids = extra.get("prompt_ids")
        if self._text and _one_per_row(ids, x):  # a hash of the prompt's text, where prompts are strings
            found["prompt_ids"] = ids  # type: ignore[assignment]
        if "completion_lengths" not in found and positions is not None:
            found["completion_lengths"] = positions.sum(1)
        if self._text:
            if x.completion_ids is not None:
                found["completion_ids"] = x.completion_ids
                if positions is not None:
                    found["_positions"] = positions
            tokens = extra.get("prompt_tokens")
            if _one_per_row(tokens, x):
                found["prompt_tokens"] = tokens  # type: ignore[assignment]
        return found

    # ---- the reading thread -----------------------------------------------------------------------------

    def _merge(self, picked: Picked) -> None:
        try:
            if picked.ready is not None:
                picked.ready.synchronize()
            host = {name: t.cpu() for name, t in picked.taken.items()}
            values = {name: t.tolist() for name, t in host.items() if t.dim() == 1}  # per row: read once
            scores, details = picked.score.tolist(), picked.detail.tolist()
            k = self._rows
            if self._closing(picked.step):  # the newest window is complete: written before a new one pushes it out
                self._write_contained()
                first = picked.step - picked.step % self._window_steps
                with self._lock:
                    self._windows.append(Window(first, first + self._window_steps - 1))
            window = self._windows[-1]
            if not window.first_step <= picked.step <= window.last_step:
                return  # a step of a window already gone (a late rollout)
            for c, kind in enumerate(picked.kinds):
                for s in range(k):
                    if scores[c][s] == -float("inf"):
                        continue
                    row = row_of(values, c * k + s, picked, kind, scores[c][s], details[c][s])
                    slot = window.place(kind, row, k, self._random)  # only this thread changes the windows
                    if slot is not None:
                        self._with_text(row, host, c * k + s)  # decoded outside the lock: readers never wait
                        with self._lock:
                            window.put(kind, row, slot, k)
            if self.on_held is not None:
                self.on_held(self.held_rows())
        except Exception as exc:  # counted and logged; the set keeps what it had
            self._on_error(exc)

    def _closing(self, step: int) -> bool:
        """Whether ``step`` opens a new window (it is past the newest, or the first)."""
        return not self._windows or step - step % self._window_steps > self._windows[-1].first_step

    def _with_text(self, row: dict[str, Any], host: Mapping[str, Tensor], pos: int) -> None:
        """The kept row's prompt and completion (only with ``text``; decoded only once it is kept)."""
        if "prompt_tokens" in host:
            row["prompt"] = _text(host["prompt_tokens"][pos].tolist(), self._decode, PROMPT_CHARS)
        if "completion_ids" in host:
            ids = host["completion_ids"][pos]
            if "_positions" in host:
                ids = ids[host["_positions"][pos].bool()]
            row["completion"] = _text(ids.tolist(), self._decode, COMPLETION_CHARS)

    # ---- readers (any thread) ------------------------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        """The set, newest window first (JSON-ready)."""
        with self._lock:
            windows = [w.document() for w in reversed(self._windows)]
        return {"format": FORMAT, "run": self._run, "rank": self._rank, "world": self._world,
                "text_kept": self._text, "window_steps": self._window_steps, "windows": windows}

    def held_rows(self) -> int:
        with self._lock:
            return sum(len(rows) for w in self._windows for rows in w.kept.values())

    def _write(self) -> None:
        """:func:`file_name` in the directory, owner-only, fsynced and renamed into place; by the reading thread
        only (at a window's end, and for close())."""
        if self.directory is None or not self._windows:
            return
        path = self.directory / file_name(self._run, self._rank)
        partial = path.with_name(f".{path.name}.partial")  # this rank's own: a write a kill cut short is redone
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(dumps(self.document()))
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)

    def wait(self, timeout: float) -> None:
        """Block until the picks handed to the reading thread are merged (at most ``timeout``; tests, close)."""
        deadline = time.monotonic() + timeout
        for job in list(self._pending):
            with contextlib.suppress(Exception):
                job.result(timeout=max(0.0, deadline - time.monotonic()))

    def _write_contained(self) -> None:
        """:meth:`_write`, its failure (a full disk) counted and logged: the set goes on with its next window."""
        try:
            self._write()
        except Exception as exc:
            self._on_error(exc)

    def close(self, timeout: float = 2.0) -> None:
        """Write the set once the queued merges are done, on the reading thread (a stuck filesystem never holds
        the caller), waiting at most ``timeout``; then the thread takes no more work."""
        deadline = time.monotonic() + timeout
        self.wait(timeout)
        try:
            final = self._pool.submit(self._write_contained)
        except RuntimeError:  # closed before
            return
        self._pool.shutdown(0.0)
        with contextlib.suppress(Exception):
            final.result(timeout=max(0.0, deadline - time.monotonic()))


def file_name(run: str, rank: int) -> str:
    """``reading-<run>-r<rank>.json``, the run's characters outside ``[A-Za-z0-9._-]`` as ``_`` (a restarted run
    in the same directory keeps its own)."""
    return f"reading-{re.sub(r'[^A-Za-z0-9._-]', '_', run)[:128]}-r{rank}.json"


def _one_per_row(t: Tensor | None, x: StepInputs) -> bool:
    """A tensor a row can be taken from: one entry per row of the batch, on the batch's device."""
    return isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == x.n and t.device == x.device


def row_of(values: Mapping[str, list[Any]], pos: int, picked: Picked, kind: str, score: float,
           detail: float) -> dict[str, Any]:
    """A picked row's numbers (``values``: each (rows,) field as a list) and why it is in its kind."""
    row: dict[str, Any] = {"step": picked.step, "row": int(values["_row"][pos]),
                           "group": int(values.get("group_ids", values["_group"])[pos])}
    if "prompt_ids" in values:
        row["prompt_id"] = int(values["prompt_ids"][pos])
    if "rewards" in values:
        row["reward"] = json_number(float(values["rewards"][pos]))
    components = {k.split(".", 1)[1]: json_number(float(v[pos])) for k, v in values.items()
                  if k.startswith("reward_components.")}
    if components:
        row["reward_components"] = components
    for name in ("correct", "truncated"):
        if name in values:
            row[name] = bool(values[name][pos])
    if "completion_lengths" in values:
        row["length"] = int(values["completion_lengths"][pos])
    if kind == "repeated_groups":
        row["copies"] = int(detail)
    elif kind == "lowest_entropy_groups":
        row["group_entropy_nats"] = json_number(detail)
    row["why"] = _why(kind, score, detail, int(values["_group_size"][pos]), picked, row)
    row["_key"] = (score, picked.step) if kind != "truncated" else (picked.step, 0.0)
    row["_id"] = (picked.step, row["group"]) if kind.endswith("_groups") else (picked.step, row["row"])
    return row



def _why(kind: str, score: float, detail: float, size: int, picked: Picked, row: Mapping[str, Any]) -> str:
    if kind == "highest_reward":
        return f"reward {score:.4g}"
    if kind == "rising_component":
        if picked.rising is None:
            return f"reward {score:+.4g} above its group's mean"
        return (f"{picked.rising} {score:+.4g} above its group's mean; {picked.rising} rose {picked.rise:+.3g} "
                "(step mean, last window against the one before)")
    if kind == "truncated":
        return f"truncated at {row.get('length', '?')} tokens"
    if kind == "repeated_groups":
        return f"{int(detail)} of its group's {size} completions are this one, token for token"
    if kind == "lowest_entropy_groups":
        return f"its group's mean entropy {detail:.3g} nats ({picked.entropy_source})"
    return "at random"


__all__ = ["ReadingSet", "clipped"]
