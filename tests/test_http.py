"""The HTTP endpoint for real: free ports, TLS, basic auth, a busy port, a scrape storm, and promtool."""

from __future__ import annotations

import base64
import contextlib
import math
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error

import pytest
import torch

from batches import make_batch
from grpo_exporter import GRPOMonitor, PortInUseError, hash_password
from grpo_exporter.catalog import CATALOG, MetricType
from grpo_exporter.checks import mask_table
from grpo_exporter.metric_docs import series_per_run
from monitor_helpers import feed, parse_exposition, registry_value, rollout_kwargs, scrape, update_kwargs

BASE = {"group_size": 8, "clip_eps": (0.2, 0.28), "log_ratio_clamp": 20.0, "guard": "off", "close_linger_s": 0.0}


def test_port_zero_serves_on_localhost_with_the_run_label():
    with GRPOMonitor(run="exp-42", port=0, **BASE) as mon:
        feed(mon, 0, seed=0)
        assert mon.port > 0
        url = mon.url
        assert url == f"http://127.0.0.1:{mon.port}/metrics"
        samples = parse_exposition(scrape(url))
        assert samples["grpo_steps_total"] == {(("run", "exp-42"),): 1.0}
    assert mon.url is None
    with pytest.raises(urllib.error.URLError):
        scrape(url)  # closed cleanly


