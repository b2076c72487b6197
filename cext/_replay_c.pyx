# Compiled replay of batch formation (bearsdk.replay._replay_c).
#
# Same contract as bearsdk/replay/_replay_py.py (the readable reference); the
# property tests require identical batch sequences. What makes it fast:
#
# * Plain decodes are aggregates, not loop iterations. A decoding request is
#   "lazy": its context is base + vt and its delivered-output count obase + vt,
#   where vt counts batches that served every lazy decode. Per batch the decodes
#   cost O(1): a count, a context sum and a histogram of block phases (which
#   decodes cross a KV-block boundary at this vt). Finishes come off two event
#   queues (a sorted array built once per snapshot, plus a heap for decodes that
#   start during the replay).
# * Runs of identical decode-only batches (the new request waits on memory or a
#   seat) are summed in closed form up to the next event.
# * Steps that need the exact order of requests (a preemption, a budget cut in
#   the middle of the running list) materialise every request and run the same
#   per-request algorithm as the twin, then fold the decodes back into the
#   aggregate.
#
# The loop is specialised per policy with fused "tag" types (KV allocation mode
# x pipeline depth x budget counting): twelve instantiations chosen once when a
# policy is compiled. Directives are set once in setup.py (BEARSDK_CYTHON_DEBUG=1
# turns bounds checks back on).

from libc.stdint cimport int8_t, int32_t, int64_t
from libc.stdlib cimport free, qsort
from libc.string cimport memcpy, memset

from _mem cimport mem_alloc, mem_reserve, mem_resize, mem_try_copy, mem_try_reserve
from _replay_defs cimport (
    CK_LOCATED, CK_NONE, CK_TAKEN, CkTerms, ck_holds, ck_locate,
    R_FIRST_TOKEN, R_HORIZON, R_LIMIT, R_NEVER, S_FINISHED, S_RUNNING, S_WAITING, STAGE_DECODES,
    STAGE_PREFILLS, STAGE_RUNNING, STAGE_WAITING, WM_ALWAYS, WM_NEVER, WM_WHILE_RUNNING, Coeffs, Ev,
    Params, arrival_arg, cdiv, ev_less, ev_pop, ev_push, ev_sift_down, horizon_arg, imax, imin,
    output_limit, output_target, read_coeffs, read_policy, tokens_arg, tokens_wanted,
)

import numpy as np

from bearsdk.replay import _replay_apc_c

