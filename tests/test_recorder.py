"""The flight recorder (seed 第 6 篇 三态保存) and `grpo-exporter inspect`: exactly the three states around an
injected fault of the demo, the offending rows first, one incident per episode, writes off the training thread,
a disk budget, owner-only files, and no partial incident after kill -9."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import math
import os
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.cli import main
from grpo_exporter.demo.scenarios import SCENARIOS
from grpo_exporter.demo.task import Task, decode
from grpo_exporter.demo.trainer import DemoConfig, Trainer, warm_snapshot
from grpo_exporter.recorder.inspect import InspectError, load, render
from grpo_exporter.recorder.store import UNLOCKED_GRACE_S, RecorderError, incidents, size_of, sweep_partials
from grpo_exporter.runtime.guard import TrainingSignalError

INJECT = 5
# a seed and a task the scenarios are not calibrated on: one right answer (reverse), seed 4
REVERSE = DemoConfig(seed=4, task=Task(symbols=8, length=5, kind="reverse"))


@functools.cache
def warm() -> dict[str, object]:
    """The warm-started state of REVERSE (deterministic), shared by the tests."""
    return warm_snapshot(REVERSE)


def train(root: Path, faults: dict[int, str | None] | None = None, steps: int = 9,
          **settings: object) -> GRPOMonitor:
    """The demo trainer with the recorder on; ``faults``: step -> scenario injected there (None: back to healthy)."""
    torch.set_num_threads(1)
    config = REVERSE
    settings = {"guard": "off", "edit_distance_groups": 0} | settings
    with GRPOMonitor(run="rec", group_size=config.group_size, clip_eps=config.clip_eps, port=None,
                     log_ratio_clamp=config.log_ratio_clamp, recorder_dir=root, decode=decode, **settings) as mon:
        trainer = Trainer(config, mon)
        trainer.restore(warm())
        for step in range(steps):
            if faults and step in faults:
                fault = faults[step]
                trainer.faults = type(trainer.faults)()
                if fault is not None:
                    SCENARIOS[fault].inject(trainer)
            trainer.step(step)
    return mon


def manifests(root: Path) -> list[dict]:
    return [load(p) for p in incidents(root)]


@pytest.mark.parametrize(("fault", "trigger", "settings"), [
    ("exp-before-clamp", "nonfinite", {}),
    ("mask-bug", "mask_mismatch", {}),
    # top-p renormalised engine log-probs: the gap is systematic (k1 ~0.1), the guard's and the alert's judgement;
    # the recorder follows the guard's lines as configured, here a stricter jump line
    ("engine-top-p", "engine_gap", {"engine_gap_stop_nats": 0.004}),
    ("advantage-bug", "advantage_bound", {}),
])
def test_exactly_the_three_states_around_an_injected_fault_offending_rows_first(tmp_path, fault, trigger, settings,
                                                                                capsys):
    mon = train(tmp_path, faults={INJECT: fault}, **settings)
    [m] = manifests(tmp_path)  # the fault persists: one incident for the episode, not one per step
    assert m["triggers"] == [trigger]
    assert m["stop_lines"]["engine_gap_stop_nats"] == settings.get("engine_gap_stop_nats", 0.01)
    assert m["steps"] == {"last_normal": INJECT - 1, "first_anomalous": INJECT, "next": INJECT + 1}
    assert m["next_missing"] is None
    assert [h["step"] for h in m["history"]] == list(range(INJECT + 1))
    assert [h["policy_version"] for h in m["history"]] == list(range(INJECT + 1))  # the demo syncs every step
    assert [bool(h["triggers"]) for h in m["history"]] == [False] * INJECT + [True]
    assert mon.metrics()["grpo_recorder_incidents_total"] == 1
    [latest] = [k for k in mon.metrics() if k.startswith("grpo_recorder_latest_incident_step")]
    assert Path(m["path"]).name in latest
    assert mon.metrics()[latest] == INJECT

    stage = "rollout" if trigger == "engine_gap" else "update"
    rows = m["states"]["first_anomalous"]["rows"][stage]
    drivers = [r for r in rows if r["driver"] == trigger]
    assert drivers
    assert rows[: len(drivers)] == drivers
    assert len(rows) == 16
    assert not any(r["driver"] for r in m["states"]["last_normal"]["rows"][stage])
    plain = [r for r in rows if r["driver"] is None]
    if trigger == "nonfinite":
        assert all("old_logprobs" in r["nonfinite"] and r["log_ratio_max"] == "inf" for r in drivers)
    elif trigger == "mask_mismatch":  # the mask covers the padding after EOS: more loss tokens than the completion
        assert all(r["loss_tokens"] > r["completion_lengths"] for r in drivers)
    elif trigger == "engine_gap":  # top-p: the rows with the largest mean gap, far above a healthy bf16 row's
        assert min(r["engine_gap_mean"] for r in drivers) >= max(r["engine_gap_mean"] for r in plain)
        assert min(r["engine_gap_mean"] for r in drivers) > 0.05
        last = m["states"]["last_normal"]["rows"]["rollout"]
        assert max(r["engine_gap_mean"] for r in last) < 0.05  # the bf16 engine's noise, ~0.015 mean
    else:  # |A| above (G-1)/sqrt(G) = 7/sqrt(8) = 2.47 (seed: the normalisation's bound)
        bound = (8 - 1) / math.sqrt(8)
        assert all(abs(r["advantage"]) > bound for r in drivers)
    # decoded text: "<bos>" + 5 symbols + "|" prompts, completions of letters ending in <eos> (or truncated)
    assert all(r["prompt"].startswith("<bos>") for r in m["states"]["first_anomalous"]["rows"]["rollout"])
    assert all(isinstance(r["completion"], str) for r in rows)

    for role in ("last_normal", "first_anomalous", "next"):  # the raw rows, replayable, loadable safely
        raw = torch.load(Path(m["path"]) / f"{role}.pt", weights_only=True)
        assert set(raw) == {"rollout", "update"}
        assert raw["update"]["logprobs"].shape == (16, REVERSE.max_new)
        assert raw["rollout"]["prompt_tokens"].shape == (16, 7)
        assert raw[stage]["row"].tolist() == [r["row"] for r in m["states"][role]["rows"][stage]]

    assert main(["inspect", str(tmp_path)]) == 0  # the recorder dir: its latest incident
    text = capsys.readouterr().out
    assert f"triggers: {trigger}" in text
    assert f"last normal {INJECT - 1}  first anomalous {INJECT}  next {INJECT + 1}" in text
    table = text.split("== rows of step")[1].splitlines()[2:]
    assert len(table) == 20
    assert all(f" {trigger} " in line for line in table[: len(drivers)])
    assert main(["inspect", m["path"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == Path(m["path"]).name


def test_a_healthy_run_records_nothing_and_a_new_episode_opens_a_new_incident(tmp_path):
    train(tmp_path / "healthy", steps=12)
    assert manifests(tmp_path / "healthy") == []
    # a fault for two steps, healthy again, then another fault: two episodes, two incidents
    train(tmp_path / "two", faults={3: "exp-before-clamp", 5: None, 8: "mask-bug"}, steps=11)
    first, second = manifests(tmp_path / "two")
    assert (first["steps"], first["triggers"]) == ({"last_normal": 2, "first_anomalous": 3, "next": 4}, ["nonfinite"])
    assert (second["steps"], second["triggers"]) == (
        {"last_normal": 7, "first_anomalous": 8, "next": 9}, ["mask_mismatch"])


def test_steps_that_cannot_judge_a_trigger_neither_end_nor_restart_its_episode(tmp_path):
    """One rollout per two optimizer steps (num_iterations=2): the update-only steps have no engine gap. A gap
    at the stop line from step 2 on is one episode; it ends at the first rollout without it (step 8), and
    returns at step 12 as a new one (no cooldown: recorder_cooldown_steps=0)."""
    def gap(step: int) -> dict[str, torch.Tensor]:
        x = _inputs(step, bad=False)
        if 2 <= step < 8 or step >= 12:
            x["rollout_logprobs"] = x["old_logprobs"] - 0.05  # mean gap 0.05 nats >= 0.01
        return x

    model = torch.nn.Linear(3, 1)
    with GRPOMonitor(run="it", group_size=8, port=None, guard="off", recorder_dir=tmp_path,
                     edit_distance_groups=0, recorder_cooldown_steps=0) as mon:
        for step in range(16):
            if step % 2 == 0:
                mon.observe_rollout(step, **gap(step))
            x = _inputs(step, bad=False)
            mon.observe_update(step, logprobs=x["old_logprobs"], old_logprobs=x["old_logprobs"],
                               loss_mask=x["loss_mask"], advantages=torch.zeros(32))
            model(torch.ones(2, 3)).sum().backward()
            mon.clip_grad_norm_(model.parameters(), 1.0)
    first, second = manifests(tmp_path)
    assert first["steps"] == {"last_normal": 1, "first_anomalous": 2, "next": 3}
    assert second["steps"] == {"last_normal": 11, "first_anomalous": 12, "next": 13}
    assert first["triggers"] == second["triggers"] == ["engine_gap"]


def test_the_guard_raising_writes_the_incident_first(tmp_path):
    with pytest.raises(TrainingSignalError):
        train(tmp_path, faults={INJECT: "exp-before-clamp"}, guard="raise")
    [m] = manifests(tmp_path)
    assert m["steps"] == {"last_normal": INJECT - 1, "first_anomalous": INJECT, "next": None}
    assert "guard raised" in m["next_missing"]
    assert not (Path(m["path"]) / "next.pt").exists()
    assert "next step: not recorded (the guard raised" in render(m)


def test_writes_happen_off_the_training_thread_and_never_block_observe(tmp_path):
    """The writer is held inside its first file until training has run three more steps: observe returned
    every time while the incident was still being written."""
    reached, release, threads = threading.Event(), threading.Event(), []

    def slow_disk() -> None:
        threads.append(threading.current_thread().name)
        reached.set()
        release.wait(60)

    torch.set_num_threads(1)
    cfg = REVERSE
    with GRPOMonitor(run="rec", group_size=cfg.group_size, clip_eps=cfg.clip_eps, port=None, guard="off",
                     log_ratio_clamp=cfg.log_ratio_clamp, recorder_dir=tmp_path, edit_distance_groups=0) as mon:
        mon._stages.recorder.between_files = slow_disk
        trainer = Trainer(cfg, mon)
        trainer.restore(warm())
        for step in range(INJECT + 5):
            if step == INJECT:
                SCENARIOS["exp-before-clamp"].inject(trainer)
            trainer.step(step)
            if step == INJECT + 1:  # the incident is complete (its next step sealed): the writer takes it
                assert reached.wait(30)
        assert incidents(tmp_path) == []  # still held in its first file while training ran three more steps
        release.set()
    assert threads
    assert all(name.startswith("grpo-exporter-recorder") for name in threads)
    assert len(incidents(tmp_path)) == 1


def _inputs(step: int, bad: bool, n: int = 32, t: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    logprobs = -torch.rand(n, t, generator=g)
    if bad:
        logprobs[3, 7] = math.nan
    return {"rewards": torch.rand(n, generator=g), "rollout_logprobs": logprobs, "old_logprobs": logprobs.clone(),
            "completion_ids": torch.randint(0, 1000, (n, t), generator=g),
            "loss_mask": torch.ones(n, t, dtype=torch.bool), "completion_lengths": torch.full((n,), t)}


def _episodes(root: Path, count: int, t: int = 64, **settings: object) -> GRPOMonitor:
    """``count`` one-step faults, each between normal steps (three steps per episode; no cooldown)."""
    settings = {"recorder_cooldown_steps": 0} | settings
    with GRPOMonitor(run="rec", group_size=8, port=None, guard="off", recorder_dir=root, edit_distance_groups=0,
                     **settings) as mon:
        for step in range(3 * count + 1):
            mon.observe_rollout(step, **_inputs(step, bad=step % 3 == 1, t=t))
            mon.wait_for_workers()  # at most MAX_QUEUED incidents wait for the writer; more would be dropped
    return mon


@pytest.mark.parametrize(("cooldown", "opened"), [(None, [1]), (4, [1, 7, 13, 19]), (0, list(range(1, 22, 2)))])
def test_a_flapping_trigger_writes_one_incident_per_cooldown(tmp_path, cooldown, opened):
    """A NaN on every other step (a fault on alternate batches, a gap hovering at its line): each odd step
    used to open a new episode, an incident every two steps (39 MiB each at T=32768). It rejoins its episode
    within recorder_cooldown_steps (default 50) of the step that opened the last incident; 0 is the old way."""
    settings = {} if cooldown is None else {"recorder_cooldown_steps": cooldown}
    with GRPOMonitor(run="rec", group_size=8, port=None, guard="off", recorder_dir=tmp_path, edit_distance_groups=0,
                     **settings) as mon:
        for step in range(22):
            mon.observe_rollout(step, **_inputs(step, bad=step % 2 == 1, t=8))
            mon.wait_for_workers()
    assert [m["steps"]["first_anomalous"] for m in manifests(tmp_path)] == opened
    assert mon.metrics()["grpo_recorder_incidents_total"] == len(opened)


def test_held_rows_stay_within_the_state_byte_bound(tmp_path):
    """recorder_rows=4096 at 512 x 4096 used to keep the whole batch per state (52 MiB); the rows one state holds
    stay within recorder_max_state_bytes (here 4 MiB: 512 x 4096 x 6 inputs would be 50 MiB), at least one."""
    bound = 4 << 20
    with GRPOMonitor(run="m", group_size=8, port=None, guard="off", recorder_dir=tmp_path, edit_distance_groups=0,
                     recorder_rows=4096, recorder_max_state_bytes=bound) as mon:
        for step in range(3):
            mon.observe_rollout(step, **_inputs(step, bad=step == 1, n=512, t=4096))
            held = [sum(t.numel() * t.element_size() for rows in state.rows.values() for t in rows.values())
                    for state in mon._stages.recorder._open.values()]
            assert held
            assert max(held) <= bound
    [m] = manifests(tmp_path)
    kept = torch.load(incidents(tmp_path)[0] / "first_anomalous.pt", weights_only=True)["rollout"]
    assert 1 <= len(kept["row"]) < 512
    assert sum(t.numel() * t.element_size() for t in kept.values()) <= bound
    assert m["states"]["first_anomalous"]["rows"]["rollout"][0]["driver"] == "nonfinite"  # the offending row kept


def test_prompt_tokens_on_another_device_never_cost_the_incident(tmp_path, caplog):
    """prompt_tokens on a device other than the step's tensors: taking its rows there used to raise inside the
    recorder and lose the whole incident. Tokens that can move are moved (a CPU-to-GPU copy of a few ids; this
    machine has no second device to show it); tokens that cannot (here the meta device) are left out with a
    counted error naming the field, and the incident keeps every other row field."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    with GRPOMonitor(run="d", group_size=8, port=None, guard="off", recorder_dir=tmp_path,
                     edit_distance_groups=0) as mon:
        for step in range(3):
            mon.observe_rollout(step, **_inputs(step, bad=step == 1),
                                prompt_tokens=torch.zeros(32, 5, dtype=torch.long, device="meta"))
    [m] = manifests(tmp_path)
    assert m["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": 2}
    kept = torch.load(incidents(tmp_path)[0] / "first_anomalous.pt", weights_only=True)["rollout"]
    assert "prompt_tokens" not in kept
    assert kept["rollout_logprobs"].shape == (16, 64)
    assert mon.metrics()['grpo_exporter_errors_total{stage="recorder"}'] == 3
    assert any("`prompt_tokens`: expected a tensor that can move to the inputs' device cpu" in r.getMessage()
               for r in caplog.records)


