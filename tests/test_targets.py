"""The exporter announces its own target (``targets_dir``): the file Prometheus' file_sd reads, its life with the
run's (written after binding, a port fallback followed, removed once the end was scraped, left by a crash, pruned
when stale), the addresses it binds and advertises, /healthz, and a directory it cannot write (counted, training
goes on). The same files against a real Prometheus: tests/test_slurm.py."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpo_exporter import GRPOMonitor, MonitorConfig, hash_password
from grpo_exporter.cli import main as cli_main
from grpo_exporter.serving import targets
from grpo_exporter.serving.health import health
from monitor_helpers import feed, parse_exposition, scrape

BASE = {"group_size": 8, "clip_eps": (0.2, 0.28), "log_ratio_clamp": 20.0, "guard": "off", "close_linger_s": 0.0}


def _read(path: Path) -> dict:
    groups = json.loads(path.read_text())
    assert len(groups) == 1
    return groups[0]


def test_the_serving_rank_announces_the_port_it_serves_with_the_rules_labels(tmp_path):
    labels = {"slurm_job_id": "4242", "partition": "gpu"}
    with GRPOMonitor(run="exp-42", port=0, host="127.0.0.1", targets_dir=tmp_path, targets_labels=labels,
                     **BASE) as mon:
        group = _read(tmp_path / "grpo-exp-42.json")
        assert group["targets"] == [f"127.0.0.1:{mon.port}"] == [mon.target]
        assert group["labels"] == {"slurm_job_id": "4242", "partition": "gpu", "job": "grpo", "run": "exp-42",
                                   "__scheme__": "http", "__grpo_exporter_pid": str(os.getpid())}
    assert not (tmp_path / "grpo-exp-42.json").exists()  # nothing scraped: withdrawn at close at once
    assert mon.target is None


def test_a_run_name_that_is_no_file_name_gets_a_safe_distinct_one(tmp_path):
    assert targets.file_name("exp/42 a") == f"grpo-exp_42_a-{targets.file_name('exp/42 a')[-13:-5]}.json"
    assert targets.file_name("exp/42 a") != targets.file_name("exp_42_a") == "grpo-exp_42_a.json"
    with GRPOMonitor(run="../../etc/passwd", port=0, targets_dir=tmp_path, **BASE):
        (written,) = tmp_path.iterdir()
        assert written.parent == tmp_path
        assert written.name.startswith("grpo-.._.._etc_passwd-")


def test_a_port_clash_is_followed_by_the_announced_target(tmp_path):
    """Two jobs on one node with the default port: the second serves on a free port, and its file says so."""
    with GRPOMonitor(run="first", port=0, host="127.0.0.1", targets_dir=tmp_path, **BASE) as first, \
            GRPOMonitor(run="second", port=first.port, host="127.0.0.1", targets_dir=tmp_path, **BASE) as second:
        assert second.port != first.port
        assert _read(tmp_path / "grpo-second.json")["targets"] == [f"127.0.0.1:{second.port}"]
        assert "grpo_run_info" in scrape(f"http://{second.target}/metrics")


def test_the_file_leaves_only_after_a_scrape_has_seen_the_normal_end(tmp_path):
    """Removed at once, Prometheus never sees grpo_run_finished 1 and a clean end pages GRPOTrainingStalled."""
    mon = GRPOMonitor(run="r", port=0, targets_dir=tmp_path, **{**BASE, "close_linger_s": 10.0})
    scrape(mon.url)  # Prometheus has found the target
    closer = threading.Thread(target=mon.close)
    closer.start()
    time.sleep(0.5)
    assert (tmp_path / "grpo-r.json").exists()  # waiting for the scrape that shows the end
    seen = parse_exposition(scrape(f"http://{_read(tmp_path / 'grpo-r.json')['targets'][0]}/metrics"))
    assert seen["grpo_run_finished"] == {(("run", "r"),): 1.0}
    closer.join(timeout=5)
    assert not closer.is_alive()
    assert not (tmp_path / "grpo-r.json").exists()


def test_a_killed_process_leaves_its_file_and_a_stale_one_is_pruned(tmp_path):
    code = ("from grpo_exporter import GRPOMonitor; import os, sys; "
            f"m = GRPOMonitor(run='crashed', group_size=8, port=0, targets_dir={str(tmp_path)!r}); "
            "print('up', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "up"
    finally:
        child.kill()
        child.wait(timeout=10)
    left = tmp_path / "grpo-crashed.json"
    assert _read(left)["labels"]["__grpo_exporter_pid"] == str(child.pid)
    foreign = tmp_path / "grpo-someone-else.json"
    foreign.write_text(json.dumps([{"targets": ["x:1"], "labels": {"job": "other"}}]))
    hour_ago = time.time() - 3601
    for path in (left, foreign):
        os.utime(path, (hour_ago, hour_ago))
    assert targets.prune(tmp_path, 7200.0) == ([], [])  # not stale yet at 2 h
    assert cli_main(["targets", "prune", "--dir", str(tmp_path)]) == 0  # the epilog's command, 1 h default
    assert not left.exists()
    assert foreign.exists()  # not ours: left alone


def test_the_next_exporter_prunes_stale_files_and_a_run_started_again_takes_its_own(tmp_path):
    stale = tmp_path / "grpo-old.json"
    stale.write_text(targets.target_text("10.0.0.1:9887", "grpo", "old", {}, "http"))
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    again = tmp_path / "grpo-resumed.json"
    again.write_text(targets.target_text("10.0.0.9:9887", "grpo", "resumed", {}, "http"))  # its crashed attempt
    with GRPOMonitor(run="resumed", port=0, host="127.0.0.1", targets_dir=tmp_path, **BASE) as mon:
        assert not stale.exists()
        assert _read(again)["targets"] == [mon.target]


def test_a_stale_file_that_cannot_be_removed_stops_neither_the_prune_nor_the_announcement(tmp_path, monkeypatch,
                                                                                        capsys, caplog):
    """Another user's stale file in a directory with the sticky bit: unlink is refused. The others are pruned,
    the new run is announced, the CLI says which file and exits 1 (the epilog ignores it)."""
    for name in ("grpo-a.json", "grpo-b.json"):
        (tmp_path / name).write_text(targets.target_text("10.0.0.1:9887", "grpo", name, {}, "http"))
        os.utime(tmp_path / name, (time.time() - 7200, time.time() - 7200))
    unlink = Path.unlink

    def refuse_a(path: Path, missing_ok: bool = False) -> None:
        if path.name == "grpo-a.json":
            raise PermissionError(1, "Operation not permitted")
        unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_a)
    assert cli_main(["targets", "prune", "--dir", str(tmp_path)]) == 1
    assert f"cannot remove {tmp_path / 'grpo-a.json'}: Operation not permitted" in capsys.readouterr().err
    assert not (tmp_path / "grpo-b.json").exists()
    with GRPOMonitor(run="new", port=0, host="127.0.0.1", targets_dir=tmp_path, **BASE) as mon:
        assert _read(tmp_path / "grpo-new.json")["targets"] == [mon.target]
    assert any("cannot remove the stale target file" in r.getMessage() for r in caplog.records)


def test_the_heartbeat_touches_the_file_and_writes_it_again_when_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.05)
    with GRPOMonitor(run="r", port=0, targets_dir=tmp_path, **BASE):
        path = tmp_path / "grpo-r.json"
        os.utime(path, (0, 0))
        _wait(lambda: path.stat().st_mtime > 0)
        path.unlink()
        _wait(path.exists)


def test_an_unwritable_directory_is_counted_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with GRPOMonitor(run="r", port=0, targets_dir=blocker / "targets", **BASE) as mon:
        feed(mon, 0, seed=0)
        samples = parse_exposition(scrape(mon.url))
        assert samples["grpo_exporter_errors_total"][(("run", "r"), ("stage", "targets"))] == 1.0
        assert mon.target is None
    assert any("failed in stage 'targets'" in r.getMessage() for r in caplog.records)
    with pytest.raises(NotADirectoryError, match="not-a-dir"):
        GRPOMonitor(run="r", port=0, targets_dir=blocker / "targets", strict=True, **BASE)


def test_binding_follows_the_announcement_unless_asked(tmp_path):
    """Unset host: 127.0.0.1 alone without targets_dir; with it, the advertised address (the node's own on its
    default route, reachable from the cluster), bound there only. An explicit host is bound as given and, being
    one address, advertised."""
    with GRPOMonitor(run="local", port=0, **BASE) as mon:
        assert mon.url.startswith("http://127.0.0.1:")
        assert mon.target is None
    node = targets.node_address()
    with GRPOMonitor(run="cluster", port=0, targets_dir=tmp_path, **BASE) as mon:
        assert mon.target == f"{node}:{mon.port}"
        assert mon.url == f"http://{mon.target}/metrics"
    with GRPOMonitor(run="named", port=0, host="127.0.0.3", targets_dir=tmp_path, **BASE) as mon:
        assert mon.target == f"127.0.0.3:{mon.port}"
    with GRPOMonitor(run="wild", port=0, host="0.0.0.0", advertise_host="node-7.cluster", targets_dir=tmp_path,
                     **BASE) as mon:
        assert mon.target == f"node-7.cluster:{mon.port}"
    assert targets.advertised_host("0.0.0.0", None) == node


def test_node_address_is_an_address_of_this_machine():
    with socket.socket() as probe:
        probe.bind((targets.node_address(), 0))  # bindable: it is one of ours


@pytest.mark.parametrize(("field", "value", "says"), [
    ("targets_labels", {"job": "x"}, "not job, run or instance"),
    ("targets_labels", {"__scheme__": "https"}, "expected label names"),
    ("targets_labels", {f"l{i}": "v" for i in range(17)}, "at most 16 labels"),
    ("targets_labels", {"ok": "a\nb"}, "control characters"),
    ("targets_stale_after_s", 10, "greater than or equal to 300"),
    ("advertise_host", "node 7", "whitespace"),
    ("targets_job", "", "at least 1 character"),
])
def test_bad_target_settings_name_the_field(field, value, says):
    with pytest.raises(ValidationError, match=field) as raised:
        MonitorConfig(run="r", group_size=8, **{field: value})
    assert says in str(raised.value)


def test_target_settings_come_from_the_environment(tmp_path):
    cfg = MonitorConfig.load(environ={"GRPO_EXPORTER_RUN": "job-7", "GRPO_EXPORTER_GROUP_SIZE": "8",
                                      "GRPO_EXPORTER_TARGETS_DIR": str(tmp_path),
                                      "GRPO_EXPORTER_TARGETS_LABELS": '{"slurm_job_id": "7"}',
                                      "GRPO_EXPORTER_ADVERTISE_HOST": "node-3"})
    assert (cfg.targets_dir, cfg.targets_labels, cfg.advertise_host) == (tmp_path, {"slurm_job_id": "7"}, "node-3")


def test_healthz_is_cheap_json_with_the_step_age(tmp_path):
    with GRPOMonitor(run="r", port=0, **BASE) as mon:
        url = mon.url.replace("/metrics", "/healthz")
        before = json.load(urllib.request.urlopen(url))
        assert before == {"status": "ok", "run": "r", "last_step": None, "last_step_age_seconds": None,
                          "finished": False}
        feed(mon, 3, seed=0)
        reply = urllib.request.urlopen(url)
        assert reply.headers["Content-Type"] == "application/json"
        after = json.load(reply)
        assert after["last_step"] == 3
        assert 0 <= after["last_step_age_seconds"] < 60
        head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"))
        assert head.status == 200
        assert head.read() == b""
    assert health("r", {}, now=5.0)["last_step_age_seconds"] is None


def test_healthz_is_behind_basic_auth_where_it_is_set():
    with GRPOMonitor(run="r", port=0, basic_auth_user="prom", basic_auth_password_hash=hash_password("pw"),
                     **BASE) as mon:
        url = mon.url.replace("/metrics", "/healthz")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url)
        assert refused.value.code == 401
        token = base64.b64encode(b"prom:pw").decode()
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        assert json.load(urllib.request.urlopen(request))["status"] == "ok"


def _wait(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_heartbeat_failure_never_reaches_training(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.05)
    failures: list[Exception] = []
    announced = targets.TargetFile(targets.Announcement(tmp_path), "r", "h:1", "http", failures.append)
    try:
        monkeypatch.setattr(targets.os, "utime", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
        _wait(lambda: bool(failures))
        assert isinstance(failures[0], PermissionError)
    finally:
        announced.remove()
    assert not announced.path.exists()
