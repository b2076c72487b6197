"""The HTTP transport: a small aiohttp server on its own thread and event loop.

vLLM's API server runs in another process than its engine core (where the
scheduler, and so the publisher, lives), and its ``vllm.endpoint_plugins``
hook only adds routes to that other process; so the engine process serves the
snapshot endpoints of ``docs/protocol.md`` itself, on a port of its own:

* ``GET /bear/snapshot``: the latest document;
* ``GET /bear/snapshots``: NDJSON push stream (coalescing, heartbeats,
  ``min_interval_ms``), served by :class:`bearsdk.io.publish.SnapshotPublisher`;
* ``GET /bear/batches``: NDJSON stream of ``bear.batch/1`` records, one per
  executed batch; a slow reader loses the oldest and the next line says how
  many (``"dropped": N``);
* ``GET /bear/publisher``: the publisher's counters (JSON).

The engine side only stores the latest document and, at most once per pass
of the server's loop, wakes that loop (one ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import orjson
from aiohttp import web

from bearsdk.io.publish import SnapshotPublisher
from bearsdk.vllm.transports import BatchTuple, batch_record

__all__ = ["SideServer"]

log = logging.getLogger("bearsdk.vllm")

_NDJSON: Final = "application/x-ndjson"
_START_TIMEOUT_S: Final = 30.0


class _BatchReader:
    """One ``/bear/batches`` connection: a bounded queue, oldest dropped first."""

    __slots__ = ("capacity", "closed", "dropped", "event", "queue")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queue: deque[BatchTuple] = deque()
        self.dropped = 0
        self.closed = False
        self.event = asyncio.Event()

    def push(self, b: BatchTuple) -> None:
        if len(self.queue) >= self.capacity:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(b)
        self.event.set()

    def close(self) -> None:
        self.closed = True
        self.event.set()


class SideServer:
    """Serves one engine's snapshots and batches over HTTP from a background thread.

    Args:
        host: Address to bind.
        port: Port to bind (0: any free port; see :attr:`port`).
        instance: The engine instance name.
        epoch: This engine run's id.
        heartbeat_s: Idle interval between heartbeat lines on the streams.
        batch_buffer: Records a ``/bear/batches`` reader may have unsent.
        stats: Returns the publisher's counters for ``GET /bear/publisher``.

    Raises:
        OSError: The port cannot be bound (the server thread has ended).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        instance: str,
        epoch: str,
        heartbeat_s: float = 1.0,
        batch_buffer: int = 4096,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._host = host
        self._instance = instance
        self._epoch = epoch
        self._heartbeat_s = heartbeat_s
        self._batch_buffer = batch_buffer
        self._stats = stats
        self._snapshots = SnapshotPublisher(instance, heartbeat_s=heartbeat_s, epoch=epoch)
        self._readers: set[_BatchReader] = set()
        self._pending: bytes | None = None
        self._batches: deque[BatchTuple] = deque()
        # Records the hand-off queue lost: written by the engine side only,
        # read by the loop, so no lock is needed.
        self._lost = 0
        self._lost_seen = 0
        self._wake_pending = False
        self._closed = False
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self.port = port
        self._thread = threading.Thread(
            target=self._run, args=(port,), name=f"bearsdk-http-{instance}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise OSError(f"bearsdk side server on {host}:{port} did not start")
        error = self._startup_error()
        if error is not None:
            self._thread.join()
            raise OSError(f"bearsdk side server cannot serve on {host}:{port}: {error}")

    def _startup_error(self) -> BaseException | None:
        # Set by the server thread before it signals readiness.
        return self._error

    @property
    def name(self) -> str:
        """``http://host:port``."""
        return f"http://{self._host}:{self.port}"

    @property
    def wants_batches(self) -> bool:
        """Whether a ``/bear/batches`` reader is connected."""
        return bool(self._readers)

    # -- engine side (any thread) ----------------------------------------------------

    def send(self, payload: bytes) -> None:
        """Make ``payload`` the latest document (streams get it on the server's next pass)."""
        self._pending = payload
        self._wake()

    def send_batch(self, batch: BatchTuple) -> None:
        """Queue one batch record for the ``/bear/batches`` readers."""
        q = self._batches
        if len(q) >= self._batch_buffer:
            # The loop has fallen a whole buffer behind: the oldest go, counted.
            q.popleft()
            self._lost += 1
        q.append(batch)
        self._wake()

    def _wake(self) -> None:
        # One wake-up per pass of the loop, however many documents arrive:
        # _flush always takes the latest.
        if not self._wake_pending and not self._closed:
            self._wake_pending = True
            with contextlib.suppress(RuntimeError):  # the loop has just stopped
                self._loop.call_soon_threadsafe(self._flush)

    def close(self) -> None:
        """End every stream, stop the server and join its thread."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)

    # -- server thread ----------------------------------------------------------------

    def _flush(self) -> None:
        self._wake_pending = False
        data, self._pending = self._pending, None
        if data is not None:
            self._snapshots.publish(data)
        lost = self._lost - self._lost_seen
        if lost:
            self._lost_seen += lost
            for r in self._readers:
                r.dropped += lost
        while self._batches:
            b = self._batches.popleft()
            for r in self._readers:
                r.push(b)

    def _run(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(port))
        except BaseException as exc:  # report any failure to the constructor
            self._error = exc
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._snapshots.close()
            for r in list(self._readers):
                r.close()
            if self._runner is not None:
                self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

    async def _start(self, port: int) -> None:
        app = web.Application()
        self._snapshots.add_routes(app)
        app.router.add_get("/bear/batches", self._handle_batches)
        app.router.add_get("/bear/publisher", self._handle_stats)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self._host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        for addr in runner.addresses:
            if isinstance(addr, tuple) and len(addr) >= 2:
                self.port = int(addr[1])
                break

    async def _handle_stats(self, request: web.Request) -> web.Response:
        body = self._stats() if self._stats is not None else {}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _handle_batches(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": _NDJSON})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        reader = _BatchReader(self._batch_buffer)
        self._readers.add(reader)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.event.wait(), self._heartbeat_s)
                reader.event.clear()
                if reader.closed:
                    break
                lines = []
                while reader.queue:
                    rec = batch_record(
                        self._instance, self._epoch, reader.queue.popleft(), dropped=reader.dropped
                    )
                    reader.dropped = 0
                    lines.append(orjson.dumps(rec))
                await resp.write(b"\n".join(lines) + b"\n" if lines else b"\n")
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self._readers.discard(reader)
        return resp
