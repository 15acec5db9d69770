"""The TRL configurations the adapter reads beside its default run, through TRL's own GRPOTrainer on CPU (the tiny
model and the builders are tests/test_integration_trl.py's): GDPO's batch-whitened advantages, prompt groups
spread over processes, vLLM without TRL's importance-sampling correction, the correction's modes that drop tokens
and sequences from the loss, CISPO without ``epsilon_high``, the staleness TRL's schedule implies, and the versions
the ``trl`` extra admits."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig

from grpo_exporter import GRPOMonitor
from grpo_exporter.functional.groups import advantage_bound
from grpo_exporter.integrations import ALLOW_UNTESTED_ENV
from grpo_exporter.integrations.trl import TESTED, MonitoredGRPOTrainer
from grpo_exporter.integrations.trl_settings import implied_staleness
from grpo_exporter.integrations.trl_update import GROUP_KEY
from test_integration_trl import (
    MAX_NEW,
    QUIET,
    VLLM,
    G,
    _logged,
    _vllm_mode,
    assert_mode_as_documented,
    build,
    drifting_engine,
    tiny_model,
    torchrun_ranks,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PreTrainedTokenizerFast]:
    return tiny_model(tmp_path_factory.mktemp("qwen2-tiny"))


def _metric(found: dict[str, float], name: str) -> float:
    """The sum of a counter's samples over its labels (0 when absent)."""
    return sum(v for k, v in found.items() if k.partition("{")[0] == name)


# ---- 1. multi_objective_aggregation="normalize_then_sum": batch-whitened advantages ---------------------------

GDPO_G = 8
SOLVED = (4, 5, 6, 7, 8)  # correct completions of each prompt's 8: solve rates 0.5 to 0.875, and a mastered one


def planned(completions: list[str], solved: list[int], **_: Any) -> list[float]:
    """Correct: the first ``solved`` completions of each prompt's group (TRL lays a group's rows out together)."""
    return [1.0 if i % GDPO_G < k else 0.0 for i, k in enumerate(solved)]


def formatted(completions: list[str], **_: Any) -> list[float]:
    """Every completion well-formed: a constant reward, as a format reward reads on a healthy run."""
    return [1.0] * len(completions)


class _Recorded(MonitoredGRPOTrainer):
    """Records the inputs TRL's ``_compute_loss`` gets (after TRL's shuffle and split), per micro-batch."""

    recorded: list[dict[str, Any]]

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        self.recorded.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return super()._compute_loss(model, inputs)


def _gdpo(model_dir: tuple[str, PreTrainedTokenizerFast], tmp_path: Path, **kwargs: Any) -> _Recorded:
    path, tok = model_dir
    args = GRPOConfig(output_dir=str(tmp_path / "out"), run_name="trl-test", num_generations=GDPO_G,
                      per_device_train_batch_size=GDPO_G * len(SOLVED), max_completion_length=MAX_NEW, max_steps=2,
                      report_to=[], use_cpu=True, save_strategy="no", seed=0,
                      multi_objective_aggregation="normalize_then_sum")
    dataset = Dataset.from_dict({"prompt": [f"add {w} plus two" for w in ("one", "two", "four", "five", "six")],
                                 "solved": list(SOLVED)})
    trainer = _Recorded(model=path, reward_funcs=[planned, formatted], args=args, train_dataset=dataset,
                        processing_class=tok, verifier="planned", **kwargs)
    trainer.recorded = []
    trainer.train()
    return trainer


