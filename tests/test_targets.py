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


def _file(directory: Path, mon: GRPOMonitor) -> Path:
    assert mon.target is not None
    return directory / targets.file_name(mon.config.run, mon.target)


def _read(path: Path) -> dict:
    groups = json.loads(path.read_text())
    assert len(groups) == 1
    return groups[0]


def test_the_serving_rank_announces_the_port_it_serves_with_the_rules_labels(tmp_path):
    labels = {"slurm_job_id": "4242", "partition": "gpu"}
    with GRPOMonitor(run="exp-42", port=0, host="127.0.0.1", targets_dir=tmp_path, targets_labels=labels,
                     **BASE) as mon:
        path = _file(tmp_path, mon)
        assert path.name == f"grpo-exp-42@127.0.0.1_{mon.port}.json"
        group = _read(path)
        assert group["targets"] == [f"127.0.0.1:{mon.port}"] == [mon.target]
        assert group["labels"] == {"slurm_job_id": "4242", "partition": "gpu", "job": "grpo", "run": "exp-42",
                                   "__scheme__": "http", "__grpo_exporter_pid": str(os.getpid())}
    assert not path.exists()  # nothing scraped: withdrawn at close at once
    assert mon.target is None


def test_a_run_name_that_is_no_file_name_gets_a_safe_distinct_one(tmp_path):
    odd = targets.file_name("exp/42 a", "node-7:9887")
    assert odd == f"grpo-exp_42_a@node-7_9887-{odd[-13:-5]}.json"
    assert odd != targets.file_name("exp_42_a", "node-7:9887") == "grpo-exp_42_a@node-7_9887.json"
    assert targets.file_name("r", "[fe80::1]:9887").startswith("grpo-r@fe80__1_9887-")
    with GRPOMonitor(run="../../etc/passwd", port=0, targets_dir=tmp_path, **BASE):
        (written,) = tmp_path.iterdir()
        assert written.parent == tmp_path
        assert written.name.startswith("grpo-.._.._etc_passwd@")


def test_a_port_clash_is_followed_by_the_announced_target(tmp_path):
    """Two jobs on one node with the default port: the second serves on a free port, and its file says so."""
    with GRPOMonitor(run="first", port=0, host="127.0.0.1", targets_dir=tmp_path, **BASE) as first, \
            GRPOMonitor(run="second", port=first.port, host="127.0.0.1", targets_dir=tmp_path, **BASE) as second:
        assert second.port != first.port
        assert _read(_file(tmp_path, second))["targets"] == [f"127.0.0.1:{second.port}"]
        assert "grpo_run_info" in scrape(f"http://{second.target}/metrics")


def test_the_file_leaves_only_after_a_scrape_has_seen_the_normal_end(tmp_path):
    """Removed at once, Prometheus never sees grpo_run_finished 1 and a clean end pages GRPOTrainingStalled."""
    mon = GRPOMonitor(run="r", port=0, targets_dir=tmp_path, **{**BASE, "close_linger_s": 10.0})
    scrape(mon.url)  # Prometheus has found the target
    path = _file(tmp_path, mon)
    closer = threading.Thread(target=mon.close)
    closer.start()
    time.sleep(0.5)
    assert path.exists()  # waiting for the scrape that shows the end
    seen = parse_exposition(scrape(f"http://{_read(path)['targets'][0]}/metrics"))
    assert seen["grpo_run_finished"] == {(("run", "r"),): 1.0}
    closer.join(timeout=5)
    assert not closer.is_alive()
    assert not path.exists()


