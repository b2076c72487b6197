"""What the parts of ``bearsdk bench gateway`` share: sizes, names, limits, a wait."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import attrs

MODEL = "Qwen/Qwen3-8B"
PROFILE = "qwen3-8b-h100"
OLD_KEY = "bench-old-key-0123456789abcdef"
NEW_KEY = "bench-new-key-0123456789abcdef"
# The router bench's prompt, so that both benches decide on the same input.
PROMPT = (
    "You are a careful assistant. Read the following report and summarize its key findings "
    "in three sentences, then list two open questions it leaves unanswered. " * 6
)
TARGET_ADDED_P50_MS = 0.5
TARGET_ADDED_P99_MS = 2.0

# Generous limits on things that take a second or two on an idle machine: a
# shared 2-core machine under load can be ten times slower, and a bench that
# gives up early reports nothing.
_START_S = 120.0
_STOP_S = 20.0
_SETTLE_S = 60.0


@attrs.frozen
class Sizes:
    """How much each scenario does (defaults: the acceptance criteria's numbers).

    Attributes:
        rate: Open-loop requests/s of the latency scenario (both paths together).
        seconds: Measured duration of the latency scenario.
        warmup_s: Load before each measurement, discarded (connections, caches).
        clients: Concurrent closed-loop clients of the scaling scenario.
        scaling_s: Measured duration of each scaling run.
        workers_max: Scaling runs with 1 .. this many gateway workers.
        streams: Long streams held open at once in the streams scenario.
        waves: Times the streams scenario opens ``streams`` (memory must not grow).
        inflight: Streams in flight at the reload and at SIGTERM.
        interval_s: Time between two chunks of the slow engine.
        chunks: Chunks of a long stream (its length: ``(chunks - 1) * interval_s``).
        open_rate: Streams opened per second.
        grace_s: ``drain_grace_s`` of the SIGTERM scenario.
    """

    rate: float = 500.0
    seconds: float = 10.0
    warmup_s: float = 1.0
    clients: int = 64
    scaling_s: float = 5.0
    workers_max: int = 2
    streams: int = 2000
    waves: int = 3
    inflight: int = 1000
    interval_s: float = 0.25
    chunks: int = 40
    open_rate: float = 1000.0
    grace_s: float = 5.0


async def _until(cond: Callable[[], bool], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.02)
    return True