def test_gdpo_whitened_advantages_of_a_healthy_run_are_never_over_a_group_bound(model_dir, tmp_path, caplog):
    """normalize_then_sum (GDPO): TRL sums each reward function's group z-scores and whitens the sum over the
    batch (grpo_trainer.py, _generate_and_score_completions). G=8, solve rates 0.5 to 0.875 and a mastered prompt,
    a constant format reward: TRL's own advantages reach |A| above the unbiased group bound (G-1)/sqrt(G) (the
    mastered group's zeros shrink the batch std), which a monitor checking them as group z-scores counts
    (GRPOAdvantageAboveBound would page: their groups' stds are all alike and not 1, no form the data could be
    told by); the monitor the adapter makes checks them as batch-whitened and counts none."""
    trainer = _gdpo(model_dir, tmp_path / "made", monitor_settings=QUIET)
    found = trainer.monitor.metrics()
    assert trainer.monitor.config.advantage_norm == "whitened"
    bound = advantage_bound(GDPO_G, "unbiased")
    largest = max(float(r["advantages"].abs().max()) for r in trainer.recorded)
    assert largest > bound * 1.01  # TRL's healthy advantages: no group bound holds for them
    assert found["grpo_advantage_over_bound_sequences_total"] == 0
    assert found["grpo_advantage_abs_max"] == pytest.approx(largest, rel=1e-5)

    unbiased = GRPOMonitor(run="trl-test", group_size=GDPO_G, port=None, close_linger_s=0, strict=True)
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        _gdpo(model_dir, tmp_path / "unbiased", monitor=unbiased)
    over = unbiased.metrics()["grpo_advantage_over_bound_sequences_total"]
    unbiased.close()
    assert over > 0  # the reading before: a healthy GDPO run pages
    assert [r for r in caplog.records if "multi_objective_aggregation='normalize_then_sum'" in r.getMessage()
            and "advantage_norm='whitened'" in r.getMessage()]


# ---- 2. groups spread over processes: each row's group id through TRL's shuffle ------------------------------


def test_each_rows_group_id_survives_trls_shuffle_and_split(model_dir, tmp_path) -> None:
    """steps_per_generation=2: TRL shuffles the generation batch's 8 rows (two groups) before it splits it into
    two micro-batches (_prepare_inputs: shuffle_sequence_dict, split_tensor_dict), so a micro-batch's rows are no
    contiguous groups. The group id the adapter adds to the batch travels with its row: rows that share an id
    share their prompt; the micro-batches mix groups; the update's advantage checks run on every step."""
    trainer = build(model_dir, tmp_path, cls=_Recorded, monitor_settings=QUIET, config={
        "per_device_train_batch_size": 4, "steps_per_generation": 2, "gradient_accumulation_steps": 2,
        "num_iterations": 1, "max_steps": 3})
    trainer.recorded = []
    trainer.train()
    found = trainer.monitor.metrics()
    assert len(trainer.recorded) == 6
    mixed = 0
    for inputs in trainer.recorded:
        ids, prompts = inputs[GROUP_KEY].tolist(), inputs["prompt_ids"]
        for i, a in enumerate(ids):
            for j, b in enumerate(ids):
                if a == b:
                    assert torch.equal(prompts[i], prompts[j])
        mixed += ids != sorted(ids) or len(set(ids)) != len(ids) // G
    assert mixed > 0  # the shuffle broke contiguous groups in some micro-batch
    assert found["grpo_advantage_over_bound_sequences_total"] == 0
    assert _metric(found, "grpo_exporter_errors_total") == 0


#: several processes, a prompt's group spread over them: rows per process per step not a multiple of G
SPREAD = [
    {"name": "b1g4", "config": {"per_device_train_batch_size": 1, "num_generations": 4}},
    {"name": "b2g8", "config": {"per_device_train_batch_size": 2, "num_generations": 8,
                                "gradient_accumulation_steps": 2}},
]


def test_groups_spread_over_four_processes_train_with_strict_monitors(model_dir, tmp_path) -> None:
    """TRL on four processes (torchrun, gloo on CPU), per-device batch 1 with G=4 (one row of the group per
    process per step) and per-device batch 2 with G=8 over two micro-steps (four rows per process, shuffled):
    TRL only needs the global batch to hold whole groups. The update observed each micro-batch with contiguous
    groups and raised (InputError: N not divisible by G), which strict=True turned into a dead run; with each
    row's group id carried through TRL's shuffle the runs finish, the advantage checks are published on every
    rank and nothing is counted as an error. The start-up notice names the rollout's group readings, which read
    the fragments."""
    stderr = torchrun_ranks(4, model_dir[0], tmp_path / "rank", json.dumps(SPREAD), timeout=600)
    for spec in SPREAD:
        ranks = [json.loads((tmp_path / f"rank.{spec['name']}.{r}.json").read_text()) for r in range(4)]
        for rank in ranks:
            published = rank["published"]
            assert rank["world"] == 4
            assert rank["steps"] == 2
            assert _metric(published, "grpo_exporter_errors_total") == 0, published
            assert published["grpo_advantage_over_bound_sequences_total"] == 0
            assert "grpo_advantage_abs_max" in published  # the advantage block ran on the update's groups
            assert "grpo_advantage_bound" in published
        g = spec["config"]["num_generations"]
        assert ranks[0]["published"]["grpo_groups_total"] >= 2 * 4 // g  # merged over the ranks' fragments
    assert stderr.count("spreads a prompt's group over several processes") >= 2


