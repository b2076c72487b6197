# Compiled replay with vLLM's automatic prefix caching (bearsdk.replay._replay_apc_c).
#
# The twin of the pure-Python replay when a policy has kv.prefix_caching and
# the snapshot carries kv.prefix_cache: the same steps as
# bearsdk/replay/scheduler.py (SchedulerCore) over bearsdk/replay/blocks.py
# (BlockPool), block for block, at C speed; the property tests and the vLLM
# cases require identical batches. docs/prefix-caching.md gives every rule with
# its vLLM source line.
#
# The plain compiled loop (_replay_c) folds decodes into an aggregate; here
# every allocation's block identity matters (which cached block it evicts,
# where a freed block goes, what a later admission hits), so each batch is
# formed request by request. What keeps a replay cheap is that it copies only
# what it touches from the prepared snapshot:
#
# * requests, blocks and free-queue runs are copied on first touch (an epoch
#   per record says whether this replay's copy is current), so a replay of a
#   snapshot with tens of thousands of cached blocks pays for the few it uses;
# * the content map (key -> first holder, holders chained first cached first)
#   is the prepared open-addressing table plus a per-replay overlay of the keys
#   the replay changed;
# * block and key lists that grow live in one per-replay arena, addressed by
#   offset (the arena may move when it grows).
#
# Block ids are the prepared pool's (cached blocks first, then the residents'
# uncached blocks); blocks named during the replay (taken from a run of unnamed
# free blocks) get the ids after them.

from libc.stdint cimport INT64_MIN, int8_t, int32_t, int64_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from cpython.long cimport PyLong_AsUnsignedLongLongMask, PyLong_CheckExact

from _mem cimport mem_alloc, mem_reserve, mem_resize
from _replay_defs cimport (
    R_FIRST_TOKEN, R_HORIZON, R_LIMIT, R_NEVER, S_FINISHED, S_RUNNING, S_WAITING, STAGE_DECODES,
    STAGE_PREFILLS, STAGE_WAITING, WM_ALWAYS, WM_WHILE_RUNNING, Coeffs, Params, arrival_arg, cdiv,
    horizon_arg, imax, imin, output_limit, output_target, read_coeffs, read_policy, tokens_arg,
    tokens_wanted,
)

cdef extern from "Python.h":
    int _PyLong_Sign(object v)
    size_t _PyLong_NumBits(object v) except? -1

import numpy as np

from bearsdk.errors import short_repr
from bearsdk.replay.types import (
    MAX_REPLAY_WORK_PY as _MAX_WORK_PY, MAX_TOKENS as _MAX_TOKENS_PY, BatchRecord, ReplayResult,
    StopReason, check_arrival, check_horizon, check_next_tokens, check_policy, check_running,
    check_table, check_tokens,
)
from bearsdk.snapshot import (
    COL_COMPUTED, COL_MAX_TOKENS, COL_OUTPUT, COL_OUTPUT_LEN, COL_PLACEHOLDERS,
    COL_PROMPT, COL_STATE, NCOLS, STATE_RUNNING,
)

IMPLEMENTATION = "cython"

cdef extern from "math.h" nogil:
    double INFINITY
    double fmax(double, double)

# Per batch in the log: num_seqs, prefill, decode, decode context, prefill
# attention, admitted, preempted, duration (bits), offset and count of its
# (slot, tokens) pairs.
cdef enum:
    LOG_W = 10

cdef int64_t NOKEY = INT64_MIN  # a block with nothing findable
# (an enum, so that the compiler folds it: module variables are loads)
cdef enum:
    NIL = -1
cdef int64_t KEY_MASK = 0x7fffffffffffffff
# Block ids are int32; the pool never names more (a replay that would is
# refused rather than wrapped).
cdef int64_t MAX_BLOCK_IDS = 0x7fffffff - 16
MIN_ANY = -_MAX_TOKENS_PY
# The work bound counts the twin's units (a batch, and each request in it or in
# the running list), so both twins stop at the same batch.
cdef int64_t MAX_WORK = _MAX_WORK_PY

ctypedef struct Rq:
    int64_t prompt
    int64_t outputs
    int64_t target
    int64_t limit
    int64_t computed
    int64_t ph          # async placeholders
    int64_t inflight    # tokens in batches not processed yet
    int64_t nblk        # blocks held (block list length)
    int64_t cached      # how many of them are findable
    int64_t nkeys       # content keys known (key list length)
    int64_t blk_off     # block list: offset into the prepared blob, or the arena when blk_own
    int64_t blk_cap
    int64_t key_off     # key list: likewise
    int64_t key_cap
    int64_t in_batch    # serial of the batch being formed once scheduled in it
    int32_t sched_pos   # ... and its entry there
    int8_t status
    int8_t prefilled
    int8_t blk_own
    int8_t key_own

ctypedef struct Blk:
    int64_t key         # NOKEY: nothing findable
    int32_t ref
    int32_t hnext       # next block holding the same key (first cached first)
    int32_t fprev       # free-queue neighbours (nodes: see node ids below)
    int32_t fnext

ctypedef struct Run:
    int64_t count       # unnamed free blocks
    int32_t fprev
    int32_t fnext

# Free-queue nodes: a block id (>= 0), a run r as -(r + 2), NIL = -1.

ctypedef struct HEnt:
    int64_t key
    int32_t head        # first holder; -1: empty slot

ctypedef struct OEnt:
    int64_t key
    int32_t head        # first holder; -1: no holder any more
    int32_t epoch       # the entry is live when it is this replay's

ctypedef struct Batch:
    int32_t* ent_s      # scheduled entries in order: slot ...
    int64_t* ent_n      # ... and tokens (-1: taken back by a preemption)
    int64_t n_ent
    int64_t cap_ent
    int64_t nlive
    int32_t* samp       # requests it samples a token for
    int64_t* got        # ... and how many tokens each receives
    int64_t n_samp
    int64_t cap_samp
    bint carried        # the batch in flight at the snapshot: got counts are in flight too
    bint has_new
    int64_t serial
    int64_t pre
    int64_t dec
    int64_t dctx
    int64_t patt
    int64_t admitted
    int64_t preempted

ctypedef struct St:
    Params* P
    # requests (copied on first touch)
    Rq* r
    Rq* src
    int32_t* rep
    int64_t cap_r
    int32_t* run
    int64_t n_run
    int32_t* wq         # waiting queue: ring buffer (capacity a power of two)
    int64_t wq_mask
    int64_t wq_head
    int64_t wq_n
    int32_t new_slot
    bint new_seen       # admission looked at the new request (see last_new_examined)
    # blocks (copied on first touch below nb0; named during the replay above)
    Blk* bl
    Blk* src_bl
    int32_t* bep
    int64_t nb0
    int64_t nb
    int64_t cap_bl
    int64_t cap_bep
    Run* runs
    Run* src_runs
    int32_t* rnep
    int64_t nruns
    int64_t cap_runs
    int32_t fq_head
    int32_t fq_tail
    int64_t n_free
    # content map: prepared table + this replay's overlay
    HEnt* ht
    int64_t ht_mask
    OEnt* ov
    int64_t ov_mask
    int64_t ov_n
    int32_t cur
    int64_t serial_key
    # block and key lists that grew in this replay
    int32_t* ab
    int64_t ab_n
    int64_t ab_cap
    int64_t* ak
    int64_t ak_n
    int64_t ak_cap
    const int32_t* pbb  # the prepared blobs
    const int64_t* pkb
    # scratch
    int32_t* hit
    int64_t cap_hit
    int32_t* first
    int64_t cap_first
    # pipeline: up to two batches queued and one being formed
    Batch ring[3]
    int64_t ring_head
    int64_t ring_n
    int64_t serial
    # clocks and coefficients
    int64_t k
    int64_t work
    int64_t max_work
    Coeffs c            # eq. 12 (read_coeffs)
    double t
    double horizon  # stop past it before the first token (INFINITY: never)
    double arrival  # the new request joins before the first batch at or after it
    bint pending_new  # it has not joined yet
    bint record
    int64_t* log
    int64_t n_log
    int64_t cap_log
    int64_t* tlog
    int64_t n_tlog
    int64_t cap_tlog
    # the new request's tokens: batch index and time of each (next_tokens)
    int64_t want
    int64_t n_tok
    int64_t* tok_k
    double* tok_t
    int64_t cap_tok


