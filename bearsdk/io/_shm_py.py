"""Pure-Python twin of ``bearsdk.io._shm_c``: the seqlock without C atomics.

Same functions, same results. The counter and length are read and written as
aligned native 8-byte words through a ``memoryview`` cast, and the payload with
slice copies. CPython cannot issue fences, so this twin relies on the hardware
keeping stores in order and loads in order (x86's total store order does; the
interpreter's opaque C calls stop compiler reordering). On weakly ordered CPUs
(ARM) use the compiled module; ``docs/snapshots.md`` says more.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUSY",
    "IMPLEMENTATION",
    "OK",
    "TOO_LARGE",
    "TORN",
    "load_counter",
    "read",
    "read_unchecked",
    "write",
]

IMPLEMENTATION: Final = "python"

OK: Final = 0
BUSY: Final = 1
TORN: Final = 2
TOO_LARGE: Final = 3

_COUNTER: Final = 2  # word index of the counter (byte offset 16)
_LENGTH: Final = 3  # word index of the payload length (byte offset 24)
HEADER_SIZE: Final = 64


def _words(segment: memoryview | bytearray) -> memoryview:
    return memoryview(segment)[:HEADER_SIZE].cast("Q")


def load_counter(segment: memoryview | bytearray) -> int:
    """The sequence counter: odd while a write is in progress."""
    with _words(segment) as w:
        return int(w[_COUNTER])


def write(segment: memoryview | bytearray, payload: bytes | bytearray | memoryview) -> int:
    """Publish ``payload`` (the caller checked it fits); return the new even counter."""
    n = len(payload)
    with _words(segment) as w, memoryview(segment) as seg:
        c = int(w[_COUNTER])
        c += c & 1  # a writer that died mid-write left it odd
        w[_COUNTER] = c + 1
        seg[HEADER_SIZE : HEADER_SIZE + n] = payload
        w[_LENGTH] = n
        w[_COUNTER] = c + 2
    return c + 2


def read(segment: memoryview | bytearray, out: bytearray | memoryview) -> tuple[int, int, int]:
    """Copy the latest complete payload into ``out``; see ``_shm_c.read``."""
    with memoryview(segment) as seg, _words(segment) as w, memoryview(out) as dst:
        capacity = len(seg) - HEADER_SIZE
        if len(dst) < capacity:
            raise ValueError(f"out must hold the capacity of {capacity} bytes (got {len(dst)})")
        c1 = int(w[_COUNTER])
        if c1 & 1:
            return BUSY, 0, c1
        n = int(w[_LENGTH])
        if n > capacity:
            return (TORN if int(w[_COUNTER]) != c1 else TOO_LARGE), 0, c1
        dst[:n] = seg[HEADER_SIZE : HEADER_SIZE + n]
        if int(w[_COUNTER]) != c1:
            return TORN, 0, c1
        return OK, n, c1


def read_unchecked(segment: memoryview | bytearray, out: bytearray | memoryview) -> int:
    """Copy the payload with no consistency check (stress-test control only)."""
    with memoryview(segment) as seg, _words(segment) as w, memoryview(out) as dst:
        n = int(w[_LENGTH])
        if n > len(seg) - HEADER_SIZE or n > len(dst):
            return 0
        dst[:n] = seg[HEADER_SIZE : HEADER_SIZE + n]
        return n
