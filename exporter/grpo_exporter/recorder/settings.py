"""The flight recorder's settings (:mod:`grpo_exporter.recorder`), a part of the monitor's configuration
(:class:`~grpo_exporter.runtime.monitor_config.MonitorConfig` inherits them): where incidents go, what they hold,
the disk they may take and how long an exit waits for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from grpo_exporter.config_files import short_repr
from grpo_exporter.recorder.triggers import TRIGGERS
from grpo_exporter.settings import Settings
from grpo_exporter.thresholds import MAX_STEPS

#: the longest wait a flush may ask of an exit, in seconds
HOUR_S = 3600.0
#: byte counts of the recorder's disk settings: a pebibyte is beyond any filesystem a run writes to
MAX_DISK_BYTES = 1 << 50


class RecorderSettings(Settings):
    """The flight recorder's fields (``recorder_*``); ``recorder_dir`` None: no recorder."""

    recorder_dir: Path | None = Field(
        None, description="flight recorder: write an incident (last normal, first anomalous and next step: metrics "
        "and raw rows) here when a layer-1 trigger fires; None or '' = off. Holds prompts and completions: owner-only",
    )
    recorder_rows: int = Field(
        16, ge=1, le=4096, description="rows kept per step and stage; on an anomalous step up to half are the rows "
        "that drove the trigger",
    )
    recorder_max_state_bytes: int = Field(
        32 << 20, ge=1 << 10, le=1 << 34, description="bytes the rows of one step and stage may hold on the "
        "tensors' device: fewer than recorder_rows are kept where the rows are long (at least one); the recorder "
        "holds a few such states (the open steps, the last normal one, a pending incident), so at most 16 GiB each",
    )
    recorder_history_steps: int = Field(
        32, ge=1, le=100_000, description="steps whose key metrics an incident carries (the ring before it)",
    )
    recorder_disk_budget_bytes: int = Field(
        1 << 30, ge=1 << 16, le=MAX_DISK_BYTES, description="bytes all incidents in recorder_dir may take; the "
        "oldest are removed first",
    )
    recorder_triggers: tuple[str, ...] = Field(
        TRIGGERS, description=f"what opens an incident, any of {', '.join(TRIGGERS)} (the guard's lines)",
    )
    recorder_min_free_bytes: int = Field(
        1 << 30, ge=0, le=MAX_DISK_BYTES, description="free bytes an incident must leave on recorder_dir's "
        "filesystem (often the checkpoints'): the oldest incidents are removed first, and an incident that would "
        "still go below is not written (a counted recorder error)",
    )
    recorder_min_free_ratio: float = Field(
        0.05, ge=0, lt=1, description="the same floor as a share of the filesystem's size; the larger one holds",
    )
    recorder_cooldown_steps: int = Field(
        50, ge=0, le=MAX_STEPS, description="a trigger that fires again within this many steps of the step that "
        "opened its last incident rejoins that episode (a flapping trigger writes one incident, not one every other "
        "step); 0 = every new episode writes",
    )
    recorder_flush_timeout_s: float = Field(
        30.0, ge=0, le=HOUR_S, description="at close, when the guard raises, at exit and on SIGTERM: longest wait "
        "for pending incidents; at most an hour (3600): writing an incident takes seconds, and a wait without end "
        "would keep a finished or preempted job from exiting",
    )

    @field_validator("recorder_dir", mode="before")
    @classmethod
    def _recorder_dir_is_a_path(cls, value: Any) -> Any:
        """'' is off, as an unset variable is (not the current directory, which would receive prompts and
        completions); a control character (a newline breaks the latest-incident series) is an error."""
        if isinstance(value, str | Path):
            text = str(value) if isinstance(value, Path) else value
            if isinstance(value, str) and not value.strip():
                return None
            if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
                raise ValueError(f"expected a directory path without control characters, got {text!r}")
        return value

    @field_validator("recorder_triggers", mode="before")
    @classmethod
    def _known_triggers(cls, value: Any) -> Any:
        """Each a known trigger, once (a repeated name adds nothing); the error shows at most a few of the
        unknown ones, briefly, whatever came."""
        if not isinstance(value, str | list | tuple | set | frozenset):
            raise ValueError(f"expected a list of any of {list(TRIGGERS)}, got {short_repr(value)}")
        items = [value] if isinstance(value, str) else list(value)
        unknown = [t for t in items if not isinstance(t, str) or t not in TRIGGERS]
        if unknown:
            raise ValueError(f"expected any of {list(TRIGGERS)}, got {short_repr(unknown)}")
        return tuple(dict.fromkeys(items))
