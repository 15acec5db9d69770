"""The demo's local stack for real: the demo trainer with a mask bug, scraped by a real Prometheus with the
time-scaled generated rules, paging through a real Alertmanager into the built-in receiver."""

from __future__ import annotations

import time

import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.demo.scenarios import SCENARIOS
from grpo_exporter.demo.stack import Stack
from grpo_exporter.demo.trainer import DemoConfig, Trainer

PAGE_WITHIN_S = 45


def test_mask_bug_pages_layer_one_through_the_stack(tmp_path):
    torch.set_num_threads(1)
    cfg = DemoConfig(seed=2)
    with Stack(workdir=tmp_path) as stack, GRPOMonitor(
        run="stack-mask-bug", group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=0, guard="off",
        log_ratio_clamp=cfg.log_ratio_clamp, edit_distance_groups=0,
    ) as mon:
        stack.set_targets([mon.port or 0])
        trainer = Trainer(cfg, mon)
        trainer.warm_start()
        step, injected_at = 0, None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if step == 8:
                SCENARIOS["mask-bug"].inject(trainer)
                injected_at = time.monotonic()
            trainer.step(step)
            step += 1
            time.sleep(0.25)
            if any(p.alert == "GRPOLossMaskMismatch" for p in stack.pages):
                break
        assert injected_at is not None
        page = next(p for p in stack.pages if p.alert == "GRPOLossMaskMismatch")
        assert time.monotonic() - injected_at < PAGE_WITHIN_S
        assert (page.receiver, page.status, page.layer, page.severity, page.run) == (
            "pager", "firing", "1-gradient", "critical", "stack-mask-bug"
        )
        assert page.runbook == "docs/runbooks.md#grpolossmaskmismatch"
        assert "PAGE [pager] FIRING GRPOLossMaskMismatch layer=1-gradient" in page.line()