def test_a_monitor_starts_while_another_job_prunes_the_directory(tmp_path):
    """Another job removing incidents while a monitor is made: the constructor lists them and sums their sizes,
    and a directory or manifest gone in between used to raise FileNotFoundError from it (training never
    started). 300 incidents, a pruner in another process removing them, monitors made meanwhile."""
    for i in range(300):
        folder = tmp_path / f"incident-s{i:09d}-20261201T000000Z-r0"
        (folder / "sub").mkdir(parents=True)
        (folder / "incident.json").write_text("{}")
        for name in ("a.pt", "b.pt", "sub/c.pt"):
            (folder / name).write_bytes(b"x" * 100)
    pruner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import shutil, pathlib
        for p in sorted(pathlib.Path({str(tmp_path)!r}).glob("incident-*")):
            shutil.rmtree(p, ignore_errors=True)
        """)])
    made = 0
    try:
        while pruner.poll() is None or made == 0:
            GRPOMonitor(run="p", group_size=8, port=None, guard="off", recorder_dir=tmp_path,
                        edit_distance_groups=0).close()
            made += 1
    finally:
        pruner.wait(timeout=60)
    assert made >= 1
    assert incidents(tmp_path) == []


def test_the_disk_budget_removes_the_oldest_incidents_first(tmp_path):
    one = tmp_path / "one"
    _episodes(one, 1)
    [single] = incidents(one)
    size = sum(f.stat().st_size for f in single.iterdir())
    budget = int(3.5 * size)
    mon = _episodes(tmp_path / "many", 8, recorder_disk_budget_bytes=budget)
    kept = incidents(tmp_path / "many")
    assert [load(p)["steps"]["first_anomalous"] for p in kept] == [16, 19, 22]  # the newest three of 1, 4, .., 22
    assert sum(f.stat().st_size for p in kept for f in p.iterdir()) <= budget
    m = mon.metrics()
    assert m["grpo_recorder_incidents_total"] == 8
    assert m["grpo_recorder_removed_incidents_total"] == 5
    assert 0 < m["grpo_recorder_disk_usage_bytes"] <= budget


def test_a_disk_that_cannot_keep_up_drops_incidents_counted_never_blocking(tmp_path):
    """The writer stuck in its first file: four incidents wait (MAX_QUEUED), the next two are dropped and
    counted as recorder errors, and training went on; once the disk answers, the four are written."""
    release = threading.Event()
    with GRPOMonitor(run="q", group_size=8, port=None, guard="off", recorder_dir=tmp_path,
                     edit_distance_groups=0, recorder_cooldown_steps=0) as mon:
        mon._stages.recorder.between_files = lambda: release.wait(60)
        for step in range(3 * 6 + 2):  # rollouts only: step 19 seals 17, the last incident's next step
            mon.observe_rollout(step, **_inputs(step, bad=step % 3 == 1))
        assert incidents(tmp_path) == []
        assert mon.metrics()['grpo_exporter_errors_total{stage="recorder"}'] == 2
        release.set()
    assert [load(p)["steps"]["first_anomalous"] for p in incidents(tmp_path)] == [1, 4, 7, 10]


FULL_DISK = """
import json, os, shutil, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
from grpo_exporter.recorder.store import incidents
mnt, floor = {mnt!r}, 1 << 20
def free():
    return shutil.disk_usage(mnt).free
