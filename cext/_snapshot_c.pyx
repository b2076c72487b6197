# Compiled fast path of the bear.snapshot/1 decoder (bearsdk._snapshot_c).
#
# bearsdk/snapshot.py is the reference: orjson parses the document into Python
# objects, then every field is validated in Python. At 64 resident requests that
# costs several hundred microseconds, mostly building and re-reading one dict per
# request. This module scans the JSON bytes once, validates each field as it
# goes and writes the int64 table directly; only the request ids become Python
# objects.
#
# Contract: decode(data) returns the snapshot's parts when the document is a
# valid snapshot it fully understands, and None otherwise. None is never an
# error: the caller then runs the reference decoder, which either raises the
# reference error message or (for the rare valid document this scanner is too
# conservative for, e.g. a string with escapes) returns the snapshot. So the
# fast path never has to reproduce an error message, and it must only ever
# accept what the reference accepts, with identical values; a differential
# property test pins that.
#
# What makes the scanner bail out (returns None) although the JSON may be fine:
# backslash escapes in any string the decoder reads (ids, names, keys), non-ASCII
# bytes in keys or in skipped values, numbers of more than 18 digits, skipped
# numbers that might overflow a double, nesting deeper than MAX_DEPTH, and
# duplicate keys (orjson keeps the last one; rather than mirror that, defer).

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.math cimport isfinite
from libc.stdint cimport int64_t
from libc.string cimport memcmp, memcpy

import numpy as np

IMPLEMENTATION = "cython"

cdef extern from "Python.h":
    double PyOS_string_to_double(
        const char* s, char** endptr, PyObject* overflow_exception
    ) except? -1.0

cdef enum:
    NCOLS = 7
    MAX_DEPTH = 64
    MAX_DIGITS = 18  # below 10**18, so any sum of three stays inside int64
    MAX_FLOAT_CHARS = 63
    # Top-level keys seen (duplicates defer to the reference).
    K_SCHEMA = 1
    K_INSTANCE = 2
    K_SEQ = 4
    K_TIME = 8
    K_KV = 16
    K_REQUESTS = 32
    K_INFLIGHT = 64
    K_EPOCH = 128
    # Request keys seen.
    R_ID = 1
    R_STATE = 2
    R_PROMPT = 4
    R_COMPUTED = 8
    R_OUTPUT = 16
    R_MAX = 32
    R_OLEN = 64
    R_PH = 128
    R_REQUIRED = 31
    # Numbers.
    N_INT = 1
    N_FLOAT = 2
    N_NULL = 3

ctypedef unsigned char uchar

# Physical bounds. bearsdk/snapshot.py defines them and hands them over at
# import (_set_limits), so both decoders enforce one set. Until then every
# document with a kv or a request defers to the reference (the zeros below).
cdef int64_t LIM_BLOCK_SIZE = 0
cdef int64_t LIM_NUM_BLOCKS = 0
cdef int64_t LIM_REQUEST_TOKENS = 0
cdef int64_t LIM_PLACEHOLDERS = 0
cdef int64_t LIM_REQUESTS = 0
cdef int64_t LIM_TOTAL_TOKENS = 0
cdef int64_t LIM_ID_BYTES = 0
cdef double LIM_INFLIGHT_S = 0.0


def _set_limits(long long block_size, long long num_blocks, long long request_tokens,
                long long placeholders, long long requests, long long total_tokens,
                long long id_chars, double inflight_s):
    """Install the bounds of bearsdk.snapshot (called once, at its import)."""
    global LIM_BLOCK_SIZE, LIM_NUM_BLOCKS, LIM_REQUEST_TOKENS, LIM_PLACEHOLDERS
    global LIM_REQUESTS, LIM_TOTAL_TOKENS, LIM_ID_BYTES, LIM_INFLIGHT_S
    # Sums of a few bounded values must stay far inside int64 (the scanner
    # already defers on integers of more than 18 digits).
    if not (0 < block_size <= 2**20 and 0 < num_blocks <= 2**40 and 0 < request_tokens <= 2**40
            and 0 <= placeholders <= 2**40 and 0 < requests <= 2**30
            and 0 < total_tokens <= 2**50 and 0 < id_chars <= 2**20 and inflight_s >= 0.0):
        raise ValueError("snapshot limits out of range")
    LIM_BLOCK_SIZE = block_size
    LIM_NUM_BLOCKS = num_blocks
    LIM_REQUEST_TOKENS = request_tokens
    LIM_PLACEHOLDERS = placeholders
    LIM_REQUESTS = requests
    LIM_TOTAL_TOKENS = total_tokens
    # Bytes, not characters: a longer non-ASCII name defers to the reference.
    LIM_ID_BYTES = id_chars
    LIM_INFLIGHT_S = inflight_s

