"""Shared-memory snapshot transport: a seqlock segment per instance (``docs/protocol.md``).

An engine and a router on one host exchange snapshots through one POSIX
shared-memory segment, ``/dev/shm/bear.<instance>``, without any lock and
without the engine ever waiting for a reader. Layout (native byte order, one
host)::

    offset  size  field
         0     8  magic b"BEARSNP1"
         8     4  layout version (1)
        12     4  header size (64)
        16     8  sequence counter: odd while a write is in progress
        24     8  payload length
        32     8  payload capacity
        40     8  payloads refused as too large (writer's count)
        48    16  reserved (0)
        64     -  payload: the snapshot's JSON bytes

:class:`ShmWriter` (engine side) and :class:`ShmReader` (router side) are both
here; the counter protocol itself is ``bearsdk.io._shm_c`` (C11 atomics,
acquire/release) or its pure-Python twin ``bearsdk.io._shm_py``
(``BEARSDK_NO_EXTENSIONS=1``); :data:`IMPLEMENTATION` says which is loaded.
:class:`ShmSource` is the router's I/O edge: it watches the counter and offers
each new complete payload to the instance's cache.

A segment only ever grows: a restarted writer with a larger capacity enlarges
the file, and readers that mapped the smaller one remap when they see a
length beyond their mapping (never reading past it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import re
import struct
import tempfile
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Final, Self

import anyio
import anyio.abc
import attrs

from bearsdk import _twins
from bearsdk import _validators as _v
from bearsdk.io import _shm_py
from bearsdk.io.base import Backoff, _Health, _Tracked
from bearsdk.state.cache import Outcome, Reject

if TYPE_CHECKING:
    from bearsdk.state.cache import SnapshotCache

__all__ = [
    "HEADER_SIZE",
    "IMPLEMENTATION",
    "MAGIC",
    "MAX_CAPACITY",
    "ReadResult",
    "ShmError",
    "ShmReader",
    "ShmSource",
    "ShmWriter",
    "implementations",
    "resolve_segment",
    "segment_path",
]

MAGIC: Final = b"BEARSNP1"
VERSION: Final = 1
HEADER_SIZE: Final = 64
MAX_CAPACITY: Final = 64 << 20
"""Largest segment capacity a reader maps (its read buffer is that large)."""
_HEAD = struct.Struct("=8sII")  # magic, version, header size
_OFF_CAPACITY: Final = 32
_OFF_OVERSIZE: Final = 40


def implementations() -> dict[str, ModuleType]:
    """Every importable seqlock implementation by name (tests run against each)."""
    out: dict[str, ModuleType] = {"python": _shm_py}
    compiled = _twins.available("bearsdk.io._shm_c")
    if compiled is not None:
        out["cython"] = compiled
    return out


def _default_impl() -> ModuleType:
    return _twins.compiled("bearsdk.io._shm_c") or _shm_py


_IMPL: Final = _default_impl()
IMPLEMENTATION: Final[str] = str(_IMPL.IMPLEMENTATION)
"""``"cython"`` or ``"python"``: the seqlock implementation used by default."""


def _impl(name: str | None) -> ModuleType:
    if name is None:
        return _IMPL
    impls = implementations()
    if name not in impls:
        raise ValueError(f"implementation must be one of {sorted(impls)} (got {name!r})")
    return impls[name]


class ShmError(OSError):
    """A segment is missing, not a snapshot segment, or cannot hold a payload."""


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def segment_path(instance: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The segment of ``instance``: ``/dev/shm/bear.<instance>`` (or under ``directory``).

    Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``.
    Without ``/dev/shm`` (not Linux), the temporary directory is used.
    """
    if not instance:
        raise ValueError("instance must be a non-empty string")
    base = _shm_dir() if directory is None else Path(directory)
    return base / f"bear.{_SAFE_NAME.sub('_', instance)}"


