"""A real TRL GRPOTrainer run, offline on CPU: a tokenizer trained here, a tiny random Qwen2, two reward
functions, 3 optimizer steps. TRL is installed by scripts/setup.sh (the `[trl]` extra), never skipped."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig

from frameworks.doc_snippets import GROUP_SERIES as FRAMEWORK_GROUP_SERIES
from grpo_exporter import GRPOMonitor
from grpo_exporter.ids import id_tensor
from grpo_exporter.integrations import ALLOW_UNTESTED_ENV, IntegrationError, check_signature, require
from grpo_exporter.integrations.trl import TESTED, TRL_METRICS, MonitoredGRPOTrainer, prompt_key
from grpo_exporter.integrations.trl_preflight import preflight
from grpo_exporter.recorder.store import incidents
from monitor_helpers import parse_exposition, scrape
from trl_engine import Bf16Engine

WORDS = [
    "add", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "plus", "minus", "equals",
    "answer",
]
G = 4
MAX_NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PreTrainedTokenizerFast]:
    return tiny_model(tmp_path_factory.mktemp("qwen2-tiny"))


def tiny_model(path: Path) -> tuple[str, PreTrainedTokenizerFast]:
    """A word-level tokenizer trained with `tokenizers` and a randomly initialised 2-layer Qwen2, saved in ``path``
    so TRL can load the reference model from the same path (beta > 0)."""
    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<pad>", "<eos>", "<unk>"]
    raw.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordLevelTrainer(special_tokens=special))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


def accuracy(completions: list[str], **_: Any) -> list[float]:
    return [1.0 if "three" in c.split() else 0.0 for c in completions]


def brevity(completions: list[str], **_: Any) -> list[float]:
    return [-len(c.split()) / MAX_NEW for c in completions]


def drifting_engine(drift_nats: float, tok: PreTrainedTokenizerFast):
    """A `rollout_func` standing in for an inference engine: samples from the trainer's own model and reports
    each token's log-prob shifted by ``drift_nats`` (an engine that disagrees with the trainer)."""

    def rollout(prompts: list[str], trainer: Any) -> dict[str, list[list[Any]]]:
        out: dict[str, list[list[Any]]] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        with torch.no_grad():
            for prompt in prompts:
                ids = tok(prompt)["input_ids"]
                seq, logps = list(ids), []
                for _ in range(MAX_NEW):
                    logp = torch.log_softmax(trainer.model(torch.tensor([seq])).logits[0, -1].float(), -1)
                    token = int(torch.multinomial(logp.exp(), 1))
                    seq.append(token)
                    logps.append(float(logp[token]) + drift_nats)
                    if token == tok.eos_token_id:
                        break
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(seq[len(ids):])
                out["logprobs"].append(logps)
        return out

    return rollout


def build(model_dir: tuple[str, PreTrainedTokenizerFast], tmp_path: Path, cls: type = MonitoredGRPOTrainer,
          model: Any = None, config: dict[str, Any] | None = None, **kwargs: Any) -> MonitoredGRPOTrainer:
    path, tok = model_dir
    args = GRPOConfig(**{
        "output_dir": str(tmp_path / "out"), "run_name": "trl-test", "per_device_train_batch_size": 8,
        "num_generations": G, "max_completion_length": MAX_NEW, "max_steps": 3, "num_iterations": 2, "beta": 0.1,
        "learning_rate": 1e-2, "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "report_to": [],
        "logging_steps": 1, "use_cpu": True, "save_strategy": "no", "seed": 0, **(config or {}),
    })
    dataset = Dataset.from_dict({"prompt": [f"add {a} plus {b}" for a, b in itertools.pairwise(WORDS[1:10])]})
    return cls(
        model=path if model is None else model, reward_funcs=[accuracy, brevity], args=args, train_dataset=dataset,
        processing_class=tok, **{"verifier": "accuracy", **kwargs},
    )


def train(model_dir: tuple[str, PreTrainedTokenizerFast], tmp_path: Path, **kwargs: Any) -> MonitoredGRPOTrainer:
    trainer = build(model_dir, tmp_path, **kwargs)
    trainer.train()
    return trainer


def _logged(trainer: MonitoredGRPOTrainer, key: str) -> list[float]:
    return [float(h[key]) for h in trainer.state.log_history if key in h]