ctypedef struct Cursor:
    const uchar* p
    const uchar* end

ctypedef struct Num:
    int kind
    int64_t i
    const uchar* s
    Py_ssize_t n

ctypedef struct Str:
    const uchar* s
    Py_ssize_t n
    bint ascii


# ---------------------------------------------------------------------------
# Scanning primitives. Each returns 0 on success and -1 to bail out.
# ---------------------------------------------------------------------------

cdef inline void skip_ws(Cursor* c) noexcept nogil:
    while c.p < c.end and (c.p[0] == 32 or c.p[0] == 9 or c.p[0] == 10 or c.p[0] == 13):
        c.p += 1


cdef inline int expect(Cursor* c, uchar ch) noexcept nogil:
    skip_ws(c)
    if c.p < c.end and c.p[0] == ch:
        c.p += 1
        return 0
    return -1


cdef inline bint peek(Cursor* c, uchar ch) noexcept nogil:
    skip_ws(c)
    return c.p < c.end and c.p[0] == ch


# Byte classes inside a string: one table load per byte instead of three tests.
cdef enum:
    CH_PLAIN = 0
    CH_QUOTE = 1
    CH_BAD = 2  # control byte or backslash: not handled here
    CH_HIGH = 3  # part of a multi-byte UTF-8 sequence

cdef uchar STR_CLASS[256]


cdef void _init_classes() noexcept:
    cdef int i
    for i in range(256):
        STR_CLASS[i] = CH_BAD if i < 32 else (CH_HIGH if i >= 128 else CH_PLAIN)
    STR_CLASS[34] = CH_QUOTE
    STR_CLASS[92] = CH_BAD


_init_classes()


cdef int scan_str(Cursor* c, Str* out) noexcept nogil:
    # A string without escapes; any control byte or backslash bails out.
    cdef uchar k
    skip_ws(c)
    if c.p >= c.end or c.p[0] != 34:
        return -1
    c.p += 1
    out.s = c.p
    out.ascii = True
    while c.p < c.end:
        k = STR_CLASS[c.p[0]]
        if k != CH_PLAIN:
            if k == CH_QUOTE:
                out.n = c.p - out.s
                c.p += 1
                return 0
            if k == CH_BAD:
                return -1
            out.ascii = False
        c.p += 1
    return -1


cdef int skip_str(Cursor* c) noexcept nogil:
    # A string in a skipped value: simple escapes allowed, \u and non-ASCII bail
    # (orjson validates surrogates and UTF-8; deferring is cheaper than mirroring).
    cdef uchar ch
    if c.p >= c.end or c.p[0] != 34:
        return -1
    c.p += 1
    while c.p < c.end:
        ch = c.p[0]
        if ch == 34:
            c.p += 1
            return 0
        if ch < 32 or ch >= 128:
            return -1
        if ch == 92:
            c.p += 1
            if c.p >= c.end:
                return -1
            ch = c.p[0]
            if not (ch == 34 or ch == 92 or ch == 47 or ch == 98 or ch == 102
                    or ch == 110 or ch == 114 or ch == 116):
                return -1
        c.p += 1
    return -1


