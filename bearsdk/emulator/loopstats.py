"""How well the emulated engine's loop keeps real time (a CPU-bound emulator falls behind)."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Final

import attrs

__all__ = ["LoopMeter", "LoopStats"]

_LAG_SAMPLES: Final = 100_000


@attrs.frozen
class LoopStats:
    """How well the engine loop kept real time.

    Attributes:
        steps: Batches completed.
        lag_median_s: Median lateness of the loop waking for a batch's completion.
        lag_p99_s: Its 99th percentile.
        lag_max_s: Its maximum.
        idle_gpu_s: Time the emulated GPU idled although work was waiting, because
            the loop scheduled late (CPU-bound emulator).
    """

    steps: int
    lag_median_s: float
    lag_p99_s: float
    lag_max_s: float
    idle_gpu_s: float


@attrs.define
class LoopMeter:
    """Collects the loop's lateness: wake-up lags, completed steps, idle GPU time."""

    lags: deque[float] = attrs.field(factory=lambda: deque(maxlen=_LAG_SAMPLES))
    steps: int = 0
    idle_gpu_s: float = 0.0
    # The recent idle spans (start, end): what a measurement that should see
    # the emulated GPU, not the machine running it, takes off.
    idle_spans: deque[tuple[float, float]] = attrs.field(factory=lambda: deque(maxlen=_LAG_SAMPLES))

    def idle_between(self, start: float, end: float) -> float:
        """Idle GPU time (work waiting) between ``start`` and ``end``, over the recent spans."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.idle_spans if b > start)

    def stats(self) -> LoopStats:
        """The summary over the recent steps."""
        lags = sorted(self.lags)
        if not lags:
            return LoopStats(self.steps, 0.0, 0.0, 0.0, self.idle_gpu_s)
        p99 = lags[min(len(lags) - 1, round(0.99 * (len(lags) - 1)))]
        return LoopStats(self.steps, statistics.median(lags), p99, lags[-1], self.idle_gpu_s)

    def reset(self) -> None:
        """Forget lag samples and idle time (the step count stays)."""
        self.lags.clear()
        self.idle_gpu_s = 0.0
        self.idle_spans.clear()
