"""``grpo-exporter demo``: a tiny GRPO run with a fault injected, watched by the exporter, scraped by a real
Prometheus, paging through a real Alertmanager into a receiver that prints each page."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.demo.scenarios import SCENARIOS
from grpo_exporter.demo.stack import INSTALL_HINT, Stack, missing_binaries
from grpo_exporter.demo.trainer import DemoConfig, Trainer


def run_demo(
    scenario: str = "engine-desync",
    inject_at: int = 40,
    steps: int = 300,
    stack: bool = True,
    seed: int = 0,
    steps_per_second: float = 4.0,
    out: Callable[[str], None] = print,
) -> list[str]:
    """Run the demo; returns the page lines received. Ctrl-C stops it and everything it started."""
    if scenario not in SCENARIOS:
        raise ValueError(f"--scenario: expected one of {sorted(SCENARIOS)}, got {scenario!r}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)
    if stack and missing_binaries():
        out(f"note: {INSTALL_HINT}; running the exporter and its in-process guard only")
        stack = False
    pages: list[str] = []

    def page(p: object) -> None:
        line = p.line()  # type: ignore[attr-defined]
        pages.append(line)
        out(line)

    cfg = DemoConfig(seed=seed)
    local = Stack(on_page=page) if stack else None
    try:
        with GRPOMonitor(run=f"demo-{scenario}-{seed}", group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=0,
                         log_ratio_clamp=cfg.log_ratio_clamp, guard="warn") as mon:
            out(f"exporter:   {mon.url}")
            if local is not None:
                local.set_targets([mon.port or 0])
                out(f"prometheus: {local.prometheus_url}/alerts   alertmanager: {local.alertmanager_url}")
            trainer = Trainer(cfg, mon)
            out(f"warm start: sampled accuracy {trainer.warm_start():.2f}")
            s = SCENARIOS[scenario]
            for step in range(steps):
                start = time.monotonic()
                if step == inject_at and scenario != "healthy":
                    s.inject(trainer)
                    out(f"step {step}: injecting {scenario} ({s.what}); expect {', '.join(s.expected_alerts)} "
                        f"[layer {s.layer}]")
                r = trainer.step(step)
                out(f"step {r.step:4d}  reward {r.reward:5.2f}  correct {r.correct:4.2f}  truncated {r.truncated:4.2f}"
                    f"  grad {r.grad_norm:8.3g}{'  (step skipped: non-finite)' if r.skipped else ''}")
                time.sleep(max(0.0, 1.0 / steps_per_second - (time.monotonic() - start)))
    finally:
        if local is not None:
            local.close()
    return pages