def test_real_trl_run_hands_the_step_tensors_to_the_monitor(model_dir, tmp_path) -> None:
    """TRL's own generation, num_iterations=2 and beta=0.1: old and reference log-probs reach the monitor, the
    series are scraped over HTTP and finite, components are named after the reward functions, and the values
    TRL logs under the same meaning agree."""
    monitor = GRPOMonitor(run="trl-test", group_size=G, clip_eps=(0.2, 0.2), port=0, strict=True, close_linger_s=0)
    try:
        trainer = train(model_dir, tmp_path, monitor=monitor)
        series = parse_exposition(scrape(monitor.url))
    finally:
        monitor.close()

    def one(name: str, **labels: str) -> float:
        return series[name][tuple(sorted({"run": "trl-test", **labels}.items()))]

    grpo = {n: s for n, s in series.items() if n.startswith("grpo_")}
    assert all(math.isfinite(v) for s in grpo.values() for v in s.values())
    assert one("grpo_steps_total") == 3  # one step per optimizer step
    assert one("grpo_last_step") == 2
    assert sum(series.get("grpo_exporter_errors_total", {}).values()) == 0
    # reward components named after the reward functions; the total is TRL's weighted sum
    assert {dict(k)["component"] for k in series["grpo_reward_mean"]} == {"accuracy", "brevity", "total"}
    assert one("grpo_reward_mean", component="total") == pytest.approx(_logged(trainer, "reward")[-1], abs=1e-6)
    assert one("grpo_reward_mean", component="accuracy") == pytest.approx(
        _logged(trainer, "rewards/accuracy/mean")[-1], abs=1e-6)
    assert one("grpo_zero_variance_groups_ratio") == pytest.approx(_logged(trainer, "frac_reward_zero_std")[-1])
    assert one("grpo_groups_total") == 2 * (16 // G)  # two rollouts of 16 completions (8 per device x 2)
    # old log-probs (num_iterations=2): ratios, the clip split and the on-policy check of step 0
    assert one("grpo_importance_weight_count") > 0
    assert one("grpo_onpolicy_checked_tokens_total") > 0
    assert one("grpo_onpolicy_log_ratio_abs_max_nats") == 0.0  # same weights, same forward on CPU
    assert one("grpo_clipped_tokens_total", bound="lower") + one("grpo_clipped_tokens_total", bound="upper") > 0
    # reference log-probs (beta > 0): KL, as TRL logs it (k3) up to TRL's per-micro-batch averaging
    assert one("grpo_kl_ref_nats") == pytest.approx(_logged(trainer, "kl")[-1], rel=0.1)
    assert one("grpo_entropy_mean_nats") == pytest.approx(_logged(trainer, "entropy")[-1], rel=0.01)
    assert one("grpo_grad_norm_pre_clip") == pytest.approx(_logged(trainer, "grad_norm")[-1], rel=1e-5)
    # correctness from the declared verifier; truncation as TRL counts it
    assert one("grpo_pass_at_k_ratio", k="1") == pytest.approx(_logged(trainer, "rewards/accuracy/mean")[-1])
    clipped = _logged(trainer, "completions/clipped_ratio")
    assert one("grpo_truncated_completions_total") == pytest.approx(sum(clipped) * 16)
    assert one("grpo_rollout_staleness_versions") == 0  # step 2 trains on the rollout made at step 2
    # TRL's own generation reports no engine log-probs: the engine gap is absent, never a fake 0
    assert "grpo_engine_logprob_gap_mean_nats" not in series
    assert_mode_as_documented(set(series), "TRL, `num_iterations > 1` (no vLLM)")
    assert set(TRL_METRICS) >= {"reward", "entropy", "kl", "frac_reward_zero_std", "grad_norm"}


def test_engine_logprobs_that_drift_show_as_engine_gap_and_the_guard_says_so(model_dir, tmp_path, caplog) -> None:
    """A rollout_func whose log-probs are 0.05 nats off the trainer's on every token: the engine gap mean reads
    0.05 and the built-in guard names the layer-1 fault, systematic from the first step (the signed gap, k1, is
    the whole gap; the stop line is 0.01). The trainer made and closed its own monitor."""
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    trainer = train(
        model_dir, tmp_path, rollout_func=drifting_engine(0.05, model_dir[1]),
        monitor_settings={"port": None, "close_linger_s": 0, "strict": True, "recorder_dir": tmp_path / "incidents"},
    )
    published = trainer.monitor.metrics()
    assert published["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(0.05, abs=1e-4)
    assert _logged(trainer, "sampling/sampling_logp_difference/mean") == []  # TRL reports it only with vLLM
    assert published["grpo_run_finished"] == 1.0  # closed at the end of train()
    assert trainer.monitor.config.run == "trl-test"
    assert trainer.monitor.config.group_size == G
    assert published["grpo_kl_penalty_coefficient"] == 0.1  # TRL's beta: the KL rules judge this run's KL
    assert published['grpo_mismatch_kl_nats{estimator="k1"}'] == pytest.approx(0.05, abs=1e-4)
    said = [re.search(r"engine log-prob gap is systematic: mismatch KL k1 \(the mean signed gap\) (\S+) nats",
                      r.getMessage()) for r in caplog.records]
    # the trainer's batched forward differs from the engine's one-token forwards by ~1e-5: 0.05 to 4 digits or not
    assert [float(m.group(1)) for m in said if m] == [pytest.approx(0.05, abs=1e-4)]
    # the flight recorder: one episode (the drift is there from the first step), rows with TRL's prompts decoded
    [incident] = incidents(tmp_path / "incidents")
    manifest = json.loads((incident / "incident.json").read_text())
    assert manifest["triggers"] == ["engine_gap"]
    assert manifest["steps"]["first_anomalous"] == 0
    assert manifest["steps"]["last_normal"] is None
    rows = manifest["states"]["first_anomalous"]["rows"]["rollout"]
    assert rows[0]["driver"] == "engine_gap"
    assert rows[0]["engine_gap_mean"] == pytest.approx(0.05, abs=1e-4)
    assert all("add" in r["prompt"] and "plus" in r["prompt"] for r in rows)


def _vllm_mode(monkeypatch: pytest.MonkeyPatch, unscored_every: int | None = None,
               syncs: int | None = None) -> type[Bf16Engine]:
    """TRL's vLLM mode with a bf16 CPU engine in place of VLLMGeneration (tests/trl_engine.py)."""
    import trl.trainer.grpo_trainer as grpo_trainer

    engine = type("Engine", (Bf16Engine,), {"unscored_every": unscored_every, "syncs": syncs, "instances": []})
    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", engine)
    return engine


VLLM = {"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_correction": True}


#: a series per input group of docs/frameworks.md, of the groups these runs hand over (beta > 0, a verifier, no
#: tools; the components are checked by name where the adapter makes the monitor)
GROUP_SERIES = {g: name for g, name in FRAMEWORK_GROUP_SERIES.items() if g != "tools"}


def assert_mode_as_documented(published: set[str], mode: str, unmet: tuple[str, ...] = ()) -> None:
    """The framework matrix's claim for ``mode`` (docs/frameworks.md) holds on a real run: each group it says
    the adapter hands over is published, each it says is absent is not. ``unmet``: the groups whose condition
    (a conditional cell, "yes (with ...)") this run does not meet: absent too."""
    from grpo_exporter.reference.frameworks import MODES

    assert all(MODES[mode].get(g) for g in unmet), f"{mode}: {unmet} are not conditional in docs/frameworks.md"
    said = {g for g in GROUP_SERIES if g in MODES[mode] and g not in unmet}
    seen = {g for g, name in GROUP_SERIES.items() if name in published}
    assert seen == said, f"{mode}: published {sorted(seen)}, docs/frameworks.md says {sorted(said)}"


def test_trl_vllm_mode_with_a_bf16_engine_matches_trls_own_sampling_metrics(model_dir, tmp_path, monkeypatch):
    """TRL's vLLM server path as users run it (its own use_vllm branches, None -> NaN, its recomputed old
    log-probs and token_truncate correction), with a bf16 engine that hands every 5th token back without a
    log-prob. One generation (max_steps 2, generate_every 4 micro-steps): TRL's logged sampling/* values and the
    exporter's readings of the same tensors agree, and the unscored tokens are counted as such, never as
    non-finite values (GRPONonFiniteValues is a layer-1 critical that would mute every other page)."""
    engine = _vllm_mode(monkeypatch, unscored_every=5)
    trainer = train(model_dir, tmp_path, config={
        **VLLM, "vllm_importance_sampling_mode": "token_truncate", "max_steps": 2,
    }, monitor_settings={"port": None, "close_linger_s": 0, "strict": True})
    [made] = engine.instances
    assert made.synced == 1
    assert made.unscored > 0
    got = trainer.monitor.metrics()
    assert trainer.monitor.config.rollout_logprob_nan == "unscored"
    assert trainer.monitor.config.rollout_correction_cap == 3.0  # TRL's vllm_importance_sampling_clip_max
    assert got['grpo_nonfinite_values_total{tensor="rollout_logprobs"}'] == 0
    assert got["grpo_rollout_unscored_tokens_total"] == made.unscored
    [gap_mean] = _logged(trainer, "sampling/sampling_logp_difference/mean")
    [gap_max] = _logged(trainer, "sampling/sampling_logp_difference/max")
    assert 1e-4 < gap_mean < 0.1  # a bf16 engine beside an fp32 trainer: noise, not zero
    assert got["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(gap_mean, rel=1e-5)
    assert got['grpo_engine_logprob_gap_nats{quantile="1"}'] == pytest.approx(gap_max, rel=1e-5)
    # TRL's ratio is after its cap (3, not reached here), over the loss tokens, unscored ones counted as 1
    [w_min] = _logged(trainer, "sampling/importance_sampling_ratio/min")
    [w_max] = _logged(trainer, "sampling/importance_sampling_ratio/max")
    [w_mean] = _logged(trainer, "sampling/importance_sampling_ratio/mean")
    assert w_max < 3.0
    assert got['grpo_rollout_correction_weight{quantile="0"}'] == pytest.approx(w_min, rel=1e-5)
    assert got['grpo_rollout_correction_weight{quantile="1"}'] == pytest.approx(w_max, rel=1e-5)
    total, scored = got["grpo_rollout_correction_weight_sum"], got["grpo_rollout_correction_weight_count"]
    assert (total + made.unscored) / (scored + made.unscored) == pytest.approx(w_mean, rel=1e-5)
    assert got["grpo_rollout_correction_capped_tokens_total"] == 0
    assert got['grpo_mismatch_kl_nats{estimator="k3"}'] < 1e-2  # noise: far below the systematic faults
    assert_mode_as_documented({k.partition("{")[0] for k in got}, "TRL, vLLM server or colocate")


def test_trl_vllm_mode_with_stale_engine_weights_reads_a_systematic_gap(model_dir, tmp_path, monkeypatch):
    """The same path, TRL's default sequence_mask correction, with an engine that stops taking TRL's weight syncs
    after the first (TRL #5312's stale weights): TRL trains at lr 1e-2, so the second generation's gap is many
    times the first's, in TRL's own logged values and in the exporter's, which read the same tensors."""
    engine = _vllm_mode(monkeypatch, syncs=1)
    trainer = train(model_dir, tmp_path, config={**VLLM, "max_steps": 3},
                    monitor_settings={"port": None, "close_linger_s": 0, "strict": True})
    [made] = engine.instances
    assert made.synced == 1
    assert trainer.monitor.config.rollout_correction_cap is None  # sequence_mask caps exp(sum), not ours
    first, second = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert second > 5 * first
    got = trainer.monitor.metrics()
    assert got["grpo_engine_logprob_gap_mean_nats"] == pytest.approx(second, rel=1e-5)
    assert got["grpo_rollout_unscored_tokens_total"] == 0
    assert got['grpo_nonfinite_values_total{tensor="rollout_logprobs"}'] == 0


def test_an_error_reading_trl_objects_is_counted_and_training_goes_on(model_dir, tmp_path, caplog) -> None:
    """Inside training the adapter never crashes it: a broken rollout read is counted under its stage."""
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0)

    class Broken(MonitoredGRPOTrainer):
        def _observe_rollout(self, inputs: Any, output: Any) -> None:
            raise KeyError("completion_ids")

    path, tok = model_dir
    args = GRPOConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=8, num_generations=G,
                      max_completion_length=MAX_NEW, max_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    dataset = Dataset.from_dict({"prompt": ["add one plus two"] * 8})
    trainer = Broken(model=path, reward_funcs=[accuracy], args=args, train_dataset=dataset, processing_class=tok,
                     monitor=monitor)
    trainer.train()
    assert trainer.state.global_step == 1
    assert monitor.metrics()['grpo_exporter_errors_total{stage="rollout"}'] == 1.0
    assert any("_generate_and_score_completions" in r.getMessage() for r in caplog.records)
    monitor.close()


def test_the_grad_norm_without_clipping_and_when_the_trainer_returns_none(model_dir, tmp_path, caplog) -> None:
    """``max_grad_norm=0`` (no clipping): TRL still logs ``grad_norm`` and so does the monitor, with no clip line
    (Trainer skipped the clip hook the adapter wrapped: no norm at all before). A trainer that returns no norm
    (DeepSpeed's ``get_global_grad_norm()`` before its first step; accelerate hands it on) leaves the reading
    absent and counts no error (``float(None)`` was an error every step before)."""
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0)
    trainer = train(model_dir, tmp_path, monitor=monitor, config={"max_grad_norm": 0.0, "max_steps": 2})
    found = monitor.metrics()
    monitor.close()
    assert found["grpo_grad_norm_pre_clip"] == pytest.approx(_logged(trainer, "grad_norm")[-1], rel=1e-5)
    assert found["grpo_optimizer_steps_total"] == 2
    assert "grpo_grad_norm_post_clip" not in found
    assert found.get("grpo_grad_clip_active_steps_total", 0.0) == 0.0
    assert sum(v for k, v in found.items() if k.startswith("grpo_exporter_errors_total")) == 0

    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0)
    trainer = build(model_dir, tmp_path / "none", monitor=monitor, config={"max_steps": 2})
    trainer.accelerator.clip_grad_norm_ = lambda *args, **kwargs: None
    with caplog.at_level(logging.INFO, logger="grpo_exporter"):
        trainer.train()
    found = monitor.metrics()
    monitor.close()
    assert trainer.state.global_step == 2
    assert "grpo_grad_norm_pre_clip" not in found
    assert sum(v for k, v in found.items() if k.startswith("grpo_exporter_errors_total")) == 0
    assert len([r for r in caplog.records if "returned no grad norm" in r.getMessage()]) == 1


