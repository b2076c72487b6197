"""Fan-out of an engine's snapshots and batch records to its readers.

Snapshots coalesce: a reader that falls behind gets the latest snapshot, never a
queue (``docs/protocol.md``). Batch records do not: each reader has a bounded
buffer; when it overflows the oldest records go and the next record sent
carries ``"dropped": N``. A :class:`DelayLine` holds snapshots back by the
injected publishing delay before they reach the hub.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs
import orjson

if TYPE_CHECKING:
    from bearsdk.emulator.timing import BatchShape

__all__ = [
    "BatchHub",
    "BatchReader",
    "DelayLine",
    "PublishedSnapshot",
    "SnapshotHub",
    "SnapshotReader",
    "batch_record",
]


@attrs.define(eq=False)
class PublishedSnapshot:
    """One published ``bear.snapshot/1`` document.

    Attributes:
        seq: Its ``seq``.
        doc: The document.
        batches: Batches the engine had scheduled when it was captured.
        captured_at: Engine loop clock at capture (``anyio.current_time()``).
    """

    seq: int
    doc: dict[str, Any]
    batches: int
    captured_at: float
    _json: bytes | None = None

    def json(self) -> bytes:
        """The document as JSON bytes (encoded once)."""
        if self._json is None:
            self._json = orjson.dumps(self.doc)
        return self._json


@attrs.define(eq=False)
class SnapshotReader:
    """One push-stream reader: holds at most the latest unsent snapshot."""

    pending: PublishedSnapshot | None = None
    closed: bool = False
    _event: anyio.Event | None = None

    def notify(self) -> None:
        """Wake the reader's writer task."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        """Wait until a snapshot is pending or the hub closes."""
        if self.pending is not None or self.closed:
            return
        self._event = anyio.Event()
        await self._event.wait()

    def is_closed(self) -> bool:
        """Whether the hub ended this reader's stream."""
        return self.closed

    def take(self) -> PublishedSnapshot | None:
        """The pending snapshot, if any (coalesced: only the latest)."""
        snap, self.pending = self.pending, None
        return snap


@attrs.define
class SnapshotHub:
    """The latest snapshot of one engine, and its push-stream readers."""

    latest: PublishedSnapshot
    _readers: set[SnapshotReader] = attrs.field(factory=set)

    def publish(self, snap: PublishedSnapshot) -> None:
        """Make ``snap`` the latest and hand it to every reader (replacing unsent ones)."""
        self.latest = snap
        for r in self._readers:
            r.pending = snap
            r.notify()

    def subscribe(self) -> SnapshotReader:
        """A new reader; its first snapshot is the current one."""
        r = SnapshotReader(pending=self.latest)
        self._readers.add(r)
        return r

    def unsubscribe(self, reader: SnapshotReader) -> None:
        """Forget ``reader``."""
        self._readers.discard(reader)

    @property
    def num_readers(self) -> int:
        """Connected push-stream readers."""
        return len(self._readers)

    def close(self) -> None:
        """End every reader's stream (engine stopping or restarting)."""
        for r in self._readers:
            r.closed = True
            r.notify()


@attrs.define(eq=False)
class BatchReader:
    """One ``/bear/batches`` reader: a bounded buffer of records, oldest dropped first."""

    capacity: int
    buffer: deque[dict[str, Any]] = attrs.field(factory=deque)
    dropped: int = 0
    closed: bool = False
    _event: anyio.Event | None = None

    def push(self, record: dict[str, Any]) -> None:
        """Queue one record (dropping the oldest when full)."""
        if len(self.buffer) >= self.capacity:
            self.buffer.popleft()
            self.dropped += 1
        self.buffer.append(record)
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        """Wait until a record is queued or the hub closes."""
        if self.buffer or self.closed:
            return
        self._event = anyio.Event()
        await self._event.wait()

    def drain(self) -> bytes:
        """Every queued record as NDJSON; the first carries ``dropped`` after a loss."""
        out = []
        first = True
        while self.buffer:
            rec = self.buffer.popleft()
            if first and self.dropped:
                rec = {**rec, "dropped": self.dropped}
                self.dropped = 0
            first = False
            out.append(orjson.dumps(rec))
        return b"\n".join(out) + b"\n" if out else b""

    def close(self) -> None:
        """End the reader's stream."""
        self.closed = True
        if self._event is not None:
            self._event.set()
            self._event = None


@attrs.define
class BatchHub:
    """Batch records of one engine, fanned out to ``/bear/batches`` readers.

    Args:
        capacity: Records each reader may have unsent before the oldest are dropped.
    """

    capacity: int = 4096
    _readers: set[BatchReader] = attrs.field(factory=set)

    def publish(self, record: dict[str, Any]) -> None:
        """Hand one record to every reader."""
        for r in self._readers:
            r.push(record)

    @property
    def has_readers(self) -> bool:
        """Whether anyone listens (records are built only then)."""
        return bool(self._readers)

    def subscribe(self) -> BatchReader:
        """A new reader (it receives records from now on)."""
        r = BatchReader(self.capacity)
        self._readers.add(r)
        return r

    def unsubscribe(self, reader: BatchReader) -> None:
        """Forget ``reader``."""
        self._readers.discard(reader)

    def close(self) -> None:
        """End every reader's stream."""
        for r in self._readers:
            r.close()


@attrs.define(eq=False)
class DelayLine:
    """Publishes captured snapshots ``delay_s()`` after their capture, in order.

    Args:
        delay_s: The current delay (a fault setting, changed at run time).
        publish: Where a snapshot goes once due (the engine's current hub).
    """

    delay_s: Callable[[], float]
    publish: Callable[[PublishedSnapshot], None]
    _pending: deque[PublishedSnapshot] = attrs.field(init=False, factory=deque)
    _event: anyio.Event | None = attrs.field(init=False, default=None)

    def put(self, snap: PublishedSnapshot) -> None:
        """Publish ``snap`` now, or once due when a delay is set or others wait."""
        if self.delay_s() <= 0 and not self._pending:
            self.publish(snap)
            return
        self._pending.append(snap)
        if self._event is not None:
            self._event.set()
            self._event = None

    def clear(self) -> None:
        """Forget the snapshots not yet published (a restart)."""
        self._pending.clear()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Publish pending snapshots as they fall due, until cancelled."""
        task_status.started()
        pending = self._pending
        while True:
            while not pending:
                self._event = anyio.Event()
                await self._event.wait()
            snap = pending[0]
            await anyio.sleep_until(snap.captured_at + self.delay_s())
            if pending and pending[0] is snap:
                pending.popleft()
                self.publish(snap)


def batch_record(instance: str, epoch: str, shape: BatchShape, duration_s: float) -> dict[str, Any]:
    """The ``bear.batch/1`` record of one batch that ran ``duration_s``."""
    return {
        "schema": "bear.batch/1",
        "instance": instance,
        "epoch": epoch,
        "time": time.time(),
        "num_seqs": shape.num_seqs,
        "prefill_tokens": shape.prefill_tokens,
        "decode_tokens": shape.decode_tokens,
        "decode_context": shape.decode_context,
        "prefill_attention": shape.prefill_attention,
        "duration_s": duration_s,
    }
