"""Pure-Python prompt features: the readable reference and test oracle.

``cext/_features_c.pyx`` computes the same features in one pass over the
prompt's code points; tests require both to produce bit-identical vectors. The
algorithm, for a prompt ``text``:

1. Tokens: maximal runs of ``str.isalnum`` characters, and every other
   non-space character on its own. ASCII letters are lowercased.
2. Each token is hashed with 64-bit FNV-1a over its code points, finished with
   MurmurHash3's ``fmix64``; the low bits pick one of ``dim`` buckets and the top
   bit the sign (signed feature hashing).
3. The signed bucket counts, divided by the token count, are projected onto the
   PCA components. Components are stored as integers scaled by ``2**24``, so the
   projection is an exact integer sum: ``acc / (n * 2**24) - offset``.
4. Scalars and indicators (:data:`~bearsdk.predictors._lexicon.SCALAR_FEATURES`,
   :data:`~bearsdk.predictors._lexicon.TASK_FEATURES`) come from the same tokens.
   A length constraint is a number (digits or a number word) followed by a unit
   word, directly or across one ``-`` ("100-word").
"""

from __future__ import annotations

import re
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from bearsdk.predictors import _lexicon as lx

__all__ = [
    "IMPLEMENTATION",
    "FeatureExtractor",
    "add_linear",
    "hash_counts",
    "predict_pool",
    "token_hash",
]

IMPLEMENTATION: Final = "python"

_MASK64: Final = (1 << 64) - 1
_FNV_OFFSET: Final = 0xCBF29CE484222325
_FNV_PRIME: Final = 0x100000001B3

# Python's re implements \w as isalnum() or "_" and \s as isspace(), the very
# predicates the compiled scanner calls, so both tokenise identically.
_TOKEN_RE: Final = re.compile(r"[^\W_]+|[^\w\s]|_")
_SENTENCE_END_RE: Final = re.compile(r"[.!?](?=\s|\Z)")
_ALNUM_RE: Final = re.compile(r"[^\W_]")
_ASCII_LOWER: Final = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}

_N_PCA_FREE: Final = len(lx.SCALAR_FEATURES) + len(lx.TASK_FEATURES)
_LIMIT_FEATURE: Final = {
    lx.UNIT_WORDS: lx.SCALAR_FEATURES.index("limit_words"),
    lx.UNIT_SENTENCES: lx.SCALAR_FEATURES.index("limit_sentences"),
    lx.UNIT_PARAGRAPHS: lx.SCALAR_FEATURES.index("limit_paragraphs"),
    lx.UNIT_ITEMS: lx.SCALAR_FEATURES.index("limit_items"),
}
_LEXICON: Final = {tok: (flags, unit, number) for tok, flags, unit, number in lx.lexicon_entries()}

_WORD: Final = 0
_PUNCT: Final = 1
_DIGITS: Final = 2

# token -> (hash, flags, unit, number value or -1, kind)
_TokenInfo = tuple[int, int, int, int, int]
_CACHE: dict[str, _TokenInfo] = {}
_CACHE_LIMIT: Final = 200_000


def token_hash(token: str) -> int:
    """Return the 64-bit hash of an (already lowercased) token."""
    h = _FNV_OFFSET
    for ch in token:
        h = ((h ^ ord(ch)) * _FNV_PRIME) & _MASK64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK64
    h ^= h >> 33
    return h


def _info(token: str) -> _TokenInfo:
    info = _CACHE.get(token)
    if info is not None:
        return info
    low = token.translate(_ASCII_LOWER)
    flags, unit, number = _LEXICON.get(low, (0, 0, 0))
    value = -1
    kind = _WORD
    if low.isascii() and low.isdigit():
        value = min(int(low), lx.NUMBER_CAP)
        kind = _DIGITS
    elif number:
        value = number
    elif len(token) == 1 and not token.isalnum():
        kind = _PUNCT
    info = (token_hash(low), flags, unit, value, kind)
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[token] = info
    return info


def hash_counts(text: str, dim: int) -> tuple[npt.NDArray[np.int64], int]:
    """Return the signed feature-hashing counts of ``text`` in ``dim`` buckets, and its token count.

    Args:
        text: The prompt.
        dim: Number of buckets, a power of two.

    Returns:
        ``int64[dim]`` counts (colliding signs cancel) and the number of tokens.
    """
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"dim must be a power of two, got {dim}")
    counts = np.zeros(dim, dtype=np.int64)
    mask = dim - 1
    tokens = _TOKEN_RE.findall(text)
    for tok in tokens:
        h = _info(tok)[0]
        counts[h & mask] += -1 if h >> lx.HASH_SIGN_SHIFT else 1
    return counts, len(tokens)


