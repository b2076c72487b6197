# Compiled capture and encoder of the vLLM snapshot publisher (bearsdk.vllm._pub_c).
#
# bearsdk/vllm/_pub_py.py is the pure-Python twin and the reference: it reads
# every request at every capture, and both produce byte-identical
# bear.snapshot/1 documents and identical batch terms (differential tests pin
# that, on stand-ins and on vLLM's real scheduler).
#
# The capture runs on vLLM's engine thread at the start of every schedule(),
# where reading three counters out of each of 256 requests costs ~35-45 us:
# the requests' dicts are scattered over the heap, and after a scheduler step
# they are out of the caches and the TLB. So, in "shadow" mode, this module
# keeps its own copy of each resident request's counters in one compact table
# and updates it from what the scheduler hands it anyway, which is hot:
#
# * after_schedule(): SchedulerOutput.num_scheduled_tokens. A request running at
#   the capture computes n more tokens; with async scheduling, one that
#   completes its known tokens gets a placeholder (AsyncScheduler's rule). An
#   admitted request's computed count (prefix-cache hits included) is read from
#   the request itself, which the scheduler has just written.
# * batch_done(): the batch's output reached the scheduler: every request whose
#   chunk completed in it got its one sampled token (outputs + 1, one
#   placeholder fewer: vLLM's _update_request_with_output). One token per
#   completed chunk is what vLLM's AsyncScheduler itself assumes when it adds
#   one placeholder per such request; speculative decoding, the exception,
#   turns shadow mode off. Reading the model's sampled token lists instead
#   would touch one more scattered object per request.
# * preempted(): vLLM's _preempt_request resets computed and placeholders.
#
# The capture itself walks the scheduler's running list and waiting queues
# (their order and membership are always read, never inferred) and looks each
# request up by address. Every capture also re-reads `audit` requests in
# rotation from the request objects and repairs (and counts) any difference, so
# a path the shadow does not model (KV-connector loads, say) cannot leave a
# counter wrong for long. Configurations whose counters move in ways the
# shadow does not follow (speculative decoding, KV connectors, pooling models)
# run with shadow=False: every request read at every capture.
#
# The table holds a reference to each request it has seen, so an address cannot
# be reused by another request while it is cached; requests a capture no longer
# sees are dropped once the table has grown to twice the resident set. Frames
# point at their rows' id fragments, which belong to the table: a dropped
# entry's fragment waits in a graveyard until no frame can point at it.
#
# Formatting the JSON needs no GIL and no request: inline (encode) or on a
# publisher thread through a lock-free triple buffer (commit / take_and_encode):
# the engine owns one frame, the publisher thread one, and the third is the
# latest committed, swapped by atomic exchange. Committing costs the engine an
# atomic exchange, no system call: the publisher thread polls (poll_us), so a
# document reaches the transports at most that much later. A slow publisher
# thread skips to the latest frame (snapshots coalesce, as every snapshot
# transport does anyway).
#
# Hooks, at the end, is what the scheduler plugin calls on the engine thread:
# the per-step bookkeeping in C, because the same few hundred Python bytecodes,
# run cold right after vLLM's own step, cost more than the capture.
#
# What it reads from a vllm.v1.request.Request (vLLM 0.33): request_id,
# num_prompt_tokens, num_computed_tokens, _output_token_ids (the list whose
# length the public num_output_tokens property returns; that property is the
# fallback), max_tokens, num_output_placeholders, is_prefill_chunk and
# resumable (a streaming session, whose prompt grows: always read in full).

from cpython.object cimport PyObject
from posix.time cimport CLOCK_MONOTONIC, CLOCK_REALTIME, clock_gettime, timespec
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from _mem cimport mem_alloc, mem_resize, mem_try_resize
from libc.string cimport memcpy, memset, strlen

IMPLEMENTATION = "cython"

from collections import deque as _deque

# vLLM's FCFS queues subclass deque and override __iter__, __len__ and __bool__
# in Python, each a cold Python frame on the engine thread per call: use
# deque's own (C) methods on them; any other queue (the priority heap) keeps
# its own, which define its order.
cdef object DEQUE_ITER = _deque.__iter__
cdef object DEQUE_LEN = _deque.__len__


cdef inline object queue_iter(object q):
    if isinstance(q, _deque):
        return DEQUE_ITER(q)
    return iter(q)


cdef inline Py_ssize_t queue_len(object q) except -1:
    if isinstance(q, _deque):
        return DEQUE_LEN(q)
    return len(q)

cdef extern from "Python.h":
    PyObject* PyDict_GetItem(object d, object key)
    bint PyDict_Next(object d, Py_ssize_t* pos, PyObject** key, PyObject** value)
    bint PyDict_CheckExact(object o)
    object PyObject_GenericGetDict(object o, void* context)
    bint PyList_CheckExact(object o)
    Py_ssize_t PyList_GET_SIZE(object o)
    PyObject* PyList_GET_ITEM(object o, Py_ssize_t i)
    bint PyLong_CheckExact(object o)
    long long PyLong_AsLongLong(object o) except? -1
    char* PyOS_double_to_string(
        double val, char format_code, int precision, int flags, int* ptype
    ) except NULL
    void PyMem_Free(void* p)
    int Py_DTSF_ADD_DOT_0
    void bear_incref "Py_INCREF"(PyObject* o)
    void bear_decref "Py_DECREF"(PyObject* o)

cdef extern from *:
    """
    #include <stdatomic.h>
    #include <stdlib.h>
    #include <time.h>

    /* The triple buffer's shared slot: the index of the latest committed
       frame, with FRESH set until the publisher thread takes it. */
    #define BEAR_FRESH 4
    typedef struct {
        _Atomic int pending;
        _Atomic int closing;
        long poll_ns;
    } bear_sync;

    static bear_sync* bear_sync_new(int idx, long poll_ns) {
        bear_sync* s = (bear_sync*)calloc(1, sizeof(bear_sync));
        if (s == NULL) return NULL;
        atomic_init(&s->pending, idx);
        atomic_init(&s->closing, 0);
        s->poll_ns = poll_ns;
        return s;
    }
    static void bear_sync_free(bear_sync* s) { free(s); }
    /* Engine: publish frame idx, get back the frame to capture into next. */
    static int bear_sync_commit(bear_sync* s, int idx) {
        int old = atomic_exchange_explicit(&s->pending, idx | BEAR_FRESH, memory_order_acq_rel);
        return old & 3;
    }
    /* Publisher thread: wait (polling) for a fresh frame and swap it for
       frame idx; -1 once closed. */
    static int bear_sync_take(bear_sync* s, int idx) {
        struct timespec ts;
        ts.tv_sec = s->poll_ns / 1000000000L;
        ts.tv_nsec = s->poll_ns % 1000000000L;
        for (;;) {
            if (atomic_load_explicit(&s->closing, memory_order_acquire)) return -1;
            if (atomic_load_explicit(&s->pending, memory_order_acquire) & BEAR_FRESH) {
                int old = atomic_exchange_explicit(&s->pending, idx, memory_order_acq_rel);
                return old & 3;
            }
            nanosleep(&ts, NULL);
        }
    }
    static void bear_sync_close(bear_sync* s) {
        atomic_store_explicit(&s->closing, 1, memory_order_release);
    }
    """
    ctypedef struct bear_sync:
        pass
    bear_sync* bear_sync_new(int idx, long poll_ns) nogil
    void bear_sync_free(bear_sync* s) nogil
    int bear_sync_commit(bear_sync* s, int idx) nogil
    int bear_sync_take(bear_sync* s, int idx) nogil
    void bear_sync_close(bear_sync* s) nogil