def test_a_killed_process_leaves_its_file_and_a_stale_one_is_pruned(tmp_path):
    code = ("from grpo_exporter import GRPOMonitor; import os, sys; "
            f"m = GRPOMonitor(run='crashed', group_size=8, port=0, targets_dir={str(tmp_path)!r}); "
            "print(m.target, flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        target = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(timeout=10)
    left = tmp_path / targets.file_name("crashed", target)
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


def test_the_next_exporter_prunes_stale_files_and_withdraws_a_dead_one_at_its_own_address(tmp_path, caplog):
    """A stale file (a crash an hour ago) goes; a fresh file naming the address and port this exporter has just
    bound is dead by construction (a crash minutes ago, the next job on the node): withdrawn at once, or
    Prometheus would scrape the new run under the dead one's labels. A live run's file elsewhere stays."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stale = tmp_path / targets.file_name("old", "10.0.0.1:9887")
    stale.write_text(targets.target_text("10.0.0.1:9887", "grpo", "old", {}, "http"))
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    dead = tmp_path / targets.file_name("crashed", f"127.0.0.1:{port}")
    dead.write_text(targets.target_text(f"127.0.0.1:{port}", "grpo", "crashed", {"slurm_job_id": "1"}, "http"))
    live = tmp_path / targets.file_name("elsewhere", "10.0.0.2:9887")
    live.write_text(targets.target_text("10.0.0.2:9887", "grpo", "elsewhere", {}, "http"))
    with GRPOMonitor(run="next", port=port, host="127.0.0.1", targets_dir=tmp_path, **BASE) as mon:
        assert mon.target == f"127.0.0.1:{port}"
        assert not stale.exists()
        assert not dead.exists()
        assert live.exists()
        assert _read(_file(tmp_path, mon))["labels"]["run"] == "next"
    assert any(f"withdrew {dead}" in r.getMessage() for r in caplog.records)


def test_a_stale_file_that_cannot_be_removed_stops_neither_the_prune_nor_the_announcement(tmp_path, monkeypatch,
                                                                                        capsys, caplog):
    """Another user's stale file in a directory with the sticky bit: unlink is refused. The others are pruned,
    the new run is announced, the CLI says which file and exits 1 (the epilog ignores it)."""
    for run in ("a", "b"):
        name = targets.file_name(run, "10.0.0.1:9887")
        (tmp_path / name).write_text(targets.target_text("10.0.0.1:9887", "grpo", run, {}, "http"))
        os.utime(tmp_path / name, (time.time() - 7200, time.time() - 7200))
    unlink = Path.unlink

    def refuse_a(path: Path, missing_ok: bool = False) -> None:
        if path.name.startswith("grpo-a@"):
            raise PermissionError(1, "Operation not permitted")
        unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_a)
    assert cli_main(["targets", "prune", "--dir", str(tmp_path)]) == 1
    assert f"cannot remove {tmp_path / 'grpo-a@10.0.0.1_9887.json'}: Operation not permitted" in capsys.readouterr().err
    assert not (tmp_path / "grpo-b@10.0.0.1_9887.json").exists()
    with GRPOMonitor(run="new", port=0, host="127.0.0.1", targets_dir=tmp_path, **BASE) as mon:
        assert _read(_file(tmp_path, mon))["targets"] == [mon.target]
    assert any("cannot remove the stale target file" in r.getMessage() for r in caplog.records)


def test_the_heartbeat_touches_the_file_and_writes_it_again_when_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.05)
    with GRPOMonitor(run="r", port=0, targets_dir=tmp_path, **BASE) as mon:
        path = _file(tmp_path, mon)
        os.utime(path, (0, 0))
        _wait(lambda: path.stat().st_mtime > 0)
        path.unlink()
        _wait(path.exists)


def test_an_unwritable_directory_is_counted_and_training_goes_on(tmp_path, caplog, monkeypatch):
    """The first write fails: counted, logged, training goes on, and every heartbeat tries again (a directory
    mounted late is announced then); strict raises at construction."""
    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.05)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    (tmp_path / "late").symlink_to(blocker)  # the mount point is a file until the filesystem is mounted
    with GRPOMonitor(run="r", port=0, targets_dir=tmp_path / "late" / "targets", **BASE) as mon:
        feed(mon, 0, seed=0)
        samples = parse_exposition(scrape(mon.url))
        assert samples["grpo_exporter_errors_total"][(("run", "r"), ("stage", "targets"))] >= 1.0
        (tmp_path / "late").unlink()  # the shared filesystem is mounted
        _wait(lambda: (tmp_path / "late" / "targets" / targets.file_name("r", mon.target)).exists())
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
        monkeypatch.setattr(targets.os, "utime", _refuse)
        _wait(lambda: bool(failures))
        assert isinstance(failures[0], PermissionError)
    finally:
        announced.remove()
    assert not announced.path.exists()


def _refuse(*args: object, **kwargs: object) -> None:
    raise PermissionError(13, "read-only")


def test_heartbeat_failures_are_published_without_a_step(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.05)
    with GRPOMonitor(run="r", port=0, targets_dir=tmp_path, **BASE) as mon:
        monkeypatch.setattr(targets.os, "utime", _refuse)

        def counted() -> bool:
            errors = parse_exposition(scrape(mon.url)).get("grpo_exporter_errors_total", {})
            return errors.get((("run", "r"), ("stage", "targets")), 0.0) >= 1

        _wait(counted)


def test_a_withdrawn_file_never_comes_back(tmp_path, monkeypatch):
    """A heartbeat stuck in a slow filesystem while the run closes: close() waits 2 s and goes on; the one
    thread that touches the file removes it when the filesystem answers, and writes it no more."""
    monkeypatch.setattr(targets, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(targets, "REMOVE_WAIT_S", 0.2)
    failures: list[Exception] = []
    announced = targets.TargetFile(targets.Announcement(tmp_path), "r", "h:1", "http", failures.append)
    utime = os.utime
    slow = threading.Event()

    def stuck(*args: object, **kwargs: object) -> None:
        slow.set()
        time.sleep(1.0)
        utime(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(targets.os, "utime", stuck)
    slow.wait(5)
    announced.remove()
    assert isinstance(failures[-1], TimeoutError)
    _wait(lambda: not announced._thread.is_alive())
    time.sleep(0.2)
    assert not announced.path.exists()


def test_a_symlink_planted_in_the_shared_directory_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    shared = tmp_path / "targets"
    shared.mkdir()
    target = "127.0.0.1:9"
    (shared / targets.file_name("r", target)).symlink_to(victim)
    announced = targets.TargetFile(targets.Announcement(shared), "r", target, "http", None)
    try:
        assert not announced.path.is_symlink()
        assert _read(announced.path)["targets"] == [target]
        assert victim.read_text() == "keep me"
        assert oct(announced.path.stat().st_mode & 0o777) == "0o644"  # Prometheus, another user, reads it
    finally:
        announced.remove()


def test_the_bound_address_for_an_advertised_one():
    """advertise_host without host: bound there when it is this machine's; every interface for an address that
    is not (NAT) or a name that means loopback here (Debian's /etc/hosts), so the run starts either way."""
    assert targets.bind_host("127.0.0.3") == "127.0.0.3"
    assert targets.bind_host(targets.node_address()) == targets.node_address()
    assert targets.bind_host("203.0.113.7") == "0.0.0.0"
    assert targets.bind_host("localhost") == "0.0.0.0"
    assert targets.bind_host("no-such-node.invalid") == "0.0.0.0"


def test_a_nat_address_advertised_serves_every_interface(tmp_path):
    with GRPOMonitor(run="r", port=0, advertise_host="203.0.113.7", targets_dir=tmp_path, **BASE) as mon:
        assert mon.target == f"203.0.113.7:{mon.port}"
        assert "grpo_run_info" in scrape(f"http://127.0.0.1:{mon.port}/metrics")


def test_prune_refuses_a_line_that_would_remove_live_targets(capsys):
    with pytest.raises(SystemExit):
        cli_main(["targets", "prune", "--dir", ".", "--stale-after-s", "10"])
    assert "expected at least 300" in capsys.readouterr().err