def test_a_busy_port_never_stops_training(caplog):
    """A second job on a node with the default port: training goes on, served on a free port that is said
    (GRPOMonitor.port, a warning naming both ports) and counted; strict mode raises the clear error instead."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with GRPOMonitor(run="r", port=port, **BASE) as mon:
            assert mon.port not in (None, port)
            served = mon.port
            mon.observe_rollout(0, rewards=torch.rand(16))
            samples = parse_exposition(scrape(mon.url))
            assert samples["grpo_exporter_errors_total"][(("run", "r"), ("stage", "scrape"))] == 1.0
        line = next(r.getMessage() for r in caplog.records if "already in use" in r.getMessage())
        assert f"port {port} on 127.0.0.1 is already in use" in line
        assert f"serving on the free port {served} instead" in line
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            GRPOMonitor(run="r", port=port, strict=True, **BASE)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is required (installed by scripts/setup.sh)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls(certificate):
    cert, key = certificate
    with GRPOMonitor(run="tls", port=0, tls_cert=cert, tls_key=key, **BASE) as mon:
        assert mon.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        assert "grpo_build_info" in scrape(mon.url, context=context)
        with pytest.raises(urllib.error.URLError):
            scrape(mon.url, context=ssl.create_default_context())  # an untrusted certificate is refused
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            scrape(mon.url.replace("https://", "http://"))


def test_basic_auth():
    def header(user: str, password: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    with GRPOMonitor(
        run="auth", port=0, basic_auth_user="prom", basic_auth_password_hash=hash_password("s3cret"), **BASE
    ) as mon:
        with pytest.raises(urllib.error.HTTPError) as err:
            scrape(mon.url)
        assert err.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            scrape(mon.url, headers=header("prom", "wrong"))
        for _ in range(3):
            assert "grpo_build_info" in scrape(mon.url, headers=header("prom", "s3cret"))


def test_scrape_storm_during_observe():
    """Four threads scrape in a loop while training observes 12 steps: every scrape succeeds and is
    well-formed, no error is counted, and every step is published."""
    with GRPOMonitor(run="storm", port=0, **BASE) as mon:
        stop = threading.Event()
        bodies: list[str] = []
        failures: list[BaseException] = []

        def scraper() -> None:
            while not stop.is_set():
                try:
                    bodies.append(scrape(mon.url))
                except BaseException as exc:
                    failures.append(exc)
                stop.wait(0.005)

        threads = [threading.Thread(target=scraper) for _ in range(4)]
        for t in threads:
            t.start()
        for step in range(12):
            feed(mon, step, seed=step % 4)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        assert not failures
        assert len(bodies) > 12
        for body in bodies[:: max(1, len(bodies) // 10)]:
            assert "grpo_build_info" in parse_exposition(body)
        assert registry_value(mon, "grpo_steps_total") == 12
        assert not [k for k in mon.metrics() if k.startswith("grpo_exporter_errors_total")]


def full_exposition(tmp_path) -> tuple[GRPOMonitor, str]:
    """A monitor where every catalogue metric has at least one sample."""
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text('grpo_engine_logprob_gap_mean_nats: 0.0004\ngrpo_pass_at_k_ratio{k="8"}: 0.61\n')
    mon = GRPOMonitor(run="full", port=0, reference_baseline=str(baseline), max_reward_components=2,
                      max_pending_micro_steps=1, gap_baseline_steps=1, anchor_steps=1, rollout_correction_cap=1.002,
                      rollout_logprob_nan="unscored", correctness_component="correctness", kl_coef=0.04,
                      recorder_dir=tmp_path / "incidents", compile_step="auto", moe_experts=8,
                      **BASE)  # small steps: eager
    model = torch.nn.Linear(4, 3)
    for step in range(3):
        x = make_batch(step).inputs()
        rollout = rollout_kwargs(x)
        if step == 0:  # a NaN reward: the flight recorder writes an incident once step 1 ends
            rollout["rewards"] = rollout["rewards"].clone().index_fill_(0, torch.tensor([2]), float("nan"))
        rollout["tool_mask"] = torch.zeros_like(rollout["loss_mask"])  # a multi-turn layout with no tool span
        # a third component, over max_reward_components: dropped, counted
        rollout["reward_components"] = {**rollout["reward_components"], "style": rollout["rewards"]}
        experts = torch.randint(0, 8, (*rollout["loss_mask"].shape, 3, 2),
                                generator=torch.Generator().manual_seed(step))
        rollout |= {"routed_experts": experts, "rollout_routed_experts": experts.roll(1, dims=0),
                    "routing_replay": False}  # an MoE model
        mon.observe_rollout(step, **rollout, prompt_ids=torch.arange(48) // 8, tool_calls=9, tool_failures=1,
                            aborted_completions=1, dropped_stale_total=step + 1, generated_groups=9,
                            filtered_all_correct_groups=2, filtered_all_incorrect_groups=1)
        mon.observe_update(step, **update_kwargs(x), policy_version=step + 1, rollout_policy_version=step,
                           tool_mask=rollout["tool_mask"])  # the audit runs where the lengths meet the mask
        if step == 0:
            mon.observe_update(step, **update_kwargs(x))  # over max_pending_micro_steps: dropped, counted
        model(torch.randn(5, 4)).square().sum().backward()
        mon.clip_grad_norm_(model.parameters(), 0.5)
        mon.observe_retrieval(step, torch.randn(48, 6), torch.arange(48) // 8)
        mon.observe_regression(step, torch.rand(64) < 0.9)
    mon.observe_update(3, logprobs=x.logprobs[:, :3], old_logprobs=x.old_logprobs)  # counted error
    mon.flush()
    mon.publish_check(mask_table([1, 2], [1, 1], [0, 1], ["prompt", "completion"]))
    mon.wait_for_workers()
    return mon, scrape(mon.url)


def test_every_catalogue_metric_is_exposed_and_promtool_finds_nothing(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package prometheus, installed by scripts/setup.sh)"
    mon, text = full_exposition(tmp_path)
    try:
        samples = parse_exposition(text)
        names = set(samples)
        grpo_series = sum(len(v) for k, v in samples.items() if k.startswith("grpo_"))
        assert grpo_series <= sum(series_per_run(mon.config).values())  # the bound stated in docs/scale.md
        for m in CATALOG:
            wanted = {MetricType.SUMMARY: m.name + "_count", MetricType.HISTOGRAM: m.name + "_bucket"}
            assert wanted.get(m.type, m.name) in names, m.name
        done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == "", done.stdout
        assert done.stderr.strip() == "", done.stderr
    finally:
        mon.close()


def test_non_rank_zero_and_portless_monitors_serve_nothing():
    with GRPOMonitor(run="quiet", port=None, **BASE) as mon:
        assert mon.port is None
        assert mon.url is None
        x = make_batch(0).inputs()
        mon.observe_rollout(0, rewards=x.rewards)
        assert registry_value(mon, "grpo_completions_total") == 48


# ---- a hostile client -----------------------------------------------------------------------------------


def test_a_silent_tls_client_blocks_no_scrape_and_close_returns(certificate):
    """A TCP client that connects to the TLS port and sends nothing: scrapes keep answering, and close()
    returns within 2 s while that client is still connected."""
    cert, key = certificate
    mon = GRPOMonitor(run="tls-idle", port=0, tls_cert=cert, tls_key=key, **BASE)
    context = ssl.create_default_context(cafile=str(cert))
    silent = [socket.create_connection(("127.0.0.1", mon.port)) for _ in range(3)]
    try:
        for _ in range(5):
            assert "grpo_build_info" in scrape(mon.url, context=context)
        start = time.monotonic()
        mon.close()
        assert time.monotonic() - start < 2.0
    finally:
        for s in silent:
            s.close()


def test_idle_plain_connections_time_out_and_many_scrapers_are_served():
    from grpo_exporter.serving.server import IDLE_TIMEOUT_S, WORKERS

    with GRPOMonitor(run="idle", port=0, **BASE) as mon:
        idle = [socket.create_connection(("127.0.0.1", mon.port)) for _ in range(WORKERS)]
        try:
            time.sleep(IDLE_TIMEOUT_S + 1.0)  # every worker held by an idle client has let it go
            assert "grpo_build_info" in scrape(mon.url)
            assert all(s.recv(1) == b"" for s in idle)  # closed by the server
        finally:
            for s in idle:
                s.close()
        latencies: list[float] = []

        def scraper() -> None:
            for _ in range(4):
                t = time.monotonic()
                try:
                    scrape(mon.url)
                    latencies.append(time.monotonic() - t)
                except OSError:
                    latencies.append(math.inf)  # dropped while every worker was busy: retried next interval

        threads = [threading.Thread(target=scraper) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        served = sorted(x for x in latencies if math.isfinite(x))
        assert len(served) >= 100  # most of the 200 scrapes were answered
        assert served[len(served) // 2] < 0.5  # median latency


def _trickle(port: int, stop: threading.Event, lifetimes: list[float], every_s: float) -> None:
    """A slowloris client without credentials: one byte of a request every ``every_s`` (under the per-read
    timeout), reconnecting at once whenever the server lets it go."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: y\r\n" * 1000
    while not stop.is_set():
        start = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.settimeout(every_s)
                for byte in request:
                    s.sendall(bytes([byte]))
                    with contextlib.suppress(TimeoutError):
                        if s.recv(1) == b"":  # let go by the server: seen at once, not at the next byte
                            break
                    if stop.is_set():
                        return
        except OSError:
            pass
        lifetimes.append(time.monotonic() - start)


