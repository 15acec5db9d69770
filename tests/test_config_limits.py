"""Nothing a user types can stall, poison or silently falsify a run (issue 54): the environment is read by each
field's type and a stray variable is no error; every float is finite and every duration and count bounded; a
configuration file is read within limits and its errors are short and name the setting; the host is checked
at construction and an address that cannot be served is an error naming it."""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from grpo_exporter import GRPOMonitor
from grpo_exporter.config_files import ConfigFileError, load_yaml_mapping
from grpo_exporter.integrations import ALLOW_UNTESTED_ENV
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.runtime.config_environment import OTHER_VARIABLES
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.serving.server import AddressUnavailableError
from grpo_exporter.settings import number_type

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = {"run": "r", "group_size": 4}
#: nine levels of nine aliases: 9^9 (387 million) strings once expanded
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def load(env: dict[str, str], **kwargs: Any) -> MonitorConfig:
    return MonitorConfig.load(environ=env, **{**BASE, **kwargs})


# ---- the environment -------------------------------------------------------------------------------------------


def test_the_documented_escape_hatch_and_a_stray_variable_leave_the_monitor_working(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "trl")
    monkeypatch.setenv("GRPO_EXPORTER_NOT_A_SETTING_54", "1")
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"), \
            GRPOMonitor(run="r", group_size=4, port=None, registry=CollectorRegistry()) as mon:
        assert mon.config.run == "r"
    warned = [r.getMessage() for r in caplog.records if "GRPO_EXPORTER_" in r.getMessage()]
    assert any("GRPO_EXPORTER_NOT_A_SETTING_54 is not a grpo-exporter setting" in w for w in warned)
    assert not any(ALLOW_UNTESTED_ENV in w for w in warned)
    assert ALLOW_UNTESTED_ENV in OTHER_VARIABLES


@pytest.mark.parametrize("text", ["42", "true", "exp-1,seed-2", "null", "[1, 2]"])
def test_a_string_setting_takes_the_text_as_typed(text):
    assert MonitorConfig.load(environ={"GRPO_EXPORTER_RUN": text}, group_size=4).run == text


def test_an_unknown_variable_is_logged_once_with_the_nearest_setting(caplog):
    env = {"GRPO_EXPORTER_CLOSE_LINGER_SECS": "0"}
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        assert load(env).close_linger_s == 30.0  # ignored, not fatal
        load(env)
    hints = [r.getMessage() for r in caplog.records if "GRPO_EXPORTER_CLOSE_LINGER_SECS" in r.getMessage()]
    assert len(hints) == 1
    assert "did you mean GRPO_EXPORTER_CLOSE_LINGER_S?" in hints[0]


def test_each_variable_is_parsed_by_its_fields_type(tmp_path):
    cfg = load({"GRPO_EXPORTER_PASS_K": "2, 4", "GRPO_EXPORTER_PORT": "none", "GRPO_EXPORTER_STRICT": "true",
                "GRPO_EXPORTER_KL_COEF": "null", "GRPO_EXPORTER_CLIP_EPS": "0.1,0.3",
                "GRPO_EXPORTER_RECORDER_TRIGGERS": "nonfinite,engine_gap,nonfinite",
                "GRPO_EXPORTER_GAP_QUANTILES": "0.5", "GRPO_EXPORTER_TLS_CERT": ""})
    assert (cfg.pass_k, cfg.port, cfg.strict, cfg.kl_coef) == ((2, 4), None, True, None)
    assert (cfg.clip_eps_low, cfg.clip_eps_high, cfg.gap_quantiles) == (0.1, 0.3, (0.5,))
    assert cfg.recorder_triggers == ("nonfinite", "engine_gap")
    assert cfg.tls_cert is None
    assert load({"GRPO_EXPORTER_PASS_K": "[2, 4]", "GRPO_EXPORTER_PORT": " 0 "}).pass_k == (2, 4)
    baseline = '{"grpo_engine_logprob_gap_mean_nats": 0.001}'
    assert load({"GRPO_EXPORTER_REFERENCE_BASELINE": baseline}).reference_baseline == {
        "grpo_engine_logprob_gap_mean_nats": 0.001}
    file = tmp_path / "baseline.yaml"
    file.write_text("grpo_engine_logprob_gap_mean_nats: 0.002\n")
    assert load({"GRPO_EXPORTER_REFERENCE_BASELINE": str(file)}).reference_baseline == {
        "grpo_engine_logprob_gap_mean_nats": 0.002}