def fill(leave):  # a checkpoint sharing the filesystem, leaving `leave` bytes free
    with open(os.path.join(mnt, "checkpoint.pt"), "ab") as f:
        f.write(bytes(free() - leave))
        f.flush()
        os.fsync(f.fileno())
def run(root, steps, seen):
    with GRPOMonitor(run="f", group_size=8, port=None, guard="off", recorder_dir=root, edit_distance_groups=0,
                     recorder_cooldown_steps=0, recorder_min_free_bytes=floor, recorder_min_free_ratio=0) as mon:
        for step in range(steps):
            mon.observe_rollout(step, **_inputs(step, bad=step % 3 == 1))
            mon.wait_for_workers()
            seen.append(free())
    return mon.metrics()
before = free()
run(os.path.join(mnt, "probe"), 4, [])
one = before - free()  # one incident's cost on this filesystem
shutil.rmtree(os.path.join(mnt, "probe"))
fill(floor + int(2.5 * one))
seen = []
m = run(os.path.join(mnt, "rec"), 19, seen)
result = {{"one": one, "min_free": min(seen), "kept": len(incidents(Path(mnt, "rec"))),
          "written": m["grpo_recorder_incidents_total"], "removed": m["grpo_recorder_removed_incidents_total"],
          "errors": m.get('grpo_exporter_errors_total{{stage="recorder"}}', 0)}}