@pytest.mark.parametrize("tls", [False, True])
def test_a_slowloris_trickle_blocks_no_scrape(certificate, tls):
    """WORKERS reconnecting tricklers, one byte every 3 s (each read within the 5 s idle timeout), used to hold
    every worker for ever, so every scrape was dropped, plain and TLS. A new connection now evicts the oldest one
    still sending its request after EVICT_AFTER_S: a scraper scraping every 0.5 s is answered, and no trickler
    keeps a worker past REQUEST_DEADLINE_S."""
    from grpo_exporter.serving.server import REQUEST_DEADLINE_S, WORKERS

    cert, key = certificate
    settings = {"tls_cert": cert, "tls_key": key} if tls else {}
    context = ssl.create_default_context(cafile=str(cert)) if tls else None
    with GRPOMonitor(run="slow", port=0, **settings, **BASE) as mon:
        stop, lifetimes = threading.Event(), []
        tricklers = [threading.Thread(target=_trickle, args=(mon.port, stop, lifetimes, 3.0)) for _ in range(WORKERS)]
        for t in tricklers:
            t.start()
        time.sleep(1.5)  # every worker held by a trickler
        answered = 0
        try:
            for _ in range(12):
                start = time.monotonic()
                with contextlib.suppress(OSError):
                    answered += "grpo_build_info" in scrape(mon.url, context=context)
                time.sleep(max(0.0, 0.5 - (time.monotonic() - start)))
        finally:
            stop.set()
            for t in tricklers:
                t.join(timeout=10)
    assert answered >= 10
    assert lifetimes
    assert max(lifetimes) <= REQUEST_DEADLINE_S + 1.0


