"""Every code block of the user docs (README.md, CHANGELOG.md, docs/, deploy/, rules/) runs in a test or is
loaded by one here: a ```python or ```py block has a named runner that exists and reads that document; a
```bash block parses (`bash -n`), its `grpo-exporter` lines parse with the real command line, the extras it
installs exist and the repository paths it names are there; a ```yaml block loads and validates as the
configuration it is (a rules config, an exporter config, a Kubernetes manifest); a ```promql block is a valid
expression for promtool; ```text is output, not code. Any other block, unlabelled included, fails."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

import k8s_schemas
from grpo_exporter.cli import build_parser
from grpo_exporter.mixin.config import MixinConfig
from grpo_exporter.runtime.monitor_config import MonitorConfig
from services import binary

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted({ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "deploy").rglob("README.md"), ROOT / "rules" / "README.md", ROOT / "dashboards" / "README.md"})
DOC_EXAMPLES = "tests/test_doc_examples.py::test_following_the_docs_verbatim_catches_each_fault"
#: (document, a string in the block) -> the test that runs that block as written
RUNNERS = {
    ("README.md", "GRPOMonitor(run="): DOC_EXAMPLES,
    ("README.md", "MonitoredGRPOTrainer"): "tests/test_integration_trl.py::test_the_docs_two_lines_run_as_written",
    ("docs/exporter.md", "GRPOMonitor("): DOC_EXAMPLES,
    ("docs/checks.md", "abc_consistency("): "tests/test_checks.py::test_the_guide_example_runs_as_written",
    ("docs/checks.md", "preflight(trainer"):
        "tests/test_integration_trl.py::test_the_checks_guide_trl_example_runs_as_written",
    ("docs/recorder.md", "recorder_dir="):
        "tests/test_recorder.py::test_the_guide_example_runs_as_written_and_records_the_nan",
    ("docs/quickstart-loop.md", "llm.generate("):
        "tests/test_quickstarts.py::test_the_loop_quickstart_runs_as_written_and_reads_bf16_noise",
    ("docs/quickstart-trl.md", "MonitoredGRPOTrainer"):
        "tests/test_integration_trl.py::test_the_docs_two_lines_run_as_written",
    ("docs/quickstart-verl.md", "monitored_task_runner"):
        "tests/frameworks/check_verl_v1.py::test_the_docs_v1_lines_run_as_written",
    ("docs/quickstart-verl.md", "monitored_ray_trainer"):
        "tests/frameworks/check_verl.py::test_the_docs_v0_lines_run_as_written",
    ("docs/quickstart-openrlhf.md", "monitored_ppo_trainer"):
        "tests/frameworks/check_openrlhf.py::"
        "test_the_monitored_trainer_is_a_ray_actor_class_whose_monitor_lives_in_the_trainer",
}
REPO_DIRS = ("deploy/", "rules/", "docs/", "scripts/", "dashboards/", "exporter/", "tests/")


def blocks() -> list[tuple[str, int, str, str]]:
    """(document, index, language, body) of every fenced block."""
    found = []
    for doc in DOCS:
        name = str(doc.relative_to(ROOT))
        for i, m in enumerate(re.finditer(r"^```(\S*)\n(.*?)^```", doc.read_text(encoding="utf-8"), re.S | re.M)):
            found.append((name, i, m[1], m[2]))
    return found


BLOCKS = blocks()


def _ids() -> list[str]:
    return [f"{doc}#{i}:{lang or 'unlabelled'}" for doc, i, lang, _ in BLOCKS]


@pytest.mark.parametrize(("doc", "index", "lang", "body"), BLOCKS, ids=_ids())
def test_every_block_runs_or_is_loaded(doc, index, lang, body, tmp_path):
    check = {"python": _runs, "py": _runs, "bash": _shell, "yaml": _yaml, "promql": _promql, "json": _json,
             "text": lambda *_: None}.get(lang)
    assert check is not None, f"{doc} block {index}: label it python/py (with a runner), bash, yaml, promql, " \
                              f"json or text; got {lang or 'no label'}"
    check(doc, body, tmp_path)


def _runs(doc: str, body: str, tmp_path: Path) -> None:
    runners = [runner for (d, marker), runner in RUNNERS.items() if d == doc and marker in body]
    assert len(runners) == 1, f"{doc}: a code block with no runner (or several) in RUNNERS: {body[:120]!r}"
    path, test = runners[0].split("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    assert f"def {test}(" in source, runners[0]
    reads = Path(doc).name in source or (path.startswith("tests/frameworks/") and "snippet(" in source)
    assert reads, f"{runners[0]} does not read {doc}"


def _shell(doc: str, body: str, tmp_path: Path) -> None:
    done = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
    assert done.returncode == 0, f"{doc}: {done.stderr}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for line in body.splitlines():
        line = line.split(" #")[0].strip()
        if not line:
            continue
        words = shlex.split(line)
        if words[0].endswith("grpo-exporter"):
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as exc:
                raise AssertionError(f"{doc}: `{line}` does not parse") from exc
        for extra in re.findall(r"grpo-exporter\[([a-z,]+)\]", line):
            assert set(extra.split(",")) <= set(extras), f"{doc}: no extra {extra!r} in pyproject.toml"
        for word in words:
            path = word.split("=", 1)[-1]
            if path.startswith(REPO_DIRS) and "<" not in path:
                assert (ROOT / path.rstrip("/")).exists() or list(ROOT.glob(path)), f"{doc}: {path} does not exist"


def _yaml(doc: str, body: str, tmp_path: Path) -> None:
    data = yaml.safe_load(body)
    assert isinstance(data, dict), f"{doc}: a YAML block that is not a mapping"
    if "apiVersion" in data:
        k8s_schemas.validate(data)
    elif set(data) <= set(MixinConfig.model_fields):
        MixinConfig.model_validate(data)
    elif set(data) <= set(MonitorConfig.model_fields):
        MonitorConfig.model_validate({"run": "r", "group_size": 8, **data})
    else:
        raise AssertionError(f"{doc}: a YAML block that is no config we know: {sorted(data)}")


def _promql(doc: str, body: str, tmp_path: Path) -> None:
    rules = {"groups": [{"name": "doc", "rules": [{"record": f"doc:expr{i}", "expr": e.strip()}
                                                  for i, e in enumerate(body.split("\n\n")) if e.strip()]}]}
    path = tmp_path / "doc.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, f"{doc}: {done.stdout}{done.stderr}"


def _json(doc: str, body: str, tmp_path: Path) -> None:
    json.loads(body)


def test_every_runner_is_used():
    used = {(d, m) for d, _, lang, body in BLOCKS if lang in ("python", "py") for (dd, m) in RUNNERS
            if dd == d and m in body}
    assert used == set(RUNNERS), set(RUNNERS) - used


#: internal words a user cannot act on: the source's article numbers and Chinese, its nickname, how and when the
#: project's own work was organised (issues, stops, sessions, waves, tasks lent a machine)
INTERNAL = re.compile(r"第|篇|三态|[\u4e00-\u9fff]|\bissues? #?\d+|\bthe issue(?:'s)?\b|"
                      r"\b(?:previous|earlier|later|next|this) (?:stop|session)s?(?:'s?)?\b|\bthis session\b|"
                      r"\bwaves? \d+|\blent to this task\b|"
                      r"(?<!random )(?<!torch random )\bseeds?\b(?![=_])|seed's", re.IGNORECASE)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_user_docs_use_user_words(doc):
    """Every user-facing file, measurement records and the changelog included: the source's findings are stated in
    English with their numbers, an RNG seed is a 'random seed', and nothing refers to how the work was organised."""
    found = [f"{i}: {line.strip()[:120]}" for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
             if INTERNAL.search(line.replace("--seed", ""))]
    assert not found, "\n".join(found)


def test_the_internal_words_are_caught():
    for phrase in ("the previous stop's run", "the targets of issue 13", "in this session", "wave 2's fix",
                   "the seed's collapse", "Issue #58", "as the issue asks", "no GPU was lent to this task"):
        assert INTERNAL.search(phrase), phrase
    for phrase in ("random seed 3", "training stops", "the guard's stop line", "TRL #5312"):
        assert not INTERNAL.search(phrase), phrase


def _install_lines() -> list[tuple[str, str]]:
    """(document, what follows `pip install`) of every pip install the user docs show, in a block or inline."""
    return [(str(doc.relative_to(ROOT)), m[1].strip()) for doc in DOCS
            for m in re.finditer(r"pip install ([^`#(\n]*)", doc.read_text(encoding="utf-8"))]


def test_every_install_line_is_the_one_of_install_md():
    """The package is on no index: README, install.md, every quickstart and every other doc install it with the
    same line, from a clone (`pip install '.[trl]'`, another extra, or `.`) or from the wheel built from one; never
    `grpo-exporter[...]` from a registry, never an editable install. Installing torch first is the one other."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = "|".join(map(re.escape, project["optional-dependencies"]))
    wheel = re.escape(f"dist/grpo_exporter-{project['version']}-py3-none-any.whl")
    one = re.compile(rf"'\.\[(?:{extra})\]'|\.|'{wheel}\[(?:{extra})\]'")
    lines = _install_lines()
    wrong = [f"{doc}: pip install {args}" for doc, args in lines
             if args.split()[0] != "torch" and not one.fullmatch(args)]
    assert not wrong, "\n".join(wrong)
    quickstarts = {str(d.relative_to(ROOT)) for d in (ROOT / "docs").glob("quickstart-*.md")}
    assert {"README.md", "docs/install.md", *quickstarts} <= {doc for doc, args in lines if one.fullmatch(args)}


def test_pages_use_user_words():
    """The alerts' summaries and descriptions, which a pager shows, say nothing internal either."""
    alerts = yaml.safe_load((ROOT / "rules" / "grpo-alerts.rules.yml").read_text(encoding="utf-8"))
    for group in alerts["groups"]:
        for rule in group["rules"]:
            for text in rule.get("annotations", {}).values():
                assert not INTERNAL.search(text), (rule["alert"], text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = [target for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
              if "://" not in target and not (doc.parent / target).exists()]
    assert not broken, broken
