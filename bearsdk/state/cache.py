"""The per-instance snapshot cache: the latest valid snapshot, ready to replay.

Every source (poll, push, shared memory, the shadow view) hands what it received
to :meth:`SnapshotCache.offer_bytes` (or :meth:`~SnapshotCache.offer`). The cache
decodes and validates it, checks it is newer than what it holds, prepares the
replay state for the instance's estimator once, and swaps a single reference to
an immutable :class:`CachedSnapshot`. Readers take that reference
(:attr:`SnapshotCache.entry`) and use it: they never block, never see a half
updated snapshot (there is nothing to update in place), and never prepare
anything on the hot path.

A snapshot that fails any check is rejected whole: the cached one stays, the
reason is counted (:meth:`SnapshotCache.stats`) and logged (rate-limited, so a
flood of bad snapshots does not flood the log).

Ordering (``docs/contracts.md`` section 1 and ``docs/protocol.md``): a cache
never replaces a snapshot by one with a lower ``seq`` of the same engine run. A
new ``epoch`` marks a restarted engine, whose ``seq`` starts over; without
``epoch``, a lower ``seq`` is accepted only as the first snapshot of a fresh
connection, or after ``restart_after_stale`` consecutive stale snapshots that
count up among themselves (an epoch-less engine that restarted behind a poll).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import anyio
import attrs

from bearsdk.errors import BearError, SnapshotError
from bearsdk.snapshot import MAX_SNAPSHOT_BYTES, Snapshot, decode_snapshot

if TYPE_CHECKING:
    from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot

__all__ = ["CacheStats", "CachedSnapshot", "Outcome", "Reject", "SnapshotCache"]

log = logging.getLogger("bearsdk.state.cache")


class Reject(enum.StrEnum):
    """Why a cache turned a snapshot down."""

    MALFORMED = "malformed"
    """Not a JSON object."""
    SCHEMA = "schema"
    """Missing or wrong ``schema``."""
    FIELD = "field"
    """A field failed validation (the logged detail names it)."""
    INSTANCE = "instance"
    """A snapshot of another instance than the cache expects."""
    STALE = "stale-seq"
    """A lower ``seq`` than the cached one, from the same engine run."""
    TORN = "torn"
    """A shared-memory read overlapped a write."""
    TOO_LARGE = "too-large"
    """Larger than the source's limit."""
    UNREPLAYABLE = "unreplayable"
    """Valid, but the estimator cannot build replay state from it."""


class Outcome(enum.Enum):
    """What an offered snapshot did to the cache (true only when accepted)."""

    ACCEPTED = "accepted"
    """It replaced the cached snapshot."""
    UNCHANGED = "unchanged"
    """Same ``seq`` as the cached one: nothing to do."""
    REJECTED = "rejected"
    """Turned down (counted and logged); the cached one stays."""

    def __bool__(self) -> bool:
        return self is Outcome.ACCEPTED


@attrs.frozen(eq=False)
class CachedSnapshot:
    """One accepted snapshot and everything the hot path needs from it.

    Attributes:
        snapshot: The validated snapshot.
        prepared: Its replay state for the cache's estimator (``None`` without one).
        received: When the cache accepted it (cache clock).
        captured: Its capture time on the cache clock: ``received`` less the
            transit time the engine's timestamp implies, clamped to
            ``[0, max_transit_s]`` so that clock skew cannot make it arbitrary.
        source: Which source delivered it.
        version: Accepted snapshots so far, this one included (local, monotone
            even across engine restarts).
        restarted: It was accepted as the first of a new engine run.
    """

    snapshot: Snapshot
    prepared: PreparedSnapshot | None
    received: float
    captured: float
    source: str
    version: int
    restarted: bool = False

    @property
    def seq(self) -> int:
        """The snapshot's engine step counter."""
        return self.snapshot.seq

    def age(self, now: float) -> float:
        """Seconds since capture at cache-clock time ``now`` (never negative)."""
        return max(0.0, now - self.captured)


@attrs.frozen
class CacheStats:
    """Counters of one cache.

    Attributes:
        accepted: Snapshots that replaced the cached one.
        unchanged: Snapshots with the cached ``seq`` (a poll between two engine steps).
        restarts: Accepted as the first snapshot of a new engine run.
        rejected: Rejections by reason.
        last_reject: The latest rejection's message, if any.
    """

    accepted: int
    unchanged: int
    restarts: int
    rejected: Mapping[str, int]
    last_reject: str | None

    @property
    def rejected_total(self) -> int:
        """All rejections."""
        return sum(self.rejected.values())


def _classify(exc: SnapshotError) -> Reject:
    if exc.field == "":
        return Reject.MALFORMED
    if exc.field == "schema":
        return Reject.SCHEMA
    return Reject.FIELD


