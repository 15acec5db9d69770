"""Compute nodes that the central Prometheus cannot reach (docs/deploy-unreachable.md), end to end: a real
Prometheus in agent mode per node scrapes the exporter on loopback and remote-writes to a real central Prometheus
(remote-write receiver on) that evaluates the generated rules, time-scaled, and sends to a real Alertmanager with
a local webhook receiver. Both Prometheus configs are the shipped files of deploy/agent/, loaded and given ports,
paths and the test's 1 s intervals; every exporter is a training process of its own, so that kill -9 is real.

Four nodes, each with its node name (the agent's external label, made part of `instance`) and its run, share the
central Prometheus as on a cluster, and start together; once the center has them all, each meets its end at the
same moment:

* ``crash``: the training process is killed (kill -9): the agent's `up` for its scrape reaches the center as 0,
  and GRPOExporterDown pages;
* ``clean``: the run ends with close() and the agent goes on scraping the closed port: nothing pages;
* ``jobend``: the run ends with close() and the job stops the agent (SIGTERM) at once: the agent sends what it
  holds, the center sees the normal end, nothing pages;
* ``dead``: the whole node dies (agent and training killed together): no `up` = 0 ever arrives, GRPOExporterDown
  stays silent, GRPOTrainingStalled pages once the last step is older than its threshold.

`pytest -s` prints the measured times.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_exporter.demo.stack import start_service, stop_services
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.receivers import webhooks
from grpo_exporter.mixin.render import alertmanager_output, rules_outputs
from services import PageClock, Webhook, binary, query, wait_for

ROOT = Path(__file__).resolve().parents[1]
AGENT_DIR = ROOT / "deploy" / "agent"
#: the flags the guide gives (checked below); the test starts both Prometheus with exactly these
AGENT_FLAGS = ("--enable-feature=agent,expand-external-labels",)
CENTRAL_FLAGS = ("--web.enable-remote-write-receiver",)
INTERVAL = "1s"  # scrape and evaluation, instead of the shipped 15 s
# production time x 0.02 (the demo's scale). GRPOTrainingStalled after 500 s (10 s here), not 900 s (18 s): still
# above the remote-write delay (the queue's 5 s batch deadline, not scaled) plus a scrape, so a live run never
# looks stalled to the center
MIXIN = MixinConfig(time_scale=0.02, stall_after_s=500, group_wait_s=50, group_interval_s=250,
                    repeat_interval_s=3600)
# start to the center's first samples: measured ~12 s for one node (training start ~2 s, the agent's WAL replay ~6 s,
# a 5 s batch), 19-26 s for the four starting together on 2 cores
SEEN_WITHIN_S = 60.0
PAGE_WITHIN_S = 30.0  # an end to its page: measured ~8 s (crash) and ~12 s (node death)
# a normal end stays quiet for as long as the slower liveness alert would take to page the same end without
# close(): the remote-write delay, GRPOTrainingStalled's silence and `for`, Alertmanager's group wait, a margin
QUIET_S = 5.0 + MIXIN.stall_s + 60 * MIXIN.time_scale + MIXIN.group_wait_s * MIXIN.time_scale + 4.0  # ~21 s
NODES = ("crash", "clean", "jobend", "dead")

# the training process: steps every 0.1 s until SIGTERM, then close() (a normal end)
TRAINING = """
import signal, sys, time
import torch
from grpo_exporter import GRPOMonitor
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
mon = GRPOMonitor(run=sys.argv[1], group_size=4, port=0, guard="off", edit_distance_groups=0, close_linger_s=5.0)
print(mon.port, flush=True)
step = 0
while not stop:
    mon.observe_rollout(step, rewards=torch.rand(8), correct=torch.rand(8) > 0.5)
    mon.end_step()
    step += 1
    time.sleep(0.1)
