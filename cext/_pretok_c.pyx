# Compiled twin of bearsdk/prompts/_pretok_py.py: byte-level BPE on plain text,
# cut as the tokenizer cuts it, each piece's ids kept in a table.
#
# The pure-Python module is the reference and the test oracle (its regular
# expressions are the tokenizers' own, restricted to ASCII); this one must give
# the same pieces and ids for every text, or None where the twin does
# (tests/test_pretok.py runs both against the tokenizers library).
#
# Each family's expression is a hand-written matcher here: at each position the
# first alternative that matches, with the backtracking the regex engine would
# do spelt out (a whitespace run that gives its last character back to the
# word after it, a run of newlines that ends the whitespace before it). It runs
# over the text's UTF-8 bytes with a class per byte (every byte of a character
# has the character's class), so that a run never ends inside a character.
#
# Kept pieces live in two arenas (their bytes, their ids) under an
# open-addressing table at most half full. Past max_pieces pieces, or past the
# arenas' caps, everything kept is dropped and the table starts over: memory
# stays bounded whatever text arrives.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy, memset
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromLong
from cpython.ref cimport Py_INCREF

cimport _mem

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object o, Py_ssize_t* size) except NULL
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)

__all__ = ["FAMILIES", "MAX_PIECES", "MAX_PIECE_BYTES", "PieceEncoder"]

FAMILIES = ("gpt2", "llama3", "qwen2")
MAX_PIECE_BYTES = 64
MAX_PIECES = 1 << 24

cdef enum:
    PIECE_MAX = 64
    # Arena caps per kept piece, on average (pieces are words: a few bytes, an id or two).
    KEY_BYTES_EACH = 16
    IDS_EACH = 8
    MAX_ID = 0x7FFFFFFF
    PIECES_CAP = 1 << 24

cdef enum:
    C_BAD = 0   # not accepted: the twin's None
    C_L = 1     # [A-Za-z], the Latin-1 letters
    C_N = 2     # [0-9]
    C_P = 3     # the rest of printable ASCII but space; the twin's MARKS
    C_SP = 4    # space
    C_TAB = 5   # tab
    C_NL = 6    # LF, CR

cdef uint8_t CLS[128]


cdef void _init_classes() noexcept:
    cdef int c
    for c in range(128):
        CLS[c] = C_BAD
    for c in range(0x21, 0x7F):
        CLS[c] = C_P
    for c in range(ord("a"), ord("z") + 1):
        CLS[c] = C_L
    for c in range(ord("A"), ord("Z") + 1):
        CLS[c] = C_L
    for c in range(ord("0"), ord("9") + 1):
        CLS[c] = C_N
    CLS[0x20] = C_SP
    CLS[0x09] = C_TAB
    CLS[0x0A] = C_NL
    CLS[0x0D] = C_NL


_init_classes()


cdef inline Py_ssize_t run_of(const uint8_t* k, Py_ssize_t i, Py_ssize_t n, int c) noexcept nogil:
    while i < n and k[i] == c:
        i += 1
    return i