cdef int scan_num(Cursor* c, Num* out) noexcept nogil:
    # JSON number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
    cdef bint neg = False
    cdef int digits = 0
    cdef int64_t v = 0
    cdef int exp_digits = 0
    cdef int64_t e = 0
    cdef bint eneg = False
    skip_ws(c)
    out.s = c.p
    if c.p < c.end and c.p[0] == 110:  # null
        if c.end - c.p >= 4 and memcmp(c.p, b"null", 4) == 0:
            c.p += 4
            out.kind = N_NULL
            return 0
        return -1
    if c.p < c.end and c.p[0] == 45:
        neg = True
        c.p += 1
    if c.p >= c.end or not (48 <= c.p[0] <= 57):
        return -1
    if c.p[0] == 48:
        c.p += 1
        digits = 1
        if c.p < c.end and 48 <= c.p[0] <= 57:
            return -1  # leading zero
    else:
        while c.p < c.end and 48 <= c.p[0] <= 57:
            if digits < MAX_DIGITS:
                v = v * 10 + (c.p[0] - 48)
            digits += 1
            c.p += 1
    out.kind = N_INT
    if c.p < c.end and c.p[0] == 46:
        c.p += 1
        if c.p >= c.end or not (48 <= c.p[0] <= 57):
            return -1
        while c.p < c.end and 48 <= c.p[0] <= 57:
            c.p += 1
        out.kind = N_FLOAT
    if c.p < c.end and (c.p[0] == 101 or c.p[0] == 69):
        c.p += 1
        if c.p < c.end and (c.p[0] == 43 or c.p[0] == 45):
            eneg = c.p[0] == 45
            c.p += 1
        if c.p >= c.end or not (48 <= c.p[0] <= 57):
            return -1
        while c.p < c.end and 48 <= c.p[0] <= 57:
            if exp_digits < 6:
                e = e * 10 + (c.p[0] - 48)
            exp_digits += 1
            c.p += 1
        out.kind = N_FLOAT
    out.n = c.p - out.s
    if out.kind == N_INT:
        if digits > MAX_DIGITS:
            return -1  # orjson turns huge integers into floats; defer
        out.i = -v if neg else v
    elif exp_digits > 5 or (not eneg and digits + e > 300):
        return -1  # might overflow a double, which orjson rejects
    return 0


cdef int skip_value(Cursor* c, int depth) noexcept nogil:
    cdef Num num
    if depth > MAX_DEPTH:
        return -1
    skip_ws(c)
    if c.p >= c.end:
        return -1
    cdef uchar ch = c.p[0]
    if ch == 34:
        return skip_str(c)
    if ch == 123:
        c.p += 1
        if peek(c, 125):
            c.p += 1
            return 0
        while True:
            skip_ws(c)
            if skip_str(c) < 0 or expect(c, 58) < 0 or skip_value(c, depth + 1) < 0:
                return -1
            if peek(c, 44):
                c.p += 1
                continue
            return expect(c, 125)
    if ch == 91:
        c.p += 1
        if peek(c, 93):
            c.p += 1
            return 0
        while True:
            if skip_value(c, depth + 1) < 0:
                return -1
            if peek(c, 44):
                c.p += 1
                continue
            return expect(c, 93)
    if ch == 116:
        if c.end - c.p >= 4 and memcmp(c.p, b"true", 4) == 0:
            c.p += 4
            return 0
        return -1
    if ch == 102:
        if c.end - c.p >= 5 and memcmp(c.p, b"false", 5) == 0:
            c.p += 5
            return 0
        return -1
    return scan_num(c, &num)


cdef inline bint key_is(const Str* k, const char* name, Py_ssize_t n) noexcept nogil:
    return k.n == n and memcmp(k.s, name, n) == 0


cdef inline int scan_uint(Cursor* c, int64_t* out) noexcept nogil:
    # A JSON integer >= 0 (not a float, not null, not a bool).
    cdef Num num
    if scan_num(c, &num) < 0 or num.kind != N_INT or num.i < 0:
        return -1
    out[0] = num.i
    return 0


cdef inline int scan_opt_uint(Cursor* c, int64_t* out) noexcept nogil:
    # An integer >= 0, or null (-1).
    cdef Num num
    if scan_num(c, &num) < 0:
        return -1
    if num.kind == N_NULL:
        out[0] = -1
        return 0
    if num.kind != N_INT or num.i < 0:
        return -1
    out[0] = num.i
    return 0


