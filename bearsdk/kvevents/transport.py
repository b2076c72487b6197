"""vLLM's KV event transport over ZeroMQ: a publisher (the emulator's) and a subscriber.

As vLLM 0.33's ``ZmqEventPublisher`` does it: a PUB socket sends each batch
as ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter from 0; a
ROUTER socket answers a replay request (the first sequence number wanted, 8
bytes big-endian) with every buffered batch from there as
``(topic, seq, payload)``, then an end marker (``seq = -1``, empty payload).

The subscriber applies batches to a :class:`~bearsdk.kvevents.index.PrefixIndex`
in sequence order. A gap (a batch lost on the PUB socket, which drops under
its high-water mark) is filled from the replay socket before anything later
is applied, so the index is exact again at once; when the publisher's buffer
no longer holds the missing batches, or the sequence starts over (an engine
restart), the index is cleared and rebuilt from what follows (blocks stored
before are then unknown: fewer hits, never false ones), or, where the engine's
snapshots say which batch they include (``kv.prefix_cache.events_seq``, the
emulator's), rebuilt exactly from the first snapshot past the gap. Runs on asyncio
(``zmq.asyncio``), the router's event loop.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import attrs
import zmq
import zmq.asyncio

from bearsdk.kvevents.index import PrefixIndex
from bearsdk.kvevents.wire import KVEventError, decode_batch

if TYPE_CHECKING:
    from bearsdk.prefix_cache import PrefixCacheState

__all__ = ["KVEventPublisher", "KVEventSubscriber"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind; a ``tcp://host:0`` endpoint gets a free port. Returns what was bound."""
    sock.bind(endpoint)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


@attrs.define
class KVEventPublisher:
    """Publishes KV event batches as vLLM does (the emulator's ``--kv-events``).

    Args:
        endpoint: PUB address to bind (``tcp://127.0.0.1:0``: a free port).
        replay_endpoint: ROUTER address for replay requests (``None``: none).
        buffer_steps: Past batches kept for replay.
        topic: Topic frame of every message.
    """

    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    buffer_steps: int = 10_000
    topic: str = ""
    _ctx: zmq.asyncio.Context = attrs.field(init=False, factory=zmq.asyncio.Context)
    _pub: Any = attrs.field(init=False, default=None)
    _replay: Any = attrs.field(init=False, default=None)
    _buffer: deque[tuple[int, bytes]] = attrs.field(init=False, factory=deque)
    _seq: int = attrs.field(init=False, default=0)
    drop_next: int = attrs.field(init=False, default=0)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind and serve replay requests until cancelled (start it with ``tg.start``)."""
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, self.replay_endpoint)
        try:
            task_status.started()
            if self._replay is None:
                await anyio.sleep_forever()
            while True:
                frames = await self._replay.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in self._buffer:
                    if seq >= first:
                        await self._replay.send_multipart(
                            (client, b"", self.topic.encode(), seq.to_bytes(8, "big"), payload)
                        )
                await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            for s in (self._pub, self._replay):
                if s is not None:
                    s.close(linger=0)
            self._ctx.term()

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch published (``-1``: none yet)."""
        return self._seq - 1

    def publish(self, payload: bytes) -> None:
        """Send one batch (an encoded ``KVEventBatch``) and keep it for replay.

        ``drop_next`` (tests) leaves that many batches unsent, as a PUB socket
        past its high-water mark would: they are still buffered for replay.
        """
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if len(self._buffer) > self.buffer_steps:
            self._buffer.popleft()
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        self._pub.send_multipart((self.topic.encode(), seq.to_bytes(8, "big"), payload))


_MAX_PENDING: Final = 20_000
"""Batches kept while waiting for a snapshot to resync from (vLLM's own replay
buffer holds 10,000): past it the oldest go, and an older snapshot no longer
serves."""