cdef inline Py_ssize_t ws_run(const uint8_t* k, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and k[i] >= C_SP:
        i += 1
    return i


cdef inline Py_ssize_t width(const uint8_t* s, Py_ssize_t i) noexcept nogil:
    # Bytes of the character at i (an accepted one: 1, 2 for Latin-1, 3 for a mark).
    return 1 if s[i] < 0x80 else (2 if s[i] < 0xE0 else 3)


cdef inline bint is_mark(uint8_t b) noexcept nogil:
    # The third byte of E2 80 xx: – — ‘ ’ “ ” • …
    return (b == 0x93 or b == 0x94 or b == 0x98 or b == 0x99 or b == 0x9C or b == 0x9D
            or b == 0xA2 or b == 0xA6)


cdef Py_ssize_t classify(const uint8_t* s, Py_ssize_t n, uint8_t* k) noexcept nogil:
    """Each byte's class into k; -1 at the first character not accepted."""
    cdef Py_ssize_t i = 0
    cdef uint8_t b, b2
    while i < n:
        b = s[i]
        if b < 0x80:
            k[i] = CLS[b]
            if k[i] == C_BAD:
                return -1
            i += 1
        elif b == 0xC3 and i + 1 < n and 0x80 <= s[i + 1] <= 0xBF and s[i + 1] != 0x97 and s[i + 1] != 0xB7:
            k[i] = C_L
            k[i + 1] = C_L
            i += 2
        elif b == 0xE2 and i + 2 < n and s[i + 1] == 0x80 and is_mark(s[i + 2]):
            k[i] = C_P
            k[i + 1] = C_P
            k[i + 2] = C_P
            i += 3
        else:
            return -1
    return n


cdef inline uint8_t lower(uint8_t c) noexcept nogil:
    return c | 0x20 if 0x41 <= c <= 0x5A else c


cdef inline Py_ssize_t contraction(const uint8_t* s, Py_ssize_t i, Py_ssize_t n, bint fold) noexcept nogil:
    """End of 's 't 're 've 'm 'll 'd at i (case-folded with fold), or 0."""
    cdef uint8_t d, e
    if s[i] != 0x27 or i + 1 >= n:
        return 0
    d = lower(s[i + 1]) if fold else s[i + 1]
    if d == 0x73 or d == 0x74 or d == 0x6D or d == 0x64:  # s t m d
        return i + 2
    if i + 2 < n:
        e = lower(s[i + 2]) if fold else s[i + 2]
        # re ve ll
        if (d == 0x72 and e == 0x65) or (d == 0x76 and e == 0x65) or (d == 0x6C and e == 0x6C):
            return i + 3
    return 0


cdef inline Py_ssize_t spaces(const uint8_t* k, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    # \s+(?!\S) then \s+: a run followed by a non-space keeps its last
    # character for what follows (unless it is the run's only one).
    cdef Py_ssize_t e = ws_run(k, i, n)
    if e == n or e - 1 == i:
        return e
    return e - 1


cdef Py_ssize_t cut_gpt2(const uint8_t* s, const uint8_t* k, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    # 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    cdef Py_ssize_t j = contraction(s, i, n, False)
    cdef int c
    if j:
        return j
    j = i + (s[i] == 0x20)
    if j < n:
        c = k[j]
        if c == C_L or c == C_N or c == C_P:
            return run_of(k, j, n, c)
    return spaces(k, i, n)


cdef Py_ssize_t cut_llama(const uint8_t* s, const uint8_t* k, Py_ssize_t i, Py_ssize_t n,
                          Py_ssize_t digits) noexcept nogil:
    # (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,digits}
    # | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
    cdef Py_ssize_t j = contraction(s, i, n, True), e, last
    cdef int c = k[i]
    if j:
        return j
    if c == C_L:
        return run_of(k, i, n, C_L)
    j = i + width(s, i)
    if c != C_NL and c != C_N and j < n and k[j] == C_L:
        return run_of(k, j, n, C_L)
    if c == C_N:
        e = run_of(k, i, n, C_N)
        return e if e - i <= digits else i + digits
    j = i + (c == C_SP)
    if j < n and k[j] == C_P:
        e = run_of(k, j, n, C_P)
        return run_of(k, e, n, C_NL)
    # Whitespace: through its last newline if it has one.
    e = ws_run(k, i, n)
    last = -1
    for j in range(i, e):
        if k[j] == C_NL:
            last = j
    if last >= 0:
        return last + 1
    return spaces(k, i, n)


cdef inline Py_ssize_t cut(int family, const uint8_t* s, const uint8_t* k, Py_ssize_t i,
                           Py_ssize_t n) noexcept nogil:
    if family == 0:
        return cut_gpt2(s, k, i, n)
    return cut_llama(s, k, i, n, 3 if family == 1 else 1)


cdef inline uint64_t fnv(const uint8_t* s, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = 0xCBF29CE484222325ULL
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ s[i]) * 0x100000001B3ULL
    h ^= h >> 29
    return h if h else 1


ctypedef struct Ent:
    uint64_t h          # 0: empty
    uint32_t key_off
    uint32_t ids_off
    uint16_t key_len
    uint16_t n_ids


cdef class PieceEncoder:
    """Cuts text as a byte-level BPE tokenizer does and keeps each piece's ids.

    Args:
        family: One of :data:`FAMILIES`.
        bpe: The ids of one piece, as the tokenizer's model gives them (called
            for pieces not kept yet).
        max_pieces: Most pieces kept; past it the table starts over.
    """

    cdef readonly str family
    cdef readonly int64_t max_pieces
    cdef object _bpe
    cdef int _fam
    cdef Ent* _tab
    cdef int64_t _mask
    cdef int64_t _n
    cdef uint8_t* _keys
    cdef int64_t _keys_n
    cdef int64_t _keys_cap
    cdef int32_t* _ids
    cdef int64_t _ids_n
    cdef int64_t _ids_cap
    cdef int64_t* _out
    cdef int64_t _out_cap
    cdef uint8_t* _cls      # the text's class per byte (scratch)
    cdef int64_t _cls_cap

    def __cinit__(self, family, bpe, max_pieces=1 << 18):
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)} (got {family!r})")
        if type(max_pieces) is not int or not 0 < max_pieces <= PIECES_CAP:
            raise ValueError(f"max_pieces must be an int in 1..{PIECES_CAP} (got {max_pieces!r})")
        self.family = family
        self._fam = FAMILIES.index(family)
        self.max_pieces = max_pieces
        self._bpe = bpe
        self._mask = 255
        self._tab = <Ent*>_mem.mem_alloc(self._mask + 1, sizeof(Ent))
        memset(self._tab, 0, sizeof(Ent) * (self._mask + 1))

    def __dealloc__(self):
        free(self._tab)
        free(self._keys)
        free(self._ids)
        free(self._out)
        free(self._cls)

    @property
    def kept(self):
        """Pieces kept now."""
        return self._n

    def pieces(self, text):
        """``text`` cut into pieces, or ``None`` when it has a character the cut is not exact on."""
        cdef const uint8_t* s
        cdef Py_ssize_t n, i = 0, j
        cdef list out = []
        s = self._read(text, &n)
        if s == NULL:
            return None
        while i < n:
            j = cut(self._fam, s, self._cls, i, n)
            out.append(PyUnicode_DecodeUTF8(<const char*>s + i, j - i, NULL))
            i = j
        return out

    def encode(self, text):
        """``text``'s ids, or ``None`` (see :meth:`pieces`)."""
        cdef const uint8_t* s
        cdef Py_ssize_t n, i = 0, j
        cdef int64_t nout = 0, k
        cdef Ent* e
        cdef list res
        cdef object v
        s = self._read(text, &n)
        if s == NULL:
            return None
        while i < n:
            j = cut(self._fam, s, self._cls, i, n)
            e = self._find(s + i, j - i)
            if e == NULL:
                nout = self._miss(s + i, j - i, nout)
            else:
                _mem.mem_reserve(<void**>&self._out, &self._out_cap, nout + e.n_ids, 256, sizeof(int64_t))
                for k in range(e.n_ids):
                    self._out[nout + k] = self._ids[e.ids_off + k]
                nout += e.n_ids
            i = j
        res = PyList_New(nout)
        for k in range(nout):
            v = PyLong_FromLong(self._out[k])
            Py_INCREF(v)
            PyList_SET_ITEM(res, k, v)
        return res

    cdef const uint8_t* _read(self, text, Py_ssize_t* n) except? NULL:
        """The text's UTF-8 bytes, each byte's class in _cls; NULL where a character is not accepted."""
        cdef const uint8_t* s
        if type(text) is not str:
            raise TypeError(f"text must be a str (got {type(text).__name__})")
        # For ASCII text CPython hands out its own buffer: no copy.
        try:
            s = <const uint8_t*>PyUnicode_AsUTF8AndSize(text, n)
        except UnicodeEncodeError:  # a lone surrogate: not accepted either
            return NULL
        _mem.mem_reserve(<void**>&self._cls, &self._cls_cap, n[0], 4096, 1)
        if classify(s, n[0], self._cls) < 0:
            return NULL
        return s

    cdef Ent* _find(self, const uint8_t* p, Py_ssize_t n) noexcept:
        cdef uint64_t h
        cdef int64_t i
        cdef Ent* e
        if n > PIECE_MAX:
            return NULL
        h = fnv(p, n)
        i = <int64_t>(h & <uint64_t>self._mask)
        while True:
            e = &self._tab[i]
            if e.h == 0:
                return NULL
            if e.h == h and e.key_len == n and memcmp(self._keys + e.key_off, p, n) == 0:
                return e
            i = (i + 1) & self._mask

    cdef int64_t _miss(self, const uint8_t* p, Py_ssize_t n, int64_t nout) except -1:
        """Append the piece's ids from the tokenizer's model, and keep them if it is short."""
        cdef object got = self._bpe(PyUnicode_DecodeUTF8(<const char*>p, n, NULL))
        cdef Py_ssize_t m = len(got), k
        cdef int64_t v
        _mem.mem_reserve(<void**>&self._out, &self._out_cap, nout + m, 256, sizeof(int64_t))
        for k in range(m):
            v = got[k]
            if not 0 <= v <= MAX_ID:
                raise ValueError(f"bpe: token id must be in 0..{MAX_ID} (got {v})")
            self._out[nout + k] = v
        if n <= PIECE_MAX and m <= 0xFFFF:
            self._keep(p, n, self._out + nout, m)
        return nout + m

    cdef int _keep(self, const uint8_t* p, Py_ssize_t n, const int64_t* ids, Py_ssize_t m) except -1:
        cdef uint64_t h = fnv(p, n)
        cdef int64_t i, k
        cdef Ent* e
        if (self._n >= self.max_pieces
                or self._keys_n + n > KEY_BYTES_EACH * self.max_pieces
                or self._ids_n + m > IDS_EACH * self.max_pieces):
            self._n = 0
            self._keys_n = 0
            self._ids_n = 0
            memset(self._tab, 0, sizeof(Ent) * (self._mask + 1))
        if (self._n + 1) * 2 > self._mask + 1:
            self._grow()
        _mem.mem_reserve(<void**>&self._keys, &self._keys_cap, self._keys_n + n, 4096, 1)
        _mem.mem_reserve(<void**>&self._ids, &self._ids_cap, self._ids_n + m, 1024, sizeof(int32_t))
        i = <int64_t>(h & <uint64_t>self._mask)
        while self._tab[i].h != 0:
            i = (i + 1) & self._mask
        e = &self._tab[i]
        e.h = h
        e.key_off = <uint32_t>self._keys_n
        e.key_len = <uint16_t>n
        e.ids_off = <uint32_t>self._ids_n
        e.n_ids = <uint16_t>m
        memcpy(self._keys + self._keys_n, p, n)
        for k in range(m):
            self._ids[self._ids_n + k] = <int32_t>ids[k]
        self._keys_n += n
        self._ids_n += m
        self._n += 1
        return 0

    cdef int _grow(self) except -1:
        """Double the table (a new one: the old stays valid if that fails)."""
        cdef int64_t cap = (self._mask + 1) * 2, i, j
        cdef Ent* nw = <Ent*>_mem.mem_alloc(cap, sizeof(Ent))
        memset(nw, 0, sizeof(Ent) * cap)
        for i in range(self._mask + 1):
            if self._tab[i].h != 0:
                j = <int64_t>(self._tab[i].h & <uint64_t>(cap - 1))
                while nw[j].h != 0:
                    j = (j + 1) & (cap - 1)
                nw[j] = self._tab[i]
        free(self._tab)
        self._tab = nw
        self._mask = cap - 1
        return 0