def test_a_request_past_its_deadline_is_cut(monkeypatch):
    """One trickler alone (nothing to evict it): one byte a second keeps every read within the idle timeout,
    and the connection used to live for as long as it trickled; it ends at REQUEST_DEADLINE_S."""
    from grpo_exporter.serving import server

    monkeypatch.setattr(server, "REQUEST_DEADLINE_S", 2.0)
    with GRPOMonitor(run="deadline", port=0, **BASE) as mon:
        stop, lifetimes = threading.Event(), []
        trickler = threading.Thread(target=_trickle, args=(mon.port, stop, lifetimes, 1.0))
        trickler.start()
        time.sleep(4.5)
        stop.set()
        trickler.join(timeout=10)
    assert 2.0 <= lifetimes[0] <= 3.5


def test_ipv6_host():
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6 loopback")
    with GRPOMonitor(run="v6", port=0, host="::1", **BASE) as mon:
        assert mon.url == f"http://[::1]:{mon.port}/metrics"
        assert "grpo_build_info" in scrape(mon.url)


def test_a_malformed_password_hash_fails_at_configuration():
    for bad in ("pbkdf2_sha256$oops", "pbkdf2_sha256$x$salt$" + "0" * 64, "pbkdf2_sha256$1000$salt$nothex"):
        with pytest.raises(ValueError, match="basic_auth_password_hash"):
            GRPOMonitor(run="r", port=0, basic_auth_user="prom", basic_auth_password_hash=bad, **BASE)


def _auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_auth_unknown_user_costs_a_hash_and_verified_credentials_are_cached():
    from grpo_exporter.serving.server import BasicAuth

    auth = BasicAuth(lambda e, s: [b""], "prom", hash_password("s3cret", iterations=100_000))

    def timed(header: str) -> float:
        auth.failures.tokens = 5.0  # isolate the hash cost from the failure throttle
        start = time.perf_counter()
        auth.check(header)
        return time.perf_counter() - start

    known_wrong = min(timed(_auth("prom", "wrong")) for _ in range(3))
    unknown = min(timed(_auth("nobody", "wrong")) for _ in range(3))
    assert unknown > 0.5 * known_wrong  # an unknown user pays the same slow hash
    assert auth.check(_auth("prom", "s3cret")) == "ok"
    assert timed(_auth("prom", "s3cret")) < 0.1 * known_wrong  # cached after one verification


