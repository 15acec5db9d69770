"""The flight recorder (seed 第 6 篇 (crash triage) 三态保存): on the first anomalous step, the last normal step,
that step and the next one, with their metrics and a bounded sample of raw rows, written as one incident directory for
``grpo-exporter inspect``. On when ``recorder_dir`` is configured."""

from grpo_exporter.recorder.flight import FlightRecorder, Incident, State
from grpo_exporter.recorder.store import RecorderError
from grpo_exporter.recorder.triggers import TRIGGERS, triggers_of

__all__ = ["TRIGGERS", "FlightRecorder", "Incident", "RecorderError", "State", "triggers_of"]
