# Compiled prompt features and tree-ensemble evaluation (bearsdk.predictors._features_c).
#
# Two hot paths of the accuracy/length/cost predictors, each with a pure-Python
# twin that is the readable reference and the test oracle; tests require
# bit-identical results:
#
# * FeatureExtractor: the prompt features of bearsdk/predictors/_features_py.py,
#   computed in one pass over the prompt's code points (tokenise, hash, count,
#   keyword flags, length constraints, sentence ends), then an exact integer PCA
#   projection. No Python object is created per token.
# * Forest: a LightGBM tree ensemble (bearsdk/predictors/_forest_py.py) walked
#   for a block of rows, trees outer and rows inner so each tree stays in cache
#   while every model of the pool passes through it. Decisions replicate
#   LightGBM's Tree::NumericalDecision / CategoricalDecision and leaf values are
#   summed in tree order, so results equal Booster.predict bit for bit.
#
# Directives are set once in setup.py (BEARSDK_CYTHON_DEBUG=1 turns bounds
# checks back on). Arrays handed to Forest are validated by the Python caller
# (bearsdk.predictors._forest.TreeEnsemble.validate): child indices only grow
# along a path, so every walk ends, and every index is in range.

from libc.math cimport isnan
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memset

from _mem cimport mem_alloc

import numpy as np

from bearsdk.predictors import _lexicon as lx

