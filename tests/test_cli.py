"""The command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_demo_lists_the_scenarios_and_refuses_a_bad_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    assert "one of: healthy, healthy-reverse, engine-desync," in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--scenario", "mask_bug", "--no-stack"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'mask_bug'" in err
    assert "'mask-bug'" in err


def test_rules_out_writes_everything_under_the_named_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a repository root would hold rules/ and deploy/alertmanager/
    assert main(["rules", "--out", "mine"]) == 0
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["mine/alertmanager.yml", "mine/grpo-alerts.rules.yml", "mine/grpo-recording.rules.yml"]
    assert "runbook_url is the local fallback" in capsys.readouterr().out
    alerts = (tmp_path / "mine" / "grpo-alerts.rules.yml").read_text()
    assert alerts.splitlines()[1].startswith("# runbook_url base: docs/runbooks.md (the local fallback")
    config = tmp_path / "mixin.yml"
    config.write_text("runbook_url: https://runbooks.example.org/grpo.md\n")
    assert main(["rules", "--out", "hosted", "--config", str(config)]) == 0
    assert "local fallback" not in capsys.readouterr().out
    hosted = (tmp_path / "hosted" / "grpo-alerts.rules.yml").read_text()
    assert "# runbook_url base: https://runbooks.example.org/grpo.md\n" in hosted
