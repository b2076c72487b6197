# Checked allocation for bearsdk's Cython modules (`cimport _mem` from cext/).
#
# The house rule for C memory: every growth goes through one helper that
# checks the size for overflow before allocating and, when the allocation
# fails, leaves the caller's block and capacity exactly as they were (so a
# later call that fits still runs on valid memory), then raises MemoryError.
# All functions are `except -1 nogil`: they can be called with or without the
# GIL, and an error propagates out of nogil code like any Python exception.

from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, realloc
from libc.string cimport memcpy

# Allocation sizes are capped well below SIZE_MAX: 2**62 bytes is more than any
# machine has, and keeping n * itemsize under it leaves room for the callers'
# own small additions without wrapping.
cdef enum:
    MEM_MAX_BYTES_LOG2 = 62


cdef inline int mem_bytes(int64_t n, size_t itemsize, size_t* out) except -1 nogil:
    """``n * itemsize`` in out, or MemoryError when it is negative or would overflow."""
    cdef size_t limit = (<size_t>1) << MEM_MAX_BYTES_LOG2
    if n < 0 or itemsize == 0 or <size_t>n > limit / itemsize:
        with gil:
            raise MemoryError(f"refusing to allocate {n} items of {itemsize} bytes")
    out[0] = <size_t>n * itemsize
    return 0


cdef inline int mem_try_resize(void** block, int64_t n, size_t itemsize) noexcept nogil:
    """mem_resize for callers that report failure by return code: -1, nothing raised, *block unchanged."""
    cdef size_t limit = (<size_t>1) << MEM_MAX_BYTES_LOG2
    cdef void* p
    if n < 0 or itemsize == 0 or <size_t>n > limit / itemsize:
        return -1
    p = realloc(block[0], <size_t>n * itemsize if n > 0 else 1)
    if p == NULL:
        return -1
    block[0] = p
    return 0


cdef inline int mem_resize(void** block, int64_t n, size_t itemsize) except -1 nogil:
    """Resize *block to n items; on failure *block is unchanged (still valid) and MemoryError is raised."""
    cdef size_t nbytes
    cdef void* p
    mem_bytes(n, itemsize, &nbytes)
    p = realloc(block[0], nbytes if nbytes > 0 else 1)
    if p == NULL:
        with gil:
            raise MemoryError(f"could not allocate {nbytes} bytes")
    block[0] = p
    return 0


cdef inline void* mem_alloc(int64_t n, size_t itemsize) except NULL nogil:
    """malloc of n items after the overflow check; MemoryError (NULL) on failure."""
    cdef size_t nbytes
    cdef void* p
    mem_bytes(n, itemsize, &nbytes)
    p = malloc(nbytes if nbytes > 0 else 1)
    if p == NULL:
        with gil:
            raise MemoryError(f"could not allocate {nbytes} bytes")
    return p


cdef inline int mem_reserve(void** block, int64_t* cap, int64_t need, int64_t minimum,
                            size_t itemsize) except -1 nogil:
    """Grow *block (capacity *cap items) geometrically to hold at least need items.

    On failure nothing changes (block and cap keep their old values) and
    MemoryError is raised.
    """
    cdef int64_t new_cap
    if need <= cap[0]:
        return 0
    new_cap = cap[0] * 2 if cap[0] < ((<int64_t>1) << 61) else need
    if new_cap < need:
        new_cap = need
    if new_cap < minimum:
        new_cap = minimum
    mem_resize(block, new_cap, itemsize)
    cap[0] = new_cap
    return 0


cdef inline int mem_try_reserve(void** block, int64_t* cap, int64_t n,
                                 size_t itemsize) noexcept nogil:
    """Room for n items in *block (capacity *cap, grown to exactly n); -1, nothing
    raised and nothing changed, when memory runs out."""
    if n > cap[0]:
        if mem_try_resize(block, n, itemsize) < 0:
            return -1
        cap[0] = n
    return 0


cdef inline int mem_try_copy(void** block, int64_t* cap, const void* src, int64_t n,
                             size_t itemsize) noexcept nogil:
    """n items of src into *block (mem_try_reserve, then a copy); -1 as it."""
    if mem_try_reserve(block, cap, n, itemsize) < 0:
        return -1
    if n > 0:
        memcpy(block[0], src, <size_t>n * itemsize)
    return 0
