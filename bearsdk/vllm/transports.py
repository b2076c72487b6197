"""Where the vLLM publisher delivers its documents.

A transport receives every snapshot document the publisher formats (bytes of
one ``bear.snapshot/1``) and, while :attr:`Transport.wants_batches`, every
executed batch as a :data:`BatchTuple`. It is called from the publisher thread
(or from the engine thread when publishing inline), never concurrently, and it
must return quickly: the shared-memory segment is a ``memcpy``, the HTTP side
server hands the document to its own event loop, the file transport appends
one line.

* :class:`ShmTransport`: the seqlock segment of ``docs/protocol.md`` (same host).
* :class:`~bearsdk.vllm.server.SideServer`: ``GET /bear/snapshot``,
  ``/bear/snapshots`` and ``/bear/batches`` over HTTP.
* :class:`FileTransport`: NDJSON files (debugging, offline analysis).
* :class:`RecordingTransport`: keeps everything in memory (tests).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Final, Protocol, runtime_checkable

import orjson

from bearsdk.io.shm import ShmWriter

__all__ = [
    "BATCH_SCHEMA",
    "BatchTuple",
    "FileTransport",
    "RecordingTransport",
    "ShmTransport",
    "Transport",
    "batch_record",
]

BATCH_SCHEMA: Final = "bear.batch/1"

BatchTuple = tuple[int, float, int, int, int, int, int, float]
"""One executed batch: ``(seq, time, num_seqs, prefill_tokens, decode_tokens,
decode_context, prefill_attention, duration_s)``. ``seq`` is that of the
snapshot captured right before the batch was scheduled; ``time`` is the wall
clock when its output reached the scheduler."""


def batch_record(instance: str, epoch: str, b: BatchTuple, *, dropped: int = 0) -> dict[str, Any]:
    """The ``bear.batch/1`` object of one batch (what ``bearsdk calibrate --batches`` reads)."""
    seq, t, num_seqs, pre, dec, dctx, patt, dur = b
    d: dict[str, Any] = {
        "schema": BATCH_SCHEMA,
        "instance": instance,
        "epoch": epoch,
        "seq": seq,
        "time": t,
        "num_seqs": num_seqs,
        "prefill_tokens": pre,
        "decode_tokens": dec,
        "decode_context": dctx,
        "prefill_attention": patt,
        "duration_s": dur,
    }
    if dropped:
        d["dropped"] = dropped
    return d


@runtime_checkable
class Transport(Protocol):
    """A destination of the publisher's documents."""

    @property
    def name(self) -> str:
        """Label in logs and stats."""
        ...

    @property
    def wants_batches(self) -> bool:
        """Whether :meth:`send_batch` has a consumer right now (batch terms cost a little)."""
        ...

    def send(self, payload: bytes) -> None:
        """Deliver one snapshot document."""
        ...

    def send_batch(self, batch: BatchTuple) -> None:
        """Deliver one executed batch."""
        ...

    def close(self) -> None:
        """Release the transport's resources."""
        ...


class ShmTransport:
    """Writes every document into the instance's shared-memory segment.

    The segment is removed on :meth:`close` (a clean engine shutdown), so a
    router's :class:`~bearsdk.io.shm.ShmSource` sees the engine gone instead of
    its last state frozen; a restarted engine recreates it.

    Args:
        path: The segment (see :func:`bearsdk.io.shm.segment_path`).
        capacity: Largest document in bytes; a larger one is refused and counted.
    """

    def __init__(self, path: str | os.PathLike[str], capacity: int = 4 << 20) -> None:
        self._writer = ShmWriter(path, capacity)
        self.path = self._writer.path

    @property
    def name(self) -> str:
        """``shm:<path>``."""
        return f"shm:{self.path}"

    @property
    def wants_batches(self) -> bool:
        """Never: the segment holds snapshots only."""
        return False

    def send(self, payload: bytes) -> None:
        """Write one document (raises ShmError when it exceeds the capacity)."""
        self._writer.write(payload)

    def send_batch(self, batch: BatchTuple) -> None:
        """Batches do not go through shared memory."""

    def close(self) -> None:
        """Unmap and remove the segment."""
        self._writer.close(unlink=True)


class FileTransport:
    """Appends every document as one line to an NDJSON file, batches to a second one.

    For debugging and offline analysis (``bearsdk replay --snapshot`` reads
    one line of it); it writes on the publisher thread, so with
    ``BEARSDK_PUBLISH_THREAD=0`` it slows the engine by a ``write`` per step.

    Args:
        path: The snapshots file (appended to).
        batches_path: The ``bear.batch/1`` file, or None for no batch records.
        instance: Instance name in batch records.
        epoch: Engine run id in batch records.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        batches_path: str | os.PathLike[str] | None = None,
        *,
        instance: str = "",
        epoch: str = "",
    ) -> None:
        self.path = os.fspath(path)
        # Raw descriptors in append mode: one write() per line, no buffer to
        # flush, and a reader never sees half a line.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._fd = os.open(self.path, flags, 0o644)
        self._bfd = -1
        if batches_path is not None:
            try:
                self._bfd = os.open(batches_path, flags, 0o644)
            except OSError:
                os.close(self._fd)
                raise
        self._instance = instance
        self._epoch = epoch

    @property
    def name(self) -> str:
        """``file:<path>``."""
        return f"file:{self.path}"

    @property
    def wants_batches(self) -> bool:
        """Whether a batches file is open."""
        return self._bfd >= 0

    def send(self, payload: bytes) -> None:
        """Append one document line."""
        os.write(self._fd, payload + b"\n")

    def send_batch(self, batch: BatchTuple) -> None:
        """Append one ``bear.batch/1`` line."""
        if self._bfd >= 0:
            rec = batch_record(self._instance, self._epoch, batch)
            os.write(self._bfd, orjson.dumps(rec) + b"\n")

    def close(self) -> None:
        """Close the files."""
        os.close(self._fd)
        if self._bfd >= 0:
            os.close(self._bfd)


class RecordingTransport:
    """Keeps every document and batch in memory (tests, debugging).

    Args:
        on_document: Called with each document as it arrives.
        batches: Whether to ask for batch records.
    """

    def __init__(
        self,
        on_document: Callable[[bytes], None] | None = None,
        *,
        batches: bool = True,
    ) -> None:
        self.documents: list[bytes] = []
        self.batches: list[BatchTuple] = []
        self.closed = False
        self._on_document = on_document
        self._want = batches
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        """``memory``."""
        return "memory"

    @property
    def wants_batches(self) -> bool:
        """As constructed."""
        return self._want

    def send(self, payload: bytes) -> None:
        """Keep ``payload``."""
        with self._lock:
            self.documents.append(payload)
        if self._on_document is not None:
            self._on_document(payload)

    def send_batch(self, batch: BatchTuple) -> None:
        """Keep ``batch``."""
        with self._lock:
            self.batches.append(batch)

    def close(self) -> None:
        """Mark closed."""
        self.closed = True