fill(floor - 3 * one)  # the checkpoint grows: removing every incident would not leave room
m = run(os.path.join(mnt, "rec"), 4, seen)
result |= {{"full_kept": len(incidents(Path(mnt, "rec"))), "full_min_free": free(),
           "full_errors": m.get('grpo_exporter_errors_total{{stage="recorder"}}', 0),
           "partials": [p for p in os.listdir(os.path.join(mnt, "rec")) if p.startswith(".")]}}
print(json.dumps(result))
"""


def test_an_incident_never_takes_the_free_space_a_checkpoint_needs(tmp_path):
    """A 4 MiB tmpfs (its own mount namespace) shared with a checkpoint that leaves room for 2.5 incidents
    above a 1 MiB floor: six episodes leave the floor free throughout; the oldest incidents are removed before
    each write (two kept, four removed). When the checkpoint grows until even no incident leaves room, the
    oldest go, nothing is written, each loss is a counted recorder error and no partial is left."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    code = textwrap.dedent(FULL_DISK.format(tests=str(Path(__file__).parent), mnt=str(mnt)))
    script = tmp_path / "full_disk.py"
    script.write_text(code)
    done = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=4m tmpfs {mnt} && "
                           f"exec {sys.executable} {script}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert 16 << 10 < r["one"] < 300 << 10
    assert r["min_free"] >= 1 << 20
    assert (r["written"], r["kept"], r["removed"], r["errors"]) == (6, 2, 4, 0)
    assert r["full_kept"] == 0  # both removed to make room, in vain
    assert r["full_errors"] == 1  # one episode, not written
    assert r["partials"] == []


