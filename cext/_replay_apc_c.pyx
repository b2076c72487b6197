# Compiled replay with vLLM's automatic prefix caching (bearsdk.replay._replay_apc_c).
#
# The twin of the pure-Python replay when a policy has kv.prefix_caching and
# the snapshot carries kv.prefix_cache: the same steps as
# bearsdk/replay/scheduler.py (SchedulerCore) over bearsdk/replay/blocks.py
# (BlockPool), block for block, at C speed; the property tests and the vLLM
# cases require identical batches. docs/prefix-caching.md gives every rule with
# its vLLM source line.
#
# Every allocation's block identity matters here (which cached block it
# evicts, where a freed block goes, what a later admission hits). Plain decodes
# are still an aggregate, as in _replay_c, with block identities kept ("Lazy
# decodes" below), and a replay copies only what it touches from the prepared
# snapshot:
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

from cpython.long cimport PyLong_AsUnsignedLongLongMask
from cpython.tuple cimport PyTuple_GET_ITEM

from _mem cimport mem_alloc, mem_reserve, mem_resize, mem_try_copy, mem_try_reserve
from _pyint cimport int_in, is_key
from _replay_defs cimport (
    CK_LOCATED, CK_NONE, CK_TAKEN, CkTerms, ck_holds, ck_locate,
    R_FIRST_TOKEN, R_HORIZON, R_LIMIT, R_NEVER, S_FINISHED, S_RUNNING, S_WAITING, STAGE_DECODES,
    STAGE_PREFILLS, STAGE_RUNNING, STAGE_WAITING, Ev, ev_pop, ev_push, ev_sift_down, WM_ALWAYS, WM_WHILE_RUNNING, Coeffs, Params, arrival_arg, cdiv,
    horizon_arg, imax, imin, output_limit, output_target, read_coeffs, read_policy, tokens_arg,
    tokens_wanted,
)


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
    int64_t phit        # a waiting request's hit on the prepared pool ...
    int64_t ph_off      # ... and where its blocks are in the prepared heads blob
    int64_t in_batch    # serial of the batch being formed once scheduled in it
    int64_t ord         # running order: serial of its admission
    # A lazy decode (see "Lazy decodes"): state as a function of st.vt.
    int64_t base        # computed = base + (vt of the next batch), while served
    int64_t obase       # outputs delivered or in flight = obase + (same)
    int64_t served_until  # last vt it is served at
    int64_t t_last      # vt of the batch that delivers its last output
    int64_t lazy_since  # first vt served lazily (the one before sampled explicitly)
    int32_t sched_pos   # ... and its entry there
    int32_t gen         # bumped whenever its queued events go stale
    int8_t status
    int8_t prefilled
    int8_t blk_own
    int8_t key_own
    int8_t lazy

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

ctypedef struct EvQ:    # a binary min-heap (_replay_defs' Ev); stale events are skipped
    Ev* e
    int64_t n
    int64_t cap

ctypedef struct Bucket:  # lazies of one block phase, in running order
    int32_t* s
    int64_t n
    int64_t cap

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
    int64_t vt          # its index among the replay's batches (-1: the carried one)
    int64_t lazy_n      # lazy decodes it serves (one token each)
    int64_t pre
    int64_t dec
    int64_t dctx
    int64_t patt
    int64_t admitted
    int64_t preempted

ctypedef struct Ack:
    # Where a replay may resume: the state at the top of the last loop turn
    # before the new request was first examined (see take_checkpoint). The
    # pool's records are materialised: the blocks named so far, the runs, the
    # content map merged with the replay's overlay, and the block and key
    # lists appended to the prepared blobs (so the requests' copies read them
    # from there).
    CkTerms terms       # which turn (a turn count), and for which replays
    Rq* r
    int64_t cap_r
    int64_t n_r
    int32_t* run
    int64_t cap_run
    int64_t n_run
    int32_t* wq
    int64_t cap_wq
    int64_t wq_n
    Blk* bl
    int64_t cap_bl
    int64_t nb
    Run* runs
    int64_t cap_runs
    int64_t nruns
    int32_t fq_head
    int32_t fq_tail
    int64_t n_free
    HEnt* ht
    int64_t cap_ht
    int64_t ht_mask
    int32_t* bb
    int64_t cap_bb
    int64_t* kb
    int64_t cap_kb
    int64_t serial_key
    int64_t forgets
    int64_t serial
    int64_t k
    int64_t work
    int64_t vt
    int64_t vt_done
    int64_t n_lazy
    int64_t s_base
    int64_t ord_next
    int64_t lazy_batches
    bint materialized
    bint fold_ok
    bint bk_dirty
    int64_t ring_n      # 0 or 1 at a turn's top (the batch in flight, async)
    Batch b             # its scalars (the arrays below hold its lists)
    int32_t* b_ent_s
    int64_t cap_b_ent_s
    int64_t* b_ent_n
    int64_t cap_b_ent_n
    int32_t* b_samp
    int64_t cap_b_samp
    int64_t* b_got
    int64_t cap_b_got
    int32_t* bk_s       # every bucket's lazies, bucket after bucket
    int64_t cap_bk_s
    int64_t* bk_n       # ... and how many each holds
    int64_t cap_bk_n
    Ev* leave
    int64_t cap_leave
    int64_t n_leave
    Ev* rel
    int64_t cap_rel
    int64_t n_rel
    int32_t* ex
    int64_t cap_ex
    int64_t n_ex

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
    const int32_t* phb
    int64_t forgets     # blocks whose content was forgotten (evicted) in this replay
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
    # lazy decodes
    bint lazy_ok        # the policy allows them (one running stage, token budget)
    bint fold_ok        # the carried batch, if any, is processed
    bint materialized   # this batch is formed request by request
    int64_t vt          # the next batch's vt
    int64_t vt_done     # the latest processed batch's vt
    int64_t n_lazy
    int64_t s_base      # sum of the lazies' base
    int64_t ord_next
    int64_t lazy_batches  # batches that served lazies (last_lazy_batches)
    Bucket* bk          # per block phase (pmod(base, bs)), P.bs of them
    bint bk_dirty       # some bucket may hold lazies (emptied before the next replay)
    EvQ leave           # served_until: past it, a lazy stops being served
    EvQ rel             # t_last: its last output lands, it finishes
    int32_t* ex         # explicit running requests, in running order
    int64_t n_ex
    int64_t cap_ex
    int64_t* grant      # tokens per entry of ex in a batch formed lazily
    int64_t cap_grant
    int32_t* fin        # requests finishing in the batch being processed
    int64_t cap_fin
    # resuming (see take_checkpoint)
    Ack* ck             # the prepared state's checkpoint, or NULL
    bint ck_take        # take it at the top of turn ck.terms.at
    int64_t turn        # loop turns so far
    int64_t top_turn    # the last turn's top before the new request was examined
    int64_t top_work    # ... and the work done by then
    double t_before     # when the latest batch started
    double join_lo      # the arrivals that join where the new request joined:
    double join_hi      #   (join_lo, join_hi]; join_hi < 0 once it joined an idle engine
    int64_t n_bb        # the prepared blobs' lengths (the checkpoint appends to copies)
    int64_t n_kb


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
    st.forgets += 1
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


