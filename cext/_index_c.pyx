# Compiled twin of bearsdk/kvevents/_index_py.py: a prompt's chain of block
# content keys, and one instance's prefix index, in C.
#
# The pure-Python module is the reference and the test oracle; this one must
# give the same keys and the same answers, call for call
# (tests/test_prefix_index.py runs both on generated event streams).
#
# Chain keys are CPython's own hash of (parent, tuple(block tokens)), masked to
# 63 bits (bearsdk.replay.blocks.chain_keys): reproduced here lane for lane
# (CPython's tuple hash is xxHash-based and its int hash is the value modulo
# 2**61 - 1, both stable since Python 3.8), so a key computed here meets the
# same key computed by the replay, the emulator or a snapshot.
#
# The index keeps one 24-byte entry per distinct vLLM hash in a dense array and
# two open-addressing tables of int32 entry numbers (by hash key, by content
# key) at most 3/4 full: ~35 to ~57 bytes per cached block, against ~400 for
# the twin's dicts. Entries with equal content and different hashes (vLLM's
# cache_salt, a LoRA) form a list from the table's entry, first stored first.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_KIND, PyUnicode_READ

cimport _mem
from _pyint cimport is_key

cdef extern from *:
    """
    #define BEAR_XXPRIME_1 11400714785074694791ULL
    #define BEAR_XXPRIME_2 14029467366897019727ULL
    #define BEAR_XXPRIME_5 2870177450012600261ULL
    """
    uint64_t BEAR_XXPRIME_1
    uint64_t BEAR_XXPRIME_2
    uint64_t BEAR_XXPRIME_5

__all__ = ["PrefixCore", "chain_keys", "extend_chain", "hash_key", "text_chain", "token_ids"]

cdef uint64_t KEY_MASK = 0x7FFFFFFFFFFFFFFF
cdef uint64_t MODULUS = 0x1FFFFFFFFFFFFFFF  # CPython's _PyHASH_MODULUS, 2**61 - 1
cdef uint64_t ROOT = 0x5BD1E995  # bearsdk.replay.blocks._ROOT
cdef uint64_t FIB = 0x9E3779B97F4A7C15
cdef int32_t EMPTY = -1
cdef int64_t MIN_CAP = 64


ctypedef struct Entry:
    uint64_t hkey    # vLLM's hash as a key (hash_key)
    uint64_t ckey    # the block's content key
    uint32_t count   # blocks with this hash (vLLM caches duplicates)
    int32_t next     # next entry with the same content, or EMPTY


cdef inline uint64_t _int_hash(int64_t v) noexcept nogil:
    # hash(int): the value modulo 2**61 - 1, the sign kept, -1 mapped to -2.
    cdef uint64_t x = <uint64_t>v if v >= 0 else -(<uint64_t>v)
    cdef uint64_t r = (x & MODULUS) + (x >> 61)
    if r >= MODULUS:
        r -= MODULUS
    if v >= 0:
        return r
    if r == 1:
        return <uint64_t>(<int64_t>-2)
    return -r


cdef inline uint64_t _lane(uint64_t acc, uint64_t lane) noexcept nogil:
    acc += lane * BEAR_XXPRIME_2
    acc = (acc << 31) | (acc >> 33)
    return acc * BEAR_XXPRIME_1


cdef inline uint64_t _finish(uint64_t acc, uint64_t n) noexcept nogil:
    acc += n ^ (BEAR_XXPRIME_5 ^ 3527539)
    if acc == <uint64_t>(<int64_t>-1):
        return 1546275796
    return acc


cdef inline uint64_t _block_key(uint64_t parent, const int64_t* tokens, int64_t n) noexcept nogil:
    # hash((parent, tuple(tokens))) & KEY_MASK, as CPython computes it.
    cdef uint64_t inner = BEAR_XXPRIME_5
    cdef int64_t i
    for i in range(n):
        inner = _lane(inner, _int_hash(tokens[i]))
    inner = _finish(inner, <uint64_t>n)
    cdef uint64_t outer = _lane(BEAR_XXPRIME_5, _int_hash(<int64_t>parent))
    outer = _lane(outer, inner)
    return _finish(outer, 2) & KEY_MASK


