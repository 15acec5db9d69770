"""The names the code examples of README.md and docs/exporter.md use, bound to a tiny real training setup, with
one fault of each layer-1 kind injectable: the examples then run verbatim (tests/test_doc_examples.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
G, PROMPTS, T = 16, 2, 12
FAULTS = ("healthy", "onpolicy", "mask", "grad", "nonfinite")


def examples(doc: str) -> list[str]:
    """The ```python blocks of a markdown file, in order."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def namespace(fault: str = "healthy") -> dict[str, Any]:
    """Globals for an example: tensors of one rollout of PROMPTS x G completions, a model and its optimizer."""
    gen = torch.Generator().manual_seed(0)
    n = PROMPTS * G
    lengths = torch.randint(3, T, (n,), generator=gen)
    positions = torch.arange(T)[None, :] < lengths[:, None]
    mask = positions.clone()
    if fault == "mask":
        mask[0, lengths[0]] = True  # trains on a padding position: the classic mask bug
    old_lp = torch.where(positions, -torch.rand(n, T, generator=gen) * 3, 0.0)  # padding holds 0, not -inf
    lp = old_lp + 0.01 * torch.randn(n, T, generator=gen)
    if fault == "onpolicy":
        lp = old_lp + 0.5  # the trainer computes another probability path than the behaviour policy
    if fault == "nonfinite":
        lp[1, 0] = torch.nan
    ok = torch.rand(n, generator=gen) < 0.5
    r = ok.float() + 0.1 * torch.rand(n, generator=gen)
    grouped = r.view(PROMPTS, G)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4, generator=gen)

    def policy_loss(micro: object) -> torch.Tensor:
        loss = model(x).square().mean()
        return loss * torch.nan if fault == "grad" else loss

    policy_loss(None).backward()  # gradients exist from the first clip on

    def framework_clip(m: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)

    return {
        "steps": 3, "loader": [object()] * 3, "engine": SimpleNamespace(generate=lambda batch: batch),
        "micro_batches": [0, 1], "first_update": True,
        "r": r, "ok": ok, "cut": lengths == T - 1, "f": torch.rand(n, generator=gen), "pids": torch.arange(n) // G,
        "engine_lp": old_lp + 1e-5, "old_lp": old_lp, "lp": lp, "ref_lp": old_lp, "mask": mask, "lengths": lengths,
        "ids": torch.randint(0, 50, (n, T), generator=gen), "adv": adv, "ent": torch.rand(n, T, generator=gen),
        "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3), "policy_loss": policy_loss,
        "framework_clip": framework_clip, "held_ok": torch.rand(64, generator=gen) < 0.95,
    }
