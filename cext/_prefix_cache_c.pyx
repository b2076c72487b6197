# Compiled fast path of the kv.prefix_cache validator (bearsdk._prefix_cache_c).
#
# bearsdk/prefix_cache.py (prefix_cache_from_dict) is the reference. A busy
# engine's extension names tens of thousands of keys and block references
# (runs expanded per request, every index checked against the pool), and the
# reference spends 10-30 ms on one in Python: more than a router may spend per
# snapshot. This module runs the same checks over C arrays (a mark per block for
# "free", "held" and "named twice") and builds the same PrefixCacheState.
#
# Contract, as bearsdk._snapshot_c's: validate() returns the state when the
# extension is valid and of a shape it fully understands (lists and dicts, as a
# JSON decoder makes them), and None otherwise. None is never an error: the
# caller then runs the reference, which raises the reference message or (for a
# valid extension this path is too strict for, e.g. tuples for lists) returns
# the state. So this path never reproduces an error message and must accept
# only what the reference accepts, with equal values; a differential test pins
# that (tests/test_prefix_cache_twins.py).

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport free
from libc.string cimport memset

from _mem cimport mem_alloc
from _pyint cimport int_in, is_key

from bearsdk.prefix_cache import KEY_LIMIT, MAX_CACHE_ENTRIES, PrefixCacheState

IMPLEMENTATION = "cython"

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL

cdef int64_t MAX_ENTRIES = MAX_CACHE_ENTRIES
# Per-block marks.
cdef enum:
    M_FREE = 1
    M_HELD = 2

cdef object K_KEYS = "keys"
cdef object K_CACHED = "cached"
cdef object K_FREE = "free"
cdef object K_EVENTS = "events_seq"
cdef object K_BLOCKS = "blocks"
cdef object K_UNCACHED = "uncached_blocks"
cdef object K_CHAIN = "chain"


cdef class _Scratch:
    """Marks and index buffers of one validation (freed with it)."""

    cdef uint8_t* mark      # per cached block: M_FREE | M_HELD
    cdef int64_t* stamp     # per key: the last run list (1 + its number) that named it
    cdef int64_t* idx       # a run list's expanded indices
    cdef int64_t n_keys

    def __dealloc__(self):
        free(self.mark)
        free(self.stamp)
        free(self.idx)


cdef inline bint bounded_list(object v):
    """_list: a list (as a JSON decoder makes it) of at most MAX_CACHE_ENTRIES items."""
    return type(v) is list and PyList_GET_SIZE(v) <= MAX_ENTRIES


cdef tuple expand(object v, int64_t stop, int64_t serial, _Scratch sc, int64_t* budget,
                  list ints):
    """_expand: a tuple of the indices of ``[start, count]`` runs, or None."""
    cdef Py_ssize_t j, nruns, k
    cdef int64_t start, count, n = 0, i
    cdef object run
    cdef tuple out
    if not bounded_list(v):
        return None
    nruns = PyList_GET_SIZE(v)
    if nruns and stop == 0:
        return None
    for j in range(nruns):
        run = <object>PyList_GET_ITEM(v, j)
        if type(run) is not list or PyList_GET_SIZE(run) != 2:
            return None
        if not int_in(<object>PyList_GET_ITEM(run, 0), 0, stop - 1, &start):
            return None
        if not int_in(<object>PyList_GET_ITEM(run, 1), 1, stop - start, &count):
            return None
        budget[0] -= count
        if budget[0] < 0:
            return None
        for i in range(start, start + count):
            if sc.stamp[i] == serial:
                return None  # named twice
            sc.stamp[i] = serial
            sc.idx[n] = i
            n += 1
    out = PyTuple_New(n)
    for k in range(n):
        run = <object>PyList_GET_ITEM(ints, sc.idx[k])
        Py_INCREF(run)
        PyTuple_SET_ITEM(out, k, run)
    return out


