"""Grad-norm spikes, judged per step in the process (seed 第 4 步: a step whose pre-clip norm is 10x the rolling
median). A scrape every 30 s sees one step in many and a step of minutes empties a rate window, so the event is
counted where every step is seen; the alert pages on the counter's increase."""

from __future__ import annotations

import math
import statistics
from collections import deque

from grpo_exporter.thresholds import EventLines


class GradNormSpikes:
    """The previous non-zero pre-clip norms, and whether a new one spikes above them."""

    def __init__(self, lines: EventLines) -> None:
        self.factor = lines.grad_spike_factor
        self.min_steps = lines.grad_spike_min_steps
        self.norms: deque[float] = deque(maxlen=lines.grad_spike_window_steps)

    def observe(self, norm: float) -> bool:
        """Whether ``norm`` spikes against the median of the previous non-zero norms; then remember it.

        A zero norm (no group carried signal: every advantage 0, as in a solved task) is neither judged nor
        remembered; a non-finite one is counted elsewhere (grpo_nonfinite_values_total{tensor="grad_norm"})."""
        if not math.isfinite(norm) or norm <= 0.0:
            return False
        spike = len(self.norms) >= self.min_steps and norm > self.factor * statistics.median(self.norms)
        self.norms.append(norm)
        return spike
