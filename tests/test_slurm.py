"""SLURM without Kubernetes (deploy/slurm/, docs/deploy-slurm.md), end to end, the way a SLURM user starts it:
a real Prometheus whose config is deploy/slurm/prometheus.yml (the targets directory a temporary one, 1 s
intervals, the rules generated at 1/50 of production time), a real Alertmanager with a local webhook receiver,
and training processes that stand for the rank 0 of SLURM jobs on other nodes. Each builds ``GRPOMonitor()``
from ``GRPO_EXPORTER_*`` variables only: the exporter lines of deploy/slurm/train.sbatch, run by bash with the
job's SLURM_JOB_NAME and SLURM_JOB_ID, plus the node's address (``host``; the whole of 127/8 is loopback on
Linux, so 127.0.0.2 and 127.0.0.3 are two nodes) and the test's port and directory. Jobs ``a`` (on 127.0.0.2)
and ``b`` (127.0.0.3) serve the same port; job ``c`` lands on a's node, finds that port taken, and serves a free
one. Then, at the same moment, ``a`` and ``c`` end with close() (SIGTERM, as scancel or --signal sends it) and
``b`` is killed (kill -9). Last, deploy/slurm/epilog.sh prunes the target directory.

`pytest -s` prints the measured times.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_exporter.demo.stack import start_service, stop_services
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.receivers import webhooks
from grpo_exporter.mixin.render import alertmanager_output, rules_outputs
from grpo_exporter.serving.targets import file_name
from services import PageClock, Poller, Webhook, binary, query, wait_for

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "deploy" / "slurm"
SHIPPED_TARGETS = "/shared/prometheus/targets"
INTERVAL = "1s"  # scrape, evaluation and file_sd refresh, instead of the shipped 15 s, 15 s and 30 s
# production time x 0.02, as tests/test_agent_mode.py: GRPOExporterDown's `for` 2 m is 2 s, GRPOTrainingStalled
# after 10 s, Alertmanager's group wait 1 s
MIXIN = MixinConfig(time_scale=0.02, stall_after_s=500, group_wait_s=50, group_interval_s=250,
                    repeat_interval_s=3600)
# a file written to its target scraped: the file_sd refresh (1 s), then Prometheus' discovery manager and scrape
# manager each pass target updates on at most every 5 s (fixed in Prometheus, whatever the intervals), then the
# first scrape within one interval. Measured 2-5 s (not within two scrape intervals: the 5 s batches dominate)
DISCOVERED_WITHIN_S = 5.0 + 5.0 + 2 * 1.0 + 3.0
STARTED_WITHIN_S = 30.0  # a training process imports torch and serves
PAGE_WITHIN_S = 20.0  # kill -9 to the GRPOExporterDown page: the next scrape, `for` 2 s, group wait 1 s
# a normal end stays quiet for as long as a missed end would take to page: the dropped target's up = 0 for up to
# 10 s plus GRPOExporterDown's `for`, or GRPOTrainingStalled's threshold and `for`; a group wait and a margin
QUIET_S = max(10.0 + 2.0, MIXIN.stall_s + 60 * MIXIN.time_scale) + MIXIN.group_wait_s * MIXIN.time_scale + 4.0
# a firing alert is sent again after this (production: 1 m). GRPOWatchdog fires at the first evaluation, before
# the notifier has discovered Alertmanager (up to 5 s): that send is lost, and the next comes a resend delay later
RESEND = "2s"
LINGER_S = 5  # close_linger_s: at most this long for the scrape that sees the end

# the rank-0 training process of a job: every setting from GRPO_EXPORTER_*; steps every 0.1 s until SIGTERM (a
# SIGTERM handler, as deploy/slurm/README.md asks of train.py), then close() (a normal end)
TRAINING = """
import signal, time
import torch
from grpo_exporter import GRPOMonitor
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
mon = GRPOMonitor()
print(mon.port, mon.target, flush=True)
step = 0
while not stop:
    mon.observe_rollout(step, rewards=torch.rand(8), correct=torch.rand(8) > 0.5)
    mon.end_step()
    step += 1
    time.sleep(0.1)