def test_trls_reward_scaling_sets_the_advantage_check_and_a_mismatch_is_reported(model_dir, tmp_path, caplog):
    """scale_rewards "group" (TRL's default, unbiased nanstd), "batch" and "none" (or False) give the monitor
    the matching advantage_norm; a monitor made with another one is reported at start-up (its bound would be
    the wrong one: a false GRPOAdvantageAboveBound under "batch")."""
    for scale, norm in (("group", "unbiased"), ("batch", "batch"), ("none", "none"), (False, "none")):
        trainer = build(model_dir, tmp_path / str(scale), config={"scale_rewards": scale})
        assert trainer.monitor.config.advantage_norm == norm, scale
        trainer.monitor.close()
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0)
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        build(model_dir, tmp_path / "mine", monitor=monitor, config={"scale_rewards": "batch"})
    monitor.close()
    assert [r for r in caplog.records if "scale_rewards='batch'" in r.getMessage()
            and "advantage_norm='batch'" in r.getMessage()]


def test_the_verifier_is_the_component_the_reward_hack_alert_reads(model_dir, tmp_path, caplog):
    """The README's own example names components after the reward functions (accuracy, brevity here): the
    monitor the adapter makes names the verifier's as the correctness component (grpo_reward_component_role,
    which GRPORewardHackSuspected reads; before, it read component="correctness", which never existed, so it
    could not fire); a monitor handed in without it is reported at start."""
    trainer = build(model_dir, tmp_path / "made")
    found = trainer.monitor.metrics()
    trainer.monitor.close()
    assert found['grpo_reward_component_role{component="accuracy",role="correctness"}'] == 1.0
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0)
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        build(model_dir, tmp_path / "mine", monitor=monitor)
    monitor.close()
    assert [r for r in caplog.records if "correctness_component='accuracy'" in r.getMessage()]


