"""The verl and OpenRLHF adapters, tested on the frameworks' own objects in their own virtualenv
(.venv-frameworks, made by scripts/setup-frameworks.sh, which scripts/test.sh runs): verl pins transformers
< 5.11, which cannot share .venv with TRL 1.16. Every test there must pass; none may be skipped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-frameworks" / "bin" / "python"
CHECKS = {"verl": 12, "verl_v1": 6, "openrlhf": 7}


@pytest.mark.parametrize("framework", sorted(CHECKS))
def test_adapter_on_the_real_framework(framework: str) -> None:
    assert VENV_PYTHON.exists(), "no .venv-frameworks: run `bash scripts/setup-frameworks.sh` (scripts/test.sh does)"
    done = subprocess.run(
        [str(VENV_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir=tests/frameworks",
         f"tests/frameworks/check_{framework}.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{CHECKS[framework]} passed\b", summary), tail
    assert "skipped" not in summary, summary
    assert "xfail" not in summary, summary


def test_the_core_package_never_imports_a_framework() -> None:
    """`import grpo_exporter` must work without TRL, verl or OpenRLHF: adapters are imported on demand."""
    code = "import sys, grpo_exporter; print(sorted(m for m in ('trl', 'verl', 'openrlhf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