# ---------------------------------------------------------------------------
# Copy on touch
# ---------------------------------------------------------------------------

cdef inline Rq* R(St* st, int64_t s) noexcept nogil:
    if st.rep[s] != st.cur:
        st.r[s] = st.src[s]
        st.rep[s] = st.cur
    return &st.r[s]


cdef inline Blk* B(St* st, int64_t b) noexcept nogil:
    if b < st.nb0 and st.bep[b] != st.cur:
        st.bl[b] = st.src_bl[b]
        st.bep[b] = st.cur
    return &st.bl[b]


cdef inline Run* RN(St* st, int64_t r) noexcept nogil:
    if r < st.nruns and st.rnep[r] != st.cur:
        st.runs[r] = st.src_runs[r]
        st.rnep[r] = st.cur
    return &st.runs[r]


# ---------------------------------------------------------------------------
# Free queue (BlockPool._free): blocks and runs of unnamed blocks, front first
# ---------------------------------------------------------------------------

cdef inline int32_t* nprev(St* st, int32_t node) noexcept nogil:
    if node >= 0:
        return &B(st, node).fprev
    return &RN(st, -node - 2).fprev


cdef inline int32_t* nnext(St* st, int32_t node) noexcept nogil:
    if node >= 0:
        return &B(st, node).fnext
    return &RN(st, -node - 2).fnext


cdef void fq_unlink(St* st, int32_t node) noexcept nogil:
    cdef int32_t p = nprev(st, node)[0]
    cdef int32_t n = nnext(st, node)[0]
    if p == NIL:
        st.fq_head = n
    else:
        nnext(st, p)[0] = n
    if n == NIL:
        st.fq_tail = p
    else:
        nprev(st, n)[0] = p


cdef void fq_push_back(St* st, int32_t node) noexcept nogil:
    nprev(st, node)[0] = st.fq_tail
    nnext(st, node)[0] = NIL
    if st.fq_tail == NIL:
        st.fq_head = node
    else:
        nnext(st, st.fq_tail)[0] = node
    st.fq_tail = node


cdef void fq_push_front(St* st, int32_t node) noexcept nogil:
    nnext(st, node)[0] = st.fq_head
    nprev(st, node)[0] = NIL
    if st.fq_head == NIL:
        st.fq_tail = node
    else:
        nprev(st, st.fq_head)[0] = node
    st.fq_head = node


# ---------------------------------------------------------------------------
# Content map (BlockPool._cached)
# ---------------------------------------------------------------------------

cdef inline uint64_t mix(int64_t k) noexcept nogil:
    # splitmix64's finaliser: keys from the engine are hashes already, but
    # the replay's own keys count down from -1.
    cdef uint64_t z = <uint64_t>k
    z = (z ^ (z >> 30)) * <uint64_t>0xbf58476d1ce4e5b9
    z = (z ^ (z >> 27)) * <uint64_t>0x94d049bb133111eb
    return z ^ (z >> 31)


cdef inline int32_t ht_get(HEnt* ht, int64_t mask, int64_t k) noexcept nogil:
    cdef int64_t i
    if ht == NULL:
        return NIL
    i = <int64_t>(mix(k) & <uint64_t>mask)
    while ht[i].head != NIL:
        if ht[i].key == k:
            return ht[i].head
        i = (i + 1) & mask
    return NIL


cdef inline OEnt* ov_find(St* st, int64_t k) noexcept nogil:
    """The overlay's live entry for k, or the empty slot where it would go."""
    cdef int64_t i = <int64_t>(mix(k) & <uint64_t>st.ov_mask)
    while st.ov[i].epoch == st.cur:
        if st.ov[i].key == k:
            return &st.ov[i]
        i = (i + 1) & st.ov_mask
    return &st.ov[i]


cdef inline int32_t head_of(St* st, int64_t k) noexcept nogil:
    cdef OEnt* e
    if st.ov_n:
        e = ov_find(st, k)
        if e.epoch == st.cur:
            return e.head
    return ht_get(st.ht, st.ht_mask, k)


cdef int ov_grow(St* st) except -1 nogil:
    """Double the overlay (a new table: the old one stays valid if that fails)."""
    cdef int64_t cap = (st.ov_mask + 1) * 2, i
    cdef OEnt* old = st.ov
    cdef int64_t old_cap = st.ov_mask + 1
    cdef OEnt* e
    cdef OEnt* nw = <OEnt*>mem_alloc(cap, sizeof(OEnt))
    memset(nw, 0, sizeof(OEnt) * cap)
    st.ov = nw
    st.ov_mask = cap - 1
    for i in range(old_cap):
        if old[i].epoch == st.cur:
            e = ov_find(st, old[i].key)
            e[0] = old[i]
    free(old)
    return 0


cdef int set_head(St* st, int64_t k, int32_t h) except -1 nogil:
    cdef OEnt* e
    if (st.ov_n + 1) * 2 > st.ov_mask + 1:
        ov_grow(st)
    e = ov_find(st, k)
    if e.epoch != st.cur:
        e.epoch = st.cur
        e.key = k
        st.ov_n += 1
    e.head = h
    return 0


cdef int add_holder(St* st, int64_t k, int32_t b) except -1 nogil:
    cdef int32_t h = head_of(st, k), x
    B(st, b).hnext = NIL
    if h == NIL:
        set_head(st, k, b)
        return 0
    x = h
    while B(st, x).hnext != NIL:
        x = B(st, x).hnext
    B(st, x).hnext = b
    return 0


cdef int forget(St* st, int64_t k, int32_t b) except -1 nogil:
    cdef int32_t h = head_of(st, k), x
    cdef Blk* q = B(st, b)
    if h == b:
        set_head(st, k, q.hnext)
    else:
        x = h
        while x != NIL and B(st, x).hnext != b:
            x = B(st, x).hnext
        if x != NIL:
            B(st, x).hnext = q.hnext
    q.hnext = NIL
    return 0


# ---------------------------------------------------------------------------
# Per-request block and key lists
# ---------------------------------------------------------------------------

cdef inline int32_t* BL(St* st, Rq* q) noexcept nogil:
    return (st.ab if q.blk_own else <int32_t*>st.pbb) + q.blk_off


cdef inline int64_t* KL(St* st, Rq* q) noexcept nogil:
    return (st.ak if q.key_own else <int64_t*>st.pkb) + q.key_off


cdef int blk_reserve(St* st, Rq* q, int64_t need) except -1 nogil:
    """Room for need blocks in q's list, in this replay's arena."""
    cdef int64_t cap
    if q.blk_own and need <= q.blk_cap:
        return 0
    cap = imax(imax(need, q.blk_cap * 2), 8)
    mem_reserve(<void**>&st.ab, &st.ab_cap, st.ab_n + cap, 256, sizeof(int32_t))
    if q.nblk:
        memcpy(st.ab + st.ab_n, BL(st, q), sizeof(int32_t) * q.nblk)
    q.blk_off = st.ab_n
    q.blk_cap = cap
    q.blk_own = 1
    st.ab_n += cap
    return 0


