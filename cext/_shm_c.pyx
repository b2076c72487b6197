# Seqlock over a shared-memory snapshot segment (bearsdk.io._shm_c).
#
# The segment layout and the protocol are in docs/protocol.md and
# bearsdk/io/shm.py; bearsdk/io/_shm_py.py is the pure-Python twin. This module
# does the part Python cannot express: the sequence counter is accessed through
# C11 atomics, so the ordering between the counter and the payload holds on any
# CPU, not only on x86's total store order.
#
# Writer (one per segment):      Reader (any number, no lock):
#   c = counter                    c1 = load_acquire(counter); odd -> busy
#   store(counter, c + 1)          n = length; copy payload[0:n]
#   release fence                  acquire fence
#   write payload, length          c2 = load(counter)
#   store_release(counter, c + 2)  accept iff c1 == c2 (even)
#
# The acquire load of c1 pairs with the writer's final release store, so a
# reader that sees c1 sees the payload that write completed. The acquire fence
# keeps the payload copy before the second counter load; the writer's release
# fence keeps its odd store before any payload byte. If any byte copied came
# from a later write, the reader sees that write's odd (or later) counter in c2.
# The payload copy itself races with the writer by design; it is only used
# after the check proves it was not overwritten.

from libc.stdint cimport uint64_t
from libc.string cimport memcpy

IMPLEMENTATION = "cython"

cdef extern from *:
    """
    #include <stdatomic.h>
    #include <stdint.h>
    static inline uint64_t bear_load_acquire(const unsigned char* p) {
        return atomic_load_explicit((_Atomic uint64_t*)p, memory_order_acquire);
    }
    static inline uint64_t bear_load_relaxed(const unsigned char* p) {
        return atomic_load_explicit((_Atomic uint64_t*)p, memory_order_relaxed);
    }
    static inline void bear_store_relaxed(unsigned char* p, uint64_t v) {
        atomic_store_explicit((_Atomic uint64_t*)p, v, memory_order_relaxed);
    }
    static inline void bear_store_release(unsigned char* p, uint64_t v) {
        atomic_store_explicit((_Atomic uint64_t*)p, v, memory_order_release);
    }
    static inline void bear_fence_acquire(void) { atomic_thread_fence(memory_order_acquire); }
    static inline void bear_fence_release(void) { atomic_thread_fence(memory_order_release); }
    """
    uint64_t bear_load_acquire(const unsigned char* p) noexcept nogil
    uint64_t bear_load_relaxed(const unsigned char* p) noexcept nogil
    void bear_store_relaxed(unsigned char* p, uint64_t v) noexcept nogil
    void bear_store_release(unsigned char* p, uint64_t v) noexcept nogil
    void bear_fence_acquire() noexcept nogil
    void bear_fence_release() noexcept nogil

# Header offsets (bytes); the counter and length are 8-byte aligned.
cdef enum:
    OFF_COUNTER = 16
    OFF_LENGTH = 24
    HEADER_SIZE = 64

# Read outcomes (same values in _shm_py).
OK = 0
BUSY = 1
TORN = 2
TOO_LARGE = 3

cdef enum:
    C_OK = 0
    C_BUSY = 1
    C_TORN = 2
    C_TOO_LARGE = 3


def load_counter(const unsigned char[::1] segment):
    """The sequence counter (acquire load): odd while a write is in progress."""
    return bear_load_acquire(&segment[OFF_COUNTER])


def write(unsigned char[::1] segment, const unsigned char[::1] payload):
    """Publish ``payload`` (the caller checked it fits); return the new even counter."""
    cdef Py_ssize_t n = payload.shape[0]
    cdef unsigned char* base = &segment[0]
    cdef uint64_t c
    with nogil:
        c = bear_load_relaxed(base + OFF_COUNTER)
        c += c & 1  # a writer that died mid-write left it odd
        bear_store_relaxed(base + OFF_COUNTER, c + 1)
        bear_fence_release()
        if n:
            memcpy(base + HEADER_SIZE, &payload[0], n)
        bear_store_relaxed(base + OFF_LENGTH, <uint64_t>n)
        bear_store_release(base + OFF_COUNTER, c + 2)
    return c + 2


cdef int _read(
    const unsigned char* base, Py_ssize_t capacity, unsigned char* out,
    uint64_t* counter, Py_ssize_t* length,
) noexcept nogil:
    cdef uint64_t c1 = bear_load_acquire(base + OFF_COUNTER)
    cdef uint64_t c2
    cdef uint64_t n
    counter[0] = c1
    length[0] = 0
    if c1 & 1:
        return C_BUSY
    n = bear_load_relaxed(base + OFF_LENGTH)
    if n > <uint64_t>capacity:
        # Either a concurrent write (the counter tells) or a segment grown by
        # a restarted writer beyond this mapping (the caller remaps).
        bear_fence_acquire()
        c2 = bear_load_relaxed(base + OFF_COUNTER)
        return C_TORN if c2 != c1 else C_TOO_LARGE
    if n:
        memcpy(out, base + HEADER_SIZE, n)
    bear_fence_acquire()
    c2 = bear_load_relaxed(base + OFF_COUNTER)
    if c2 != c1:
        return C_TORN
    length[0] = <Py_ssize_t>n
    return C_OK


def read(const unsigned char[::1] segment, unsigned char[::1] out):
    """Copy the latest complete payload into ``out``.

    Args:
        segment: The whole mapped segment (header and payload area).
        out: Buffer of at least the segment's payload capacity.

    Returns:
        ``(status, length, counter)``: ``status`` is ``OK`` (``out[:length]``
        holds the payload written under ``counter``), ``BUSY`` (a write was in
        progress), ``TORN`` (a write overlapped the copy) or ``TOO_LARGE``.
    """
    cdef Py_ssize_t capacity = segment.shape[0] - HEADER_SIZE
    cdef uint64_t counter = 0
    cdef Py_ssize_t length = 0
    cdef int status
    if out.shape[0] < capacity:
        raise ValueError(f"out must hold the capacity of {capacity} bytes (got {out.shape[0]})")
    with nogil:
        status = _read(&segment[0], capacity, &out[0], &counter, &length)
    return status, length, counter


def read_unchecked(const unsigned char[::1] segment, unsigned char[::1] out):
    """Copy the payload with no consistency check (stress-test control only)."""
    cdef Py_ssize_t capacity = segment.shape[0] - HEADER_SIZE
    cdef uint64_t n = bear_load_relaxed(&segment[OFF_LENGTH])
    if n > <uint64_t>capacity or n > <uint64_t>out.shape[0]:
        return 0
    if n:
        with nogil:
            memcpy(&out[0], &segment[HEADER_SIZE], n)
    return <Py_ssize_t>n
