"""The command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from grpo_exporter.cli import main
from grpo_exporter.mixin.config import RUNBOOKS
from grpo_exporter.serving.settings import verify_password


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
    assert "one of: healthy, healthy-reverse, healthy-tool," in " ".join(capsys.readouterr().out.split())
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
    alerts = (tmp_path / "mine" / "grpo-alerts.rules.yml").read_text()
    assert alerts.splitlines()[1] == f"# runbook_url base: {RUNBOOKS}"
    config = tmp_path / "mixin.yml"
    config.write_text("runbook_url: https://runbooks.example.org/grpo.md\n")
    assert main(["rules", "--out", "hosted", "--config", str(config)]) == 0
    hosted = (tmp_path / "hosted" / "grpo-alerts.rules.yml").read_text()
    assert "# runbook_url base: https://runbooks.example.org/grpo.md\n" in hosted
    assert "runbook_url: https://runbooks.example.org/grpo.md#grpolossmaskmismatch" in hosted


def test_a_runbook_a_phone_cannot_open_and_a_moved_setting_are_named(tmp_path, capsys):
    """A page carries absolute links: a relative runbook_url is refused, naming the setting, what it expects and
    what came; so is a setting of an earlier version, with where it went; no traceback."""
    config = tmp_path / "mixin.yml"
    config.write_text("runbook_url: docs/runbooks.md\nslack_api_url: https://hooks.slack.com/x\n")
    with pytest.raises(SystemExit) as exit_:
        main(["rules", "--out", str(tmp_path / "out"), "--config", str(config)])
    lines = str(exit_.value.code).splitlines()
    assert lines == [
        f"grpo-exporter: error: --config {config}: runbook_url: String should match pattern '^https?://\\S+$', "
        "got 'docs/runbooks.md'",
        f"grpo-exporter: error: --config {config}: slack_api_url: not a setting (its value is not shown) "
        "(docs/config-rules.md lists the settings)",
    ]
    config.write_text("pager_webhook_url: http://pager.internal/hook\n")
    with pytest.raises(SystemExit) as exit_:
        main(["rules", "--out", str(tmp_path / "out"), "--config", str(config)])
    assert str(exit_.value.code) == (f"grpo-exporter: error: --config {config}: pager_webhook_url: this setting "
                                     "moved to receivers.pager.webhook.url (receivers: docs/receivers.md), got "
                                     "pager_webhook_url set")
    assert not (tmp_path / "out").exists()


def test_rules_for_ten_minute_steps_size_every_window_in_steps(tmp_path, monkeypatch):
    """The README's `grpo-exporter rules --step-seconds 600 --out my-rules/`: 5-step windows (50 min), 60-step
    baselines ending 10 steps back, a trend `for` of 6 steps; the config file's other settings are kept."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "mixin.yml"
    config.write_text('selector: job="grpo-train"\n')
    assert main(["rules", "--step-seconds", "600", "--out", "my-rules/", "--config", str(config)]) == 0
    recording = (tmp_path / "my-rules" / "grpo-recording.rules.yml").read_text()
    assert 'rate(grpo_groups_total{job="grpo-train"}[50m])' in recording
    assert "[10h] offset 100m" in recording
    alerts = yaml.safe_load((tmp_path / "my-rules" / "grpo-alerts.rules.yml").read_text())["groups"][0]["rules"]
    ess = next(r for r in alerts if r["alert"] == "GRPOESSDrop")
    assert ess["for"] == "1h"  # max(5 min, 6 steps of 10 min)
    assert ess["keep_firing_for"] == "200m"  # a trend window of 20 steps


def test_a_secret_written_in_place_is_refused_without_being_echoed(tmp_path):
    """The natural first try, a Slack URL under `slack:`, fails naming where secrets go; the URL stays out of the
    terminal and the CI log, also when pasted into a `*_file` field."""
    config = tmp_path / "mixin.yml"
    secret = "https://hooks.slack.com/services/T0000/B0000/XXXXSECRETXXXX"
    config.write_text(f"slack_api_url: '{secret}'\nreceivers: {{pager: {{slack: {{api_url: '{secret}', chanel: x}}, "
                      f"pagerduty: {{routing_key_file: '{secret}'}}}}, default: {{webhook: '{secret}'}}}}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["rules", "--out", str(tmp_path / "out"), "--config", str(config)])
    text = str(exit_.value.code)
    assert secret not in text
    assert ("receivers.pager.slack.api_url: not a setting (its value is not shown); a secret is read from a file, "
            "api_url_file, or in Kubernetes from a Secret key, api_url_secret (docs/receivers.md)") in text
    assert "receivers.pager.pagerduty.routing_key_file: expected the absolute path of a file holding the secret" in text
    assert "receivers.pager.slack.chanel: not a setting (its value is not shown) (docs/receivers.md lists" in text
    assert "receivers.default.webhook: Input should be a valid dictionary" in text
    assert not (tmp_path / "out").exists()
