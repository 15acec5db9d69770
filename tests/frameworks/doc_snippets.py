"""The ```py blocks of the framework quickstarts (docs/quickstart-*.md) that need a framework of this
virtualenv: each check file runs its framework's block as written (tests/test_doc_blocks.py checks that every
block has a runner)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def snippet(marker: str) -> str:
    """The one ```py block of the quickstarts that names ``marker``."""
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("quickstart-*.md")))
    blocks = re.findall(r"```py\n(.*?)```", text, flags=re.DOTALL)
    (code,) = [b for b in blocks if marker in b]
    return code


#: one series per input group of docs/frameworks.md
GROUP_SERIES = {"verdicts": "grpo_pass_at_k_ratio", "engine": "grpo_engine_logprob_gap_mean_nats",
                "ratios": "grpo_onpolicy_checked_tokens_total", "entropy": "grpo_entropy_mean_nats",
                "kl": "grpo_kl_ref_nats", "grad": "grpo_grad_norm_pre_clip",
                "staleness": "grpo_rollout_staleness_versions", "tools": "grpo_loss_mask_tool_tokens_total"}


def assert_never_as_documented(metrics: dict[str, float], mode: str, unmet: tuple[str, ...] = ()) -> None:
    """docs/frameworks.md's "never" for ``mode`` holds on the framework's own objects: no series of a group it
    says the adapter never hands over is published, nor of a conditional group (``unmet``, "yes (with ...)")
    whose condition this run does not meet."""
    from grpo_exporter.reference.frameworks import MODES

    assert all(MODES[mode].get(g) for g in unmet), f"{mode}: {unmet} are not conditional in docs/frameworks.md"
    published = {key.partition("{")[0] for key in metrics}
    wrong = sorted(g for g, name in GROUP_SERIES.items()
                   if (g not in MODES[mode] or g in unmet) and name in published)
    assert not wrong, f"{mode}: published {wrong}, which docs/frameworks.md says it never hands over"
