"""The monitor's configuration: the metric math plus run identity, guard and baselines; the HTTP endpoint's and the
flight recorder's and the reading set's fields come from their own modules (:mod:`grpo_exporter.serving.settings`,
:mod:`grpo_exporter.recorder.settings`, :mod:`grpo_exporter.recorder.reading_settings`).

One pydantic model, validated once at construction. Sources, later ones winning: defaults, a YAML file
(read within limits: :mod:`grpo_exporter.config_files`), ``GRPO_EXPORTER_*`` environment variables (each parsed
by its field's type: :mod:`grpo_exporter.runtime.config_environment`), keyword arguments. An invalid value fails
at construction with a message naming the field (and the variable, for a value from the environment)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from rapidfuzz import process

from grpo_exporter import catalog
from grpo_exporter.config import MetricsConfig
from grpo_exporter.config_files import Oversized, check_value_size, load_yaml_mapping, short_repr
from grpo_exporter.recorder.reading_settings import ReadingSettings
from grpo_exporter.recorder.settings import RecorderSettings
from grpo_exporter.runtime.config_environment import environment_settings, naming_variables
from grpo_exporter.serving.settings import ServingSettings
from grpo_exporter.thresholds import EventLines, StopLines

#: the longest a duration setting may ask the process to wait, in seconds (see each field)
HOUR_S, DAY_S = 3600.0, 86400.0


class MonitorConfig(MetricsConfig, StopLines, EventLines, RecorderSettings, ReadingSettings, ServingSettings):
    """Everything :class:`~grpo_exporter.runtime.monitor.GRPOMonitor` needs; the metric knobs are inherited."""

    run: str = Field(min_length=1, max_length=128, description="run id: the `run` label of every series")
    strict: bool = Field(False, description="raise instead of counting and logging exporter errors (tests)")
    guard: Literal["warn", "raise", "off"] = Field(
        "warn", description="what a layer-1 stop criterion does inside training: log, raise, or nothing"
    )
    # engine_gap_stop_nats, engine_gap_healthy_nats, onpolicy_clip_stop_ratio: StopLines (shared with the alerts)
    runbook_url: str = Field(
        "docs/runbooks.md", max_length=2048, description="base of runbook links in guard messages"
    )
    reference_baseline: dict[str, float] = Field(
        default_factory=dict, description="sample key -> value of a known-good run, published as baselines"
    )
    kl_coef: float | None = Field(
        None, ge=0, description="the coefficient of the KL-to-reference penalty in the loss or the reward (TRL's "
        "beta, verl's kl_loss_coef or kl_ctrl.kl_coef), published as grpo_kl_penalty_coefficient: with it above 0 "
        "GRPOKLToReferenceRunaway and GRPOKLToReferenceZero judge grpo_kl_ref_nats; None or 0: no KL penalty, "
        "no KL rule"
    )
    correctness_component: str | None = Field(
        None, min_length=1, max_length=128, description="the reward component that measures correctness (the "
        "verifier's name, e.g. 'accuracy'), published as grpo_reward_component_role{role=\"correctness\"}: "
        "GRPORewardHackSuspected reads it, whatever the rules' correctness_component default"
    )
    solve_rate_slots: int = Field(
        1 << 20, ge=1, le=1 << 26, description="slots of the device-side solve-rate table, indexed by prompt_id "
        "modulo its size; at most 2^26 (16 bytes each: a 1 GiB table on the tensors' device)"
    )
    solve_rate_prior: float = Field(
        0.5, ge=0, le=1, description="solve-rate estimate before any batch; later, unseen prompts take the "
        "running solve rate of recent batches"
    )
    solve_rate_halflife: float = Field(4.0, gt=0, description="observations after which history weighs half")
    max_pending_micro_steps: int = Field(
        256, ge=1, le=1 << 16, description="micro-steps held for one optimizer step; further ones are dropped and "
        "counted; at most 65536 (each holds its readings until the step ends)"
    )
    distributed: Literal["merge", "local", "rank0"] = Field(
        "merge", description="with torch.distributed: `merge` the ranks' readings (every rank constructs a monitor "
        "at the same point: its setup is a collective, so a monitor on rank 0 alone would wait for the others); "
        "`rank0`: a monitor on rank 0 only, publishing rank 0's values (constructed on another rank it raises); "
        "`local`: each rank's monitor publishes its own values (rank 0 serves)",
    )
    distributed_timeout_s: float = Field(
        300.0, gt=0, le=DAY_S, description="longest wait of a rank in an exporter collective (its own gloo group); "
        "after a failure or timeout the exporter publishes rank-local values for the rest of the run; at most a day "
        "(86400), so a dead peer ends the wait within any run's life",
    )
    close_linger_s: float = Field(
        30.0, ge=0, le=HOUR_S, description="after close() marks the run finished, keep serving until one more "
        "scrape (at most this long; not at all when nothing ever scraped): Prometheus must see the normal end, or it "
        "pages; at most an hour (3600), beyond any scrape interval (Prometheus' staleness horizon is 5 minutes), so "
        "close() always returns",
    )
    compile_step: Literal["auto", "off"] = Field(
        "off", description="`auto` (experimental): each stage's per-token work runs as one program compiled by "
        "torch.compile (inductor), made on a background thread at the first step of each kind and used once ready "
        "(the eager step serves until then, and wherever compiling fails: logged once, counted in "
        "grpo_exporter_compiled_fallbacks_total{reason}). In a training that uses torch.compile itself, no program "
        "is made once its own compiled frames exist (torch's FX-tracing state is process-wide), and its first "
        "compilation may wait for one in progress. close() drops the compilations not started and waits at most "
        "2 s for the one in progress; at exit it is interrupted, never aborting the process. While it compiles, "
        "steps share the interpreter with it (slower, never blocked). `off` (the default while experimental): "
        "eager only",
    )
    compile_min_positions: int = Field(
        1 << 16, ge=0, le=1 << 40, description="N x T below which a stage runs eagerly even with compile_step=auto: "
        "there a step costs its fixed cost, which the compiled program does not lower (docs/benchmarks.md); at most "
        "2^40 (no batch holds more positions: above it nothing would compile)",
    )
    edit_distance_groups: int = Field(
        4, ge=0, le=1024, description="groups per rollout whose in-group edit distance is computed off-thread; "
        "0 = off; at most 1024 (the work is also capped by edit_distance_budget_s)"
    )
    edit_distance_budget_s: float = Field(
        0.02, gt=0, le=10, description="wall time one rollout's edit-distance job may take on its worker thread; "
        "its pairs are also capped at the work this buys (fewer as T grows, ~1/T^2), drawn in random order",
    )
    @model_validator(mode="before")
    @classmethod
    def _split_clip_eps(cls, data: Any) -> Any:
        """``clip_eps``: one eps for both sides or a pair (low, high); a side given itself wins."""
        if isinstance(data, dict) and "clip_eps" in data:
            data = dict(data)
            eps = data.pop("clip_eps")
            try:
                check_value_size(eps)  # this runs before MetricsConfig's own check, which sees only the sides
            except ValueError as exc:
                eps = Oversized(str(exc))
            if isinstance(eps, int | float | str | Oversized):
                eps = (eps, eps)
            if not isinstance(eps, list | tuple) or len(eps) != 2:
                raise ValueError(f"clip_eps: expected a number or a pair (low, high), got {short_repr(eps)}")
            data.setdefault("clip_eps_low", eps[0])
            data.setdefault("clip_eps_high", eps[1])
        return data

    @field_validator("reference_baseline", mode="before")
    @classmethod
    def _load_baseline(cls, value: Any) -> Any:
        if isinstance(value, str | Path):
            return load_yaml_mapping(value, "sample key -> number", "reference_baseline")
        return value

    @field_validator("reference_baseline")
    @classmethod
    def _baseline_keys_exist(cls, value: dict[str, float]) -> dict[str, float]:
        for key, number in value.items():
            name, labels = catalog.parse_key(key)
            if name not in catalog.BY_NAME:
                guess = process.extractOne(name, list(catalog.BY_NAME))
                hint = f"; did you mean {guess[0]!r}?" if guess else ""
                raise ValueError(f"expected catalogue metric names as keys, got {name!r}{hint}")
            catalog.metric(name).key(**labels)  # raises on undeclared labels
            if not math.isfinite(number):
                raise ValueError(f"expected a finite baseline for {key!r}, got {number}")
        return value

    @field_validator("run")
    @classmethod
    def _run_is_a_label_value(cls, value: str) -> str:
        return catalog.check_label_value("run", value)

    @classmethod
    def load(
        cls, file: str | Path | None = None, environ: Mapping[str, str] | None = None, **kwargs: Any
    ) -> MonitorConfig:
        """Defaults < YAML ``file`` < ``GRPO_EXPORTER_*`` variables of ``environ`` (``os.environ`` when None)
        < ``kwargs``. A value from the environment that fails validation is reported with its variable."""
        data = load_yaml_mapping(file, "settings", "config_file") if file is not None else {}
        env = os.environ if environ is None else environ
        from_env = environment_settings(cls, env)
        data.update({name: value for name, (_, value) in from_env.items()})
        data.update(kwargs)
        sources = {name: variable for name, (variable, _) in from_env.items() if name not in kwargs}
        if "clip_eps" in sources:  # it sets both sides, unless a side itself is given
            sides = [side for side in ("clip_eps_low", "clip_eps_high") if side not in data]
            sources = {**dict.fromkeys(sides, sources["clip_eps"]), **sources}
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise naming_variables(exc, cls, sources, env) from None
