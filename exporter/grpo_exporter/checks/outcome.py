"""The outcome every preflight report shares: passed; failed, with a diagnosis naming what to fix; or cannot
tell, when the inputs give the check nothing to judge (an empty batch, an all-masked one, non-finite values).
A check that cannot see anything says so instead of passing (``passed`` is then False), and the monitor
publishes it apart from a failure (``grpo_preflight_check_cannot_tell``)."""

from __future__ import annotations

OUTCOMES = ("passed", "failed", "cannot_tell")


class Outcome:
    """Mixed into each report dataclass, which declares ``passed`` and ``cannot_tell``."""

    passed: bool
    cannot_tell: bool

    @property
    def outcome(self) -> str:
        """One of :data:`OUTCOMES`."""
        return "cannot_tell" if self.cannot_tell else "passed" if self.passed else "failed"