def test_environment_only_examples_keep_their_prompts_apart() -> None:
    """TRL's environment datasets carry no "prompt" (the environment makes it): their examples are told apart
    by their other fields, and examples with none by their group, never all merged into one prompt id."""
    text, chat = {"prompt": "add one plus two"}, {"prompt": [{"role": "user", "content": "add one"}]}
    assert prompt_key(text, 3, 0) == "add one plus two"  # the id a text prompt always had
    assert prompt_key(chat, 3, 0) == chat["prompt"]
    env = [{"task": "maze", "seed": 1}, {"task": "maze", "seed": 2}, {"task": "maze", "seed": 1}]
    ids = id_tensor("prompt_ids", [prompt_key(x, 3, i) for i, x in enumerate(env)], None)
    assert ids is not None
    assert ids[0] != ids[1]
    assert ids[0] == ids[2]  # the same environment example is the same prompt, in any group
    empty = id_tensor("prompt_ids", [prompt_key({}, 3, g) for g in (0, 0, 1)] + [prompt_key({"prompt": ""}, 4, 0)],
                      None)
    assert empty is not None
    assert empty[0] == empty[1]
    assert len({int(v) for v in empty}) == 3


def test_unknown_verifier_is_refused_naming_the_reward_functions(model_dir, tmp_path) -> None:
    path, tok = model_dir
    args = GRPOConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=8, num_generations=G,
                      max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"verifier: expected one of the reward function names \['accuracy'\]"):
        MonitoredGRPOTrainer(model=path, reward_funcs=[accuracy], args=args, processing_class=tok,
                             train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}), verifier="acc",
                             monitor_settings={"port": None})


def test_every_series_the_trl_mapping_names_is_in_the_catalogue() -> None:
    """TRL_METRICS types our series names in PromQL: each must be a catalogue sample, so a rename cannot leave
    the mapping (and docs/integrations.md, which copies it) pointing at nothing."""
    from grpo_exporter.catalog import family_of

    names = {n for expr, _ in TRL_METRICS.values() for n in re.findall(r"grpo_[a-z_]+", expr)}
    assert names
    for name in names:
        family_of(name)  # KeyError for a name the catalogue does not publish


def test_a_moved_private_method_fails_at_import_naming_it() -> None:
    class Renamed:
        def _compute_loss(self, model: Any, batch: Any) -> None: ...

    moved = r"Renamed._compute_loss.* does not start with the parameters \(self, model, inputs\)"
    with pytest.raises(IntegrationError, match=moved):
        check_signature(Renamed, "_compute_loss", ("self", "model", "inputs"), "trl", "trl>=1.16,<1.17")
    with pytest.raises(IntegrationError, match="_clip_grad_norm is missing"):
        check_signature(Renamed, "_clip_grad_norm", ("self", "model"), "transformers", "x")


def test_a_missing_framework_names_the_extra_to_install() -> None:
    with pytest.raises(IntegrationError, match=r"pip install 'verl>=0.9,<0.10' \(or '\.\[verl\]' in grpo-exporter"):
        require("verl_is_not_installed_here", "verl", "verl>=0.9,<0.10")