cdef int keys_extend(St* st, Rq* q, int64_t nblocks) except -1 nogil:
    """q's keys for its first nblocks full blocks (SchedulerCore._keys).

    A replayed request has no token ids: past the keys it came with, its blocks
    hold content only it has (a key no other block can have).
    """
    cdef int64_t cap, i
    cdef int64_t* keys
    if q.nkeys >= nblocks:
        return 0
    if not q.key_own or nblocks > q.key_cap:
        cap = imax(imax(nblocks, q.key_cap * 2), 8)
        mem_reserve(<void**>&st.ak, &st.ak_cap, st.ak_n + cap, 256, sizeof(int64_t))
        if q.nkeys:
            memcpy(st.ak + st.ak_n, KL(st, q), sizeof(int64_t) * q.nkeys)
        q.key_off = st.ak_n
        q.key_cap = cap
        q.key_own = 1
        st.ak_n += cap
    keys = KL(st, q)
    for i in range(q.nkeys, nblocks):
        st.serial_key -= 1
        keys[i] = st.serial_key
    q.nkeys = nblocks
    return 0


# ---------------------------------------------------------------------------
# The pool (BlockPool)
# ---------------------------------------------------------------------------

cdef int64_t evictable(St* st, int32_t* blocks, int64_t n) noexcept nogil:
    cdef int64_t i, e = 0
    for i in range(n):
        e += B(st, blocks[i]).ref == 0
    return e


cdef void touch(St* st, int32_t* blocks, int64_t n) noexcept nogil:
    cdef int64_t i
    cdef Blk* q
    for i in range(n):
        q = B(st, blocks[i])
        if q.ref == 0:
            fq_unlink(st, blocks[i])
            st.n_free -= 1
        q.ref += 1


cdef int name_block(St* st) except -1 nogil:
    cdef int64_t b = st.nb
    cdef Blk* q
    if b >= MAX_BLOCK_IDS:
        with gil:
            raise MemoryError(f"a replay would name more than {MAX_BLOCK_IDS} KV blocks")
    mem_reserve(<void**>&st.bl, &st.cap_bl, b + 1, 64, sizeof(Blk))
    q = &st.bl[b]
    q.key = NOKEY
    q.ref = 1
    q.hnext = NIL
    q.fprev = NIL
    q.fnext = NIL
    st.nb = b + 1
    return <int>0


cdef int allocate(St* st, Rq* q, int64_t n) except -1 nogil:
    """Append n blocks from the front of the free queue to q's list (callers check n_free)."""
    cdef int64_t got = 0, take, j
    cdef int32_t e
    cdef Run* run
    cdef Blk* blk
    cdef int32_t* out
    if n <= 0:
        return 0
    blk_reserve(st, q, q.nblk + n)
    while got < n:
        e = st.fq_head
        if e < 0:
            run = RN(st, -e - 2)
            take = imin(run.count, n - got)
            run.count -= take
            if run.count == 0:
                fq_unlink(st, e)
            for j in range(take):
                name_block(st)
                BL(st, q)[q.nblk] = <int32_t>(st.nb - 1)
                q.nblk += 1
            got += take
            st.n_free -= take
            continue
        fq_unlink(st, e)
        st.n_free -= 1
        blk = B(st, e)
        if blk.key != NOKEY:
            forget(st, blk.key, e)
            blk = B(st, e)
            blk.key = NOKEY
        blk.ref = 1
        BL(st, q)[q.nblk] = e
        q.nblk += 1
        got += 1
    return 0


cdef int cache_blocks(St* st, Rq* q, int64_t tokens) except -1 nogil:
    """Make q's full blocks up to tokens (capped at its tokens) findable (SchedulerCore._cache)."""
    cdef int64_t full = imin(tokens, q.prompt + q.outputs) // st.P.bs, i
    cdef int32_t b
    cdef Blk* blk
    cdef int64_t k
    if full <= q.cached:
        return 0
    keys_extend(st, q, full)
    for i in range(q.cached, full):
        b = BL(st, q)[i]
        blk = B(st, b)
        if blk.key != NOKEY:
            continue
        k = KL(st, q)[i]
        blk.key = k
        add_holder(st, k, b)
    q.cached = full
    return 0


cdef int release(St* st, Rq* q) except -1 nogil:
    """Free q's blocks tail first: cached ones to the back, the rest to the front."""
    cdef int64_t i, nf = 0
    cdef int32_t b
    cdef Blk* blk
    if q.nblk > st.cap_first:
        mem_reserve(<void**>&st.first, &st.cap_first, q.nblk, 64, sizeof(int32_t))
    for i in range(q.nblk - 1, -1, -1):
        b = BL(st, q)[i]
        blk = B(st, b)
        blk.ref -= 1
        if blk.ref == 0:
            st.n_free += 1
            if blk.key == NOKEY:
                st.first[nf] = b
                nf += 1
            else:
                fq_push_back(st, b)
    for i in range(nf - 1, -1, -1):
        fq_push_front(st, st.first[i])
    q.nblk = 0
    q.cached = 0
    return 0


# ---------------------------------------------------------------------------
# Queues
# ---------------------------------------------------------------------------

cdef inline int32_t wq_at(St* st, int64_t i) noexcept nogil:
    return st.wq[(st.wq_head + i) & st.wq_mask]


cdef inline void wq_push_back(St* st, int32_t s) noexcept nogil:
    st.wq[(st.wq_head + st.wq_n) & st.wq_mask] = s
    st.wq_n += 1


cdef inline void wq_push_front(St* st, int32_t s) noexcept nogil:
    st.wq_head = (st.wq_head - 1) & st.wq_mask
    st.wq[st.wq_head] = s
    st.wq_n += 1


cdef void wq_remove_at(St* st, int64_t i) noexcept nogil:
    cdef int64_t j
    for j in range(i, 0, -1):
        st.wq[(st.wq_head + j) & st.wq_mask] = st.wq[(st.wq_head + j - 1) & st.wq_mask]
    st.wq_head = (st.wq_head + 1) & st.wq_mask
    st.wq_n -= 1


cdef void wq_remove(St* st, int32_t s) noexcept nogil:
    cdef int64_t i
    for i in range(st.wq_n):
        if wq_at(st, i) == s:
            wq_remove_at(st, i)
            return


cdef void run_remove(St* st, int32_t s) noexcept nogil:
    cdef int64_t i, j
    for i in range(st.n_run):
        if st.run[i] == s:
            for j in range(i, st.n_run - 1):
                st.run[j] = st.run[j + 1]
            st.n_run -= 1
            return


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------

cdef int sched_add(St* st, Batch* b, int32_t s, int64_t n) except -1 nogil:
    cdef Rq* q = R(st, s)
    if b.n_ent == b.cap_ent:
        mem_reserve(<void**>&b.ent_s, &b.cap_ent, b.n_ent + 1, 16, sizeof(int32_t))
        b.cap_ent = b.n_ent  # both arrays grow together
        mem_reserve(<void**>&b.ent_n, &b.cap_ent, b.n_ent + 1, 16, sizeof(int64_t))
    q.in_batch = b.serial
    q.sched_pos = <int32_t>b.n_ent
    b.ent_s[b.n_ent] = s
    b.ent_n[b.n_ent] = n
    b.n_ent += 1
    b.nlive += 1
    return 0


cdef int samp_add(Batch* b, int32_t s, int64_t got) except -1 nogil:
    if b.n_samp == b.cap_samp:
        mem_reserve(<void**>&b.samp, &b.cap_samp, b.n_samp + 1, 16, sizeof(int32_t))
        b.cap_samp = b.n_samp
        mem_reserve(<void**>&b.got, &b.cap_samp, b.n_samp + 1, 16, sizeof(int64_t))
    b.samp[b.n_samp] = s
    b.got[b.n_samp] = got
    b.n_samp += 1
    return 0


