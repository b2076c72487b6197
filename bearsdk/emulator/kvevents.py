"""The emulated engine's KV events, published as vLLM publishes them (``--kv-events``).

With prefix caching on, the engine's scheduler reports each block that enters
the prefix cache and each one evicted
(:meth:`~bearsdk.replay.scheduler.SchedulerCore.record_kv_events`); after every
step they go out as one vLLM ``KVEventBatch`` on a ZeroMQ PUB socket, with a
ROUTER socket that replays recent batches (:mod:`bearsdk.kvevents.transport`).
A content key stands for vLLM's block hash. Needs the ``kvevents`` extra.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import anyio.abc

if TYPE_CHECKING:
    from bearsdk.kvevents.transport import KVEventPublisher
    from bearsdk.replay.scheduler import SchedulerCore

__all__ = ["KVEventFeed"]


class KVEventFeed:
    """One engine's KV event publisher (see the module).

    Args:
        block_size: The engine's tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        from bearsdk.kvevents.transport import KVEventPublisher

        self.block_size = block_size
        self.publisher: KVEventPublisher = KVEventPublisher()
        self._live = False

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind the sockets and serve replays until cancelled."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.publisher.run)
            self._live = True
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._live = False

    def flush(self, core: SchedulerCore) -> int:
        """Publish the events of the steps since the last flush (one batch).

        Returns:
            The sequence number of the last batch published (``-1``: none, or
            the publisher is not running).
        """
        if not self._live:
            return -1
        events = core.take_kv_events()
        if events:
            from bearsdk.kvevents.wire import encode_batch, from_scheduler

            self.publisher.publish(
                encode_batch(time.time(), from_scheduler(events, self.block_size))
            )
        return self.publisher.last_seq

    def cleared(self) -> None:
        """The engine restarted with an empty cache: say so (vLLM's ``AllBlocksCleared``)."""
        if self._live:
            from bearsdk.kvevents.wire import AllBlocksCleared, encode_batch

            self.publisher.publish(encode_batch(time.time(), [AllBlocksCleared()]))
