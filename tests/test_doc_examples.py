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
