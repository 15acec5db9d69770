"""GRPOMonitor: the public face. A training loop hands it each step's tensors; Prometheus scrapes the result.

* ``observe_rollout`` once per rollout batch: rewards, groups, outcomes, engine vs trainer log-probs, masks.
* ``observe_update`` for every optimizer (micro)step: the micro-steps of one optimizer step are kept (as
  references, validated at once) and computed together, in one pass with one host transfer, when the step
  ends: at ``clip_grad_norm_``, at the next step's first observe call, or at ``flush``/``close``.
* ``clip_grad_norm_`` clips like ``torch.nn.utils.clip_grad_norm_`` and records the norm before and after.

Inside a training process the monitor never crashes or stalls training: an exception is caught, counted in
``grpo_exporter_errors_total{stage}``, logged at most once per stage per minute, and training goes on;
``strict=True`` raises instead. The layer-1 guard is the one deliberate exception: with ``guard="raise"`` a
failed stop criterion raises :class:`~grpo_exporter.guard.TrainingSignalError` at the end of observe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry
from torch import Tensor

from grpo_exporter import __version__, catalog, distributed, guard
from grpo_exporter.collector import CatalogCollector
from grpo_exporter.edit_distance import median_normalized_edit_distance, rows_to_groups
from grpo_exporter.functional.diversity import retrieval_accuracy
from grpo_exporter.functional.groups import Groups
from grpo_exporter.inputs import InputError, StepInputs
from grpo_exporter.monitor_config import MonitorConfig
from grpo_exporter.publication import Publication
from grpo_exporter.server import MetricsServer
from grpo_exporter.step import ROLLOUT_BLOCKS, UPDATE_BLOCKS, compute_step_carrying

log = logging.getLogger("grpo_exporter")

PARAM_SAMPLE_TENSORS = 16
PARAM_SAMPLE_ELEMENTS = 65_536
_LOG_EVERY_SECONDS = 60.0


class GRPOMonitor:
    """Health metrics of a GRPO/PPO run, published with prometheus-client.

    ``GRPOMonitor(run="exp-42", group_size=16, clip_eps=(0.2, 0.28), port=0)``; any
    :class:`~grpo_exporter.monitor_config.MonitorConfig` field is a keyword, ``config_file`` reads YAML and
    ``GRPO_EXPORTER_*`` variables apply. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        run: str | None = None,
        *,
        config: MonitorConfig | None = None,
        config_file: str | Path | None = None,
        registry: CollectorRegistry | None = None,
        **settings: Any,
    ) -> None:
        if config is None:
            config = MonitorConfig.load(config_file, **({"run": run} if run is not None else {}), **settings)
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._publication = Publication()
        self._collector = CatalogCollector(
            self._publication, config.run, self.registry, on_error=lambda exc: self._error("scrape", exc)
        )
        self._rank, self._world = distributed.world()
        self._reduce = distributed.all_reduce_entries if self._world > 1 else None
        self._solve_rates: Tensor | None = None
        self._overall_rate: Tensor = torch.tensor(config.solve_rate_prior, dtype=torch.float64)
        self._step: int | None = None
        self._pending: list[StepInputs] = []
        self._grad: dict[str, Any] = {}
        self._param_snapshot: list[Tensor] | None = None
        self._components: list[str] = []
        self._last_log: dict[str, float] = {}
        self._deferred: list[guard.Violation] = []
        self._workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-exporter-edit-distance")
        self._edit_job: Future[None] | None = None
        self._publication.merge(self._static_values())
        self._publication.publish()
        self._server: MetricsServer | None = None
        if self._rank == 0 and config.port is not None:
            ProcessCollector(registry=self.registry)
            self._server = MetricsServer(
                self.registry, config.host, config.port, config.tls_cert, config.tls_key,
                config.basic_auth_user, config.basic_auth_password_hash,
            )

    # ---- public API ------------------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The bound port (the free one picked for ``port=0``), or None when not serving."""
        return self._server.port if self._server else None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server else None

    def observe_rollout(
        self,
        step: int,
        *,
        rewards: Tensor | None = None,
        group_ids: Tensor | None = None,
        correct: Tensor | None = None,
        truncated: Tensor | None = None,
        reward_components: Mapping[str, Tensor] | None = None,
        rollout_logprobs: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        loss_mask: Tensor | None = None,
        completion_lengths: Tensor | None = None,
        completion_ids: Tensor | None = None,
        completion_mask: Tensor | None = None,
        prompt_ids: Tensor | None = None,
    ) -> None:
        """Rollout-level metrics, once per rollout batch (one host transfer)."""
        violations: list[guard.Violation] = []
        with self._stage("rollout"):
            self._advance(step)
            inputs = StepInputs(
                rewards=rewards, group_ids=group_ids, correct=correct, truncated=truncated,
                reward_components=self._capped(reward_components or {}), rollout_logprobs=rollout_logprobs,
                old_logprobs=old_logprobs, loss_mask=loss_mask, completion_lengths=completion_lengths,
                completion_ids=completion_ids, completion_mask=completion_mask,
            )
            slots = self._solve_rate_slots(inputs, prompt_ids)
            if slots is not None and self._solve_rates is not None:
                prior = solve_rate_prior(self._solve_rates, slots, self._overall_rate)
                inputs = dataclasses.replace(inputs, prompt_solve_rate=prior)
            carry = self._edit_distance_carry(inputs)
            result = compute_step_carrying(inputs, self.config, carry, self.config.strict, self._reduce, ROLLOUT_BLOCKS)
            self._count_block_errors("rollout", result.errors)
            metrics = result.metrics
            if slots is not None and self._solve_rates is not None and inputs.correct is not None:
                groups = inputs.groups(self.config.group_size)
                keep = 0.5 ** (1.0 / self.config.solve_rate_halflife)
                update_solve_rates(self._solve_rates, slots, prior, inputs.correct, groups, keep)
                batch_rate = inputs.correct.double().mean()
                self._overall_rate = keep * self._overall_rate + (1.0 - keep) * batch_rate
            if inputs.completion_ids is not None:
                self._start_edit_distance(result.carried, inputs.completion_ids.shape[1])
            self._publication.merge(metrics, result.families)
            violations = self._check(metrics)
        self._enforce(violations)

    def observe_update(
        self,
        step: int,
        *,
        logprobs: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        advantages: Tensor | None = None,
        loss_mask: Tensor | None = None,
        entropy: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        on_policy: bool | None = None,
        **more: Any,
    ) -> None:
        """Update-level tensors of one optimizer (micro)step, accumulated into the step (validated now,
        computed when the step ends).

        ``more`` takes any other :class:`~grpo_exporter.inputs.StepInputs` field of the update (``rewards``,
        ``group_ids`` and ``completion_lengths`` for the advantage bound and mask audit, ``loss``,
        ``policy_version``, ``rollout_policy_version``).
        """
        with self._stage("update"):
            self._advance(step)
            self._pending.append(
                StepInputs(
                    logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask,
                    entropy=entropy, ref_logprobs=ref_logprobs, on_policy=on_policy, **more,
                )
            )
        self._enforce([])

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter] | Tensor, max_norm: float, norm_type: float = 2.0
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that records the norm before and after clipping; ends the step.

        Returns the pre-clip total norm, like torch. The clipping itself always happens, even when recording
        fails.
        """
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        pre_clip = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        violations: list[guard.Violation] = []
        with self._stage("grad"):
            current = _sample_parameters(params)
            self._grad = {"grad_norm_pre_clip": pre_clip.detach(), "max_grad_norm": float(max_norm)}
            before = self._param_snapshot
            if before is not None and [t.shape for t in before] == [t.shape for t in current]:
                # taken at the previous clip, before that step's optimizer.step(): the update it made
                self._grad |= {"params_before": before, "params_after": current}
            violations = self._finish_update()
            self._param_snapshot = current
        self._enforce(violations)
        return pre_clip

    def observe_retrieval(self, step: int, scores: Tensor, own_prompt: Tensor) -> None:
        """Retrieval accuracy: ``scores`` (N, P) of each completion under each of the batch's P prompts (e.g.
        log-probs from one extra forward pass), ``own_prompt`` (N,) the column of its own prompt. Call every
        K steps; chance level 1/P is published beside it."""
        with self._stage("rollout"):
            self._advance(step)
            if scores.dim() != 2 or own_prompt.shape != scores.shape[:1]:
                raise ValueError(
                    f"`scores`/`own_prompt`: expected (N, P) and (N,), got {tuple(scores.shape)} and "
                    f"{tuple(own_prompt.shape)}"
                )
            r = retrieval_accuracy(scores, own_prompt)
            value, present = torch.stack([r.value.double(), r.present.double()]).tolist()
            accuracy = catalog.metric("grpo_retrieval_accuracy_ratio")
            values = {catalog.metric("grpo_retrieval_chance_ratio").key(): 1.0 / scores.shape[1]}
            if present:
                values[accuracy.key()] = value
            self._publication.merge(values, [accuracy.name])

    def flush(self) -> None:
        """Compute and publish the pending update step now."""
        violations: list[guard.Violation] = []
        with self._stage("update"):
            violations = self._finish_update()
        self._enforce(violations)

    def metrics(self) -> Mapping[str, float]:
        """The published values (sample key -> value, without the run label): what a scrape would see."""
        return self._publication.snapshot()

    def close(self) -> None:
        """Publish what is pending and stop serving. Idempotent."""
        with contextlib.suppress(guard.TrainingSignalError):
            self.flush()
        self._workers.shutdown(wait=True)
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> GRPOMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- step life cycle -------------------------------------------------------------------------------

    def _advance(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"`step`: expected a Python int, got {type(step).__name__} {step!r}")
        if self._step is not None and step != self._step and self._pending:
            self._deferred.extend(self._finish_update())
        if step != self._step:
            self._publication.add({"grpo_steps_total": 1.0})
        self._step = step
        self._publication.merge({"grpo_last_step": float(step), "grpo_last_step_timestamp_seconds": time.time()})

    def _finish_update(self) -> list[guard.Violation]:
        if not self._pending and not self._grad:
            return []
        inputs = _concatenate(self._pending, self._grad)
        self._pending, self._grad = [], {}
        result = compute_step_carrying(inputs, self.config, {}, self.config.strict, self._reduce, UPDATE_BLOCKS)
        self._count_block_errors("update", result.errors)
        self._publication.merge(result.metrics, result.families)
        return self._check(result.metrics)

    # ---- helpers ---------------------------------------------------------------------------------------

    def _static_values(self) -> dict[str, float]:
        cfg = self.config
        values = {
            catalog.metric("grpo_build_info").key(version=__version__, torch_version=torch.__version__): 1.0,
            catalog.metric("grpo_run_info").key(
                group_size=str(cfg.group_size), clip_eps_low=repr(cfg.clip_eps_low),
                clip_eps_high=repr(cfg.clip_eps_high), advantage_norm=cfg.advantage_norm,
            ): 1.0,
        }
        baseline = catalog.metric("grpo_reference_baseline")
        for key, value in self.config.reference_baseline.items():
            name, labels = catalog.parse_key(key)
            text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            values[baseline.key(metric=name, labels=text.replace('"', "'"))] = float(value)
        return values

    def _capped(self, components: Mapping[str, Tensor]) -> dict[str, Tensor]:
        kept: dict[str, Tensor] = {}
        dropped = 0
        for name, value in components.items():
            if name not in self._components and len(self._components) < self.config.max_reward_components:
                self._components.append(name)
            if name in self._components:
                kept[name] = value
            else:
                dropped += 1
        if dropped:
            self._publication.add({"grpo_dropped_reward_components_total": float(dropped)})
        return kept

    def _solve_rate_slots(self, inputs: StepInputs, prompt_ids: Tensor | None) -> Tensor | None:
        """Slots of the device-side solve-rate table for this batch's prompts (None without history inputs)."""
        if prompt_ids is None or inputs.correct is None:
            return None
        if prompt_ids.shape != inputs.correct.shape or prompt_ids.is_floating_point():
            raise InputError("prompt_ids", f"an integer tensor of shape {tuple(inputs.correct.shape)} like `correct`",
                             f"dtype {prompt_ids.dtype}, shape {tuple(prompt_ids.shape)}")
        if self._solve_rates is None:
            self._solve_rates = torch.full((self.config.solve_rate_slots,), math.nan, device=inputs.device)
            self._overall_rate = torch.tensor(self.config.solve_rate_prior, dtype=torch.float64, device=inputs.device)
        return prompt_ids.long().remainder(self.config.solve_rate_slots)

    def _edit_distance_carry(self, inputs: StepInputs) -> dict[str, Tensor]:
        k = self.config.edit_distance_groups
        lengths = inputs.completion_lengths
        if lengths is None and inputs.completion_mask is not None:
            lengths = inputs.completion_mask.sum(dim=1)
        if k == 0 or inputs.completion_ids is None or lengths is None:
            return {}
        groups = inputs.groups(self.config.group_size)
        if groups is None:
            return {}
        rows = torch.argsort(groups.index, stable=True)[: k * self.config.group_size]
        return {"ed_ids": inputs.completion_ids[rows], "ed_lengths": lengths[rows], "ed_group": groups.index[rows]}

    def _start_edit_distance(self, carried: dict[str, list[float]], width: int) -> None:
        """Hand the sampled groups (rows of ``width`` tokens) to the worker thread; skipped while the previous
        job still runs."""
        if "ed_ids" not in carried or (self._edit_job is not None and not self._edit_job.done()):
            return
        groups = rows_to_groups(carried["ed_ids"], carried["ed_lengths"], carried["ed_group"], width)
        self._edit_job = self._workers.submit(self._edit_distance_job, groups)

    def _edit_distance_job(self, groups: list[list[list[int]]]) -> None:
        try:
            median = median_normalized_edit_distance(groups)
            family = catalog.metric("grpo_edit_distance_median_ratio")
            with self._publication.writing:
                self._publication.merge({} if median is None else {family.key(): median}, [family.name])
                self._publication.publish()
        except Exception as exc:
            with self._publication.writing:
                self._error("rollout", exc, "edit distance worker")
                self._publication.publish()

    def wait_for_workers(self, timeout: float = 10.0) -> None:
        """Block until the off-thread edit-distance job (if any) is done; for tests and shutdown."""
        if self._edit_job is not None:
            self._edit_job.result(timeout=timeout)

    def _check(self, metrics: Mapping[str, float]) -> list[guard.Violation]:
        if self.config.guard == "off":
            return []
        return guard.check(metrics, self.config.engine_gap_stop_nats, self.config.onpolicy_clip_stop_ratio)

    def _enforce(self, violations: list[guard.Violation]) -> None:
        violations, self._deferred = [*self._deferred, *violations], []
        if not violations:
            return
        lines = [v.line(self.config.run, self._step, self.config.runbook_url) for v in violations]
        if self.config.guard == "raise":
            raise guard.TrainingSignalError(violations, lines)
        for violation, line in zip(violations, lines, strict=True):
            if self._due(f"guard:{violation.alert}"):
                log.warning(line)

    def _count_block_errors(self, stage: str, errors: list[tuple[str, Exception]]) -> None:
        for block, exc in errors:
            self._error(stage, exc, f"metric block {block!r}")

    def _error(self, stage: str, exc: BaseException, where: str = "") -> None:
        self._publication.add({catalog.metric("grpo_exporter_errors_total").key(stage=stage): 1.0})
        if self._due(f"error:{stage}"):
            log.warning(
                "grpo-exporter: %s failed in stage %r%s (training continues; counted in "
                "grpo_exporter_errors_total; further errors of this stage are logged at most once a minute)",
                type(exc).__name__, stage, f" ({where})" if where else "", exc_info=exc,
            )

    def _due(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._last_log.get(what, -math.inf) < _LOG_EVERY_SECONDS:
            return False
        self._last_log[what] = now
        return True

    @contextlib.contextmanager
    def _stage(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        with self._publication.writing:
            try:
                yield
            except guard.TrainingSignalError:
                raise
            except Exception as exc:
                self._error(stage, exc)
                if self.config.strict:
                    raise
            finally:
                self._record_duration(stage, time.perf_counter() - start)
                self._publication.publish()

    def _record_duration(self, stage: str, seconds: float) -> None:
        family = catalog.metric("grpo_observe_duration_seconds")
        increments = {family.key("_sum", stage=stage): seconds, family.key("_count", stage=stage): 1.0}
        for bound in (*family.buckets, math.inf):
            le = "+Inf" if bound == math.inf else catalog.format_quantile(bound)
            increments[family.key("_bucket", stage=stage, le=le)] = float(seconds <= bound)
        self._publication.add(increments)


def solve_rate_prior(table: Tensor, slots: Tensor, default: Tensor | float) -> Tensor:
    """Each prompt's solve-rate estimate *before* this batch: the prompt's own history, or ``default`` (the
    running solve rate of recent batches) when unseen. The ``prompt_solve_rate`` from which E[p^G+(1-p)^G]
    is predicted; on the device, no host sync."""
    estimate = table[slots]
    return torch.where(torch.isnan(estimate), default, estimate)


def update_solve_rates(
    table: Tensor, slots: Tensor, prior: Tensor, correct: Tensor, groups: Groups | None, keep: float
) -> None:
    """Exponentially weighted update of each prompt's estimate by its group's solve rate in this batch
    (``keep`` = 0.5 ** (1 / half-life)). Prompts sharing a slot (prompt_id modulo the table size) share an
    estimate; the table has a fixed size whatever the number of prompts."""
    if groups is None:
        return
    rate = (groups.count(correct).double() / groups.sizes().clamp(min=1))[groups.index]
    table.index_put_((slots,), (keep * prior.double() + (1.0 - keep) * rate).to(table.dtype))


def _sample_parameters(params: list[Tensor]) -> list[Tensor]:
    """Copies of up to 16 evenly spaced parameter tensors, first 65,536 elements each: the |dtheta|/|theta|
    sample (a bounded copy, whatever the model size)."""
    stride = max(1, math.ceil(len(params) / PARAM_SAMPLE_TENSORS))
    return [p.detach().reshape(-1)[:PARAM_SAMPLE_ELEMENTS].clone() for p in params[::stride]]


def _concatenate(parts: list[StepInputs], grad: Mapping[str, Any]) -> StepInputs:
    """One StepInputs for the micro-steps of an optimizer step: per-completion fields concatenated (token
    fields padded to the widest T with masked-out padding); a field missing from any micro-step is dropped;
    ``on_policy`` holds when every micro-step says so."""
    fields: dict[str, Any] = dict(grad)
    if parts:
        width = max((p.loss_mask.shape[1] for p in parts if p.loss_mask is not None), default=0)
        for name in ("logprobs", "old_logprobs", "advantages", "loss_mask", "entropy", "ref_logprobs", "rewards",
                     "group_ids", "correct", "completion_lengths", "completion_mask", "rollout_logprobs"):
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                continue
            fields[name] = torch.cat([_pad(v, width) for v in values]) if len(values) > 1 else values[0]
        flags = [p.on_policy for p in parts]
        if all(f is not None for f in flags):
            fields["on_policy"] = all(flags)
        for name in ("loss", "policy_version", "rollout_policy_version"):
            last = getattr(parts[-1], name)
            if last is not None:
                fields[name] = last
    return StepInputs(**fields)


def _pad(value: Tensor, width: int) -> Tensor:
    if value.dim() != 2 or value.shape[1] == width:
        return value
    fill = False if value.dtype == torch.bool else 0
    return torch.nn.functional.pad(value, (0, width - value.shape[1]), value=fill)