def _shm_dir() -> Path:
    return Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def resolve_segment(path: str | os.PathLike[str]) -> Path:
    """A segment's file: ``path`` itself, or a bare name (``"bear.x"``) under ``/dev/shm``.

    A name without any directory part names a shared-memory object, as
    ``shm_open`` names do; write ``./name`` for a file in the working directory.
    """
    raw = os.fspath(path)
    if not raw:
        raise ValueError("path must be a non-empty path or segment name")
    p = Path(raw)
    if os.sep not in raw and (os.altsep is None or os.altsep not in raw):
        return _shm_dir() / p
    return p


class ReadResult:
    """The outcome of one :meth:`ShmReader.read`.

    Attributes:
        status: ``"ok"``, ``"unchanged"``, ``"busy"`` (a write in progress),
            ``"torn"`` (a write overlapped the copy), ``"empty"`` (nothing
            written yet) or ``"too-large"`` (beyond this mapping: remap).
        payload: The payload (a view into the reader's buffer, valid until its
            next read) when ``ok``.
        counter: The sequence counter observed.
    """

    __slots__ = ("counter", "payload", "status")

    def __init__(self, status: str, payload: memoryview | None, counter: int) -> None:
        self.status = status
        self.payload = payload
        self.counter = counter

    def __repr__(self) -> str:
        n = None if self.payload is None else len(self.payload)
        return f"ReadResult({self.status!r}, {n} bytes, counter={self.counter})"


_STATUS: Final = {_shm_py.OK: "ok", _shm_py.BUSY: "busy", _shm_py.TORN: "torn"}


class _Mapping:
    """A mapped segment file (owned fd and mmap, closed together)."""

    def __init__(self, path: Path, fd: int, size: int, writable: bool) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self.mm = mmap.mmap(fd, size, access=access)
        self.view = memoryview(self.mm)
        self.inode = os.fstat(fd).st_ino

    def close(self) -> None:
        self.view.release()
        self.mm.close()
        os.close(self.fd)


def _check_header(view: memoryview, path: Path) -> None:
    magic, version, hsize = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise ShmError(f"{path}: not a snapshot segment (magic {magic!r}, want {MAGIC!r})")
    if version != VERSION or hsize != HEADER_SIZE:
        raise ShmError(
            f"{path}: layout version {version} with a {hsize}-byte header is not supported "
            f"(want version {VERSION}, {HEADER_SIZE} bytes)"
        )