cdef int scan_double(Cursor* c, double* out, bint* is_null) except -2:
    # A finite JSON number as the reference reads it: float(int) or the double.
    cdef Num num
    cdef char tmp[MAX_FLOAT_CHARS + 1]
    if scan_num(c, &num) < 0:
        return -1
    is_null[0] = num.kind == N_NULL
    if num.kind == N_NULL:
        return 0
    if num.kind == N_INT:
        out[0] = <double>num.i
        return 0
    if num.n > MAX_FLOAT_CHARS:
        return -1
    memcpy(tmp, num.s, num.n)
    tmp[num.n] = 0
    # Correctly rounded and locale-independent, as orjson's parser is.
    out[0] = PyOS_string_to_double(tmp, NULL, NULL)
    if not isfinite(out[0]):
        return -1
    return 0


cdef inline int str_value(Cursor* c, Str* out) noexcept nogil:
    # A string, or null (out.s == NULL).
    skip_ws(c)
    if c.end - c.p >= 4 and memcmp(c.p, b"null", 4) == 0:
        c.p += 4
        out.s = NULL
        out.n = 0
        return 0
    return scan_str(c, out)


cdef object to_str(const Str* s):
    # None when the bytes are not valid UTF-8 (orjson rejects those too).
    if s.ascii:
        return PyUnicode_DecodeUTF8(<const char*>s.s, s.n, NULL)
    try:
        return PyUnicode_DecodeUTF8(<const char*>s.s, s.n, NULL)
    except UnicodeDecodeError:
        return None


# ---------------------------------------------------------------------------
# The document.
# ---------------------------------------------------------------------------

cdef class _Rows:
    """A growable int64 row buffer (freed with the object, whatever happens)."""

    cdef int64_t* data
    cdef Py_ssize_t n
    cdef Py_ssize_t cap

    def __cinit__(self):
        self.cap = 64
        self.n = 0
        self.data = <int64_t*>PyMem_Malloc(self.cap * NCOLS * sizeof(int64_t))
        if self.data == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.data)

    cdef int64_t* push(self) except NULL:
        cdef int64_t* grown
        if self.n == self.cap:
            grown = <int64_t*>PyMem_Realloc(self.data, 2 * self.cap * NCOLS * sizeof(int64_t))
            if grown == NULL:
                raise MemoryError()
            self.data = grown
            self.cap *= 2
        self.n += 1
        return self.data + (self.n - 1) * NCOLS


cdef int scan_request(Cursor* c, int64_t* row, Str* rid) noexcept nogil:
    # One request object into a table row; validation as bearsdk.snapshot._row.
    cdef Str key
    cdef Str sv
    cdef int seen = 0
    cdef int bit
    cdef int64_t state = -1
    cdef int64_t prompt = 0, computed = 0, output = 0, mt = -1, ol = -1, ph = 0
    cdef int64_t lo
    if expect(c, 123) < 0:
        return -1
    if peek(c, 125):
        return -1  # required fields missing
    while True:
        if scan_str(c, &key) < 0 or expect(c, 58) < 0:
            return -1
        if key_is(&key, "id", 2):
            bit = R_ID
            if scan_str(c, rid) < 0 or rid.n == 0 or rid.n > LIM_ID_BYTES:
                return -1
        elif key_is(&key, "state", 5):
            bit = R_STATE
            if scan_str(c, &sv) < 0:
                return -1
            if key_is(&sv, "running", 7):
                state = 0
            elif key_is(&sv, "waiting", 7):
                state = 1
            else:
                return -1
        elif key_is(&key, "prompt_tokens", 13):
            bit = R_PROMPT
            if scan_uint(c, &prompt) < 0:
                return -1
        elif key_is(&key, "computed_tokens", 15):
            bit = R_COMPUTED
            if scan_uint(c, &computed) < 0:
                return -1
        elif key_is(&key, "output_tokens", 13):
            bit = R_OUTPUT
            if scan_uint(c, &output) < 0:
                return -1
        elif key_is(&key, "max_tokens", 10):
            bit = R_MAX
            if scan_opt_uint(c, &mt) < 0:
                return -1
        elif key_is(&key, "output_len", 10):
            bit = R_OLEN
            if scan_opt_uint(c, &ol) < 0:
                return -1
        elif key_is(&key, "placeholders", 12):
            bit = R_PH
            if scan_uint(c, &ph) < 0:
                return -1
        else:
            return -1
        if seen & bit:
            return -1
        seen |= bit
        if peek(c, 44):
            c.p += 1
            continue
        if expect(c, 125) < 0:
            return -1
        break
    if (seen & R_REQUIRED) != R_REQUIRED:
        return -1
    if prompt < 1 or prompt > LIM_REQUEST_TOKENS or output > LIM_REQUEST_TOKENS:
        return -1
    if prompt + output > LIM_REQUEST_TOKENS or ph > LIM_PLACEHOLDERS:
        return -1
    if mt > LIM_REQUEST_TOKENS or ol > LIM_REQUEST_TOKENS:
        return -1
    if state == 1:
        if computed != 0 or ph != 0:
            return -1
    elif computed > prompt + output + ph:
        return -1
    if mt == 0:
        return -1
    if ol >= 0:
        lo = output + 1  # a resident request has at least one token to go
        if ol < lo or (mt >= 0 and ol > mt):
            return -1
    if mt >= 0 and output >= mt:
        return -1
    row[0] = state
    row[1] = prompt
    row[2] = computed
    row[3] = output
    row[4] = mt
    row[5] = ol
    row[6] = ph
    return 0


