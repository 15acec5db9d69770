"""The preflight checks (seed 第 6 篇 第 1 / 1.5 / 2 步): each passes on a correct tiny model and fails with the
right diagnosis on a deliberately broken one (dropout left on; an engine in bf16 or with a stale layer; the
loss divided twice or not at all; frozen parameters; prompt tokens in the loss mask)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo_exporter import GRPOMonitor
from grpo_exporter.catalog import PREFLIGHT_CHECKS
from grpo_exporter.checks import (
    ABCReport,
    AccumulationReport,
    MaskTableReport,
    ReachReport,
    abc_consistency,
    accumulation_equivalence,
    mask_table,
    nll_reach,
)

V, T, N = 32, 12, 8


class TinyLM(nn.Module):
    """Next-token log-probs of a fixed batch: embedding, one hidden layer with dropout, a vocabulary head."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 16)
        self.body = nn.Linear(16, 16)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, T) log-probs of tokens[:, 1:] given the previous token, padded with 0 at position 0."""
        logits = self.head(self.drop(torch.tanh(self.body(self.emb(tokens[:, :-1])))))
        chosen = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros(tokens.shape[0], 1, dtype=chosen.dtype), chosen], dim=1)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (N, T), generator=gen)
    mask = torch.zeros(N, T, dtype=torch.bool)
    mask[:, 4:] = True  # prompt 0..3, completion 4..T-1
    return tokens, mask


# ---- A/B/C -------------------------------------------------------------------------------------------------


def test_abc_passes_when_trainer_and_engine_share_the_probability_path():
    tokens, mask = batch()
    model = TinyLM().eval()
    engine = copy.deepcopy(model)
    report = abc_consistency(lambda: model(tokens), lambda: engine(tokens), mask)
    assert report.passed, report.diagnosis
    assert report.repeat.max == 0.0
    assert report.engine.max == 0.0
    assert report.outside_clip_ratio == 0.0
    assert report.tokens == N * (T - 4)


def test_abc_dropout_left_on_is_a_trainer_that_is_not_repeatable():
    tokens, mask = batch()
    model = TinyLM(dropout=0.3).train()  # the bug: eval() forgotten
    engine = copy.deepcopy(model).eval()
    report = abc_consistency(lambda: model(tokens), lambda: engine(tokens), mask)
    assert not report.passed
    assert report.diagnosis.startswith("A != B")
    assert report.repeat.max > 1e-2


def test_abc_a_stale_engine_layer_clips_before_any_update():
    tokens, mask = batch()
    model = TinyLM().eval()
    engine = copy.deepcopy(model)
    with torch.no_grad():
        engine.head.weight.add_(torch.randn_like(engine.head.weight) * 0.5)  # a layer the sync never updated
    report = abc_consistency(lambda: model(tokens), lambda: engine(tokens), mask)
    assert not report.passed
    assert report.diagnosis.startswith("ratio clipped before any update")
    assert report.outside_clip_ratio > 0.01


def test_abc_a_bf16_engine_is_caught_by_the_gap_or_the_clip():
    tokens, mask = batch()
    model = TinyLM().eval()
    engine = copy.deepcopy(model).to(torch.bfloat16)

    def engine_logprobs() -> torch.Tensor:  # the whole engine path in bf16, as a careless rollout worker
        logits = engine.head(torch.tanh(engine.body(engine.emb(tokens[:, :-1]))))
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1).float()
        return torch.cat([torch.zeros(N, 1), chosen], dim=1)

    clean = abc_consistency(lambda: model(tokens), lambda: copy.deepcopy(model)(tokens), mask)  # measured first
    report = abc_consistency(lambda: model(tokens), engine_logprobs, mask, clean_gap_nats=clean.engine.mean)
    assert not report.passed
    assert report.repeat.max == 0.0  # the trainer is fine
    assert report.outside_clip_ratio == 0.0  # no token clipped: only the clean baseline catches it
    assert 1e-3 < report.engine.mean < 0.01  # between the seed's healthy line and its stop line
    assert "more than 10x the clean baseline" in report.diagnosis
    lenient = abc_consistency(lambda: model(tokens), engine_logprobs, mask)  # without a baseline: a warning only
    assert lenient.passed
    assert "above 0.001" in lenient.diagnosis


def test_abc_names_a_shape_that_does_not_match_the_mask():
    tokens, mask = batch()
    model = TinyLM().eval()
    with pytest.raises(ValueError, match=r"C \(engine\) log-probs: expected shape \(8, 12\)"):
        abc_consistency(lambda: model(tokens), torch.zeros(N, T - 1), mask)


# ---- gradient accumulation ----------------------------------------------------------------------------------


def _losses(model: TinyLM, divide: str) -> tuple:
    tokens, mask = batch()

    def nll(rows: slice) -> torch.Tensor:
        lp = model(tokens[rows])
        return -(lp * mask[rows]).sum() / mask[rows].sum()  # the token mean of these rows

    chunks = [slice(k * 2, (k + 1) * 2) for k in range(4)]  # 4 micro-batches of 2 equal-length samples
    scale = {"once": 4.0, "twice": 16.0, "never": 1.0}[divide]
    return (lambda: nll(slice(0, N))), [lambda r=r: nll(r) / scale for r in chunks]


def test_accumulation_is_equivalent_when_each_micro_batch_is_divided_once():
    model = TinyLM().eval()
    batch_loss, micro = _losses(model, "once")
    before = [p.detach().clone() for p in model.parameters()]
    report = accumulation_equivalence(model.parameters(), batch_loss, micro,
                                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert report.passed, report.diagnosis
    assert report.cosine > 0.99999
    assert report.norm_ratio == pytest.approx(1.0, rel=1e-5)
    assert report.delta_relative_difference < 1e-5
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))  # restored
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("divide", "expected"), [("twice", "4x smaller = the micro-batch count"),
                                                  ("never", "4x = the micro-batch count")])
def test_accumulation_names_a_loss_divided_twice_or_not_at_all(divide, expected):
    model = TinyLM().eval()
    batch_loss, micro = _losses(model, divide)
    report = accumulation_equivalence(model.parameters(), batch_loss, micro)
    assert not report.passed
    assert report.multiple == expected
    assert report.cosine > 0.99999  # the direction is right: only the scale is wrong
    assert "scaled once too often or not at all" in report.diagnosis


def test_accumulation_names_the_world_size_when_the_norm_matches_it():
    model = TinyLM().eval()
    batch_loss, micro = _losses(model, "once")
    report = accumulation_equivalence(model.parameters(), batch_loss, [lambda f=f: f() * 8 for f in micro],
                                      multiples={"world size": 8})
    assert report.multiple == "8x = the world size"


# ---- plain-NLL reach ----------------------------------------------------------------------------------------


def test_nll_reach_passes_when_the_gradient_reaches_the_parameters():
    tokens, mask = batch()
    model = TinyLM().eval()
    report = nll_reach(lambda: model(tokens), mask, model.parameters(), steps=60, lr=0.05)
    assert report.passed, report.diagnosis
    assert report.final_nll <= report.initial_nll / 2
    assert report.without_gradient == 0


def test_nll_reach_fails_on_frozen_parameters_and_on_an_optimizer_that_never_moves():
    tokens, mask = batch()
    model = TinyLM().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    frozen = nll_reach(lambda: model(tokens), mask, model.parameters())
    assert not frozen.passed
    assert "every parameter is frozen" in frozen.diagnosis
    model = TinyLM().eval()
    still = nll_reach(lambda: model(tokens), mask, model.parameters(), steps=10,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    assert not still.passed
    assert still.final_nll == pytest.approx(still.initial_nll)
    assert "check frozen parameters, the loss mask" in still.diagnosis
    detached = nll_reach(lambda: model(tokens).detach(), mask, model.parameters(), steps=5)
    assert not detached.passed
    assert "carry no graph" in detached.diagnosis


# ---- the mask table -----------------------------------------------------------------------------------------

EOS = 2
SOURCES = ["prompt"] * 3 + ["completion"] * 2 + ["tool"] * 2 + ["completion"] * 2 + ["padding"] * 2
TOKENS = [5, 6, 7, 10, 11, 20, 21, 12, EOS, 0, 0]
ATTENTION = [1] * 9 + [0, 0]
LOSS = [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0]


def test_mask_table_of_a_correct_sample_with_a_tool_call():
    report = mask_table(TOKENS, ATTENTION, LOSS, SOURCES, advantages=0.5, decode=lambda t: f"<{t}>", eos_id=EOS)
    assert report.passed, report.diagnosis
    assert report.loss_tokens == report.completion_tokens == 4
    assert [r.source for r in report.rows] == SOURCES
    assert report.rows[8].token == "<2>"
    assert report.rows[0].advantage is None
    assert report.rows[3].advantage == 0.5
    text = report.render()
    assert "| 5 | '<20>' | tool | 1 | 0 | 0.5 |" in text
    assert "every assertion holds" in text


def test_mask_table_finds_prompt_tokens_in_the_loss():
    loss = [1, 1, 1, *LOSS[3:]]
    report = mask_table(torch.tensor(TOKENS), torch.tensor(ATTENTION), torch.tensor(loss), SOURCES)
    assert not report.passed
    assert "loss-mask sum 7 != completion tokens less tool tokens 4" in report.violations
    assert "prompt tokens in the loss at positions 0, 1, 2" in report.violations


def test_mask_table_finds_tool_tokens_trained_padding_attended_and_an_eos_against_the_stop_rule():
    loss, attention = list(LOSS), list(ATTENTION)
    loss[5] = 1  # the environment's reply trained as if the model wrote it
    attention[9] = 1  # padding visible
    report = mask_table(TOKENS, attention, loss, SOURCES, eos_id=EOS, eos_in_loss=False)
    assert "tool tokens in the loss at positions 5" in report.violations
    assert "padding attended at positions 9" in report.violations
    assert any(v.startswith("EOS at position 8 is a loss target") for v in report.violations)


def test_mask_table_names_a_length_that_does_not_match():
    with pytest.raises(ValueError, match="loss_mask: expected 11 entries like token_ids, got 3"):
        mask_table(TOKENS, ATTENTION, [1, 0, 1], SOURCES)
    with pytest.raises(ValueError, match=r"sources: expected values in .* got \['assistant'\]"):
        mask_table(TOKENS, ATTENTION, LOSS, ["assistant"] * 11)
    with pytest.raises(ValueError, match="advantages: expected one value or 11 entries like token_ids, got 2"):
        mask_table(TOKENS, ATTENTION, LOSS, SOURCES, advantages=[0.5, 0.5])


# ---- cannot tell: a check that sees nothing never passes ----------------------------------------------------


def test_abc_cannot_tell_on_an_empty_batch_an_all_masked_one_or_non_finite_log_probs():
    tokens, mask = batch()
    model = TinyLM().eval()
    empty = torch.zeros(0, T, dtype=torch.long)
    reports = {
        "empty": abc_consistency(lambda: model(empty), lambda: model(empty), torch.zeros(0, T, dtype=torch.bool)),
        "all-masked": abc_consistency(lambda: model(tokens), lambda: model(tokens), torch.zeros_like(mask)),
        "non-finite": abc_consistency(lambda: model(tokens), lambda: model(tokens).masked_fill(mask, float("nan")),
                                      mask),
    }
    for name, report in reports.items():
        assert (report.outcome, report.passed) == ("cannot_tell", False), name
        assert report.diagnosis.startswith("cannot tell"), name
    assert "selects no token" in reports["all-masked"].diagnosis
    assert "non-finite log-probs on loss tokens in C" in reports["non-finite"].diagnosis


def test_accumulation_diagnoses_a_zero_gradient_and_cannot_tell_on_a_non_finite_one():
    model = TinyLM().eval()
    batch_loss, micro = _losses(model, "once")
    zero = accumulation_equivalence(model.parameters(), lambda: batch_loss() * 0.0,
                                    [lambda f=f: f() * 0.0 for f in micro])
    assert zero.outcome == "failed"
    assert "a zero gradient" in zero.diagnosis
    nan = accumulation_equivalence(model.parameters(), batch_loss, [*micro[:-1], lambda: micro[-1]() * float("nan")],
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert nan.outcome == "cannot_tell"
    assert "the accumulated gradient is not finite" in nan.diagnosis
    assert all(bool(torch.isfinite(p).all()) and p.grad is None for p in model.parameters())  # restored
    both = accumulation_equivalence(model.parameters(), lambda: batch_loss() * float("inf"), micro)
    assert both.outcome == "cannot_tell"
    assert "the batch gradient is not finite" in both.diagnosis


def test_nll_reach_cannot_tell_on_an_empty_mask_or_a_non_finite_nll_and_never_broadcasts_a_mask():
    tokens, mask = batch()
    model = TinyLM().eval()
    empty = nll_reach(lambda: model(tokens), torch.zeros_like(mask), model.parameters(), steps=5)
    assert empty.outcome == "cannot_tell"
    nan = nll_reach(lambda: model(tokens) * float("nan"), mask, model.parameters(), steps=5)
    assert nan.outcome == "cannot_tell"
    assert "the NLL is not finite" in nan.diagnosis
    for wrong in (mask[:, :1], mask[0]):  # (N, 1) and (T,) would broadcast and pass with a wrong NLL
        with pytest.raises(ValueError, match=r"nll_reach: completion_logprobs\(\): expected shape \(\d+,( \d+)?\) like "
                                             r"completion_mask, got \(8, 12\)"):
            nll_reach(lambda: model(tokens), wrong, model.parameters(), steps=5)


def test_mask_table_cannot_tell_on_an_empty_sample_or_one_without_a_completion():
    for report in (mask_table([], [], [], []), mask_table([5, 6], [1, 1], [0, 0], ["prompt", "prompt"])):
        assert report.outcome == "cannot_tell"
        assert "no completion token" in report.diagnosis
    prompt_trained = mask_table([5, 6], [1, 1], [1, 0], ["prompt", "prompt"])
    assert prompt_trained.outcome == "failed"  # a violation stays a failure


def test_the_guide_example_runs_as_written():
    text = (Path(__file__).parent.parent / "docs" / "checks.md").read_text()
    code = text.split("```py\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/checks.md", "exec"), {"__name__": "guide"})


def test_the_monitor_publishes_each_checks_last_verdict():
    good = mask_table(TOKENS, ATTENTION, LOSS, SOURCES)
    bad = mask_table(TOKENS, ATTENTION, [1, *LOSS[1:]], SOURCES)
    with GRPOMonitor(run="pre", group_size=4, port=None, guard="off", close_linger_s=0.0) as mon:
        mon.publish_check(good)
        tokens, mask = batch()
        model = TinyLM().eval()
        mon.publish_check(abc_consistency(lambda: model(tokens), lambda: model(tokens), mask))
        mon.publish_check(bad)  # the last run of a check replaces its verdict
        mon.publish_check(nll_reach(lambda: model(tokens), torch.zeros_like(mask), model.parameters()))
        values = mon.metrics()
        with pytest.raises(TypeError, match=r"publish_check: report: expected a report of .*got dict"):
            mon.publish_check({"passed": True})
    assert values['grpo_preflight_check_passed{check="mask_table"}'] == 0.0
    assert values['grpo_preflight_check_passed{check="abc_consistency"}'] == 1.0
    assert values['grpo_preflight_check_cannot_tell{check="mask_table"}'] == 0.0
    assert values['grpo_preflight_check_passed{check="nll_reach"}'] == 0.0  # could not tell: never a pass
    assert values['grpo_preflight_check_cannot_tell{check="nll_reach"}'] == 1.0
    assert not any("accumulation_equivalence" in k for k in values)


def test_every_report_names_a_check_the_catalogue_declares():
    reports = (ABCReport, AccumulationReport, ReachReport, MaskTableReport)
    assert sorted(r.CHECK for r in reports) == sorted(PREFLIGHT_CHECKS)