cdef void mark_cached(St* st, Rq* q, int64_t tokens) noexcept nogil:
    """cache_blocks for content only q has, when q finishes: keyed, not findable."""
    cdef int64_t full = imin(tokens, q.prompt + q.outputs) // st.P.bs, i
    cdef Blk* blk
    for i in range(q.cached, full):
        blk = B(st, BL(st, q)[i])
        if blk.key == NOKEY:
            st.serial_key -= 1
            blk.key = st.serial_key
    if full > q.cached:
        q.cached = full


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


cdef void remove_first(int32_t* a, int64_t* n, int32_t s) noexcept nogil:
    """Remove s's first occurrence from a[:n], keeping the order of the rest."""
    cdef int64_t i, j
    for i in range(n[0]):
        if a[i] == s:
            for j in range(i, n[0] - 1):
                a[j] = a[j + 1]
            n[0] -= 1
            return


cdef inline void run_remove(St* st, int32_t s) noexcept nogil:
    remove_first(st.run, &st.n_run, s)


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------

cdef inline int ent_append(Batch* b, int32_t s, int64_t n) except -1 nogil:
    """An entry (sched_add: in the batch being formed; unlazy: in one in flight)."""
    if b.n_ent == b.cap_ent:
        mem_reserve(<void**>&b.ent_s, &b.cap_ent, b.n_ent + 1, 16, sizeof(int32_t))
        b.cap_ent = b.n_ent
        mem_reserve(<void**>&b.ent_n, &b.cap_ent, b.n_ent + 1, 16, sizeof(int64_t))
    b.ent_s[b.n_ent] = s
    b.ent_n[b.n_ent] = n
    b.n_ent += 1
    return 0


cdef int sched_add(St* st, Batch* b, int32_t s, int64_t n) except -1 nogil:
    cdef Rq* q = R(st, s)
    q.in_batch = b.serial
    q.sched_pos = <int32_t>b.n_ent
    ent_append(b, s, n)
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
    b.vt = st.vt
    b.lazy_n = 0
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
# Lazy decodes
# ---------------------------------------------------------------------------
#
# A running request that decodes one token per batch, in step with the engine,
# is folded into an aggregate, as in _replay_c: its context is base + vt and
# its outputs (delivered or in flight) obase + vt, where vt counts batches. A
# batch serves every lazy decode with one count, one context sum and the
# decodes whose context sits on a block boundary (the bucket of that phase),
# which take a block each, in running order among the explicit requests'
# allocations, so that every block id is the twin's. Two event heaps say when a
# lazy stops being served (served_until) and when its last output lands
# (t_last). A batch that needs each request's place (a preemption, a budget cut
# before a lazy) makes every request explicit first and folds them back after.
#
# What a lazy defers is the caching of the blocks its decodes fill: their
# content is its own (a key no other request looks up), so they only matter
# where it releases them (cached to the back of the free queue) or is looked at
# (last_blocks); unlazy() caches them as the twin would have by then.

cdef inline int64_t pmod(int64_t a, int64_t b) noexcept nogil:
    cdef int64_t r = a % b
    return r + b if r < 0 else r


cdef inline int heap_push(EvQ* q, int64_t key, int32_t slot, int32_t gen) except -1 nogil:
    return ev_push(&q.e, &q.n, &q.cap, key, slot, gen)


cdef inline void heap_pop(EvQ* q) noexcept nogil:
    ev_pop(q.e, &q.n)


