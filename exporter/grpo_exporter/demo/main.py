"""``grpo-exporter demo``: a tiny GRPO run with a fault injected, watched by the exporter, scraped by a real
Prometheus, paging through a real Alertmanager into a receiver that prints each page."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.demo.scenarios import SCENARIOS, STEPS_PER_SECOND
from grpo_exporter.demo.stack import INSTALL_HINT, Page, Stack, missing_binaries
from grpo_exporter.demo.task import decode
from grpo_exporter.demo.trainer import Trainer
from grpo_exporter.recorder.store import incidents


def run_demo(
    scenario: str = "engine-stale-weights",
    inject_at: int | None = None,
    steps: int = 400,
    stack: bool = True,
    seed: int | None = None,
    steps_per_second: float | None = None,
    out: Callable[[str], None] = print,
    record: str | Path | None = None,
) -> list[str]:
    """Run the demo; returns the page lines received. ``inject_at`` and ``seed`` default to the scenario's
    (docs/demo.md), ``steps_per_second`` to the pace the scenarios are calibrated for; ``record``: a flight
    recorder directory (docs/recorder.md). Ctrl-C (KeyboardInterrupt) stops it and everything it started."""
    if scenario not in SCENARIOS:
        raise ValueError(f"--scenario: expected one of {', '.join(SCENARIOS)}, got {scenario!r}")
    s = SCENARIOS[scenario]
    inject_at = s.inject_at if inject_at is None else inject_at
    seed = s.seed if seed is None else seed
    pace = STEPS_PER_SECOND if steps_per_second is None else steps_per_second
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    if stack and missing_binaries():
        out(f"note: {INSTALL_HINT}; running the exporter and its in-process guard only")
        stack = False
    pages: list[str] = []
    page = _pager(pages, out, s.expected_alerts)

    cfg = s.config(seed)
    # the demo's own stack stops before the exporter closes (below): nobody is left to see the end, so no linger
    with GRPOMonitor(run=f"demo-{scenario}-{seed}", port=0, guard="warn", close_linger_s=0.0, recorder_dir=record,
                     decode=decode, **cfg.monitor_settings()) as mon:
        out(f"exporter:     {mon.url}")
        local = Stack(on_page=page, targets=(mon.port or 0,)) if stack else None
        try:  # the stack stops first: no scrape of a closed exporter, no "exporter down" page at the end
            if local is not None:
                out(f"prometheus:   {local.prometheus_url}/alerts")
                out(f"alertmanager: {local.alertmanager_url}   pages are printed here as they arrive")
            trainer = Trainer(cfg, mon)
            out(f"warm start: sampled accuracy {trainer.warm_start():.2f}")
            if s.expected_alerts:
                out(f"fault {scenario} at step {inject_at}: {s.what}; expect {', '.join(s.expected_alerts)} "
                    f"[layer {s.layer}]")
            for step in range(steps):
                start = time.monotonic()
                if step == inject_at and s.expected_alerts:
                    s.inject(trainer)
                    out(f"step {step}: injected {scenario}")
                r = trainer.step(step)
                out(f"step {r.step:4d}  reward {r.reward:5.2f}  correct {r.correct:4.2f}  truncated {r.truncated:4.2f}"
                    f"  grad {r.grad_norm:8.3g}{'  (step skipped: non-finite or zero norm)' if r.skipped else ''}")
                time.sleep(max(0.0, 1.0 / pace - (time.monotonic() - start)))
        finally:
            if local is not None:
                local.close()
    out(f"{len(pages)} page(s) received")
    if record is not None:
        written = incidents(Path(record))
        out(f"flight recorder: {len(written)} incident(s) in {record}"
            + (f"; read the latest with: grpo-exporter inspect {written[-1]}" if written else ""))
    return pages


def _pager(pages: list[str], out: Callable[[str], None], expected: tuple[str, ...]) -> Callable[[Page], None]:
    """What the demo's receiver does with a page: print it, and for the first page of an expected alert the
    rollouts it links (read first: what the person on call sees)."""
    read: set[str] = set()

    def page(p: Page) -> None:
        pages.append(p.line())
        out(p.line())
        if p.status == "firing" and p.alert in expected and p.alert not in read and p.reading:
            read.add(p.alert)
            out(_reading(p.reading))

    return page


def _reading(url: str) -> str:
    """The newest window of the reading set a page links, two rows a kind, as ``grpo-exporter read`` prints it."""
    from grpo_exporter.recorder.reading_doc import for_page, render_text
    from grpo_exporter.recorder.reading_source import ReadingSourceError, load, page_of

    try:
        return f"read first (grpo-exporter read {url}):\n" + render_text(for_page(load(url), *page_of(url), 1), 2)
    except ReadingSourceError as exc:
        return f"the rollouts to read could not be fetched: {exc}"