mon.close()
"""

def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((AGENT_DIR / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@dataclass
class Node:
    name: str
    run: str
    training: subprocess.Popen[str]
    port: int = 0
    agent: subprocess.Popen[bytes] | None = None
    seen_after_s: float = 0.0
    ended: float = 0.0
    returncodes: dict[str, int | None] = field(default_factory=dict)

    @property
    def instance(self) -> str:
        """The target as the center sees it: the agent's write relabelling puts the node name in it."""
        return f"{self.name}:{self.port}"


@dataclass
class Cluster:
    url: str
    clock: PageClock
    nodes: dict[str, Node]

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Alerts pending or firing in the central Prometheus with these labels."""
        return query(self.url, "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}")

    def up(self, n: Node, expr: str) -> list[dict[str, Any]]:
        return query(self.url, expr.replace("UP", f'up{{job="grpo",instance="{n.instance}",node="{n.name}"}}'))


@contextmanager
def central_stack(workdir: Path, webhook: Webhook) -> Iterator[str]:
    """Alertmanager, and the central Prometheus of deploy/agent/prometheus-central.yml with the rules generated at
    MIXIN's time scale; yields the central URL."""
    mixin = MIXIN.model_copy(update={"receivers": webhooks(pager=f"{webhook.url}/pager",
                                                           default=f"{webhook.url}/default")})
    for name, text in rules_outputs(mixin).items():
        (workdir / name).write_text(text)
    (workdir / "alertmanager.yml").write_text(alertmanager_output(mixin))
    config = load("prometheus-central.yml")
    shipped_rules = [Path(f).name for f in config["rule_files"]]
    assert shipped_rules == ["grpo-recording.rules.yml", "grpo-alerts.rules.yml"], shipped_rules
    assert all((AGENT_DIR / f).resolve().is_file() for f in config["rule_files"])  # the committed rules
    assert not config.get("scrape_configs"), "the center scrapes no training process"
    (alerting,) = config["alerting"]["alertmanagers"]
    assert alerting["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        am, am_url = start_service(binary("prometheus-alertmanager"), [
            f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'am'}",
            "--cluster.listen-address="], workdir / "alertmanager.log")
        processes.append(am)
        config["global"]["evaluation_interval"] = INTERVAL
        config["rule_files"] = [str(workdir / name) for name in shipped_rules]
        alerting["static_configs"][0]["targets"] = [am_url.removeprefix("http://")]
        (workdir / "central.yml").write_text(yaml.safe_dump(config))
        prom, url = start_service(binary("prometheus"), [
            f"--config.file={workdir / 'central.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            *CENTRAL_FLAGS], workdir / "central.log")
        processes.append(prom)
        yield url
    finally:
        stop_services(processes)


def start_agent(n: Node, central: str, workdir: Path) -> None:
    """The node's agent: deploy/agent/prometheus-agent.yml with the exporter's port, the center's URL, 1 s."""
    config = load("prometheus-agent.yml")
    assert config["global"]["external_labels"] == {"node": "${GRPO_NODE}"}
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "grpo"
    assert job["static_configs"] == [{"targets": ["127.0.0.1:9887"]}]
    (remote,) = config["remote_write"]
    assert remote["url"].endswith("/api/v1/write")
    config["global"]["scrape_interval"] = INTERVAL
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{n.port}"]
    remote["url"] = f"{central}/api/v1/write"
    (workdir / "agent.yml").write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GRPO_NODE", n.name)  # as `GRPO_NODE=$(hostname) prometheus ...` in the guide
        n.agent, _ = start_service(binary("prometheus"), [
            f"--config.file={workdir / 'agent.yml'}", f"--storage.agent.path={workdir / 'wal'}", *AGENT_FLAGS],
            workdir / "agent.log")


def stop_node(n: Node) -> None:
    if n.training.poll() is None:
        n.training.kill()
    n.training.wait(timeout=10)
    if n.agent is not None:
        stop_services([n.agent])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("agent-mode")
    with ExitStack() as stack:
        webhook = Webhook()
        stack.callback(webhook.close)
        clock = PageClock(webhook)
        stack.callback(clock.close)
        central = stack.enter_context(central_stack(workdir, webhook))
        started = time.monotonic()
        nodes: dict[str, Node] = {}
        for name in NODES:  # the training processes start together (each imports torch)
            nodes[name] = Node(f"node-{name}", f"agent-{name}",
                               subprocess.Popen([sys.executable, "-c", TRAINING, f"agent-{name}"],
                                                stdout=subprocess.PIPE, text=True, cwd=ROOT))
            stack.callback(stop_node, nodes[name])
        for n in nodes.values():
            assert n.training.stdout is not None
            line = n.training.stdout.readline()  # the bound port; an empty line if the process died
            assert line.strip().isdigit(), f"{n.run} did not start: {line!r}"
            n.port = int(line)
            (workdir / n.name).mkdir()
            start_agent(n, central, workdir / n.name)
        cluster = Cluster(central, clock, nodes)
        for n in nodes.values():
            wait_for(f"up = 1 of {n.instance} at the center", lambda n=n: cluster.up(n, "UP == 1"), SEEN_WITHIN_S)
            wait_for(f"the step of {n.run} at the center",
                     lambda n=n: query(central, f'grpo_last_step{{run="{n.run}",instance="{n.instance}"}}'),
                     SEEN_WITHIN_S)
            n.seen_after_s = time.monotonic() - started
        # every node meets its end at once
        crash, clean, jobend, dead = (nodes[name] for name in NODES)
        assert dead.agent is not None
        assert jobend.agent is not None
        now = time.monotonic()
        crash.training.kill()
        dead.agent.kill()
        dead.training.kill()
        clean.training.terminate()  # the loop ends: close() marks the run finished, serves one more scrape
        jobend.training.terminate()
        for n in nodes.values():
            n.ended = now
        jobend.returncodes["training"] = jobend.training.wait(timeout=20)
        stop_services([jobend.agent])  # the job's end: SIGTERM, right after the training process exits
        jobend.returncodes["agent"] = jobend.agent.returncode
        clean.returncodes["training"] = clean.training.wait(timeout=20)
        yield cluster


def test_the_shipped_configs_pass_promtool_and_the_guide_gives_the_tested_flags():
    for name, extra in (("prometheus-agent.yml", ["--agent"]), ("prometheus-central.yml", [])):
        done = subprocess.run([binary("promtool"), "check", "config", *extra, name], cwd=AGENT_DIR,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    for doc in (AGENT_DIR / "README.md", ROOT / "docs" / "deploy-unreachable.md"):
        text = doc.read_text(encoding="utf-8")
        for flag in (*AGENT_FLAGS, *CENTRAL_FLAGS, "--storage.agent.path=", "GRPO_NODE="):
            assert flag in text, (doc.name, flag)


def test_the_center_has_each_nodes_series_and_up_from_its_agent(cluster):
    for n in cluster.nodes.values():
        assert cluster.up(n, "max_over_time(UP[5m]) == 1"), n.name
        names = {r["metric"]["__name__"] for r in
                 query(cluster.url, f'last_over_time({{run="{n.run}",instance="{n.instance}",node="{n.name}"}}[5m])')}
        assert {"grpo_run_info", "grpo_run_finished", "grpo_last_step", "grpo_last_step_timestamp_seconds",
                "grpo_steps_total"} <= names, sorted(names)
    # the same loopback target on every node: only the relabelled instance reaches the center
    assert not query(cluster.url, 'last_over_time({instance=~"127\\\\.0\\\\.0\\\\.1:.*"}[5m])')
    print(f"\nstart to the center's first samples: {max(n.seen_after_s for n in cluster.nodes.values()):.1f} s "
          f"(four nodes starting together)")


def test_a_killed_training_process_pages_exporter_down(cluster):
    n = cluster.nodes["crash"]
    wait_for(f"up = 0 of {n.instance} at the center", lambda: cluster.up(n, "UP == 0"), PAGE_WITHIN_S)
    down = time.monotonic() - n.ended
    # the agent marks the run's series stale after the failed scrape, and the marker travels too
    wait_for(f"{n.run}'s series stale at the center",
             lambda: not query(cluster.url, f'grpo_last_step{{run="{n.run}"}}'), PAGE_WITHIN_S)
    pages = wait_for("the GRPOExporterDown page",
                     lambda: cluster.clock.pages(alertname="GRPOExporterDown", instance=n.instance), PAGE_WITHIN_S)
    (first, path, alert), *_ = pages
    assert path == "/pager", pages
    assert alert["labels"]["node"] == n.name
    print(f"\nkill -9 to up = 0 at the center {down:.1f} s (or less), to the GRPOExporterDown page "
          f"{first - n.ended:.1f} s")


def test_a_dead_node_pages_training_stalled_not_exporter_down(cluster):
    """Agent and training die together: no failed scrape is ever reported, the node's last `up` (1) stays the
    latest sample for the lookback delta, and only the age of the last step tells the death."""
    n = cluster.nodes["dead"]
    pages = wait_for("the GRPOTrainingStalled page",
                     lambda: cluster.clock.pages(alertname="GRPOTrainingStalled", run=n.run), PAGE_WITHIN_S)
    (first, path, _), *_ = pages
    assert path == "/pager", pages
    assert cluster.up(n, "UP == 1"), "the center still shows the dead node up (no staleness marker came)"
    assert not cluster.up(n, "min_over_time(UP[5m]) == 0"), "nothing ever reported it down"
    assert not cluster.alerts(alertname="GRPOExporterDown", instance=n.instance)
    assert not cluster.clock.pages(alertname="GRPOExporterDown", instance=n.instance)
    print(f"\nnode death to the GRPOTrainingStalled page {first - n.ended:.1f} s "
          f"(its threshold {MIXIN.stall_s:g} s + `for` {MIXIN.duration(60)})")


def _quiet_until_deadline(cluster: Cluster, n: Node) -> None:
    """Until QUIET_S after the end, nothing is pending or firing for the run or its target, and no page came."""
    while True:
        assert not cluster.alerts(run=n.run), cluster.alerts(run=n.run)
        assert not cluster.alerts(instance=n.instance), cluster.alerts(instance=n.instance)
        assert not cluster.clock.pages(run=n.run), cluster.clock.pages(run=n.run)
        assert not cluster.clock.pages(instance=n.instance), cluster.clock.pages(instance=n.instance)
        if time.monotonic() > n.ended + QUIET_S:
            return
        time.sleep(0.5)


def test_a_run_that_ends_with_close_pages_nothing(cluster):
    n = cluster.nodes["clean"]
    assert n.returncodes["training"] == 0
    wait_for("grpo_run_finished 1 at the center",
             lambda: query(cluster.url, f'last_over_time(grpo_run_finished{{run="{n.run}"}}[1m]) == 1'), PAGE_WITHIN_S)
    wait_for(f"up = 0 of {n.instance} at the center (the agent still scrapes the closed port)",
             lambda: cluster.up(n, "UP == 0"), PAGE_WITHIN_S)
    _quiet_until_deadline(cluster, n)


def test_a_job_that_stops_the_agent_right_after_training_still_delivers_the_normal_end(cluster):
    n = cluster.nodes["jobend"]
    assert n.returncodes == {"training": 0, "agent": 0}
    wait_for("grpo_run_finished 1 at the center (sent by the agent as it stopped)",
             lambda: query(cluster.url, f'last_over_time(grpo_run_finished{{run="{n.run}"}}[1m]) == 1'), PAGE_WITHIN_S)
    _quiet_until_deadline(cluster, n)