class FeatureExtractor:
    """Computes the prompt part of the feature vector (see the module docstring).

    Args:
        components: ``int32[dim, k]`` PCA components scaled by ``2**24``.
        offset: ``float64[k]``: the training mean projected onto the components.
    """

    implementation: Final = IMPLEMENTATION

    def __init__(self, components: npt.NDArray[np.int32], offset: npt.NDArray[np.float64]) -> None:
        dim, k = components.shape
        if dim <= 0 or dim & (dim - 1) or offset.shape != (k,):
            raise ValueError(
                f"components must be [2**b, k] with offset [k]: got {components.shape}"
            )
        self._components = components.astype(np.int64)
        self._offset = np.ascontiguousarray(offset, dtype=np.float64)
        self.dim = dim
        self.n_components = k
        self.n_features = k + _N_PCA_FREE

    def transform_into(self, text: str, out: npt.NDArray[np.float64]) -> None:
        """Write the prompt features of ``text`` into ``out[: n_features]``."""
        k = self.n_components
        mask = self.dim - 1
        counts = np.zeros(self.dim, dtype=np.int64)
        scal = [0.0] * _N_PCA_FREE
        flags = 0
        n_punct = n_numeric = 0
        limit_value = 0
        last_num_pos = -3
        last_num_value = 0
        dash_pos = -3
        tokens = _TOKEN_RE.findall(text)
        for i, tok in enumerate(tokens):
            h, tflags, unit, value, kind = _info(tok)
            counts[h & mask] += -1 if h >> lx.HASH_SIGN_SHIFT else 1
            flags |= tflags
            if kind == _PUNCT:
                n_punct += 1
                if tok == "-":
                    dash_pos = i
            elif kind == _DIGITS:
                n_numeric += 1
            if unit and (last_num_pos == i - 1 or (last_num_pos == i - 2 and dash_pos == i - 1)):
                scal[_LIMIT_FEATURE[unit]] = 1.0
                if limit_value == 0:
                    limit_value = last_num_value
            if value >= 0:
                last_num_pos = i
                last_num_value = value
        n = len(tokens)
        n_chars = len(text)
        if n:
            acc = counts @ self._components
            out[:k] = acc.astype(np.float64) / float(n * (1 << lx.PCA_SCALE_BITS)) - self._offset
        else:
            out[:k] = 0.0 - self._offset
        sentences = sum(1 for seg in _SENTENCE_END_RE.split(text) if _ALNUM_RE.search(seg))
        names = lx.SCALAR_FEATURES
        scal[names.index("n_tokens")] = float(n)
        scal[names.index("n_chars")] = float(n_chars)
        scal[names.index("n_sentences")] = float(sentences)
        scal[names.index("avg_chars_per_token")] = n_chars / n if n else 0.0
        scal[names.index("n_lines")] = float(text.count("\n") + 1) if text else 0.0
        scal[names.index("frac_punct")] = n_punct / n if n else 0.0
        scal[names.index("frac_numeric")] = n_numeric / n if n else 0.0
        scal[names.index("n_questions")] = float(text.count("?"))
        scal[names.index("limit_value")] = float(limit_value)
        scal[names.index("brevity")] = 1.0 if flags & lx.FLAG_BREVITY else 0.0
        scal[names.index("detail")] = 1.0 if flags & lx.FLAG_DETAIL else 0.0
        base = len(names)
        for bit in range(len(lx.TASK_FEATURES)):
            scal[base + bit] = 1.0 if flags >> bit & 1 else 0.0
        out[k : k + _N_PCA_FREE] = scal


class _Forest(Protocol):
    def predict_into(self, x: npt.NDArray[np.float64], out: npt.NDArray[np.float64]) -> None: ...


def predict_pool(
    fx: FeatureExtractor,
    text: str,
    x: npt.NDArray[np.float64],
    forests: tuple[_Forest, ...],
    lo: npt.NDArray[np.float64],
    hi: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
) -> None:
    """Predict every head for one prompt on every model row, in one call.

    Writes the prompt features of ``text`` into the prompt columns of every row
    of ``x`` (whose model columns the caller filled), then ``out[h, r]`` = head
    ``h``'s score of row ``r`` clipped to ``[lo[h], hi[h]]``.
    """
    p = fx.n_features
    if x.shape[1] < p or x.shape[0] < 1:
        raise ValueError(f"x must have rows of at least {p} features")
    if (
        out.shape != (len(forests), x.shape[0])
        or lo.shape[0] < len(forests)
        or hi.shape[0] < len(forests)
    ):
        raise ValueError("out, lo and hi must match the heads and rows")
    fx.transform_into(text, x[0])
    x[1:, :p] = x[0, :p]
    for h, forest in enumerate(forests):
        forest.predict_into(x, out[h])
        np.clip(out[h], lo[h], hi[h], out=out[h])


def add_linear(
    x: npt.NDArray[np.float64],
    p: int,
    model_col: int,
    weights: npt.NDArray[np.float64],
    intercept: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
    lo: float,
    hi: float,
) -> None:
    """Add each row's model-specific linear term to ``out``, then clip to ``[lo, hi]``.

    Row ``r`` is for model ``m = x[r, model_col]``: ``out[r] += (sum over j < p
    of x[r, j] * weights[m, j]) + intercept[m]``, the products summed in feature
    order from 0.0 (as the compiled kernel does, so both give the same bits).
    """
    k = weights.shape[0]
    if not 0 <= p <= min(x.shape[1], weights.shape[1]) or not 0 <= model_col < x.shape[1]:
        raise ValueError("p and model_col must index the columns of x and weights")
    if intercept.shape[0] != k or out.shape[0] != x.shape[0]:
        raise ValueError("intercept must match weights' rows and out must match x's rows")
    w = weights[:, :p].tolist()
    b = intercept.tolist()
    for r, row in enumerate(x.tolist()):
        mid = row[model_col]
        m = int(mid) if 0 <= mid < k else -1
        if m < 0 or m != mid:
            raise ValueError(f"row {r}: model id {mid!r} is not one of 0..{k - 1}")
        acc = 0.0
        for xv, wv in zip(row[:p], w[m], strict=True):
            acc = acc + xv * wv
        v = float(out[r]) + (acc + b[m])
        out[r] = lo if v < lo else (hi if v > hi else v)
