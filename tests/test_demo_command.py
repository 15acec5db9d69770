"""The README's demo command, run as a new user would: its own set-up, then the default scenario through the
real stack; a page must be printed within two minutes, and Ctrl-C must stop every process it started."""

from __future__ import annotations

import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from grpo_exporter.mixin.config import RUNBOOKS

ROOT = Path(__file__).resolve().parents[1]
PAGE_WITHIN_S = 120.0


def readme_commands() -> list[str]:
    """The commands of the README's first code block."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md starts with a bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_starts_with_the_demo_and_the_test_suite():
    commands = readme_commands()
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _read_until(process: subprocess.Popen[str], done: Callable[[str], bool], timeout: float) -> list[str]:
    """Output lines until one satisfies ``done`` (the last line returned), the process exits or ``timeout``
    elapses; never blocks longer than that on a silent process."""
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if selector.select(timeout=1):
            lines.append(process.stdout.readline().rstrip())
            if done(lines[-1]):
                break
    return lines


def test_readme_demo_command_prints_a_page_within_two_minutes_and_ctrl_c_stops_everything():
    command = readme_commands()[0]
    start = time.monotonic()
    process = subprocess.Popen(shlex.split(command), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        lines = _read_until(process, lambda line: line.startswith("PAGE "), PAGE_WITHIN_S)
        elapsed = time.monotonic() - start
        page = lines[-1] if lines and lines[-1].startswith("PAGE ") else None
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground process group
        rest, _ = process.communicate(timeout=30)
        lines += rest.splitlines()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "\n".join(lines)
    assert page is not None, output[-3000:]
    assert elapsed < PAGE_WITHIN_S
    assert "FIRING GRPOEngineLogprobGapCritical layer=1-gradient" in page, page  # the default scenario's alert
    assert f"runbook: {RUNBOOKS}#grpoenginelogprobgapcritical" in page
    assert process.returncode == 130, output[-3000:]
    assert "stopped" in lines[-1]
    urls = re.findall(r"(?:exporter|prometheus|alertmanager): +(http://127\.0\.0\.1:\d+)", output)
    assert len(urls) == 3, output[:2000]
    assert not any(_port_open(url) for url in urls), urls  # nothing it started is left listening


def _urls_once_started(process: subprocess.Popen[str], marker: str, timeout: float = 60.0) -> list[str]:
    lines = _read_until(process, lambda line: marker in line, timeout)
    assert marker in (lines[-1] if lines else ""), "\n".join(lines)
    return re.findall(r"http://127\.0\.0\.1:\d+", "\n".join(lines))


def _closed_within(urls: list[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_port_open(url) for url in urls):
            return True
        time.sleep(0.2)
    return False


def test_kill_stops_the_demo_like_ctrl_c():
    process = subprocess.Popen([str(ROOT / ".venv/bin/grpo-exporter"), "demo", "--steps", "1000"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        urls = _urls_once_started(process, "step    2 ")
        assert len(urls) == 3
        assert all(_port_open(u) for u in urls)
        process.terminate()
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, out
    assert _closed_within(urls, 5), urls


def test_ctrl_c_stops_a_demo_started_where_sigint_is_ignored():
    """A shell's background job (`cmd &`, and every command a non-interactive script starts that way, as CI runners
    do) starts with SIGINT ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C reached the demo
    and training went on (found when the README command's test ran under a backgrounded suite). The demo installs
    its own handler."""
    process = subprocess.Popen([str(ROOT / ".venv/bin/grpo-exporter"), "demo", "--steps", "1000", "--no-stack"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        lines = _read_until(process, lambda line: line.startswith("step    2 "), 60)
        assert (lines[-1] if lines else "").startswith("step    2 "), "\n".join(lines)
        os.killpg(process.pid, signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, out[-2000:]
    assert "stopped" in out


def test_the_stack_dies_with_its_parent_even_on_sigkill():
    script = ("from grpo_exporter.demo.stack import Stack\nimport time\n"
              "s = Stack()\nprint(s.prometheus_url, s.alertmanager_url, 'ready', flush=True)\ntime.sleep(120)\n")
    process = subprocess.Popen([str(ROOT / ".venv/bin/python"), "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        urls = _urls_once_started(process, "ready")
        assert len(urls) == 2
        assert all(_port_open(u) for u in urls)
        process.kill()  # no cleanup code of the parent runs
        process.wait(timeout=10)
    finally:
        process.kill()
    assert _closed_within(urls, 10), urls


def test_without_the_binaries_the_demo_says_how_to_get_them_and_runs_the_exporter_and_guard(
    monkeypatch, tmp_path, caplog
):
    from grpo_exporter.demo.main import run_demo

    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus, no prometheus-alertmanager
    lines: list[str] = []
    pages = run_demo("mask-bug", inject_at=1, steps=3, steps_per_second=100.0, out=lines.append,
                     record=tmp_path / "incidents")
    assert pages == []
    assert "apt-get install -y prometheus prometheus-alertmanager" in lines[0]
    assert lines[1].startswith("exporter:     http://127.0.0.1:")
    assert any(line.startswith("step    2 ") for line in lines)
    assert not any(line.startswith("prometheus:") for line in lines)
    assert "guard [layer 1-gradient] run=demo-mask-bug-3" in caplog.text  # the in-process guard caught it
    assert "runbooks.md#grpolossmaskmismatch" in caplog.text
    # --record: the flight recorder wrote the three states around the fault, and the demo says where
    from grpo_exporter.recorder.inspect import load

    incident = load(tmp_path / "incidents")
    assert incident["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": 2}
    assert incident["triggers"] == ["mask_mismatch"]
    assert lines[-1] == (f"flight recorder: 1 incident(s) in {tmp_path / 'incidents'}; read the latest with: "
                         f"grpo-exporter inspect {incident['path']}")