mon.close()
"""

def active_targets(base: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{base}/api/v1/targets?state=active", timeout=10) as response:
        return list(json.loads(response.read())["data"]["activeTargets"])


def sbatch_exports(job_name: str, job_id: str) -> dict[str, str]:
    """The GRPO_EXPORTER_* variables the exporter lines of train.sbatch export, run by bash as SLURM would."""
    text = (SLURM / "train.sbatch").read_text(encoding="utf-8")
    block = text.split("# >>> grpo-exporter", 1)[1].split("\n", 1)[1].split("# <<< grpo-exporter", 1)[0]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_EXPORTER_")}
    done = subprocess.run(["bash", "-c", f"set -euo pipefail\n{block}\nenv -0"], capture_output=True, text=True,
                          check=True, env={**clean, "SLURM_JOB_NAME": job_name, "SLURM_JOB_ID": job_id})
    variables = dict(item.split("=", 1) for item in done.stdout.split("\0") if item)
    return {k: v for k, v in variables.items() if k.startswith("GRPO_EXPORTER_")}


def shared_free_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of ``hosts``."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port free on all of {hosts}")


class FileWatch(Poller):
    """When each target file in ``directory`` first appeared and last vanished: polled every 20 ms."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.appeared: dict[str, float] = {}
        self.vanished: dict[str, float] = {}
        self.vanished_wall: dict[str, float] = {}
        super().__init__(0.02)

    def poll(self) -> None:
        now, wall = time.monotonic(), time.time()
        present = {p.name for p in self.directory.glob("grpo-*.json")}
        for name in present:
            self.appeared.setdefault(name, now)
        for name in set(self.appeared) - present:
            if name not in self.vanished:
                self.vanished[name], self.vanished_wall[name] = now, wall


@dataclass
class Job:
    name: str  # a, b, c
    job_id: str
    host: str  # the node's address
    port: int  # the port asked for
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[str] | None = None
    served: int = 0  # the port bound
    announced: str = ""  # the target it wrote
    discovered_after_s: float = 0.0  # file written to the target scraped (up = 1)
    ended: float = 0.0
    returncode: int | None = None

    @property
    def run(self) -> str:
        return self.env["GRPO_EXPORTER_RUN"]

    @property
    def instance(self) -> str:
        return f"{self.host}:{self.served}"

    @property
    def file(self) -> str:
        return file_name(self.run, self.instance)


@dataclass
class Cluster:
    url: str
    targets_dir: Path
    workdir: Path
    clock: PageClock
    files: FileWatch
    jobs: dict[str, Job]
    targets: list[dict[str, Any]]  # /api/v1/targets once every job was discovered
    series: dict[str, list[dict[str, Any]]]  # job name -> its grpo_ series, then
    exported: list[dict[str, Any]]  # any series with an exported_run label, then

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Alerts pending or firing in Prometheus with these labels."""
        return query(self.url, "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}")


def start_job(job: Job, targets_dir: Path) -> None:
    """The job's rank 0: the sbatch file's variables, the node's address, the port, the test's directory."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_EXPORTER_")}
    job.env = {**sbatch_exports("grpo", job.job_id), "GRPO_EXPORTER_TARGETS_DIR": str(targets_dir),
               "GRPO_EXPORTER_HOST": job.host, "GRPO_EXPORTER_PORT": str(job.port),
               "GRPO_EXPORTER_GROUP_SIZE": "4", "GRPO_EXPORTER_GUARD": "off",
               "GRPO_EXPORTER_EDIT_DISTANCE_GROUPS": "0", "GRPO_EXPORTER_CLOSE_LINGER_S": str(LINGER_S)}
    with (targets_dir.parent / f"job-{job.name}.log").open("w") as log:  # the exporter's own log lines
        job.process = subprocess.Popen([sys.executable, "-c", TRAINING], stdout=subprocess.PIPE, stderr=log,
                                       text=True, cwd=ROOT, env={**clean, **job.env, "OMP_NUM_THREADS": "1"})


def served(job: Job) -> None:
    """Read the port bound and the target announced, which the process prints once it serves."""
    assert job.process is not None
    assert job.process.stdout is not None
    ready, _, _ = select.select([job.process.stdout], [], [], STARTED_WITHIN_S)
    assert ready, f"job {job.name} did not serve within {STARTED_WITHIN_S:g} s"
    line = job.process.stdout.readline()  # an empty line if the process died
    port, _, target = line.strip().partition(" ")
    assert port.isdigit(), f"job {job.name} did not start: {line!r}"
    job.served, job.announced = int(port), target


def stop_job(job: Job) -> None:
    if job.process is not None:
        if job.process.poll() is None:
            job.process.kill()
        job.process.wait(timeout=10)
        if job.process.stdout is not None:
            job.process.stdout.close()