cdef Batch* ring_new(St* st) noexcept nogil:
    cdef Batch* b = &st.ring[(st.ring_head + st.ring_n) % 3]
    st.ring_n += 1
    st.serial += 1
    b.serial = st.serial
    b.n_ent = b.nlive = b.n_samp = 0
    b.carried = b.has_new = False
    b.pre = b.dec = b.dctx = b.patt = b.admitted = b.preempted = 0
    return b


cdef inline bint fits(St* st, Batch* b, int64_t n) noexcept nogil:
    """Padded budgets charge every sequence the longest chunk in the batch."""
    cdef int64_t longest = n, i
    if not st.P.padded:
        return True
    for i in range(b.n_ent):
        if b.ent_n[i] > longest:
            longest = b.ent_n[i]
    return (b.nlive + 1) * longest <= st.P.token_budget


# ---------------------------------------------------------------------------
# Scheduling (SchedulerCore.schedule)
# ---------------------------------------------------------------------------

cdef int preempt(St* st, Batch* b, int32_t s) except -1 nogil:
    cdef Rq* q = R(st, s)
    release(st, q)
    q.computed = 0
    q.ph = 0
    q.prefilled = 0
    q.status = S_WAITING
    if not st.P.keep_outputs:
        q.outputs = 0
    if st.P.requeue_front:
        wq_push_front(st, s)
    else:
        wq_push_back(st, s)
    return 0


cdef int grow(St* st, Batch* b, int32_t s, int64_t n, int64_t* budget) except -1 nogil:
    """Blocks for n more tokens of s, preempting from the back: 1 if allocated, 0 if not."""
    cdef Rq* q = R(st, s)
    cdef int64_t need, one_free = st.P.one_free and q.prefilled
    cdef int32_t v
    cdef Rq* vq
    while True:
        q = R(st, s)
        # (compared, not divided: this runs for every request in every batch)
        need = 0
        if q.computed + n > q.nblk * st.P.bs:
            need = cdiv(q.computed + n, st.P.bs) - q.nblk
        if imax(need, one_free) <= st.n_free:
            if need:
                allocate(st, q, need)
            if imin(q.computed + n, q.prompt + q.outputs) >= (q.cached + 1) * st.P.bs:
                cache_blocks(st, q, q.computed + n)
            return 1
        if not st.P.victim_newest:
            return 0
        st.n_run -= 1
        v = st.run[st.n_run]
        vq = R(st, v)
        if v != s and vq.in_batch == b.serial and b.ent_n[vq.sched_pos] >= 0:
            budget[0] += b.ent_n[vq.sched_pos]
            b.ent_n[vq.sched_pos] = -1
            b.nlive -= 1
            vq.in_batch = -1
        preempt(st, b, v)
        b.preempted += 1
        if v == s:
            return 0


cdef int64_t serve_running(St* st, Batch* b, int64_t budget, int64_t cap, int32_t stage) except -2 nogil:
    cdef int64_t i = 0, n
    cdef int32_t s
    cdef Rq* q
    cdef int64_t mml = st.P.mml
    while i < st.n_run and budget > 0:
        s = st.run[i]
        q = R(st, s)
        if ((stage == STAGE_DECODES and not q.prefilled)
                or (stage == STAGE_PREFILLS and q.prefilled)
                or q.in_batch == b.serial):
            i += 1
            continue
        if q.ph > 0 and q.outputs + q.ph >= q.limit:
            # Async: its last token is in flight; it keeps seat and blocks.
            i += 1
            continue
        n = q.prompt + q.outputs + q.ph - q.computed
        if 0 < cap < n:
            n = cap
        n = imin(n, budget)
        if mml:
            n = imin(n, mml - q.computed - 1)
        if n <= 0 or not fits(st, b, n):
            i += 1
            continue
        if not grow(st, b, s, n, &budget):
            break
        sched_add(st, b, s, n)
        budget -= n
        i += 1
    return budget


cdef inline int64_t watermark(St* st) noexcept nogil:
    cdef int32_t a = st.P.wm_applies
    if a == WM_ALWAYS or (a == WM_WHILE_RUNNING and st.n_run):
        return st.P.wm_blocks
    return 0


cdef int64_t lookup(St* st, Rq* q, int64_t most) except -1 nogil:
    """The cached blocks matching q's keys from the start (into st.hit): their count."""
    cdef int64_t i, n = imin(q.nkeys, most)
    cdef int32_t h
    cdef int64_t* keys
    if n > st.cap_hit:
        mem_reserve(<void**>&st.hit, &st.cap_hit, n, 64, sizeof(int32_t))
    keys = KL(st, q)
    for i in range(n):
        h = head_of(st, keys[i])
        if h == NIL:
            return i
        st.hit[i] = h
    return n


cdef int reserve_cached(St* st, int32_t s, int64_t n, int64_t nhit) except -1 nogil:
    """KV admission of a waiting request's first chunk past its hit: 1 if admitted."""
    cdef Rq* q = R(st, s)
    cdef int64_t bs = st.P.bs, wm = watermark(st), full, hit_tokens, new
    cdef int64_t ev = evictable(st, st.hit, nhit)
    if st.P.reserve_full:
        full = q.prompt + q.outputs
        if st.P.mml:
            full = imin(full, st.P.mml)
        if imax(cdiv(full, bs) - nhit, 0) + ev + wm > st.n_free:
            return 0
    hit_tokens = nhit * bs
    new = imax(cdiv(hit_tokens + n, bs) - nhit, 0)
    if new + ev + wm > st.n_free:
        return 0
    touch(st, st.hit, nhit)
    q.nblk = 0
    blk_reserve(st, q, nhit + new)
    memcpy(BL(st, q), st.hit, sizeof(int32_t) * nhit)
    q.nblk = nhit
    allocate(st, q, new)
    q.cached = nhit
    q.computed = hit_tokens
    cache_blocks(st, q, hit_tokens + n)
    return 1


cdef int64_t admit(St* st, Batch* b, int64_t budget, int64_t cap) except -2 nogil:
    cdef int64_t i = 0, n, nhit, most
    cdef int32_t s
    cdef Rq* q
    cdef bint blocked
    cdef Params* P = st.P
    while budget > 0 and i < st.wq_n:
        if st.n_run >= P.max_seqs:
            break
        s = wq_at(st, i)
        if s == st.new_slot:
            st.new_seen = True
        q = R(st, s)
        if q.inflight > 0:
            # Preempted with output still in flight: it cannot resume until
            # that output lands, but it does not block the queue.
            i += 1
            continue
        # The last token is always computed (its logits are needed).
        most = (q.prompt + q.outputs - 1) // P.bs
        nhit = lookup(st, q, most)
        n = q.prompt + q.outputs - nhit * P.bs
        if 0 < cap < n:
            n = cap
        blocked = (not P.chunked and n > budget) or not fits(st, b, imin(n, budget))
        if not blocked:
            n = imin(n, budget)
            blocked = not reserve_cached(st, s, n, nhit)
        if blocked:
            if P.stop_on_blocked:
                break
            i += 1
            continue
        wq_remove_at(st, i)
        q = R(st, s)
        q.status = S_RUNNING
        st.run[st.n_run] = s
        st.n_run += 1
        sched_add(st, b, s, n)
        b.admitted += 1
        budget -= n
    return budget


cdef int after_schedule(St* st, Batch* b) except -1 nogil:
    cdef int64_t i, n, c
    cdef int32_t s
    cdef Rq* q
    cdef bint is_async = st.P.depth > 1
    for i in range(b.n_ent):
        n = b.ent_n[i]
        if n < 0:
            continue
        s = b.ent_s[i]
        q = R(st, s)
        c = q.computed  # context before this batch
        if q.prefilled:
            b.dec += n
            b.dctx += c * n
        else:
            b.pre += n
            b.patt += n * c + n * (n + 1) // 2
        q.computed += n
        q.inflight += n
        if q.computed >= q.prompt + q.outputs + q.ph:
            # Not a partial chunk: this step samples a token for it.
            q.prefilled = 1
            samp_add(b, s, 1)
            if s == st.new_slot:
                b.has_new = True
            if is_async:
                q.ph += 1
    return 0