from bearsdk.replay.types import (
    MAX_REPLAY_WORK as _MAX_REPLAY_WORK_PY, MAX_TOKENS as _MAX_TOKENS_PY, BatchRecord, ReplayResult,
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
    double sqrt(double)
    double floor(double)

# ---------------------------------------------------------------------------
# Policy, specialisation tags
# ---------------------------------------------------------------------------

ctypedef struct OnDemand:
    char _unused
ctypedef struct WholePrompt:
    char _unused
ctypedef struct MaxLength:
    char _unused
ctypedef fused Alloc:
    OnDemand
    WholePrompt
    MaxLength

ctypedef struct SyncPipe:
    char _unused
ctypedef struct AsyncPipe:
    char _unused
ctypedef fused Pipe:
    SyncPipe
    AsyncPipe

ctypedef struct TokenCount:
    char _unused
ctypedef struct PaddedCount:
    char _unused
ctypedef fused Count:
    TokenCount
    PaddedCount

# "No limit" for a request's output count, and a step no batch ever had.
cdef int64_t NEVER_SCHEDULED = -((<int64_t>1) << 40)
# Token counts are refused beyond bearsdk.replay.types.MAX_TOKENS at the Python
# boundary (check_table, check_tokens): sums of a few of them stay far from
# int64 overflow, so the loop's arithmetic never wraps.
MIN_ANY = -_MAX_TOKENS_PY
cdef int64_t MAX_REPLAY_WORK_C = _MAX_REPLAY_WORK_PY
# Column order and running state of bearsdk.snapshot (table_in_range reads
# columns by position; a module-level check keeps them in step).
assert (COL_STATE, COL_PROMPT, COL_COMPUTED, COL_OUTPUT, COL_PLACEHOLDERS, NCOLS) == (0, 1, 2, 3, 6, 7)
cdef int64_t STATE_RUNNING_C = STATE_RUNNING

# ---------------------------------------------------------------------------
# Per-request state
# ---------------------------------------------------------------------------

ctypedef struct Req:
    int64_t prompt
    int64_t outputs       # delivered output tokens (explicit requests)
    int64_t target        # outputs at which the request finishes
    int64_t limit         # outputs at which the scheduler knows it stops
    int64_t computed      # explicit requests
    int64_t blocks        # explicit requests; max-length lazies keep theirs here
    int64_t base          # lazy: computed = base + vt
    int64_t obase         # lazy: delivered + in-flight outputs = obase + vt
    int64_t served_until  # lazy: last vt at which it is served
    int64_t t_last        # lazy: vt whose batch delivers its last output
    int64_t lazy_since    # lazy: first vt served lazily
    int64_t last_sched    # step index of the last batch that scheduled it
    int64_t in_batch      # step index of the batch being formed, once scheduled in it
    int64_t ph            # async placeholders (explicit requests)
    int32_t ro_pos        # index in run_order
    int32_t gen           # bumped whenever queued events become stale
    int8_t status
    int8_t lazy
    int8_t prefilled
    int8_t eos            # stops before `limit`: async schedules one wasted token

ctypedef struct EvQ:
    Ev* sorted_        # owned by Prepared (read only)
    int64_t n_sorted
    int64_t pos
    Ev* heap
    int64_t n_heap
    int64_t cap_heap

ctypedef struct Batch:
    int64_t vt           # vt served (lazies), or -2: none
    int32_t* rel         # explicit releases at processing
    int64_t n_rel
    int32_t* stale       # preempted requests whose batch this is
    int64_t* stale_tok   # ... and how many of their tokens it carries
    int64_t n_stale
    Ev* samp             # explicit requests with a token in this batch (async);
    int64_t n_samp       #   an entry is void once its request's gen moves on
    int64_t nsched
    int64_t pre
    int64_t dec
    int64_t dctx
    int64_t patt
    int64_t admitted
    int64_t preempted
    bint active          # in the pipeline, not processed yet
    bint sampled_any

ctypedef struct Checkpoint:
    # Where a replay may resume: the state at the top of the last loop turn
    # before the new request was first examined (see take_checkpoint).
    CkTerms terms        # which turn (a step), and for which replays
    int64_t n_slots
    Req* r               # every slot, materialised
    int64_t cap_r
    int32_t* ro
    int64_t cap_ro
    int64_t ro_n
    int64_t n_running
    int32_t* ex
    int64_t cap_ex
    int64_t n_ex
    int32_t* wq          # linearised (head first)
    int64_t cap_wq
    int64_t wq_n
    int64_t* hist
    int64_t cap_hist
    int64_t n_lazy
    int64_t s_base
    int64_t n_grow
    int64_t leave_pos
    Ev* leave_heap
    int64_t cap_leave
    int64_t n_leave_heap
    int64_t release_pos
    Ev* release_heap
    int64_t cap_release
    int64_t n_release_heap
    int64_t free_blocks
    int64_t vt
    int64_t k
    int64_t work
    bint materialized
    bint st_force_slow
    bint slow_until_b0
    bint b0_done
    int64_t ring_n       # 0 or 1 at a turn's top (the batch in flight, async)
    Batch b              # its scalars (the arrays below hold its lists)
    int32_t* b_rel
    int64_t cap_b_rel
    int32_t* b_stale
    int64_t cap_b_stale
    int64_t* b_stale_tok
    int64_t cap_b_stale_tok
    Ev* b_samp
    int64_t cap_b_samp

ctypedef struct State:
    Params* P
    Req* r               # per-replay copies, made on first touch (see R)
    Req* src             # the prepared snapshot's requests (read only)
    int32_t* epoch       # epoch[s] == cur: r[s] is this replay's copy
    int32_t cur
    int64_t n_slots
    int64_t cap
    # running order (admission order) with tombstones (-1)
    int32_t* ro
    int64_t ro_n
    int64_t ro_cap
    int64_t n_running
    # explicit running requests still prefilling, in running order
    int32_t* ex
    int64_t n_ex
    # waiting queue: ring buffer
    int32_t* wq
    int64_t wq_head
    int64_t wq_n
    int64_t wq_cap
    # lazy aggregate
    int64_t n_lazy
    int64_t s_base       # sum of base over lazies
    int64_t* hist        # lazies growing on demand, by base mod bs
    int64_t n_grow
    EvQ leave
    EvQ release
    # KV
    int64_t free_blocks
    bint unlimited
    # clocks
    int64_t vt           # vt of the next batch that serves the lazies
    int64_t step         # schedule() calls so far
    int64_t k            # non-empty batches so far
    int64_t work         # MAX_REPLAY_WORK units so far (batches + requests touched)
    int64_t max_work
    bint materialized
    bint force_slow
    bint slow_until_b0   # force_slow only until the batch in flight at the snapshot lands
    bint b0_done         # ... which it has
    # pipeline (depth 1 or 2) + the in-flight batch at the snapshot
    Batch ring[3]
    int64_t ring_head    # index of the oldest unprocessed batch
    int64_t ring_n
    # scratch
    int32_t* sched       # slots scheduled explicitly in the current batch
    int64_t* sched_n
    int8_t* sched_dec
    int64_t* sched_ctx
    int64_t n_sched
    int32_t* tmp
    int64_t* grant
    int32_t new_slot
    bint new_tok_b       # the batch being formed samples a token for the new request
    # the new request's tokens: batch index and time of each (next_tokens)
    int64_t want
    int64_t n_tok
    int64_t* tok_k
    double* tok_t
    int64_t cap_tok
    bint new_seen        # admission looked at the new request (see last_new_examined)
    Batch* unlazy_batch  # the batch in flight while one is formed (async), else NULL
    Coeffs c            # eq. 12 (read_coeffs)
    double t
    double horizon       # stop past it before the first token (INFINITY: never)
    double arrival       # the new request joins before the first batch at or after it
    bint pending_new     # it has not joined yet
    # optional batch log
    bint record
    int64_t* log
    int64_t n_log
    int64_t cap_log
    # resuming (see take_checkpoint)
    Checkpoint* ck       # the prepared state's checkpoint, or NULL
    bint ck_take         # take it at the top of the turn at step ck.terms.at
    int64_t top_step     # the last turn's top before the new request was examined
    double t_before      # when the latest batch started
    double join_lo       # the arrivals that join where the new request joined:
    double join_hi       #   (join_lo, join_hi]; join_hi < 0 once it joined an idle engine


cdef inline Req* R(State* st, int64_t s) noexcept nogil:
    """This replay's copy of request s, copied from the prepared state on first use.

    Most replays touch a handful of requests; copying all of them up front
    cost more than the replay itself for large snapshots.
    """
    if st.epoch[s] != st.cur:
        st.r[s] = st.src[s]
        st.epoch[s] = st.cur
    return &st.r[s]


cdef inline int64_t pmod(int64_t a, int64_t b) noexcept nogil:
    cdef int64_t m = a % b
    return m + b if m < 0 else m

# ---------------------------------------------------------------------------
# Event queues: a sorted array (per snapshot) merged with a binary heap
# ---------------------------------------------------------------------------

cdef inline int heap_push(EvQ* q, int64_t key, int32_t slot, int32_t gen) except -1 nogil:
    return ev_push(&q.heap, &q.n_heap, &q.cap_heap, key, slot, gen)


cdef inline void sift_down(EvQ* q, int64_t i, Ev e) noexcept nogil:
    ev_sift_down(q.heap, q.n_heap, i, e)


cdef inline void heap_pop(EvQ* q) noexcept nogil:
    ev_pop(q.heap, &q.n_heap)


cdef inline bint ev_valid(State* st, Ev* e) noexcept nogil:
    return R(st, e.slot).gen == e.gen


cdef void heap_compact(State* st, EvQ* q) noexcept nogil:
    """Drop the stale events of a heap and re-heapify it.

    Every exact step re-lazifies the running requests, voiding their queued
    events; left in place they pile up (millions in a preemption storm) and
    every pop pays for the heap's depth. At most one event per request is
    valid and (key, slot) orders them totally, so the pop order is unchanged.
    """
    cdef int64_t i, j = 0, k, n
    for i in range(q.n_heap):
        if ev_valid(st, &q.heap[i]):
            q.heap[j] = q.heap[i]
            j += 1
    q.n_heap = j
    n = j
    for k in range(n // 2 - 1, -1, -1):
        sift_down(q, k, q.heap[k])
    st.work += n >> 2


cdef Ev* evq_top(State* st, EvQ* q) noexcept nogil:
    """Smallest valid event, dropping stale ones; NULL when empty."""
    cdef Ev* a
    cdef Ev* b
    while q.pos < q.n_sorted and not ev_valid(st, &q.sorted_[q.pos]):
        q.pos += 1
    while q.n_heap > 0 and not ev_valid(st, &q.heap[0]):
        heap_pop(q)
    a = &q.sorted_[q.pos] if q.pos < q.n_sorted else NULL
    b = &q.heap[0] if q.n_heap > 0 else NULL
    if a == NULL:
        return b
    if b == NULL:
        return a
    return a if ev_less(a, b) else b


cdef void evq_drop(EvQ* q, Ev* e) noexcept nogil:
    if q.pos < q.n_sorted and e == &q.sorted_[q.pos]:
        q.pos += 1
    else:
        heap_pop(q)

# ---------------------------------------------------------------------------
# Containers
# ---------------------------------------------------------------------------

cdef inline int32_t wq_at(State* st, int64_t i) noexcept nogil:
    return st.wq[(st.wq_head + i) % st.wq_cap]


cdef inline void wq_push_back(State* st, int32_t s) noexcept nogil:
    st.wq[(st.wq_head + st.wq_n) % st.wq_cap] = s
    st.wq_n += 1


cdef inline void wq_push_front(State* st, int32_t s) noexcept nogil:
    st.wq_head = (st.wq_head + st.wq_cap - 1) % st.wq_cap
    st.wq[st.wq_head] = s
    st.wq_n += 1


cdef inline int32_t wq_pop_front(State* st) noexcept nogil:
    cdef int32_t s = st.wq[st.wq_head]
    st.wq_head = (st.wq_head + 1) % st.wq_cap
    st.wq_n -= 1
    return s


cdef void wq_remove(State* st, int32_t s) noexcept nogil:
    cdef int64_t i, j
    for i in range(st.wq_n):
        if wq_at(st, i) == s:
            st.work += (st.wq_n - i) >> 4  # a shift: ~1 ns an entry, 1/16 of a unit
            for j in range(i, st.wq_n - 1):
                st.wq[(st.wq_head + j) % st.wq_cap] = st.wq[(st.wq_head + j + 1) % st.wq_cap]
            st.wq_n -= 1
            return


cdef void ro_compact(State* st) noexcept nogil:
    cdef int64_t i, j = 0
    cdef int32_t s
    for i in range(st.ro_n):
        s = st.ro[i]
        if s >= 0:
            st.ro[j] = s
            R(st, s).ro_pos = <int32_t>j
            j += 1
    st.ro_n = j


cdef inline void ro_append(State* st, int32_t s) noexcept nogil:
    if st.ro_n == st.ro_cap:
        ro_compact(st)
    st.ro[st.ro_n] = s
    R(st, s).ro_pos = <int32_t>st.ro_n
    st.ro_n += 1
    st.n_running += 1


cdef inline void ro_remove(State* st, int32_t s) noexcept nogil:
    st.ro[R(st, s).ro_pos] = -1
    st.n_running -= 1
    while st.ro_n > 0 and st.ro[st.ro_n - 1] < 0:
        st.ro_n -= 1


cdef void ex_remove(State* st, int32_t s) noexcept nogil:
    cdef int64_t i, j
    st.work += st.n_ex >> 6  # a scan and a shift of one array: ~0.2 ns an entry
    for i in range(st.n_ex):
        if st.ex[i] == s:
            for j in range(i, st.n_ex - 1):
                st.ex[j] = st.ex[j + 1]
            st.n_ex -= 1
            return


cdef void ex_insert_ordered(State* st, int32_t s) noexcept nogil:
    """Insert keeping running order (ro_pos); appends are the common case."""
    cdef int64_t i = st.n_ex
    while i > 0 and R(st, st.ex[i - 1]).ro_pos > R(st, s).ro_pos:
        st.ex[i] = st.ex[i - 1]
        i -= 1
    st.ex[i] = s
    st.n_ex += 1

# ---------------------------------------------------------------------------
# Lazy decodes
# ---------------------------------------------------------------------------

cdef inline void samp_add(Batch* b, int32_t s, int32_t gen, int64_t tokens) noexcept nogil:
    # key: tokens the batch carries for s (one, but the in-flight batch at a
    # snapshot carries all of a request's placeholders)
    b.samp[b.n_samp].key = tokens
    b.samp[b.n_samp].slot = s
    b.samp[b.n_samp].gen = gen
    b.n_samp += 1


cdef inline bint grows(Alloc* a) noexcept nogil:
    if Alloc is MaxLength:
        return False
    else:
        return True


cdef int lazify(State* st, Alloc* a, Pipe* p, int32_t s, int64_t pending) except -1 nogil:
    """Fold a decoding request (state at the next serving vt) into the aggregate.

    ``pending``: outputs delivered or in flight. Returns 1 when the request has
    nothing left to schedule (it becomes a zombie awaiting release), else 0.
    """
    cdef Req* q = R(st, s)
    cdef int64_t v = st.vt
    q.t_last = q.target - pending + v - 1
    q.served_until = q.t_last
    if Pipe is AsyncPipe:
        if q.eos:
            q.served_until += 1
    if q.served_until < v:
        return 1
    q.base = q.computed - v
    q.obase = pending - v
    q.lazy_since = v
    q.lazy = 1
    q.gen += 1
    st.n_lazy += 1
    st.s_base += q.base
    if grows(a):
        st.hist[pmod(q.base, st.P.bs)] += 1
        st.n_grow += 1
    heap_push(&st.leave, q.served_until, s, q.gen)
    heap_push(&st.release, q.t_last, s, q.gen)
    st.work += 4  # two heap events pushed, and popped later (valid or stale)
    # Valid events number at most one per request: beyond twice that, compact
    # (amortised O(1) a push; st.n_slots is 0 while a snapshot is prepared).
    if st.n_slots > 0:
        if st.leave.n_heap > 2 * st.n_slots + 64:
            heap_compact(st, &st.leave)
        if st.release.n_heap > 2 * st.n_slots + 64:
            heap_compact(st, &st.release)
    return 0


cdef void unlazy(State* st, Alloc* a, Pipe* p, int32_t s) noexcept nogil:
    """Make a lazy request explicit, as it stands when the batch at st.vt is formed."""
    cdef Req* q = R(st, s)
    cdef int64_t v = st.vt
    cdef int64_t served = imin(v, q.served_until + 1)  # vt values served so far, + base
    cdef int64_t last_served = served - 1
    cdef int64_t pending = q.obase + served
    st.work += 1
    q.computed = q.base + served
    if last_served >= q.lazy_since:
        q.last_sched = st.step - (v - last_served)
    if Pipe is AsyncPipe:
        # A token is in flight iff the previous batch scheduled it; that batch
        # turns it into an output when it is processed.
        q.ph = 1 if q.last_sched == st.step - 1 else 0
    else:
        q.ph = 0
    q.outputs = pending - q.ph
    if grows(a):
        q.blocks = cdiv(q.computed, st.P.bs)
        st.hist[pmod(q.base, st.P.bs)] -= 1
        st.n_grow -= 1
    st.n_lazy -= 1
    st.s_base -= q.base
    q.lazy = 0
    q.gen += 1   # its queued leave/release events are void
    if Pipe is AsyncPipe:
        if q.ph and st.unlazy_batch != NULL:
            samp_add(st.unlazy_batch, s, q.gen, 1)


cdef int pop_leaves(State* st, Alloc* a, Pipe* p) except -1 nogil:
    """Lazies whose last scheduled vt has passed leave the aggregate (zombies)."""
    cdef Ev* e
    cdef int32_t s
    while True:
        e = evq_top(st, &st.leave)
        if e == NULL or e.key >= st.vt:
            return 0
        s = e.slot
        evq_drop(&st.leave, e)
        unlazy(st, a, p, s)
        # Still running, holding its seat and blocks, until its last output lands.
        heap_push(&st.release, R(st, s).t_last, s, R(st, s).gen)


cdef inline int64_t lazy_demand(State* st, int64_t v) noexcept nogil:
    """Blocks the lazies need at vt ``v``: those whose context sits on a block boundary."""
    if st.n_grow == 0:
        return 0
    return st.hist[pmod(-v, st.P.bs)]

# ---------------------------------------------------------------------------
# Releasing finished requests (processing a batch's outputs)
# ---------------------------------------------------------------------------

cdef void release(State* st, Alloc* a, Pipe* p, int32_t s) noexcept nogil:
    cdef Req* q = R(st, s)
    if q.lazy:
        unlazy(st, a, p, s)
    if not st.unlimited:
        st.free_blocks += q.blocks
    q.blocks = 0
    q.status = S_FINISHED
    q.gen += 1
    ro_remove(st, s)


cdef void process(State* st, Alloc* a, Pipe* p, Batch* b) noexcept nogil:
    cdef int64_t i, got
    cdef int32_t s
    cdef Ev* e
    cdef Req* q
    for i in range(b.n_rel):
        s = b.rel[i]
        if R(st, s).status == S_RUNNING:
            release(st, a, p, s)
    if Pipe is AsyncPipe:
        # Tokens of requests that are explicit now land: placeholder -> output.
        for i in range(b.n_samp):
            s = b.samp[i].slot
            q = R(st, s)
            if q.gen == b.samp[i].gen and q.status == S_RUNNING and not q.lazy and q.ph > 0:
                got = imin(b.samp[i].key, q.ph)
                q.ph -= got
                q.outputs += got
                if q.outputs >= q.target:
                    # Only a snapshot's odd rows get here (engines release their
                    # finishes through `rel`): finish as the twin does.
                    if not q.prefilled:
                        ex_remove(st, s)
                    release(st, a, p, s)
    for i in range(b.n_stale):
        s = b.stale[i]
        q = R(st, s)
        if q.status != S_WAITING:
            continue
        if b.stale_tok[i] > 0:
            # Preempted while its token was in flight: it still receives it.
            q.outputs += b.stale_tok[i]
            if q.outputs >= q.target:
                q.status = S_FINISHED
                q.gen += 1
                wq_remove(st, s)
    if b.vt > -2:
        while True:
            e = evq_top(st, &st.release)
            if e == NULL or e.key > b.vt:
                break
            s = e.slot
            evq_drop(&st.release, e)
            if R(st, s).status == S_RUNNING:
                release(st, a, p, s)
    b.active = False


cdef inline Batch* ring_new(State* st) noexcept nogil:
    cdef Batch* b = &st.ring[(st.ring_head + st.ring_n) % 3]
    st.ring_n += 1
    b.vt = -2
    b.n_rel = 0
    b.n_stale = 0
    b.n_samp = 0
    b.nsched = 0
    b.pre = 0
    b.dec = 0
    b.dctx = 0
    b.patt = 0
    b.admitted = 0
    b.preempted = 0
    b.active = True
    b.sampled_any = False
    return b


cdef inline Batch* ring_prev(State* st) noexcept nogil:
    """While a batch is being formed: the one still in flight (async), or NULL."""
    if st.ring_n < 2:
        return NULL
    return &st.ring[st.ring_head]


cdef inline void ring_pop(State* st, Alloc* a, Pipe* p) noexcept nogil:
    process(st, a, p, &st.ring[st.ring_head])
    if st.slow_until_b0 and st.ring[st.ring_head].vt == -1:
        st.b0_done = True
    st.ring_head = (st.ring_head + 1) % 3
    st.ring_n -= 1

# ---------------------------------------------------------------------------
# Exact per-request scheduling (the twin's algorithm)
# ---------------------------------------------------------------------------

cdef void materialize(State* st, Alloc* a, Pipe* p) noexcept nogil:
    cdef int64_t i
    cdef int32_t s
    if st.materialized:
        return
    # The exact step costs O(running): materialising, serving in order, folding
    # back (lazify and unlazy count their own heap events).
    st.work += 2 * st.ro_n
    for i in range(st.ro_n):
        s = st.ro[i]
        if s >= 0 and R(st, s).lazy:
            unlazy(st, a, p, s)
    st.materialized = True


cdef inline int64_t reserve_tokens(State* st, Alloc* a, Req* q) noexcept nogil:
    if Alloc is WholePrompt:
        return q.prompt + q.outputs
    elif Alloc is MaxLength:
        return q.prompt + q.limit
    else:
        return 0


cdef inline bint fits(State* st, Count* c, Batch* b, int64_t n, int64_t longest) noexcept nogil:
    if Count is PaddedCount:
        return (b.nsched + 1) * imax(longest, n) <= st.P.token_budget
    else:
        return True


cdef void preempt(State* st, Alloc* a, Pipe* p, Batch* b, int32_t s) noexcept nogil:
    cdef Req* q = R(st, s)
    cdef Batch* prev
    cdef int64_t tok = q.ph  # tokens the batch in flight carries for it
    if not st.unlimited:
        st.free_blocks += q.blocks
    q.blocks = 0
    q.computed = 0
    q.ph = 0
    q.prefilled = 0
    q.status = S_WAITING
    q.gen += 1
    if not st.P.keep_outputs:
        q.outputs = 0
    if Pipe is AsyncPipe:
        if q.last_sched == st.step - 1:
            prev = ring_prev(st)
            if prev != NULL:
                prev.stale[prev.n_stale] = s
                prev.stale_tok[prev.n_stale] = tok
                prev.n_stale += 1
    if st.P.requeue_front:
        wq_push_front(st, s)
    else:
        wq_push_back(st, s)
    b.preempted += 1


cdef int32_t ro_last(State* st) noexcept nogil:
    return st.ro[st.ro_n - 1] if st.ro_n > 0 else -1


cdef int64_t unschedule(State* st, Batch* b, int32_t s) noexcept nogil:
    """Drop s from the batch being formed; return the tokens it had (0: none)."""
    cdef int64_t i, j, n
    st.work += st.n_sched >> 2  # a scan and a shift of four arrays
    for i in range(st.n_sched):
        if st.sched[i] == s:
            R(st, s).in_batch = -1
            n = st.sched_n[i]
            for j in range(i, st.n_sched - 1):
                st.sched[j] = st.sched[j + 1]
                st.sched_n[j] = st.sched_n[j + 1]
                st.sched_dec[j] = st.sched_dec[j + 1]
                st.sched_ctx[j] = st.sched_ctx[j + 1]
            st.n_sched -= 1
            b.nsched -= 1
            return n
    return 0


cdef inline int64_t sched_longest(State* st) noexcept nogil:
    cdef int64_t i, m = 0
    for i in range(st.n_sched):
        m = imax(m, st.sched_n[i])
    return m


cdef bint grow(State* st, Alloc* a, Pipe* p, Batch* b, int32_t s, int64_t n,
               int64_t* budget) noexcept nogil:
    """Allocate blocks for n more tokens of running request s, preempting if needed.

    A victim already scheduled in this batch (by an earlier stage) gives its
    tokens back to ``budget``.
    """
    cdef Req* q = R(st, s)
    cdef bint one_free = st.P.one_free and q.prefilled
    cdef int64_t need
    cdef int32_t victim
    while True:
        need = imax(cdiv(q.computed + n, st.P.bs) - q.blocks, 0)
        if st.unlimited or imax(need, <int64_t>one_free) <= st.free_blocks:
            q.blocks += need
            if not st.unlimited:
                st.free_blocks -= need
            return True
        if not st.P.victim_newest:
            return False
        victim = ro_last(st)
        ro_remove(st, victim)
        if R(st, victim).prefilled == 0:
            ex_remove(st, victim)
        if victim != s:
            budget[0] += unschedule(st, b, victim)
        preempt(st, a, p, b, victim)
        if victim == s:
            return False


cdef inline void sched_add(State* st, Batch* b, int32_t s, int64_t n) noexcept nogil:
    cdef Req* q = R(st, s)
    q.in_batch = st.step
    st.sched[st.n_sched] = s
    st.sched_n[st.n_sched] = n
    st.sched_dec[st.n_sched] = q.prefilled
    st.sched_ctx[st.n_sched] = q.computed
    st.n_sched += 1
    b.nsched += 1


cdef inline int64_t running_want(State* st, Req* q, int64_t cap, int64_t budget) noexcept nogil:
    cdef int64_t n = q.prompt + q.outputs + q.ph - q.computed
    if 0 < cap < n:
        n = cap
    n = imin(n, budget)
    if st.P.mml:
        n = imin(n, st.P.mml - q.computed - 1)
    return n


cdef int64_t serve_exact(State* st, Alloc* a, Pipe* p, Count* c, Batch* b,
                         int64_t budget, int64_t cap, int32_t stage, int64_t* longest) noexcept nogil:
    """The running stage over the materialised running list, in order."""
    cdef int64_t i = 0, n
    cdef int32_t s
    cdef Req* q
    while i < st.ro_n and budget > 0:
        s = st.ro[i]
        if s < 0:
            i += 1
            continue
        q = R(st, s)
        if (stage == STAGE_DECODES and not q.prefilled) or (stage == STAGE_PREFILLS and q.prefilled) \
                or q.in_batch == st.step:
            i += 1
            continue
        if q.ph > 0 and q.outputs + q.ph >= q.limit:
            i += 1
            continue
        n = running_want(st, q, cap, budget)
        if n <= 0 or not fits(st, c, b, n, longest[0]):
            i += 1
            continue
        pre = b.preempted
        if not grow(st, a, p, b, s, n, &budget):
            if Count is PaddedCount:
                if b.preempted != pre:
                    longest[0] = sched_longest(st)
            break
        if Count is PaddedCount:
            if b.preempted != pre:
                # A victim scheduled earlier in this batch left it: the padded
                # width is the longest chunk still in it.
                longest[0] = sched_longest(st)
        sched_add(st, b, s, n)
        longest[0] = imax(longest[0], n)
        budget -= n
        i += 1
    return budget


cdef int64_t serve_prefills(State* st, Alloc* a, Pipe* p, Count* c, Batch* b,
                            int64_t budget, int64_t cap, int64_t* longest) noexcept nogil:
    """Partial prefills in running order; split_fast_ok ruled out preemptions."""
    cdef int64_t i = 0, n
    cdef int32_t s
    cdef Req* q
    while i < st.n_ex and budget > 0:
        s = st.ex[i]
        q = R(st, s)
        i += 1
        if q.in_batch == st.step:
            continue  # admitted earlier in this batch
        n = running_want(st, q, cap, budget)
        if n <= 0 or not fits(st, c, b, n, longest[0]):
            continue
        grow(st, a, p, b, s, n, &budget)
        sched_add(st, b, s, n)
        longest[0] = imax(longest[0], n)
        budget -= n
    return budget


cdef bint reserve(State* st, Alloc* a, Req* q, int64_t n) noexcept nogil:
    cdef int64_t wm = 0, full, need
    if st.unlimited:
        return True
    if st.P.wm_applies == WM_ALWAYS or (st.P.wm_applies == WM_WHILE_RUNNING and st.n_running > 0):
        wm = st.P.wm_blocks
    if st.P.reserve_full:
        full = q.prompt + q.outputs
        if st.P.mml:
            full = imin(full, st.P.mml)
        if cdiv(full, st.P.bs) + wm > st.free_blocks:
            return False
    need = imax(cdiv(n, st.P.bs), cdiv(reserve_tokens(st, a, q), st.P.bs))
    if need + wm > st.free_blocks:
        return False
    q.blocks = need
    st.free_blocks -= need
    return True


cdef int64_t admit(State* st, Alloc* a, Pipe* p, Count* c, Batch* b,
                   int64_t budget, int64_t cap, int64_t* longest) noexcept nogil:
    cdef int64_t n_skipped = 0, n, i
    cdef int32_t s
    cdef Req* q
    cdef bint blocked
    while budget > 0 and st.wq_n > 0:
        if st.n_running >= st.P.max_seqs:
            break
        s = wq_at(st, 0)
        if s == st.new_slot:
            st.new_seen = True
        q = R(st, s)
        if Pipe is AsyncPipe:
            if q.last_sched == st.step - 1:
                # Preempted with output still in flight: skip, do not block.
                st.tmp[n_skipped] = wq_pop_front(st)
                n_skipped += 1
                continue
        n = q.prompt + q.outputs
        if 0 < cap < n:
            n = cap
        blocked = (not st.P.chunked and n > budget) or not fits(st, c, b, imin(n, budget), longest[0])
        if not blocked:
            n = imin(n, budget)
            blocked = not reserve(st, a, q, n)
        if blocked:
            if st.P.stop_on_blocked:
                break
            st.tmp[n_skipped] = wq_pop_front(st)
            n_skipped += 1
            continue
        wq_pop_front(st)
        q.status = S_RUNNING
        q.gen += 1
        ro_append(st, s)
        ex_insert_ordered(st, s)
        sched_add(st, b, s, n)
        longest[0] = imax(longest[0], n)
        b.admitted += 1
        budget -= n
    for i in range(n_skipped - 1, -1, -1):
        wq_push_front(st, st.tmp[i])
    return budget

# ---------------------------------------------------------------------------
# One schedule() call
# ---------------------------------------------------------------------------

cdef inline int64_t eff_cap(State* st) noexcept nogil:
    if st.P.chunk_cap and st.P.cap_exempt_alone and st.n_running + st.wq_n <= 1:
        return 0
    return st.P.chunk_cap


cdef bint lazies_fit(State* st, int64_t extra_blocks) noexcept nogil:
    """Can every lazy decode (plus extra_blocks of other requests) be served now?"""
    cdef int64_t d
    if st.unlimited:
        return True
    d = lazy_demand(st, st.vt) + extra_blocks
    if st.P.one_free and st.n_lazy > 0:
        return d < st.free_blocks
    return d <= st.free_blocks


cdef void serve_lazies(State* st, Batch* b) noexcept nogil:
    cdef int64_t d
    if st.n_lazy == 0:
        return
    if not st.unlimited:
        d = lazy_demand(st, st.vt)
        st.free_blocks -= d
    b.dec += st.n_lazy
    b.dctx += st.s_base + st.n_lazy * st.vt
    b.nsched += st.n_lazy
    b.sampled_any = True


cdef bint running_fast_ok(State* st, Count* c, Batch* b, int64_t budget, int64_t cap,
                          int64_t longest) noexcept nogil:
    """Mixed running stage: can it be formed without knowing where each decode sits?

    Yes when every request gets what it wants, or when the budget runs out at
    a prefill chunk that no lazy decode follows in running order (the usual
    vLLM steady state: the newest prefill takes the rest of the budget). The
    grants go to st.grant, one per entry of st.ex.
    """
    cdef int64_t i, j, n, tok = st.n_lazy, blk = 0, lg = longest, cnt = st.n_lazy
    cdef int64_t cut = -1
    cdef Req* q
    if st.force_slow or st.n_lazy > budget:
        return False
    for i in range(st.n_ex):
        q = R(st, st.ex[i])
        n = running_want(st, q, cap, budget)  # the full want; totals are checked below
        if q.in_batch == st.step:
            n = 0  # admitted earlier in this batch
        if cut >= 0 or n <= 0:
            st.grant[i] = 0
            continue
        if tok + n > budget:
            n = budget - tok
            if n <= 0:
                return False  # the budget ran out somewhere among the decodes
            cut = i
        st.grant[i] = n
        tok += n
        blk += imax(cdiv(q.computed + n, st.P.bs) - q.blocks, 0)
        lg = imax(lg, n)
        cnt += 1
    if cut >= 0 and st.n_lazy > 0:
        # Decodes after the cut would go unserved: only the exact path knows which.
        for j in range(R(st, st.ex[cut]).ro_pos + 1, st.ro_n):
            if st.ro[j] >= 0 and R(st, st.ro[j]).lazy:
                return False
    if not lazies_fit(st, blk):
        return False
    if Count is PaddedCount:
        if cnt > 0 and (b.nsched + cnt) * imax(lg, 1) > st.P.token_budget:
            return False
    return True


cdef bint split_fast_ok(State* st, Count* c, Batch* b, int64_t budget, int64_t cap) noexcept nogil:
    """Decodes then partial prefills: can both stages run without a preemption?"""
    cdef int64_t i, n, blk = 0, d
    cdef Req* q
    if st.force_slow or st.n_lazy > budget:
        return False
    if Count is PaddedCount:
        return False  # no built-in combines these; take the exact path
    if not lazies_fit(st, 0):
        return False
    budget -= st.n_lazy
    for i in range(st.n_ex):
        if budget <= 0:
            break
        q = R(st, st.ex[i])
        if q.in_batch == st.step:
            continue
        n = running_want(st, q, cap, budget)
        if n <= 0:
            continue
        blk += imax(cdiv(q.computed + n, st.P.bs) - q.blocks, 0)
        budget -= n
    if st.unlimited or blk == 0:
        return True
    d = lazy_demand(st, st.vt)
    return blk + d <= st.free_blocks


cdef int64_t serve_running_fast(State* st, Alloc* a, Pipe* p, Count* c, Batch* b,
                                int64_t budget, int64_t cap, int64_t* longest) noexcept nogil:
    """Mixed running stage once running_fast_ok holds (grants in st.grant)."""
    cdef int64_t i, n, tok = st.n_lazy
    cdef int32_t s
    serve_lazies(st, b)
    if st.n_lazy:
        longest[0] = imax(longest[0], 1)
    for i in range(st.n_ex):
        s = st.ex[i]
        n = st.grant[i]
        if n <= 0:
            continue
        grow(st, a, p, b, s, n, &budget)
        sched_add(st, b, s, n)
        longest[0] = imax(longest[0], n)
        tok += n
    return budget - tok


cdef int relazify(State* st, Alloc* a, Pipe* p, Batch* b) except -1 nogil:
    """After an exact step: fold decodes back into the aggregate, rebuild `ex`."""
    cdef int64_t i
    cdef int32_t s
    cdef Req* q
    cdef Batch* prev
    st.n_ex = 0
    for i in range(st.ro_n):
        s = st.ro[i]
        if s < 0:
            continue
        q = R(st, s)
        if q.lazy:
            continue
        if not q.prefilled:
            st.ex[st.n_ex] = s
            st.n_ex += 1
            continue
        if q.last_sched == st.step:
            continue   # scheduled in this batch: after_schedule handles it
        # Not served in this batch. Pending = delivered + in flight.
        if q.outputs + q.ph >= q.target:
            # Every output is sampled: a zombie until the batch in flight
            # delivers its last token (it is never served again, not even an
            # unannounced stop's wasted token: that batch lands first).
            if q.ph > 0:
                prev = ring_prev(st)
                prev.rel[prev.n_rel] = s
                prev.n_rel += 1
            continue
        lazify(st, a, p, s, q.outputs + q.ph)
    st.materialized = False
    return 0


cdef int after_schedule(State* st, Alloc* a, Pipe* p, Batch* b) except -1 nogil:
    cdef int64_t i, n, c, pending
    cdef int32_t s
    cdef Req* q
    cdef Batch* prev
    cdef int rc
    for i in range(st.n_sched):
        s = st.sched[i]
        n = st.sched_n[i]
        c = st.sched_ctx[i]
        q = R(st, s)
        if st.sched_dec[i]:
            b.dec += n
            b.dctx += c * n
        else:
            b.pre += n
            b.patt += n * c + n * (n + 1) // 2
        q.computed += n
        q.last_sched = st.step
        if q.computed >= q.prompt + q.outputs + q.ph:
            b.sampled_any = True
            if not q.prefilled:
                q.prefilled = 1
                ex_remove(st, s)
            if s == st.new_slot:
                st.new_tok_b = True
            if Pipe is AsyncPipe:
                q.ph += 1
                pending = q.outputs + q.ph
                samp_add(b, s, q.gen, 1)
            else:
                pending = q.outputs + 1
            rc = lazify(st, a, p, s, pending)
            if rc == 1:
                if pending > q.target:
                    # A wasted token past an unannounced stop: the batch in
                    # flight delivers its real last token.
                    prev = ring_prev(st)
                    prev.rel[prev.n_rel] = s
                    prev.n_rel += 1
                else:
                    b.rel[b.n_rel] = s
                    b.n_rel += 1
    return 0


cdef int schedule(State* st, Alloc* a, Pipe* p, Count* c, Batch* b) except -1 nogil:
    cdef int64_t budget = st.P.token_budget
    cdef int64_t cap = eff_cap(st)
    cdef int64_t longest = 0
    cdef int32_t i, stage
    cdef bint served_running = False
    st.n_sched = 0
    st.unlazy_batch = ring_prev(st)
    pop_leaves(st, a, p)
    for i in range(st.P.n_stages):
        stage = st.P.stages[i]
        if stage == STAGE_WAITING:
            if b.preempted and not st.P.admit_after_preemption:
                continue
            budget = admit(st, a, p, c, b, budget, cap, &longest)
        else:
            served_running = True
            if not st.materialized:
                if stage == STAGE_RUNNING:
                    if not running_fast_ok(st, c, b, budget, cap, longest):
                        materialize(st, a, p)
                elif stage == STAGE_DECODES:
                    if not split_fast_ok(st, c, b, budget, cap):
                        materialize(st, a, p)
            if st.materialized:
                budget = serve_exact(st, a, p, c, b, budget, cap, stage, &longest)
            elif stage == STAGE_RUNNING:
                budget = serve_running_fast(st, a, p, c, b, budget, cap, &longest)
            elif stage == STAGE_DECODES:
                serve_lazies(st, b)
                budget -= st.n_lazy
                if st.n_lazy:
                    longest = imax(longest, 1)
            else:
                budget = serve_prefills(st, a, p, c, b, budget, cap, &longest)
        if st.P.exclusive and b.nsched > 0:
            break
    # Lazies were served iff a running stage ran (exclusive: only in decode batches).
    if served_running or not st.P.exclusive:
        b.vt = st.vt
        st.vt += 1
    after_schedule(st, a, p, b)
    # Every batch walks what it scheduled and scans the partial prefills.
    st.work += 1 + st.n_sched + (st.n_ex >> 4)
    if st.materialized:
        relazify(st, a, p, b)
        if st.b0_done:
            # The in-flight tokens that only the exact path models were
            # delivered before this step, which folded every request back into
            # the aggregate: from here on it applies.
            st.force_slow = False
            st.slow_until_b0 = False
            st.b0_done = False
    st.unlazy_batch = NULL
    return 0

# ---------------------------------------------------------------------------
# Closed-form runs of identical decode-only batches
# ---------------------------------------------------------------------------

cdef bint admission_stuck(State* st, Alloc* a, Count* c, int64_t budget) noexcept nogil:
    """Would the waiting stage admit nothing, for a reason only a release can lift?"""
    cdef Req* q
    cdef int64_t n, wm = 0, full, need, before
    if budget <= 0 or st.wq_n == 0:
        return True
    if st.n_running >= st.P.max_seqs:
        return True
    if not st.P.stop_on_blocked:
        return False
    if wq_at(st, 0) == st.new_slot:
        st.new_seen = True
    q = R(st, wq_at(st, 0))
    n = q.prompt + q.outputs
    if 0 < eff_cap(st) < n:
        n = eff_cap(st)
    if not st.P.chunked and n > budget:
        return True
    if Count is PaddedCount:
        # Decodes are in the batch before admissions unless the waiting stage comes first.
        before = st.n_lazy if st.P.stages[0] != STAGE_WAITING else 0
        if (before + 1) * imax(imin(n, budget), 1 if before else 0) > st.P.token_budget:
            return True
    if st.unlimited:
        return False
    n = imin(n, budget)
    if st.P.wm_applies == WM_ALWAYS or (st.P.wm_applies == WM_WHILE_RUNNING and st.n_running > 0):
        wm = st.P.wm_blocks
    if st.P.reserve_full:
        full = q.prompt + q.outputs
        if st.P.mml:
            full = imin(full, st.P.mml)
        if cdiv(full, st.P.bs) + wm > st.free_blocks:
            return True
    need = imax(cdiv(n, st.P.bs), cdiv(reserve_tokens(st, a, q), st.P.bs))
    return need + wm > st.free_blocks


cdef int64_t demand_over(State* st, int64_t v0, int64_t m) noexcept nogil:
    cdef int64_t full = m // st.P.bs, rem = m % st.P.bs, d, j
    if st.n_grow == 0:
        return 0
    d = full * st.n_grow
    for j in range(rem):
        d += st.hist[pmod(-(v0 + full * st.P.bs + j), st.P.bs)]
    return d


cdef int64_t kv_run_limit(State* st, int64_t m) noexcept nogil:
    """Largest m' <= m such that every batch of the run passes its KV check."""
    cdef int64_t lim, periods, mm, d, v
    if st.unlimited or st.n_grow == 0:
        if st.P.one_free and not st.unlimited and st.free_blocks < 1:
            return 0
        return m
    # Cumulative demand D(m') must stay <= lim (one-free: every batch needs a
    # spare block after its own demand).
    lim = st.free_blocks - (1 if st.P.one_free else 0)
    if lim < 0:
        return 0
    periods = lim // st.n_grow
    if periods * st.P.bs >= m:
        return m
    mm = periods * st.P.bs
    d = periods * st.n_grow
    v = st.vt + mm
    while mm < m:
        d += st.hist[pmod(-v, st.P.bs)]
        if d > lim:
            break
        mm += 1
        v += 1
    return mm


cdef int log_batch(State* st, Batch* b, double dt) except -1 nogil:
    mem_reserve(<void**>&st.log, &st.cap_log, st.n_log + 8, 64, sizeof(int64_t))
    st.log[st.n_log] = b.nsched
    st.log[st.n_log + 1] = b.pre
    st.log[st.n_log + 2] = b.dec
    st.log[st.n_log + 3] = b.dctx
    st.log[st.n_log + 4] = b.patt
    st.log[st.n_log + 5] = b.admitted
    st.log[st.n_log + 6] = b.preempted
    (<double*>&st.log[st.n_log + 7])[0] = dt
    st.n_log += 8
    return 0


cdef inline double run_first_batch_s(State* st) noexcept nogil:
    """Eq. 12 time of a closed-form run's first batch: the lazies alone at st.vt."""
    return (st.c.b0 + st.c.b1 * fmax(<double>st.n_lazy, st.c.tau)
            + st.c.b2 * (st.s_base + st.n_lazy * st.vt) + st.c.b2s * st.n_lazy)


cdef inline int64_t run_limit_before(State* st, int64_t m, double until) noexcept nogil:
    """Cap a closed-form run so that it ends before ``until``, with a margin.

    The run's batch j costs a + g * j (contexts grow by n_lazy per batch), so
    m batches cost m * a + g * m * (m - 1) / 2; the largest m that stays within
    the time left solves a quadratic. Two batches short of it, the ordinary
    path meets ``until`` batch by batch, exactly where the twin does
    (summation order only moves the crossing by rounding, far below a batch).
    """
    cdef double left, a, g, p, disc, bound
    if until == INFINITY or m <= 0:
        return m
    left = until - st.t
    if left <= 0.0:
        return 0
    a = run_first_batch_s(st)
    g = st.c.b2 * st.n_lazy
    p = a - g / 2.0
    disc = p * p + 2.0 * g * left
    if p + sqrt(disc) <= 0.0:
        return m  # batches that cost nothing never reach it
    bound = floor(2.0 * left / (p + sqrt(disc))) - 2.0
    if bound < <double>m:
        return imax(<int64_t>bound, 0)
    return m


cdef int64_t try_run(State* st, Alloc* a, Pipe* p, Count* c, int64_t max_batches) except -1 nogil:
    """Advance over identical decode-only batches in closed form; return how many."""
    cdef int64_t m, budget, j, v
    cdef Ev* e
    cdef Batch* prev
    cdef Batch* b
    cdef double dt
    cdef bint follow
    cdef int64_t depth = 2 if Pipe is AsyncPipe else 1
    if st.materialized or st.force_slow or st.n_ex > 0 or st.n_lazy == 0:
        return 0
    if st.P.n_stages == 0:
        return 0
    prev = &st.ring[st.ring_head] if st.ring_n >= 1 else NULL
    if prev != NULL and (prev.n_rel > 0 or prev.n_stale > 0):
        return 0
    # The batch is the lazies alone, and admissions stay blocked.
    budget = st.P.token_budget
    if st.P.stages[0] != STAGE_WAITING:
        budget -= st.n_lazy
    if not admission_stuck(st, a, c, budget):
        return 0
    if st.n_lazy > st.P.token_budget:
        return 0
    m = max_batches - st.k
    e = evq_top(st, &st.leave)
    if e != NULL:
        m = imin(m, e.key - st.vt + 1)
    e = evq_top(st, &st.release)
    if e != NULL:
        m = imin(m, e.key + depth - st.vt)
    m = kv_run_limit(st, m)
    m = run_limit_before(st, m, st.horizon)
    follow = st.n_tok > 0 and R(st, st.new_slot).lazy
    if follow:
        # Each batch of the run samples the new request's next token: stop at
        # the last one wanted (the ordinary path then takes that batch).
        m = imin(m, st.want - st.n_tok)
    if st.pending_new:
        # Its arrival is met batch by batch too (a batch scheduled at or after
        # it sees the new request).
        m = run_limit_before(st, m, st.arrival)
    if st.ck_take and st.ck.terms.at > st.step:
        # A turn starts at the step whose state is to be kept.
        m = imin(m, st.ck.terms.at - st.step)
    if m < 2:
        return 0
    m -= 1  # leave the last batch to the ordinary path (it meets the event)
    if follow:
        # Batch by batch (at most next_tokens of them): each ends at a token.
        dt = 0.0
        for j in range(m):
            dt += st.c.b0 + st.c.b1 * fmax(<double>st.n_lazy, st.c.tau) \
                + st.c.b2 * <double>(st.s_base + st.n_lazy * (st.vt + j)) + st.c.b2s * st.n_lazy
            st.tok_k[st.n_tok] = st.k + j + 1
            st.tok_t[st.n_tok] = st.t + dt
            st.n_tok += 1
    else:
        # Sum eq. 12 over the run: contexts grow by n_lazy per batch.
        dt = m * run_first_batch_s(st) + st.c.b2 * st.n_lazy * (<double>m * (m - 1) / 2.0)
    if st.record:
        for j in range(m):
            v = st.vt + j
            b = ring_new(st)
            b.nsched = st.n_lazy
            b.dec = st.n_lazy
            b.dctx = st.s_base + st.n_lazy * v
            st.ring_n -= 1  # the record is all this batch leaves behind
            log_batch(st, b, st.c.b0 + st.c.b1 * fmax(<double>st.n_lazy, st.c.tau) + st.c.b2 * b.dctx
                      + st.c.b2s * st.n_lazy)
    if not st.unlimited:
        st.free_blocks -= demand_over(st, st.vt, m)
    st.t += dt
    st.k += m
    st.work += m if st.record else 1
    st.step += m
    st.vt += m
    # Async: the run's last batch is now the one in flight (the batches before it,
    # including one in flight before the run, were processed with no effect).
    if Pipe is AsyncPipe:
        if prev == NULL:
            prev = ring_new(st)
        prev.vt = st.vt - 1
        prev.n_rel = 0
        prev.n_stale = 0
        prev.n_samp = 0
        prev.nsched = st.n_lazy
        prev.sampled_any = True
    return m

# ---------------------------------------------------------------------------
# The engine loop
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# Resuming: a replay's state before it first examined the new request
# ---------------------------------------------------------------------------

cdef enum:
    # A turn this early saves less than taking its state costs.
    CK_MIN_STEP = 4


cdef void take_checkpoint(State* st) noexcept nogil:
    """Keep the state at this turn's top in ``st.ck``, for later replays to resume from.

    Until the scheduler first examines the new request (admission reaches it),
    nothing the replay did depended on it: its batches are those of any new
    request that joined the waiting queue at the same point. So a replay of
    the same prepared state, arrival, coefficients and replayer, with a horizon
    at or past this turn, may start here instead of at the snapshot: for a
    long queue ahead, most of its batches. Out of memory, nothing is kept.
    """
    cdef Checkpoint* ck = st.ck
    cdef int64_t i, n = st.n_slots
    cdef Batch* b
    ck.terms.status = CK_NONE
    if mem_try_copy(<void**>&ck.r, &ck.cap_r, st.src, n, sizeof(Req)) < 0:
        return
    for i in range(n):
        if st.epoch[i] == st.cur:
            ck.r[i] = st.r[i]
    if mem_try_copy(<void**>&ck.ro, &ck.cap_ro, st.ro, st.ro_n, sizeof(int32_t)) < 0:
        return
    if mem_try_copy(<void**>&ck.ex, &ck.cap_ex, st.ex, st.n_ex, sizeof(int32_t)) < 0:
        return
    if mem_try_reserve(<void**>&ck.wq, &ck.cap_wq, st.wq_n, sizeof(int32_t)) < 0:
        return
    for i in range(st.wq_n):
        ck.wq[i] = wq_at(st, i)
    if mem_try_copy(<void**>&ck.hist, &ck.cap_hist, st.hist, st.P.bs, sizeof(int64_t)) < 0:
        return
    if mem_try_copy(<void**>&ck.leave_heap, &ck.cap_leave, st.leave.heap, st.leave.n_heap,
                    sizeof(Ev)) < 0:
        return
    if mem_try_copy(<void**>&ck.release_heap, &ck.cap_release, st.release.heap,
                    st.release.n_heap, sizeof(Ev)) < 0:
        return
    ck.ring_n = st.ring_n
    if st.ring_n > 1:
        return  # (a turn's top holds at most the batch in flight)
    if st.ring_n == 1:
        b = &st.ring[st.ring_head]
        if mem_try_copy(<void**>&ck.b_rel, &ck.cap_b_rel, b.rel, b.n_rel, sizeof(int32_t)) < 0:
            return
        if mem_try_copy(<void**>&ck.b_stale, &ck.cap_b_stale, b.stale, b.n_stale,
                        sizeof(int32_t)) < 0:
            return
        if mem_try_copy(<void**>&ck.b_stale_tok, &ck.cap_b_stale_tok, b.stale_tok, b.n_stale,
                        sizeof(int64_t)) < 0:
            return
        if mem_try_copy(<void**>&ck.b_samp, &ck.cap_b_samp, b.samp, b.n_samp, sizeof(Ev)) < 0:
            return
        ck.b = b[0]
    ck.n_slots = n
    ck.ro_n = st.ro_n
    ck.n_running = st.n_running
    ck.n_ex = st.n_ex
    ck.wq_n = st.wq_n
    ck.n_lazy = st.n_lazy
    ck.s_base = st.s_base
    ck.n_grow = st.n_grow
    ck.leave_pos = st.leave.pos
    ck.n_leave_heap = st.leave.n_heap
    ck.release_pos = st.release.pos
    ck.n_release_heap = st.release.n_heap
    ck.free_blocks = st.free_blocks
    ck.vt = st.vt
    ck.k = st.k
    ck.work = st.work
    ck.terms.t = st.t
    ck.materialized = st.materialized
    ck.st_force_slow = st.force_slow
    ck.slow_until_b0 = st.slow_until_b0
    ck.b0_done = st.b0_done
    ck.terms.status = CK_TAKEN


cdef inline bint new_lazily_served(State* st, Batch* b) noexcept nogil:
    """Did batch b serve the new request as a lazy decode (one token)?

    A request folded back after this batch's exact step starts at the next vt,
    so a token is never counted twice.
    """
    cdef Req* q
    if st.n_tok == 0 or b.vt < 0:
        return False
    q = R(st, st.new_slot)
    return q.lazy and q.lazy_since <= b.vt <= q.served_until


cdef int run(State* st, Alloc* a, Pipe* p, Count* c, int64_t max_batches) except -1 nogil:
    cdef Batch* b
    cdef Batch* prev
    cdef double dt
    cdef int64_t depth = 2 if Pipe is AsyncPipe else 1
    cdef int64_t ran
    while True:
        if st.pending_new and st.t >= st.arrival:
            wq_push_back(st, st.new_slot)
            st.pending_new = False
            st.join_lo = st.t_before
            st.join_hi = st.t
        if not st.new_seen and not st.pending_new:
            if st.ck_take and st.step == st.ck.terms.at:
                st.ck_take = False
                take_checkpoint(st)
            st.top_step = st.step
        ran = try_run(st, a, p, c, max_batches)
        b = ring_new(st)
        schedule(st, a, p, c, b)
        st.step += 1
        if b.nsched > 0:
            st.k += 1
            dt = st.c.b0 + st.c.b1 * fmax(<double>(b.pre + b.dec), st.c.tau) + st.c.b2 * b.dctx \
                + st.c.b2s * b.dec + st.c.b3 * b.patt
            st.t_before = st.t
            st.t += dt
            if st.record:
                log_batch(st, b, dt)
            if st.new_tok_b or new_lazily_served(st, b):
                st.new_tok_b = False
                st.tok_k[st.n_tok] = st.k
                st.tok_t[st.n_tok] = st.t
                st.n_tok += 1
                st.horizon = INFINITY  # it bounds the first token only
                if st.n_tok >= st.want:
                    return R_FIRST_TOKEN
            if st.t > st.horizon:
                return R_HORIZON
            if st.k >= max_batches:
                return R_FIRST_TOKEN if st.n_tok else R_LIMIT
        else:
            prev = &st.ring[st.ring_head] if st.ring_n > 1 else NULL
            if prev == NULL or (prev.nsched == 0 and prev.n_rel == 0 and prev.n_stale == 0
                                and not prev.sampled_any):
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
        if st.work >= st.max_work:
            return R_FIRST_TOKEN if st.n_tok else R_LIMIT
        if st.ring_n < depth:
            continue
        ring_pop(st, a, p)


cdef int run_dispatch(int code, State* st, int64_t max_batches) except -1 nogil:
    # code = alloc * 4 + async * 2 + padded
    if code == 0:
        return run(st, <OnDemand*>NULL, <SyncPipe*>NULL, <TokenCount*>NULL, max_batches)
    elif code == 1:
        return run(st, <OnDemand*>NULL, <SyncPipe*>NULL, <PaddedCount*>NULL, max_batches)
    elif code == 2:
        return run(st, <OnDemand*>NULL, <AsyncPipe*>NULL, <TokenCount*>NULL, max_batches)
    elif code == 3:
        return run(st, <OnDemand*>NULL, <AsyncPipe*>NULL, <PaddedCount*>NULL, max_batches)
    elif code == 4:
        return run(st, <WholePrompt*>NULL, <SyncPipe*>NULL, <TokenCount*>NULL, max_batches)
    elif code == 5:
        return run(st, <WholePrompt*>NULL, <SyncPipe*>NULL, <PaddedCount*>NULL, max_batches)
    elif code == 6:
        return run(st, <WholePrompt*>NULL, <AsyncPipe*>NULL, <TokenCount*>NULL, max_batches)
    elif code == 7:
        return run(st, <WholePrompt*>NULL, <AsyncPipe*>NULL, <PaddedCount*>NULL, max_batches)
    elif code == 8:
        return run(st, <MaxLength*>NULL, <SyncPipe*>NULL, <TokenCount*>NULL, max_batches)
    elif code == 9:
        return run(st, <MaxLength*>NULL, <SyncPipe*>NULL, <PaddedCount*>NULL, max_batches)
    elif code == 10:
        return run(st, <MaxLength*>NULL, <AsyncPipe*>NULL, <TokenCount*>NULL, max_batches)
    else:
        return run(st, <MaxLength*>NULL, <AsyncPipe*>NULL, <PaddedCount*>NULL, max_batches)


cdef int lazify_dispatch(int code, State* st, int32_t s, int64_t pending) except -1 nogil:
    cdef int alloc = code // 4
    cdef bint is_async = (code // 2) % 2
    if alloc == 0:
        if is_async:
            return lazify(st, <OnDemand*>NULL, <AsyncPipe*>NULL, s, pending)
        return lazify(st, <OnDemand*>NULL, <SyncPipe*>NULL, s, pending)
    elif alloc == 1:
        if is_async:
            return lazify(st, <WholePrompt*>NULL, <AsyncPipe*>NULL, s, pending)
        return lazify(st, <WholePrompt*>NULL, <SyncPipe*>NULL, s, pending)
    else:
        if is_async:
            return lazify(st, <MaxLength*>NULL, <AsyncPipe*>NULL, s, pending)
        return lazify(st, <MaxLength*>NULL, <SyncPipe*>NULL, s, pending)


cdef bint table_in_range(const int64_t[:, ::1] T) noexcept:
    """bearsdk.replay.types.check_table's test at C speed (it formats the error)."""
    cdef int64_t i, j, v, hi = _MAX_TOKENS_PY
    cdef int64_t lo[7]
    lo[:] = [0, 1, 0, 0, -hi, -hi, 0]
    for i in range(T.shape[0]):
        for j in range(7):
            v = T[i, j]
            if v < lo[j] or v > hi:
                return False
        if T[i, 0] > 1:
            return False
        if T[i, 0] == STATE_RUNNING_C and T[i, 2] > T[i, 1] + T[i, 3] + T[i, 6]:
            return False
    return True


cdef int ev_cmp(const void* x, const void* y) noexcept nogil:
    cdef Ev* a = <Ev*>x
    cdef Ev* b = <Ev*>y
    if a.key != b.key:
        return -1 if a.key < b.key else 1
    return -1 if a.slot < b.slot else (1 if a.slot > b.slot else 0)

# ---------------------------------------------------------------------------
# Python-facing classes
# ---------------------------------------------------------------------------

cdef inline void new_epoch(State* st, Req* src) noexcept nogil:
    """Every request is copied from ``src`` on its first touch from here on."""
    st.src = src
    st.cur += 1
    if st.cur == 0x7fffffff:
        memset(st.epoch, 0, sizeof(int32_t) * st.cap)
        st.cur = 1


cdef inline void load_lists(State* st, const int32_t* ro, int64_t ro_n, int64_t n_running,
                            const int32_t* ex, int64_t n_ex, const int32_t* wq, int64_t wq_n,
                            const int64_t* hist, int64_t n_lazy, int64_t s_base,
                            int64_t n_grow) noexcept nogil:
    """The running order, the prefilling and waiting lists and the decode
    aggregate, from a prepared snapshot or a checkpoint."""
    memcpy(st.ro, ro, sizeof(int32_t) * ro_n)
    st.ro_n = ro_n
    st.n_running = n_running
    memcpy(st.ex, ex, sizeof(int32_t) * n_ex)
    st.n_ex = n_ex
    memcpy(st.wq, wq, sizeof(int32_t) * wq_n)
    st.wq_head = 0
    st.wq_n = wq_n
    memcpy(st.hist, hist, sizeof(int64_t) * st.P.bs)
    st.n_lazy = n_lazy
    st.s_base = s_base
    st.n_grow = n_grow


cdef class Prepared:
    """A snapshot's requests, ready to replay with one compiled policy.

    Built once per snapshot by :meth:`Replayer.prepare`; every replay starts
    from a copy of this state (a few memcpy's), so preparing is where the
    per-snapshot work (output lengths, decode aggregates, event ordering) goes.
    """

    cdef Req* r
    cdef int64_t n
    cdef int32_t* ro
    cdef int64_t ro_n
    cdef int32_t* ex
    cdef int64_t n_ex
    cdef int32_t* wq
    cdef int64_t wq_n
    cdef int64_t* hist
    cdef int64_t bs
    cdef int64_t n_lazy
    cdef int64_t s_base
    cdef int64_t n_grow
    cdef Ev* leave
    cdef int64_t n_leave
    cdef Ev* rel
    cdef int64_t n_rel
    cdef int32_t* b0_rel
    cdef int64_t n_b0_rel
    cdef int32_t* b0_samp  # prefilling requests with a token in the in-flight batch
    cdef int64_t n_b0_samp
    cdef bint exact        # rows the aggregate cannot model: replay on the exact path
    cdef bint exact_b0     # ... until the batch in flight at the snapshot is processed
    cdef int64_t free_blocks
    cdef bint unlimited
    cdef bint has_inflight
    cdef bint b0_sampled
    cdef object ids
    cdef int code
    cdef Checkpoint ck     # where replays of it may resume (take_checkpoint)

    def __cinit__(self):
        memset(&self.ck, 0, sizeof(Checkpoint))

    def __dealloc__(self):
        cdef Checkpoint* ck = &self.ck
        free(ck.r)
        free(ck.ro)
        free(ck.ex)
        free(ck.wq)
        free(ck.hist)
        free(ck.leave_heap)
        free(ck.release_heap)
        free(ck.b_rel)
        free(ck.b_stale)
        free(ck.b_stale_tok)
        free(ck.b_samp)
        free(self.r)
        free(self.ro)
        free(self.ex)
        free(self.wq)
        free(self.hist)
        free(self.leave)
        free(self.rel)
        free(self.b0_rel)
        free(self.b0_samp)

    def __len__(self):
        return self.n


cdef int64_t _serials = 0


cdef class Replayer:
    """Compiled replay of one bound policy (see :mod:`bearsdk.replay`)."""

    cdef Params P
    cdef int code
    cdef readonly object policy
    cdef State st
    cdef public bint force_slow
    cdef bint resume_on
    cdef object _apc
    cdef bint _last_apc
    cdef int64_t serial     # names it in the checkpoints it takes
    cdef bint resumed
    implementation = IMPLEMENTATION

    def __cinit__(self):
        memset(&self.st, 0, sizeof(State))

    def __init__(self, policy):
        # Every size below reaches a malloc or int64 arithmetic: bounded first.
        check_policy(policy)
        self.policy = policy
        p = policy
        read_policy(&self.P, p)
        alloc = {"on-demand": 0, "prompt": 1, "max-length": 2}[p.allocate]
        self.code = alloc * 4 + (2 if p.async_scheduling else 0) + (1 if p.budget_count == "padded" else 0)
        self.force_slow = False
        self.resume_on = True
        global _serials
        _serials += 1
        self.serial = _serials
        # A snapshot with its block pool replays block by block (_replay_apc_c).
        self._apc = _replay_apc_c.Replayer(p) if p.prefix_caching else None

    def __dealloc__(self):
        cdef State* st = &self.st
        free(st.r)
        free(st.epoch)
        free(st.ro)
        free(st.ex)
        free(st.wq)
        free(st.hist)
        free(st.leave.heap)
        free(st.release.heap)
        free(st.sched)
        free(st.sched_n)
        free(st.sched_dec)
        free(st.sched_ctx)
        free(st.tmp)
        free(st.grant)
        free(st.log)
        free(st.tok_k)
        free(st.tok_t)
        for i in range(3):
            free(st.ring[i].rel)
            free(st.ring[i].stale)
            free(st.ring[i].stale_tok)
            free(st.ring[i].samp)

    # -- preparation -----------------------------------------------------------

    def prepare(self, table, long long free_blocks=-1, ids=None, cache=None):
        """Turn a snapshot table (output lengths resolved) into replay state.

        Same contract as the pure-Python twin's ``prepare``: with ``cache`` (the
        snapshot's ``kv.prefix_cache``) a prefix-caching policy replays the
        snapshot's blocks one by one.
        """
        if cache is not None and self._apc is not None:
            return self._apc.prepare(table, free_blocks, ids, cache)
        tab = np.ascontiguousarray(table, dtype=np.int64)
        if tab.ndim != 2 or tab.shape[1] != NCOLS:
            raise ValueError(f"table must have shape (n, {NCOLS}) (got {tab.shape})")
        cdef const int64_t[:, ::1] T = tab
        if not table_in_range(T):
            check_table(tab)  # raises, naming the row, the column and the value
        cdef int64_t n = T.shape[0], i, held = 0, freed = 0, lim, target, need, n_run = 0
        for i in range(n):
            n_run += T[i, COL_STATE] == STATE_RUNNING_C
        check_running(self.policy, n_run)
        cdef bint is_async = (self.code // 2) % 2
        cdef int alloc = self.code // 4
        cdef Prepared pr = Prepared.__new__(Prepared)
        cdef Req* q
        cdef int64_t bs = self.P.bs
        cdef int64_t mml = self.P.mml
        cdef int32_t s
        cdef int rc
        cdef State tmp
        pr.ids = ids
        pr.code = self.code
        pr.n = n
        pr.bs = bs
        # Slots are int32 (and the new request takes one more).
        if n > 0x7fffffff - 16:
            raise ValueError(f"table has too many rows for one replay (got {n})")
        pr.r = <Req*>mem_alloc(n + 1, sizeof(Req))
        pr.ro = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.ex = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.wq = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.hist = <int64_t*>mem_alloc(bs, sizeof(int64_t))
        pr.b0_rel = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        pr.b0_samp = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
        memset(pr.hist, 0, sizeof(int64_t) * bs)
        memset(pr.r, 0, sizeof(Req) * (n + 1))
        pr.ro_n = pr.n_ex = pr.wq_n = pr.n_b0_rel = pr.n_b0_samp = 0
        pr.has_inflight = False
        pr.b0_sampled = False
        pr.exact = False
        pr.exact_b0 = False
        for i in range(n):
            if T[i, COL_OUTPUT_LEN] < 1:
                raise ValueError(
                    f"row {i}: output_len must be resolved before replay (got {T[i, COL_OUTPUT_LEN]})")
            q = &pr.r[i]
            self._init_req(q, T[i, COL_PROMPT], T[i, COL_OUTPUT], T[i, COL_OUTPUT_LEN], T[i, COL_MAX_TOKENS])
            q.ro_pos = -1
            q.last_sched = NEVER_SCHEDULED
            q.in_batch = -1
            if T[i, COL_STATE] == STATE_RUNNING:
                q.status = S_RUNNING
                q.computed = T[i, COL_COMPUTED]
                q.ph = T[i, COL_PLACEHOLDERS]
                need = q.prompt + q.outputs + q.ph - q.computed
                q.prefilled = (q.outputs + q.ph >= 1) and need <= 1
                if need <= 0:
                    # Every token computed, placeholders included: vLLM schedules
                    # nothing for it, ever; the decode aggregate assumes one token
                    # per batch, so only the exact path models it.
                    pr.exact = True
                q.blocks = cdiv(q.computed, bs)
                if alloc == 2 or (alloc == 1 and not q.prefilled):
                    q.blocks = imax(q.blocks, cdiv(self._reserve(q, alloc), bs))
                held += q.blocks
                if q.ph and not is_async:
                    q.outputs += q.ph
                    q.ph = 0
                    if q.outputs >= q.target:
                        freed += q.blocks
                        q.status = S_FINISHED
                        continue
                if q.ph > 0:
                    pr.has_inflight = True
                    q.last_sched = -1  # scheduled in the in-flight batch (step -1)
                if q.ph > 1:
                    # Several tokens in flight (speculative decoding, or a forged
                    # snapshot) may overshoot the request's end; only the exact
                    # path serves the wasted token an engine schedules then
                    # (until the batch in flight has landed).
                    pr.exact_b0 = True
                q.ro_pos = <int32_t>pr.ro_n
                pr.ro[pr.ro_n] = <int32_t>i
                pr.ro_n += 1
            else:
                q.status = S_WAITING
                pr.wq[pr.wq_n] = <int32_t>i
                pr.wq_n += 1
        p = self.policy
        pr.unlimited = p.num_blocks == 0 and free_blocks < 0
        if free_blocks < 0:
            free_blocks = 0 if pr.unlimited else p.num_blocks - p.reserved_blocks - held
            if free_blocks < 0:
                raise ValueError(
                    f"running requests hold {held} KV blocks, more than the pool of {p.num_blocks} "
                    f"minus {p.reserved_blocks} reserved")
        else:
            free_blocks += freed
        pr.free_blocks = free_blocks
        # Fold decodes into the aggregate, as seen by the first batch (vt 0).
        memset(&tmp, 0, sizeof(State))
        tmp.P = &self.P
        tmp.r = pr.r
        tmp.src = pr.r
        tmp.hist = pr.hist
        tmp.vt = 0
        tmp.step = 0
        try:
            tmp.epoch = <int32_t*>mem_alloc(n + 1, sizeof(int32_t))
            memset(tmp.epoch, 0, sizeof(int32_t) * (n + 1))  # == tmp.cur: in place
            for i in range(pr.ro_n):
                s = pr.ro[i]
                q = &pr.r[s]
                q.gen = 0
                if not q.prefilled:
                    if q.ph > 0:
                        # A placeholder on a request still prefilling (no engine
                        # reports one): the in-flight batch delivers its token,
                        # which only the exact path models.
                        pr.b0_samp[pr.n_b0_samp] = s
                        pr.n_b0_samp += 1
                        pr.b0_sampled = True
                        pr.exact_b0 = True
                    pr.ex[pr.n_ex] = s
                    pr.n_ex += 1
                    continue
                rc = lazify_dispatch(self.code, &tmp, s, q.outputs + q.ph)
                if rc == 1:
                    # Its last token is in the batch in flight at the snapshot.
                    pr.b0_rel[pr.n_b0_rel] = s
                    pr.n_b0_rel += 1
                if q.ph > 0:
                    pr.b0_sampled = True
        finally:
            free(tmp.epoch)
            # The heaps' contents become the sorted per-snapshot arrays (pr owns
            # them from here, also when lazify ran out of memory half-way).
            pr.leave = tmp.leave.heap
            pr.n_leave = tmp.leave.n_heap
            pr.rel = tmp.release.heap
            pr.n_rel = tmp.release.n_heap
        pr.n_lazy = tmp.n_lazy
        pr.s_base = tmp.s_base
        pr.n_grow = tmp.n_grow
        if pr.n_leave:
            qsort(pr.leave, pr.n_leave, sizeof(Ev), ev_cmp)
        if pr.n_rel:
            qsort(pr.rel, pr.n_rel, sizeof(Ev), ev_cmp)
        return pr

    cdef void _init_req(self, Req* q, int64_t prompt, int64_t outputs, int64_t output_len,
                        int64_t max_tokens):
        cdef int64_t lim = output_limit(&self.P, prompt, max_tokens)
        q.prompt = prompt
        q.outputs = outputs
        q.limit = lim
        q.target = output_target(lim, outputs, output_len)
        q.eos = q.target < lim

    cdef int64_t _reserve(self, Req* q, int alloc):
        if alloc == 1:
            return q.prompt + q.outputs
        if alloc == 2:
            return q.prompt + q.limit
        return 0

    # -- replay ---------------------------------------------------------------

    cdef int _ensure(self, int64_t n) except -1:
        """Size the per-replay buffers for n slots.

        Each buffer grows through mem_resize, which keeps the old block when an
        allocation fails; st.cap (and the capacities derived from it) move only
        once every buffer has its new size, so a replay that fits the old
        capacity still runs on valid memory after a MemoryError here.
        """
        cdef State* st = &self.st
        cdef int64_t cap = n + 8
        cdef int i
        if st.cap >= cap and st.hist != NULL and st.P != NULL:
            return 0
        st.P = &self.P
        mem_resize(<void**>&st.r, cap, sizeof(Req))
        mem_resize(<void**>&st.epoch, cap, sizeof(int32_t))
        # Epochs restart with the new block (copies made before are stale anyway).
        memset(st.epoch, 0, sizeof(int32_t) * cap)
        st.cur = 0
        mem_resize(<void**>&st.ro, cap * 2, sizeof(int32_t))
        mem_resize(<void**>&st.ex, cap, sizeof(int32_t))
        mem_resize(<void**>&st.wq, cap, sizeof(int32_t))
        mem_resize(<void**>&st.hist, self.P.bs, sizeof(int64_t))
        mem_resize(<void**>&st.sched, cap, sizeof(int32_t))
        mem_resize(<void**>&st.sched_n, cap, sizeof(int64_t))
        mem_resize(<void**>&st.sched_dec, cap, sizeof(int8_t))
        mem_resize(<void**>&st.sched_ctx, cap, sizeof(int64_t))
        mem_resize(<void**>&st.tmp, cap, sizeof(int32_t))
        mem_resize(<void**>&st.grant, cap, sizeof(int64_t))
        # Per-batch lists: a batch collects entries while it is formed and again
        # while the next one is formed (releases, stale tokens), so they hold
        # several entries per request (duplicates are harmless, overflow is not).
        for i in range(3):
            mem_resize(<void**>&st.ring[i].rel, cap * 4, sizeof(int32_t))
            mem_resize(<void**>&st.ring[i].stale, cap * 2, sizeof(int32_t))
            mem_resize(<void**>&st.ring[i].stale_tok, cap * 2, sizeof(int64_t))
            mem_resize(<void**>&st.ring[i].samp, cap * 4, sizeof(Ev))
        st.ro_cap = cap * 2
        st.wq_cap = cap
        st.cap = cap
        return 0

    cdef int _start(self, Prepared pr, object prompt_tokens, object output_len, object max_tokens,
                    object coeffs, bint record, double arrival=0.0,
                    int64_t next_tokens=0) except -1:
        cdef State* st = &self.st
        cdef Req* q
        cdef Batch* b0
        cdef int64_t i
        cdef int64_t prompt, out_len, cap_tokens
        if pr.code != self.code or pr.bs != self.P.bs:
            raise ValueError("prepared state belongs to another policy")
        prompt = tokens_arg(prompt_tokens, "prompt_tokens", 1, check_tokens)
        out_len = tokens_arg(output_len, "output_len", MIN_ANY, check_tokens)
        cap_tokens = tokens_arg(max_tokens, "max_tokens", MIN_ANY, check_tokens)
        self._ensure(pr.n + 1)
        read_coeffs(&st.c, coeffs)
        new_epoch(st, pr.r)
        load_lists(st, pr.ro, pr.ro_n, pr.ro_n, pr.ex, pr.n_ex, pr.wq, pr.wq_n, pr.hist,
                   pr.n_lazy, pr.s_base, pr.n_grow)
        st.leave.sorted_ = pr.leave
        st.leave.n_sorted = pr.n_leave
        st.leave.pos = 0
        st.leave.n_heap = 0
        st.release.sorted_ = pr.rel
        st.release.n_sorted = pr.n_rel
        st.release.pos = 0
        st.release.n_heap = 0
        st.free_blocks = pr.free_blocks
        st.unlimited = pr.unlimited
        st.vt = 0
        st.step = 0
        st.k = 0
        st.work = 0
        st.max_work = MAX_REPLAY_WORK_C
        st.horizon = INFINITY
        st.t = 0.0
        st.materialized = False
        st.force_slow = self.force_slow or pr.exact or pr.exact_b0
        st.slow_until_b0 = pr.exact_b0 and not (self.force_slow or pr.exact)
        st.b0_done = False
        st.new_tok_b = False
        st.new_seen = False
        st.record = record
        st.n_log = 0
        st.ring_head = 0
        st.ring_n = 0
        st.ck = NULL
        st.ck_take = False
        st.top_step = -1
        st.t_before = -1.0
        st.join_hi = -1.0
        self.resumed = False
        # The new request joins the end of the waiting queue.
        st.n_slots = pr.n + 1
        st.new_slot = <int32_t>pr.n
        st.epoch[pr.n] = st.cur
        q = &st.r[pr.n]
        memset(q, 0, sizeof(Req))
        self._init_req(q, prompt, 0, imax(out_len, 1), cap_tokens)
        st.want = tokens_wanted(next_tokens, q.target, q.outputs, &st.tok_k, &st.tok_t,
                                &st.cap_tok)
        st.n_tok = 0
        q.status = S_WAITING
        q.ro_pos = -1
        q.last_sched = NEVER_SCHEDULED
        q.in_batch = -1
        # It joins the end of the waiting queue when it arrives (at the loop's
        # first turn when that is now).
        st.arrival = arrival
        st.pending_new = True
        if (self.code // 2) % 2 and pr.has_inflight:
            b0 = ring_new(st)
            b0.vt = -1
            b0.sampled_any = pr.b0_sampled
            for i in range(pr.n_b0_rel):
                b0.rel[i] = pr.b0_rel[i]
            b0.n_rel = pr.n_b0_rel
            for i in range(pr.n_b0_samp):
                samp_add(b0, pr.b0_samp[i], 0, pr.r[pr.b0_samp[i]].ph)  # gen 0: as prepared
        return 0

    def ttft(self, prepared, prompt_tokens, output_len, coeffs, max_tokens=-1, prefix_keys=None,
             horizon_s=INFINITY, arrival_s=0.0):
        """Return only the predicted time to first token (``inf`` when never)."""
        self._last_apc = type(prepared) is not Prepared
        if self._last_apc:
            return self._apc_of(prepared).ttft(
                prepared, prompt_tokens, output_len, coeffs, max_tokens, prefix_keys, horizon_s,
                arrival_s)
        cdef double horizon = horizon_arg(horizon_s, check_horizon)
        cdef double arrival = arrival_arg(arrival_s, check_arrival)
        cdef Prepared pr = prepared
        self._start(pr, prompt_tokens, output_len, max_tokens, coeffs, False, arrival)
        cdef State* st = &self.st
        st.horizon = horizon
        cdef bint same = self._resume_or_keep(pr, arrival)
        cdef int rc
        with nogil:
            rc = run_dispatch(self.code, st, 1_000_000)
        self._locate(pr, same)
        # At the work bound: the time replayed so far, a lower bound (as replay()).
        return st.t if rc != R_NEVER else INFINITY

    cdef bint _resume_or_keep(self, Prepared pr, double arrival) except? -1:
        """Before a replay that _start set up (its horizon set): resume from
        ``pr``'s checkpoint where it holds, or have the run keep it there.

        Returns whether the checkpoint's terms are this replay's.
        """
        cdef State* st = &self.st
        cdef Checkpoint* ck = &pr.ck
        cdef bint same = ck_holds(&ck.terms, self.resume_on, self.serial, self.force_slow,
                                  arrival, &st.c)
        if same and ck.terms.status == CK_TAKEN and ck.terms.t <= st.horizon:
            self._resume(pr)
        elif same and ck.terms.status == CK_LOCATED:
            st.ck = ck
            st.ck_take = True
        return same

    cdef void _locate(self, Prepared pr, bint same):
        """After the replay: a first look at ``pr`` (or with other terms) that
        examined the new request says where a later replay keeps its state."""
        cdef State* st = &self.st
        if (self.resume_on and st.new_seen and st.top_step >= CK_MIN_STEP and st.join_hi >= 0.0
                and not self.resumed and not same):
            ck_locate(&pr.ck.terms, st.top_step, st.join_lo, st.join_hi, &st.c, self.serial,
                      self.force_slow)

    cdef int _resume(self, Prepared pr) except -1:
        """Start the replay that _start set up from ``pr``'s checkpoint instead.

        The new request keeps the slot _start gave it; every other request is
        copied from the checkpoint on first touch (a fresh epoch), the
        containers and clocks are restored.
        """
        cdef State* st = &self.st
        cdef Checkpoint* ck = &pr.ck
        cdef Req fresh = st.r[st.new_slot]
        cdef Batch* b
        new_epoch(st, ck.r)
        st.r[st.new_slot] = fresh
        st.epoch[st.new_slot] = st.cur
        load_lists(st, ck.ro, ck.ro_n, ck.n_running, ck.ex, ck.n_ex, ck.wq, ck.wq_n, ck.hist,
                   ck.n_lazy, ck.s_base, ck.n_grow)
        mem_reserve(<void**>&st.leave.heap, &st.leave.cap_heap, ck.n_leave_heap, 16, sizeof(Ev))
        mem_reserve(<void**>&st.release.heap, &st.release.cap_heap, ck.n_release_heap, 16,
                    sizeof(Ev))
        if ck.n_leave_heap:
            memcpy(st.leave.heap, ck.leave_heap, sizeof(Ev) * ck.n_leave_heap)
        if ck.n_release_heap:
            memcpy(st.release.heap, ck.release_heap, sizeof(Ev) * ck.n_release_heap)
        st.leave.n_heap = ck.n_leave_heap
        st.leave.pos = ck.leave_pos
        st.release.n_heap = ck.n_release_heap
        st.release.pos = ck.release_pos
        st.free_blocks = ck.free_blocks
        st.vt = ck.vt
        st.step = ck.terms.at
        st.k = ck.k
        st.work = ck.work
        st.t = ck.terms.t
        st.materialized = ck.materialized
        st.force_slow = ck.st_force_slow
        st.slow_until_b0 = ck.slow_until_b0
        st.b0_done = ck.b0_done
        st.ring_head = 0
        st.ring_n = 0
        if ck.ring_n:
            b = ring_new(st)
            b.vt = ck.b.vt
            b.nsched = ck.b.nsched
            b.pre = ck.b.pre
            b.dec = ck.b.dec
            b.dctx = ck.b.dctx
            b.patt = ck.b.patt
            b.admitted = ck.b.admitted
            b.preempted = ck.b.preempted
            b.active = ck.b.active
            b.sampled_any = ck.b.sampled_any
            memcpy(b.rel, ck.b_rel, sizeof(int32_t) * ck.b.n_rel)
            b.n_rel = ck.b.n_rel
            memcpy(b.stale, ck.b_stale, sizeof(int32_t) * ck.b.n_stale)
            memcpy(b.stale_tok, ck.b_stale_tok, sizeof(int64_t) * ck.b.n_stale)
            b.n_stale = ck.b.n_stale
            memcpy(b.samp, ck.b_samp, sizeof(Ev) * ck.b.n_samp)
            b.n_samp = ck.b.n_samp
        # It joined where the checkpoint's did (its arrival is in the same interval).
        st.pending_new = False
        st.join_lo = ck.terms.join_lo
        st.join_hi = ck.terms.join_hi
        self.resumed = True
        return 0

    def replay(self, prepared, prompt_tokens, output_len,
               coeffs=(0.0, 0.0, 0.0, 0.0), bint record=False, max_batches=1_000_000,
               max_tokens=-1, max_work=None, prefix_keys=None, horizon_s=INFINITY,
               arrival_s=0.0, next_tokens=0):
        """Replay batch formation until the new request's first token.

        Same contract as the pure-Python twin's ``replay``; ``max_work`` counts
        this loop's units (default :data:`~bearsdk.replay.types.MAX_REPLAY_WORK`),
        or the twin's for a snapshot prepared with its blocks. ``prefix_keys``
        matter only there (a counted replay has no cache to hit).
        """
        self._last_apc = type(prepared) is not Prepared
        if self._last_apc:
            return self._apc_of(prepared).replay(
                prepared, prompt_tokens, output_len, coeffs, record, max_batches, max_tokens,
                max_work, prefix_keys, horizon_s, arrival_s, next_tokens)
        cdef int64_t limit = check_tokens(max_batches, "max_batches", MIN_ANY)
        cdef int64_t work = check_tokens(
            _MAX_REPLAY_WORK_PY if max_work is None else max_work, "max_work", MIN_ANY)
        cdef double horizon = check_horizon(horizon_s)
        cdef double arrival = check_arrival(arrival_s)
        cdef int64_t follow = check_next_tokens(next_tokens)
        self._start(prepared, prompt_tokens, output_len, max_tokens, coeffs, record, arrival,
                    follow)
        self.st.max_work = work
        self.st.horizon = horizon
        # Resuming needs the batches before the kept state unrecorded and the
        # bounds ttft() replays under (they cut those batches alike).
        cdef bint resumable = (not record and limit == 1_000_000
                               and work == MAX_REPLAY_WORK_C)
        cdef bint same = resumable and self._resume_or_keep(prepared, arrival)
        cdef int rc
        with nogil:
            rc = run_dispatch(self.code, &self.st, limit)
        if resumable:
            self._locate(prepared, same)
        batches = None
        if record:
            batches = tuple(self._records())
        cdef State* st = &self.st
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

    def residents(self, prepared, coeffs, max_batches):
        """Replay the snapshot's requests alone; the twin's ``residents``."""
        if type(prepared) is not Prepared:
            return self._apc_of(prepared).residents(prepared, coeffs, max_batches)
        cdef int64_t limit = check_tokens(max_batches, "max_batches", 0)
        self._start(prepared, 1, 1, -1, coeffs, False, INFINITY)
        cdef int rc
        if limit > 0:
            with nogil:
                rc = run_dispatch(self.code, &self.st, limit)
        return self.st.k, self.st.t

    cdef object _apc_of(self, prepared):
        if self._apc is None or type(prepared) is not _replay_apc_c.Prepared:
            raise TypeError(f"prepared state of another replay ({type(prepared).__name__})")
        return self._apc

    @property
    def resume(self):
        """Resume replays from their prepared state's checkpoint (default on;
        setting it sets the block-level loop's too)."""
        return self.resume_on

    @resume.setter
    def resume(self, bint on):
        self.resume_on = on
        if self._apc is not None:
            self._apc.resume = on

    @property
    def last_resumed(self):
        """Whether the latest :meth:`ttft` or :meth:`replay` started from its
        prepared state's checkpoint (the state before the new request was first
        examined, kept by an earlier replay of it) rather than from the
        snapshot, in this loop or the block-level one. :meth:`replay` resumes
        only unrecorded, with its default ``max_batches`` and ``max_work``."""
        return self._apc.last_resumed if self._last_apc else self.resumed

    @property
    def last_work(self):
        """Work units (:data:`~bearsdk.replay.types.MAX_REPLAY_WORK`) of the latest replay."""
        return self._apc.last_work if self._last_apc else self.st.work

    @property
    def last_new_examined(self):
        """Whether the latest replay's admissions looked at the new request.

        ``False`` for a replay that stopped before ever reaching it: every
        request ahead of it was still waiting, so its batches, and a
        horizon stop among them, are the same for any new request.
        """
        return self._apc.last_new_examined if self._last_apc else self.st.new_seen

    cdef list _records(self):
        cdef State* st = &self.st
        cdef int64_t i
        out = []
        for i in range(0, st.n_log, 8):
            out.append(BatchRecord(
                num_seqs=st.log[i], prefill_tokens=st.log[i + 1], decode_tokens=st.log[i + 2],
                decode_context=st.log[i + 3], prefill_attention=st.log[i + 4],
                admitted=st.log[i + 5], preempted=st.log[i + 6],
                duration_s=(<double*>&st.log[i + 7])[0]))
        return out