cdef object scan_requests(Cursor* c, _Rows rows, list ids):
    # The requests array; False to bail out.
    cdef Str rid
    cdef int64_t* row
    cdef bint seen_waiting = False
    cdef set seen = set()
    cdef int64_t total = 0
    if expect(c, 91) < 0:
        return False
    if peek(c, 93):
        c.p += 1
        return True
    while True:
        if rows.n >= LIM_REQUESTS:
            return False
        row = rows.push()
        if scan_request(c, row, &rid) < 0:
            return False
        total += row[1] + row[3]
        if total > LIM_TOTAL_TOKENS:
            return False
        if row[0] == 1:
            seen_waiting = True
        elif seen_waiting:
            return False
        name = to_str(&rid)
        if name is None or name in seen:
            return False
        seen.add(name)
        ids.append(name)
        if peek(c, 44):
            c.p += 1
            continue
        if expect(c, 93) < 0:
            return False
        return True


cdef int scan_kv(Cursor* c, int64_t* kv) noexcept nogil:
    cdef Str key
    cdef int seen = 0
    cdef int bit
    if expect(c, 123) < 0 or peek(c, 125):
        return -1
    while True:
        if scan_str(c, &key) < 0 or expect(c, 58) < 0:
            return -1
        if key_is(&key, "block_size", 10):
            bit = 0
        elif key_is(&key, "num_blocks", 10):
            bit = 1
        elif key_is(&key, "free_blocks", 11):
            bit = 2
        else:
            return -1
        if seen & (1 << bit) or scan_uint(c, &kv[bit]) < 0:
            return -1
        seen |= 1 << bit
        if peek(c, 44):
            c.p += 1
            continue
        if expect(c, 125) < 0 or seen != 7:
            return -1
        break
    if kv[0] < 1 or kv[1] < 1 or kv[2] > kv[1]:
        return -1
    if kv[0] > LIM_BLOCK_SIZE or kv[1] > LIM_NUM_BLOCKS:
        return -1
    return 0


cdef int scan_inflight(Cursor* c, double* remaining) except -2:
    # The reference only needs remaining_s; other keys are ignored.
    cdef Str key
    cdef bint found = False
    cdef bint is_null
    if expect(c, 123) < 0 or peek(c, 125):
        return -1
    while True:
        # A non-ASCII key may be invalid UTF-8, which the reference rejects:
        # defer rather than validate it here.
        if scan_str(c, &key) < 0 or not key.ascii or expect(c, 58) < 0:
            return -1
        if key_is(&key, "remaining_s", 11):
            if found or scan_double(c, remaining, &is_null) < 0 or is_null:
                return -1
            found = True
            if not (0.0 <= remaining[0] <= LIM_INFLIGHT_S):
                return -1
        elif skip_value(c, 1) < 0:
            return -1
        if peek(c, 44):
            c.p += 1
            continue
        if expect(c, 125) < 0:
            return -1
        break
    return 0 if found else -1


