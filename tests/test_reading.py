"""The reading set (issue 60; seed: 读原文在读曲线之前, read the raw rollouts before the curves, and for a suspected
reward hack 人工阅读 reward 最高和增长最快的样本, read the highest-reward and fastest-rising samples by hand): the picks
on the device, the windows kept as the run goes (bounded), the text kept only when asked, the document served on
the metrics port (auth, escaping, bad queries), written beside an incident and in the recorder directory, and
printed by ``grpo-exporter read``. The demo's pages bringing the right rollouts are checked end to end in
test_e2e.py."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from grpo_exporter import GRPOMonitor
from grpo_exporter.cli import main
from grpo_exporter.functional import diversity
from grpo_exporter.functional import rows_to_read as pick
from grpo_exporter.functional.groups import contiguous_groups
from grpo_exporter.inputs import StepInputs
from grpo_exporter.mixin.alerts import alerts
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.recorder.reading_doc import BY_ALERT, BY_LAYER, KINDS, escaped, render_text
from grpo_exporter.recorder.reading_set import COMPLETION_CHARS, PROMPT_CHARS, ReadingSet
from grpo_exporter.serving.settings import hash_password

G = 4


def _hacked_batch(groups: int = 4, hack_group: int = 2) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
    """Groups of 4; in ``hack_group`` two answers open with the paid symbol: format 1, correctness 0, reward 2 (the
    demo's hack pays twice a correct answer); elsewhere one correct answer per group (reward 1)."""
    n = groups * G
    correct = torch.zeros(n)
    correct[torch.arange(groups) * G] = 1.0
    fmt = torch.zeros(n)
    fmt[hack_group * G + 1: hack_group * G + 3] = 1.0
    return {"rewards": correct + 2 * fmt, "reward_components": {"correctness": correct, "format": fmt},
            "correct": correct.bool()}


def test_the_reward_picks_show_the_hack_one_row_per_group():
    b = _hacked_batch()
    groups = contiguous_groups(16, G)
    top = pick.highest_reward(b["rewards"], groups, 3)
    assert top.rows.tolist()[0] in (9, 10)
    assert top.score.tolist() == [2.0, 1.0, 1.0]
    assert len({r // G for r in top.rows.tolist()}) == 3  # three prompts, not one prompt's siblings
    rising = pick.rising_component(b["reward_components"]["format"], groups, 3)
    assert rising.rows.tolist()[0] in (9, 10)
    assert rising.score.tolist()[0] == pytest.approx(0.5)
    assert rising.score.tolist()[1:] == [float("-inf")] * 2  # no other group has a row above its mean


def test_repeated_groups_count_copies_token_for_token():
    ids = torch.tensor([[5, 6, 3], [5, 6, 3], [5, 6, 3], [7, 8, 3],  # 3 copies
                        [5, 6, 3], [5, 7, 3], [9, 9, 3], [4, 4, 3],  # all distinct (one shares group 0's text)
                        [1, 2, 3], [1, 2, 3], [1, 2, 0], [2, 1, 3]])  # 2 copies (row 10 is shorter: another answer)
    positions = torch.ones_like(ids, dtype=torch.bool)
    positions[10, 2] = False
    groups = contiguous_groups(12, G)
    copies = diversity.copies_in_group(ids, positions, groups)
    assert copies.tolist() == [3, 3, 3, 1, 1, 1, 1, 1, 2, 2, 1, 1]
    top = pick.repeated_groups(copies, groups, 3)
    assert top.rows.tolist()[:2] == [0, 8]
    assert top.detail.tolist()[:2] == [3.0, 2.0]
    assert top.score.tolist()[2] == float("-inf")  # a group of distinct answers is no repeat


def test_lowest_entropy_groups_rank_groups_by_their_mean():
    entropy = torch.tensor([[0.5, 0.5], [0.1, 0.1], [0.3, 0.3], [0.3, 0.3],  # group mean 0.3, lowest row 1
                            [0.2, 0.2], [0.2, 0.2], [0.2, 0.2], [0.2, 0.2],  # group mean 0.2
                            [0.01, 9.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]).double()  # row 8's mask hides the 9
    tokens = torch.ones(12, 2, dtype=torch.bool)
    tokens[8, 1] = False
    rows = pick.row_entropy(entropy, tokens)
    top = pick.lowest_entropy_groups(rows, contiguous_groups(12, G), 2)
    assert top.rows.tolist() == [4, 1]
    assert top.detail.tolist() == pytest.approx([0.2, 0.3])


def test_control_rows_vary_by_step_and_leave_the_training_rng_alone():
    state = torch.get_rng_state()
    a, b = pick.control_rows(64, 4, 7, torch.device("cpu")), pick.control_rows(64, 4, 8, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    assert a.rows.tolist() != b.rows.tolist()
    assert all(0 <= r < 64 for r in a.rows.tolist() + b.rows.tolist())
    assert pick.control_rows(64, 4, 7, torch.device("cpu")).rows.tolist() == a.rows.tolist()


def _rollout(step: int, n: int = 16, t: int = 6, long_text: bool = False) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    b = _hacked_batch(n // G)
    ids = torch.randint(4, 12, (n, t), generator=gen)
    lengths = torch.randint(2, t + 1, (n,), generator=gen)
    return {**b, "truncated": lengths == t, "completion_ids": ids, "completion_lengths": lengths,
            "rollout_logprobs": -torch.rand(n, t, generator=gen), "prompt_tokens": ids[:, :3] if not long_text
            else torch.randint(4, 12, (n, 1000), generator=gen)}


def _reading_set(text: bool = True, **kw: object) -> ReadingSet:
    errors: list[BaseException] = []
    reading = ReadingSet(run="r", rank=0, world=1, rows=kw.pop("rows", 3), window_steps=kw.pop("window_steps", 5),
                         windows=kw.pop("windows", 2), text=text, group_size=G, decode=kw.pop("decode", None),
                         on_error=errors.append)
    reading.errors = errors  # type: ignore[attr-defined]
    return reading


def _observe(reading: ReadingSet, step: int, **kw: object) -> None:
    """One rollout; the step's metrics say the format component's mean rises (0.01 a step), correctness holds."""
    fields = _rollout(step, **kw)  # type: ignore[arg-type]
    tokens = fields.pop("prompt_tokens")
    metrics = {'grpo_reward_mean{component="format"}': 0.01 * step, 'grpo_reward_mean{component="correctness"}': 0.25}
    reading.observe(step, StepInputs(**fields), metrics, {"prompt_tokens": tokens})  # type: ignore[arg-type]


def test_memory_stays_bounded_over_10000_steps():
    """10,000 rollouts with prompts of 1,000 tokens and a decode: at most windows x kinds x rows rows are held,
    each text within its bound (the loop waits for the reading thread every few steps: a training step is slower
    than these picks; a thread left behind is the next test's)."""
    reading = _reading_set(decode=lambda ids: "x" * (5 * len(ids)), window_steps=50, windows=3, rows=4)
    try:
        for step in range(10_000):
            _observe(reading, step, long_text=True)
            if step % 4 == 3:
                reading.wait(30)
            if step % 500 == 499:
                reading.wait(30)
                held = reading.held_rows()
                assert 0 < held <= 3 * len(KINDS) * 4, (step, held)
        reading.wait(30)
        doc = reading.document()
    finally:
        reading.close()
    assert reading.errors == []
    assert reading.skipped == 0
    assert [w["first_step"] for w in doc["windows"]] == [9950, 9900, 9850]
    texts = [r["prompt"] for w in doc["windows"] for rows in w["rows"].values() for r in rows]
    assert texts
    assert all(len(t) <= PROMPT_CHARS + 60 for t in texts)
    assert all("left out" in t for t in texts)
    assert len(json.dumps(doc)) < 3 * len(KINDS) * 4 * (PROMPT_CHARS + COMPLETION_CHARS + 1000)


def test_a_reading_thread_left_behind_skips_steps_and_holds_a_bounded_queue():
    """A decode that blocks: the training thread never waits; at most MAX_PENDING steps' picks are queued, the
    rest are skipped (said once), and the set catches up once the decode returns."""
    from grpo_exporter.recorder.reading_set import MAX_PENDING

    gate = threading.Event()
    reading = _reading_set(decode=lambda ids: (gate.wait(), "t")[1])
    try:
        for step in range(40):
            _observe(reading, step)
        held = reading.document()["windows"]  # a reader never waits for the decode (it holds no lock)
        assert [rows for w in held for rows in w["rows"].values() if rows] == []  # a row is kept once decoded
        assert reading.skipped >= 40 - MAX_PENDING - 1
        assert len(reading._pending) <= MAX_PENDING
        gate.set()
        reading.wait(10)
        assert reading.held_rows() > 0
        assert reading.errors == []
    finally:
        gate.set()
        reading.close()


def test_without_reading_text_no_prompt_completion_or_token_id_is_kept():
    reading = _reading_set(text=False)
    try:
        for step in range(12):
            _observe(reading, step)
        reading.wait(10)
        doc = reading.document()
    finally:
        reading.close()
    rows = [r for w in doc["windows"] for kept in w["rows"].values() for r in kept]
    assert rows
    assert not doc["text_kept"]
    assert all("prompt" not in r and "completion" not in r for r in rows)
    assert {"reward", "reward_components", "correct", "truncated", "length", "why"} <= set(rows[0])
    assert "text not kept" in render_text(doc)


def test_the_window_keeps_each_kinds_best_and_says_why():
    reading = _reading_set(rows=2, window_steps=10, decode=lambda ids: "".join(chr(ord("a") + i - 4) for i in ids))
    try:
        for step in range(10):
            _observe(reading, step)
            reading.wait(10)  # no step left out: the thread keeps up (8 steps behind, a step is skipped)
        window = reading.document()["windows"][0]
    finally:
        reading.close()
    hack = window["rows"]["highest_reward"][0]
    assert hack["reward"] == 2.0
    assert hack["reward_components"] == {"correctness": 0.0, "format": 1.0}
    assert hack["step"] == 9  # ties go to the newest step
    rising = window["rows"]["rising_component"][0]
    assert rising["reward_components"]["format"] == 1.0
    assert rising["why"].startswith("format +0.5 above")
    assert all(r["truncated"] for r in window["rows"]["truncated"])
    assert all(len(r["completion"]) == r["length"] for r in window["rows"]["control"])
    assert window["rows"]["lowest_entropy_groups"][0]["why"].endswith("nats (the sampled tokens' -log p)")


def test_the_steps_host_reads_do_not_grow(monkeypatch):
    """observe_rollout with the reading set on makes the same host reads on the training thread as with it off:
    the picks and the rows stay on the device; the reading thread takes them."""
    from batches import make_batch
    from monitor_helpers import rollout_kwargs

    training = threading.get_ident()
    calls: list[str] = []
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, __name=name, __original=original, **kwargs):
            if threading.get_ident() == training:
                calls.append(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    x = make_batch(0).healthy_inputs()
    counts = []
    for rows in (0, 4, 0):  # the first monitor of the process builds cached constants: compare the next two
        with GRPOMonitor(run=f"r{rows}", group_size=8, port=None, guard="off", edit_distance_groups=0,
                         reading_rows=rows, reading_text=True, decode=str) as mon:
            for step in range(3):
                calls.clear()
                mon.observe_rollout(step, prompt_tokens=x.completion_ids, **rollout_kwargs(x))
                counts.append(list(calls))
            mon.wait_for_workers()
            if rows:
                assert mon.metrics()
                assert sum(len(v) for v in _doc(mon)["windows"][0]["rows"].values()) > 0
    assert counts[3:6] == counts[6:], counts


def _doc(mon: GRPOMonitor) -> dict:
    return mon._stages.reading.document()  # type: ignore[union-attr]


def _get(url: str, user: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


HOSTILE = "<script>alert(1)</script>\x1b[2J\x1b]8;;http://evil\x07\r\u202eevil"


def test_served_behind_auth_escaped_and_bounded(monkeypatch):
    """/reading answers behind the same basic auth as /metrics; a completion holding HTML and terminal escapes is
    served escaped (JSON in ASCII, the text form without control characters, nosniff); a bad query is a 400
    naming the field."""
    with GRPOMonitor(run="served", group_size=G, port=0, guard="off", edit_distance_groups=0, close_linger_s=0,
                     basic_auth_user="prom", basic_auth_password_hash=hash_password("s3cret"), reading_text=True,
                     reading_window_steps=5, decode=lambda ids: HOSTILE) as mon:
        for step in range(6):
            fields = _rollout(step)
            mon.observe_rollout(step, **fields)  # type: ignore[arg-type]
        mon.wait_for_workers()
        base = (mon.url or "").replace("/metrics", "/reading")
        assert _get(base)[0] == 401
        status, headers, body = _get(f"{base}?alert=GRPORewardHackSuspected", "prom:s3cret")
        assert status == 200
        assert headers["Content-Type"] == "application/json"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert body.isascii()
        doc = json.loads(body)
        assert list(doc["windows"][0]["rows"]) == list(BY_ALERT["GRPORewardHackSuspected"])
        assert doc["windows"][0]["rows"]["highest_reward"][0]["completion"] == HOSTILE
        status, headers, text = _get(f"{base}?layer=4-diversity&format=text&windows=1", "prom:s3cret")
        assert status == 200
        assert headers["Content-Type"].startswith("text/plain")
        assert b"\x1b" not in text
        assert b"\r" not in text
        assert "\u202e" not in text.decode()
        assert "\\x1b[2J" in text.decode()
        assert "-- repeated_groups" in text.decode()
        for query, field in (("alert=NoSuchAlert", "alert"), ("layer=9-x", "layer"), ("format=html", "format"),
                             ("windows=0", "windows"), ("alert=" + "A" * 300, "alert")):
            status, _, message = _get(f"{base}?{query}", "prom:s3cret")
            assert (status, message.decode().split(":")[0]) == (400, field), (query, message)
            assert message.decode().startswith(f"{field}: expected"), message
        scrape = urllib.request.Request(mon.url or "", headers={
            "Authorization": "Basic " + base64.b64encode(b"prom:s3cret").decode()})
        assert 'grpo_reading_rollouts{run="served",scheme="http"}' in urllib.request.urlopen(scrape).read().decode()


def test_escaped_keeps_newlines_and_shows_controls():
    assert escaped("a\nb\tc\x1b[0m\x00\u2066") == "a\nb\tc\\x1b[0m\\x00\\u2066"


def test_the_recorder_directory_and_incidents_hold_the_reading_set(tmp_path, capsys):
    """With recorder_dir, the set is written there (reading-<run>-r0.json, owner-only) when a window closes and at
    close, and beside each incident; ``grpo-exporter read`` prints each source the same way."""
    root = tmp_path / "incidents"
    settings = {"guard": "off", "edit_distance_groups": 0, "reading_text": True, "reading_window_steps": 4}
    with GRPOMonitor(run="rec", group_size=G, port=None, recorder_dir=root,
                     decode=lambda ids: "ans" + "".join(map(str, ids)), **settings) as mon:
        for step in range(10):
            fields = _rollout(step)
            if step == 6:  # a NaN reward: the flight recorder's nonfinite trigger opens an incident
                fields["rewards"] = fields["rewards"].clone()  # type: ignore[union-attr]
                fields["rewards"][0] = float("nan")  # type: ignore[index]
            mon.observe_rollout(step, **fields)  # type: ignore[arg-type]
            mon.wait_for_workers()  # every step read (a thread 8 steps behind skips one)
    written = root / "reading-rec-r0.json"
    assert written.stat().st_mode & 0o777 == 0o600
    assert json.loads(written.read_bytes())["windows"][0]["first_step"] == 8
    incident = next(root.glob("incident-*"))
    assert (incident / "reading.json").is_file()
    for source in (str(root), str(written), str(incident)):
        assert main(["read", source, "--alert", "GRPOTruncationSurge", "--rows", "1"]) == 0
        out = capsys.readouterr().out
        assert "-- truncated" in out
        assert "completion: ans" in out
        assert "-- highest_reward" not in out
    assert main(["read", str(tmp_path / "nothing")]) == 2
    assert "expected a readable reading set" in capsys.readouterr().err


def test_cli_reads_the_link_a_page_gives(capsys):
    with GRPOMonitor(run="link", group_size=G, port=0, guard="off", edit_distance_groups=0, close_linger_s=0,
                     reading_text=True, decode=lambda ids: "ok") as mon:
        for step in range(3):
            mon.observe_rollout(step, **_rollout(step))  # type: ignore[arg-type]
        mon.wait_for_workers()
        link = (mon.url or "").replace("/metrics", "/reading?alert=GRPOEntropyCollapse&layer=4-diversity&format=text")
        assert main(["read", link]) == 0
        out = capsys.readouterr().out
        assert "for GRPOEntropyCollapse" in out
        assert "-- lowest_entropy_groups" in out
        assert "-- truncated" not in out
        assert main(["read", link, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["run"] == "link"


def test_every_page_of_layers_1_to_4_links_its_rollouts():
    """Every alert of ours but the liveness ones and the heartbeat ends its description with the link (the
    exporter's /reading for that alert and layer); every alert named in the table exists."""
    c = MixinConfig()
    names = {a.name: str(a.layer.value if hasattr(a.layer, "value") else a.layer) for a in alerts(c)}
    assert set(BY_ALERT) <= set(names)
    for rule in (a.rule(c) for a in alerts(c)):
        layer = rule["labels"]["layer"]
        linked = "/reading?alert=" + rule["alert"] + "&layer=" + layer in rule["annotations"]["description"]
        assert linked == (layer in BY_LAYER and rule["labels"]["severity"] != "none"), rule["alert"]
        assert layer in BY_LAYER or layer == "0-liveness"


def test_a_closing_window_is_written_whole_even_when_only_one_is_kept(tmp_path):
    """reading_windows=1: the window a new step closes is written before the new one replaces it."""
    reading = _reading_set(windows=1, window_steps=4)
    reading.directory = tmp_path
    try:
        for step in range(5):
            _observe(reading, step)
            reading.wait(10)
        written = json.loads((tmp_path / "reading-r-r0.json").read_bytes())
        assert [(w["first_step"], w["last_step"]) for w in written["windows"]] == [(0, 3)]
        assert max(r["step"] for rows in written["windows"][0]["rows"].values() for r in rows) == 3
    finally:
        reading.close()
    assert json.loads((tmp_path / "reading-r-r0.json").read_bytes())["windows"][0]["first_step"] == 4


def test_prompt_ids_not_one_per_row_are_left_out_not_indexed(monkeypatch):
    """prompt_ids of another length (one per prompt) or device never reach index_select (out of range there is a
    device-side assert on CUDA): the rows are kept without them."""
    reading = _reading_set()
    try:
        fields = _rollout(0)
        tokens = fields.pop("prompt_tokens")
        reading.observe(0, StepInputs(**fields), {}, {"prompt_ids": torch.arange(4), "prompt_tokens": tokens[:3]})
        reading.wait(10)
        rows = [r for w in reading.document()["windows"] for kept in w["rows"].values() for r in kept]
    finally:
        reading.close()
    assert rows
    assert all("prompt_id" not in r and "prompt" not in r and "completion" in r for r in rows)
    assert reading.errors == []  # type: ignore[attr-defined]


def test_a_batch_the_step_rejects_is_counted_once():
    """6 completions in groups of 4 (no group_ids): the rollout's own step counts the input error; the reading set
    leaves the batch out without counting it again."""
    fields = {k: v[:6] if isinstance(v, torch.Tensor) else {c: t[:6] for c, t in v.items()}  # type: ignore[union-attr]
              for k, v in _rollout(0).items()}
    with GRPOMonitor(run="odd", group_size=G, port=None, guard="off", edit_distance_groups=0) as mon:
        mon.observe_rollout(0, **fields)  # type: ignore[arg-type]
        mon.wait_for_workers()
        errors = {k: v for k, v in mon.metrics().items() if k.startswith("grpo_exporter_errors_total") and v}
    assert errors == {'grpo_exporter_errors_total{stage="rollout"}': 1.0}