# ---- 3. vLLM (or a rollout_func) without TRL's importance-sampling correction ---------------------------------


def test_without_old_logprobs_the_engine_gap_reads_the_losss_own_forward(model_dir, tmp_path, caplog) -> None:
    """TRL computes no old log-probs when gradient_accumulation_steps is a multiple of steps_per_generation x
    num_iterations and no vLLM correction asks for them, so the engine gap vanished exactly where TRL's advice for
    a server with raw log-probs leads. An engine whose log-probs are 0.05 nats off, two generation batches per
    optimizer step (shuffled before the loss): the gap reads 0.05 on every token (a row paired with another row's
    log-probs would read far more), from the loss's own forward, no extra pass. No ratio series (TRL's ratio is 1
    by construction here) and one notice naming the alerts that cannot fire."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    trainer = build(model_dir, tmp_path, rollout_func=drifting_engine(0.05, model_dir[1]), monitor_settings=QUIET,
                    config={"steps_per_generation": 1, "gradient_accumulation_steps": 2, "num_iterations": 1,
                            "max_steps": 2})
    calls: list[int] = []
    real = trainer._get_per_token_logps_and_entropies

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted  # type: ignore[method-assign]
    trainer.train()
    found = trainer.monitor.metrics()
    assert found["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(0.05, abs=1e-4)
    assert found['grpo_engine_logprob_gap_nats{quantile="1"}'] == pytest.approx(0.05, rel=1e-2)
    assert found['grpo_engine_logprob_gap_nats{quantile="0.5"}'] == pytest.approx(0.05, rel=1e-2)
    assert found['grpo_mismatch_kl_nats{estimator="k1"}'] == pytest.approx(0.05, abs=1e-4)
    assert found["grpo_completions_total"] == 2 * 2 * 8  # 2 steps x 2 generation batches of 8
    assert "grpo_onpolicy_checked_tokens_total" not in found
    assert "grpo_importance_weight_count" not in found
    # the loss forward per micro-step and the reference model's pass per generation batch (beta > 0): no more
    assert len(calls) == 2 * 2 + 2 * 2
    said = [r.getMessage() for r in caplog.records if "TRL computes no old log-probs" in r.getMessage()]
    assert len(said) == 1
    assert "GRPOClipFractionHigh" in said[0]


def test_vllm_without_is_correction_reads_the_gap_trl_reads_with_it(model_dir, tmp_path, monkeypatch) -> None:
    """TRL's vLLM path (a bf16 engine on CPU, tests/trl_engine.py), the first generation of the same seed with
    and without vllm_importance_sampling_correction: TRL logs its gap (sampling/sampling_logp_difference/mean)
    from its old-log-prob pass only with the correction; without it the monitor's gap, read from the loss's
    forward, is the same number."""
    _vllm_mode(monkeypatch)
    config = {**VLLM, "max_steps": 1, "num_iterations": 1}
    with_is = build(model_dir, tmp_path / "is", monitor_settings=QUIET, config=config)
    with_is.train()
    [logged] = _logged(with_is, "sampling/sampling_logp_difference/mean")
    assert with_is.monitor.metrics()["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(logged, rel=1e-5)
    without = build(model_dir, tmp_path / "raw", monitor_settings=QUIET,
                    config={**config, "vllm_importance_sampling_correction": False})
    without.train()
    found = without.monitor.metrics()
    assert _logged(without, "sampling/sampling_logp_difference/mean") == []
    assert 1e-4 < logged < 0.1
    assert found["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(logged, rel=1e-4)
    assert "grpo_onpolicy_checked_tokens_total" not in found
    # docs/frameworks.md's column for this mode, its conditional ratios cell unmet on this aligned schedule
    assert_mode_as_documented({k.partition("{")[0] for k in found}, "TRL, vLLM without IS correction",
                              unmet=("ratios",))


# ---- 4. TRL's importance-sampling modes that drop tokens and sequences from the loss --------------------------


@pytest.mark.parametrize("mode", ["sequence_mask", "token_mask"])
def test_what_trls_is_correction_drops_trains_nothing_and_is_counted(model_dir, tmp_path, monkeypatch, mode):
    """vllm_importance_sampling_clip_min=1: TRL's *_mask modes zero the loss of each sequence (sequence_mask, its
    default) or token (token_mask) whose ratio pi_old / pi_vllm is below 1, about half of a bf16 engine's. Those
    are no loss tokens here (the ratio, clip and ESS readings leave them out: TRL's own recorded weights say
    which), a sequence dropped whole counts in grpo_loss_mask_empty_sequences_total, and a token-level drop is no
    length mismatch."""
    _vllm_mode(monkeypatch)
    trainer = build(model_dir, tmp_path, cls=_Recorded, monitor_settings=QUIET, config={
        **VLLM, "vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": 1.0, "max_steps": 2})
    trainer.recorded = []
    trainer.train()
    found = trainer.monitor.metrics()
    trained = kept = empty = 0
    for inputs in trainer.recorded:
        mask = inputs["completion_mask"].bool()
        narrowed = mask & (inputs["importance_sampling_ratio"] != 0)
        trained += int(mask.sum())
        kept += int(narrowed.sum())
        empty += int(((mask.sum(1) > 0) & (narrowed.sum(1) == 0)).sum())
    assert 0 < kept < trained  # TRL dropped some of the loss tokens, not all
    if mode == "sequence_mask":
        assert empty > 0
    assert _metric(found, "grpo_update_tokens_total") == kept
    assert found["grpo_loss_mask_empty_sequences_total"] == empty
    assert found["grpo_loss_mask_length_mismatch_sequences_total"] == 0
    assert found["grpo_loss_mask_outside_completion_tokens_total"] == 0
    assert _metric(found, "grpo_exporter_errors_total") == 0


# ---- 5. CISPO without epsilon_high ---------------------------------------------------------------------------


def test_cispo_without_epsilon_high_builds_trains_and_says_its_cap(model_dir, tmp_path, caplog) -> None:
    """loss_type="cispo" with epsilon_high unset: TRL caps the weight at epsilon (0.2: _compute_loss's
    clamp(coef_1, max=self.epsilon_high), epsilon_high defaulting to epsilon), a cap below 1. The monitor's
    ratio_cap must be above 1, so the trainer could not be built; now it is, monitored without clip metrics, and
    the warning names TRL's cap and the setting."""
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        trainer = build(model_dir, tmp_path, monitor_settings=QUIET, config={"loss_type": "cispo", "max_steps": 1})
    assert trainer.epsilon_high == pytest.approx(0.2)
    assert trainer.monitor.config.clip == "none"
    assert trainer.monitor.config.ratio_cap is None
    said = [r.getMessage() for r in caplog.records if "loss_type='cispo'" in r.getMessage()]
    assert len(said) == 1
    assert "epsilon_high=0.2 (epsilon_high unset" in said[0]
    assert "epsilon_high=5.0" in said[0]
    trainer.train()
    found = trainer.monitor.metrics()
    assert found["grpo_importance_weight_count"] > 0  # the ratios are read; no clip line is claimed
    assert "grpo_clipped_tokens_total" not in {k.partition("{")[0] for k in found}
    assert _metric(found, "grpo_exporter_errors_total") == 0