def test_an_untested_framework_release_fails_at_import_naming_the_range(monkeypatch, caplog) -> None:
    """The tested range is enforced (a release outside it moves the private methods an adapter wraps), the
    error names the version, the range and the override; the override lets it through with one warning."""
    fake = ModuleType("grpo_fake_framework")
    fake.__version__ = "2.1.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "grpo_fake_framework", fake)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    tested = "grpo_fake_framework>=1.4,<2 with other>=3"
    found = r"grpo_fake_framework 2.1.0 is installed, outside the tested range grpo_fake_framework>=1.4,<2 \("
    with pytest.raises(IntegrationError, match=found) as raised:
        require("grpo_fake_framework", "fake", tested)
    assert f"{ALLOW_UNTESTED_ENV}=grpo_fake_framework" in str(raised.value)
    for untested in ("1.3.9", "2.0.0rc1", "2"):
        fake.__version__ = untested  # type: ignore[attr-defined]
        with pytest.raises(IntegrationError):
            require("grpo_fake_framework", "fake", tested)
    for version in ("1.4", "1.4.0", "1.9.3+cpu"):
        fake.__version__ = version  # type: ignore[attr-defined]
        assert require("grpo_fake_framework", "fake", tested) is fake
    fake.__version__ = "2.1.0"  # type: ignore[attr-defined]
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "verl, grpo_fake_framework")
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        assert require("grpo_fake_framework", "fake", tested) is fake
    assert [r.getMessage() for r in caplog.records if "outside the tested range" in r.getMessage()]
    # the installed TRL and transformers are in the adapter's own range (it imported above)
    assert require("trl", "trl", TESTED) is not None
    assert require("transformers", "trl", TESTED) is not None


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart-trl.md"])
def test_the_docs_two_lines_run_as_written(model_dir, tmp_path, doc) -> None:
    """The TRL snippet of the README and of docs/quickstart-trl.md (```py blocks: they need TRL, so the core
    doc-example test leaves them to this file), run verbatim but for a free port, the tiny model's path and its
    tokenizer."""
    text = (Path(__file__).resolve().parents[1] / doc).read_text(encoding="utf-8")
    (code,) = [c for c in re.findall(r"```py\n(.*?)```", text, flags=re.DOTALL) if "MonitoredGRPOTrainer" in c]
    path, tok = model_dir  # the word-level tokenizer is passed as trained: a reload would re-split words
    grpo_config = GRPOConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=8, num_generations=G,
                             max_completion_length=MAX_NEW, max_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", run_name=Path(doc).stem)
    names: dict[str, Any] = {"tok": tok, "accuracy": accuracy, "fmt": brevity, "grpo_config": grpo_config,
                             "ds": Dataset.from_dict({"prompt": ["add one plus two", "add two plus two"] * 4})}
    os.environ["GRPO_EXPORTER_CLOSE_LINGER_S"] = "0"
    try:
        code = code.replace('"port": 9887', '"port": 0').replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(path))
        exec(code.replace("train_dataset=ds,", "train_dataset=ds, processing_class=tok,"), names)
        trainer = names["trainer"]
        url = trainer.monitor.url
        trainer.train()  # the trainer made its monitor, so train() closes it
    finally:
        del os.environ["GRPO_EXPORTER_CLOSE_LINGER_S"]
    published = trainer.monitor.metrics()
    assert url is not None
    assert published["grpo_steps_total"] == 2
    assert published['grpo_pass_at_k_ratio{k="1"}'] >= 0
    assert published["grpo_run_finished"] == 1.0


def torchrun_ranks(processes: int, model_dir: str, out: Path, *args: str, timeout: int = 300) -> str:
    """tests/trl_ranks.py on ``processes`` CPU processes under torchrun (gloo; accelerate's MULTI_CPU), each
    writing its readings next to ``out``; returns their stderr (the run must succeed)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
         "127.0.0.1", "--master_port", str(port), str(Path(__file__).with_name("trl_ranks.py")), model_dir,
         str(out), *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def test_two_ranks_merge_and_rank_zero_serves(model_dir, tmp_path) -> None:
    """TRL on two processes (torchrun, gloo on CPU; accelerate's MULTI_CPU): each rank's monitor merges on the
    exporter's own group, rank 0 serves and rank 1 does not, and the merged reward is TRL's global one (TRL
    gathers rewards over processes; each rank observes its own slice)."""
    import json

    torchrun_ranks(2, model_dir[0], tmp_path / "rank")
    ranks = [json.loads((tmp_path / f"rank.{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["url"] is not None
    assert ranks[1]["url"] is None
    served = parse_exposition(ranks[0]["scrape"])
    total = served["grpo_reward_mean"][(("component", "total"), ("run", "trl-ranks"))]
    assert total == pytest.approx(ranks[0]["logged_reward"][-1], abs=1e-6)  # both ranks' rows, merged
    assert served["grpo_groups_total"][(("run", "trl-ranks"),)] == 2 * (2 * 8 // G)  # 2 steps x 2 ranks x 8 rows
    assert served["grpo_steps_total"][(("run", "trl-ranks"),)] == 2
    assert ranks[1]["published"]['grpo_reward_mean{component="total"}'] == pytest.approx(total)


# ---- the preflight checks on a TRL trainer (grpo_exporter.integrations.trl_preflight) ----------------------

QUIET = {"port": None, "close_linger_s": 0, "strict": True}


def test_preflight_passes_on_a_healthy_trainer_and_leaves_it_as_found(model_dir, tmp_path) -> None:
    trainer = build(model_dir, tmp_path, monitor_settings=QUIET)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    rng = torch.random.get_rng_state()
    result = preflight(trainer, reach=True, reach_steps=30)
    assert result.passed, result.render()
    assert [r.CHECK for r in result.reports] == ["abc_consistency", "mask_table", "accumulation_equivalence",
                                                  "nll_reach"]
    assert result.abc.repeat.max == 0.0
    assert result.abc.tokens > 0
    assert result.accumulation is not None
    assert result.accumulation.multiple is None
    assert result.reach is not None
    assert result.reach.final_nll <= result.reach.initial_nll / 2
    assert "| completion | 1 | 1 |" in result.render()  # the mask table of a sample that ended in EOS
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert not any(trainer._metrics["train"].values())
    assert not any(trainer._metrics["eval"].values())
    published = trainer.monitor.metrics()
    checks = ("abc_consistency", "mask_table", "accumulation_equivalence", "nll_reach")
    assert {k: v for k, v in published.items() if k.startswith("grpo_preflight")} == {
        **{f'grpo_preflight_check_passed{{check="{c}"}}': 1.0 for c in checks},
        **{f'grpo_preflight_check_cannot_tell{{check="{c}"}}': 0.0 for c in checks},
    }
    assert "grpo_completions_total" not in published  # the preflight batch is no training step
    trainer.train()
    assert trainer.monitor.metrics()["grpo_steps_total"] == 3


def test_the_checks_guide_trl_example_runs_as_written(model_dir, tmp_path, capsys) -> None:
    """docs/checks.md's one-call example, verbatim: `MonitoredGRPOTrainer(...)` stands for the tiny trainer."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "checks.md").read_text(encoding="utf-8")
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if "preflight(trainer)" in c]
    names: dict[str, Any] = {"MonitoredGRPOTrainer": lambda *_: build(model_dir, tmp_path, monitor_settings=QUIET)}
    exec(compile(code, "docs/checks.md", "exec"), names)
    assert names["result"].passed
    assert "abc_consistency: pass" in capsys.readouterr().out