# Interned attribute names: dict keys are the same interned objects, so a
# lookup compares pointers.
cdef object K_PROMPT = "num_prompt_tokens"
cdef object K_COMPUTED = "num_computed_tokens"
cdef object K_OUTPUTS = "_output_token_ids"
cdef object K_NUM_OUTPUTS = "num_output_tokens"
cdef object K_MAX = "max_tokens"
cdef object K_PH = "num_output_placeholders"
cdef object K_PREFILL_CHUNK = "is_prefill_chunk"

cdef enum:
    ROW_FIXED = 160  # bytes of a row besides its id fragment and integers
    INT_CHARS = 20
    FLOAT_CHARS = 40
    COUNT_MAX = 2147483647  # counters are int32 in the table and the frames

cdef const char* DIGITS = (
    b"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    b"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    b"8081828384858687888990919293949596979899"
)
cdef const char* HEX = b"0123456789abcdef"

# The table, the frames and the rows are packed small on purpose: after a
# scheduler step everything is out of the cache, and a capture's cost is
# about the memory it touches.

ctypedef struct Row:
    const char* frag  # the request's row head, b'{"id":"<id>","state":"' (its entry's)
    int32_t frag_len
    int32_t running
    int32_t prompt
    int32_t computed
    int32_t outputs
    int32_t ph
    int64_t max_tokens

ctypedef struct Frame:
    Row* rows
    Py_ssize_t n
    Py_ssize_t cap
    Py_ssize_t frag_bytes
    uint32_t gen  # the capture it holds
    int64_t seq
    int64_t free_blocks
    char time_s[FLOAT_CHARS + 1]
    char inflight_s[FLOAT_CHARS + 1]  # empty: unknown

ctypedef struct Entry:
    PyObject* req  # strong reference: pins the address
    PyObject* rid  # owned by req; compared by address only
    char* frag  # owned; freed through the graveyard (frames may point at it)
    int32_t frag_len
    int32_t prompt
    int32_t computed  # the shadow of the request's counters
    int32_t outputs
    int32_t ph
    uint32_t gen  # the last capture that saw it
    uint32_t serial  # unique per entry: tells a recorded request from a reused address
    int64_t max_tokens
    uint8_t volatile  # a streaming session: read in full at every capture
    uint8_t prefilled  # its last chunk completed its known tokens
    uint8_t running  # running at the last capture (or admitted since)

ctypedef struct Sampled:
    # The requests whose chunk completed in one scheduled batch.
    PyObject* key  # the batch's SchedulerOutput, compared by address only
    PyObject** rids  # compared by address only, with the entry's serial
    uint32_t* serials
    Py_ssize_t n
    Py_ssize_t cap

ctypedef struct Grave:
    char* frag
    uint32_t gen  # dropped by this capture: frames from it on do not point at it

ctypedef struct Out:
    char* buf
    Py_ssize_t cap
    Py_ssize_t length


# ---------------------------------------------------------------------------
# JSON formatting (no GIL)
# ---------------------------------------------------------------------------

cdef inline char* put_u64(char* p, uint64_t v) noexcept nogil:
    cdef char tmp[24]
    cdef int i = 24
    cdef uint64_t q
    while v >= 100:
        q = v // 100
        i -= 2
        memcpy(&tmp[i], &DIGITS[2 * (v - q * 100)], 2)
        v = q
    if v >= 10:
        i -= 2
        memcpy(&tmp[i], &DIGITS[2 * v], 2)
    else:
        i -= 1
        tmp[i] = <char>(48 + v)
    memcpy(p, &tmp[i], 24 - i)
    return p + (24 - i)


cdef inline char* put_i64(char* p, int64_t v) noexcept nogil:
    if v < 0:
        p[0] = b"-"
        return put_u64(p + 1, <uint64_t>(-(v + 1)) + 1)
    return put_u64(p, <uint64_t>v)


cdef inline char* put(char* p, const char* s, Py_ssize_t n) noexcept nogil:
    memcpy(p, s, n)
    return p + n


cdef char* put_str(char* p, const char* s, Py_ssize_t n) noexcept nogil:
    # A JSON string with the escapes RFC 8259 requires; other bytes (UTF-8) pass through.
    cdef Py_ssize_t i
    cdef unsigned char ch
    p[0] = b'"'
    p += 1
    for i in range(n):
        ch = <unsigned char>s[i]
        if ch == 34 or ch == 92:
            p[0] = b"\\"
            p[1] = <char>ch
            p += 2
        elif ch < 32:
            memcpy(p, b"\\u00", 4)
            p[4] = HEX[ch >> 4]
            p[5] = HEX[ch & 15]
            p += 6
        else:
            p[0] = <char>ch
            p += 1
    p[0] = b'"'
    return p + 1


cdef int reserve(Out* o, Py_ssize_t need) noexcept nogil:
    cdef Py_ssize_t cap
    if need <= o.cap:
        return 0
    cap = need if need > 2 * o.cap else 2 * o.cap
    if mem_try_resize(<void**>&o.buf, cap, 1):
        return -1  # o.buf and o.cap unchanged
    o.cap = cap
    return 0


