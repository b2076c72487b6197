# What both compiled replay loops share (cimport _replay_defs from cext/):
# the bound policy as a C struct, the enums its strings compile to, and the
# integer helpers. _replay_c.pyx folds decodes into an aggregate;
# _replay_apc_c.pyx forms batches block by block (prefix caching); both read
# the policy the same way.

from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcmp, memset

from _mem cimport mem_reserve, mem_resize

cdef enum:
    STAGE_RUNNING = 0
    STAGE_DECODES = 1
    STAGE_PREFILLS = 2
    STAGE_WAITING = 3

cdef enum:
    WM_ALWAYS = 0
    WM_WHILE_RUNNING = 1
    WM_NEVER = 2

cdef enum:
    S_RUNNING = 0
    S_WAITING = 1
    S_FINISHED = 2

cdef enum:
    R_FIRST_TOKEN = 0
    R_NEVER = 1
    R_LIMIT = 2
    R_HORIZON = 3   # past the horizon before the first token (StopReason.HORIZON)

ctypedef struct Params:
    int64_t token_budget
    int64_t max_seqs
    int64_t mml
    int64_t chunk_cap
    int64_t bs
    int64_t num_blocks
    int64_t reserved
    int64_t wm_blocks
    int32_t n_stages
    int32_t stages[4]
    int32_t wm_applies
    int32_t depth
    bint padded
    bint exclusive
    bint admit_after_preemption
    bint chunked
    bint cap_exempt_alone
    bint stop_on_blocked
    bint reserve_full
    bint one_free
    bint victim_newest
    bint requeue_front
    bint keep_outputs


cdef inline int read_policy(Params* P, object p) except -1:
    """Fill P from a bound policy (its numbers checked by check_policy first)."""
    memset(P, 0, sizeof(Params))
    P.token_budget = p.token_budget
    P.max_seqs = p.max_seqs
    P.mml = p.max_model_len
    P.chunk_cap = p.chunk_cap
    P.bs = p.block_size
    P.num_blocks = p.num_blocks
    P.reserved = p.reserved_blocks
    P.wm_blocks = p.watermark_blocks
    names = {"running": STAGE_RUNNING, "decodes": STAGE_DECODES,
             "prefills": STAGE_PREFILLS, "waiting": STAGE_WAITING}
    P.n_stages = len(p.stages)
    for i, s in enumerate(p.stages):
        P.stages[i] = names[s]
    P.wm_applies = {"always": WM_ALWAYS, "while-running": WM_WHILE_RUNNING,
                    "never": WM_NEVER}[p.watermark_applies]
    P.depth = 2 if p.async_scheduling else 1
    P.padded = p.budget_count == "padded"
    P.exclusive = p.exclusive
    P.admit_after_preemption = p.admit_after_preemption
    P.chunked = p.chunked_prefill
    P.cap_exempt_alone = p.cap_exempt_when_alone
    P.stop_on_blocked = p.on_blocked == "stop"
    P.reserve_full = p.reserve_full_sequence
    P.one_free = p.decode_needs_free_block
    P.victim_newest = p.victim == "newest"
    P.requeue_front = p.requeue == "front"
    P.keep_outputs = p.keep_outputs
    return 0


cdef inline int64_t cdiv(int64_t a, int64_t b) noexcept nogil:
    # cdivision is on (C truncation): only valid for a >= 0, b > 0.
    return (a + b - 1) // b


