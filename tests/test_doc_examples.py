"""Every code example of README.md and docs/exporter.md runs as written, and following it verbatim catches a
fault of each layer-1 kind: an on-policy ratio outside the clip range, a wrong loss mask, a non-finite grad
norm, a NaN log-prob (the guard names each; a healthy run names nothing)."""

from __future__ import annotations

import logging

import pytest

from doc_examples import examples, namespace

# the one change to the examples: the README's fixed port 9887 becomes a free one, so tests can run anywhere
EXAMPLES = [("README.md", code.replace("port=9887", "port=0")) for code in examples("README.md")]
EXAMPLES += [("docs/exporter.md", code) for code in examples("docs/exporter.md")]
EXPECTED = {
    "healthy": set(),
    "onpolicy": {"GRPORatioClippedBeforeUpdate"},
    "mask": {"GRPOLossMaskMismatch"},
    "grad": {"GRPONonFiniteValues"},
    "nonfinite": {"GRPONonFiniteValues"},
}


def test_every_document_has_examples():
    assert [doc for doc, _ in EXAMPLES].count("README.md") == 1
    assert [doc for doc, _ in EXAMPLES].count("docs/exporter.md") == 2


@pytest.mark.parametrize("fault", sorted(EXPECTED))
@pytest.mark.parametrize(("doc", "code"), EXAMPLES, ids=[f"{d}#{i}" for i, (d, _) in enumerate(EXAMPLES)])
def test_following_the_docs_verbatim_catches_each_fault(doc, code, fault, caplog):
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    exec(compile(code, doc, "exec"), namespace(fault))
    named = {alert for alert in ("GRPORatioClippedBeforeUpdate", "GRPOLossMaskMismatch", "GRPONonFiniteValues",
                                 "GRPOEngineLogprobGapCritical") if alert.lower() in caplog.text}
    errors = [r for r in caplog.records if "failed in stage" in r.getMessage()]
    assert not errors, errors[0].getMessage()
    expected = EXPECTED[fault]
    if fault == "mask" and "completion_lengths" not in code:
        pytest.fail(f"{doc}: an example without completion_lengths cannot audit the mask")
    assert named == expected, caplog.text


#: the ```py blocks of docs/integrations.md, each run as written by its framework's test
INTEGRATION_RUNNERS = {
    "MonitoredGRPOTrainer": "tests/test_integration_trl.py::test_the_docs_two_lines_run_as_written",
    "monitored_task_runner": "tests/frameworks/check_verl_v1.py::test_the_docs_v1_lines_run_as_written",
    "monitored_ray_trainer": "tests/frameworks/check_verl.py::test_the_docs_v0_lines_run_as_written",
    "monitored_ppo_trainer": "tests/frameworks/check_openrlhf.py::"
                             "test_the_monitored_trainer_is_a_ray_actor_class_whose_monitor_lives_in_the_trainer",
}


def test_every_integration_snippet_has_a_test_that_runs_it():
    """docs/integrations.md has no ```python block (those would need a runner here) and each ```py block is
    the one its framework's test finds by name, and that test exists."""
    import re

    from doc_examples import ROOT

    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    assert not examples("docs/integrations.md")
    blocks = re.findall(r"```py\n(.*?)```", text, flags=re.DOTALL)
    assert sorted(m for b in blocks for m in INTEGRATION_RUNNERS if m in b) == sorted(INTEGRATION_RUNNERS)
    assert len(blocks) == len(INTEGRATION_RUNNERS)
    for runner in INTEGRATION_RUNNERS.values():
        path, name = runner.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), runner
