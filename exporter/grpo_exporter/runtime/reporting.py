"""What the exporter says about itself inside training: counted errors, rate-limited log lines, the guard.

An exception of the exporter is counted in ``grpo_exporter_errors_total{stage}`` and logged at most once per
stage per minute (:meth:`Reporter.contained`; ``strict`` raises it instead); a failed layer-1 stop criterion is
logged once a minute per alert (``guard="warn"``) or raised as
:class:`~grpo_exporter.runtime.guard.TrainingSignalError` (``guard="raise"``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping

import torch

from grpo_exporter import catalog
from grpo_exporter.runtime import guard
from grpo_exporter.runtime.monitor_config import MonitorConfig
from grpo_exporter.serving.publication import Publication, duration_increments

log = logging.getLogger("grpo_exporter")

LOG_EVERY_SECONDS = 60.0
_COUNTED = "_grpo_exporter_counted"  # set on an exception once counted: a nested contained block re-raising it


class Reporter:
    """Counts, logs and contains the exporter's errors and says the guard's verdict, for one monitor."""

    def __init__(self, publication: Publication, config: MonitorConfig) -> None:
        self._publication = publication
        self._config = config
        self._last_log: dict[str, float] = {}

    def count(self, stage: str, publish: bool = False) -> None:
        """Count an exporter error of ``stage`` that was already said elsewhere; ``publish``: publish the count
        now (outside an observe call, which publishes at its end)."""
        if not publish:
            self._publication.add({catalog.metric("grpo_exporter_errors_total").key(stage=stage): 1.0})
            return
        with self._publication.writing:
            self.count(stage)
            self._publication.publish()

    def error(self, stage: str, exc: BaseException, where: str = "") -> None:
        """Count an exporter error of ``stage`` and log it (at most once a minute per stage). An error is counted
        once, however many contained blocks it passes through on its way out (strict mode re-raises it)."""
        if getattr(exc, _COUNTED, False):
            return
        with contextlib.suppress(AttributeError):  # an exception type with __slots__ cannot be marked
            setattr(exc, _COUNTED, True)
        self.count(stage)
        if self.due(f"error:{stage}"):
            outcome = "raised: strict=True" if self._config.strict else "training continues"
            log.warning(
                "grpo-exporter: %s failed in stage %r%s (%s; counted in grpo_exporter_errors_total; further "
                "errors of this stage are logged at most once a minute): %s",
                type(exc).__name__, stage, f" ({where})" if where else "", outcome, exc, exc_info=exc,
            )

    def due(self, what: str) -> bool:
        """Whether a line about ``what`` may be logged now (once a minute each)."""
        now = time.monotonic()
        if now - self._last_log.get(what, -math.inf) < LOG_EVERY_SECONDS:
            return False
        self._last_log[what] = now
        return True

    def check(self, metrics: Mapping[str, float]) -> list[guard.Violation]:
        """The layer-1 stop criteria these metrics fail (none with ``guard="off"``)."""
        if self._config.guard == "off":
            return []
        return guard.check(metrics, self._config.stop_lines)

    def enforce(self, violations: list[guard.Violation], step: int | None) -> None:
        """Warn about or raise the violations, as the config says."""
        if not violations:
            return
        lines = [v.line(self._config.run, step, self._config.runbook_url) for v in violations]
        if self._config.guard == "raise":
            raise guard.TrainingSignalError(violations, lines)
        for violation, line in zip(violations, lines, strict=True):
            if self.due(f"guard:{violation.alert}"):
                log.warning(line)

    @contextlib.contextmanager
    def contained(self, stage: str, where: str = "", publish: bool = False) -> Iterator[None]:
        """An exception inside is counted and logged under ``stage`` and the call goes on (strict: raised; the
        guard's own error always passes); ``publish``: publish the count now (outside an observe call, which
        publishes at its end)."""
        try:
            yield
        except guard.TrainingSignalError:
            raise
        except Exception as exc:
            with self._publication.writing:
                self.error(stage, exc, where)
                if publish:
                    self._publication.publish()
            if self._config.strict:
                raise

    @contextlib.contextmanager
    def stage(self, stage: str) -> Iterator[None]:
        """One observe call: under the publication's lock, contained, without autograd, timed, and published
        at its end."""
        start = time.perf_counter()
        with self._publication.writing:
            try:
                with self.contained(stage), torch.inference_mode():
                    yield
            finally:
                self._publication.add(duration_increments(stage, time.perf_counter() - start))
                self._publication.publish()