def _unexpected(exc: BaseException) -> str:
    # str(exc) of an arbitrary exception may be huge or may itself raise.
    try:
        text = str(exc)
    except Exception:
        text = ""
    if len(text) > 200:
        text = text[:200] + "..."
    return f"unexpected {type(exc).__name__}: {text}"


def _non_negative(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if math.isnan(value) or value < 0:
        raise ValueError(f"{att.name} must be a number >= 0 (got {value!r})")


# Validators run at init only: a hook on every private-state write costs
# microseconds per snapshot.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class SnapshotCache:
    """The latest valid snapshot of one instance.

    Args:
        instance: The instance's name (router side; used in logs).
        estimator: The instance's BEA estimator; when set, every accepted snapshot
            is prepared for it once, at acceptance.
        expect_instance: Reject snapshots whose ``instance`` differs (guards
            against a misrouted URL); ``None`` accepts any.
        clock: The cache clock (seconds). Default: wall time, the clock engines
            stamp snapshots with, so ages include the transit time.
        max_transit_s: Cap on the transit time inferred from the snapshot's own
            timestamp (beyond it, clocks are assumed skewed).
        restart_after_stale: Accept a lower ``seq`` without a new ``epoch`` after
            this many consecutive stale snapshots counting up (0: never).
        log_interval_s: At most one warning per rejection reason per interval;
            the others are logged at debug level.
        on_accept: Called with the previous entry (``None`` at first or after a
            restart) and the new one whenever a snapshot is accepted; what it
            raises is logged, never propagated (it cannot cost a snapshot).
    """

    instance: str
    estimator: BEAEstimator | None = None
    expect_instance: str | None = None
    clock: Callable[[], float] = time.time
    max_transit_s: float = attrs.field(default=1.0, validator=_non_negative)
    restart_after_stale: int = 8
    log_interval_s: float = attrs.field(default=10.0, validator=_non_negative)
    on_accept: Callable[[CachedSnapshot | None, CachedSnapshot], None] | None = None
    _entry: CachedSnapshot | None = attrs.field(init=False, default=None)
    _accepted: int = attrs.field(init=False, default=0)
    _unchanged: int = attrs.field(init=False, default=0)
    _restarts: int = attrs.field(init=False, default=0)
    _rejected: dict[str, int] = attrs.field(init=False, factory=dict)
    _last_reject: str | None = attrs.field(init=False, default=None)
    _last_log: dict[str, float] = attrs.field(init=False, factory=dict)
    _stale_run: int = attrs.field(init=False, default=0)
    _stale_seq: int = attrs.field(init=False, default=-1)
    _changed: anyio.Event | None = attrs.field(init=False, default=None)

    # ------------------------------------------------------------------ reads

    @property
    def entry(self) -> CachedSnapshot | None:
        """The cached snapshot (one reference read: consistent by construction)."""
        return self._entry

    @property
    def version(self) -> int:
        """Snapshots accepted so far."""
        return self._accepted

    def age(self, now: float | None = None) -> float:
        """Age of the cached snapshot in seconds (``inf`` when there is none)."""
        e = self._entry
        if e is None:
            return math.inf
        return e.age(self.clock() if now is None else now)

    def stats(self) -> CacheStats:
        """The counters so far."""
        return CacheStats(
            accepted=self._accepted,
            unchanged=self._unchanged,
            restarts=self._restarts,
            rejected=dict(self._rejected),
            last_reject=self._last_reject,
        )

    async def wait_version(self, version: int) -> CachedSnapshot:
        """Wait until more than ``version`` snapshots were accepted; return the entry.

        Must be called from the event loop that feeds the cache.
        """
        while True:
            entry = self._entry
            if entry is not None and self._accepted > version:
                return entry
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    # ------------------------------------------------------------------ writes

    def offer_bytes(
        self,
        data: bytes | bytearray | memoryview | str,
        *,
        source: str = "",
        fresh_connection: bool = False,
        received: float | None = None,
    ) -> Outcome:
        """Decode, validate and (if newer) cache a snapshot document.

        Args:
            data: The JSON document.
            source: The delivering source (logs, :attr:`CachedSnapshot.source`).
            fresh_connection: First document of a new connection (see module doc).
            received: Receipt time on the cache clock (default: now).

        Returns:
            What happened (truthy when the snapshot replaced the cached one).
        """
        if len(data) > MAX_SNAPSHOT_BYTES:
            # Every source passes through here: whatever a transport accepted,
            # a document this large is refused before any parsing.
            self.reject(
                Reject.TOO_LARGE,
                f"snapshot: must be <= {MAX_SNAPSHOT_BYTES} bytes (got {len(data)})",
                source=source,
            )
            return Outcome.REJECTED
        try:
            snap = decode_snapshot(data)
        except SnapshotError as exc:
            self.reject(_classify(exc), str(exc), source=source)
            return Outcome.REJECTED
        except Exception as exc:
            # Last resort: the decoders raise only SnapshotError by contract, but
            # a bug must cost one snapshot, never the source's task (and with it
            # the router's task group).
            self.reject(Reject.MALFORMED, _unexpected(exc), source=source)
            log.debug("%s: decoder raised", self.instance, exc_info=True)
            return Outcome.REJECTED
        return self.offer(snap, source=source, fresh_connection=fresh_connection, received=received)

    def offer(
        self,
        snapshot: Snapshot,
        *,
        source: str = "",
        fresh_connection: bool = False,
        received: float | None = None,
    ) -> Outcome:
        """Cache a validated snapshot if it is newer than the cached one.

        Args:
            snapshot: The snapshot.
            source: The delivering source.
            fresh_connection: First snapshot of a new connection.
            received: Receipt time on the cache clock (default: now).

        Returns:
            What happened (truthy when it replaced the cached one).
        """
        if self.expect_instance is not None and snapshot.instance != self.expect_instance:
            self.reject(
                Reject.INSTANCE,
                f"snapshot instance: must be {self.expect_instance!r} (got {snapshot.instance!r})",
                source=source,
            )
            return Outcome.REJECTED
        cur = self._entry
        restarted = False
        if cur is not None:
            old = cur.snapshot
            if snapshot.epoch is not None:
                restarted = snapshot.epoch != old.epoch
            else:
                restarted = fresh_connection and snapshot.seq < old.seq
            if not restarted:
                if snapshot.seq == old.seq:
                    self._unchanged += 1
                    return Outcome.UNCHANGED
                if snapshot.seq < old.seq:
                    restarted = self._stale_counts_up(snapshot.seq)
                    if not restarted:
                        self.reject(
                            Reject.STALE,
                            f"snapshot seq: must be > the cached {old.seq} of the same engine "
                            f"run (got {snapshot.seq})",
                            source=source,
                        )
                        return Outcome.REJECTED
        prepared = None
        if self.estimator is not None:
            try:
                prepared = self.estimator.prepare(snapshot)
            except (BearError, ValueError) as exc:
                self.reject(
                    Reject.UNREPLAYABLE, f"snapshot seq {snapshot.seq}: {exc}", source=source
                )
                return Outcome.REJECTED
            except Exception as exc:
                # As in offer_bytes: validation bounds every number so that this
                # does not happen; if it does, the cached snapshot stays.
                self.reject(
                    Reject.UNREPLAYABLE,
                    f"snapshot seq {snapshot.seq}: {_unexpected(exc)}",
                    source=source,
                )
                log.debug("%s: preparing the replay raised", self.instance, exc_info=True)
                return Outcome.REJECTED
        now = self.clock() if received is None else received
        transit = min(max(now - snapshot.time, 0.0), self.max_transit_s)
        self._accepted += 1
        self._stale_run = 0
        self._stale_seq = -1
        if restarted:
            self._restarts += 1
            log.info(
                "%s: engine restarted (seq %d -> %d, epoch %r -> %r) via %s",
                self.instance,
                cur.snapshot.seq if cur is not None else -1,
                snapshot.seq,
                cur.snapshot.epoch if cur is not None else None,
                snapshot.epoch,
                source or "?",
            )
        self._entry = CachedSnapshot(
            snapshot=snapshot,
            prepared=prepared,
            received=now,
            captured=now - transit,
            source=source,
            version=self._accepted,
            restarted=restarted,
        )
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        if self.on_accept is not None:
            try:
                self.on_accept(None if restarted else cur, self._entry)
            except Exception:
                log.warning("%s: on_accept raised", self.instance, exc_info=True)
        return Outcome.ACCEPTED

    def reject(self, reason: Reject, detail: str, *, source: str = "") -> None:
        """Count and log a rejected snapshot (sources report transport-level ones here).

        Args:
            reason: The reason.
            detail: What exactly was wrong (names the field and value).
            source: The delivering source.
        """
        key = str(reason)
        self._rejected[key] = self._rejected.get(key, 0) + 1
        msg = f"{self.instance}: rejected snapshot from {source or '?'} ({key}): {detail}"
        self._last_reject = msg
        now = time.monotonic()
        last = self._last_log.get(key)
        if last is None or now - last >= self.log_interval_s:
            self._last_log[key] = now
            log.warning("%s [%d so far]", msg, self._rejected[key])
        else:
            log.debug("%s", msg)

    def clear(self) -> None:
        """Forget the cached snapshot (e.g. the instance was removed)."""
        self._entry = None

    def _stale_counts_up(self, seq: int) -> bool:
        if self.restart_after_stale <= 0:
            return False
        if self._stale_run and seq > self._stale_seq:
            self._stale_run += 1
        else:
            self._stale_run = 1
        self._stale_seq = seq
        return self._stale_run > self.restart_after_stale