def decode(data):
    """Scan a snapshot document; its parts, or None to defer to the reference.

    Args:
        data: The JSON bytes (any contiguous byte buffer).

    Returns:
        ``(instance, seq, time, kv, ids, table, inflight_remaining_s, epoch)``
        with ``kv`` a ``(block_size, num_blocks, free_blocks)`` tuple or None,
        or None when the reference decoder must decide.
    """
    cdef const uchar[::1] buf
    try:
        buf = data
    except (TypeError, ValueError, BufferError):
        return None
    if buf.shape[0] == 0:
        return None
    cdef Cursor c
    c.p = &buf[0]
    c.end = c.p + buf.shape[0]
    cdef Str key, sval, instance, epoch
    cdef int seen = 0
    cdef int bit
    cdef int64_t seq = 0
    cdef double t = 0.0
    cdef bint is_null
    cdef int64_t kv[3]
    cdef bint has_kv = False
    cdef double remaining = 0.0
    cdef bint has_inflight = False
    cdef _Rows rows = _Rows()
    cdef list ids = []
    cdef int64_t held = 0
    cdef Py_ssize_t i
    cdef int64_t comp
    epoch.s = NULL

    if expect(&c, 123) < 0 or peek(&c, 125):
        return None
    while True:
        skip_ws(&c)
        if scan_str(&c, &key) < 0 or not key.ascii or expect(&c, 58) < 0:
            return None
        bit = 0
        if key_is(&key, "schema", 6):
            bit = K_SCHEMA
            if scan_str(&c, &sval) < 0 or not key_is(&sval, "bear.snapshot/1", 15):
                return None
        elif key_is(&key, "instance", 8):
            bit = K_INSTANCE
            if scan_str(&c, &instance) < 0 or instance.n == 0 or instance.n > LIM_ID_BYTES:
                return None
        elif key_is(&key, "seq", 3):
            bit = K_SEQ
            if scan_uint(&c, &seq) < 0:
                return None
        elif key_is(&key, "time", 4):
            bit = K_TIME
            if scan_double(&c, &t, &is_null) < 0 or is_null:
                return None
        elif key_is(&key, "kv", 2):
            bit = K_KV
            if peek(&c, 110):
                if str_value(&c, &sval) < 0 or sval.s != NULL:
                    return None
            else:
                if scan_kv(&c, kv) < 0:
                    return None
                has_kv = True
        elif key_is(&key, "inflight", 8):
            bit = K_INFLIGHT
            if peek(&c, 110):
                if str_value(&c, &sval) < 0 or sval.s != NULL:
                    return None
            else:
                if scan_inflight(&c, &remaining) < 0:
                    return None
                has_inflight = True
        elif key_is(&key, "epoch", 5):
            bit = K_EPOCH
            if str_value(&c, &epoch) < 0 or (
                epoch.s != NULL and (epoch.n == 0 or epoch.n > LIM_ID_BYTES)
            ):
                return None
        elif key_is(&key, "requests", 8):
            bit = K_REQUESTS
            if not scan_requests(&c, rows, ids):
                return None
        elif skip_value(&c, 1) < 0:
            return None
        if bit:
            if seen & bit:
                return None
            seen |= bit
        if peek(&c, 44):
            c.p += 1
            continue
        if expect(&c, 125) < 0:
            return None
        break
    skip_ws(&c)
    if c.p != c.end:
        return None
    if (seen & (K_SCHEMA | K_INSTANCE | K_SEQ | K_TIME | K_REQUESTS)) != (
        K_SCHEMA | K_INSTANCE | K_SEQ | K_TIME | K_REQUESTS
    ):
        return None
    if has_kv:
        # Blocks held by the running requests must fit the pool. held never
        # exceeds num_blocks (< 10**18) before one more addend, so no overflow.
        for i in range(rows.n):
            comp = rows.data[i * NCOLS + 2]
            held += (comp + kv[0] - 1) // kv[0]
            if held > kv[1]:
                return None
    name = to_str(&instance)
    if name is None:
        return None
    epoch_name = None
    if epoch.s != NULL:
        epoch_name = to_str(&epoch)
        if epoch_name is None:
            return None
    table = np.empty((rows.n, NCOLS), dtype=np.int64)
    cdef int64_t[:, ::1] tab = table
    if rows.n:
        memcpy(&tab[0, 0], rows.data, rows.n * NCOLS * sizeof(int64_t))
    return (
        name,
        seq,
        t,
        (kv[0], kv[1], kv[2]) if has_kv else None,
        tuple(ids),
        table,
        remaining if has_inflight else None,
        epoch_name,
    )
