"""The command line."""

from __future__ import annotations

import subprocess
import sys

from grpo_exporter.cli import main
from grpo_exporter.monitor_config import verify_password


def test_hash_password(capsys):
    assert main(["hash-password", "--password", "pw"]) == 0
    encoded = capsys.readouterr().out.strip()
    assert verify_password("pw", encoded)
    assert not verify_password("other", encoded)


def test_catalog_to_stdout_and_console_script(tmp_path):
    out = tmp_path / "metrics.md"
    assert main(["catalog", "--out", str(out)]) == 0
    assert out.read_text().startswith("# Metric reference")
    done = subprocess.run([sys.executable, "-m", "grpo_exporter.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout.startswith("grpo-exporter ")


def test_demo_names_the_scenarios_on_a_bad_one(capsys):
    assert main(["demo", "--scenario", "mask_bug", "--no-stack"]) == 2
    err = capsys.readouterr().err
    assert "--scenario: expected one of healthy, engine-desync," in err
    assert "got 'mask_bug'" in err
