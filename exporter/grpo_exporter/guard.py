"""Moved to :mod:`grpo_exporter.runtime.guard`; kept so that imports written against this path still work."""

from grpo_exporter.runtime.guard import TrainingSignalError, Violation, check, engine_verdict

__all__ = ["TrainingSignalError", "Violation", "check", "engine_verdict"]
