"""The CLI commands that need no tensors start without torch: importing it costs ~1.2 s, more than the command.

Each command runs in a fresh interpreter that reports, after ``main`` returned, whether ``torch`` was imported.
The package root imports its public names (``GRPOMonitor`` and the rest) on first access, so the commands reach
only the modules they use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = """
import sys
from grpo_exporter.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(f"torch imported: {'torch' in sys.modules}", file=sys.stderr)
sys.exit(code)
"""
#: a minimal incident manifest, as the flight recorder writes one
MANIFEST = {"format": 1, "id": "incident-x", "run": "r", "rank": 0, "world": 1, "triggers": ["nonfinite"],
            "steps": {"last_normal": 0, "first_anomalous": 1, "next": None},
            "states": {"first_anomalous": {"step": 1, "metrics": {"grpo_nonfinite_values_total": 1.0},
                                           "rows": {"update": [{"row": 3, "driver": "nonfinite", "rewards": 1.0}]}}}}
COMMANDS = {
    "--version": ["--version"],
    "catalog": ["catalog"],
    "rules": ["rules", "--out", "rules-out"],
    "dashboards": ["dashboards", "--out", "dashboards-out"],
    "kubernetes": ["kubernetes", "--out", "k8s-out"],
    "reference": ["reference", "--out", "docs-out", "--runbooks", str(ROOT / "docs" / "runbooks.md")],
    "inspect": ["inspect", "incident"],
    "hash-password": ["hash-password", "--password", "pw"],
    "targets prune": ["targets", "prune", "--dir", "targets"],
}


def _run(args: list[str], cwd: Path, code: str = WRAPPER) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_that_needs_no_tensors_does_not_import_torch(name, tmp_path):
    (tmp_path / "incident").mkdir()
    (tmp_path / "incident" / "incident.json").write_text(json.dumps(MANIFEST))
    (tmp_path / "targets").mkdir()
    done = _run(COMMANDS[name], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "torch imported: False", done.stderr[-2000:]


def test_the_public_names_import_on_first_access(tmp_path):
    """The lazy package root still serves every public name (the check above is not vacuous: GRPOMonitor brings
    torch)."""
    code = """
import sys
import grpo_exporter
assert "torch" not in sys.modules
names = {name: getattr(grpo_exporter, name) for name in grpo_exporter.__all__}
from grpo_exporter import GRPOMonitor, MonitorConfig
from grpo_exporter.runtime.monitor import GRPOMonitor as defined
assert GRPOMonitor is defined is names["GRPOMonitor"]
assert set(grpo_exporter.__all__) <= set(dir(grpo_exporter))
print("torch" in sys.modules)
"""
    done = _run([], tmp_path, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
    missing = _run([], tmp_path, "import grpo_exporter\ngrpo_exporter.NoSuchName")
    assert "AttributeError: module 'grpo_exporter' has no attribute 'NoSuchName'" in missing.stderr
