"""The reading set's settings (:mod:`grpo_exporter.recorder.reading_set`), a part of the monitor's configuration
(:class:`~grpo_exporter.runtime.monitor_config.MonitorConfig` inherits them): how many rollouts it keeps per kind
and window, and whether it keeps their text."""

from __future__ import annotations

from pydantic import Field

from grpo_exporter.settings import Settings


class ReadingSettings(Settings):
    """The reading set's fields (``reading_*``); ``reading_rows`` 0: no reading set."""

    reading_rows: int = Field(
        4, ge=0, le=16, description="reading set: rollouts kept per kind (highest reward, fastest-rising component, "
        "truncated, most repeated groups, lowest-entropy groups, control) and window, served at /reading and linked "
        "from every page; 0 = off",
    )
    reading_window_steps: int = Field(
        20, ge=1, le=100_000, description="steps per reading-set window (the set keeps the last reading_windows)",
    )
    reading_windows: int = Field(3, ge=1, le=10, description="windows the reading set keeps, newest first")
    reading_text: bool = Field(
        False, description="keep the prompts and completions of the reading set's rollouts (decoded with decode, "
        "token ids otherwise): they can be private data, so off unless set; without it a row holds its numbers only",
    )