IMPLEMENTATION = "cython"

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    static inline int bear_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    #else
    static inline int bear_ctz64(unsigned long long x) {
        int n = 0;
        while (!(x & 1ULL)) { x >>= 1; ++n; }
        return n;
    }
    #endif
    """
    int bear_ctz64(unsigned long long x) nogil

cdef extern from "Python.h":
    bint Py_UNICODE_ISSPACE(Py_UCS4 ch) nogil
    bint Py_UNICODE_ISALNUM(Py_UCS4 ch) nogil
    unsigned int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    enum:
        PyUnicode_1BYTE_KIND
        PyUnicode_2BYTE_KIND
        PyUnicode_4BYTE_KIND

# ---------------------------------------------------------------------------
# Hashing and the keyword table
# ---------------------------------------------------------------------------

cdef enum:
    CLS_SPACE = 0
    CLS_ALNUM = 1
    CLS_OTHER = 2
    LEX_SIZE = 1024  # power of two, several times the lexicon size
    N_UNITS = 5

cdef uint64_t FNV_OFFSET = 0xCBF29CE484222325ULL
cdef uint64_t FNV_PRIME = 0x100000001B3ULL

ctypedef struct LexEntry:
    uint64_t key  # full token hash; 0 marks an empty slot
    uint32_t flags
    int32_t unit
    int32_t number

ctypedef fused ucs_t:
    uint8_t
    uint16_t
    uint32_t

cdef LexEntry _lex[LEX_SIZE]
cdef uint8_t _ascii_class[128]
cdef int64_t _number_cap = lx.NUMBER_CAP
cdef int _sign_shift = lx.HASH_SIGN_SHIFT
cdef uint32_t _flag_brevity = lx.FLAG_BREVITY
cdef uint32_t _flag_detail = lx.FLAG_DETAIL
cdef int _n_tasks = len(lx.TASK_FEATURES)
cdef int _n_scalars = len(lx.SCALAR_FEATURES)
cdef double _pca_scale = float(1 << lx.PCA_SCALE_BITS)
# Scalar feature positions, relative to the first scalar (after the PCA block).
cdef int S_TOKENS = lx.SCALAR_FEATURES.index("n_tokens")
cdef int S_CHARS = lx.SCALAR_FEATURES.index("n_chars")
cdef int S_SENTENCES = lx.SCALAR_FEATURES.index("n_sentences")
cdef int S_AVG = lx.SCALAR_FEATURES.index("avg_chars_per_token")
cdef int S_LINES = lx.SCALAR_FEATURES.index("n_lines")
cdef int S_PUNCT = lx.SCALAR_FEATURES.index("frac_punct")
cdef int S_NUMERIC = lx.SCALAR_FEATURES.index("frac_numeric")
cdef int S_QUESTIONS = lx.SCALAR_FEATURES.index("n_questions")
cdef int S_LIMIT_VALUE = lx.SCALAR_FEATURES.index("limit_value")
cdef int S_BREVITY = lx.SCALAR_FEATURES.index("brevity")
cdef int S_DETAIL = lx.SCALAR_FEATURES.index("detail")
cdef int _unit_feature[N_UNITS]


cdef inline uint64_t _fmix64(uint64_t h) noexcept nogil:
    h ^= h >> 33
    h *= 0xFF51AFD7ED558CCDULL
    h ^= h >> 33
    h *= 0xC4CEB9FE1A85EC53ULL
    h ^= h >> 33
    return h


cdef inline const LexEntry* _lookup(uint64_t key) noexcept nogil:
    cdef uint64_t slot = key & (LEX_SIZE - 1)
    while _lex[slot].key != 0:
        if _lex[slot].key == key:
            return &_lex[slot]
        slot = (slot + 1) & (LEX_SIZE - 1)
    return NULL


cdef uint64_t _hash_str(str token):
    cdef uint64_t h = FNV_OFFSET
    cdef Py_UCS4 ch
    for ch in token:
        h = (h ^ <uint64_t>ch) * FNV_PRIME
    return _fmix64(h)


def token_hash(str token):
    """Return the 64-bit hash of an (already lowercased) token."""
    return _hash_str(token)


cdef void _init_tables() except *:
    cdef int c
    cdef uint64_t key, slot
    for c in range(128):
        ch = chr(c)
        _ascii_class[c] = CLS_SPACE if ch.isspace() else (CLS_ALNUM if ch.isalnum() else CLS_OTHER)
    memset(_lex, 0, sizeof(_lex))
    entries = lx.lexicon_entries()
    if len(entries) * 2 > LEX_SIZE:
        raise RuntimeError("keyword lexicon too large for the compiled table")
    for tok, flags, unit, number in entries:
        if not tok.isalnum() or tok != tok.lower():
            raise RuntimeError(f"lexicon token {tok!r} must be lowercase alphanumeric")
        key = _hash_str(tok)
        slot = key & (LEX_SIZE - 1)
        while _lex[slot].key != 0:
            slot = (slot + 1) & (LEX_SIZE - 1)
        _lex[slot].key = key
        _lex[slot].flags = flags
        _lex[slot].unit = unit
        _lex[slot].number = number
    _unit_feature[0] = -1
    _unit_feature[lx.UNIT_WORDS] = lx.SCALAR_FEATURES.index("limit_words")
    _unit_feature[lx.UNIT_SENTENCES] = lx.SCALAR_FEATURES.index("limit_sentences")
    _unit_feature[lx.UNIT_PARAGRAPHS] = lx.SCALAR_FEATURES.index("limit_paragraphs")
    _unit_feature[lx.UNIT_ITEMS] = lx.SCALAR_FEATURES.index("limit_items")


_init_tables()

# ---------------------------------------------------------------------------
# The scan
# ---------------------------------------------------------------------------

ctypedef struct Scan:
    int64_t n_tokens
    int64_t n_punct
    int64_t n_numeric
    int64_t n_questions
    int64_t n_newlines
    int64_t n_sentences
    int64_t limit_value
    uint32_t flags
    int32_t limit[N_UNITS]
    # length-constraint state: token positions of the last number and dash
    int64_t last_num
    int64_t last_num_value
    int64_t dash_pos


cdef inline void _token(Scan* s, uint64_t h, int64_t value, bint digits,
                        int64_t* counts, uint64_t mask) noexcept nogil:
    # One finished alphanumeric token (h already finalised).
    cdef const LexEntry* e = _lookup(h)
    cdef int32_t unit = 0
    cdef int64_t tok = s.n_tokens
    if h >> _sign_shift:
        counts[h & mask] -= 1
    else:
        counts[h & mask] += 1
    if digits:
        s.n_numeric += 1
    else:
        value = -1
    if e != NULL:
        s.flags |= e.flags
        unit = e.unit
        if value < 0 and e.number != 0:
            value = e.number
    if unit != 0 and (s.last_num == tok - 1 or (s.last_num == tok - 2 and s.dash_pos == tok - 1)):
        s.limit[unit] = 1
        if s.limit_value == 0:
            s.limit_value = s.last_num_value
    if value >= 0:
        s.last_num = tok
        s.last_num_value = value
    s.n_tokens = tok + 1


cdef void _scan(const ucs_t* data, Py_ssize_t length, int64_t* counts, uint64_t mask,
                Scan* s) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint32_t c
    cdef int cls
    cdef bint in_word = False
    cdef bint digits = False
    cdef bint pending = False  # an alphanumeric since the last counted sentence end
    cdef bint prev_end = False  # previous char was . ! or ?
    cdef uint64_t h = 0
    cdef int64_t value = 0
    for i in range(length):
        c = data[i]
        if c < 128:
            cls = _ascii_class[c]
        elif Py_UNICODE_ISSPACE(c):
            cls = CLS_SPACE
        elif Py_UNICODE_ISALNUM(c):
            cls = CLS_ALNUM
        else:
            cls = CLS_OTHER
        if prev_end:
            prev_end = False
            if cls == CLS_SPACE and pending:
                s.n_sentences += 1
                pending = False
        if cls == CLS_ALNUM:
            if not in_word:
                in_word = True
                h = FNV_OFFSET
                digits = True
                value = 0
            if 65 <= c <= 90:
                c += 32
            h = (h ^ c) * FNV_PRIME
            if digits:
                if 48 <= c <= 57:
                    value = value * 10 + (c - 48)
                    if value > _number_cap:
                        value = _number_cap
                else:
                    digits = False
            pending = True
            continue
        if in_word:
            in_word = False
            _token(s, _fmix64(h), value, digits, counts, mask)
        if cls == CLS_OTHER:
            # A punctuation token: never a keyword, a number or a unit.
            h = _fmix64((FNV_OFFSET ^ c) * FNV_PRIME)
            if h >> _sign_shift:
                counts[h & mask] -= 1
            else:
                counts[h & mask] += 1
            s.n_punct += 1
            if c == 45:  # '-'
                s.dash_pos = s.n_tokens
            elif c == 63:  # '?'
                s.n_questions += 1
                prev_end = True
            elif c == 46 or c == 33:  # '.' '!'
                prev_end = True
            s.n_tokens += 1
        elif c == 10:
            s.n_newlines += 1
    if in_word:
        _token(s, _fmix64(h), value, digits, counts, mask)
    if pending:
        s.n_sentences += 1


cdef void _scan_str(str text, int64_t* counts, uint64_t mask, Scan* s):
    cdef unsigned int kind = PyUnicode_KIND(text)
    cdef void* data = PyUnicode_DATA(text)
    cdef Py_ssize_t length = PyUnicode_GET_LENGTH(text)
    memset(s, 0, sizeof(Scan))
    s.last_num = -3
    s.dash_pos = -3
    # The GIL stays held: extractors reuse their count buffers across calls, so
    # two threads must not scan with one extractor at once (it is ~20 us).
    if kind == PyUnicode_1BYTE_KIND:
        _scan(<const uint8_t*>data, length, counts, mask, s)
    elif kind == PyUnicode_2BYTE_KIND:
        _scan(<const uint16_t*>data, length, counts, mask, s)
    else:
        _scan(<const uint32_t*>data, length, counts, mask, s)


def hash_counts(str text, Py_ssize_t dim):
    """Return the signed feature-hashing counts of ``text`` in ``dim`` buckets (``int64[dim]``)
    and its token count (colliding signs cancel in the counts, not in the token count)."""
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"dim must be a power of two, got {dim}")
    out = np.zeros(dim, dtype=np.int64)
    cdef int64_t[::1] counts = out
    cdef Scan s
    _scan_str(text, &counts[0], <uint64_t>(dim - 1), &s)
    return out, s.n_tokens


cdef class FeatureExtractor:
    """Computes the prompt part of the feature vector (see ``_features_py``).

    Args:
        components: ``int32[dim, k]`` PCA components scaled by ``2**24``.
        offset: ``float64[k]``: the training mean projected onto the components.
    """

    implementation = IMPLEMENTATION

    cdef int32_t[:, ::1] _w
    cdef double[::1] _offset
    cdef int64_t[::1] _counts
    cdef int64_t[::1] _acc
    cdef readonly Py_ssize_t dim
    cdef readonly Py_ssize_t n_components
    cdef readonly Py_ssize_t n_features

    def __init__(self, components, offset):
        w = np.ascontiguousarray(components, dtype=np.int32)
        off = np.ascontiguousarray(offset, dtype=np.float64)
        dim, k = w.shape
        if dim <= 0 or dim & (dim - 1) or off.shape != (k,):
            raise ValueError(f"components must be [2**b, k] with offset [k]: got {w.shape}")
        self._w = w
        self._offset = off
        self._counts = np.zeros(dim, dtype=np.int64)
        self._acc = np.zeros(k, dtype=np.int64)
        self.dim = dim
        self.n_components = k
        self.n_features = k + _n_scalars + _n_tasks

    def transform_into(self, str text, double[::1] out):
        """Write the prompt features of ``text`` into ``out[: n_features]``."""
        if out.shape[0] < self.n_features:
            raise ValueError(f"out has {out.shape[0]} slots, need {self.n_features}")
        self._transform(text, &out[0])

    cdef void _transform(self, str text, double* out):
        cdef Scan s
        cdef Py_ssize_t n_chars = PyUnicode_GET_LENGTH(text)
        memset(&self._counts[0], 0, self.dim * sizeof(int64_t))
        _scan_str(text, &self._counts[0], <uint64_t>(self.dim - 1), &s)
        self._finish(&s, n_chars, out)

    cdef void _finish(self, const Scan* s, Py_ssize_t n_chars, double* out) noexcept nogil:
        cdef Py_ssize_t j, b, k = self.n_components
        cdef int64_t cnt
        cdef int64_t* acc = &self._acc[0]
        cdef const int32_t* row
        cdef double n = <double>s.n_tokens
        cdef double* sc = out + k
        cdef int bit
        for j in range(k):
            acc[j] = 0
        for b in range(self.dim):
            cnt = self._counts[b]
            if cnt != 0:
                row = &self._w[b, 0]
                for j in range(k):
                    acc[j] += cnt * row[j]
        if s.n_tokens > 0:
            for j in range(k):
                # n * 2**24 is exact; one division and one subtraction, no
                # fused multiply-add, so the twin's numpy result matches.
                out[j] = (<double>acc[j]) / (n * _pca_scale) - self._offset[j]
        else:
            for j in range(k):
                out[j] = 0.0 - self._offset[j]
        for j in range(_n_scalars + _n_tasks):
            sc[j] = 0.0
        sc[S_TOKENS] = n
        sc[S_CHARS] = <double>n_chars
        sc[S_SENTENCES] = <double>s.n_sentences
        sc[S_LINES] = <double>(s.n_newlines + 1) if n_chars > 0 else 0.0
        sc[S_QUESTIONS] = <double>s.n_questions
        if s.n_tokens > 0:
            sc[S_AVG] = (<double>n_chars) / n
            sc[S_PUNCT] = (<double>s.n_punct) / n
            sc[S_NUMERIC] = (<double>s.n_numeric) / n
        for j in range(1, N_UNITS):
            if s.limit[j]:
                sc[_unit_feature[j]] = 1.0
        sc[S_LIMIT_VALUE] = <double>s.limit_value
        if s.flags & _flag_brevity:
            sc[S_BREVITY] = 1.0
        if s.flags & _flag_detail:
            sc[S_DETAIL] = 1.0
        for bit in range(_n_tasks):
            if (s.flags >> bit) & 1:
                sc[_n_scalars + bit] = 1.0

# ---------------------------------------------------------------------------
# Tree ensembles
# ---------------------------------------------------------------------------

ctypedef struct CatRef:
    int32_t offset  # the bitset in cat_words
    int32_t nwords

ctypedef union Split:
    double threshold  # numerical splits
    CatRef cat  # categorical splits

ctypedef struct Node:
    Split split
    int16_t feature
    int16_t left  # child within the tree: < n_internal a node, else a leaf
    int16_t right
    uint8_t decision  # LightGBM's decision_type bits

ctypedef struct Tree:
    int32_t start  # first internal node
    int32_t n_internal  # child indices >= n_internal name leaf (index - n_internal)
    int32_t leaf_start  # first leaf value

cdef double _zero_threshold = float(np.float32(1e-35))  # LightGBM's kZeroThreshold (a float)


cdef inline int32_t _decide(const Node* nd, double fval, const uint32_t* cat_words) noexcept nogil:
    cdef int missing = (nd.decision >> 2) & 3
    cdef int iv
    cdef int32_t word
    if nd.decision & 1:
        # LightGBM casts to int and sends negatives right; NaN and values past
        # INT_MAX cast to INT_MIN on x86, so they go right too.
        if isnan(fval) or fval <= -1.0 or fval >= 2147483648.0:
            return nd.right
        iv = <int>fval
        word = iv >> 5
        if word < nd.split.cat.nwords and (cat_words[nd.split.cat.offset + word] >> (iv & 31)) & 1:
            return nd.left
        return nd.right
    if missing != 0:
        if isnan(fval) and missing != 2:
            fval = 0.0
        if (missing == 1 and -_zero_threshold <= fval <= _zero_threshold) or (
            missing == 2 and isnan(fval)
        ):
            return nd.left if nd.decision & 2 else nd.right
    elif isnan(fval):
        fval = 0.0
    return nd.left if fval <= nd.split.threshold else nd.right


cdef class Forest:
    """A LightGBM tree ensemble in flat arrays (see ``bearsdk.predictors._forest``).

    Construct from :meth:`~bearsdk.predictors._forest.TreeEnsemble.arrays` of a
    validated ensemble.
    """

    implementation = IMPLEMENTATION

    cdef Node* _nodes
    cdef Tree* _trees
    cdef object _keep  # the arrays behind the raw pointers below
    cdef const double* _leaves
    cdef const uint32_t* _cat_words
    cdef const double* _base
    cdef Py_ssize_t _n_base
    cdef Py_ssize_t _base_feature
    cdef readonly Py_ssize_t n_trees
    cdef readonly Py_ssize_t n_features

    def __cinit__(self):
        self._nodes = NULL
        self._trees = NULL

    def __init__(self, feature, threshold, decision, left, right, cat_offset, cat_nwords,
                 cat_words, leaf_value, node_start, leaf_start, base, Py_ssize_t n_features,
                 Py_ssize_t base_feature=-1):
        cdef const int32_t[::1] f = np.ascontiguousarray(feature, dtype=np.int32)
        cdef const double[::1] th = np.ascontiguousarray(threshold, dtype=np.float64)
        cdef const uint8_t[::1] dt = np.ascontiguousarray(decision, dtype=np.uint8)
        cdef const int32_t[::1] lc = np.ascontiguousarray(left, dtype=np.int32)
        cdef const int32_t[::1] rc = np.ascontiguousarray(right, dtype=np.int32)
        cdef const int32_t[::1] co = np.ascontiguousarray(cat_offset, dtype=np.int32)
        cdef const int32_t[::1] cn = np.ascontiguousarray(cat_nwords, dtype=np.int32)
        cdef const int32_t[::1] ns = np.ascontiguousarray(node_start, dtype=np.int32)
        cdef const int32_t[::1] ls = np.ascontiguousarray(leaf_start, dtype=np.int32)
        cdef Py_ssize_t i, t, n = f.shape[0], n_trees = ns.shape[0] - 1
        cdef int32_t k, n_int, start, src, child, total = 0
        leaves = np.ascontiguousarray(leaf_value, dtype=np.float64)
        words = np.ascontiguousarray(cat_words, dtype=np.uint32)
        if words.shape[0] == 0:
            words = np.zeros(1, dtype=np.uint32)  # a valid pointer, never read
        for name, arr in (("threshold", th), ("decision", dt), ("left", lc), ("right", rc),
                          ("cat_offset", co), ("cat_nwords", cn)):
            if arr.shape[0] != n:
                raise ValueError(f"{name} has {arr.shape[0]} entries, feature has {n}")
        if n_trees < 0 or ls.shape[0] != ns.shape[0]:
            raise ValueError("node_start and leaf_start must have n_trees + 1 entries")
        # The nodes are 16 bytes: a tree's children and the feature columns in
        # 16 bits (``_forest.MAX_TREE_SPLITS``, ``MAX_FEATURES``).
        if n_features > 32767:
            raise ValueError(f"n_features must be at most 32767, got {n_features}")
        for t in range(n_trees):
            if ns[t] < 0 or not 0 <= ns[t + 1] - ns[t] <= 16383 or ns[t + 1] > n:
                raise ValueError(f"tree {t} must have 0 to 16383 splits within the nodes")
        for i in range(n):
            if not 0 <= f[i] < n_features:
                raise ValueError(f"feature {f[i]} of node {i} is not in [0, {n_features})")
        total = <int32_t>n
        self._nodes = <Node*>mem_alloc(max(total, 1), sizeof(Node))
        self._trees = <Tree*>mem_alloc(max(n_trees, 1), sizeof(Tree))
        start = 0
        for t in range(n_trees):
            n_int = ns[t + 1] - ns[t]
            self._trees[t].start = start
            self._trees[t].n_internal = n_int
            self._trees[t].leaf_start = ls[t]
            for k in range(n_int):
                src = ns[t] + k
                if dt[src] & 1:
                    self._nodes[start + k].split.cat.offset = co[src]
                    self._nodes[start + k].split.cat.nwords = cn[src]
                else:
                    self._nodes[start + k].split.threshold = th[src]
                self._nodes[start + k].feature = <int16_t>f[src]
                self._nodes[start + k].decision = dt[src]
                child = lc[src]
                self._nodes[start + k].left = <int16_t>(child if child >= 0 else n_int + ~child)
                child = rc[src]
                self._nodes[start + k].right = <int16_t>(child if child >= 0 else n_int + ~child)
            start += n_int
        bases = np.ascontiguousarray(base, dtype=np.float64)
        if bases.shape[0] == 0:
            bases = np.zeros(1, dtype=np.float64)  # a valid pointer
            base_feature = -1
        if not -1 <= base_feature < n_features:
            raise ValueError(f"base_feature must be -1 or in [0, {n_features}), got {base_feature}")
        self._keep = (leaves, words, bases)
        cdef const double[::1] lv = leaves
        cdef const uint32_t[::1] cw = words
        cdef const double[::1] bv = bases
        self._base = &bv[0]
        self._n_base = bv.shape[0]
        self._base_feature = base_feature
        self._leaves = &lv[0] if lv.shape[0] else NULL
        self._cat_words = &cw[0]
        self.n_trees = n_trees
        self.n_features = n_features

    def __dealloc__(self):
        free(self._nodes)
        free(self._trees)

    def predict_into(self, const double[:, ::1] x, double[::1] out, Py_ssize_t shared=0):
        """Write the ensemble's raw score of each row of ``x`` into ``out``.

        ``shared > 0`` promises that all rows hold the same values in columns
        ``[0, shared)`` (one prompt on many models): up to 64 such rows walk
        each tree together. The scores are the same either way.
        """
        if x.shape[1] < self.n_features:
            raise ValueError(f"rows have {x.shape[1]} features, the ensemble reads {self.n_features}")
        if out.shape[0] != x.shape[0]:
            raise ValueError(f"out has {out.shape[0]} slots for {x.shape[0]} rows")
        if not 0 <= shared <= x.shape[1]:
            raise ValueError(f"shared must be in [0, {x.shape[1]}], got {shared}")
        if x.shape[0] == 0:
            return
        with nogil:
            if shared > 0 and x.shape[0] <= 64:
                self._predict_shared(&x[0, 0], x.shape[0], x.shape[1], shared, &out[0])
            else:
                self._predict(&x[0, 0], x.shape[0], x.shape[1], &out[0])

    cdef void _predict(self, const double* x, Py_ssize_t n_rows, Py_ssize_t stride,
                       double* out) noexcept nogil:
        cdef Py_ssize_t r, t
        cdef int32_t node, n_int
        cdef const Node* nodes
        cdef const Node* nd
        cdef const Tree* tree
        cdef const double* row
        for r in range(n_rows):
            out[r] = 0.0
        # Trees outer, rows inner: a tree stays in L1 while every row walks it.
        for t in range(self.n_trees):
            tree = &self._trees[t]
            nodes = self._nodes + tree.start
            n_int = tree.n_internal
            for r in range(n_rows):
                row = x + r * stride
                node = 0
                while node < n_int:
                    nd = &nodes[node]
                    node = _decide(nd, row[nd.feature], self._cat_words)
                out[r] += self._leaves[tree.leaf_start + node - n_int]
        self._add_base(x, n_rows, stride, out)

    cdef inline void _add_base(self, const double* x, Py_ssize_t n_rows, Py_ssize_t stride,
                               double* out) noexcept nogil:
        # After the trees, as `booster.predict(x) + init_score` would add it.
        cdef Py_ssize_t r
        cdef double v
        if self._base_feature < 0:
            return
        for r in range(n_rows):
            v = x[r * stride + self._base_feature]
            if v >= 0.0 and v < <double>self._n_base:
                out[r] += self._base[<Py_ssize_t>v]


    cdef void _predict_shared(self, const double* x, Py_ssize_t n_rows, Py_ssize_t stride,
                              Py_ssize_t shared, double* out) noexcept nogil:
        # Rows that agree on columns [0, shared) (one prompt, many models) take
        # the same branch at every split on those columns, so they walk each tree
        # together as a bit set of rows that only divides at splits on the other
        # (model) columns. Each row still gets one leaf per tree, in tree order.
        cdef Py_ssize_t t, r
        cdef int32_t node, n_int, sp
        cdef uint64_t mask, m, lmask, rmask
        cdef uint64_t full = (~<uint64_t>0) >> (64 - n_rows)
        cdef int32_t stack_node[64]
        cdef uint64_t stack_mask[64]
        cdef const Node* nodes
        cdef const Node* nd
        cdef const Tree* tree
        cdef double v
        for r in range(n_rows):
            out[r] = 0.0
        for t in range(self.n_trees):
            tree = &self._trees[t]
            nodes = self._nodes + tree.start
            n_int = tree.n_internal
            stack_node[0] = 0
            stack_mask[0] = full
            sp = 1
            while sp > 0:
                sp -= 1
                node = stack_node[sp]
                mask = stack_mask[sp]
                while node < n_int:
                    nd = &nodes[node]
                    if nd.feature < shared:
                        r = bear_ctz64(mask)
                        node = _decide(nd, x[r * stride + nd.feature], self._cat_words)
                        continue
                    lmask = 0
                    m = mask
                    while m:
                        r = bear_ctz64(m)
                        m &= m - 1
                        if _decide(nd, x[r * stride + nd.feature], self._cat_words) == nd.left:
                            lmask |= (<uint64_t>1) << r
                    rmask = mask & ~lmask
                    if lmask == 0:
                        node = nd.right
                    elif rmask == 0:
                        node = nd.left
                    else:
                        stack_node[sp] = nd.right
                        stack_mask[sp] = rmask
                        sp += 1
                        node = nd.left
                        mask = lmask
                v = self._leaves[tree.leaf_start + node - n_int]
                m = mask
                while m:
                    r = bear_ctz64(m)
                    m &= m - 1
                    out[r] += v
        self._add_base(x, n_rows, stride, out)


def predict_pool(FeatureExtractor fx, str text, double[:, ::1] x, tuple forests,
                 const double[::1] lo, const double[::1] hi, double[:, ::1] out):
    """Predict every head for one prompt on every model row, in one call.

    Writes the prompt features of ``text`` into the prompt columns of every row
    of ``x`` (whose model columns the caller filled), then ``out[h, r]`` = head
    ``h``'s score of row ``r`` clipped to ``[lo[h], hi[h]]``.
    """
    cdef Py_ssize_t h, r, j, n_heads = len(forests), p = fx.n_features
    cdef Forest f
    if x.shape[1] < p or x.shape[0] < 1:
        raise ValueError(f"x must have rows of at least {p} features")
    if out.shape[0] != n_heads or out.shape[1] != x.shape[0] or lo.shape[0] < n_heads or hi.shape[0] < n_heads:
        raise ValueError("out, lo and hi must match the heads and rows")
    for h in range(n_heads):
        f = forests[h]
        if x.shape[1] < f.n_features:
            raise ValueError(f"rows have {x.shape[1]} features, head {h} reads {f.n_features}")
    fx._transform(text, &x[0, 0])
    with nogil:
        for r in range(1, x.shape[0]):
            for j in range(p):
                x[r, j] = x[0, j]
    for h in range(n_heads):
        f = forests[h]
        with nogil:
            if x.shape[0] <= 64:
                f._predict_shared(&x[0, 0], x.shape[0], x.shape[1], p, &out[h, 0])
            else:
                f._predict(&x[0, 0], x.shape[0], x.shape[1], &out[h, 0])
            for r in range(x.shape[0]):
                if out[h, r] < lo[h]:
                    out[h, r] = lo[h]
                elif out[h, r] > hi[h]:
                    out[h, r] = hi[h]


def add_linear(const double[:, ::1] x, Py_ssize_t p, Py_ssize_t model_col,
               const double[:, ::1] weights, const double[::1] intercept,
               double[::1] out, double lo, double hi):
    """Add each row's model-specific linear term to ``out``, then clip to ``[lo, hi]``.

    Row ``r`` is for model ``m = x[r, model_col]``: ``out[r] += (sum over j < p
    of x[r, j] * weights[m, j]) + intercept[m]``, the products summed in feature
    order from 0.0 (as the pure-Python twin does, so both give the same bits).
    """
    cdef Py_ssize_t r, j, m = 0, bad = -1, n = x.shape[0], k = weights.shape[0]
    cdef double acc, v, mid = 0.0
    if p < 0 or p > x.shape[1] or p > weights.shape[1] or not 0 <= model_col < x.shape[1]:
        raise ValueError("p and model_col must index the columns of x and weights")
    if intercept.shape[0] != k or out.shape[0] != n:
        raise ValueError("intercept must match weights' rows and out must match x's rows")
    with nogil:
        for r in range(n):
            mid = x[r, model_col]
            m = <Py_ssize_t>mid
            if not (0 <= mid < k) or <double>m != mid:
                bad = r
                break
            acc = 0.0
            for j in range(p):
                acc = acc + x[r, j] * weights[m, j]
            v = out[r] + (acc + intercept[m])
            if v < lo:
                v = lo
            elif v > hi:
                v = hi
            out[r] = v
    if bad >= 0:
        raise ValueError(f"row {bad}: model id {mid!r} is not one of 0..{k - 1}")