def test_preflight_finds_dropout_left_on(model_dir, tmp_path) -> None:
    """The seed's A != B: dropout active in the pass that computes the loss's log-probs."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir[0], attention_dropout=0.5)
    trainer = build(model_dir, tmp_path, model=model, config={"beta": 0.0}, monitor_settings=QUIET)
    result = preflight(trainer)
    assert not result.abc.passed
    assert "A != B" in result.abc.diagnosis
    assert "dropout" in result.abc.diagnosis
    assert result.accumulation is None
    assert "not repeatable" in result.skipped["accumulation_equivalence"]
    assert trainer.monitor.metrics()['grpo_preflight_check_passed{check="abc_consistency"}'] == 0.0


def test_preflight_finds_an_engine_that_disagrees_with_the_trainer(model_dir, tmp_path) -> None:
    """An engine (a rollout_func, as vLLM would be) whose log-probs are 0.05 nats off: C differs from A."""
    trainer = build(model_dir, tmp_path, rollout_func=drifting_engine(0.05, model_dir[1]), monitor_settings=QUIET)
    result = preflight(trainer)
    assert not result.abc.passed
    assert result.abc.engine.mean == pytest.approx(0.05, abs=1e-4)
    assert "mean |A-C| 0.05 nats >= 0.01" in result.abc.diagnosis
    assert result.mask.passed


class _LossNotDivided(MonitoredGRPOTrainer):
    """A custom loss that undoes TRL's division by the accumulation steps (the seed's scaling bug)."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        return super().compute_loss(model, inputs) * self.current_gradient_accumulation_steps


class _MaskCoversPadding(MonitoredGRPOTrainer):
    """A batch whose completion mask (TRL's loss mask) covers the padding after EOS."""

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        output = super()._generate_and_score_completions(inputs)
        output["completion_mask"] = torch.ones_like(output["completion_mask"])
        return output


def test_preflight_finds_a_loss_scaled_once_too_few_times(model_dir, tmp_path) -> None:
    trainer = build(model_dir, tmp_path, cls=_LossNotDivided, monitor_settings=QUIET)
    result = preflight(trainer)
    assert result.abc.passed
    assert result.mask.passed
    assert result.accumulation is not None
    assert not result.accumulation.passed
    assert result.accumulation.multiple is not None
    assert "micro-batch count" in result.accumulation.multiple
    assert result.accumulation.norm_ratio == pytest.approx(2.0, rel=1e-2)


def test_preflight_finds_padding_in_the_loss_mask(model_dir, tmp_path) -> None:
    trainer = build(model_dir, tmp_path, cls=_MaskCoversPadding, monitor_settings=QUIET)
    result = preflight(trainer)
    assert not result.mask.passed
    assert "padding" in result.mask.diagnosis
    assert not result.passed


def test_trls_loss_variant_sets_what_the_clip_metrics_measure(model_dir, tmp_path, caplog):
    """GSPO (importance_sampling_level="sequence") weights by one ratio per sequence; CISPO's epsilon_high is a ratio
    cap (5 in TRL's docs), not an epsilon; SAPO and VESPO have no hard clip. The monitor the adapter makes measures
    that loss (ratio_level, clip, ratio_cap: published on grpo_run_info); a monitor handed in that measures
    another loss is reported at start-up, naming both."""
    cases = {
        "gspo": ({"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
                 {"ratio_level": "sequence", "clip": "ppo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
        "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, {"clip": "cap", "ratio_cap": 5.0}),
        "sapo": ({"loss_type": "sapo"}, {"clip": "none", "ratio_level": "token"}),
        "vespo": ({"loss_type": "vespo"}, {"clip": "none"}),
        "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, {"clip": "ppo", "clip_eps_high": 0.28}),
    }
    for name, (config, expected) in cases.items():
        trainer = build(model_dir, tmp_path / name, config=config)
        found = {k: getattr(trainer.monitor.config, k) for k in expected}
        info = [k for k in trainer.monitor.metrics() if k.startswith("grpo_run_info")]
        trainer.monitor.close()
        assert found == pytest.approx(expected), name
        assert f'ratio_level="{found.get("ratio_level", "token")}"' in info[0], name
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, close_linger_s=0)
    with caplog.at_level(logging.WARNING, logger="grpo_exporter"):
        build(model_dir, tmp_path / "mine", monitor=monitor, config={"loss_type": "cispo", "epsilon_high": 5.0})
    monitor.close()
    said = [r.getMessage() for r in caplog.records if "loss_type='cispo'" in r.getMessage()]
    assert said
    assert "clip='cap'" in said[0]
    assert "ratio_cap=5.0" in said[0]


def test_trls_clip_metric_names_are_in_its_source() -> None:
    """The TRL names the mapping and LOSS_CLIP rely on are the ones TRL 1.16 logs and accepts: a renamed metric or
    a new loss type fails here, not silently in a user's dashboard."""
    import inspect

    from trl.trainer import grpo_trainer

    from grpo_exporter.integrations.trl import LOSS_CLIP

    source = inspect.getsource(grpo_trainer)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio",
                 "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
                 "tools/call_frequency", "tools/failure_frequency"):
        assert f'"{name}"' in source or f'"{name.rsplit("/", 1)[0]}/' in source, name
    groups = re.findall(r"self\.loss_type in \[([^\]]+)\]", source)
    known = set(re.findall(r'self\.loss_type == "([a-z_]+)"', source)) | {
        t for group in groups for t in re.findall(r'"([a-z_]+)"', group)}
    assert known == set(LOSS_CLIP)


def test_several_generation_batches_of_one_optimizer_step_are_read_together(model_dir, tmp_path) -> None:
    """steps_per_generation=2 below gradient_accumulation_steps=4: TRL generates twice per optimizer step. Each
    generation batch observed alone overwrote the one before (a step's reward, pass@k and zero-variance readings
    were those of its last half); joined, they are the step's, as TRL logs them (its `reward` is the mean of the
    two generations' means, equal-sized: the pooled mean)."""
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, strict=True, close_linger_s=0)
    try:
        trainer = train(model_dir, tmp_path, monitor=monitor, config={
            "steps_per_generation": 2, "gradient_accumulation_steps": 4, "num_iterations": 1, "max_steps": 2})
        found = monitor.metrics()
    finally:
        monitor.close()
    assert trainer.state.global_step == 2
    assert found["grpo_groups_total"] == 2 * 2 * 16 // G  # 2 steps x 2 generations of 16 completions
    assert found["grpo_completions_total"] == 2 * 2 * 16
    assert found['grpo_reward_mean{component="total"}'] == pytest.approx(_logged(trainer, "reward")[-1], abs=1e-6)
    assert found["grpo_zero_variance_groups_ratio"] == pytest.approx(_logged(trainer, "frac_reward_zero_std")[-1])
    assert_mode_as_documented({k.partition("{")[0] for k in found}, "TRL, default (no vLLM)")


REPLAY_STEP_S = 20  # the replay's cadence: one optimizer step every 20 s, scraped every 30 s
REPLAY_STEPS = 40