cdef Py_ssize_t format_frame(
    Frame* f, const char* head, Py_ssize_t headn, int64_t block_size, int64_t num_blocks,
    Out* o,
) noexcept nogil:
    """Write frame ``f`` as one document into ``o``; its length, or -1 without memory."""
    cdef Py_ssize_t i
    cdef Row* r
    cdef char* p
    cdef int64_t prompt, outputs, computed, ph, free_blocks
    if reserve(o, headn + 256 + 2 * FLOAT_CHARS + f.frag_bytes
               + f.n * (ROW_FIXED + 5 * INT_CHARS)) < 0:
        return -1
    p = put(o.buf, head, headn)
    p = put(p, b',"seq":', 7)
    p = put_i64(p, f.seq)
    p = put(p, b',"time":', 8)
    p = put(p, f.time_s, strlen(f.time_s))
    free_blocks = f.free_blocks
    if free_blocks < 0:
        free_blocks = 0
    if free_blocks > num_blocks:
        free_blocks = num_blocks
    p = put(p, b',"kv":{"block_size":', 20)
    p = put_i64(p, block_size)
    p = put(p, b',"num_blocks":', 14)
    p = put_i64(p, num_blocks)
    p = put(p, b',"free_blocks":', 15)
    p = put_i64(p, free_blocks)
    p[0] = b"}"
    p += 1
    if f.inflight_s[0]:
        p = put(p, b',"inflight":{"remaining_s":', 27)
        p = put(p, f.inflight_s, strlen(f.inflight_s))
        p[0] = b"}"
        p += 1
    p = put(p, b',"requests":[', 13)
    for i in range(f.n):
        r = &f.rows[i]
        # The document must validate whole: clamp what vLLM does not report
        # anyway rather than let one odd request void the snapshot.
        prompt = r.prompt if r.prompt >= 1 else 1
        outputs = r.outputs if r.outputs >= 0 else 0
        ph = r.ph if r.ph >= 0 else 0
        computed = r.computed if r.computed >= 0 else 0
        if computed > prompt + outputs + ph:
            computed = prompt + outputs + ph
        if i:
            p[0] = b","
            p += 1
        p = put(p, r.frag, r.frag_len)
        if r.running:
            p = put(p, b'running","prompt_tokens":', 25)
        else:
            p = put(p, b'waiting","prompt_tokens":', 25)
        p = put_i64(p, prompt)
        p = put(p, b',"computed_tokens":', 19)
        p = put_i64(p, computed)
        p = put(p, b',"output_tokens":', 17)
        p = put_i64(p, outputs)
        if r.max_tokens > outputs:
            p = put(p, b',"max_tokens":', 14)
            p = put_i64(p, r.max_tokens)
        if ph > 0:
            p = put(p, b',"placeholders":', 16)
            p = put_i64(p, ph)
        p[0] = b"}"
        p += 1
    p[0] = b"]"
    p[1] = b"}"
    o.length = p + 2 - o.buf
    return o.length


# ---------------------------------------------------------------------------
# Reading requests (GIL held)
# ---------------------------------------------------------------------------

cdef inline int64_t int_field(object d, object r, object key) except? -1:
    cdef PyObject* v = PyDict_GetItem(d, key) if d is not None else NULL
    if v != NULL and PyLong_CheckExact(<object>v):
        return PyLong_AsLongLong(<object>v)
    v2 = getattr(r, key)
    return -1 if v2 is None else v2


cdef inline int64_t outputs_of(object d, object r) except? -1:
    cdef PyObject* v = PyDict_GetItem(d, K_OUTPUTS) if d is not None else NULL
    if v != NULL and PyList_CheckExact(<object>v):
        return PyList_GET_SIZE(<object>v)
    return getattr(r, K_NUM_OUTPUTS)


cdef inline int32_t count(int64_t v) noexcept:
    return <int32_t>(COUNT_MAX if v > COUNT_MAX else (-1 if v < -1 else v))


cdef inline object dict_of(object r):
    try:
        d = PyObject_GenericGetDict(r, NULL)
    except (AttributeError, TypeError):
        return None
    return d if PyDict_CheckExact(d) else None


def id_fragment(str rid):
    """The constant head of a request's row: ``{"id":"<id>","state":"``."""
    cdef bytes raw = rid.encode("utf-8", "replace")
    cdef Py_ssize_t n = len(raw)
    # 6 + 10 bytes around the string, its two quotes, and at most 6 per byte
    # (a control character's \u00XX): 2 bytes short of that wrote past the
    # block for an id of control characters.
    cdef char* tmp = <char*>mem_alloc(18 + 6 * n, 1)
    cdef char* p
    try:
        p = put(tmp, b'{"id":', 6)
        p = put_str(p, raw, n)
        p = put(p, b',"state":"', 10)
        return tmp[: p - tmp]
    finally:
        free(tmp)


def json_head(str instance, str epoch):
    """The document's constant head (schema, instance, epoch)."""
    cdef bytes inst = instance.encode("utf-8", "replace")
    cdef bytes ep = epoch.encode("utf-8", "replace")
    cdef char* tmp = <char*>mem_alloc(64 + 6 * (len(inst) + len(ep)), 1)
    cdef char* p
    try:
        p = put(tmp, b'{"schema":"bear.snapshot/1","instance":', 39)
        p = put_str(p, inst, len(inst))
        p = put(p, b',"epoch":', 9)
        p = put_str(p, ep, len(ep))
        return tmp[: p - tmp]
    finally:
        free(tmp)


def json_ints(const int64_t[::1] values):
    """``values`` as JSON integers joined by commas (no brackets): the bulk arrays of
    ``kv.prefix_cache`` (bearsdk.vllm._prefix), tens of thousands per snapshot."""
    cdef Py_ssize_t n = values.shape[0]
    cdef Py_ssize_t i
    cdef char* tmp
    cdef char* p
    if n == 0:
        return b""
    tmp = <char*>mem_alloc(n * 21, 1)
    try:
        with nogil:
            p = tmp
            for i in range(n):
                if i:
                    p[0] = b","
                    p += 1
                p = put_i64(p, values[i])
        return tmp[:p - tmp]
    finally:
        free(tmp)


cdef void put_float(char* dst, double v) except *:
    cdef char* s = PyOS_double_to_string(v, b"r", 0, Py_DTSF_ADD_DOT_0, NULL)
    cdef size_t n = strlen(s)
    try:
        if n > FLOAT_CHARS:
            raise ValueError(f"{v!r} does not fit the document")
        memcpy(dst, s, n + 1)
    finally:
        PyMem_Free(s)


cdef inline uint64_t ptr_hash(void* p) noexcept nogil:
    return ((<uint64_t><uintptr_t>p) >> 4) * <uint64_t>11400714819323198485ULL