def validate(raw, long long block_size, long long num_blocks, long long free_blocks,
             requests, rows):
    """prefix_cache_from_dict's checks; the state, or None to defer to the reference.

    Args:
        raw: The ``kv.prefix_cache`` value.
        block_size: ``kv.block_size``. num_blocks: ``kv.num_blocks``.
        free_blocks: ``kv.free_blocks``.
        requests: The raw request objects.
        rows: The validated rows of the same requests.

    Returns:
        The :class:`~bearsdk.prefix_cache.PrefixCacheState`, or None when the
        reference must decide (every invalid extension among others).
    """
    cdef Py_ssize_t i, n_keys, n_free, n_req, j
    cdef int64_t cached, e, queued = 0, budget = MAX_ENTRIES, lo, hi, events = -1
    cdef int64_t n_un, need, known, held = 0, private = 0, b, x
    cdef int64_t state, prompt, computed, output
    cdef object v, r, row, keys_raw, free_raw
    cdef PyObject* p
    cdef tuple mine, chain
    cdef list ints, blocks = [], uncached = [], chains = []
    cdef tuple empty = ()
    cdef _Scratch sc = _Scratch()
    if type(raw) is not dict or type(requests) is not list or type(rows) is not list:
        return None
    if block_size <= 0 or num_blocks <= 0:
        return None
    n_req = PyList_GET_SIZE(requests)
    if PyList_GET_SIZE(rows) != n_req:
        return None
    for v in raw:
        if v != K_KEYS and v != K_CACHED and v != K_FREE and v != K_EVENTS:
            return None
    # keys: exactly ints in [0, 2**63)
    p = PyDict_GetItemWithError(raw, K_KEYS)
    if p == NULL:
        return None
    keys_raw = <object>p
    if not bounded_list(keys_raw):
        return None
    n_keys = PyList_GET_SIZE(keys_raw)
    for i in range(n_keys):
        v = <object>PyList_GET_ITEM(keys_raw, i)
        if not is_key(v):
            return None
    p = PyDict_GetItemWithError(raw, K_CACHED)
    if p == NULL or not int_in(<object>p, 0, min(n_keys, num_blocks), &cached):
        return None
    p = PyDict_GetItemWithError(raw, K_EVENTS)
    if p != NULL and not int_in(<object>p, 0, KEY_LIMIT - 1, &events):
        return None
    sc.mark = <uint8_t*>mem_alloc(cached, sizeof(uint8_t))
    memset(sc.mark, 0, cached)
    sc.stamp = <int64_t*>mem_alloc(n_keys, sizeof(int64_t))
    memset(sc.stamp, 0, sizeof(int64_t) * n_keys)
    sc.idx = <int64_t*>mem_alloc(n_keys, sizeof(int64_t))
    # free: cached indices (each once) or -n runs, adding up to free_blocks
    p = PyDict_GetItemWithError(raw, K_FREE)
    if p == NULL:
        return None
    free_raw = <object>p
    if not bounded_list(free_raw):
        return None
    n_free = PyList_GET_SIZE(free_raw)
    lo = -num_blocks
    hi = cached - 1 if cached > 0 else -1
    for i in range(n_free):
        if not int_in(<object>PyList_GET_ITEM(free_raw, i), lo, hi, &e):
            return None
        if e >= 0:
            if sc.mark[e] & M_FREE:
                return None
            sc.mark[e] |= M_FREE
            queued += 1
        else:
            queued -= e
    if queued != free_blocks:
        return None
    # Index objects shared by every tuple (the reference's are equal ints).
    ints = list(range(n_keys))
    for i in range(n_req):
        r = <object>PyList_GET_ITEM(requests, i)
        row = <object>PyList_GET_ITEM(rows, i)
        if type(r) is not dict or type(row) is not list or PyList_GET_SIZE(row) < 4:
            return None
        if not (int_in(<object>PyList_GET_ITEM(row, 0), 0, 1, &state)
                and int_in(<object>PyList_GET_ITEM(row, 1), 0, 1 << 50, &prompt)
                and int_in(<object>PyList_GET_ITEM(row, 2), 0, 1 << 50, &computed)
                and int_in(<object>PyList_GET_ITEM(row, 3), 0, 1 << 50, &output)):
            return None
        known = (prompt + output) // block_size
        mine = empty
        n_un = 0
        p = PyDict_GetItemWithError(r, K_BLOCKS)
        if p != NULL:
            mine = expand(<object>p, cached, 2 * i + 1, sc, &budget, ints)
            if mine is None:
                return None
        p = PyDict_GetItemWithError(r, K_UNCACHED)
        if p != NULL and not int_in(<object>p, 0, num_blocks, &n_un):
            return None
        if state == 0:  # running
            need = (computed + block_size - 1) // block_size
            if len(mine) + n_un != need:
                return None
            if len(mine) > min(computed, prompt + output) // block_size:
                return None
            for j in range(len(mine)):
                b = sc.idx[j]
                if sc.mark[b] & M_FREE:
                    return None
                if not sc.mark[b] & M_HELD:
                    sc.mark[b] |= M_HELD
                    held += 1
        elif len(mine) or n_un:
            return None
        chain = empty
        p = PyDict_GetItemWithError(r, K_CHAIN)
        if p != NULL:
            chain = expand(<object>p, n_keys, 2 * i + 2, sc, &budget, ints)
            if chain is None:
                return None
            if len(mine) + len(chain) > known:
                return None
        private += n_un
        blocks.append(mine)
        uncached.append(n_un)
        chains.append(chain)
    for x in range(cached):
        if not sc.mark[x]:
            return None  # neither free nor held
    if held + private + free_blocks > num_blocks:
        return None
    return PrefixCacheState(
        keys=tuple(keys_raw),
        cached=cached,
        free=tuple(free_raw),
        blocks=tuple(blocks),
        uncached=tuple(uncached),
        chains=tuple(chains),
        events_seq=None if events < 0 else events,
    )
