"""What every snapshot source shares: the interface, backoff, counters, failure logging.

A source is one I/O edge between an engine instance and the router: it runs as
one task in the router's anyio task group, feeds one
:class:`~bearsdk.state.cache.SnapshotCache`, and stops when that task group is
cancelled (it owns no task outside its own ``run`` call)::

    async with anyio.create_task_group() as tg:
        await tg.start(source.run, cache)   # returns once the first attempt is done
        ...
        tg.cancel_scope.cancel()

``tg.start`` returns after the source's first attempt, whether it delivered a
snapshot or failed (the failure is counted and the source keeps retrying with
backoff), so a router starts even while an engine is still down; such an
instance is estimated with the fallback until snapshots arrive.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import anyio
import anyio.abc
import attrs

from bearsdk import _validators as _v

if TYPE_CHECKING:
    from bearsdk.state.cache import SnapshotCache

__all__ = ["Backoff", "SnapshotSource", "SourceStats"]

log = logging.getLogger("bearsdk.io")


@attrs.frozen
class Backoff:
    """Exponential backoff with jitter between failed attempts.

    Attributes:
        initial_s: Delay after the first failure.
        max_s: Longest delay.
        factor: Growth per further failure.
        jitter: Each delay is drawn from ``[d * (1 - jitter), d]``, so routers
            that lost the same engine do not reconnect in lockstep.
    """

    initial_s: float = attrs.field(default=0.05, validator=_v.positive)
    max_s: float = attrs.field(default=5.0, validator=_v.positive)
    factor: float = attrs.field(default=2.0, validator=_v.positive)
    jitter: float = attrs.field(default=0.2, validator=_v.fraction)

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """The delay before the next attempt after ``failures`` consecutive failures (>= 1)."""
        d = min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1))
        u = (rng or random).random()
        return d * (1.0 - self.jitter * u)


@attrs.frozen
class SourceStats:
    """Counters of one source.

    Attributes:
        connects: Successful connections (push), polls (poll) or segment opens (shm).
        failures: Failed attempts (timeouts, refused connections, HTTP errors,
            missing segments).
        documents: Documents handed to the cache (accepted or not).
        busy: Shared-memory reads that found a write in progress (retried).
        last_error: The latest failure, if any.
    """

    connects: int = 0
    failures: int = 0
    documents: int = 0
    busy: int = 0
    last_error: str | None = None


@runtime_checkable
class SnapshotSource(Protocol):
    """An I/O edge feeding one instance's snapshot cache."""

    @property
    def name(self) -> str:
        """Label used in logs and :attr:`CachedSnapshot.source`."""
        ...

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Feed ``cache`` until cancelled; report readiness after the first attempt."""
        ...

    def stats(self) -> SourceStats:
        """The counters so far."""
        ...


class _Tracked:
    """``name`` and ``stats()`` for a source that keeps ``_name`` and a ``_Health``."""

    __slots__ = ()
    _name: str
    _health: _Health

    @property
    def name(self) -> str:
        """Label used in logs and :attr:`CachedSnapshot.source`."""
        return self._name

    def stats(self) -> SourceStats:
        """The counters so far."""
        return self._health.stats()


@attrs.define
class _Health:
    """Failure bookkeeping shared by the sources: counts, and logs state changes only."""

    name: str
    connects: int = 0
    failures: int = 0
    documents: int = 0
    busy: int = 0
    streak: int = 0
    last_error: str | None = None
    _down_since: float | None = None

    def ok(self) -> None:
        self.connects += 1
        if self.streak:
            down = time.monotonic() - (self._down_since or time.monotonic())
            log.info("%s: recovered after %d failures (%.1f s)", self.name, self.streak, down)
        self.streak = 0
        self._down_since = None

    def fail(self, error: BaseException | str) -> int:
        """Count a failure; return the consecutive-failure count."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.failures += 1
        self.streak += 1
        self.last_error = text
        if self.streak == 1:
            self._down_since = time.monotonic()
            log.warning("%s: %s (retrying with backoff)", self.name, text)
        else:
            log.debug("%s: %s (failure %d in a row)", self.name, text, self.streak)
        return self.streak

    def stats(self) -> SourceStats:
        return SourceStats(
            connects=self.connects,
            failures=self.failures,
            documents=self.documents,
            busy=self.busy,
            last_error=self.last_error,
        )