cdef int schedule(St* st, Batch* b) except -1 nogil:
    cdef Params* P = st.P
    cdef int64_t budget = P.token_budget, cap = P.chunk_cap
    cdef int32_t i, stage
    if cap and P.cap_exempt_alone and st.n_run + st.wq_n <= 1:
        cap = 0
    for i in range(P.n_stages):
        stage = P.stages[i]
        if stage == STAGE_WAITING:
            if b.preempted and not P.admit_after_preemption:
                continue
            budget = admit(st, b, budget, cap)
        else:
            budget = serve_running(st, b, budget, cap, stage)
        if P.exclusive and b.nlive:
            break
    after_schedule(st, b)
    return 0


# ---------------------------------------------------------------------------
# Outputs (SchedulerCore.process)
# ---------------------------------------------------------------------------

cdef int process(St* st, Batch* b) except -1 nogil:
    cdef int64_t i, got, bs = st.P.bs
    cdef int32_t s
    cdef Rq* q
    cdef bint is_async = st.P.depth > 1
    for i in range(b.n_ent):
        if b.ent_n[i] >= 0:
            R(st, b.ent_s[i]).inflight -= b.ent_n[i]
    if b.carried:
        for i in range(b.n_samp):
            R(st, b.samp[i]).inflight -= b.got[i]
    for i in range(b.n_samp):
        s = b.samp[i]
        q = R(st, s)
        if q.status == S_FINISHED:
            continue
        got = b.got[i]
        if q.status == S_WAITING:
            # Preempted while its token was in flight: it still receives it.
            q.outputs += got
            if q.outputs >= q.target:
                q.status = S_FINISHED
                wq_remove(st, s)
            continue
        q.outputs += got
        if is_async:
            q.ph -= got
            # The token just landed completes blocks computed while it was in
            # flight: they become findable now.
            if imin(q.computed - q.inflight, q.prompt + q.outputs) >= (q.cached + 1) * bs:
                cache_blocks(st, q, q.computed - q.inflight)
        if q.outputs >= q.target:
            q.status = S_FINISHED
            release(st, q)
            run_remove(st, s)
    return 0


# ---------------------------------------------------------------------------
# The engine loop (SchedulerCore.go)
# ---------------------------------------------------------------------------

cdef int log_batch(St* st, Batch* b, double dt) except -1 nogil:
    cdef int64_t* e
    cdef int64_t i
    mem_reserve(<void**>&st.log, &st.cap_log, st.n_log + LOG_W, 64 * LOG_W, sizeof(int64_t))
    mem_reserve(<void**>&st.tlog, &st.cap_tlog, st.n_tlog + 2 * b.nlive, 256, sizeof(int64_t))
    e = st.log + st.n_log
    e[0] = b.nlive
    e[1] = b.pre
    e[2] = b.dec
    e[3] = b.dctx
    e[4] = b.patt
    e[5] = b.admitted
    e[6] = b.preempted
    memcpy(&e[7], &dt, sizeof(double))
    e[8] = st.n_tlog
    e[9] = b.nlive
    st.n_log += LOG_W
    for i in range(b.n_ent):
        if b.ent_n[i] >= 0:
            st.tlog[st.n_tlog] = b.ent_s[i]
            st.tlog[st.n_tlog + 1] = b.ent_n[i]
            st.n_tlog += 2
    return 0


cdef int go(St* st, int64_t max_batches) except -1 nogil:
    cdef Batch* b
    cdef Batch* q
    cdef double dt
    cdef int64_t j
    cdef bint inert
    while True:
        if st.pending_new and st.t >= st.arrival:
            wq_push_back(st, st.new_slot)
            st.pending_new = False
        b = ring_new(st)
        schedule(st, b)
        st.work += 1 + st.n_run + b.nlive
        if b.nlive:
            st.k += 1
            dt = (st.c.b0 + st.c.b1 * fmax(<double>(b.pre + b.dec), st.c.tau)
                  + st.c.b2 * <double>b.dctx + st.c.b2s * <double>b.dec + st.c.b3 * <double>b.patt)
            st.t += dt
            if st.record:
                log_batch(st, b, dt)
            if b.has_new:
                st.tok_k[st.n_tok] = st.k
                st.tok_t[st.n_tok] = st.t
                st.n_tok += 1
                if st.n_tok >= st.want:
                    return R_FIRST_TOKEN
            if st.n_tok == 0 and st.t > st.horizon:
                return R_HORIZON
        else:
            # Nothing scheduled and nothing in flight that could free a seat
            # or a block: the new request can never be served.
            inert = True
            for j in range(st.ring_n - 1):
                q = &st.ring[(st.ring_head + j) % 3]
                if q.nlive or q.n_samp:
                    inert = False
            if inert:
                if st.n_tok:
                    return R_FIRST_TOKEN  # preempted past its first token for good
                if not st.pending_new:
                    return R_NEVER
                if st.arrival == INFINITY:
                    return R_LIMIT  # the residents alone (residents()), run dry
                # Idle until the new request arrives.
                st.t = st.arrival
                wq_push_back(st, st.new_slot)
                st.pending_new = False
        if (b.nlive and st.k >= max_batches) or st.work >= st.max_work:
            return R_FIRST_TOKEN if st.n_tok else R_LIMIT
        if st.ring_n < st.P.depth:
            continue
        process(st, &st.ring[st.ring_head])
        st.ring_head = (st.ring_head + 1) % 3
        st.ring_n -= 1


# ---------------------------------------------------------------------------
# Python surface
# ---------------------------------------------------------------------------

cdef list _key_list(object prefix_keys):
    """The new request's content keys, each checked as the twin checks them."""
    cdef list keys
    if type(prefix_keys) is list:
        keys = <list>prefix_keys
    else:
        keys = list(prefix_keys) if prefix_keys else []
    cdef Py_ssize_t i
    cdef object k
    cdef long long v
    for i in range(len(keys)):
        k = keys[i]
        # Exactly int (not bool, not a numpy integer), in [0, 2**63).
        if PyLong_CheckExact(k) and _PyLong_Sign(k) >= 0 and _PyLong_NumBits(k) <= 63:
            continue
        raise ValueError(
            f"prefix_keys[{i}] must be an integer in [0, 2**63) (got {short_repr(k)})")
    return keys


cdef inline int64_t pow2_at_least(int64_t n) noexcept:
    cdef int64_t c = 8
    while c < n:
        c *= 2
    return c


cdef class Prepared:
    """A prefix-caching snapshot ready to replay: requests, block pool, content map."""

    cdef Rq* r
    cdef int64_t n
    cdef int32_t* run
    cdef int64_t n_run
    cdef int32_t* wq
    cdef int64_t wq_n
    cdef Blk* bl
    cdef int64_t nb
    cdef Run* runs
    cdef int64_t nruns
    cdef int32_t fq_head
    cdef int32_t fq_tail
    cdef int64_t n_free
    cdef HEnt* ht
    cdef int64_t ht_mask
    cdef int32_t* bb
    cdef int64_t* kb
    cdef int32_t* b0
    cdef int64_t* b0_got
    cdef int64_t n_b0
    cdef bint has_inflight
    cdef object ids
    cdef object policy

    def __dealloc__(self):
        free(self.r)
        free(self.run)
        free(self.wq)
        free(self.bl)
        free(self.runs)
        free(self.ht)
        free(self.bb)
        free(self.kb)
        free(self.b0)
        free(self.b0_got)

    def __len__(self):
        return self.n_run + self.wq_n

    @property
    def free_blocks(self):
        """Free blocks (cached ones included), as the engine counts them."""
        return self.n_free

    def hit_blocks(self, keys):
        """How many of a chain of content keys, from the start, the pool holds cached.

        The twin of ``BlockPool.lookup`` on the prepared pool (no block limit):
        what an admission at the snapshot would hit.
        """
        cdef list ks = _key_list(keys)
        cdef Py_ssize_t i, n = len(ks)
        cdef int64_t k
        for i in range(n):
            k = <int64_t>PyLong_AsUnsignedLongLongMask(ks[i])
            if ht_get(self.ht, self.ht_mask, k) == NIL:
                return i
        return n


