"""The preflight checks on a TRL ``GRPOTrainer``, in one call, before ``train()``.

.. code-block:: python

    from grpo_exporter.integrations.trl_preflight import preflight
    trainer = MonitoredGRPOTrainer(...)          # or any trl.GRPOTrainer
    result = preflight(trainer)                  # publishes grpo_preflight_check_passed on trainer.monitor
    print(result.render())
    if not result.passed:
        raise SystemExit("fix the probability path / the mask before training")

It takes a few prompts of the training set, each ``num_generations`` times, and lets TRL itself generate and
score them (``_generate_and_score_completions``), so every check reads what training will read:

* **A/B/C consistency** on that batch: A and B are TRL's own log-prob path
  (``_get_per_token_logps_and_entropies``) twice, in training mode, as the loss computes it; C is the engine's
  log-probs when TRL has them (vLLM, or a ``rollout_func``: ``sampling_per_token_logps``), else, with HF
  generate sampling from this very model, the same path in inference mode. Loss mask: ``completion_mask``
  (and ``tool_mask``); clip range: TRL's ``epsilon``/``epsilon_high``.
* **The mask table** of the first sample that ended in EOS: sources from the token ids alone (prompt where
  ``prompt_mask``, completion up to and including the first EOS, tool where ``tool_mask`` is 0, padding
  after), attention and loss masks as TRL built them, the sample's advantage.
* **Gradient-accumulation equivalence**: TRL's ``compute_loss`` (your override included) on the whole batch
  with no accumulation, against the same batch in ``gradient_accumulation_steps`` micro-batches as training
  scales them (``current_gradient_accumulation_steps`` and ``steps_per_generation`` set for each path). Run in
  training mode; skipped when A != B (a model that is not repeatable gives two different gradients anyway).
* **Plain-NLL reach** (``reach=True``, off by default: it trains a deep copy of the model, twice its memory):
  NLL on the batch's completion tokens through TRL's log-prob path must halve within ``reach_steps`` steps.

The trainer is left as found: parameters, gradients, training mode, RNG state, TRL's logged metrics; with
:class:`~grpo_exporter.integrations.trl.MonitoredGRPOTrainer` nothing of the preflight batch reaches the
step metrics (only the verdicts, as ``grpo_preflight_check_passed{check}``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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
from grpo_exporter.runtime.monitor import GRPOMonitor


@dataclass(frozen=True)
class TRLPreflight:
    """The reports of :func:`preflight`; a check not run is None, with why in ``skipped``."""

    abc: ABCReport
    mask: MaskTableReport
    accumulation: AccumulationReport | None
    reach: ReachReport | None
    skipped: dict[str, str]

    @property
    def reports(self) -> list[ABCReport | MaskTableReport | AccumulationReport | ReachReport]:
        return [r for r in (self.abc, self.mask, self.accumulation, self.reach) if r is not None]

    @property
    def passed(self) -> bool:
        """Every check that ran passed."""
        return all(r.passed for r in self.reports)

    def render(self) -> str:
        verdicts = {"passed": "pass", "failed": "FAIL", "cannot_tell": "CANNOT TELL"}
        lines = [f"{r.CHECK}: {verdicts[r.outcome]}: {r.diagnosis}" for r in self.reports]
        lines += [f"{check}: not run: {why}" for check, why in self.skipped.items()]
        return "\n".join(lines) + "\n\n" + self.mask.render()


@contextlib.contextmanager
def _left_as_found(trainer: Any) -> Iterator[None]:
    """Training mode, RNG, TRL's logged metrics, the accumulation settings and the adapter's observation are
    restored on exit; the adapter observes nothing meanwhile."""
    model = trainer.model
    training = model.training
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    metrics = copy.deepcopy(getattr(trainer, "_metrics", None))
    accumulation = trainer.__dict__.get("current_gradient_accumulation_steps")
    steps_per_generation = trainer.args.steps_per_generation
    tokens_seen = getattr(trainer.state, "num_input_tokens_seen", None)
    trainer._grpo_preflight = True
    try:
        yield
    finally:
        trainer._grpo_preflight = False
        model.train(training)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if metrics is not None:
            trainer._metrics = metrics
        if accumulation is None:
            trainer.__dict__.pop("current_gradient_accumulation_steps", None)
        else:
            trainer.current_gradient_accumulation_steps = accumulation
        trainer.args.steps_per_generation = steps_per_generation
        if tokens_seen is not None:
            trainer.state.num_input_tokens_seen = tokens_seen
        for p in model.parameters():
            p.grad = None


def _batch(trainer: Any, prompts: int) -> list[dict[str, Any]]:
    dataset = trainer.train_dataset
    if dataset is None or len(dataset) == 0:
        raise ValueError("preflight: trainer.train_dataset: expected a non-empty dataset, got none")
    rows = [dataset[i % len(dataset)] for i in range(prompts)]
    return [row for row in rows for _ in range(trainer.num_generations)]  # TRL's layout: G in a row per prompt


def _sequences(batch: dict[str, Any]) -> tuple[Tensor, Tensor, int, Tensor]:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    loss = batch["completion_mask"].bool()
    if "tool_mask" in batch:
        loss = loss & batch["tool_mask"].bool()
    return ids, attention, batch["completion_ids"].shape[1], loss


def _mask_table(trainer: Any, batch: dict[str, Any], loss: Tensor) -> MaskTableReport:
    tok = trainer.processing_class
    eos = getattr(tok, "eos_token_id", None)
    completions = batch["completion_ids"]
    ends = (completions == eos) if eos is not None else torch.zeros_like(completions, dtype=torch.bool)
    row = next((i for i in range(completions.shape[0]) if bool(ends[i].any())), 0)
    first_eos = int(ends[row].int().argmax()) if bool(ends[row].any()) else completions.shape[1] - 1
    tool = batch["tool_mask"][row].bool() if "tool_mask" in batch else None
    sources = ["prompt" if m else "padding" for m in batch["prompt_mask"][row].tolist()]
    for t in range(completions.shape[1]):
        inside = t <= first_eos
        sources.append("padding" if not inside else "tool" if tool is not None and not bool(tool[t]) else "completion")
    ids = torch.cat([batch["prompt_ids"][row], completions[row]]).tolist()
    attention = torch.cat([batch["prompt_mask"][row], batch["completion_mask"][row]]).tolist()
    loss_row = [0] * batch["prompt_ids"].shape[1] + loss[row].int().tolist()
    decode = (lambda t: tok.decode([t])) if hasattr(tok, "decode") else None
    return mask_table(ids, attention, loss_row, sources, float(batch["advantages"][row]), decode, eos, True)


def _slice(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    n = batch["completion_ids"].shape[0]
    return {k: v[rows] if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == n else v for k, v in batch.items()}


def _accumulation(trainer: Any, batch: dict[str, Any], seed: int, norm_rtol: float) -> AccumulationReport:
    model = trainer.model
    model.train()
    k = max(1, int(trainer.args.gradient_accumulation_steps))
    n = batch["completion_ids"].shape[0]
    size = -(-n // k)
    slices = [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def loss_with(steps: int, inputs: dict[str, Any]) -> Tensor:
        trainer.current_gradient_accumulation_steps = steps
        trainer.args.steps_per_generation = steps
        return trainer.compute_loss(model, inputs)

    def sliced(part: slice) -> Tensor:
        return loss_with(len(slices), _slice(batch, part))

    return accumulation_equivalence(
        model.parameters(), lambda: loss_with(1, batch),
        [functools.partial(sliced, s) for s in slices],
        multiples={"world size": float(trainer.accelerator.num_processes)} if trainer.accelerator.num_processes > 1
        else None, seed=seed, norm_rtol=norm_rtol,
    )


def preflight(trainer: Any, prompts: int | None = None, *, reach: bool = False, reach_steps: int = 50,
              accumulation_rtol: float = 1e-2, publish: bool = True, seed: int = 0) -> TRLPreflight:
    """Run the preflight checks on ``trainer`` (a ``trl.GRPOTrainer``) before ``train()``; ``prompts``
    prompts of its training set (default: a per-device batch's worth, at least 1), each ``num_generations``
    times. ``publish``: set ``grpo_preflight_check_passed`` on ``trainer.monitor`` when it has one.

    ``accumulation_rtol``: the relative gradient difference the accumulation check tolerates. A model's
    kernels reduce in an order that depends on the batch size (fp32 on CPU: ~1e-3 on a tiny random model), so
    1% by default; a scaling bug is an integer multiple (100% for two micro-batches) and a wrong denominator
    differs by the share of tokens between micro-batches, both far above it."""
    count = prompts or max(1, int(trainer.args.per_device_train_batch_size) // int(trainer.num_generations))
    skipped: dict[str, str] = {}
    model = trainer.model
    with _left_as_found(trainer):
        model.train()
        batch = trainer._generate_and_score_completions(_batch(trainer, count))
        ids, attention, width, loss = _sequences(batch)

        def trainer_logprobs() -> Tensor:
            model.train()
            return trainer._get_per_token_logps_and_entropies(model, ids, attention, width)[0]

        def engine_logprobs() -> Tensor:
            engine = batch.get("sampling_per_token_logps")
            if engine is not None:
                return engine
            model.eval()
            return trainer._get_per_token_logps_and_entropies(model, ids, attention, width)[0]

        abc = abc_consistency(trainer_logprobs, engine_logprobs, loss,
                              clip_eps=(trainer.epsilon_low, trainer.epsilon_high), seed=seed)
        mask = _mask_table(trainer, batch, loss)
        accumulation = None
        if abc.repeat.max > 1e-4 or abc.tokens == 0:
            skipped["accumulation_equivalence"] = "A != B: the trainer is not repeatable (fix that first)"
        else:
            accumulation = _accumulation(trainer, batch, seed, accumulation_rtol)
        result_reach = None
        if reach:
            twin = copy.deepcopy(model).train()
            result_reach = nll_reach(
                lambda: trainer._get_per_token_logps_and_entropies(twin, ids, attention, width)[0], loss,
                twin.parameters(), steps=reach_steps, seed=seed,
            )
            del twin
        else:
            skipped["nll_reach"] = "reach=False (it trains a copy of the model)"
    result = TRLPreflight(abc, mask, accumulation, result_reach, skipped)
    monitor = getattr(trainer, "monitor", None)
    if publish and isinstance(monitor, GRPOMonitor):
        for report in result.reports:
            monitor.publish_check(report)
    return result