cdef list _extend(uint64_t parent, object tokens, int64_t first, int block_size):
    # Keys of the full blocks of tokens[first * block_size:], after parent.
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    cdef Py_ssize_t n = len(tokens)
    cdef int64_t nblocks = n // block_size
    cdef list seq = tokens if type(tokens) is list else list(tokens)
    cdef list out = []
    if nblocks <= first:
        return out
    cdef int64_t* buf = <int64_t*>_mem.mem_alloc(block_size, sizeof(int64_t))
    cdef int64_t b, i
    cdef uint64_t key = parent
    try:
        for b in range(first, nblocks):
            for i in range(block_size):
                buf[i] = seq[b * block_size + i]
            key = _block_key(key, buf, block_size)
            out.append(key)
    finally:
        free(buf)
    return out


def chain_keys(tokens, int block_size, start=()):
    """The content keys of every full block of ``tokens``; see
    :func:`bearsdk.replay.blocks.chain_keys` (the same keys)."""
    cdef list keys = list(start)
    cdef uint64_t parent = keys[len(keys) - 1] if keys else ROOT
    keys.extend(_extend(parent, tokens, len(keys), block_size))
    return keys


def token_ids(value):
    """A list copy of ``value`` when it is a list or tuple of ints in [0, 2**63),
    else None (the caller says which element is wrong); see
    :func:`bearsdk.kvevents._index_py.token_ids`."""
    cdef Py_ssize_t i, n
    cdef list out
    cdef object v
    if type(value) is not list and type(value) is not tuple:
        return None
    n = PySequence_Fast_GET_SIZE(value)
    out = PyList_New(n)
    for i in range(n):
        v = <object>PySequence_Fast_GET_ITEM(value, i)
        if not is_key(v):
            return None
        Py_INCREF(v)
        PyList_SET_ITEM(out, i, v)
    return out


def extend_chain(parent, tokens, int block_size):
    """The keys of the full blocks of ``tokens`` after the block keyed ``parent``;
    see :func:`bearsdk.replay.blocks.extend_chain`."""
    return _extend(ROOT if parent is None else <uint64_t>parent, tokens, 0, block_size)


cdef uint64_t FNV_OFFSET = 0xCBF29CE484222325ULL
cdef uint64_t FNV_PRIME = 0x100000001B3


cdef inline uint64_t _fmix64(uint64_t k) noexcept nogil:
    k ^= k >> 33
    k *= 0xFF51AFD7ED558CCDULL
    k ^= k >> 33
    k *= 0xC4CEB9FE1A85EC53ULL
    k ^= k >> 33
    return k


def text_chain(str text, int block_chars):
    """Chained keys of the full ``block_chars``-character blocks of ``text``; see
    :func:`bearsdk.kvevents._index_py.text_chain`."""
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1 (got {block_chars})")
    cdef Py_ssize_t n = len(text), nblocks = n // block_chars, b, i
    cdef int kind = PyUnicode_KIND(text)
    cdef const void* data = PyUnicode_DATA(text)
    cdef uint64_t key = ROOT, h
    cdef list out = []
    for b in range(nblocks):
        h = FNV_OFFSET ^ key
        for i in range(b * block_chars, (b + 1) * block_chars):
            h = (h ^ <uint64_t>PyUnicode_READ(kind, data, i)) * FNV_PRIME
        key = _fmix64(h) & KEY_MASK
        out.append(key)
    return out


cdef inline uint64_t _hash_key(object h) except? 0:
    cdef const unsigned char* p
    cdef Py_ssize_t n, i
    cdef uint64_t v = 0
    if isinstance(h, bytes):
        p = <const unsigned char*>PyBytes_AS_STRING(h)
        n = PyBytes_GET_SIZE(h)
        for i in range(n - 8 if n > 8 else 0, n):
            v = (v << 8) | p[i]
        return v & KEY_MASK
    return <uint64_t>(h & 0x7FFFFFFFFFFFFFFF)


def hash_key(h):
    """vLLM's block hash as a content-key-sized key; see
    :func:`bearsdk.kvevents._index_py.hash_key`."""
    return _hash_key(h)