def wait_discovered(url: str, files: FileWatch, job: Job, since: float) -> None:
    """Until Prometheus scrapes the job's announced target (up = 1); how long after its file appeared (or after
    ``since``, when Prometheus was ready, for a file written before)."""

    def scraped() -> bool:
        return any(t["labels"].get("instance") == job.instance and t["health"] == "up" for t in active_targets(url))

    wait_for(f"job {job.name}'s file written", lambda: job.file in files.appeared, STARTED_WITHIN_S)
    wait_for(f"{job.instance} of job {job.name} discovered and scraped", scraped, DISCOVERED_WITHIN_S + 5.0)
    job.discovered_after_s = time.monotonic() - max(files.appeared[job.file], since)


def load_config() -> dict[str, Any]:
    config = yaml.safe_load((SLURM / "prometheus.yml").read_text(encoding="utf-8"))
    assert isinstance(config, dict)
    return config


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("slurm")
    targets_dir = workdir / "targets"  # stands for /shared/prometheus/targets
    targets_dir.mkdir()
    port = shared_free_port(("127.0.0.2", "127.0.0.3"))
    jobs = {"a": Job("a", "1001", "127.0.0.2", port), "b": Job("b", "1002", "127.0.0.3", port),
            "c": Job("c", "1003", "127.0.0.2", port)}
    with ExitStack() as stack:
        webhook = Webhook()
        stack.callback(webhook.close)
        clock = PageClock(webhook)
        stack.callback(clock.close)
        files = FileWatch(targets_dir)
        stack.callback(files.close)
        for job in jobs.values():
            stack.callback(stop_job, job)
        # the jobs of nodes a and b start while Prometheus starts
        for job in (jobs["a"], jobs["b"]):
            start_job(job, targets_dir)
        mixin = MIXIN.model_copy(update={"receivers": webhooks(pager=f"{webhook.url}/pager",
                                                               default=f"{webhook.url}/default",
                                                               watchdog=f"{webhook.url}/watchdog")})
        for name, text in rules_outputs(mixin).items():
            (workdir / name).write_text(text)
        (workdir / "alertmanager.yml").write_text(alertmanager_output(mixin))
        processes: list[subprocess.Popen[bytes]] = []
        stack.callback(stop_services, processes)
        am, am_url = start_service(binary("prometheus-alertmanager"), [
            f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'am'}",
            "--cluster.listen-address="], workdir / "alertmanager.log")
        processes.append(am)
        config = load_config()
        config["global"].update(scrape_interval=INTERVAL, evaluation_interval=INTERVAL)
        config["rule_files"] = [str(workdir / name) for name in rules_outputs(mixin)]
        config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [am_url.removeprefix("http://")]
        (sd,) = config["scrape_configs"][0]["file_sd_configs"]
        sd["files"] = [str(targets_dir / "grpo-*.json")]
        sd["refresh_interval"] = INTERVAL
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom, url = start_service(binary("prometheus"), [
            f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--rules.alert.resend-delay={RESEND}"], workdir / "prometheus.log")
        processes.append(prom)
        ready = time.monotonic()

        served(jobs["a"])
        start_job(jobs["c"], targets_dir)  # a second job on a's node: a holds the port now
        served(jobs["b"])
        served(jobs["c"])
        for job in jobs.values():
            wait_discovered(url, files, job, ready)
        # every series of every job, read while they all serve
        series = {job.name: query(url, f'{{__name__=~"grpo_.+",instance="{job.instance}"}}') for job in jobs.values()}
        exported = query(url, '{exported_run!=""}')
        targets = active_targets(url)

        # every job meets its end at once: a and c end normally (SIGTERM: close()), b is killed
        a, b, c = jobs["a"], jobs["b"], jobs["c"]
        assert a.process is not None
        assert b.process is not None
        assert c.process is not None
        now = time.monotonic()
        b.process.send_signal(signal.SIGKILL)
        a.process.terminate()
        c.process.terminate()
        for job in jobs.values():
            job.ended = now
        for job in jobs.values():
            job.returncode = job.process.wait(timeout=LINGER_S + 20) if job.process else None
        yield Cluster(url, targets_dir, workdir, clock, files, jobs, targets, series, exported)


def test_the_job_step_announces_the_address_of_prometheus_iface_on_its_own_node(tmp_path):
    """The srun step of train.sbatch, run by bash with a stand-in torchrun: with PROMETHEUS_IFACE each node finds
    its own address there (here the loopback interface's) and hands it on as GRPO_EXPORTER_ADVERTISE_HOST."""
    sbatch = (SLURM / "train.sbatch").read_text(encoding="utf-8")
    step = sbatch[sbatch.index("srun --kill-on-bad-exit=1 "):].removeprefix("srun --kill-on-bad-exit=1 ")
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/bash\necho "advertise=${GRPO_EXPORTER_ADVERTISE_HOST:-unset} $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77",
           "head": "node-1"}
    env.pop("GRPO_EXPORTER_ADVERTISE_HOST", None)
    cases = [("", "unset")] + ([("lo", "127.0.0.1")] if shutil.which("ip") else [])  # ip: iproute2
    for iface, advertised in cases:
        done = subprocess.run(["bash", "-c", step], env={**env, "PROMETHEUS_IFACE": iface}, capture_output=True,
                              text=True, check=True)
        assert done.stdout == (f"advertise={advertised} --nnodes=2 --nproc-per-node=8 --rdzv-id=77 "
                               "--rdzv-backend=c10d --rdzv-endpoint=node-1:29500 train.py\n"), done.stdout


def test_the_shipped_files_are_what_the_guide_says():
    config = load_config()
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "grpo"
    assert job["honor_labels"] is True
    assert job["file_sd_configs"] == [{"files": [f"{SHIPPED_TARGETS}/grpo-*.json"], "refresh_interval": "30s"}]
    done = subprocess.run([binary("promtool"), "check", "config", "prometheus.yml"], cwd=SLURM,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr  # the rule files need not exist here
    for name in ("train.sbatch", "epilog.sh"):
        done = subprocess.run(["bash", "-n", str(SLURM / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    sbatch = (SLURM / "train.sbatch").read_text(encoding="utf-8")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "--rdzv-backend=c10d", "GLOO_SOCKET_IFNAME",
                 "--nnodes=\"$SLURM_NNODES\""):
        assert line in sbatch, line
    exports = sbatch_exports("grpo", "4242")
    assert exports == {"GRPO_EXPORTER_TARGETS_DIR": SHIPPED_TARGETS, "GRPO_EXPORTER_RUN": "grpo-4242",
                       "GRPO_EXPORTER_TARGETS_LABELS": '{"slurm_job_id": "4242"}'}
    assert "--dir \"$TARGETS_DIR\"" in (SLURM / "epilog.sh").read_text(encoding="utf-8")
    assert f"TARGETS_DIR=${{EPILOG_TARGETS_DIR:-{SHIPPED_TARGETS}}}" in (SLURM / "epilog.sh").read_text()


def test_each_job_is_discovered_from_its_file_with_its_labels(cluster):
    for job in cluster.jobs.values():
        (target,) = [t for t in cluster.targets if t["labels"].get("instance") == job.instance]
        assert target["health"] == "up", target
        assert target["scrapePool"] == "grpo"
        assert target["labels"] == {"instance": job.instance, "job": "grpo", "run": job.run,
                                    "slurm_job_id": job.job_id}, target["labels"]
        assert target["scrapeUrl"] == f"http://{job.instance}/metrics"
        assert job.announced == job.instance
        names = {s["metric"]["__name__"] for s in cluster.series[job.name]}
        assert {"grpo_run_info", "grpo_run_finished", "grpo_last_step", "grpo_steps_total"} <= names, sorted(names)
        for s in cluster.series[job.name]:
            assert s["metric"]["run"] == job.run, s["metric"]
            assert s["metric"]["slurm_job_id"] == job.job_id, s["metric"]
            assert "exported_run" not in s["metric"], s["metric"]
        assert query(cluster.url, f'up{{instance="{job.instance}",run="{job.run}"}}')
        assert job.discovered_after_s <= DISCOVERED_WITHIN_S, (job.name, job.discovered_after_s)
    assert not cluster.exported, cluster.exported  # honor_labels: the exporter's run label is kept
    times = ", ".join(f"{j.name} {j.discovered_after_s:.1f} s" for j in cluster.jobs.values())
    print(f"\nfile written to the target scraped (up = 1): {times}")


def test_a_second_job_on_a_node_serves_a_free_port_and_its_file_names_it(cluster):
    a, b, c = (cluster.jobs[n] for n in "abc")
    assert a.served == b.served == a.port, "the same port on two nodes"
    assert c.port == a.port
    assert c.served != a.port, "the taken port was followed to a free one"
    assert c.announced == f"127.0.0.2:{c.served}"
    assert query(cluster.url, f'max_over_time(up{{instance="{c.instance}",run="{c.run}"}}[5m]) == 1')


def test_a_clean_end_withdraws_the_file_after_its_end_was_scraped_and_pages_nothing(cluster):
    for name in "ac":
        job = cluster.jobs[name]
        assert job.returncode == 0
        vanished = wait_for(f"job {name}'s file removed", lambda job=job: cluster.files.vanished.get(job.file), 5.0)
        assert not (cluster.targets_dir / job.file).exists()
        # the samples of the run's last scrapes: the first that reads the end was taken before the file went
        (matrix,) = query(cluster.url, f'grpo_run_finished{{run="{job.run}"}}[2m]')
        ended_at = min(float(t) for t, v in matrix["values"] if v == "1")
        assert ended_at < cluster.files.vanished_wall[job.file], (ended_at, cluster.files.vanished_wall[job.file])
        print(f"\njob {name}: close() to the file removed {vanished - job.ended:.1f} s")
    # the dropped targets leave discovery; until QUIET_S after the end nothing pends, fires or pages for them
    for name in "ac":
        job = cluster.jobs[name]
        wait_for(f"{job.instance} dropped", lambda job=job: all(
            t["labels"].get("instance") != job.instance for t in active_targets(cluster.url)), QUIET_S)
    while True:
        for name in "ac":
            job = cluster.jobs[name]
            for labels in ({"run": job.run}, {"instance": job.instance}):
                assert not cluster.alerts(**labels), cluster.alerts(**labels)
                assert not cluster.clock.pages(**labels), cluster.clock.pages(**labels)
        if time.monotonic() > cluster.jobs["a"].ended + QUIET_S:
            break
        time.sleep(0.5)


def test_kill_9_pages_exporter_down_and_leaves_the_file(cluster):
    b = cluster.jobs["b"]
    assert b.returncode == -signal.SIGKILL
    pages = wait_for("the GRPOExporterDown page of job b",
                     lambda: cluster.clock.pages(alertname="GRPOExporterDown", instance=b.instance), PAGE_WITHIN_S)
    (first, path, alert), *_ = pages
    assert path == "/pager", pages
    assert alert["labels"]["run"] == b.run, alert["labels"]
    assert alert["labels"]["slurm_job_id"] == b.job_id, alert["labels"]
    assert (cluster.targets_dir / b.file).exists(), "the crashed job's file stays"
    assert any(t["labels"].get("instance") == b.instance and t["health"] == "down"
               for t in active_targets(cluster.url))
    print(f"\nkill -9 to the GRPOExporterDown page {first - b.ended:.1f} s")


def test_only_the_crash_pages_and_the_watchdog_reaches_its_own_receiver(cluster):
    b = cluster.jobs["b"]
    watchdog = wait_for("GRPOWatchdog at /watchdog", lambda: cluster.clock.pages(alertname="GRPOWatchdog"), 10.0)
    assert {path for _, path, _ in watchdog} == {"/watchdog"}, watchdog
    others = [(path, a["labels"]) for _, path, a in cluster.clock.pages() if a["labels"]["alertname"] != "GRPOWatchdog"]
    assert others, "the crash paged"
    for path, labels in others:  # the crash's own pages only: down, then (once older than 10 s) stalled
        assert labels.get("run") == b.run, (path, labels)
        assert path == "/pager", (path, labels)
        assert labels["alertname"] in ("GRPOExporterDown", "GRPOTrainingStalled"), labels
    assert not [a for _, a in cluster.clock.webhook.alerts() if a["labels"]["alertname"] == "GRPOWatchdog"
                and a["status"] != "firing"]


def test_the_epilog_prunes_a_stale_file_and_keeps_a_fresh_one(cluster):
    """deploy/slurm/epilog.sh: the crashed job's file stays while it is fresh (it still pages), and goes once it
    is older than an hour; the epilog exits 0 also when it cannot prune."""
    b = cluster.jobs["b"]
    path = cluster.targets_dir / b.file
    foreign = cluster.targets_dir / "grpo-not-ours.json"  # a file_sd file another program wrote
    foreign.write_text('[{"targets": ["127.0.0.9:9"], "labels": {}}]\n')
    old = time.time() - 2 * 3600
    os.utime(foreign, (old, old))
    env = {**os.environ, "EPILOG_TARGETS_DIR": str(cluster.targets_dir),
           "EPILOG_GRPO_EXPORTER": str(Path(sys.executable).parent / "grpo-exporter")}
    epilog = [str(SLURM / "epilog.sh")]
    done = subprocess.run(epilog, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert path.exists(), "a fresh file stays"
    assert foreign.exists(), "a file not ours stays"
    os.utime(path, (old, old))
    done = subprocess.run(epilog, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not path.exists(), "the stale file is gone"
    assert foreign.exists()
    for broken in ({"EPILOG_TARGETS_DIR": str(cluster.workdir / "not-mounted")},
                   {"EPILOG_GRPO_EXPORTER": str(cluster.workdir / "no-such-command")}):
        done = subprocess.run(epilog, env={**env, **broken}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (broken, done.stderr)