def _replayed(model_dir: tuple[str, PreTrainedTokenizerFast], tmp_path: Path, config: dict[str, Any],
              monitor: GRPOMonitor | None = None) -> tuple[MonitoredGRPOTrainer, dict[str, dict[str, int]]]:
    """Train with TRL for REPLAY_STEPS optimizer steps, scraping the monitor after each at a REPLAY_STEP_S cadence,
    and judge the scrapes with the production rules for that cadence in promtool (tests/worlds.py); returns the
    trainer and run -> alert -> firing episodes."""
    from transformers import TrainerCallback

    from grpo_exporter.mixin.config import MixinConfig
    from replay import JOB, SCRAPE_S, Timeline, _exposed, rule_metric_names
    from worlds import TAIL_S, _fired

    mixin = MixinConfig(step_seconds=REPLAY_STEP_S)
    keep = rule_metric_names(mixin)
    scrapes = (REPLAY_STEPS * REPLAY_STEP_S + TAIL_S) // SCRAPE_S
    timeline, instance = Timeline(scrapes), "trl:9887"
    up = f'up{{instance="{instance}",job="{JOB}"}}'

    class Scrape(TrainerCallback):  # type: ignore[misc]
        """After the adapter's own on_step_end (added after it): the state a scrape sees until the next step."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = state.global_step - 1
            mon.wait_for_workers()
            seen = _exposed(mon, keep, step * REPLAY_STEP_S, instance) | {up: 1.0}
            for i in range(-(-step * REPLAY_STEP_S // SCRAPE_S), -(-(step + 1) * REPLAY_STEP_S // SCRAPE_S)):
                timeline.put(i, seen)

    settings = {"port": None, "guard": "off", "close_linger_s": 0.0}
    trainer = build(model_dir, tmp_path, monitor=monitor, monitor_settings=None if monitor else settings,
                    config={"max_steps": REPLAY_STEPS, "learning_rate": 1e-3, **config})
    mon = trainer.monitor
    trainer.add_callback(Scrape())
    try:
        trainer.train()
    finally:
        mon.close()
    end = -(-REPLAY_STEPS * REPLAY_STEP_S // SCRAPE_S)
    timeline.put(end, _exposed(mon, keep, (REPLAY_STEPS - 1) * REPLAY_STEP_S, instance) | {up: 1.0})
    for i in range(end + 1, scrapes):
        timeline.series[up][i] = 0.0
    folder = tmp_path / "promtool"
    folder.mkdir()
    return trainer, _fired(mixin, timeline, folder)


# lr 1e-4: TRL's own clip_ratio/* read ~0.1 of sequences clipped on the off-policy steps, GSPO's published regime
# (~15% of tokens); at 1e-3 they read ~0.5 and GRPOClipFractionHigh (the seed's 20%) fires, rightly: updates too large
GSPO_BATCH = {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4, "scale_rewards": "batch",
              "steps_per_generation": 4, "gradient_accumulation_steps": 2, "num_iterations": 1, "learning_rate": 1e-4}


def test_a_healthy_gspo_run_with_batch_scaling_pages_nothing_through_the_production_rules(model_dir, tmp_path):
    """TRL's second configuration, replayed: GSPO (sequence-level ratio, epsilon 3e-4 / 4e-4), scale_rewards="batch",
    steps_per_generation=4 over gradient_accumulation_steps=2 (old log-probs computed; each generation batch
    trains two optimizer steps, the second off-policy). 40 steps at 20 s, the production rules for that cadence:
    nothing fires. The same run watched by a monitor that reads per-token ratios and group-normalised advantages
    (the reading before TRL's loss settings reached the monitor) pages, so the replay can fail."""
    trainer, fired = _replayed(model_dir, tmp_path / "made", GSPO_BATCH)
    assert trainer.monitor.config.ratio_level == "sequence"
    assert trainer.monitor.config.advantage_norm == "batch"
    assert fired == {}
    naive = GRPOMonitor(run="trl-test", group_size=G, clip_eps=(3e-4, 4e-4), port=None, guard="off",
                        close_linger_s=0.0)
    _, fired = _replayed(model_dir, tmp_path / "naive", GSPO_BATCH, monitor=naive)
    assert fired.get("trl-test"), fired


def test_trls_off_policy_sequence_mask_leaves_the_sequences_it_drops_out_of_the_loss_tokens(
    model_dir, tmp_path, monkeypatch, caplog
):
    """off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence mask) drops negative-advantage sequences
    whose mean KL to the sampling policy exceeds it: they train nothing. TRL's own get_off_policy_mask is
    recorded where TRL's _compute_loss calls it; the monitor's negative-advantage loss tokens are those TRL kept,
    and at least one sequence was dropped (at lr 1e-2 the second iteration moves the policy). With
    top_entropy_quantile < 1, the notice says the ratio metrics count the tokens that mask leaves out."""
    from trl import GRPOTrainer

    theirs: list[tuple[Tensor, Tensor, Tensor]] = []
    real = GRPOTrainer.get_off_policy_mask

    def recorded(**kwargs: Any) -> Tensor:
        kept = real(**kwargs)
        if sys._getframe(1).f_code.co_name == "_compute_loss":  # TRL's own call, not the adapter's
            theirs.append((kwargs["advantages"].detach().clone(), kwargs["mask"].detach().clone(), kept.clone()))
        return kept

    monkeypatch.setattr(GRPOTrainer, "get_off_policy_mask", staticmethod(recorded))
    caplog.set_level(logging.WARNING, logger="grpo_exporter")
    trainer = train(model_dir, tmp_path, config={"off_policy_mask_threshold": 0.0, "top_entropy_quantile": 0.5},
                    monitor_settings={"port": None, "close_linger_s": 0, "strict": True})
    assert theirs
    negative = [(m * k * (a < 0)).sum() for a, m, k in theirs]
    dropped = [(m * (1 - k) * (a < 0)).sum() for a, m, k in theirs]
    assert float(sum(dropped)) > 0
    got = trainer.monitor.metrics()['grpo_update_tokens_total{advantage_sign="negative"}']
    assert got == float(sum(negative))
    said = [r.getMessage() for r in caplog.records if "top_entropy_quantile" in r.getMessage()]
    assert len(said) == 1
    assert "count every completion token" in said[0]


def test_trls_tool_counts_are_results_4_and_5_of_its_tool_loop() -> None:
    """The adapter reads TRL's tool calls and failures from ``_tool_call_loop``'s return value, by position: TRL's
    own source must return (..., tool_call_count, tool_failure_count, ...) there."""
    import ast
    import inspect
    import textwrap

    from trl import GRPOTrainer

    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._tool_call_loop)))
    loop = tree.body[0]
    assert isinstance(loop, ast.FunctionDef)
    nested = {id(n) for d in ast.walk(loop) if d is not loop and isinstance(d, ast.AsyncFunctionDef | ast.FunctionDef)
              for n in ast.walk(d)}
    returned = [n.value for n in ast.walk(loop) if isinstance(n, ast.Return) and id(n) not in nested]
    assert len(returned) == 1
    assert isinstance(returned[0], ast.Tuple)
    names = [e.id if isinstance(e, ast.Name) else "" for e in returned[0].elts]
    assert names[4:6] == ["tool_call_count", "tool_failure_count"], names