cdef class Capture:
    """Captures a vLLM scheduler's resident requests as ``bear.snapshot/1`` documents.

    Args:
        instance: The instance name the documents carry.
        epoch: This engine run's id.
        block_size: Tokens per KV block.
        num_blocks: Blocks in the KV pool.
        placeholders: Async scheduling: read and track ``num_output_placeholders``
            (a synchronous scheduler never sets it).
        threaded: Allow :meth:`commit` / :meth:`take_and_encode` (a publisher thread).
        shadow: Keep each request's counters from :meth:`after_schedule`,
            :meth:`batch_done` and :meth:`preempted` instead of reading every
            request at every capture.
        audit: Requests re-read (and repaired) per capture in shadow mode;
            negative: all of them.
        poll_us: The publisher thread's polling interval.
    """

    cdef Frame frames[3]
    cdef int eng  # the frame the engine captures into
    cdef int bg  # the frame the publisher thread formats
    cdef bear_sync* sync
    cdef Out eng_out
    cdef Out bg_out
    cdef bytes head
    cdef readonly int64_t block_size
    cdef readonly int64_t num_blocks
    cdef bint placeholders
    cdef readonly bint shadow
    cdef Py_ssize_t audit
    cdef Py_ssize_t audit_pos
    cdef readonly int64_t mismatches
    # Entries in a dense array, found through two open-addressing indexes
    # (slot value: entry index + 1; 0 = empty): by request and by request id.
    cdef Entry* ents
    cdef Py_ssize_t ecap
    cdef Py_ssize_t ecount
    cdef int32_t* by_req
    cdef int32_t* by_rid
    cdef Py_ssize_t tcap
    cdef uint32_t gen
    # Row heads of dropped entries, freed once no frame can point at them.
    cdef Grave* graves
    cdef Py_ssize_t ngraves
    cdef Py_ssize_t gcap
    # Batches scheduled and not yet done, oldest first (a ring).
    cdef Sampled batches[16]
    cdef int bhead
    cdef int blen
    cdef uint32_t serials
    # The running requests of the last capture: entry index, for batch terms.
    cdef int32_t* run_idx
    cdef Py_ssize_t run_cap
    cdef readonly Py_ssize_t num_running
    cdef readonly Py_ssize_t num_waiting
    cdef Py_ssize_t last_n  # requests in the previous capture (bounds the audit rotation)
    cdef bint valid

    def __cinit__(self):
        cdef int i
        for i in range(3):
            memset(&self.frames[i], 0, sizeof(Frame))
        for i in range(16):
            memset(&self.batches[i], 0, sizeof(Sampled))
        self.bhead = 0
        self.blen = 0
        self.serials = 0
        memset(&self.eng_out, 0, sizeof(Out))
        memset(&self.bg_out, 0, sizeof(Out))
        self.sync = NULL
        self.ents = NULL
        self.ecap = 0
        self.ecount = 0
        self.by_req = NULL
        self.by_rid = NULL
        self.tcap = 0
        self.graves = NULL
        self.ngraves = 0
        self.gcap = 0
        self.run_idx = NULL
        self.run_cap = 0

    def __init__(
        self, str instance, str epoch, int64_t block_size, int64_t num_blocks,
        bint placeholders=True, bint threaded=False, bint shadow=False,
        Py_ssize_t audit=2, double poll_us=500.0,
    ):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(
                f"block_size and num_blocks must be >= 1 (got {block_size}, {num_blocks})"
            )
        if not poll_us > 0:
            raise ValueError(f"poll_us must be > 0 (got {poll_us!r})")
        self.head = json_head(instance, epoch)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.placeholders = placeholders
        self.shadow = shadow
        self.audit = audit
        self.audit_pos = 0
        self.mismatches = 0
        self.eng = 0
        self.bg = 2
        self.gen = 0
        self.num_running = 0
        self.num_waiting = 0
        self.last_n = 0
        self.valid = False
        self._rebuild(256, 512)
        if threaded:
            self.sync = bear_sync_new(1, <long>(poll_us * 1000.0))
            if self.sync == NULL:
                raise MemoryError()

    def __dealloc__(self):
        cdef int i
        cdef Py_ssize_t j
        for i in range(3):
            free(self.frames[i].rows)
        for i in range(16):
            free(self.batches[i].rids)
            free(self.batches[i].serials)
        for j in range(self.ecount):
            free(self.ents[j].frag)
            bear_decref(self.ents[j].req)
        for j in range(self.ngraves):
            free(self.graves[j].frag)
        free(self.ents)
        free(self.graves)
        free(self.by_req)
        free(self.by_rid)
        free(self.run_idx)
        free(self.eng_out.buf)
        free(self.bg_out.buf)
        bear_sync_free(self.sync)

    # -- the request table ---------------------------------------------------

    cdef int _bury(self, char* frag) except -1:
        cdef Py_ssize_t cap
        if self.ngraves == self.gcap:
            cap = 2 * self.gcap if self.gcap else 64
            # Out of memory: frag leaks (a frame may still point at it).
            mem_resize(<void**>&self.graves, cap, sizeof(Grave))
            self.gcap = cap
        self.graves[self.ngraves].frag = frag
        self.graves[self.ngraves].gen = self.gen
        self.ngraves += 1
        return 0

    cdef void _free_graves(self) noexcept:
        # A frame captured at or after a grave's generation cannot point at
        # it; the engine's own frame is being recaptured; empty frames point
        # at nothing. Only the engine writes a frame's gen, so reading the
        # others' here races with nothing.
        cdef uint32_t oldest = self.gen
        cdef int i
        cdef Py_ssize_t j, k = 0
        for i in range(3):
            if i != self.eng and self.frames[i].n > 0 and self.frames[i].gen < oldest:
                oldest = self.frames[i].gen
        for j in range(self.ngraves):
            if self.graves[j].gen <= oldest:
                free(self.graves[j].frag)
            else:
                self.graves[k] = self.graves[j]
                k += 1
        self.ngraves = k

    cdef int _rebuild(self, Py_ssize_t ecap, Py_ssize_t tcap) except -1:
        # Compact the entries (dropping those the last capture did not see,
        # unless growing) and rebuild both indexes with tcap slots.
        cdef Py_ssize_t j, k = 0, i
        cdef uint64_t mask = tcap - 1
        cdef bint keep_all = ecap > self.ecap
        cdef int32_t* nr = <int32_t*>calloc(tcap, sizeof(int32_t))
        cdef int32_t* nd = <int32_t*>calloc(tcap, sizeof(int32_t))
        if nr == NULL or nd == NULL:
            free(nr)
            free(nd)
            raise MemoryError()
        if ecap > self.ecap:
            if mem_try_resize(<void**>&self.ents, ecap, sizeof(Entry)):
                free(nr)
                free(nd)
                raise MemoryError(f"could not grow the request table to {ecap} entries")
            self.ecap = ecap
        for j in range(self.ecount):
            if not keep_all and self.ents[j].gen != self.gen:
                self._bury(self.ents[j].frag)
                bear_decref(self.ents[j].req)
                continue
            if k != j:
                self.ents[k] = self.ents[j]
            i = ptr_hash(self.ents[k].req) & mask
            while nr[i]:
                i = (i + 1) & mask
            nr[i] = <int32_t>(k + 1)
            i = ptr_hash(self.ents[k].rid) & mask
            while nd[i]:
                i = (i + 1) & mask
            nd[i] = <int32_t>(k + 1)
            k += 1
        self.ecount = k
        free(self.by_req)
        free(self.by_rid)
        self.by_req = nr
        self.by_rid = nd
        self.tcap = tcap
        return 0

    cdef inline Py_ssize_t _find_req(self, PyObject* key) noexcept:
        cdef uint64_t mask = self.tcap - 1
        cdef Py_ssize_t i = ptr_hash(key) & mask
        cdef int32_t v
        while True:
            v = self.by_req[i]
            if v == 0:
                return -1
            if self.ents[v - 1].req == key:
                return v - 1
            i = (i + 1) & mask

    cdef inline Py_ssize_t _find_rid(self, PyObject* key) noexcept:
        cdef uint64_t mask = self.tcap - 1
        cdef Py_ssize_t i = ptr_hash(key) & mask
        cdef int32_t v
        while True:
            v = self.by_rid[i]
            if v == 0:
                return -1
            if self.ents[v - 1].rid == key:
                return v - 1
            i = (i + 1) & mask

    cdef Py_ssize_t _add(self, object r, object d) except -1:
        cdef Entry* e
        cdef Py_ssize_t k, i, n
        cdef uint64_t mask
        cdef char* frag
        cdef bytes raw
        if self.ecount == self.ecap or 2 * (self.ecount + 1) > self.tcap:
            self._rebuild(2 * self.ecap, 2 * self.tcap)
        rid = r.request_id
        raw = id_fragment(rid)
        n = len(raw)
        prompt = int_field(d, r, K_PROMPT)
        max_tokens = r.max_tokens
        volatile = bool(getattr(r, "resumable", False))
        frag = <char*>mem_alloc(n, 1)
        memcpy(frag, <const char*>raw, n)
        k = self.ecount
        e = &self.ents[k]
        memset(e, 0, sizeof(Entry))
        e.frag = frag
        e.frag_len = <int32_t>n
        e.prompt = count(prompt)
        e.max_tokens = -1 if max_tokens is None else max_tokens
        e.volatile = volatile
        e.gen = self.gen
        self.serials += 1
        e.serial = self.serials
        e.rid = <PyObject*>rid
        bear_incref(<PyObject*>r)
        e.req = <PyObject*>r
        self.ecount += 1
        mask = self.tcap - 1
        i = ptr_hash(e.req) & mask
        while self.by_req[i]:
            i = (i + 1) & mask
        self.by_req[i] = <int32_t>(k + 1)
        i = ptr_hash(e.rid) & mask
        while self.by_rid[i]:
            i = (i + 1) & mask
        self.by_rid[i] = <int32_t>(k + 1)
        return k

    @property
    def cached(self):
        """Requests in the table."""
        return self.ecount

    # -- capture -------------------------------------------------------------

    cdef int _reserve_frame(self, Frame* f, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        if n <= f.cap:
            return 0
        cap = n if n > 2 * f.cap else 2 * f.cap
        mem_resize(<void**>&f.rows, cap, sizeof(Row))
        f.cap = cap
        return 0

    cdef int _reserve_run(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        if n <= self.run_cap:
            return 0
        cap = n if n > 2 * self.run_cap else 2 * self.run_cap
        mem_resize(<void**>&self.run_idx, cap, sizeof(int32_t))
        self.run_cap = cap
        return 0

    cdef int _read(self, Py_ssize_t k, object r, object d, bint running, bint flag) except -1:
        # Read the request's counters into entry k: the truth (and, with
        # `flag`, whether its last chunk completed). Returns 1 when they
        # differed from what the shadow held.
        cdef Entry* e = &self.ents[k]
        cdef int32_t computed = 0, ph = 0, outputs
        cdef int differs
        cdef PyObject* chunk
        if e.volatile:
            e.prompt = count(int_field(d, r, K_PROMPT))
            e.max_tokens = int_field(d, r, K_MAX)
        outputs = count(outputs_of(d, r))
        if running:
            computed = count(int_field(d, r, K_COMPUTED))
            if self.placeholders:
                ph = count(int_field(d, r, K_PH))
        e = &self.ents[k]
        differs = outputs != e.outputs or (running and (computed != e.computed or ph != e.ph))
        e.outputs = outputs
        if running:
            e.computed = computed
            e.ph = ph
            if flag:
                chunk = PyDict_GetItem(d, K_PREFILL_CHUNK) if d is not None else NULL
                value = <object>chunk if chunk != NULL else getattr(r, K_PREFILL_CHUNK, None)
                if value is True or value is False:
                    e.prefilled = not value
                else:
                    # Without the flag: caught up with its known tokens and sampled before.
                    e.prefilled = outputs + ph >= 1 and computed >= e.prompt + outputs + ph - 1
        else:
            e.computed = 0
            e.ph = 0
            e.prefilled = 0
        return differs

    cdef inline bint _audited(self, Py_ssize_t pos) noexcept:
        # A window of `audit` positions, [audit_pos, audit_pos + audit) modulo
        # the previous capture's size, that moves on by as much every capture,
        # so that every request is re-read every few captures.
        cdef Py_ssize_t end
        if self.audit < 0:
            return True
        if self.audit == 0:
            return False
        end = self.audit_pos + self.audit
        return (self.audit_pos <= pos < end) or pos + self.last_n < end

    cdef int _row(
        self, Frame* f, PyObject* rp, bint running, bint terms, bint full, Py_ssize_t pos,
    ) except -1:
        # `rp` is borrowed and only hashed unless the request must be read:
        # touching scattered request objects is what a full read costs.
        cdef Py_ssize_t k = self._find_req(rp)
        cdef Entry* e
        cdef Row* row
        cdef object d
        cdef object r
        cdef bint fresh = k < 0
        cdef bint volatile = not fresh and self.ents[k].volatile
        if fresh or full or volatile or self._audited(pos):
            r = <object>rp
            d = dict_of(r)
            if fresh:
                k = self._add(r, d)
            if self._read(k, r, d, running, terms or full or fresh) and not (
                fresh or full or volatile
            ):
                self.mismatches += 1
        e = &self.ents[k]
        e.gen = self.gen
        e.running = running
        if running:
            self.run_idx[self.num_running] = <int32_t>k
        if f.n == f.cap:
            self._reserve_frame(f, f.n + 1)
        row = &f.rows[f.n]
        row.frag = e.frag
        row.frag_len = e.frag_len
        row.running = running
        row.prompt = e.prompt
        row.outputs = e.outputs
        row.max_tokens = e.max_tokens
        if running:
            row.computed = e.computed
            row.ph = e.ph
        else:
            row.computed = 0
            row.ph = 0
        f.n += 1
        f.frag_bytes += e.frag_len
        return 0

    cpdef Py_ssize_t capture(
        self,
        list running,
        tuple waiting,
        int64_t seq,
        double time_s,
        int64_t free_blocks,
        double inflight_s=-1.0,
        bint batch_terms=False,
    ) except -1:
        """Capture the resident requests into the engine's frame.

        Args:
            running: The scheduler's running list, in its order.
            waiting: The waiting queues, in the order the scheduler drains them.
            seq: The document's ``seq``.
            time_s: Capture time (Unix seconds).
            free_blocks: Free KV blocks.
            inflight_s: Remaining time of the batch in flight; negative: unknown.
            batch_terms: Read what :meth:`after_schedule` needs to tell decodes
                from prefills when requests are read in full.

        Returns:
            The number of requests captured.
        """
        cdef Frame* f = &self.frames[self.eng]
        cdef Py_ssize_t i
        cdef Py_ssize_t n = PyList_GET_SIZE(running)
        cdef Py_ssize_t pos = 0
        cdef bint full = not self.shadow
        self.valid = False
        self.num_running = 0
        self.num_waiting = 0
        self.gen += 1
        f.n = 0
        f.frag_bytes = 0
        f.gen = self.gen
        if self.ngraves:
            self._free_graves()
        self._reserve_frame(f, n + 16)
        self._reserve_run(n)
        f.seq = seq
        f.free_blocks = free_blocks
        put_float(f.time_s, time_s)
        if inflight_s >= 0.0:
            put_float(f.inflight_s, inflight_s)
        else:
            f.inflight_s[0] = 0
        for i in range(n):
            self._row(f, PyList_GET_ITEM(running, i), True, batch_terms, full, pos)
            self.num_running += 1
            pos += 1
        for q in waiting:
            if queue_len(q) == 0:
                continue
            for r in queue_iter(q):
                self._row(f, <PyObject*>r, False, False, full, pos)
                self.num_waiting += 1
                pos += 1
        self.last_n = pos
        if self.audit > 0:
            self.audit_pos += self.audit
            if pos:
                self.audit_pos %= pos
        self.valid = True
        if self.ecount > 2 * pos + 64:
            self._rebuild(self.ecap, self.tcap)
        return pos

    # -- the shadow ----------------------------------------------------------

    def after_schedule(self, dict scheduled, object key=None):
        """Note the batch schedule() formed since the last capture; its eq. 12 terms.

        Args:
            scheduled: ``SchedulerOutput.num_scheduled_tokens`` (request id to tokens).
            key: The ``SchedulerOutput`` (:meth:`batch_done` names it again).

        Returns:
            ``(num_seqs, prefill_tokens, decode_tokens, decode_context,
            prefill_attention)``; zeros when no capture preceded it.
        """
        cdef int64_t t[5]
        self._after_schedule(scheduled, t, <PyObject*>key)
        return (t[0], t[1], t[2], t[3], t[4])

    cdef Sampled* _new_batch(self, PyObject* key) noexcept:
        cdef Sampled* b
        if self.blen == 16:
            # Outputs that never came back: forget the oldest.
            self.bhead = (self.bhead + 1) % 16
            self.blen -= 1
        b = &self.batches[(self.bhead + self.blen) % 16]
        self.blen += 1
        b.key = key
        b.n = 0
        return b

    cdef int _record(self, Sampled* b, Entry* e) except -1:
        cdef Py_ssize_t cap
        if b.n == b.cap:
            cap = 2 * b.cap if b.cap else 64
            # b.cap moves only once both arrays have grown.
            mem_resize(<void**>&b.rids, cap, sizeof(PyObject*))
            mem_resize(<void**>&b.serials, cap, sizeof(uint32_t))
            b.cap = cap
        b.rids[b.n] = e.rid
        b.serials[b.n] = e.serial
        b.n += 1
        return 0

    cdef int _after_schedule(self, dict scheduled, int64_t* terms, PyObject* batch) except -1:
        cdef Sampled* b = self._new_batch(batch) if self.shadow else NULL
        cdef Py_ssize_t pos = 0
        cdef PyObject* key
        cdef PyObject* v
        cdef Py_ssize_t k
        cdef Entry* e
        cdef int64_t n, c, ph0
        cdef int64_t seqs = 0, pre = 0, dec = 0, dctx = 0, patt = 0
        cdef bint decode
        memset(terms, 0, 5 * sizeof(int64_t))
        if not self.valid:
            return 0
        self.valid = False  # one batch per capture
        while PyDict_Next(scheduled, &pos, &key, &v):
            n = PyLong_AsLongLong(<object>v)
            if n <= 0:
                continue
            k = self._find_rid(key)
            if k < 0:
                continue
            seqs += 1
            e = &self.ents[k]
            if e.running:
                c = e.computed
                decode = e.prefilled
            else:
                # Admitted by this schedule(): its computed tokens (prefix-cache
                # hits included) are on the request, just written.
                c = (<object>e.req).num_computed_tokens - n
                if c < 0:
                    c = 0
                decode = False
                e = &self.ents[k]
                e.running = True
                e.ph = 0
            if decode:
                dec += n
                dctx += c * n
            else:
                pre += n
                patt += n * c + n * (n + 1) // 2
            ph0 = e.ph
            e.computed = count(c + n)
            # vLLM's Scheduler._update_after_schedule / AsyncScheduler's: a chunk
            # that reaches the known tokens samples (one more placeholder).
            e.prefilled = e.computed >= e.prompt + e.outputs + ph0
            if e.prefilled:
                if self.placeholders:
                    e.ph = count(ph0 + 1)
                if b != NULL:
                    self._record(b, e)
        terms[0] = seqs
        terms[1] = pre
        terms[2] = dec
        terms[3] = dctx
        terms[4] = patt
        return 0

    def batch_done(self, object key=None):
        """Note that the output of the batch scheduled as ``key`` reached the scheduler.

        Batches come back in the order they were scheduled; with ``key`` None the
        oldest is meant.
        """
        self._batch_done(<PyObject*>key)

    cdef int _batch_done(self, PyObject* key) except -1:
        cdef Sampled* b
        cdef Py_ssize_t j, k
        cdef Entry* e
        while self.blen:
            b = &self.batches[self.bhead]
            self.bhead = (self.bhead + 1) % 16
            self.blen -= 1
            if key != <PyObject*>None and b.key != key:
                continue  # a batch whose output never came back
            for j in range(b.n):
                k = self._find_rid(b.rids[j])
                if k < 0 or self.ents[k].serial != b.serials[j]:
                    continue  # gone since
                e = &self.ents[k]
                e.outputs = count(e.outputs + 1)
                if e.ph > 0:
                    e.ph -= 1
            return 0
        return 0

    cpdef int preempted(self, object request) except -1:
        """Note that vLLM preempted ``request`` (its computed tokens are gone)."""
        cdef Py_ssize_t k = self._find_req(<PyObject*>request)
        cdef Entry* e
        if k < 0:
            return 0
        e = &self.ents[k]
        e.computed = 0
        e.ph = 0
        e.prefilled = False
        e.running = False
        return 0

    # -- formatting ----------------------------------------------------------

    def encode(self):
        """Format the last capture into this thread's buffer; returns its length."""
        cdef Py_ssize_t n
        cdef const char* head = self.head
        cdef Py_ssize_t headn = len(self.head)
        with nogil:
            n = format_frame(
                &self.frames[self.eng], head, headn, self.block_size, self.num_blocks,
                &self.eng_out,
            )
        if n < 0:
            raise MemoryError()
        return n

    def payload(self):
        """The document :meth:`encode` formatted last."""
        return self.eng_out.buf[: self.eng_out.length]

    cpdef int commit(self) except -1:
        """Hand the last capture to the publisher thread (an atomic exchange; never waits)."""
        if self.sync == NULL:
            raise RuntimeError("this Capture was not created with threaded=True")
        self.eng = bear_sync_commit(self.sync, self.eng)
        return 0

    def take_and_encode(self):
        """Publisher thread: wait for a committed capture and format it.

        Returns:
            The document's length (:meth:`taken_payload`), or -1 once closed.
        """
        cdef int got
        cdef Py_ssize_t n = 0
        cdef const char* head = self.head
        cdef Py_ssize_t headn = len(self.head)
        if self.sync == NULL:
            raise RuntimeError("this Capture was not created with threaded=True")
        with nogil:
            got = bear_sync_take(self.sync, self.bg)
            if got >= 0:
                self.bg = got
                n = format_frame(
                    &self.frames[got], head, headn, self.block_size, self.num_blocks,
                    &self.bg_out,
                )
        if got < 0:
            return -1
        if n < 0:
            raise MemoryError()
        return n

    def taken_payload(self):
        """The document :meth:`take_and_encode` formatted last."""
        return self.bg_out.buf[: self.bg_out.length]

    def close(self):
        """Stop the publisher thread's wait for good (take_and_encode returns -1)."""
        if self.sync != NULL:
            bear_sync_close(self.sync)


# ---------------------------------------------------------------------------
# The engine thread's hooks
# ---------------------------------------------------------------------------

cdef enum:
    FIFO = 16  # scheduled batches awaiting their output (2 with async scheduling)
    I_DOCUMENT = 1  # hook results: what an inline publisher has to deliver
    I_BATCHES = 2

INLINE_DOCUMENT = I_DOCUMENT
INLINE_BATCHES = I_BATCHES


cdef inline double wall_s() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline double mono_s() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline int64_t mono_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000 + ts.tv_nsec


ctypedef struct Pending:
    PyObject* out  # the SchedulerOutput, compared by address only
    double t_sched
    int64_t seq
    int64_t terms[5]
    bint has_terms

ctypedef struct BatchRec:
    int64_t seq
    double time_s
    int64_t terms[5]
    double duration


cdef class Hooks:
    """What the scheduler plugin calls on vLLM's engine thread, in C.

    Each step would otherwise run a few hundred Python bytecodes of
    bookkeeping, and right after vLLM's own step they run cold: that cost
    more than the capture itself. Every method catches its own failures,
    counts them and reports them through ``on_failure(where, exc)``; none
    raises. Methods return what an inline publisher (``threaded=False``) must
    deliver now: ``INLINE_DOCUMENT`` and/or ``INLINE_BATCHES`` bits.

    Args:
        capture: The capture.
        free_blocks: Returns the free KV blocks (vLLM's block pool method).
        on_failure: Called with ``(where, exception)`` on each failure.
        threaded: Documents go through ``capture.commit`` to a publisher thread.
        batch_time: Eq. 12 coefficients ``(b0, b1, b2, b3)`` for
            ``inflight.remaining_s``, or None.
        batch_buffer: Batch records kept until taken (the oldest go first).
    """

    cdef Capture cap
    cdef object free_fn
    cdef object on_failure
    cdef readonly bint threaded
    cdef public bint want_terms
    cdef bint has_model
    cdef double b0, b1, b2, b3
    cdef readonly int64_t seq
    cdef readonly int64_t captures
    cdef readonly int64_t failures
    cdef readonly int64_t batches
    cdef readonly int64_t dropped
    cdef readonly int64_t engine_ns  # time spent in the hooks (their own measure)
    cdef int64_t hook_ns[4]  # the same by hook: before/after schedule, before update, change
    cdef Pending fifo[FIFO]
    cdef int fifo_head
    cdef int fifo_len
    cdef double last_done
    cdef BatchRec* ring
    cdef Py_ssize_t ring_cap
    cdef Py_ssize_t ring_head
    cdef Py_ssize_t ring_len
    cdef readonly bint closed

    def __cinit__(self):
        self.ring = NULL

    def __init__(
        self, Capture capture, object free_blocks, object on_failure, bint threaded,
        object batch_time=None, Py_ssize_t batch_buffer=4096,
    ):
        self.cap = capture
        self.free_fn = free_blocks
        self.on_failure = on_failure
        self.threaded = threaded
        self.has_model = batch_time is not None
        if self.has_model:
            self.b0, self.b1, self.b2, self.b3 = batch_time
        self.want_terms = self.has_model
        self.seq = 0
        self.captures = 0
        self.failures = 0
        self.batches = 0
        self.dropped = 0
        self.engine_ns = 0
        memset(self.hook_ns, 0, sizeof(self.hook_ns))
        self.fifo_head = 0
        self.fifo_len = 0
        self.last_done = 0.0
        self.closed = False
        self.ring_cap = batch_buffer if batch_buffer > 0 else 1
        self.ring = <BatchRec*>calloc(self.ring_cap, sizeof(BatchRec))
        if self.ring == NULL:
            raise MemoryError()
        self.ring_head = 0
        self.ring_len = 0

    def __dealloc__(self):
        free(self.ring)

    cdef void _fail(self, str where, BaseException exc) noexcept:
        self.failures += 1
        try:
            self.on_failure(where, exc)
        except Exception:
            pass  # the failure is counted; a broken logger must not reach the engine

    cdef double _inflight(self) noexcept:
        # The batch in flight is the oldest one scheduled and not yet back.
        cdef Pending* p
        cdef double predicted, start
        if not self.has_model or self.fifo_len == 0:
            return -1.0
        p = &self.fifo[self.fifo_head]
        if not p.has_terms:
            return -1.0
        predicted = (
            self.b0 + self.b1 * (p.terms[1] + p.terms[2])
            + self.b2 * p.terms[3] + self.b3 * p.terms[4]
        )
        start = p.t_sched if p.t_sched > self.last_done else self.last_done
        predicted -= mono_s() - start
        return predicted if predicted > 0.0 else 0.0

    def before_schedule(self, sched):
        """Start of ``schedule()``: capture the resident requests."""
        cdef int64_t t0 = mono_ns()
        cdef int r = self._before_schedule(sched)
        t0 = mono_ns() - t0
        self.engine_ns += t0
        self.hook_ns[0] += t0
        return r

    cdef int _before_schedule(self, object sched):
        if self.closed:
            return 0
        try:
            running = sched.running
            waiting = (sched.kv_holding_waiting, sched.waiting)
            free = self.free_fn()
            self.seq += 1
            self.cap.capture(
                running, waiting, self.seq, wall_s(), free, self._inflight(), self.want_terms
            )
            self.captures += 1
            if self.threaded:
                self.cap.commit()
                return 0
            return I_DOCUMENT
        except Exception as exc:
            self._fail("capture", exc)
            return 0

    def after_schedule(self, out):
        """End of ``schedule()``: the batch's terms, and the shadow's scheduled tokens."""
        cdef int64_t t0 = mono_ns()
        self._after_schedule(out)
        t0 = mono_ns() - t0
        self.engine_ns += t0
        self.hook_ns[1] += t0
        return 0

    cdef int _after_schedule(self, object out):
        cdef Pending* p
        cdef int64_t t[5]
        cdef bint wanted
        cdef int i
        if self.closed:
            return 0
        try:
            scheduled = out.num_scheduled_tokens
            wanted = self.want_terms and out.total_num_scheduled_tokens > 0
            memset(t, 0, sizeof(t))
            if self.cap.shadow or wanted:
                self.cap._after_schedule(scheduled, t, <PyObject*>out)
            if self.fifo_len == FIFO:
                self.fifo_head = (self.fifo_head + 1) % FIFO
                self.fifo_len -= 1
            p = &self.fifo[(self.fifo_head + self.fifo_len) % FIFO]
            self.fifo_len += 1
            p.out = <PyObject*>out
            p.t_sched = mono_s()
            p.seq = self.seq
            p.has_terms = wanted
            for i in range(5):
                p.terms[i] = t[i]
        except Exception as exc:
            self._fail("batch terms", exc)
        return 0

    def before_update(self, out, model_output):
        """Start of ``update_from_output()``: the batch is done; its record.

        ``model_output`` (the ``ModelRunnerOutput``) is not read: a completed
        chunk sampled one token (see the module comment).
        """
        cdef int64_t t0 = mono_ns()
        cdef int r = self._before_update(out)
        t0 = mono_ns() - t0
        self.engine_ns += t0
        self.hook_ns[2] += t0
        return r

    cdef int _before_update(self, object out):
        cdef Pending* p
        cdef Pending found
        cdef bint hit = False
        cdef double now, last, start, duration
        cdef BatchRec* rec
        cdef int i
        if self.closed:
            return 0
        if self.cap.shadow:
            try:
                self.cap._batch_done(<PyObject*>out)
            except Exception as exc:
                self._fail("sampled tokens", exc)
        now = mono_s()
        while self.fifo_len:
            p = &self.fifo[self.fifo_head]
            self.fifo_head = (self.fifo_head + 1) % FIFO
            self.fifo_len -= 1
            if p.out == <PyObject*>out:
                found = p[0]
                hit = True
                break
        last = self.last_done
        self.last_done = now
        if not hit or not found.has_terms or found.terms[1] + found.terms[2] <= 0:
            return 0
        # The batch ran once it was scheduled and the batch ahead of it, if
        # any, had returned its output.
        start = found.t_sched if found.t_sched > last else last
        duration = now - start
        if duration <= 0.0:
            return 0
        if self.ring_len == self.ring_cap:
            self.ring_head = (self.ring_head + 1) % self.ring_cap
            self.ring_len -= 1
            self.dropped += 1
        rec = &self.ring[(self.ring_head + self.ring_len) % self.ring_cap]
        self.ring_len += 1
        rec.seq = found.seq
        rec.time_s = wall_s()
        for i in range(5):
            rec.terms[i] = found.terms[i]
        rec.duration = duration
        self.batches += 1
        return 0 if self.threaded else I_BATCHES

    def after_change(self, sched):
        """After ``update_from_output()`` or an abort: capture once more if now idle."""
        cdef int64_t t0 = mono_ns()
        cdef int r = self._after_change(sched)
        t0 = mono_ns() - t0
        self.engine_ns += t0
        self.hook_ns[3] += t0
        return r

    cdef int _after_change(self, object sched):
        if self.closed:
            return 0
        try:
            # Resident requests mean a schedule() is coming, which captures.
            if (
                len(sched.running)
                or queue_len(sched.waiting)
                or queue_len(sched.kv_holding_waiting)
            ):
                return 0
            if sched.has_requests():
                return 0
        except Exception as exc:
            self._fail("read scheduler state", exc)
            return 0
        return self._before_schedule(sched)

    def preempted(self, request):
        """vLLM preempted ``request``."""
        cdef int64_t t0 = mono_ns()
        if self.closed or not self.cap.shadow:
            return 0
        try:
            self.cap.preempted(request)
        except Exception as exc:
            self._fail("preemption", exc)
        self.engine_ns += mono_ns() - t0
        return 0

    @property
    def cost_ns(self):
        """Time spent in each hook so far: before_schedule, after_schedule,
        before_update, after_change (ns)."""
        return (self.hook_ns[0], self.hook_ns[1], self.hook_ns[2], self.hook_ns[3])

    def take_batches(self):
        """The batch records not taken yet, oldest first (``BatchTuple``s)."""
        cdef list out = []
        cdef BatchRec* r
        while self.ring_len:
            r = &self.ring[self.ring_head]
            out.append(
                (r.seq, r.time_s, r.terms[0], r.terms[1], r.terms[2], r.terms[3], r.terms[4],
                 r.duration)
            )
            self.ring_head = (self.ring_head + 1) % self.ring_cap
            self.ring_len -= 1
        return out

    def close(self):
        """Stop: hooks do nothing from now on."""
        self.closed = True
