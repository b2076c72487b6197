"""Faults an emulated engine injects on demand, for testing routers and snapshot caches.

Set them in process (``engine.faults``) or over HTTP (``POST /bear/faults`` with a
JSON object of the fields below, plus the one-shot actions ``fail_next``,
``drop_next`` and ``stall_s``; ``POST /bear/restart`` restarts the engine).

* ``latency_s``: added one-way network delay. A request reaches the engine
  ``latency_s`` after it arrived, and every response line (SSE chunk, snapshot
  line, JSON body) leaves ``latency_s`` after the engine produced it.
* ``error_rate`` / ``error_status``: each request to a path in ``fault_paths``
  fails with that probability with a vLLM-style 5xx error; ``fail_next(n)`` fails
  the next ``n`` for certain.
* ``drop_rate`` / ``drop_after_chunks``: the connection is dropped (TCP reset)
  after that many response chunks (0: before any response); ``drop_next(n)``.
* ``stall(s)``: the engine's next batch takes ``s`` seconds longer (a GPU or CPU
  hang): no tokens, no snapshots meanwhile.
* ``snapshot_delay_s``: each snapshot becomes visible (``GET /bear/snapshot``,
  the push stream) only that long after capture: a slow publisher.
* restart (:meth:`EmulatedEngine.restart`): every connection drops, the port
  refuses connections for ``downtime_s``, and the engine comes back empty with a
  new ``epoch`` and ``seq`` starting over at 0.

Random draws are seeded (``EngineConfig.seed``), so a faulty run repeats.

Every setting is bounded, so that a fault cannot take the emulator itself down:
delays (``latency_s``, ``snapshot_delay_s``, ``stall_s``, pending stalls
together, a restart's ``downtime_s``) are at most :data:`MAX_DELAY_S`, pending
one-shot failures and drops at most :data:`MAX_PENDING`, ``fault_paths`` at most
:data:`MAX_PATHS` paths. An out-of-range value is refused (HTTP 400 naming the
field and the value) and changes nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any, Final

import attrs

__all__ = ["MAX_DELAY_S", "MAX_PATHS", "MAX_PENDING", "FaultDecision", "Faults", "FaultsError"]

GENERATION_PATHS: Final = ("/v1/completions", "/v1/chat/completions")
MAX_DELAY_S: Final = 60.0
"""Longest injected delay, stall or downtime (a longer one is a hung engine, not a fault)."""
MAX_PENDING: Final = 100_000
"""Most one-shot failures, and drops, pending at once."""
MAX_PATHS: Final = 64
"""Most entries of ``fault_paths`` (each at most 256 characters)."""


class FaultsError(ValueError):
    """A fault setting is invalid (names the field and the value)."""


def _check_range(name: str, value: object, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FaultsError(f"{name} must be a number in [0, {hi:g}] (got {value!r:.80})")
    try:
        v = float(value)
    except OverflowError:  # an integer beyond any float
        v = math.inf
    if not (math.isfinite(v) and 0 <= v <= hi):
        raise FaultsError(f"{name} must be a number in [0, {hi:g}] (got {value!r:.80})")
    return v


def _check_delay(name: str, value: object, hi: float = MAX_DELAY_S) -> float:
    """A delay; ``hi`` below :data:`MAX_DELAY_S` leaves room for the ones pending."""
    return _check_range(name, value, max(0.0, hi))


def _check_prob(name: str, value: object) -> float:
    # NaN fails the comparison too.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise FaultsError(f"{name} must be in [0, 1] (got {value!r:.80})")
    return float(value)


def _check_count(name: str, value: object, hi: int = MAX_PENDING) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise FaultsError(f"{name} must be an integer in [0, {hi}] (got {value!r:.80})")
    return value


def _check_status(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 500 <= value <= 599:
        raise FaultsError(f"{name} must be a 5xx HTTP status (got {value!r:.80})")
    return value


def _check_paths(value: object) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_PATHS
        or not all(isinstance(p, str) and len(p) <= 256 for p in value)
    ):
        shown = f"a list of {len(value)}" if isinstance(value, list) else f"{value!r:.80}"
        raise FaultsError(
            f"fault_paths must be a list of at most {MAX_PATHS} paths of at most 256 "
            f"characters (got {shown})"
        )
    return tuple(value)


@attrs.frozen
class FaultDecision:
    """What to do to one request.

    Attributes:
        error_status: Fail it with this status (0: no).
        drop_after_chunks: Drop the connection after this many chunks (-1: no).
    """

    error_status: int = 0
    drop_after_chunks: int = -1


@attrs.define
class Faults:
    """The fault settings of one engine (see the module docstring).

    Args:
        seed: Seeds the random fault draws.
    """

    latency_s: float = 0.0
    error_rate: float = 0.0
    error_status: int = 500
    drop_rate: float = 0.0
    drop_after_chunks: int = 0
    snapshot_delay_s: float = 0.0
    fault_paths: tuple[str, ...] = GENERATION_PATHS
    seed: int = 0
    _fail_next: list[int] = attrs.field(factory=list)
    _drop_next: list[int] = attrs.field(factory=list)
    _stall_s: float = 0.0
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed ^ 0x5EED)

    def fail_next(self, n: int = 1, status: int = 500) -> None:
        """Fail the next ``n`` requests to ``fault_paths`` with ``status``."""
        _check_count("fail_next", n, MAX_PENDING - len(self._fail_next))
        _check_status("status", status)
        self._fail_next.extend([status] * n)

    def drop_next(self, n: int = 1, after_chunks: int = 0) -> None:
        """Drop the connection of the next ``n`` requests after ``after_chunks`` chunks."""
        _check_count("drop_next", n, MAX_PENDING - len(self._drop_next))
        _check_count("after_chunks", after_chunks)
        self._drop_next.extend([after_chunks] * n)

    def stall(self, seconds: float) -> None:
        """Make the engine's next batch ``seconds`` longer (pending stalls add up to at most
        :data:`MAX_DELAY_S`)."""
        self._stall_s += _check_delay("stall_s", seconds, MAX_DELAY_S - self._stall_s)

    def take_stall(self) -> float:
        """The pending stall, consumed (the engine calls this when it launches a batch)."""
        s, self._stall_s = self._stall_s, 0.0
        return s

    def clear(self) -> None:
        """Back to no faults."""
        self.latency_s = self.error_rate = self.drop_rate = self.snapshot_delay_s = 0.0
        self.error_status = 500
        self.drop_after_chunks = 0
        self.fault_paths = GENERATION_PATHS
        self._fail_next.clear()
        self._drop_next.clear()
        self._stall_s = 0.0

    def decide(self, path: str) -> FaultDecision:
        """Whether the request to ``path`` fails or drops (consumes one-shot faults)."""
        if not any(path.startswith(p) for p in self.fault_paths):
            return FaultDecision()
        if self._fail_next:
            return FaultDecision(error_status=self._fail_next.pop(0))
        if self._drop_next:
            return FaultDecision(drop_after_chunks=self._drop_next.pop(0))
        if self.error_rate and self._rng.random() < self.error_rate:
            return FaultDecision(error_status=self.error_status)
        if self.drop_rate and self._rng.random() < self.drop_rate:
            return FaultDecision(drop_after_chunks=self.drop_after_chunks)
        return FaultDecision()

    def update(self, doc: Mapping[str, Any]) -> None:
        """Apply a ``POST /bear/faults`` body (validated whole before anything changes).

        Raises:
            FaultsError: Unknown field or bad value (named).
        """
        if not isinstance(doc, Mapping):
            raise FaultsError(f"body must be a JSON object (got {type(doc).__name__})")
        setters: dict[str, Any] = {}
        actions: list[tuple[str, Any]] = []
        for key, value in doc.items():
            if key in ("latency_s", "snapshot_delay_s"):
                setters[key] = _check_delay(key, value)
            elif key in ("error_rate", "drop_rate"):
                setters[key] = _check_prob(key, value)
            elif key == "error_status":
                setters[key] = _check_status(key, value)
            elif key == "drop_after_chunks":
                setters[key] = _check_count(key, value)
            elif key == "fault_paths":
                setters[key] = _check_paths(value)
            elif key == "fail_next" or key == "drop_next":
                pending = len(self._fail_next if key == "fail_next" else self._drop_next)
                actions.append((key, _check_count(key, value, MAX_PENDING - pending)))
            elif key == "stall_s":
                actions.append((key, _check_delay(key, value, MAX_DELAY_S - self._stall_s)))
            elif key == "clear":
                if value is not True:
                    raise FaultsError(f"clear must be true (got {value!r})")
                actions.insert(0, (key, True))
            else:
                raise FaultsError(f"{key!s:.80} is not a fault setting")
        if actions and actions[0][0] == "clear":
            self.clear()
        for key, value in setters.items():
            setattr(self, key, value)
        for key, value in actions:
            if key == "fail_next":
                self.fail_next(value, self.error_status)
            elif key == "drop_next":
                self.drop_next(value, self.drop_after_chunks)
            elif key == "stall_s":
                self.stall(value)

    def to_dict(self) -> dict[str, Any]:
        """The current settings (``GET /bear/faults``)."""
        return {
            "latency_s": self.latency_s,
            "error_rate": self.error_rate,
            "error_status": self.error_status,
            "drop_rate": self.drop_rate,
            "drop_after_chunks": self.drop_after_chunks,
            "snapshot_delay_s": self.snapshot_delay_s,
            "fault_paths": list(self.fault_paths),
            "pending_failures": len(self._fail_next),
            "pending_drops": len(self._drop_next),
            "pending_stall_s": self._stall_s,
        }