@pytest.mark.parametrize(("variable", "text", "message"), [
    ("GRPO_EXPORTER_PORT", "abc", "GRPO_EXPORTER_PORT: expected an integer 0..65535, or none, got 'abc'"),
    ("GRPO_EXPORTER_PORT", "70000", "GRPO_EXPORTER_PORT: expected an integer 0..65535, or none, got '70000'"),
    ("GRPO_EXPORTER_PORT", "", "GRPO_EXPORTER_PORT: expected an integer 0..65535, or none, got ''"),
    ("GRPO_EXPORTER_CLOSE_LINGER_S", "Infinity", "GRPO_EXPORTER_CLOSE_LINGER_S: expected a finite number 0..3600"),
    ("GRPO_EXPORTER_GUARD", "loud", "GRPO_EXPORTER_GUARD: expected one of 'warn', 'raise', 'off', got 'loud'"),
    ("GRPO_EXPORTER_PASS_K", "[2,", "GRPO_EXPORTER_PASS_K: expected a JSON list .* got '\\[2,' \\(not valid JSON\\)"),
    ("GRPO_EXPORTER_STRICT", "maybe", "GRPO_EXPORTER_STRICT: expected true or false, got 'maybe'"),
    ("GRPO_EXPORTER_RECORDER_TRIGGERS", "nan", "GRPO_EXPORTER_RECORDER_TRIGGERS: .*expected any of"),
    ("GRPO_EXPORTER_REFERENCE_BASELINE", "/no/such.yaml", "GRPO_EXPORTER_REFERENCE_BASELINE: .*missing path"),
])
def test_an_invalid_value_names_its_variable(variable, text, message):
    with pytest.raises(ValidationError, match=message):
        load({variable: text})


def test_every_documented_variable_works_as_documented():
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")]
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in docs)
    settings = {f"GRPO_EXPORTER_{name.upper()}" for name in [*MonitorConfig.model_fields, "clip_eps"]}
    named = set(re.findall(r"GRPO_EXPORTER_[A-Z][A-Z0-9_]*", text))
    assert named - settings - OTHER_VARIABLES == set()
    examples = dict(re.findall(r"(GRPO_EXPORTER_[A-Z_]+)=([\w.,-]+)", text))
    assert examples  # GRPO_EXPORTER_GROUP_SIZE=16, GRPO_EXPORTER_COMPILE_STEP=auto, ...
    for variable, value in examples.items():
        field = variable.removeprefix("GRPO_EXPORTER_").lower()
        cfg = MonitorConfig.load(environ={variable: value}, **{k: v for k, v in BASE.items() if k != field})
        if variable in settings:
            assert str(getattr(cfg, field)).lower() == value.lower()


# ---- bounds -------------------------------------------------------------------------------------------------------


def _number_fields(model: type, kind: type) -> list[str]:
    return [name for name, info in model.model_fields.items() if number_type(info.annotation) is kind]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_every_float_setting_refuses_a_non_finite_value_naming_the_field(bad):
    for name in _number_fields(MonitorConfig, float):
        with pytest.raises(ValidationError, match=rf"(?m)^{name}\n"):
            MonitorConfig(**BASE, **{name: bad})
    for name in _number_fields(MixinConfig, float):
        with pytest.raises(ValidationError, match=rf"(?m)^{name}\n"):
            MixinConfig(**{name: bad})
    for name in ("gap_quantiles", "ratio_quantiles", "length_quantiles", "solve_rate_buckets"):
        with pytest.raises(ValidationError, match=rf"(?m)^{name}\.0\n"):
            MonitorConfig(**BASE, **{name: (bad,)})


def test_every_duration_and_count_has_an_upper_bound_and_refuses_a_bool():
    for name, info in MonitorConfig.model_fields.items():
        kind = number_type(info.annotation)
        if kind is int or name.endswith("_s"):
            assert any(isinstance(m, annotated_types.Le | annotated_types.Lt) for m in info.metadata), name
        if kind is not None:
            with pytest.raises(ValidationError, match=rf"(?m)^{name}\n.*got the bool True"):
                MonitorConfig(**{**BASE, name: True})