@attrs.define
class KVEventSubscriber:
    """Keeps one instance's :class:`PrefixIndex` from its KV event stream.

    Args:
        index: The index to feed.
        endpoint: The engine's PUB address (``--kv-events-config``'s ``endpoint``).
        replay_endpoint: Its replay address (``None``: a gap clears the index).
        topic: Topic to subscribe to.
        snapshots: The instance's latest snapshot's ``kv.prefix_cache``, where
            the engine says which batch it includes (``events_seq``): after a gap
            nothing could fill, the index is rebuilt from the first such snapshot
            that includes the gap, then the batches after it are applied.
        resync_interval_s: How often to look for that snapshot while waiting.

    Attributes:
        applied: Batches applied. replayed: Of them, fetched from the replay socket.
        resyncs: Times the index was cleared. rebuilt: Of them, rebuilt from a snapshot.
        bad: Payloads refused. last_seq: The last sequence number applied (``-1``: none).
        resyncing: The index misses blocks (a gap) and waits for a snapshot.
    """

    index: PrefixIndex
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    snapshots: Callable[[], PrefixCacheState | None] | None = None
    resync_interval_s: float = 0.25
    applied: int = 0
    replayed: int = 0
    resyncs: int = 0
    rebuilt: int = 0
    bad: int = 0
    last_seq: int = -1
    resyncing: bool = False
    _pending: deque[tuple[int, bytes]] = attrs.field(
        init=False, factory=lambda: deque(maxlen=_MAX_PENDING)
    )
    _ctx: zmq.asyncio.Context = attrs.field(init=False, factory=zmq.asyncio.Context)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Subscribe and apply batches until cancelled (start it with ``tg.start``)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        wait_ms = max(1, int(self.resync_interval_s * 1000))
        try:
            task_status.started()
            while True:
                if self.resyncing:
                    # Poll rather than cancel a receive: an idle engine sends
                    # nothing, and its snapshot must still be looked at.
                    self.resync()
                    if not await sub.poll(timeout=wait_ms):
                        continue
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.bad += 1
                    continue
                await self._receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)
            self._ctx.term()

    def resync(self) -> bool:
        """Rebuild the index from the latest snapshot, if one includes the gap.

        Returns:
            Whether the index was rebuilt (it is then exact again).
        """
        if not self.resyncing or self.snapshots is None:
            return False
        pc = self.snapshots()
        if pc is None or pc.events_seq is None:
            return False
        at = pc.events_seq
        first = self._pending[0][0] if self._pending else self.last_seq + 1
        if at + 1 < first:
            return False  # taken before the gap ended
        if pc.cached > self.index.max_blocks:
            self.bad += 1
            return False
        # The publisher that says events_seq names its blocks by their content keys.
        held = pc.keys[: pc.cached]
        self.index.clear()
        self.index.stored(held, held)
        for seq, payload in self._pending:
            if seq > at:
                self._decode(seq, payload)
        self._pending.clear()
        self.last_seq = max(self.last_seq, at)
        self.resyncing = False
        self.rebuilt += 1
        log.info("KV events: the prefix index was rebuilt from the snapshot of batch %d", at)
        return True

    async def _receive(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            if seq == 0:
                # The sequence starts over: the engine restarted, its cache is empty.
                self.index.clear()
                self.resyncs += 1
                self.last_seq = -1
                self.resyncing = False
                self._pending.clear()
            else:
                return  # a duplicate, or a batch a snapshot already included
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            await self._fill(self.last_seq + 1, seq)
        self._apply(seq, payload)

    async def _fill(self, first: int, upto: int) -> None:
        """Fetch batches ``first .. upto - 1`` from the replay socket, or resync."""
        got: list[tuple[int, bytes]] = []
        if self.replay_endpoint is not None:
            # A DEALER with REQ's empty envelope frame: the publisher's ROUTER sees
            # a REQ request, and the DEALER may read its many replies (a REQ takes one).
            req = self._ctx.socket(zmq.DEALER)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(self.replay_endpoint)
            try:
                with anyio.move_on_after(2.0):
                    await req.send_multipart((b"", first.to_bytes(8, "big")))
                    while True:
                        frames = await req.recv_multipart()
                        if frames[-2] == END_SEQ:
                            break
                        got.append((int.from_bytes(frames[-2], "big"), frames[-1]))
            finally:
                req.close(linger=0)
        wanted = [(s, p) for s, p in got if first <= s < upto]
        if not wanted or wanted[0][0] != first or len(wanted) != upto - first:
            log.warning(
                "KV events %d..%d are lost (replay gave %d): the prefix index starts over%s",
                first,
                upto - 1,
                len(wanted),
                "" if self.snapshots is None else " until a snapshot includes them",
            )
            self.index.clear()
            self.resyncs += 1
            self._pending.clear()
            self.resyncing = self.snapshots is not None
            return
        for s, p in wanted:
            self._apply(s, p)
            self.replayed += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.resyncing:
            # Applied now (fewer hits, never false ones) and again after the rebuild.
            self._pending.append((seq, payload))
        self._decode(seq, payload)
        self.applied += 1
        self.last_seq = seq

    def _decode(self, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(decode_batch(payload))
        except KVEventError as exc:
            self.bad += 1
            log.warning("KV event batch %d refused: %s", seq, exc)