cdef inline int64_t imin(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


cdef inline int64_t imax(int64_t a, int64_t b) noexcept nogil:
    return a if a > b else b


cdef inline int64_t output_limit(const Params* P, int64_t prompt, int64_t max_tokens) noexcept nogil:
    # The request's output cap within max_model_len; far above any count when
    # uncapped (the pure twin's PolicyGeometry.make_req resolves it the same way).
    cdef int64_t lim = max_tokens if max_tokens > 0 else (<int64_t>1) << 60
    if P.mml > 0:
        lim = imin(lim, P.mml - prompt)
    return lim


cdef inline int64_t output_target(int64_t limit, int64_t outputs, int64_t output_len) noexcept nogil:
    # Outputs it will have when it finishes: its (predicted) length within the
    # cap, and at least one more than it already has.
    return imax(imin(output_len, limit), outputs + 1)


cdef inline int64_t tokens_wanted(int64_t next_tokens, int64_t target, int64_t outputs,
                                  int64_t** tok_k, double** tok_t, int64_t* cap) except -1 nogil:
    # The new request's tokens to follow (never past its output length: an async
    # engine's wasted token past an unannounced stop is no token), with room in
    # the token log (batch index and time of each) for all of them.
    cdef int64_t want = imin(1 + next_tokens, target - outputs)
    if want > cap[0]:
        mem_resize(<void**>tok_k, want, sizeof(int64_t))
        mem_resize(<void**>tok_t, want, sizeof(double))
        cap[0] = want
    return want


cdef enum:
    MAX_TOKENS_LOG2 = 40   # bearsdk.replay.types.MAX_TOKENS == 1 << 40


cdef inline int64_t tokens_arg(object v, object name, int64_t minimum,
                               object check) except? -0x7fffffffffffffff:
    """``check(v, name, minimum)`` (types.check_tokens) without calling it for an
    int already in range: the hot path validates three counts per estimate."""
    cdef int overflow = 0
    cdef long long x
    if type(v) is int:
        x = PyLong_AsLongLongAndOverflow(v, &overflow)
        if overflow == 0 and minimum <= x <= ((<int64_t>1) << MAX_TOKENS_LOG2):
            return x
    return check(v, name, minimum)


cdef inline double horizon_arg(object v, object check) except? -1.0:
    """``check(v)`` (types.check_horizon) without calling it for a float > 0."""
    cdef double h
    if type(v) is float:
        h = v
        if h > 0.0:  # NaN is not
            return h
    return check(v)


cdef inline double arrival_arg(object v, object check) except? -1.0:
    """``check(v)`` (types.check_arrival) without calling it for a finite float >= 0."""
    cdef double a
    if type(v) is float:
        a = v
        if 0.0 <= a and a - a == 0.0:  # NaN and infinities fail the second
            return a
    return check(v)


ctypedef struct Coeffs:
    double b0
    double b1
    double b2
    double b3
    double tau          # richer dense term: b1 * max(tokens, tau); 0 = eq. 12
    double b2s          # b2 per decode token, for its own key ("attended"); 0 = "before"


cdef inline int read_coeffs(Coeffs* c, object coeffs) except -1:
    """Eq. 12's coefficients as BatchTimeModel.replay_coeffs gives them:
    (b0, b1, b2, b3), then optionally tau and a decode token's own keys."""
    cdef Py_ssize_t n = len(coeffs)
    if n < 4 or n > 6:
        raise ValueError(f"coeffs must hold 4 to 6 numbers (got {n})")
    c.b0 = coeffs[0]
    c.b1 = coeffs[1]
    c.b2 = coeffs[2]
    c.b3 = coeffs[3]
    c.tau = coeffs[4] if n > 4 else 0.0
    c.b2s = c.b2 * <double>coeffs[5] if n > 5 else 0.0
    return 0


# ---------------------------------------------------------------------------
# Events of lazy decodes (both loops): a binary min-heap on (key, slot)
# ---------------------------------------------------------------------------

ctypedef struct Ev:
    int64_t key         # the vt it happens at
    int32_t slot
    int32_t gen         # the request's generation when queued (stale once it moves on)


cdef inline bint ev_less(const Ev* a, const Ev* b) noexcept nogil:
    return a.key < b.key or (a.key == b.key and a.slot < b.slot)


cdef inline int ev_push(Ev** heap, int64_t* n, int64_t* cap, int64_t key, int32_t slot,
                        int32_t gen) except -1 nogil:
    cdef int64_t i, p
    cdef Ev e
    cdef Ev* h
    mem_reserve(<void**>heap, cap, n[0] + 1, 16, sizeof(Ev))
    h = heap[0]
    e.key = key
    e.slot = slot
    e.gen = gen
    i = n[0]
    n[0] += 1
    while i > 0:
        p = (i - 1) >> 1
        if not ev_less(&e, &h[p]):
            break
        h[i] = h[p]
        i = p
    h[i] = e
    return 0


cdef inline void ev_sift_down(Ev* h, int64_t n, int64_t i, Ev e) noexcept nogil:
    """Place e at i of the heap's first n entries, moving smaller children up."""
    cdef int64_t c
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and ev_less(&h[c + 1], &h[c]):
            c += 1
        if not ev_less(&h[c], &e):
            break
        h[i] = h[c]
        i = c
    h[i] = e


cdef inline void ev_pop(Ev* h, int64_t* n) noexcept nogil:
    n[0] -= 1
    if n[0] > 0:
        ev_sift_down(h, n[0], 0, h[n[0]])


# ---------------------------------------------------------------------------
# Resuming (both loops): where a replay's state before the new request is kept
# ---------------------------------------------------------------------------

cdef enum:
    CK_NONE = 0
    CK_LOCATED = 1      # the turn is known
    CK_TAKEN = 2        # the state is held


ctypedef struct CkTerms:
    # What a kept state is, and which replays it holds for.
    int status
    int64_t at          # the kept turn: a step (counted loop) or a turn count (block-level)
    double t            # the time replayed by then
    double join_lo      # the arrivals it holds for: those in (join_lo, join_hi],
    double join_hi      #   which join the waiting queue at the same batch's end
    Coeffs c            # ... the coefficients
    int64_t owner       # ... the replayer (its serial)
    bint force_slow     # ... and the replayer's force_slow


cdef inline bint ck_holds(const CkTerms* k, bint on, int64_t owner, bint force_slow,
                          double arrival, const Coeffs* c) noexcept nogil:
    """A replay with these terms may resume from (or keep) the state ``k`` names."""
    return (on and k.status != CK_NONE and k.owner == owner and k.force_slow == force_slow
            and k.join_lo < arrival <= k.join_hi and memcmp(&k.c, c, sizeof(Coeffs)) == 0)


cdef inline void ck_locate(CkTerms* k, int64_t at, double join_lo, double join_hi,
                           const Coeffs* c, int64_t owner, bint force_slow) noexcept nogil:
    """Where a replay with these terms keeps its state, from a first look."""
    k.status = CK_LOCATED
    k.at = at
    k.join_lo = join_lo
    k.join_hi = join_hi
    k.c = c[0]
    k.owner = owner
    k.force_slow = force_slow
