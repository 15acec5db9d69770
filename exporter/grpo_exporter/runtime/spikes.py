"""Grad-norm spikes, judged per step in the process (seed 第 4 步: a step whose pre-clip norm is 10x the rolling
median). A scrape every 30 s sees one step in many and a step of minutes empties a rate window, so the event is
counted where every step is seen; the alert pages on the counter's increase.

The judged quantity is the norm per share of loss tokens that carry signal (non-zero advantage). In a token-level
loss the zero-advantage tokens sit in the denominator and scale the gradient down like a smaller batch (seed
第 3 篇 (signal health), gradient dilution): a converging run whose steps swing between one mixed group and several has
norms that swing with them, and a step with ten times the signal is no crash. A crash's spike is large for the signal
the step had. (If the per-token gradients were independent the norm would grow only as the square root of the signal;
dividing by the share itself then inflates a sparse step by at most sqrt(dense / sparse), 4x for one group in sixteen,
below the 10x line.)"""

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

    def observe(self, norm: float, signal_share: float | None = None) -> bool:
        """Whether ``norm`` (per ``signal_share``, the share of the update's loss tokens with non-zero
        advantage, when known) spikes against the median of the previous ones; then remember it.

        A zero norm or a step without signal (every advantage 0, as in a solved task) is neither judged nor
        remembered; a non-finite one is counted elsewhere (grpo_nonfinite_values_total{tensor="grad_norm"})."""
        if signal_share is not None:
            if not signal_share > 0.0:
                return False
            norm = norm / min(signal_share, 1.0)
        if not math.isfinite(norm) or norm <= 0.0:
            return False
        spike = len(self.norms) >= self.min_steps and norm > self.factor * statistics.median(self.norms)
        self.norms.append(norm)
        return spike
