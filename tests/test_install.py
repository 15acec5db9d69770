"""The install that docs/install.md describes, done on an empty venv: a wheel built from the source tree, installed
with its runtime dependencies, then the commands a user runs first, from a directory outside the repository.

torch is left out of that venv: it is multi-GB, and the install line has the user install it first (the build for
their CUDA, or the CPU wheel). The commands run here need no tensors, so the venv without torch also proves that
they never import it. The venv holds no grafana-foundation-sdk either (the ``dashboards`` extra): ``grpo-exporter
kubernetes`` ships the dashboards packaged in the wheel. The dependencies come from the index pip is configured
with, as the install line's do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.mixin.dashboard_sources import DASHBOARD_SETTINGS, dashboards_for, packaged, unfollowed

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "exporter" / "grpo_exporter"


def _pip(*args: str | Path, python: Path | None = None) -> None:
    """The test environment's pip, acting on ``python``'s environment when given (the new venv holds no pip)."""
    target = ["--python", str(python)] if python else []
    done = subprocess.run([sys.executable, "-m", "pip", *target, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def _isolation() -> list[str]:
    """``--no-build-isolation`` when this environment has the build backend pyproject.toml asks for (fast, no
    index); otherwise pip fetches it into an isolated build environment."""
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for requirement in map(Requirement, backend):
        try:
            if not requirement.specifier.contains(metadata.version(requirement.name)):
                return []
        except metadata.PackageNotFoundError:
            return []
    return ["--no-build-isolation"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the source (a build in place would write build/ into the working tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "exporter", src / "exporter", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", *_isolation(), "-q", "-w", dist, src)
    (built,) = dist.glob("grpo_exporter-*-py3-none-any.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """An empty venv (no system site packages) with the wheel and its runtime dependencies except torch."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True, timeout=120)
    python = root / "bin" / "python"
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(archive.read(info).decode()).get_all("Requires-Dist") or []
    runtime = [r for r in requires if Requirement(r).marker is None and Requirement(r).name != "torch"]
    assert runtime, requires
    _pip("install", "-q", *runtime, python=python)
    _pip("install", "-q", "--no-deps", wheel, python=python)
    return root


def _command(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / "grpo-exporter"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_wheel_holds_every_module_and_the_packaged_dashboards(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    modules = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)[:10]
    assert {f"grpo_exporter/mixin/packaged_dashboards/{name}" for name in packaged()} <= names


def test_the_installed_commands_run_outside_the_repository(venv, tmp_path):
    env_python = venv / "bin" / "python"
    alone = subprocess.run([str(env_python), "-c", "import torch"], capture_output=True, text=True)
    absent = subprocess.run([str(env_python), "-c", "import grafana_foundation_sdk"], capture_output=True, text=True)
    assert alone.returncode != 0, "the venv is not the empty one this test means"
    assert absent.returncode != 0, "the venv is not the empty one this test means"

    version = _command(venv, tmp_path, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("grpo-exporter 0."), version.stdout

    rules = _command(venv, tmp_path, "rules", "--out", "rules")
    assert rules.returncode == 0, rules.stderr[-2000:]
    alerts = yaml.safe_load((tmp_path / "rules" / "grpo-alerts.rules.yml").read_text())
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert {"GRPOEngineLogprobGapCritical", "GRPOTrainingStalled"} <= names
    assert (tmp_path / "rules" / "alertmanager.yml").is_file()

    k8s = _command(venv, tmp_path, "kubernetes", "--out", "k8s")
    assert k8s.returncode == 0, k8s.stderr[-2000:]
    assert "grafana-foundation-sdk" not in k8s.stderr  # the default config: the packaged dashboards are its own
    rule = yaml.safe_load((tmp_path / "k8s" / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    assert names <= {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    configmap = yaml.safe_load((tmp_path / "k8s" / "dashboards-configmap.yaml").read_text())
    assert configmap["data"] == packaged()  # both dashboards, as the repository's dashboards/ holds them
    assert set(configmap["data"]) == {"grpo-crash-triage.json", "grpo-training-health.json"}

    boards = _command(venv, tmp_path, "dashboards", "--out", "boards")
    assert boards.returncode == 2
    assert "Traceback" not in boards.stderr
    assert "dashboards extra" in boards.stderr, boards.stderr
    assert "pip install '.[dashboards]'" in boards.stderr, boards.stderr


def test_kubernetes_without_the_sdk_names_the_settings_its_dashboards_do_not_follow(venv, tmp_path):
    (tmp_path / "mixin.yml").write_text('selector: job="grpo-train"\nstep_seconds: 600\n')
    done = _command(venv, tmp_path, "kubernetes", "--out", "k8s", "--config", "mixin.yml")
    assert done.returncode == 0, done.stderr[-2000:]
    note = next(line for line in done.stderr.splitlines() if "grafana-foundation-sdk is not installed" in line)
    assert "step_seconds" in note
    assert "selector" not in note  # the dashboards read $job, never the selector
    assert "pip install '.[dashboards]'" in note
    assert "grafana-foundation-sdk==" in note


def _changed(name: str, value: object) -> list[object]:
    """Other valid-looking values of a setting: a few numbers around a number, a flipped bool, another string."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int | float):
        around = [value * 2, value + 1, value / 2, value * 0.9, value * 1.1, value - 1]
        return [type(value)(v) for v in around if isinstance(value, float) or v == int(v)]
    if isinstance(value, str):
        return [value + "x", 'job="other"']
    return []


def test_the_dashboard_settings_are_those_whose_change_shows_in_the_dashboards():
    """DASHBOARD_SETTINGS, which decides when ``kubernetes`` without the SDK warns, is held to the renderer: every
    setting in it changes a dashboard, and no scalar setting outside it does for any of a few values tried."""
    from grpo_exporter.mixin.dashboards import dashboard_files

    default = MixinConfig()
    base, dump = dashboard_files(default), default.model_dump()
    showing = set()
    for name in MixinConfig.model_fields:
        for value in _changed(name, getattr(default, name)):
            try:
                config = MixinConfig.model_validate(dump | {name: value})
            except ValueError:
                continue
            if dashboard_files(config) != base:
                showing.add(name)
                break
    assert showing == DASHBOARD_SETTINGS
    assert dashboards_for(default) == (base, None)
    assert packaged() == base
    assert unfollowed(MixinConfig.model_validate(dump | {"step_seconds": 600.0, "selector": 'job="x"'})) == [
        "step_seconds"]