def test_an_infinite_linger_is_refused_from_every_source(tmp_path):
    with pytest.raises(ValidationError, match="close_linger_s"):
        MonitorConfig(**BASE, close_linger_s=math.inf)
    with pytest.raises(ValidationError, match="GRPO_EXPORTER_CLOSE_LINGER_S"):
        load({"GRPO_EXPORTER_CLOSE_LINGER_S": "Infinity"})
    file = tmp_path / "grpo.yaml"
    file.write_text("close_linger_s: .inf\n")
    with pytest.raises(ValidationError, match="close_linger_s"):
        MonitorConfig.load(file, environ={}, **BASE)
    for name, big in (("distributed_timeout_s", 1e9), ("recorder_flush_timeout_s", 1e9), ("close_linger_s", 3601)):
        with pytest.raises(ValidationError, match=name):
            MonitorConfig(**BASE, **{name: big})
    with pytest.raises(ValidationError, match="solve_rate_slots"):
        MonitorConfig(**BASE, solve_rate_slots=1 << 40)


# ---- configuration files -----------------------------------------------------------------------------------------


def _refused_quickly(file: Path, match: str, **kwargs: Any) -> str:
    started = time.monotonic()
    with pytest.raises(ValueError, match=match) as caught:
        MonitorConfig.load(file, environ={}, **kwargs)
    text = str(caught.value)
    assert time.monotonic() - started < 2.0, text
    assert len(text) < 2000, text
    return text


def test_a_billion_laughs_fails_at_once_with_a_short_error(tmp_path):
    file = tmp_path / "bomb.yaml"
    file.write_text(BOMB + "run: r\ngroup_size: 4\n")
    _refused_quickly(file, r"config_file .*bomb\.yaml: expected YAML settings, got a document that expands to more")
    file.write_text(BOMB.replace("i:", "recorder_triggers:") + "run: r\ngroup_size: 4\n")
    _refused_quickly(file, "config_file .*expands to more than")
    merges = "m0: &m0 {x: 1}\n" + "".join(f"m{i + 1}: &m{i + 1} {{<<: [*m{i}, *m{i}], y{i}: 1}}\n" for i in range(40))
    file.write_text(merges)
    _refused_quickly(file, "config_file .*expands to more than")
    file.write_text("a: &a [*a]\n")
    _refused_quickly(file, "config_file .*a recursive alias")
    file.write_text("a: " + "[" * 100_000)
    _refused_quickly(file, "config_file .*expected YAML settings")