def test_an_incident_over_the_budget_keeps_its_summary_or_is_counted_as_an_error(tmp_path):
    one = tmp_path / "one"
    _episodes(one, 1, t=1024)
    [single] = incidents(one)
    summary = (single / "incident.json").stat().st_size
    assert summary < size_of(single)
    assert summary > 1 << 16  # completions of 1024 token ids, the first 512 kept as ids
    row = load(single)["states"]["first_anomalous"]["rows"]["rollout"][0]
    assert len(row["completion"]) == 512
    raw = torch.load(single / "first_anomalous.pt", weights_only=True)
    assert raw["rollout"]["completion_ids"].shape == (16, 1024)  # every token in the raw rows
    _episodes(tmp_path / "tight", 1, t=1024, recorder_disk_budget_bytes=summary + 100)
    [tight] = incidents(tmp_path / "tight")
    assert sorted(p.name for p in tight.iterdir()) == ["incident.json"]
    assert "over the disk budget" in load(tight)["raw_rows"]
    mon = _episodes(tmp_path / "tiny", 1, t=1024, recorder_disk_budget_bytes=1 << 16)
    assert [p.name.startswith("reading-") for p in (tmp_path / "tiny").iterdir()] == [True]  # the reading set's
    assert mon.metrics()['grpo_exporter_errors_total{stage="recorder"}'] == 1
    assert mon.metrics()["grpo_recorder_incidents_total"] == 0


def test_incidents_are_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        _episodes(tmp_path / "new", 1)
    finally:
        os.umask(old)
    root = tmp_path / "new"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    [incident] = incidents(root)
    assert stat.S_IMODE(incident.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in incident.iterdir()} == {0o600}


def test_no_raw_text_reaches_a_label(tmp_path):
    with GRPOMonitor(run="t", group_size=8, port=None, guard="off", recorder_dir=tmp_path, edit_distance_groups=0,
                     decode=lambda ids: "SECRET PROMPT TEXT") as mon:
        for step in range(4):
            mon.observe_rollout(step, **_inputs(step, bad=step == 1), prompt_tokens=torch.ones(32, 4, dtype=torch.long))
    [incident] = incidents(tmp_path)
    assert "SECRET PROMPT TEXT" in (incident / "incident.json").read_text()
    assert any(k.startswith("grpo_recorder_latest_incident_step{") for k in mon.metrics())
    assert not [k for k in mon.metrics() if "SECRET" in k]


KILLED = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
mon = GRPOMonitor(run="k", group_size=8, port=None, guard="off", recorder_dir={root!r}, edit_distance_groups=0)
def stuck():
    print("one file written", flush=True)
    time.sleep(60)
mon._stages.recorder.between_files = stuck
for step in range(5):  # rollouts only: step 4 seals step 2, the incident's next state
    mon.observe_rollout(step, **_inputs(step, bad=step == 1))
time.sleep(60)
"""

EXITS = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
mon = GRPOMonitor(run="x", group_size=8, port=None, guard="off", recorder_dir={root!r}, edit_distance_groups=0)
for step in range(2):
    mon.observe_rollout(step, **_inputs(step, bad=step == 1))
raise SystemExit(3)  # a crash of the training loop: no close()
"""


STUCK = """
import os, sys, time, torch
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
def hang(*args):
    time.sleep(3600)
if {where!r} == "fsync":
    os.fsync = hang  # a filesystem that never answers (a dead NFS mount)
decode = hang if {where!r} == "decode" else None
mon = GRPOMonitor(run="s", group_size=8, port=None, guard="off", recorder_dir={root!r}, edit_distance_groups=0,
                  recorder_flush_timeout_s=3.0, decode=decode)  # the serialisation ends well within it
for step in range(3):
    mon.observe_rollout(step, **_inputs(step, bad=step == 1))
if {close!r}:
    mon.close()
print("training done", flush=True)
"""

LAUNCHER = """
import gc, sys, torch
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
def train():
    mon = GRPOMonitor(run="l", group_size=8, port=None, guard="off", recorder_dir={root!r}, edit_distance_groups=0)
    for step in range(2):
        mon.observe_rollout(step, **_inputs(step, bad=step == 1))
    raise RuntimeError("the training loop crashed")  # no with, no close()
try:
    train()
except RuntimeError:
    print("the launcher caught it", flush=True)
gc.collect()  # the monitor is garbage now
"""


@pytest.mark.parametrize(("where", "close"), [("decode", True), ("decode", False), ("fsync", True),
                                              ("fsync", False)])