class ShmWriter:
    """The engine side: publishes snapshots into a segment.

    Opening an existing segment reuses it (readers keep their mapping) and
    continues its counter; a larger ``capacity`` grows it. One writer per
    segment: two would break the seqlock.

    Args:
        path: The segment file (see :func:`segment_path`), or a bare segment
            name (see :func:`resolve_segment`).
        capacity: Largest payload in bytes (at most :data:`MAX_CAPACITY`, which
            readers refuse to exceed).
        implementation: ``"cython"`` or ``"python"`` (default: the loaded one).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int = 1 << 20,
        *,
        implementation: str | None = None,
    ) -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in [1, {MAX_CAPACITY}] bytes (got {capacity!r})")
        self.path = resolve_segment(path)
        self._impl = _impl(implementation)
        self.oversize = 0
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            want = HEADER_SIZE + capacity
            fresh = size < HEADER_SIZE
            if size < want:
                os.ftruncate(fd, want)  # grow only: readers may map the old size
                size = want
            self._map = _Mapping(self.path, fd, size, writable=True)
        except BaseException:
            os.close(fd)
            raise
        v = self._map.view
        if not fresh:
            try:
                _check_header(v, self.path)
            except ShmError:
                fresh = True  # not ours or a foreign layout: start the header over
        if fresh:
            v[:HEADER_SIZE] = bytes(HEADER_SIZE)
            _HEAD.pack_into(v, 0, MAGIC, VERSION, HEADER_SIZE)
        struct.pack_into("=Q", v, _OFF_CAPACITY, size - HEADER_SIZE)
        self.capacity = size - HEADER_SIZE

    def write(self, payload: bytes | bytearray | memoryview) -> int:
        """Publish one snapshot document.

        Returns:
            The counter after the write (even).

        Raises:
            ShmError: The payload exceeds the capacity (counted; the segment
                keeps the previous snapshot; nothing is truncated).
        """
        n = len(payload)
        if n > self.capacity:
            self.oversize += 1
            struct.pack_into("=Q", self._map.view, _OFF_OVERSIZE, self.oversize)
            raise ShmError(
                f"{self.path}: payload of {n} bytes exceeds the capacity of {self.capacity} "
                f"bytes ({self.oversize} refused so far)"
            )
        return int(self._impl.write(self._map.view, payload))

    @property
    def counter(self) -> int:
        """The segment's sequence counter."""
        return int(self._impl.load_counter(self._map.view))

    def close(self, *, unlink: bool = False) -> None:
        """Unmap the segment; ``unlink=True`` also removes it (readers then go stale)."""
        self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ShmReader:
    """The router side: reads complete snapshots out of a segment, never blocking the writer.

    Args:
        path: The segment file, or a bare segment name (see :func:`resolve_segment`).
        implementation: ``"cython"`` or ``"python"`` (default: the loaded one).

    Raises:
        ShmError: The segment does not exist or is not a snapshot segment.
    """

    def __init__(self, path: str | os.PathLike[str], *, implementation: str | None = None) -> None:
        self.path = resolve_segment(path)
        self._impl = _impl(implementation)
        self._map = self._open()
        self._buf = bytearray(self._map.size - HEADER_SIZE)
        self._last = -1
        self.torn = 0
        """Reads that overlapped a write (each one retried or reported)."""

    def _open(self) -> _Mapping:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShmError(f"{self.path}: no such segment (is the engine running?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise ShmError(f"{self.path}: {size} bytes is too small for a segment header")
            if size - HEADER_SIZE > MAX_CAPACITY:
                # The reader allocates a buffer of the capacity: a segment of any
                # size would make it allocate any amount.
                raise ShmError(
                    f"{self.path}: capacity must be <= {MAX_CAPACITY} bytes "
                    f"(got {size - HEADER_SIZE})"
                )
            m = _Mapping(self.path, fd, size, writable=False)
        except BaseException:
            os.close(fd)
            raise
        try:
            _check_header(m.view, self.path)
        except BaseException:
            m.close()
            raise
        return m

    @property
    def capacity(self) -> int:
        """Largest payload this mapping can read."""
        return self._map.size - HEADER_SIZE

    @property
    def counter(self) -> int:
        """The current sequence counter (cheap: one atomic load)."""
        return int(self._impl.load_counter(self._map.view))

    def replaced(self) -> bool:
        """The segment file was replaced (unlinked and recreated) since it was opened."""
        try:
            return os.stat(self.path).st_ino != self._map.inode
        except FileNotFoundError:
            return True

    def reopen(self) -> None:
        """Map the segment again (it was replaced or grew)."""
        new = self._open()
        self._map.close()
        self._map = new
        if len(self._buf) < new.size - HEADER_SIZE:
            self._buf = bytearray(new.size - HEADER_SIZE)
        self._last = -1

    def read(self, *, retries: int = 3, if_changed: bool = False) -> ReadResult:
        """Read the latest complete snapshot.

        Args:
            retries: Further attempts after a torn or busy read before giving up.
            if_changed: Return ``"unchanged"`` without copying when the counter
                equals the last successful read's.

        Returns:
            The outcome; on ``ok`` the payload is a view into this reader's buffer.
        """
        status = "busy"
        counter = 0
        for _ in range(retries + 1):
            if if_changed:
                counter = self.counter
                if counter == self._last:
                    return ReadResult("unchanged", None, counter)
            code, n, counter = self._impl.read(self._map.view, self._buf)
            if code == _shm_py.TOO_LARGE:
                return ReadResult("too-large", None, counter)
            status = _STATUS[code]
            if code == _shm_py.TORN:
                self.torn += 1
            if status == "ok":
                if counter == 0:
                    return ReadResult("empty", None, counter)
                self._last = counter
                return ReadResult("ok", memoryview(self._buf)[:n], counter)
        return ReadResult(status, None, counter)

    def read_unchecked(self) -> bytes:
        """The payload without the seqlock check: a torn-read control for stress tests."""
        n = self._impl.read_unchecked(self._map.view, self._buf)
        return bytes(self._buf[:n])

    def close(self) -> None:
        """Unmap the segment."""
        self._map.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@attrs.define
class ShmSource(_Tracked):
    """Watches a shared-memory segment and offers every new snapshot to a cache.

    The event loop checks the counter every ``interval_s`` (one atomic load when
    nothing changed) and copies and decodes the payload only when it did. A torn
    read is rejected (``torn``, counted) and retried at once, up to ``retries``
    times; a missing segment is retried with backoff; a replaced segment (the
    engine restarted and recreated it) is reopened.

    Args:
        path: The segment file (see :func:`segment_path`), or a bare segment
            name (see :func:`resolve_segment`).
        interval_s: Time between counter checks.
        retries: Immediate re-reads after a torn or busy read.
        backoff: Delays between attempts to open a missing segment.
        implementation: ``"cython"`` or ``"python"`` (default: the loaded one).
        name: Label in logs (default: ``shm:{path}``).
    """

    path: Path = attrs.field(converter=resolve_segment)
    interval_s: float = attrs.field(default=0.001, validator=_v.positive)
    retries: int = 3
    backoff: Backoff = attrs.field(factory=Backoff)
    implementation: str | None = None
    _name: str = attrs.field(default="", alias="name")
    _health: _Health = attrs.field(init=False)
    _rng: random.Random = attrs.field(init=False, factory=random.Random)
    _reads: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._name = self._name or f"shm:{self.path}"
        self._health = _Health(self._name)
        _impl(self.implementation)

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Watch the segment until cancelled; ready after the first attempt to open it."""
        started = False
        while True:
            try:
                reader = ShmReader(self.path, implementation=self.implementation)
            except (ShmError, OSError, ValueError) as exc:
                streak = self._health.fail(exc)
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(self.backoff.delay(streak, self._rng))
                continue
            self._health.ok()
            with reader:
                if not started:
                    started = True
                    self._poll(reader, cache, fresh=True)
                    task_status.started()
                await self._watch(reader, cache)

    async def _watch(self, reader: ShmReader, cache: SnapshotCache) -> None:
        fresh = True
        checks = 0
        while True:
            status = self._poll(reader, cache, fresh)
            if status == "accepted":
                fresh = False
            elif status == "too-large":
                reader.reopen()
            checks += 1
            # A replaced segment means a restarted engine; look about once per
            # second of idle checks (a stat call, too slow for every check).
            if checks * self.interval_s >= 1.0:
                checks = 0
                if reader.replaced():
                    self._health.fail(f"{self.path}: segment replaced; reopening")
                    return
            await anyio.sleep(self.interval_s)

    def _poll(self, reader: ShmReader, cache: SnapshotCache, fresh: bool) -> str:
        torn = reader.torn
        res = reader.read(retries=self.retries, if_changed=True)
        for _ in range(reader.torn - torn):
            # Every torn copy is a rejected snapshot, even when a retry then succeeded.
            cache.reject(
                Reject.TORN,
                f"read overlapped a write (counter {res.counter}); discarded",
                source=self._name,
            )
        if res.status == "ok":
            assert res.payload is not None
            self._health.documents += 1
            out = cache.offer_bytes(res.payload, source=self._name, fresh_connection=fresh)
            res.payload.release()
            return "accepted" if out is not Outcome.REJECTED else "rejected"
        if res.status == "busy":
            self._health.busy += 1
        return res.status