def test_tool_calls_and_failures_are_taken_as_trl_counts_them(model_dir, tmp_path, monkeypatch) -> None:
    """A tool-calling run (TRL's ``tools``): the tool calls and failures TRL's loop counts are the monitor's
    counters, over both generation batches of a step (steps_per_generation=2 below gradient accumulation 4), and
    TRL's own ``tools/call_frequency`` and ``tools/failure_frequency`` read the same from them."""
    from trl import GRPOTrainer

    counted: list[tuple[int, int]] = []
    tool_tokens: list[int] = []

    def tool_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's loop, its tools run elsewhere: a completion calls one tool per 'two' it says, every third fails."""
        calls = sum(ids.count(tok_two) for ids in completion_ids)
        failures = calls // 3
        counted.append((calls, failures))
        # the token after each 'two' is the tool's answer: 0 in TRL's tool_mask, off its loss, out of its lengths
        mask = [[0 if j and ids[j - 1] == tok_two else 1 for j in range(len(ids))] for ids in completion_ids]
        tool_tokens.append(sum(m.count(0) for m in mask))
        return mask, completions, completion_ids, logprobs, calls, failures, [[] for _ in completion_ids]

    tok_two = model_dir[1].convert_tokens_to_ids("two")
    monkeypatch.setattr(GRPOTrainer, "_tool_call_loop", tool_loop)
    monitor = GRPOMonitor(run="trl-test", group_size=G, port=None, strict=True, close_linger_s=0)
    try:
        trainer = build(model_dir, tmp_path, monitor=monitor, config={
            "steps_per_generation": 2, "gradient_accumulation_steps": 4, "num_iterations": 1, "max_steps": 2,
            "temperature": 3.0})
        trainer.tools = [len]  # TRL takes the tool path when it has tools; the loop above stands in for running them
        trainer.train()
        found = monitor.metrics()
    finally:
        monitor.close()
    calls, failures = sum(c for c, _ in counted), sum(f for _, f in counted)
    assert len(counted) == 4  # 2 steps x 2 generation batches
    assert calls > 0
    assert failures > 0
    assert found["grpo_tool_calls_total"] == calls
    assert found["grpo_tool_call_failures_total"] == failures
    frequency = _logged(trainer, "tools/call_frequency")  # TRL: one mean per logging step over its generations
    assert sum(frequency) * 2 * 16 == pytest.approx(calls)  # 16 completions per generation, 2 per step
    assert found["grpo_completions_total"] == 2 * 2 * 16
    # TRL's tool spans reach the mask audit as such: off its loss, out of its lengths, no fault of either kind
    assert sum(tool_tokens) > 0
    assert found["grpo_loss_mask_tool_tokens_total"] == 0
    assert found["grpo_completion_length_tool_span_sequences_total"] == 0
    assert found["grpo_loss_mask_length_mismatch_sequences_total"] == 0


def test_trls_async_trainer_is_refused_naming_what_is_missing() -> None:
    """TRL's AsyncGRPOTrainer (trl.experimental) is no GRPOTrainer: none of the methods the adapter wraps runs in
    it. Mixing the adapter into it fails at class definition naming the trainer and the way to monitor instead,
    never a trainer that trains unmonitored; any other base is refused too."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from grpo_exporter.integrations.trl import GRPOMonitorMixin

    with pytest.raises(IntegrationError, match=r"AsyncGRPOTrainer is not monitored.*tree-packed.*use_vllm=True"):
        type("MonitoredAsync", (GRPOMonitorMixin, AsyncGRPOTrainer), {})
    from transformers import Trainer

    with pytest.raises(IntegrationError, match=r"mix it in before a GRPOTrainer subclass.*transformers"):
        type("MonitoredPlain", (GRPOMonitorMixin, Trainer), {})


def test_trls_evaluation_is_the_regression_set_when_asked(model_dir, tmp_path) -> None:
    """``regression_eval``: each evaluate() TRL runs during training is one observe_regression of the verifier's
    verdicts on every eval completion; its accuracy is TRL's own eval reward mean of the 0/1 verifier."""
    # 4 prompts x G = two eval batches of 8: TRL's eval means (a mean of batch means) weigh completions alike
    held = Dataset.from_dict({"prompt": [f"add {a} plus {b}" for a, b in itertools.pairwise(WORDS[2:7])]})
    trainer = build(model_dir, tmp_path, regression_eval=True, eval_dataset=held, monitor_settings=QUIET,
                    config={"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 8})
    trainer.train()
    evaluations = _logged(trainer, "eval_rewards/accuracy/mean")
    assert len(evaluations) == 3  # one per optimizer step
    m = trainer.monitor.metrics()
    size = len(held) * G
    assert m["grpo_regression_evaluated_completions"] == size
    assert m["grpo_regression_completions_total"] == 3 * size
    assert m["grpo_regression_accuracy_ratio"] == pytest.approx(evaluations[-1], abs=1e-6)
    assert m["grpo_regression_correct_completions_total"] == pytest.approx(size * sum(evaluations), abs=1e-4)
    anchor = m['grpo_run_anchor{metric="grpo_regression_accuracy_ratio",labels=""}']
    assert anchor == pytest.approx(sum(evaluations) / 3, abs=1e-6)  # the early window: its three evaluations
    assert m.get('grpo_exporter_errors_total{stage="rollout"}', 0.0) == 0.0


def test_regression_eval_needs_a_verifier(model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="regression_eval: the regression set's accuracy needs a verifier"):
        build(model_dir, tmp_path, regression_eval=True, verifier=None)
