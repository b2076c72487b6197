"""Benchmarks users can run (``bearsdk bench NAME``).

Each module here that defines ``register(subparsers)`` adds one benchmark, like
the command-line package does for commands. Benchmarks report medians, p99s and
ratios measured in one run; unit tests never time anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Timing", "loop_line", "loop_report", "time_call"]


class Timing:
    """Summary of repeated timings of one call (microseconds)."""

    __slots__ = ("median_us", "n", "p99_us", "samples_us")

    def __init__(self, samples_us: list[float]) -> None:
        s = sorted(samples_us)
        self.samples_us = s
        self.n = len(s)
        self.median_us = statistics.median(s)
        self.p99_us = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]

    def as_dict(self) -> dict[str, float]:
        """Median, p99 and sample count."""
        return {"median_us": round(self.median_us, 4), "p99_us": round(self.p99_us, 4), "n": self.n}


def loop_report(lag: Any) -> dict[str, float]:
    """An emulated engine's :class:`~bearsdk.emulator.LoopStats` as a report's ``loop``.

    How well the emulator kept real time: a loaded machine makes the engine
    idle between batches, time no model of the GPU can know of.
    """
    return {
        "steps": lag.steps,
        "lag_median_ms": round(1e3 * lag.lag_median_s, 3),
        "lag_p99_ms": round(1e3 * lag.lag_p99_s, 3),
        "idle_gpu_ms": round(1e3 * lag.idle_gpu_s, 1),
    }


def loop_line(lp: dict[str, float]) -> str:
    """One line of text for :func:`loop_report`'s dict."""
    return (
        f"  emulator loop: {lp['steps']} batches, lag p50 {lp['lag_median_ms']} ms, "
        f"p99 {lp['lag_p99_ms']} ms, GPU idle while work waited {lp['idle_gpu_ms']} ms"
    )


def time_call(
    fn: Callable[[], object], *, batch: int = 100, rounds: int = 200, warmup: int = 20
) -> Timing:
    """Time ``fn`` in ``rounds`` rounds of ``batch`` back-to-back calls.

    A round's mean is one sample, so timer resolution and call overhead of the
    timing loop itself stay well below the quantity measured.
    """
    for _ in range(warmup * batch):
        fn()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(batch):
            fn()
        samples.append((clock() - t0) / batch / 1000.0)
    return Timing(samples)