def test_a_flood_of_wrong_passwords_costs_a_few_slow_hashes_a_second(monkeypatch):
    """50 client threads (another process) send wrong passwords as fast as they can for 3 s. What that costs
    the training process is counted, not timed (a timing ratio is a benchmark's job, and flaky on 2 cores):
    the slow PBKDF2 hashes (~50 ms each at 200,000 iterations) stay within the failed-attempt bucket's burst
    plus its refill over the flood, and the accept loop's work within its shedding bounds, while the flood
    sent many times more requests than were hashed. Once it stops, the verified scraper is answered at once."""
    from grpo_exporter.serving import server

    hashes, accepts = [0], [0]
    verify, process = server.verify_password, server._Server.process_request

    def counted_verify(password: str, password_hash: str) -> bool:
        hashes[0] += 1
        return verify(password, password_hash)

    def counted_process(self: server._Server, request: object, address: object) -> None:
        accepts[0] += 1
        process(self, request, address)

    monkeypatch.setattr(server, "verify_password", counted_verify)
    monkeypatch.setattr(server._Server, "process_request", counted_process)
    with GRPOMonitor(run="flood", port=0, basic_auth_user="prom", basic_auth_password_hash=hash_password("s3cret"),
                     **BASE) as mon:
        legit = {"Authorization": _auth("prom", "s3cret")}
        assert "grpo_build_info" in scrape(mon.url, headers=legit)  # Prometheus, verified once: one hash
        assert hashes[0] == 1
        start = time.monotonic()
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, mon.url], stdout=subprocess.PIPE, text=True)
        try:
            out, _ = flood.communicate(timeout=30)
        finally:
            flood.kill()
        elapsed = time.monotonic() - start
        during, accepted = hashes[0] - 1, accepts[0] - 1
        answered = int(out.split()[-1])  # 401 and 429 answers the flood received
        # under the flood scrapes may be refused (the connection budget protects training, not Prometheus);
        # once it stops, the verified scraper is answered at once, from the cache (no new hash)
        assert _served_within(mon.url, legit, seconds=3.0)
    print(f"{elapsed:.1f} s of flood: {answered} answers, {accepted} connections accepted, {during} slow hashes")
    assert during <= server.FAILED_AUTH_BURST + server.FAILED_AUTH_PER_S * elapsed + 1
    assert answered > 10 * during  # without the throttle every answer would have been a slow hash
    # the accept loop: each dropped connection costs it a SHED_PAUSE_S rest (<= 200 a second); the others were
    # answered (the flood's answers, the legitimate scrapes)
    assert accepted <= elapsed / server.SHED_PAUSE_S + answered + 2 * server.WORKERS
    assert hashes[0] == 1 + during  # the scrapes after the flood were answered from the cache


def _served_within(url: str, headers: dict[str, str], seconds: float) -> bool:
    """A scraper that retries is answered within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            return "grpo_build_info" in scrape(url, headers=headers)
        except OSError:
            time.sleep(0.2)
    return False


_FLOOD = """
import base64, sys, threading, time, urllib.error, urllib.request
url = sys.argv[1]
header = {"Authorization": "Basic " + base64.b64encode(b"prom:wrong").decode()}
answered = [0]
def hammer():
    end = time.monotonic() + 3
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(urllib.request.Request(url, headers=header), timeout=5).read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 429):
                answered[0] += 1
        except Exception:
            time.sleep(0.01)
threads = [threading.Thread(target=hammer, daemon=True) for _ in range(50)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(answered[0])
"""


def test_close_marks_the_run_finished_and_waits_for_one_scrape_to_see_it():
    """A normal end must reach Prometheus (grpo_run_finished 1), or the vanished target pages like a crash."""
    mon = GRPOMonitor(run="ending", port=0, **(BASE | {"close_linger_s": 10.0}))
    assert parse_exposition(scrape(mon.url))["grpo_run_finished"] == {(("run", "ending"),): 0.0}
    closer = threading.Thread(target=mon.close)
    start = time.monotonic()
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()  # lingering until a scrape has seen the end
    assert parse_exposition(scrape(mon.url))["grpo_run_finished"] == {(("run", "ending"),): 1.0}
    closer.join(timeout=5)
    assert not closer.is_alive()
    assert time.monotonic() - start < 2.0
    quiet = GRPOMonitor(run="never-scraped", port=0, **(BASE | {"close_linger_s": 10.0}))
    start = time.monotonic()
    quiet.close()  # nothing ever scraped it: no scraper to wait for
    assert time.monotonic() - start < 1.0
