"""How ``bearsdk demo`` spreads its runs over the machine: how many at once on
the idle cores, and which to run again when they sent their requests late."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

__all__ = [
    "MAX_ARRIVAL_LAG_S",
    "MAX_RERUNS",
    "busy_cores",
    "default_jobs",
    "measured_busy",
    "rerun_plan",
    "usable_cpus",
]

MAX_ARRIVAL_LAG_S = 0.01
"""A run whose requests were sent later than this (p99) is rerun, then marked
unreliable. The engines share the router's event loop, so the loop's lag is
also how far the emulated GPUs ran behind real time. A quiet machine's loop
lags 1.5 ms at p99 (``bearsdk bench emulator``); under load, runs lagging
10-15 ms already reordered the policies at 16 req/s (BEAR behind the
latency-agnostic router), so the bound sits well below that and well above
quiet noise, at 1/15 of the tightest A.2 TTFT target (150 ms)."""

MAX_RERUNS = 2
"""Reruns of a lagging run, each with half as many runs beside it; bounded so
that a machine busy with other work ends the demo instead of looping."""

_BUSY_SLACK = 0.25
"""Cores busier than this still count as idle for ``--jobs``: the sample's own
noise and the demo's parent process are about this much."""

_LOAD_SAMPLE_S = 0.25
"""How long ``/proc/stat`` is sampled to find the idle cores: the current load,
where the 1-minute load average still remembers finished jobs."""


def busy_cores(before: str, after: str, cpus: Sequence[int]) -> float:
    """How many of ``cpus`` were busy between two readings of ``/proc/stat``.

    Args:
        before: The file's text at the start of the sample.
        after: Its text at the end.
        cpus: The CPU numbers this process may run on.

    Returns:
        The busy time over the elapsed time, summed over ``cpus`` (0 to ``len(cpus)``);
        a CPU missing from either reading counts as idle.
    """

    def per_cpu(text: str) -> dict[int, tuple[int, int]]:
        out = {}
        for line in text.splitlines():
            name, *fields = line.split()
            if not (name.startswith("cpu") and name[3:].isdigit() and len(fields) >= 4):
                continue
            ticks = [int(x) for x in fields[:8]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (sum(ticks), idle)
        return out

    t0, t1 = per_cpu(before), per_cpu(after)
    busy = 0.0
    for c in cpus:
        if c in t0 and c in t1:
            total = t1[c][0] - t0[c][0]
            idle = t1[c][1] - t0[c][1]
            if total > 0:
                busy += min(1.0, max(0.0, (total - idle) / total))
    return busy


def default_jobs(cpus: int, busy: float, runs: int) -> int:
    """Concurrent runs for a machine with ``cpus`` usable cores, ``busy`` of them busy.

    Each run needs a whole idle core: its engines emulate GPUs in real time.

    Args:
        cpus: Cores this process may use.
        busy: Cores busy with other work (a load measurement).
        runs: Runs to make.

    Returns:
        The idle cores (at least 1), and no more than ``runs``.
    """
    idle = math.floor(cpus - max(0.0, busy) + _BUSY_SLACK) if math.isfinite(busy) else 1
    return max(1, min(idle, cpus, runs))


def rerun_plan(lags: Sequence[float], workers: int, attempt: int) -> tuple[list[int], int]:
    """Which runs to make again, and with how many at once.

    Args:
        lags: Each run's p99 arrival lag, seconds.
        workers: Concurrent runs of the attempt that measured ``lags``.
        attempt: That attempt's number (0: the first runs).

    Returns:
        The indices into ``lags`` of the runs that lagged more than
        :data:`MAX_ARRIVAL_LAG_S`, and half as many workers (at least 1); no runs
        once :data:`MAX_RERUNS` reruns were made.
    """
    if attempt >= MAX_RERUNS:
        return [], 0
    late = [i for i, lag in enumerate(lags) if not lag <= MAX_ARRIVAL_LAG_S]
    if not late:
        return [], 0
    return late, max(1, min(len(late), workers // 2))


def measured_busy(cpus: Sequence[int]) -> float:
    """Busy cores now: a short ``/proc/stat`` sample, else the 1-minute load average."""
    try:
        with open("/proc/stat") as f:
            before = f.read()
        time.sleep(_LOAD_SAMPLE_S)
        with open("/proc/stat") as f:
            after = f.read()
        return busy_cores(before, after, cpus)
    except (OSError, ValueError):
        pass
    try:
        return min(float(len(cpus)), os.getloadavg()[0])
    except OSError:
        return 0.0


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