# ---- 6. the staleness TRL's schedule implies ------------------------------------------------------------------


def _simulated(steps_per_generation: int, num_iterations: int, accumulation: int) -> int:
    """TRL's schedule micro-step by micro-step (_prepare_inputs: generate when _step % generate_every == 0):
    the largest optimizer-step distance between a micro-batch and its generation."""
    every, worst, made = steps_per_generation * num_iterations, 0, 0
    for micro in range(every * accumulation * 3):
        if micro % every == 0:
            made = micro // accumulation
        worst = max(worst, micro // accumulation - made)
    return worst


@pytest.mark.parametrize(("spg", "iterations", "accumulation"), [
    (1, 1, 1), (4, 1, 1), (8, 1, 1), (4, 2, 2), (2, 1, 4), (3, 1, 2), (2, 1, 3), (6, 2, 4), (5, 3, 7)])
def test_the_staleness_trls_schedule_implies(spg, iterations, accumulation) -> None:
    args = GRPOConfig(output_dir="unused", steps_per_generation=spg, num_iterations=iterations,
                      gradient_accumulation_steps=accumulation, per_device_train_batch_size=G, num_generations=G,
                      report_to=[], use_cpu=True)
    assert implied_staleness(args) == _simulated(spg, iterations, accumulation)


def test_staleness_by_design_is_not_a_stale_rollout(model_dir, tmp_path, caplog) -> None:
    """steps_per_generation=6 over gradient_accumulation_steps=1: each generation batch trains six optimizer
    steps, the last five policy versions after its rollout. Above the default line (4), GRPORolloutsStale
    counted (grpo_stale_update_steps_total) on a run configured so; the monitor the adapter makes has the line
    at 5 and counts nothing, while the staleness it reads reaches 5. A monitor handed in with the default line is
    warned about and counts the step."""
    config = {"per_device_train_batch_size": 4, "steps_per_generation": 6, "gradient_accumulation_steps": 1,
              "num_iterations": 1, "max_steps": 6, "beta": 0.0}
    seen: list[float] = []

    class Staleness(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trainer.monitor.wait_for_workers()
            seen.append(trainer.monitor.metrics().get("grpo_rollout_staleness_versions", math.nan))

    trainer = build(model_dir, tmp_path / "made", monitor_settings=QUIET, config=config)
    trainer.add_callback(Staleness())
    assert trainer.monitor.config.staleness_max_versions == 5
    trainer.train()
    assert max(seen) == 5
    assert trainer.monitor.metrics().get("grpo_stale_update_steps_total", 0.0) == 0

    mine = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0, strict=True)
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        handed = build(model_dir, tmp_path / "mine", monitor=mine, config=config)
    handed.train()
    stale = mine.metrics()["grpo_stale_update_steps_total"]
    mine.close()
    assert stale == 1  # the sixth step trains on a rollout 5 versions old
    assert [r for r in caplog.records if "staleness_max_versions=4" in r.getMessage()
            and "up to 5 policy versions old" in r.getMessage()]


# ---- 7. the versions the trl extra admits ---------------------------------------------------------------------


def _extra(name: str) -> list[Requirement]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    line = re.search(rf"^{name} = (\[.*\])$", text, flags=re.MULTILINE)
    assert line is not None
    return [Requirement(r) for r in json.loads(line.group(1))]


def test_the_trl_extra_pins_transformers_no_tighter_than_trl_and_the_adapter_admits_it() -> None:
    """transformers is TRL's dependency: the extra leaves its range to TRL's own metadata (trl 1.16 asks
    transformers>=4.56.2), and the adapter's tested range holds the installed transformers and 5.25."""
    extra = {r.name: r for r in _extra("trl")}
    assert "trl" in extra
    trl_needs = [Requirement(r) for r in metadata.requires("trl") or [] if Requirement(r).marker is None]
    [theirs] = [r.specifier for r in trl_needs if r.name == "transformers"]
    if "transformers" in extra:
        assert extra["transformers"].specifier == theirs
    tested = dict(part.split(">=", 1) for part in re.findall(r"(\w+>=[\d.]+,<[\d.]+)", TESTED))
    transformers_range = SpecifierSet(">=" + tested["transformers"])
    installed = Version(metadata.version("transformers"))
    assert installed in transformers_range
    assert Version("5.25.0") in transformers_range
    assert Version(metadata.version("trl")) in SpecifierSet(">=" + tested["trl"])
    assert os.environ.get(ALLOW_UNTESTED_ENV) is None  # the tested-range check ran at import, not overridden