@pytest.mark.parametrize("name", ["recorder_triggers", "pass_k", "clip_eps", "reference_baseline", "run", "host"])
def test_a_billion_laughs_given_in_code_fails_with_a_short_error(name):
    bomb: Any = ["lol"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    started = time.monotonic()
    with pytest.raises(ValidationError, match="expands to more than 100000 nodes") as caught:
        MonitorConfig(**{**BASE, name: {"k": bomb} if name == "reference_baseline" else bomb})
    assert len(str(caught.value)) < 2000
    assert time.monotonic() - started < 2.0
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(ValidationError, match="contains itself"):
        MonitorConfig(**BASE, pass_k=looped)


@pytest.mark.parametrize(("make", "got"), [
    (lambda tmp: Path("/dev/zero"), "got a device, FIFO or socket '/dev/zero'"),
    (lambda tmp: tmp, "got a directory"),
    (lambda tmp: tmp / "missing.yaml", "got a missing path"),
    (lambda tmp: _written(tmp / "latin.yaml", "run: caf\xe9\n".encode("latin-1")), "which is not UTF-8"),
    (lambda tmp: _written(tmp / "binary.yaml", bytes(range(256)) * 4), "which is not UTF-8"),
    (lambda tmp: _written(tmp / "nul.yaml", b"run: r\x00\n"), "expected YAML settings, got .*unacceptable character"),
    (lambda tmp: _written(tmp / "huge.yaml", b"# x\n" * (1 << 18)), "of 1048576 bytes"),
    (lambda tmp: _written(tmp / "list.yaml", b"- a\n"), "expected a YAML mapping of settings, got list"),
])
def test_an_unreadable_config_file_is_an_error_naming_the_setting(tmp_path, make, got):
    text = _refused_quickly(make(tmp_path), re.escape(got) if "*" not in got else got, **BASE)
    assert text.startswith("config_file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_does_not_wait_for_a_writer(tmp_path):
    fifo = tmp_path / "grpo.yaml"
    os.mkfifo(fifo)
    _refused_quickly(fifo, "config_file: expected a readable UTF-8 YAML file of at most 256 KiB, got a device, FIFO")


def test_a_reference_baseline_file_is_read_within_the_same_limits(tmp_path):
    file = tmp_path / "baseline.yaml"
    file.write_text(BOMB)
    started = time.monotonic()
    with pytest.raises(ValidationError, match=r"reference_baseline .*expands to more than") as caught:
        MonitorConfig(**BASE, reference_baseline=str(file))
    assert time.monotonic() - started < 2.0
    assert len(str(caught.value)) < 2000
    with pytest.raises(ValidationError, match=r"reference_baseline: expected a readable UTF-8 YAML file .* directory"):
        MonitorConfig(**BASE, reference_baseline=str(tmp_path))
    with pytest.raises(ConfigFileError, match=r"^config file: expected a path"):
        load_yaml_mapping(7, "settings")  # type: ignore[arg-type]


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---- host and port -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "message"), [
    ("", "expected an address to bind"),
    ("127.0.0.1 ", "without whitespace"),
    ("[abc]", "expected an IPv6 address inside the brackets"),
    ("999.1.1.1", "expected an IPv4 or IPv6 address or a hostname"),
    ("a..b", "expected an IPv4 or IPv6 address or a hostname"),
    ("::1::2", "expected an IPv6 address"),
])
def test_a_malformed_host_fails_at_construction_naming_host(host, message):
    with pytest.raises(ValidationError, match=rf"(?s)^1 validation error.*\nhost\n.*{re.escape(message)}"):
        MonitorConfig(**BASE, host=host)


def test_brackets_are_removed_and_names_are_kept():
    assert MonitorConfig(**BASE, host="[::1]").host == "::1"
    assert MonitorConfig(**BASE, host="trainer-0.svc_local").host == "trainer-0.svc_local"


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1"])  # no name; TEST-NET-1, no address here
def test_an_address_that_cannot_be_served_is_an_error_naming_host(host, strict):
    with pytest.raises(AddressUnavailableError, match=rf"host '{re.escape(host)}': cannot serve port 0 there"):
        GRPOMonitor(run="r", group_size=4, host=host, port=0, strict=strict, close_linger_s=0,
                    registry=CollectorRegistry())


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_loopback_serves():
    with GRPOMonitor(run="r", group_size=4, host="[::1]", port=0, close_linger_s=0,
                     registry=CollectorRegistry()) as mon:
        assert mon.url == f"http://[::1]:{mon.port}/metrics"
        with urllib.request.urlopen(mon.url, timeout=5) as answer:
            assert b"grpo_" in answer.read()


# ---- found by a hostile probe of the fixes above ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0x0", "0x00000000", "0", "127.1", "0x7f.1"])
def test_a_host_the_resolver_would_read_as_another_address_is_refused(host):
    """inet_aton's short and hex forms: "0x0" bound every interface."""
    with pytest.raises(ValidationError, match="expected an IPv4 address in dotted-decimal form"):
        MonitorConfig(**BASE, host=host)


def test_a_link_local_address_without_scope_names_the_host():
    with pytest.raises(AddressUnavailableError, match="host 'fe80::1'"):
        GRPOMonitor(run="r", group_size=4, host="fe80::1", port=0, registry=CollectorRegistry())


def test_a_config_path_with_a_nul_byte_names_the_setting():
    with pytest.raises(ConfigFileError, match=r"^config_file: expected a readable UTF-8 YAML file"):
        MonitorConfig.load("/tmp/x\0y", environ={}, **BASE)


@pytest.mark.parametrize(("variable", "text"), [("GRPO_EXPORTER_PASS_K", "[0]"), ("GRPO_EXPORTER_CLIP_EPS", "[0.2]"),
                                                ("GRPO_EXPORTER_CLIP_EPS", "0.2,0.3,0.4")])
def test_a_whole_model_check_names_the_variable_too(variable, text):
    with pytest.raises(ValidationError, match=f"{variable}: expected .* got '{re.escape(text)}'"):
        load({variable: text})
