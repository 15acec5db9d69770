"""The verl and OpenRLHF adapters, tested on the frameworks' own objects in their own virtualenv
(.venv-frameworks, made by scripts/setup-frameworks.sh, which scripts/test.sh runs): verl pins transformers
< 5.11, which cannot share .venv with TRL 1.16. Every test there must pass; none may be skipped."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-frameworks" / "bin" / "python"
CHECKS = {"verl": 23, "verl_v1": 10, "openrlhf": 34}
# scripts/test.sh makes the virtualenv in the background: the set-up's pid while it runs, its exit code, its output
PENDING, STATUS, LOG = (ROOT / f".venv-frameworks.{end}" for end in ("pending", "status", "log"))
SETUP_WAIT_S = 1200


def _log_tail() -> str:
    return LOG.read_text(errors="replace")[-3000:] if LOG.exists() else "(no .venv-frameworks.log)"


@pytest.fixture(scope="module")
def frameworks_venv() -> Path:
    """The frameworks' virtualenv, once scripts/test.sh's background set-up is done (at once when none runs)."""
    deadline = time.monotonic() + SETUP_WAIT_S
    while PENDING.exists() and time.monotonic() < deadline:
        pid = PENDING.read_text().strip()
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():  # Linux, as the set-up scripts
            pytest.fail(f"scripts/setup-frameworks.sh (pid {pid}) ended without a status:\n{_log_tail()}")
        time.sleep(1.0)
    assert not PENDING.exists(), f"scripts/setup-frameworks.sh still runs after {SETUP_WAIT_S} s:\n{_log_tail()}"
    if STATUS.exists():
        code = STATUS.read_text().strip()
        assert code == "0", f"scripts/setup-frameworks.sh failed (exit {code}):\n{_log_tail()}"
    assert VENV_PYTHON.exists(), "no .venv-frameworks: run `bash scripts/setup-frameworks.sh` (scripts/test.sh does)"
    return VENV_PYTHON


@pytest.mark.parametrize("framework", sorted(CHECKS))
def test_adapter_on_the_real_framework(framework: str, frameworks_venv: Path) -> None:
    done = subprocess.run(
        [str(frameworks_venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir=tests/frameworks",
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