cdef St _pool_state(Prepared pr):
    """A state that edits pr's pool in place (no copies: nothing is prepared yet)."""
    cdef St st
    memset(&st, 0, sizeof(St))
    st.bl = pr.bl
    st.runs = pr.runs
    st.nb0 = 0
    st.nb = pr.nb
    st.cap_bl = pr.nb
    st.fq_head = pr.fq_head
    st.fq_tail = pr.fq_tail
    st.n_free = pr.n_free
    st.pbb = pr.bb
    st.pkb = pr.kb
    return st


cdef class Replayer:
    """Compiled prefix-caching replay of one bound policy (``kv.prefix_caching``)."""

    cdef Params P
    cdef St st
    cdef readonly object policy
    implementation = IMPLEMENTATION

    def __cinit__(self):
        memset(&self.st, 0, sizeof(St))

    def __init__(self, policy):
        check_policy(policy)
        if not policy.prefix_caching:
            raise ValueError(f"policy {policy.name!r} does not cache prefixes")
        if policy.allocate != "on-demand":
            raise ValueError(f"policy {policy.name!r}: prefix caching needs on-demand allocation")
        self.policy = policy
        p = policy
        read_policy(&self.P, p)
        self.st.P = &self.P

    def __dealloc__(self):
        cdef St* st = &self.st
        free(st.r)
        free(st.rep)
        free(st.run)
        free(st.wq)
        free(st.bl)
        free(st.bep)
        free(st.runs)
        free(st.rnep)
        free(st.ov)
        free(st.ab)
        free(st.ak)
        free(st.hit)
        free(st.first)
        free(st.log)
        free(st.tlog)
        free(st.tok_k)
        free(st.tok_t)
        for i in range(3):
            free(st.ring[i].ent_s)
            free(st.ring[i].ent_n)
            free(st.ring[i].samp)
            free(st.ring[i].got)

    # -- preparation -----------------------------------------------------------

    def prepare(self, table, long long free_blocks=-1, ids=None, cache=None):
        """Turn a snapshot table and its ``kv.prefix_cache`` into replay state.

        Same contract as the pure-Python twin's ``prepare`` with ``cache``
        given (the engine's free count is the pool's; ``free_blocks`` is not
        used).

        Raises:
            ValueError: The table is malformed, an output length is missing, or
                ``cache`` does not describe a consistent pool for this table.
        """
        if cache is None:
            raise ValueError("a prefix-caching replay needs the snapshot's prefix_cache")
        tab = np.ascontiguousarray(table, dtype=np.int64)
        if tab.ndim != 2 or tab.shape[1] != NCOLS:
            raise ValueError(f"table must have shape (n, {NCOLS}) (got {tab.shape})")
        check_table(tab)
        cdef const int64_t[:, ::1] T = tab
        cdef int64_t n = T.shape[0], i, j, b, e, nb, ncached, total_b = 0, total_k = 0
        check_running(self.policy, int(np.count_nonzero(tab[:, COL_STATE] == STATE_RUNNING)))
        keys = cache.keys
        ncached = cache.cached
        blocks, uncached, chains = cache.blocks, cache.uncached, cache.chains
        if len(blocks) != n or len(uncached) != n or len(chains) != n:
            raise ValueError(f"cache describes {len(blocks)} requests, the table {n}")
        if not 0 <= ncached <= len(keys):
            raise ValueError(f"prefix_cache.cached must be in [0, {len(keys)}] (got {ncached})")
        if n > 0x7fffffff - 16:
            raise ValueError(f"table has too many rows for one replay (got {n})")
        # What the wire validator guarantees, checked again: a state built in
        # code reaches the C arrays below only within their bounds.
        for i, k in enumerate(keys):
            if type(k) is not int or not 0 <= k <= KEY_MASK:
                raise ValueError(
                    f"prefix_cache.keys[{i}] must be an integer in [0, 2**63) (got {short_repr(k)})")
        nb = ncached
        for i in range(n):
            if type(uncached[i]) is not int or uncached[i] < 0:
                raise ValueError(
                    f"request {i}: uncached blocks must be an integer >= 0 "
                    f"(got {short_repr(uncached[i])})")
            total_b += len(blocks[i]) + uncached[i]
            total_k += len(blocks[i]) + len(chains[i])
            nb += uncached[i]
        if nb >= MAX_BLOCK_IDS:
            raise ValueError(f"prefix_cache names too many blocks (got {nb})")
        cdef Prepared pr = Prepared.__new__(Prepared)
        pr.policy = self.policy
        pr.ids = ids
        pr.n = n
        pr.r = <Rq*>mem_alloc(n + 1, sizeof(Rq))
        memset(pr.r, 0, sizeof(Rq) * (n + 1))
        pr.run = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.wq = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.b0 = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.b0_got = <int64_t*>mem_alloc(n + 1, sizeof(int64_t))
        pr.bb = <int32_t*>mem_alloc(total_b, sizeof(int32_t))
        pr.kb = <int64_t*>mem_alloc(total_k, sizeof(int64_t))
        pr.bl = <Blk*>mem_alloc(nb, sizeof(Blk))
        pr.nb = nb
        pr.n_run = pr.wq_n = pr.n_b0 = 0
        pr.fq_head = pr.fq_tail = NIL
        pr.n_free = 0
        cdef Blk* q
        for b in range(nb):
            q = &pr.bl[b]
            q.key = keys[b] if b < ncached else NOKEY
            q.ref = 0
            q.hnext = q.fprev = q.fnext = NIL
        # Requests' blocks and keys, and the reference counts they imply.
        cdef int64_t off_b = 0, off_k = 0, own = ncached, kk
        cdef Rq* r
        nkeys_all = len(keys)
        for i in range(n):
            r = &pr.r[i]
            r.blk_off = off_b
            r.key_off = off_k
            for j, b in enumerate(blocks[i]):
                if not 0 <= b < ncached:
                    raise ValueError(f"request {i}: cached block {short_repr(b)} out of range")
                pr.bl[b].ref += 1
                pr.bb[off_b] = <int32_t>b
                off_b += 1
                pr.kb[off_k] = keys[b]
                off_k += 1
            for j in range(uncached[i]):
                pr.bl[own].ref = 1
                pr.bb[off_b] = <int32_t>own
                off_b += 1
                own += 1
            for j in chains[i]:
                if not 0 <= j < nkeys_all:
                    raise ValueError(f"request {i}: chain key {short_repr(j)} out of range")
                kk = keys[j]
                pr.kb[off_k] = kk
                off_k += 1
            r.nblk = off_b - r.blk_off
            r.cached = len(blocks[i])
            r.nkeys = off_k - r.key_off
            r.blk_cap = r.nblk
            r.key_cap = r.nkeys
        # The free queue: cached blocks no one holds, and runs of unnamed blocks.
        free_q = cache.free
        cdef int64_t nruns = 0
        for e in free_q:
            nruns += e < 0
        pr.runs = <Run*>mem_alloc(nruns, sizeof(Run))
        pr.nruns = nruns
        cdef St tmp = _pool_state(pr)
        cdef int64_t ri = 0, queued = 0
        for e in free_q:
            if e >= 0:
                if e >= ncached or pr.bl[e].ref != 0 or pr.bl[e].fprev != NIL or e == tmp.fq_head:
                    raise ValueError(f"prefix_cache.free: block {e} is not a free cached block")
                fq_push_back(&tmp, <int32_t>e)
                tmp.n_free += 1
                queued += 1
            else:
                pr.runs[ri].count = -e
                fq_push_back(&tmp, <int32_t>(-ri - 2))
                tmp.n_free += -e
                ri += 1
        for b in range(ncached):
            queued -= pr.bl[b].ref == 0
        if queued != 0:
            raise ValueError("prefix_cache.free must list every cached block no request holds")
        # The content map: first cached first among equal keys.
        cdef int64_t cap = pow2_at_least(2 * ncached + 2)
        pr.ht = <HEnt*>mem_alloc(cap, sizeof(HEnt))
        pr.ht_mask = cap - 1
        for i in range(cap):
            pr.ht[i].head = NIL
        cdef int64_t slot
        cdef int32_t x
        for b in range(ncached):
            kk = pr.bl[b].key
            slot = <int64_t>(mix(kk) & <uint64_t>pr.ht_mask)
            while pr.ht[slot].head != NIL and pr.ht[slot].key != kk:
                slot = (slot + 1) & pr.ht_mask
            if pr.ht[slot].head == NIL:
                pr.ht[slot].key = kk
                pr.ht[slot].head = <int32_t>b
            else:
                x = pr.ht[slot].head
                while pr.bl[x].hnext != NIL:
                    x = pr.bl[x].hnext
                pr.bl[x].hnext = <int32_t>b
        # The rows, as PolicyGeometry.prepare reads them.
        cdef int64_t lim, need
        cdef bint is_async = self.P.depth > 1
        for i in range(n):
            if T[i, COL_OUTPUT_LEN] < 1:
                raise ValueError(
                    f"row {i}: output_len must be resolved before replay (got {T[i, COL_OUTPUT_LEN]})")
            r = &pr.r[i]
            self._init_req(r, T[i, COL_PROMPT], T[i, COL_OUTPUT], T[i, COL_OUTPUT_LEN],
                           T[i, COL_MAX_TOKENS])
            r.in_batch = -1
            if T[i, COL_STATE] == STATE_RUNNING:
                r.status = S_RUNNING
                r.computed = T[i, COL_COMPUTED]
                r.ph = T[i, COL_PLACEHOLDERS]
                need = r.prompt + r.outputs + r.ph - r.computed
                r.prefilled = (r.outputs + r.ph >= 1) and need <= 1
                if r.ph and not is_async:
                    # A synchronous engine has processed its outputs before it
                    # schedules again: fold any placeholder into the outputs.
                    r.outputs += r.ph
                    r.ph = 0
                    if r.outputs >= r.target:
                        release(&tmp, r)
                        r.status = S_FINISHED
                        continue
                if r.ph > 0:
                    pr.has_inflight = True
                    r.inflight = r.ph
                    pr.b0[pr.n_b0] = <int32_t>i
                    pr.b0_got[pr.n_b0] = r.ph
                    pr.n_b0 += 1
                pr.run[pr.n_run] = <int32_t>i
                pr.n_run += 1
            else:
                if r.nblk:
                    raise ValueError(f"request {i}: a waiting request holds no blocks")
                r.status = S_WAITING
                pr.wq[pr.wq_n] = <int32_t>i
                pr.wq_n += 1
        free(tmp.first)
        pr.fq_head = tmp.fq_head
        pr.fq_tail = tmp.fq_tail
        pr.n_free = tmp.n_free
        return pr

    cdef void _init_req(self, Rq* q, int64_t prompt, int64_t outputs, int64_t output_len,
                        int64_t max_tokens):
        cdef int64_t lim = output_limit(&self.P, prompt, max_tokens)
        q.prompt = prompt
        q.outputs = outputs
        q.limit = lim
        q.target = output_target(lim, outputs, output_len)

    # -- replay ---------------------------------------------------------------

    cdef int _ensure(self, Prepared pr) except -1:
        """Size the per-replay buffers for pr (each grows through the checked helpers)."""
        cdef St* st = &self.st
        cdef int64_t n = pr.n + 1, wcap
        if st.cap_r < n:
            mem_resize(<void**>&st.r, n, sizeof(Rq))
            mem_resize(<void**>&st.rep, n, sizeof(int32_t))
            memset(st.rep, 0, sizeof(int32_t) * n)
            mem_resize(<void**>&st.run, n, sizeof(int32_t))
            wcap = pow2_at_least(n)
            mem_resize(<void**>&st.wq, wcap, sizeof(int32_t))
            st.wq_mask = wcap - 1
            st.cap_r = n
            self._restart_epochs()
        if st.cap_bep < pr.nb:
            mem_resize(<void**>&st.bep, pr.nb, sizeof(int32_t))
            memset(st.bep, 0, sizeof(int32_t) * pr.nb)
            st.cap_bep = pr.nb
            self._restart_epochs()
        if st.cap_bl < pr.nb:
            mem_reserve(<void**>&st.bl, &st.cap_bl, pr.nb, 64, sizeof(Blk))
        if st.cap_runs < pr.nruns:
            mem_resize(<void**>&st.rnep, pr.nruns, sizeof(int32_t))
            mem_resize(<void**>&st.runs, pr.nruns, sizeof(Run))
            memset(st.rnep, 0, sizeof(int32_t) * pr.nruns)
            st.cap_runs = pr.nruns
            self._restart_epochs()
        if st.ov == NULL:
            st.ov = <OEnt*>mem_alloc(64, sizeof(OEnt))
            memset(st.ov, 0, sizeof(OEnt) * 64)
            st.ov_mask = 63
        return 0

    cdef void _restart_epochs(self):
        # Every epoch array restarts together, so that no stale copy looks current.
        cdef St* st = &self.st
        if st.rep != NULL:
            memset(st.rep, 0, sizeof(int32_t) * st.cap_r)
        if st.bep != NULL:
            memset(st.bep, 0, sizeof(int32_t) * st.cap_bep)
        if st.rnep != NULL:
            memset(st.rnep, 0, sizeof(int32_t) * st.cap_runs)
        if st.ov != NULL:
            memset(st.ov, 0, sizeof(OEnt) * (st.ov_mask + 1))
        st.cur = 0

    cdef int _start(self, Prepared pr, object prompt_tokens, object output_len,
                    object max_tokens, object coeffs, bint record, object prefix_keys,
                    double arrival=0.0, int64_t next_tokens=0) except -1:
        cdef St* st = &self.st
        cdef Rq* q
        cdef Batch* b0
        cdef int64_t i, prompt, out_len, cap_tokens, nk
        if pr.policy is not self.policy and pr.policy != self.policy:
            raise ValueError("prepared state belongs to another policy")
        prompt = tokens_arg(prompt_tokens, "prompt_tokens", 1, check_tokens)
        out_len = tokens_arg(output_len, "output_len", MIN_ANY, check_tokens)
        cap_tokens = tokens_arg(max_tokens, "max_tokens", MIN_ANY, check_tokens)
        cdef list keys = _key_list(prefix_keys)
        nk = imin(len(keys), prompt // self.P.bs)
        self._ensure(pr)
        read_coeffs(&st.c, coeffs)
        st.cur += 1
        if st.cur == 0x7fffffff:
            self._restart_epochs()
            st.cur = 1
        st.src = pr.r
        memcpy(st.run, pr.run, sizeof(int32_t) * pr.n_run)
        st.n_run = pr.n_run
        st.wq_head = 0
        st.wq_n = 0
        for i in range(pr.wq_n):
            wq_push_back(st, pr.wq[i])
        st.src_bl = pr.bl
        st.nb0 = pr.nb
        st.nb = pr.nb
        st.src_runs = pr.runs
        st.nruns = pr.nruns
        st.fq_head = pr.fq_head
        st.fq_tail = pr.fq_tail
        st.n_free = pr.n_free
        st.ht = pr.ht
        st.ht_mask = pr.ht_mask
        st.ov_n = 0
        st.serial_key = 0
        st.ab_n = 0
        st.ak_n = 0
        st.pbb = pr.bb
        st.pkb = pr.kb
        st.ring_head = 0
        st.ring_n = 0
        st.k = 0
        st.work = 0
        st.max_work = MAX_WORK
        st.horizon = INFINITY
        st.t = 0.0
        st.record = record
        st.n_log = 0
        st.n_tlog = 0
        # The new request joins the end of the waiting queue with its keys.
        st.new_slot = <int32_t>pr.n
        st.new_seen = False
        st.rep[pr.n] = st.cur
        q = &st.r[pr.n]
        memset(q, 0, sizeof(Rq))
        self._init_req(q, prompt, 0, imax(out_len, 1), cap_tokens)
        q.status = S_WAITING
        q.in_batch = -1
        st.want = tokens_wanted(next_tokens, q.target, q.outputs, &st.tok_k, &st.tok_t,
                                &st.cap_tok)
        st.n_tok = 0
        if nk:
            mem_reserve(<void**>&st.ak, &st.ak_cap, nk, 256, sizeof(int64_t))
            for i in range(nk):
                # In [0, 2**63) (checked by _key_list): the digits as they are.
                st.ak[i] = <int64_t>PyLong_AsUnsignedLongLongMask(keys[i])
            st.ak_n = nk
        q.key_own = 1
        q.key_off = 0
        q.key_cap = nk
        q.nkeys = nk
        # It joins the end of the waiting queue when it arrives (at the loop's
        # first turn when that is now).
        st.arrival = arrival
        st.pending_new = True
        if pr.has_inflight:
            b0 = ring_new(st)
            b0.carried = True
            for i in range(pr.n_b0):
                samp_add(b0, pr.b0[i], pr.b0_got[i])
        return 0

    def ttft(self, Prepared prepared, prompt_tokens, output_len, coeffs, max_tokens=-1,
             prefix_keys=None, horizon_s=INFINITY, arrival_s=0.0):
        """Return only the predicted time to first token (``inf`` when never)."""
        cdef double horizon = horizon_arg(horizon_s, check_horizon)
        cdef double arrival = arrival_arg(arrival_s, check_arrival)
        self._start(prepared, prompt_tokens, output_len, max_tokens, coeffs, False, prefix_keys,
                    arrival)
        self.st.horizon = horizon
        cdef int rc
        with nogil:
            rc = go(&self.st, 1_000_000)
        if rc == R_NEVER:
            return INFINITY
        return self.st.tok_t[0] if rc == R_FIRST_TOKEN else self.st.t

    def replay(self, Prepared prepared, prompt_tokens, output_len,
               coeffs=(0.0, 0.0, 0.0, 0.0), bint record=False, max_batches=1_000_000,
               max_tokens=-1, max_work=None, prefix_keys=None, horizon_s=INFINITY,
               arrival_s=0.0, next_tokens=0):
        """Replay batch formation until the new request's first token.

        Same contract as the pure-Python twin's ``replay`` (``max_work`` counts
        the twin's units, default :data:`~bearsdk.replay.types.MAX_REPLAY_WORK_PY`).
        """
        cdef int64_t limit = check_tokens(max_batches, "max_batches", MIN_ANY)
        cdef int64_t work = check_tokens(
            _MAX_WORK_PY if max_work is None else max_work, "max_work", MIN_ANY)
        cdef double horizon = check_horizon(horizon_s)
        cdef double arrival = check_arrival(arrival_s)
        cdef int64_t follow = check_next_tokens(next_tokens)
        self._start(prepared, prompt_tokens, output_len, max_tokens, coeffs, record, prefix_keys,
                    arrival, follow)
        self.st.max_work = work
        self.st.horizon = horizon
        cdef int rc
        with nogil:
            rc = go(&self.st, limit)
        batches = tuple(self._records(prepared)) if record else None
        cdef St* st = &self.st
        if rc == R_FIRST_TOKEN:
            return ReplayResult(
                st.tok_k[0], st.tok_t[0], StopReason.FIRST_TOKEN, batches,
                token_batches=tuple([st.tok_k[i] for i in range(st.n_tok)]),
                token_times_s=tuple([st.tok_t[i] for i in range(st.n_tok)]))
        if rc == R_LIMIT:
            return ReplayResult(0, self.st.t, StopReason.BATCH_LIMIT, batches)
        if rc == R_HORIZON:
            return ReplayResult(0, self.st.t, StopReason.HORIZON, batches)
        return ReplayResult(0, float("inf"), StopReason.NEVER_ADMITTED, batches)

    def residents(self, Prepared prepared, coeffs, max_batches):
        """Replay the snapshot's requests alone; the twin's ``residents``."""
        cdef int64_t limit = check_tokens(max_batches, "max_batches", 0)
        self._start(prepared, 1, 1, -1, coeffs, False, None, INFINITY)
        cdef int rc
        if limit > 0:
            with nogil:
                rc = go(&self.st, limit)
        return self.st.k, self.st.t

    @property
    def last_work(self):
        """Work units of the latest replay (the twin's units)."""
        return self.st.work

    @property
    def last_new_examined(self):
        """Whether the latest replay's admissions looked at the new request."""
        return self.st.new_seen

    @property
    def last_pool(self):
        """``(free blocks, running, waiting, named blocks)`` where the latest replay stopped."""
        return (self.st.n_free, self.st.n_run, self.st.wq_n, self.st.nb)

    def last_blocks(self):
        """The pool where the latest replay stopped: the test oracle's view.

        Returns:
            ``(refs, keys, free)``: per block id its holders and content key
            (``None``: nothing findable), and the free queue front first
            (``(block id, key)`` or ``(-n, None)`` for ``n`` unnamed blocks),
            as :class:`~bearsdk.replay.blocks.BlockPool` reports them.
        """
        cdef St* st = &self.st
        cdef int64_t b
        cdef int32_t node
        cdef Blk* q
        refs = []
        keys = []
        for b in range(st.nb):
            q = B(st, b)
            refs.append(q.ref)
            keys.append(None if q.key == NOKEY else q.key)
        fq = []
        node = st.fq_head
        while node != NIL:
            if node >= 0:
                fq.append((node, keys[node]))
            else:
                fq.append((-RN(st, -node - 2).count, None))
            node = nnext(st, node)[0]
        return refs, keys, fq

    cdef list _records(self, Prepared pr):
        from bearsdk.replay.requests import NEW_REQUEST_ID

        cdef St* st = &self.st
        cdef int64_t i, j, s
        cdef double dt
        ids = pr.ids
        out = []
        for i in range(0, st.n_log, LOG_W):
            memcpy(&dt, &st.log[i + 7], sizeof(double))
            toks = []
            for j in range(st.log[i + 8], st.log[i + 8] + 2 * st.log[i + 9], 2):
                s = st.tlog[j]
                if s == pr.n:
                    rid = NEW_REQUEST_ID
                else:
                    rid = ids[s] if ids is not None else f"#{s}"
                toks.append((rid, st.tlog[j + 1]))
            out.append(BatchRecord(
                num_seqs=st.log[i], prefill_tokens=st.log[i + 1], decode_tokens=st.log[i + 2],
                decode_context=st.log[i + 3], prefill_attention=st.log[i + 4],
                admitted=st.log[i + 5], preempted=st.log[i + 6], duration_s=dt,
                tokens_by_request=tuple(toks)))
        return out