def test_a_hung_decode_or_filesystem_never_keeps_the_process_alive(tmp_path, where, close):
    """The writer thread is stuck for good: close() returns after recorder_flush_timeout_s, and the process
    exits, saying what it abandoned (concurrent.futures used to join the stuck thread at exit: a finished
    job kept its nodes for ever). The stuck call is one of the user's or the filesystem's: a writer abandoned
    while it still runs torch's serialisation (a timeout shorter than it) would be stopped mid-call at exit."""
    code = textwrap.dedent(STUCK.format(tests=str(Path(__file__).parent), root=str(tmp_path / "rec"), where=where,
                                        close=close))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training done" in done.stdout
    assert time.monotonic() - start < 45
    said = "close() returns without them" if close else "abandoned at exit"
    assert said in done.stderr, done.stderr[-2000:]


def test_a_monitor_never_closed_in_a_loop_a_launcher_catches_still_writes_its_incident(tmp_path):
    root = tmp_path / "rec"
    code = textwrap.dedent(LAUNCHER.format(tests=str(Path(__file__).parent), root=str(root)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [m] = manifests(root)
    assert m["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": None}
    assert m["next_missing"] == "the process exited"


def test_kill_9_mid_write_leaves_no_partial_incident_and_the_next_recorder_cleans_up(tmp_path):
    root = tmp_path / "rec"
    code = textwrap.dedent(KILLED.format(tests=str(Path(__file__).parent), root=str(root)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "one file written"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert incidents(root) == []
    [partial] = list(root.iterdir())
    assert partial.name.startswith(".partial-")
    with pytest.raises(InspectError, match="no complete incident"):
        load(root)
    _episodes(root, 1)  # a new recorder on the directory removes the dead process's partial write
    assert [p.name.startswith("incident-") for p in root.iterdir() if not p.name.startswith("reading-")] == [True]


def test_a_live_writer_in_another_pid_namespace_is_never_swept(tmp_path):
    """Two PID namespaces on one directory (two containers on one host): the writer's PID (3999991 in its
    namespace) is no process in ours, so `kill(pid, 0)` called it dead and its incident was deleted mid-write.
    Its lock says it is alive; once it is gone, its partial directory is removed."""
    root = tmp_path / "rec"
    code = textwrap.dedent(KILLED.format(tests=str(Path(__file__).parent), root=str(root)))
    # the namespace's next PID set, then a fork (not an exec): the writer is PID 3999991 there
    inner = f"echo 3999990 > /proc/sys/kernel/ns_last_pid && {sys.executable} -c {shlex.quote(code)}; exit $?"
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", inner],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "one file written"
        [partial] = list(root.iterdir())
        assert "--3999991-" in partial.name  # a PID that no process of this namespace has
        assert sweep_partials(root) == []
        assert partial.exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 30  # the killed writer (a grandchild in its namespace) exits, its lock with it
    while not (removed := sweep_partials(root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert removed == [partial]


def test_an_unlocked_partial_of_another_host_is_swept_only_once_it_is_old(tmp_path):
    """Another host's writer cannot be asked by PID: its unlocked partial directory stays for UNLOCKED_GRACE_S
    (it may not have taken its lock yet), then goes; a locked one stays whatever its age."""
    young, old, held = (tmp_path / f".partial-elsewhere--{pid}-1-x" for pid in (11, 12, 13))
    for path in (young, old, held):
        path.mkdir()
    past = time.time() - UNLOCKED_GRACE_S - 60
    for path in (old, held):
        os.utime(path, (past, past))
    lock = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        assert sweep_partials(tmp_path) == [old]
    finally:
        os.close(lock)
    assert young.exists()
    assert held.exists()


def test_two_recorders_of_one_process_on_one_directory_both_write(tmp_path):
    """Both write their first incident at once: the partial names once collided (host, pid, serial 1)."""
    holding, gate = threading.Event(), threading.Event()

    def hold() -> None:  # a's writer keeps its partial directory until b's incident is written
        holding.set()
        gate.wait(30)

    kw = {"group_size": 8, "port": None, "guard": "off", "recorder_dir": tmp_path, "edit_distance_groups": 0}
    with GRPOMonitor(run="a", **kw) as a, GRPOMonitor(run="b", **kw) as b:
        assert a._stages.recorder is not None
        a._stages.recorder.between_files = hold
        for mon in (a, b):
            for step in range(5):  # rollouts only: step 4 seals step 2, the incident's next state
                mon.observe_rollout(step, **_inputs(step, bad=step == 1))
            if mon is a:
                assert holding.wait(30)
        b.wait_for_workers()
        gate.set()
    assert sorted(m["run"] for m in manifests(tmp_path)) == ["a", "b"]
    assert a.metrics().get('grpo_exporter_errors_total{stage="recorder"}', 0) == 0
    assert b.metrics().get('grpo_exporter_errors_total{stage="recorder"}', 0) == 0


def test_an_exit_without_close_still_writes_the_pending_incident(tmp_path):
    root = tmp_path / "rec"
    code = textwrap.dedent(EXITS.format(tests=str(Path(__file__).parent), root=str(root)))
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 3
    [m] = manifests(root)
    assert m["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": None}
    assert m["next_missing"] == "the process exited"


TERMINATED = """
import signal, sys, time, torch
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
if {chained!r}:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))  # the launcher's own handler, installed first
mon = GRPOMonitor(run="t", group_size=8, port=None, guard="off", recorder_dir={root!r}, edit_distance_groups=0)
for step in range(2):
    mon.observe_rollout(step, **_inputs(step, bad=step == 1))
print("pending", flush=True)  # step 1's incident waits for its next state
time.sleep(120)
"""


CLOSES = """
import sys, tempfile
sys.path.insert(0, {tests!r})
from test_recorder import _inputs
from grpo_exporter import GRPOMonitor
for run in range(3):
    with GRPOMonitor(run="c", group_size=8, port=None, guard="off", recorder_dir=tempfile.mkdtemp(dir={root!r}),
                     edit_distance_groups=0) as mon:
        for step in range(7):
            mon.observe_rollout(step, **_inputs(step, bad=step % 3 == 1))
            mon.wait_for_workers()
print("done", flush=True)
"""


def test_a_process_that_closed_its_recorders_exits_cleanly(tmp_path):
    """The writer thread used to be left ending on its own after close(): when the interpreter tore down
    meanwhile, torch's thread-local destructors aborted the process (exit 134, "terminate called without an
    active exception") in 5 of 8 exits here, a finished job reported as crashed. close() now waits for the
    idle writer to end. Five processes, each closing three recorders that wrote incidents, all exit 0."""
    code = textwrap.dedent(CLOSES.format(tests=str(Path(__file__).parent), root=str(tmp_path)))
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, "done"), done.stderr[-2000:]


@pytest.mark.parametrize("chained", [False, True])
def test_sigterm_writes_the_pending_incident_and_ends_the_process_as_before(tmp_path, chained):
    """A scheduler ends a job with SIGTERM, which skips atexit: the pending incident used to be lost. Now it is
    written first; then the process ends as it would have: killed by SIGTERM (default), or by the handler that
    was there before (here one that exits 7)."""
    root = tmp_path / "rec"
    code = textwrap.dedent(TERMINATED.format(tests=str(Path(__file__).parent), root=str(root), chained=chained))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "pending"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == (7 if chained else -signal.SIGTERM)
    finally:
        proc.kill()
    [m] = manifests(root)
    assert m["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": None}
    assert m["next_missing"] == "the process was sent SIGTERM"


def test_hostile_recorder_inputs_are_counted_never_raised_unless_strict(tmp_path):
    def broken(ids: list[int]) -> str:
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")

    x = _inputs(1, bad=True)
    with GRPOMonitor(run="h", group_size=8, port=None, guard="off", recorder_dir=tmp_path, decode=broken,
                     edit_distance_groups=0) as mon:
        mon.observe_rollout(0, **_inputs(0, bad=False), prompt_tokens=torch.zeros(5, 3, dtype=torch.long))
        assert mon.metrics()['grpo_exporter_errors_total{stage="recorder"}'] == 1
        for step in (1, 2, 3):
            mon.observe_rollout(step, **(x if step == 1 else _inputs(step, bad=False)))
    [m] = manifests(tmp_path)
    assert m["steps"] == {"last_normal": 0, "first_anomalous": 1, "next": 2}  # step 0 kept, without prompts
    row = m["states"]["first_anomalous"]["rows"]["rollout"][0]
    assert row["driver"] == "nonfinite"
    assert row["row"] == 3
    assert row["completion"].startswith("<decode failed: UnicodeDecodeError>")
    with (GRPOMonitor(run="s", group_size=8, port=None, recorder_dir=tmp_path / "s", strict=True) as mon,
          pytest.raises(ValueError, match="prompt_tokens")):
        mon.observe_rollout(0, **_inputs(0, bad=False), prompt_tokens=torch.zeros(32, 3))


def test_a_recorder_dir_that_cannot_be_used_fails_at_construction_naming_the_field(tmp_path):
    """Before training starts, not at the first incident: a file where the directory should be."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecorderError, match=r"recorder_dir: expected a directory.*file"):
        GRPOMonitor(run="v", group_size=8, port=None, recorder_dir=tmp_path / "file")
    with pytest.raises(RecorderError, match="recorder_dir: expected a directory this process can create"):
        GRPOMonitor(run="v", group_size=8, port=None, recorder_dir=tmp_path / "file" / "below")


def test_the_guide_example_runs_as_written_and_records_the_nan(tmp_path):
    """docs/recorder.md's loop, verbatim but for a free port, on the doc examples' tiny setup with a NaN
    log-prob on a loss token of row 1 from the first step: one episode, its offending row first, decoded."""
    from types import SimpleNamespace

    from doc_examples import examples, namespace

    [code] = examples("docs/recorder.md")
    names = namespace("nonfinite") | {
        "incidents": tmp_path, "tokenizer": SimpleNamespace(decode=lambda ids: " ".join(f"t{i}" for i in ids)),
        "prompt_ids": torch.arange(32 * 4).view(32, 4),
    }
    exec(compile(code.replace("port=9887", "port=0"), "docs/recorder.md", "exec"), names)
    [m] = manifests(tmp_path)
    assert m["triggers"] == ["nonfinite"]
    assert m["steps"] == {"last_normal": None, "first_anomalous": 0, "next": 1}
    first = m["states"]["first_anomalous"]["rows"]["update"][0]
    assert (first["row"], first["driver"], first["nonfinite"]) == (1, "nonfinite", ["logprobs"])
    assert m["states"]["first_anomalous"]["rows"]["rollout"][0]["prompt"] == "t0 t1 t2 t3"


def test_recorder_settings_are_validated():
    with pytest.raises(ValueError, match="recorder_triggers"):
        GRPOMonitor(run="v", group_size=8, port=None, recorder_triggers=["nonfinite", "nan"])
    with pytest.raises(ValueError, match="recorder_rows"):
        GRPOMonitor(run="v", group_size=8, port=None, recorder_rows=0)


def _manifest(**changes: object) -> dict:
    """A minimal valid manifest, as the recorder writes one, with ``changes`` applied."""
    row = {"row": 3, "driver": "nonfinite", "rewards": 1.0, "reward_components": {"correctness": 1.0},
           "correct": True, "truncated": False, "loss_tokens": 5, "log_ratio_min": -0.1, "log_ratio_max": "inf",
           "engine_gap_mean": 0.01, "advantage": 0.5, "nonfinite": ["logprobs"], "prompt": "p", "completion": [4, 5]}
    state = {"step": 1, "metrics": {"grpo_nonfinite_values_total": 1.0}, "rows": {"update": [row]}}
    return {"format": 1, "id": "incident-x", "run": "r", "rank": 0, "world": 1, "triggers": ["nonfinite"],
            "steps": {"last_normal": 0, "first_anomalous": 1, "next": None}, "states": {"first_anomalous": state}
            } | changes


def _row_with(**fields: object) -> dict:
    m = _manifest()
    m["states"]["first_anomalous"]["rows"]["update"][0].update(fields)
    return m


CRAFTED = {
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "deep inside a metric": json.dumps(_manifest(states={"first_anomalous": {"metrics": {"m": [[[[[1]]]]]}}})),
    "states a list": json.dumps(_manifest(states=[1, 2])),
    "an unknown role": json.dumps(_manifest(states={"\x1b[2Jrole": {"metrics": {}}})),
    "a state a string": json.dumps(_manifest(states={"next": "x"})),
    "metrics a list": json.dumps(_manifest(states={"next": {"metrics": [1]}})),
    "rows a string": json.dumps(_manifest(states={"next": {"metrics": {}, "rows": "x"}})),
    "a stage a dict": json.dumps(_manifest(states={"next": {"metrics": {}, "rows": {"update": {}}}})),
    "a row a number": json.dumps(_manifest(states={"next": {"metrics": {}, "rows": {"update": [7]}}})),
    "a row without its index": json.dumps(_row_with(row="3")),
    "a ratio of the wrong type": json.dumps(_row_with(log_ratio_min={"a": 1})),
    "components a list": json.dumps(_row_with(reward_components=[1])),
    "non-finite names numbers": json.dumps(_row_with(nonfinite=[1])),
    "steps a list": json.dumps(_manifest(steps=[1])),
    "triggers a number": json.dumps(_manifest(triggers=3)),
    "the run an object": json.dumps(_manifest(run={"a": 1})),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_inspect_of_a_crafted_manifest_exits_2_with_a_message(tmp_path, capsys, case):
    (tmp_path / "incident.json").write_text(CRAFTED[case])
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-exporter inspect: "), err[:300]
    assert "expected" in err, err[:300]
    assert "\x1b" not in err


def test_inspect_escapes_control_characters_and_lone_surrogates_in_model_text(tmp_path, capsys):
    text = "ok\x1b[2J\x07\rbell\u2028\ud800end"
    m = _row_with(prompt=text, completion=text, driver="nonfinite\x1b")
    m["states"]["first_anomalous"]["metrics"]["grpo_x{k=\"\x1b\"}"] = 1.0
    (tmp_path / "incident.json").write_text(json.dumps(m))  # ensure_ascii: "\ud800" stays a lone surrogate
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(ch == "\n" or ch.isprintable() for ch in out)
    assert "\\x1b[2J\\x07\\rbell\\u2028\\ud800end" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert "\x1b" not in capsys.readouterr().out


@pytest.mark.parametrize(("decode", "starts"), [
    (lambda ids: b"\xffok" + bytes(i % 128 for i in ids), "\ufffdok"),  # bytes: UTF-8, bad bytes replaced
    (lambda ids: {"ids": ids}, "<decode returned dict>"),
    (lambda ids: (_ for _ in ()).throw(SystemExit(3)), "<decode failed: SystemExit>"),
    (lambda ids: (_ for _ in ()).throw(asyncio.CancelledError()), "<decode failed: CancelledError>"),
])
def test_decode_may_return_or_raise_anything_and_the_incident_keeps_its_rows(tmp_path, decode, starts):
    with GRPOMonitor(run="h", group_size=8, port=None, guard="off", recorder_dir=tmp_path, decode=decode,
                     edit_distance_groups=0) as mon:
        for step in (0, 1, 2):
            mon.observe_rollout(step, **_inputs(step, bad=step == 1))
    [m] = manifests(tmp_path)  # close() returned, nothing escaped, the incident is whole
    row = m["states"]["first_anomalous"]["rows"]["rollout"][0]
    assert (row["row"], row["driver"]) == (3, "nonfinite")
    assert row["completion"].startswith(starts)
    raw = torch.load(Path(m["path"]) / "first_anomalous.pt", weights_only=True)
    assert raw["rollout"]["row"][0] == 3  # the tensors kept