cdef class PrefixCore:
    """One instance's cached blocks, in C; see :class:`bearsdk.kvevents._index_py.PrefixCore`."""

    cdef readonly int block_size
    cdef readonly int64_t max_blocks
    cdef public int64_t broken
    cdef int64_t _blocks
    cdef Entry* _e
    cdef int64_t _n
    cdef int64_t _ecap
    cdef int32_t* _th   # slot -> entry, by hash key
    cdef int32_t* _tc   # slot -> first entry, by content key
    cdef int64_t _cap   # slots per table, a power of two
    cdef int _shift     # 64 - log2(_cap)

    def __cinit__(self, int block_size, int64_t max_blocks):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if not 0 <= max_blocks < (1 << 31) - 1:
            raise ValueError(f"max_blocks must be in [0, 2**31 - 1) (got {max_blocks})")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._init_tables(MIN_CAP)

    def __dealloc__(self):
        free(self._e)
        free(self._th)
        free(self._tc)

    cdef int _init_tables(self, int64_t cap) except -1:
        cdef int32_t* th = <int32_t*>_mem.mem_alloc(cap, sizeof(int32_t))
        cdef int32_t* tc = <int32_t*>_mem.mem_alloc(cap, sizeof(int32_t)) if th != NULL else NULL
        cdef int64_t i
        if tc == NULL:
            free(th)
            return -1
        for i in range(cap):
            th[i] = EMPTY
            tc[i] = EMPTY
        free(self._th)
        free(self._tc)
        self._th, self._tc, self._cap = th, tc, cap
        self._shift = 64
        while cap > 1:
            cap >>= 1
            self._shift -= 1
        return 0

    cdef inline int64_t _home(self, uint64_t key) noexcept nogil:
        return <int64_t>((key * FIB) >> self._shift)

    cdef inline int64_t _slot_h(self, uint64_t key) noexcept nogil:
        # The slot holding hash key `key`, or the empty slot where it would go.
        cdef int64_t mask = self._cap - 1
        cdef int64_t i = self._home(key)
        while self._th[i] != EMPTY and self._e[self._th[i]].hkey != key:
            i = (i + 1) & mask
        return i

    cdef inline int64_t _slot_c(self, uint64_t key) noexcept nogil:
        cdef int64_t mask = self._cap - 1
        cdef int64_t i = self._home(key)
        while self._tc[i] != EMPTY and self._e[self._tc[i]].ckey != key:
            i = (i + 1) & mask
        return i

    cdef void _unslot(self, int32_t* t, int64_t i, bint by_hash) noexcept nogil:
        # Linear probing's backward-shift deletion: no tombstones to pile up.
        cdef int64_t mask = self._cap - 1
        cdef int64_t j = i, k
        cdef Entry* e
        while True:
            j = (j + 1) & mask
            if t[j] == EMPTY:
                break
            e = &self._e[t[j]]
            k = self._home(e.hkey if by_hash else e.ckey)
            if (i < k <= j) if i <= j else (i < k or k <= j):
                continue
            t[i] = t[j]
            i = j
        t[i] = EMPTY

    cdef int _reserve(self) except -1:
        # Room for one more entry: the entry array grows by 1/4 (memory per
        # block stays bounded), the tables double before they pass 3/4 full.
        cdef int64_t cap
        if self._n == self._ecap:
            cap = self._ecap + self._ecap // 4 if self._ecap >= 256 else 256
            _mem.mem_resize(<void**>&self._e, cap, sizeof(Entry))
            self._ecap = cap
        if (self._n + 1) * 4 > self._cap * 3:
            self._rebuild(self._cap * 2)
        return 0

    cdef int _rebuild(self, int64_t cap) except -1:
        # Both tables at the new size, from the entries: a content list's
        # head is the one entry no other entry's `next` names.
        cdef unsigned char* listed = <unsigned char*>_mem.mem_alloc(self._n, 1)
        cdef int64_t i
        cdef Entry* e
        try:
            self._init_tables(cap)
            for i in range(self._n):
                listed[i] = 0
            for i in range(self._n):
                if self._e[i].next != EMPTY:
                    listed[self._e[i].next] = 1
            for i in range(self._n):
                e = &self._e[i]
                self._th[self._slot_h(e.hkey)] = <int32_t>i
                if not listed[i]:
                    self._tc[self._slot_c(e.ckey)] = <int32_t>i
        finally:
            free(listed)
        return 0

    @property
    def blocks(self):
        """Blocks the index holds (duplicates counted)."""
        return self._blocks

    @property
    def memory_bytes(self):
        """Bytes the index holds in C (entries and both tables)."""
        return self._ecap * sizeof(Entry) + 2 * self._cap * sizeof(int32_t)

    def clear(self):
        """Forget every block."""
        self._n = 0
        self._blocks = 0
        self._init_tables(MIN_CAP)

    def parent_key(self, h):
        """The content key of the block vLLM hashed ``h``, or ``None`` if unknown."""
        cdef int64_t s = self._slot_h(_hash_key(h))
        return None if self._th[s] == EMPTY else self._e[self._th[s]].ckey

    def stored(self, hashes, keys):
        """Blocks ``hashes`` (vLLM's) entered the cache with content ``keys``."""
        cdef Py_ssize_t m = len(hashes), x
        if m != len(keys):
            raise ValueError(f"{m} hashes for {len(keys)} content keys")
        cdef uint64_t hk, ck
        cdef int64_t s, idx, tail
        for x in range(m):
            hk = _hash_key(hashes[x])
            ck = <uint64_t>keys[x]
            s = self._slot_h(hk)
            if self._th[s] != EMPTY:
                self._e[self._th[s]].count += 1
                self._blocks += 1
                continue
            self._reserve()
            idx = self._n
            self._e[idx].hkey = hk
            self._e[idx].ckey = ck
            self._e[idx].count = 1
            self._e[idx].next = EMPTY
            self._n += 1
            self._th[self._slot_h(hk)] = <int32_t>idx
            s = self._slot_c(ck)
            if self._tc[s] == EMPTY:
                self._tc[s] = <int32_t>idx
            else:
                tail = self._tc[s]
                while self._e[tail].next != EMPTY:
                    tail = self._e[tail].next
                self._e[tail].next = <int32_t>idx
            self._blocks += 1

    def removed(self, hashes):
        """Blocks ``hashes`` (vLLM's) left the cache; unknown ones are skipped."""
        cdef int64_t s
        for h in hashes:
            s = self._slot_h(_hash_key(h))
            if self._th[s] == EMPTY:
                continue  # stored before the index joined, or under a broken parent
            self._blocks -= 1
            self._e[self._th[s]].count -= 1
            if self._e[self._th[s]].count == 0:
                self._drop(s)

    cdef void _drop(self, int64_t s) noexcept nogil:
        cdef int64_t idx = self._th[s], c, prev, last
        cdef Entry* e = &self._e[idx]
        self._unslot(self._th, s, True)
        c = self._slot_c(e.ckey)
        if self._tc[c] == idx:
            if e.next == EMPTY:
                self._unslot(self._tc, c, False)
            else:
                self._tc[c] = e.next
        else:
            prev = self._tc[c]
            while self._e[prev].next != idx:
                prev = self._e[prev].next
            self._e[prev].next = e.next
        # Keep the array dense: the last entry moves into the hole.
        last = self._n - 1
        self._n -= 1
        if idx == last:
            return
        self._e[idx] = self._e[last]
        e = &self._e[idx]
        self._th[self._slot_h(e.hkey)] = <int32_t>idx
        c = self._slot_c(e.ckey)
        if self._tc[c] == last:
            self._tc[c] = <int32_t>idx
        else:
            prev = self._tc[c]
            while self._e[prev].next != last:
                prev = self._e[prev].next
            self._e[prev].next = <int32_t>idx

    def hit_blocks(self, keys):
        """How many of ``keys`` (a prompt's chain) are cached here, from the start."""
        cdef Py_ssize_t n = 0
        cdef uint64_t k
        for key in keys:
            k = <uint64_t>key
            if self._tc[self._slot_c(k)] == EMPTY:
                break
            n += 1
        return n

    def engine_keys(self, keys):
        """A prompt's chain as the engine names its blocks, up to the first miss."""
        cdef list out = []
        cdef int64_t s
        for key in keys:
            s = self._slot_c(<uint64_t>key)
            if self._tc[s] == EMPTY:
                break
            out.append(self._e[self._tc[s]].hkey)
        return out