cdef void heap_compact(St* st, EvQ* q) noexcept nogil:
    """Drop the stale events (every materialised batch leaves one pair per lazy)."""
    cdef int64_t i, n = 0
    cdef Rq* r
    for i in range(q.n):
        r = R(st, q.e[i].slot)
        if r.lazy and r.gen == q.e[i].gen:
            q.e[n] = q.e[i]
            n += 1
    q.n = n
    for i in range(n // 2 - 1, -1, -1):
        ev_sift_down(q.e, n, i, q.e[i])


cdef Ev* heap_top(St* st, EvQ* q) noexcept nogil:
    """The earliest event still current (stale ones dropped), or NULL."""
    cdef Rq* r
    while q.n:
        r = R(st, q.e[0].slot)
        if r.lazy and r.gen == q.e[0].gen:
            return &q.e[0]
        heap_pop(q)
    return NULL


cdef int bk_insert(St* st, int32_t s) except -1 nogil:
    cdef Rq* q = R(st, s)
    cdef Bucket* k = &st.bk[pmod(q.base, st.P.bs)]
    cdef int64_t i, o = q.ord
    if k.n == k.cap:
        mem_reserve(<void**>&k.s, &k.cap, k.n + 1, 8, sizeof(int32_t))
    i = k.n
    while i > 0 and R(st, k.s[i - 1]).ord > o:
        k.s[i] = k.s[i - 1]
        i -= 1
    k.s[i] = s
    k.n += 1
    st.bk_dirty = True
    return 0


cdef void bk_remove(St* st, int32_t s, int64_t base) noexcept nogil:
    cdef Bucket* k = &st.bk[pmod(base, st.P.bs)]
    cdef int64_t i, j
    for i in range(k.n):
        if k.s[i] == s:
            for j in range(i, k.n - 1):
                k.s[j] = k.s[j + 1]
            k.n -= 1
            return


cdef int ex_append(St* st, int32_t s) except -1 nogil:
    if st.n_ex == st.cap_ex:
        mem_reserve(<void**>&st.ex, &st.cap_ex, st.n_ex + 1, 64, sizeof(int32_t))
    st.ex[st.n_ex] = s
    st.n_ex += 1
    return 0


cdef int ex_insert(St* st, int32_t s) except -1 nogil:
    """Into ex at its place in running order."""
    cdef int64_t i, o = R(st, s).ord
    ex_append(st, s)
    i = st.n_ex - 1
    while i > 0 and R(st, st.ex[i - 1]).ord > o:
        st.ex[i] = st.ex[i - 1]
        i -= 1
    st.ex[i] = s
    return 0


cdef inline void ex_remove(St* st, int32_t s) noexcept nogil:
    remove_first(st.ex, &st.n_ex, s)


cdef bint foldable(St* st, int32_t s, Batch* u) noexcept nogil:
    """Did s decode one token in u, in the steady state a lazy's formulas assume?"""
    cdef Rq* q = R(st, s)
    if s == st.new_slot or q.lazy or q.status != S_RUNNING or not q.prefilled:
        return False
    if q.in_batch != u.serial or u.ent_n[q.sched_pos] != 1:
        return False
    if st.P.depth > 1:
        # (batch u in flight, the one before it processed)
        if q.ph != 1 or q.inflight != 1 or q.computed != q.prompt + q.outputs:
            return False
    elif q.ph != 0 or q.inflight != 0 or q.computed != q.prompt + q.outputs - 1:
        return False
    # Blocks exactly for its context, and no known content past its cached
    # blocks (a lazy's next full blocks hold content only it has).
    return q.nblk == cdiv(q.computed, st.P.bs) and q.nkeys <= q.cached


cdef bint lazify(St* st, int32_t s) except -1 nogil:
    """Fold s (foldable) into the aggregate from the next batch on: True if folded."""
    cdef Rq* q = R(st, s)
    cdef int64_t v = st.vt
    cdef int64_t pending = q.outputs + q.ph
    cdef int64_t t_last = q.target - pending + v - 1
    cdef int64_t su = t_last
    if t_last < v:
        return False  # its last output is in flight already
    if st.P.depth > 1 and q.target < q.limit:
        su += 1  # async: a stop the scheduler cannot foresee costs one wasted token
    if st.P.mml and q.computed + (su - v) > st.P.mml - 2:
        return False  # it would reach max_model_len while lazy
    q.base = q.computed - v
    q.obase = pending - v
    q.served_until = su
    q.t_last = t_last
    q.lazy_since = v
    q.lazy = 1
    q.gen += 1
    st.n_lazy += 1
    st.s_base += q.base
    bk_insert(st, s)
    # Valid events number one per lazy: past four times that, compact
    # (amortised O(1) a push).
    if st.leave.n > 4 * st.n_lazy + 64:
        heap_compact(st, &st.leave)
        heap_compact(st, &st.rel)
    heap_push(&st.leave, su, s, q.gen)
    heap_push(&st.rel, t_last, s, q.gen)
    return True


cdef int unlazy(St* st, int32_t s, bint finishing, bint in_bucket) except -1 nogil:
    """Make s explicit as it stands now (before st.vt is formed; batches up to
    st.vt_done processed). Unless it is finishing, the batches in flight that
    served it lazily get its entries, so that processing them delivers its tokens.
    """
    cdef Rq* q = R(st, s)
    cdef int64_t last = imin(st.vt - 1, q.served_until)
    cdef int64_t inflight = imax(last - imax(st.vt_done, q.lazy_since - 2), 0)
    cdef int64_t j, upto
    cdef Batch* b
    q.lazy = 0
    q.gen += 1
    st.n_lazy -= 1
    st.s_base -= q.base
    if in_bucket:
        bk_remove(st, s, q.base)
    q.computed = q.base + last + 1
    q.outputs = q.obase + last + 1 - inflight
    q.inflight = inflight
    q.ph = inflight if st.P.depth > 1 else 0
    # The twin cached its full blocks when it scheduled each decode (up to
    # the context, capped at its outputs) and, async, when each token landed;
    # async, the latest decode's block waits for that decode's own token.
    upto = q.computed - 1 if st.P.depth > 1 and last > st.vt_done else q.computed
    if finishing:
        # Its content goes nowhere but the back of the free queue: no one
        # will look it up, so it need not enter the content map.
        mark_cached(st, q, upto)
        return 0
    cache_blocks(st, q, upto)
    for j in range(st.ring_n):
        b = &st.ring[(st.ring_head + j) % 3]
        if st.vt_done < b.vt <= last and b.vt >= q.lazy_since:
            ent_append(b, s, 1)
            samp_add(b, s, 1)
    return 0


cdef int unlazy_all(St* st) except -1 nogil:
    """Every lazy explicit, in running order."""
    cdef int64_t i
    cdef int32_t s
    # Empty the buckets at once when there are few; with many (large blocks),
    # each lazy leaves its own, short, one.
    cdef bint each = st.P.bs > 64
    if st.n_lazy == 0:
        return 0
    for i in range(st.n_run):
        s = st.run[i]
        if R(st, s).lazy:
            unlazy(st, s, False, each)
    if not each:
        for i in range(st.P.bs):
            st.bk[i].n = 0
        st.bk_dirty = False
    return 0


cdef int materialize(St* st) except -1 nogil:
    """Form this batch request by request (fold() folds them back after it)."""
    st.materialized = True
    return unlazy_all(st)


cdef int pop_leaves(St* st) except -1 nogil:
    """Lazies served for the last time stay running, explicit, until their output lands."""
    cdef Ev* e
    cdef int32_t s
    while True:
        e = heap_top(st, &st.leave)
        if e == NULL or e.key >= st.vt:
            return 0
        s = e.slot
        heap_pop(&st.leave)
        unlazy(st, s, False, True)
        ex_insert(st, s)


cdef int fold(St* st, Batch* u) except -1 nogil:
    """After batch u: fold its steady decodes; after a materialised batch, rebuild ex."""
    cdef int64_t i, k = 0
    cdef int32_t s
    if st.materialized:
        st.n_ex = 0
        for i in range(st.n_run):
            s = st.run[i]
            if not (st.fold_ok and foldable(st, s, u) and lazify(st, s)):
                ex_append(st, s)
        st.materialized = False
        return 0
    if not st.fold_ok:
        return 0
    for i in range(st.n_ex):
        s = st.ex[i]
        if not (foldable(st, s, u) and lazify(st, s)):
            st.ex[k] = s
            k += 1
    st.n_ex = k
    return 0


cdef int64_t running_want(St* st, Batch* b, Rq* q, int64_t cap) noexcept nogil:
    """serve_running's tokens for q before the budget bounds them (0: skipped)."""
    cdef int64_t n
    if q.in_batch == b.serial or (q.ph > 0 and q.outputs + q.ph >= q.limit):
        return 0
    n = q.prompt + q.outputs + q.ph - q.computed
    if 0 < cap < n:
        n = cap
    if st.P.mml:
        n = imin(n, st.P.mml - q.computed - 1)
    return n


cdef bint fast_ok(St* st, Batch* b, int64_t budget, int64_t cap) except -1 nogil:
    """Can the running stage be formed with the lazies as an aggregate?

    Yes when no one is preempted and every lazy is served: every request gets
    what it wants, or the budget runs out at an explicit request that no lazy
    follows in running order. Grants go to st.grant, one per entry of ex.
    """
    cdef int64_t i, p, n, tok = st.n_lazy, blk, cut = -1, bs = st.P.bs
    cdef Rq* q
    if st.n_lazy > budget:
        return False
    blk = st.bk[pmod(-st.vt, bs)].n if st.n_lazy else 0
    if st.n_ex > st.cap_grant:
        mem_reserve(<void**>&st.grant, &st.cap_grant, st.n_ex, 64, sizeof(int64_t))
    for i in range(st.n_ex):
        q = R(st, st.ex[i])
        n = running_want(st, b, q, cap)
        if cut >= 0 or n <= 0:
            st.grant[i] = 0
            continue
        if tok + n > budget:
            n = budget - tok
            if n <= 0:
                return False
            cut = i
        st.grant[i] = n
        tok += n
        if q.computed + n > q.nblk * bs:
            blk += cdiv(q.computed + n, bs) - q.nblk
    if cut >= 0 and st.n_lazy:
        p = st.n_run - 1
        while p >= 0 and not R(st, st.run[p]).lazy:
            p -= 1
        if p >= 0 and R(st, st.run[p]).ord > R(st, st.ex[cut]).ord:
            return False
    return blk + st.P.one_free <= st.n_free


cdef int64_t serve_fast(St* st, Batch* b, int64_t budget) except -2 nogil:
    """The running stage once fast_ok holds: lazies as one, explicit ones by grant."""
    cdef Bucket* k = &st.bk[pmod(-st.vt, st.P.bs)]
    cdef int64_t i, j = 0, n, o
    cdef int32_t s
    for i in range(st.n_ex):
        n = st.grant[i]
        if n <= 0:
            continue
        s = st.ex[i]
        o = R(st, s).ord
        if st.n_lazy:
            while j < k.n and R(st, k.s[j]).ord < o:
                allocate(st, R(st, k.s[j]), 1)
                j += 1
        grow(st, b, s, n, &budget)
        sched_add(st, b, s, n)
        budget -= n
    if st.n_lazy:
        while j < k.n:
            allocate(st, R(st, k.s[j]), 1)
            j += 1
        b.dec += st.n_lazy
        b.dctx += st.s_base + st.n_lazy * st.vt
        b.nlive += st.n_lazy
        b.lazy_n = st.n_lazy
        st.lazy_batches += 1
        budget -= st.n_lazy
    return budget


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
    cdef int64_t i = 0, n = imin(q.nkeys, most)
    cdef int32_t h
    cdef int64_t* keys
    if n > st.cap_hit:
        mem_reserve(<void**>&st.hit, &st.cap_hit, n, 64, sizeof(int32_t))
    if q.phit and st.forgets == 0:
        # Until a block's content is forgotten, the first holder of every key
        # the prepared pool held is still the one it had (a key gains holders at
        # the end of its chain); what the replay cached since is probed below.
        i = imin(q.phit, n)
        memcpy(st.hit, st.phb + q.ph_off, sizeof(int32_t) * i)
    keys = KL(st, q)
    for i in range(i, n):
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
        q.ord = st.ord_next
        st.ord_next += 1
        if st.lazy_ok and not st.materialized:
            ex_append(st, s)
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
    if st.lazy_ok and not st.materialized:
        pop_leaves(st)
    for i in range(P.n_stages):
        stage = P.stages[i]
        if stage == STAGE_WAITING:
            if b.preempted and not P.admit_after_preemption:
                continue
            budget = admit(st, b, budget, cap)
        elif st.lazy_ok and not st.materialized:
            if fast_ok(st, b, budget, cap):
                budget = serve_fast(st, b, budget)
            else:
                materialize(st)
                budget = serve_running(st, b, budget, cap, stage)
        else:
            budget = serve_running(st, b, budget, cap, stage)
        if P.exclusive and b.nlive:
            break
    after_schedule(st, b)
    st.vt += 1
    return 0


# ---------------------------------------------------------------------------
# Outputs (SchedulerCore.process)
# ---------------------------------------------------------------------------

cdef int process(St* st, Batch* b) except -1 nogil:
    cdef int64_t i, j, got, bs = st.P.bs, nfin = 0
    cdef int32_t s
    cdef Rq* q
    cdef Ev* e
    cdef bint is_async = st.P.depth > 1
    # With lazies about, finishes are released together, in running order.
    cdef bint lz = st.lazy_ok and not b.carried
    if lz:
        st.vt_done = b.vt
        if b.n_samp + st.n_lazy > st.cap_fin:
            mem_reserve(<void**>&st.fin, &st.cap_fin, b.n_samp + st.n_lazy, 64, sizeof(int32_t))
    for i in range(b.n_ent):
        if b.ent_n[i] >= 0:
            q = R(st, b.ent_s[i])
            if not q.lazy:
                q.inflight -= b.ent_n[i]
    if b.carried:
        for i in range(b.n_samp):
            R(st, b.samp[i]).inflight -= b.got[i]
    for i in range(b.n_samp):
        s = b.samp[i]
        q = R(st, s)
        if q.status == S_FINISHED or q.lazy:
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
            if lz:
                st.fin[nfin] = s
                nfin += 1
            else:
                release(st, q)
                run_remove(st, s)
    if not lz:
        if b.carried:
            st.fold_ok = True
        return 0
    while True:
        e = heap_top(st, &st.rel)
        if e == NULL or e.key > b.vt:
            break
        s = e.slot
        heap_pop(&st.rel)
        unlazy(st, s, True, True)
        R(st, s).status = S_FINISHED
        st.fin[nfin] = s
        nfin += 1
    for i in range(1, nfin):
        s = st.fin[i]
        j = i
        while j > 0 and R(st, st.fin[j - 1]).ord > R(st, s).ord:
            st.fin[j] = st.fin[j - 1]
            j -= 1
        st.fin[j] = s
    for i in range(nfin):
        s = st.fin[i]
        release(st, R(st, s))
        run_remove(st, s)
        ex_remove(st, s)
    return 0


# ---------------------------------------------------------------------------
# The engine loop (SchedulerCore.go)
# ---------------------------------------------------------------------------

cdef int log_batch(St* st, Batch* b, double dt) except -1 nogil:
    cdef int64_t* e
    cdef int64_t i, n
    cdef int32_t s
    cdef Rq* q
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
    if b.lazy_n:
        # Lazies have no entries: the running list gives the batch's order.
        for i in range(st.n_run):
            s = st.run[i]
            q = R(st, s)
            if q.lazy:
                n = 1
            elif q.in_batch == b.serial and b.ent_n[q.sched_pos] >= 0:
                n = b.ent_n[q.sched_pos]
            else:
                continue
            st.tlog[st.n_tlog] = s
            st.tlog[st.n_tlog + 1] = n
            st.n_tlog += 2
        return 0
    for i in range(b.n_ent):
        if b.ent_n[i] >= 0:
            st.tlog[st.n_tlog] = b.ent_s[i]
            st.tlog[st.n_tlog + 1] = b.ent_n[i]
            st.n_tlog += 2
    return 0


# ---------------------------------------------------------------------------
# Resuming: a replay's state before it first examined the new request
# ---------------------------------------------------------------------------

cdef enum:
    # A turn this early saves less than taking its state costs.
    CK_MIN_TURN = 4
    # Nor does one whose work so far is small beside the pool it copies: a
    # work unit (a request in a batch) costs about this many copied records.
    CK_WORK_PER_RECORD = 16


cdef inline void ht_put(HEnt* ht, int64_t mask, int64_t k, int32_t h) noexcept nogil:
    cdef int64_t i = <int64_t>(mix(k) & <uint64_t>mask)
    while ht[i].head != NIL:
        i = (i + 1) & mask
    ht[i].key = k
    ht[i].head = h


cdef int merge_map(St* st, Ack* ck) noexcept nogil:
    """The content map as the replay has it now (the prepared table, the
    overlay's changes on top), as one table in ck; -1 out of memory."""
    cdef int64_t i, n = st.ov_n, cap = 8
    cdef OEnt* e
    if st.ht != NULL:
        for i in range(st.ht_mask + 1):
            n += st.ht[i].head != NIL
    while cap < 2 * n + 2:
        cap *= 2
    if mem_try_reserve(<void**>&ck.ht, &ck.cap_ht, cap, sizeof(HEnt)) < 0:
        return -1
    memset(ck.ht, 0xff, sizeof(HEnt) * cap)  # head NIL: empty
    ck.ht_mask = cap - 1
    if st.ht != NULL:
        for i in range(st.ht_mask + 1):
            if st.ht[i].head == NIL:
                continue
            if st.ov_n:
                e = ov_find(st, st.ht[i].key)
                if e.epoch == st.cur:
                    continue  # changed in this replay: the overlay's entry below
            ht_put(ck.ht, ck.ht_mask, st.ht[i].key, st.ht[i].head)
    if st.ov_n:
        for i in range(st.ov_mask + 1):
            if st.ov[i].epoch == st.cur and st.ov[i].head != NIL:
                ht_put(ck.ht, ck.ht_mask, st.ov[i].key, st.ov[i].head)
    return 0


cdef void take_checkpoint(St* st) noexcept nogil:
    """Keep the state at this turn's top in ``st.ck``, for later replays to resume from.

    As in the counted loop (``_replay_c.take_checkpoint``): until admission
    first reaches the new request, nothing it carries, its keys included, has
    changed a batch or a block. Every record is materialised and the block and
    key lists grown in this replay are appended to copies of the prepared
    blobs, so a resumed replay reads everything from the checkpoint as a first
    replay reads it from the prepared snapshot. Out of memory, nothing is kept.
    """
    cdef Ack* ck = st.ck
    cdef int64_t i, n = st.new_slot + 1, total
    cdef Rq* q
    cdef Batch* b
    ck.terms.status = CK_NONE
    if mem_try_copy(<void**>&ck.r, &ck.cap_r, st.src, n, sizeof(Rq)) < 0:
        return
    for i in range(n):
        if st.rep[i] == st.cur:
            ck.r[i] = st.r[i]
        q = &ck.r[i]
        if q.blk_own:
            q.blk_off += st.n_bb
            q.blk_own = 0
        if q.key_own:
            q.key_off += st.n_kb
            q.key_own = 0
    if mem_try_copy(<void**>&ck.run, &ck.cap_run, st.run, st.n_run, sizeof(int32_t)) < 0:
        return
    if mem_try_reserve(<void**>&ck.wq, &ck.cap_wq, st.wq_n, sizeof(int32_t)) < 0:
        return
    for i in range(st.wq_n):
        ck.wq[i] = wq_at(st, i)
    if mem_try_reserve(<void**>&ck.bl, &ck.cap_bl, st.nb, sizeof(Blk)) < 0:
        return
    for i in range(st.nb):
        ck.bl[i] = st.src_bl[i] if i < st.nb0 and st.bep[i] != st.cur else st.bl[i]
    if mem_try_reserve(<void**>&ck.runs, &ck.cap_runs, st.nruns, sizeof(Run)) < 0:
        return
    for i in range(st.nruns):
        ck.runs[i] = st.src_runs[i] if st.rnep[i] != st.cur else st.runs[i]
    if merge_map(st, ck) < 0:
        return
    if mem_try_reserve(<void**>&ck.bb, &ck.cap_bb, st.n_bb + st.ab_n, sizeof(int32_t)) < 0:
        return
    memcpy(ck.bb, st.pbb, sizeof(int32_t) * st.n_bb)
    memcpy(ck.bb + st.n_bb, st.ab, sizeof(int32_t) * st.ab_n)
    if mem_try_reserve(<void**>&ck.kb, &ck.cap_kb, st.n_kb + st.ak_n, sizeof(int64_t)) < 0:
        return
    memcpy(ck.kb, st.pkb, sizeof(int64_t) * st.n_kb)
    memcpy(ck.kb + st.n_kb, st.ak, sizeof(int64_t) * st.ak_n)
    if st.ring_n > 1:
        return  # (a turn's top holds at most the batch in flight)
    if st.ring_n == 1:
        b = &st.ring[st.ring_head]
        if (mem_try_copy(<void**>&ck.b_ent_s, &ck.cap_b_ent_s, b.ent_s, b.n_ent,
                         sizeof(int32_t)) < 0
                or mem_try_copy(<void**>&ck.b_ent_n, &ck.cap_b_ent_n, b.ent_n, b.n_ent,
                                sizeof(int64_t)) < 0
                or mem_try_copy(<void**>&ck.b_samp, &ck.cap_b_samp, b.samp, b.n_samp,
                                sizeof(int32_t)) < 0
                or mem_try_copy(<void**>&ck.b_got, &ck.cap_b_got, b.got, b.n_samp,
                                sizeof(int64_t)) < 0):
            return
        ck.b = b[0]
    total = 0
    for i in range(st.P.bs):
        total += st.bk[i].n
    if (mem_try_reserve(<void**>&ck.bk_s, &ck.cap_bk_s, total, sizeof(int32_t)) < 0
            or mem_try_reserve(<void**>&ck.bk_n, &ck.cap_bk_n, st.P.bs, sizeof(int64_t)) < 0):
        return
    total = 0
    for i in range(st.P.bs):
        ck.bk_n[i] = st.bk[i].n
        memcpy(ck.bk_s + total, st.bk[i].s, sizeof(int32_t) * st.bk[i].n)
        total += st.bk[i].n
    if mem_try_copy(<void**>&ck.leave, &ck.cap_leave, st.leave.e, st.leave.n, sizeof(Ev)) < 0:
        return
    if mem_try_copy(<void**>&ck.rel, &ck.cap_rel, st.rel.e, st.rel.n, sizeof(Ev)) < 0:
        return
    if mem_try_copy(<void**>&ck.ex, &ck.cap_ex, st.ex, st.n_ex, sizeof(int32_t)) < 0:
        return
    ck.n_r = n
    ck.n_run = st.n_run
    ck.wq_n = st.wq_n
    ck.nb = st.nb
    ck.nruns = st.nruns
    ck.fq_head = st.fq_head
    ck.fq_tail = st.fq_tail
    ck.n_free = st.n_free
    ck.serial_key = st.serial_key
    ck.forgets = st.forgets
    ck.ring_n = st.ring_n
    ck.serial = st.serial
    ck.k = st.k
    ck.work = st.work
    ck.terms.t = st.t
    ck.vt = st.vt
    ck.vt_done = st.vt_done
    ck.n_lazy = st.n_lazy
    ck.s_base = st.s_base
    ck.ord_next = st.ord_next
    ck.lazy_batches = st.lazy_batches
    ck.materialized = st.materialized
    ck.fold_ok = st.fold_ok
    ck.bk_dirty = st.bk_dirty
    ck.n_leave = st.leave.n
    ck.n_rel = st.rel.n
    ck.n_ex = st.n_ex
    ck.terms.status = CK_TAKEN


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
            st.join_lo = st.t_before
            st.join_hi = st.t
        if not st.new_seen and not st.pending_new:
            if st.ck_take and st.turn == st.ck.terms.at:
                st.ck_take = False
                take_checkpoint(st)
            st.top_turn = st.turn
            st.top_work = st.work
        st.turn += 1
        b = ring_new(st)
        schedule(st, b)
        st.work += 1 + st.n_run + b.nlive
        if b.nlive:
            st.k += 1
            dt = (st.c.b0 + st.c.b1 * fmax(<double>(b.pre + b.dec), st.c.tau)
                  + st.c.b2 * <double>b.dctx + st.c.b2s * <double>b.dec + st.c.b3 * <double>b.patt)
            st.t_before = st.t
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
                st.join_hi = -1.0  # (the batches from here start at its arrival)
        if (b.nlive and st.k >= max_batches) or st.work >= st.max_work:
            return R_FIRST_TOKEN if st.n_tok else R_LIMIT
        if st.ring_n < st.P.depth:
            if st.lazy_ok:
                fold(st, b)
            continue
        process(st, &st.ring[st.ring_head])
        st.ring_head = (st.ring_head + 1) % 3
        st.ring_n -= 1
        if st.lazy_ok:
            fold(st, b)


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
        if is_key(k):
            continue
        raise ValueError(
            f"prefix_keys[{i}] must be an integer in [0, 2**63) (got {short_repr(k)})")
    return keys


cdef class _I64:
    """An int64 buffer freed with its owner (prepare's scratch)."""

    cdef int64_t* v

    def __cinit__(self, Py_ssize_t n):
        self.v = <int64_t*>mem_alloc(n, sizeof(int64_t))

    def __dealloc__(self):
        free(self.v)


cdef inline tuple _as_tuple(object x):
    return <tuple>x if type(x) is tuple else tuple(x)


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
    cdef int32_t* phb
    cdef int32_t* b0
    cdef int64_t* b0_got
    cdef int64_t n_b0
    cdef bint has_inflight
    cdef object ids
    cdef object policy
    cdef int64_t n_bb       # the blobs' lengths
    cdef int64_t n_kb
    cdef Ack ck             # where replays of it may resume (take_checkpoint)

    def __dealloc__(self):
        cdef Ack* ck = &self.ck
        free(ck.r)
        free(ck.run)
        free(ck.wq)
        free(ck.bl)
        free(ck.runs)
        free(ck.ht)
        free(ck.bb)
        free(ck.kb)
        free(ck.b_ent_s)
        free(ck.b_ent_n)
        free(ck.b_samp)
        free(ck.b_got)
        free(ck.bk_s)
        free(ck.bk_n)
        free(ck.leave)
        free(ck.rel)
        free(ck.ex)
        free(self.r)
        free(self.run)
        free(self.wq)
        free(self.bl)
        free(self.runs)
        free(self.ht)
        free(self.bb)
        free(self.kb)
        free(self.phb)
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


cdef int64_t _serials = 0


cdef class Replayer:
    """Compiled prefix-caching replay of one bound policy (``kv.prefix_caching``)."""

    cdef Params P
    cdef St st
    cdef readonly object policy
    cdef public bint resume
    cdef int64_t serial     # names it in the checkpoints it takes
    cdef bint resumed
    # The last new request's keys, converted: a router prices one request at
    # many instances with one chain, and a tuple cannot change behind it.
    cdef object keys_obj
    cdef int64_t* keys_buf
    cdef int64_t keys_cap
    cdef int64_t keys_n
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
        self.resume = True
        global _serials
        _serials += 1
        self.serial = _serials
        p = policy
        read_policy(&self.P, p)
        self.st.P = &self.P
        cdef Params* P = &self.P
        # Lazy decodes need the running list served in order before admissions,
        # and a budget that counts tokens.
        self.st.lazy_ok = (P.n_stages == 2 and P.stages[0] == STAGE_RUNNING
                           and P.stages[1] == STAGE_WAITING and not P.padded
                           and not P.exclusive)
        self.st.bk = <Bucket*>mem_alloc(P.bs, sizeof(Bucket))
        memset(self.st.bk, 0, sizeof(Bucket) * P.bs)

    def __dealloc__(self):
        cdef St* st = &self.st
        free(self.keys_buf)
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
        free(st.ex)
        free(st.grant)
        free(st.fin)
        free(st.leave.e)
        free(st.rel.e)
        if st.bk != NULL:
            for i in range(self.P.bs):
                free(st.bk[i].s)
            free(st.bk)
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
        # code reaches the C arrays below only within their bounds. The keys
        # become a C array once; every later read is an index into it.
        cdef tuple kt = keys if type(keys) is tuple else tuple(keys)
        cdef Py_ssize_t nkeys_all = len(kt)
        cdef object ko
        cdef _I64 kc = _I64(nkeys_all)
        for i in range(nkeys_all):
            ko = <object>PyTuple_GET_ITEM(kt, i)
            if not is_key(ko):
                raise ValueError(
                    f"prefix_cache.keys[{i}] must be an integer in [0, 2**63) (got {short_repr(ko)})")
            kc.v[i] = <int64_t>PyLong_AsUnsignedLongLongMask(ko)
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
        pr.n_bb = total_b
        pr.n_kb = total_k
        pr.bl = <Blk*>mem_alloc(nb, sizeof(Blk))
        pr.nb = nb
        pr.n_run = pr.wq_n = pr.n_b0 = 0
        pr.fq_head = pr.fq_tail = NIL
        pr.n_free = 0
        cdef Blk* q
        for b in range(nb):
            q = &pr.bl[b]
            q.key = kc.v[b] if b < ncached else NOKEY
            q.ref = 0
            q.hnext = q.fprev = q.fnext = NIL
        # Requests' blocks and keys, and the reference counts they imply.
        cdef int64_t off_b = 0, off_k = 0, own = ncached, kk
        cdef Rq* r
        cdef tuple seq
        cdef Py_ssize_t m
        for i in range(n):
            r = &pr.r[i]
            r.blk_off = off_b
            r.key_off = off_k
            seq = _as_tuple(blocks[i])
            for m in range(len(seq)):
                ko = <object>PyTuple_GET_ITEM(seq, m)
                if not int_in(ko, 0, ncached - 1, &b):
                    raise ValueError(f"request {i}: cached block {short_repr(ko)} out of range")
                pr.bl[b].ref += 1
                pr.bb[off_b] = <int32_t>b
                off_b += 1
                pr.kb[off_k] = kc.v[b]
                off_k += 1
            for j in range(uncached[i]):
                pr.bl[own].ref = 1
                pr.bb[off_b] = <int32_t>own
                off_b += 1
                own += 1
            seq = _as_tuple(chains[i])
            for m in range(len(seq)):
                ko = <object>PyTuple_GET_ITEM(seq, m)
                if not int_in(ko, 0, nkeys_all - 1, &kk):
                    raise ValueError(f"request {i}: chain key {short_repr(ko)} out of range")
                pr.kb[off_k] = kc.v[kk]
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
                r.ord = pr.n_run
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
        # Each waiting request's hit on this pool, found once here rather than
        # in every replay (lookup() uses it while nothing is evicted).
        cdef int64_t total_h = 0, off_h = 0, h
        for i in range(pr.wq_n):
            total_h += pr.r[pr.wq[i]].nkeys
        pr.phb = <int32_t*>mem_alloc(total_h, sizeof(int32_t))
        for i in range(pr.wq_n):
            r = &pr.r[pr.wq[i]]
            r.ph_off = off_h
            h = 0
            while h < r.nkeys:
                x = ht_get(pr.ht, pr.ht_mask, pr.kb[r.key_off + h])
                if x == NIL:
                    break
                pr.phb[off_h + h] = x
                h += 1
            r.phit = h
            off_h += h
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
        nk = 0
        if prefix_keys is not None:
            # (None leaves the kept chain for the next call that brings it.)
            if prefix_keys is not self.keys_obj:
                self._convert_keys(prefix_keys)
            nk = imin(self.keys_n, prompt // self.P.bs)
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
        st.phb = pr.phb
        st.forgets = 0
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
        st.n_bb = pr.n_bb
        st.n_kb = pr.n_kb
        st.ck = NULL
        st.ck_take = False
        st.turn = 0
        st.top_turn = -1
        st.t_before = -1.0
        st.join_hi = -1.0
        self.resumed = False
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
            memcpy(st.ak, self.keys_buf, sizeof(int64_t) * nk)
            st.ak_n = nk
        q.key_own = 1
        q.key_off = 0
        q.key_cap = nk
        q.nkeys = nk
        # It joins the end of the waiting queue when it arrives (at the loop's
        # first turn when that is now).
        st.arrival = arrival
        st.pending_new = True
        st.vt = 0
        st.vt_done = -1
        st.n_lazy = 0
        st.s_base = 0
        st.ord_next = pr.n_run
        st.lazy_batches = 0
        st.materialized = True
        st.fold_ok = not pr.has_inflight
        st.n_ex = 0
        st.leave.n = 0
        st.rel.n = 0
        if st.bk_dirty:
            for i in range(self.P.bs):
                st.bk[i].n = 0
            st.bk_dirty = False
        if pr.has_inflight:
            b0 = ring_new(st)
            b0.carried = True
            b0.vt = -1
            for i in range(pr.n_b0):
                samp_add(b0, pr.b0[i], pr.b0_got[i])
        return 0

    cdef int _convert_keys(self, object prefix_keys) except -1:
        """Check and convert the new request's keys (kept while they are one tuple)."""
        cdef list keys = _key_list(prefix_keys)
        cdef int64_t i, n = len(keys)
        self.keys_obj = None
        self.keys_n = 0
        if n:
            mem_reserve(<void**>&self.keys_buf, &self.keys_cap, n, 256, sizeof(int64_t))
            for i in range(n):
                # In [0, 2**63) (checked by _key_list): the digits as they are.
                self.keys_buf[i] = <int64_t>PyLong_AsUnsignedLongLongMask(keys[i])
        self.keys_n = n
        if type(prefix_keys) is tuple:
            self.keys_obj = prefix_keys
        return 0

    def ttft(self, Prepared prepared, prompt_tokens, output_len, coeffs, max_tokens=-1,
             prefix_keys=None, horizon_s=INFINITY, arrival_s=0.0):
        """Return only the predicted time to first token (``inf`` when never)."""
        cdef double horizon = horizon_arg(horizon_s, check_horizon)
        cdef double arrival = arrival_arg(arrival_s, check_arrival)
        self._start(prepared, prompt_tokens, output_len, max_tokens, coeffs, False, prefix_keys,
                    arrival)
        self.st.horizon = horizon
        cdef bint same = self._resume_or_keep(prepared, arrival)
        cdef int rc
        with nogil:
            rc = go(&self.st, 1_000_000)
        self._locate(prepared, same)
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
        # Resuming needs the batches before the kept state unrecorded and the
        # bounds ttft() replays under.
        cdef bint resumable = not record and limit == 1_000_000 and work == MAX_WORK
        cdef bint same = resumable and self._resume_or_keep(prepared, arrival)
        cdef int rc
        with nogil:
            rc = go(&self.st, limit)
        if resumable:
            self._locate(prepared, same)
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

    cdef bint _resume_or_keep(self, Prepared pr, double arrival) except? -1:
        """Before a replay that _start set up (its horizon set): resume from
        ``pr``'s checkpoint where it holds, or have the run keep it there
        (the counted loop's rule, ``_replay_c``). Returns whether the
        checkpoint's terms are this replay's."""
        cdef St* st = &self.st
        cdef Ack* ck = &pr.ck
        cdef bint same = ck_holds(&ck.terms, self.resume, self.serial, False, arrival, &st.c)
        if same and ck.terms.status == CK_TAKEN and ck.terms.t <= st.horizon:
            self._resume(pr)
        elif same and ck.terms.status == CK_LOCATED:
            st.ck = ck
            st.ck_take = True
        return same

    cdef void _locate(self, Prepared pr, bint same):
        """After the replay: a first look at ``pr`` (or with other terms) that
        examined the new request says where a later replay keeps its state."""
        cdef St* st = &self.st
        cdef int64_t records = (pr.n + 1 + st.nb + pr.nruns + pr.n_bb + pr.n_kb
                                + (pr.ht_mask + 1 if pr.ht != NULL else 0))
        if (self.resume and st.new_seen and st.top_turn >= CK_MIN_TURN and st.join_hi >= 0.0
                and st.top_work * CK_WORK_PER_RECORD >= records
                and not self.resumed and not same):
            ck_locate(&pr.ck.terms, st.top_turn, st.join_lo, st.join_hi, &st.c, self.serial, False)

    cdef int _resume(self, Prepared pr) except -1:
        """Start the replay that _start set up from ``pr``'s checkpoint instead.

        The new request keeps the slot and keys _start gave it (its keys the
        only ones in the arena); every other record is copied from the
        checkpoint on first touch (a fresh epoch), the lists, content map,
        buckets, heaps and clocks are restored.
        """
        cdef St* st = &self.st
        cdef Ack* ck = &pr.ck
        cdef int64_t i, off
        cdef Rq fresh = st.r[st.new_slot]
        cdef Batch* b
        if st.cap_bep < ck.nb:
            mem_resize(<void**>&st.bep, ck.nb, sizeof(int32_t))
            memset(st.bep, 0, sizeof(int32_t) * ck.nb)
            st.cap_bep = ck.nb
            self._restart_epochs()
        if st.cap_bl < ck.nb:
            mem_reserve(<void**>&st.bl, &st.cap_bl, ck.nb, 64, sizeof(Blk))
        for i in range(self.P.bs):
            mem_reserve(<void**>&st.bk[i].s, &st.bk[i].cap, ck.bk_n[i], 16, sizeof(int32_t))
        mem_reserve(<void**>&st.leave.e, &st.leave.cap, ck.n_leave, 16, sizeof(Ev))
        mem_reserve(<void**>&st.rel.e, &st.rel.cap, ck.n_rel, 16, sizeof(Ev))
        mem_reserve(<void**>&st.ex, &st.cap_ex, ck.n_ex, 64, sizeof(int32_t))
        b = &st.ring[0]
        if ck.ring_n and b.cap_ent < ck.b.n_ent:
            mem_resize(<void**>&b.ent_s, ck.b.n_ent, sizeof(int32_t))
            mem_resize(<void**>&b.ent_n, ck.b.n_ent, sizeof(int64_t))
            b.cap_ent = ck.b.n_ent
        if ck.ring_n and b.cap_samp < ck.b.n_samp:
            mem_resize(<void**>&b.samp, ck.b.n_samp, sizeof(int32_t))
            mem_resize(<void**>&b.got, ck.b.n_samp, sizeof(int64_t))
            b.cap_samp = ck.b.n_samp
        # Every buffer has its size: a fresh epoch, and the new request's copy current.
        st.cur += 1
        if st.cur == 0x7fffffff:
            self._restart_epochs()
            st.cur = 1
        st.r[st.new_slot] = fresh
        st.rep[st.new_slot] = st.cur
        st.src = ck.r
        memcpy(st.run, ck.run, sizeof(int32_t) * ck.n_run)
        st.n_run = ck.n_run
        st.wq_head = 0
        st.wq_n = 0
        for i in range(ck.wq_n):
            wq_push_back(st, ck.wq[i])
        st.src_bl = ck.bl
        st.nb0 = ck.nb
        st.nb = ck.nb
        st.src_runs = ck.runs
        st.nruns = ck.nruns
        st.fq_head = ck.fq_head
        st.fq_tail = ck.fq_tail
        st.n_free = ck.n_free
        st.ht = ck.ht
        st.ht_mask = ck.ht_mask
        st.ov_n = 0
        st.serial_key = ck.serial_key
        st.pbb = ck.bb
        st.pkb = ck.kb
        st.forgets = ck.forgets
        st.ring_head = 0
        st.ring_n = ck.ring_n
        if ck.ring_n:
            b.n_ent = ck.b.n_ent
            memcpy(b.ent_s, ck.b_ent_s, sizeof(int32_t) * b.n_ent)
            memcpy(b.ent_n, ck.b_ent_n, sizeof(int64_t) * b.n_ent)
            b.n_samp = ck.b.n_samp
            memcpy(b.samp, ck.b_samp, sizeof(int32_t) * b.n_samp)
            memcpy(b.got, ck.b_got, sizeof(int64_t) * b.n_samp)
            b.nlive = ck.b.nlive
            b.carried = ck.b.carried
            b.has_new = ck.b.has_new
            b.serial = ck.b.serial
            b.vt = ck.b.vt
            b.lazy_n = ck.b.lazy_n
            b.pre = ck.b.pre
            b.dec = ck.b.dec
            b.dctx = ck.b.dctx
            b.patt = ck.b.patt
            b.admitted = ck.b.admitted
            b.preempted = ck.b.preempted
        st.serial = ck.serial
        st.k = ck.k
        st.work = ck.work
        st.t = ck.terms.t
        st.vt = ck.vt
        st.vt_done = ck.vt_done
        st.n_lazy = ck.n_lazy
        st.s_base = ck.s_base
        st.ord_next = ck.ord_next
        st.lazy_batches = ck.lazy_batches
        st.materialized = ck.materialized
        st.fold_ok = ck.fold_ok
        off = 0
        for i in range(self.P.bs):
            st.bk[i].n = ck.bk_n[i]
            memcpy(st.bk[i].s, ck.bk_s + off, sizeof(int32_t) * ck.bk_n[i])
            off += ck.bk_n[i]
        st.bk_dirty = ck.bk_dirty
        memcpy(st.leave.e, ck.leave, sizeof(Ev) * ck.n_leave)
        st.leave.n = ck.n_leave
        memcpy(st.rel.e, ck.rel, sizeof(Ev) * ck.n_rel)
        st.rel.n = ck.n_rel
        memcpy(st.ex, ck.ex, sizeof(int32_t) * ck.n_ex)
        st.n_ex = ck.n_ex
        # It joined where the checkpoint's did (its arrival is in the same interval).
        st.pending_new = False
        st.join_lo = ck.terms.join_lo
        st.join_hi = ck.terms.join_hi
        st.turn = ck.terms.at
        self.resumed = True
        return 0

    @property
    def last_resumed(self):
        """Whether the latest :meth:`ttft` or :meth:`replay` started from its
        prepared state's checkpoint (see ``_replay_c.Replayer.last_resumed``)."""
        return self.resumed

    @property
    def last_work(self):
        """Work units of the latest replay (the twin's units)."""
        return self.st.work

    @property
    def last_new_examined(self):
        """Whether the latest replay's admissions looked at the new request."""
        return self.st.new_seen

    @property
    def last_lazy_batches(self):
        """Batches of the latest replay that served decodes as an aggregate."""
        return self.st.lazy_batches

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
        # (the lazies' own blocks are cached when they become explicit)
        unlazy_all(st)
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
