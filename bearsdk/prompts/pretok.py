"""Byte-level BPE tokenizers' plain text tokenized from a piece table.

A never-seen 8k-token prompt costs the ``tokenizers`` library about 8 ms on a
small core, nearly all of it its regular expression engine cutting the text
into pieces (``bench prefix-index``); BPE then runs on each piece alone. For
the byte-level BPE families whose cut is known here (GPT-2's, Llama 3's,
Qwen2's expression, recognised by their exact text in ``tokenizer.json``),
:class:`FastPath` cuts plain text with a compiled matcher, looks each
piece's ids up in a bounded table, and asks the tokenizer's own BPE model only
for pieces it has not kept: the same ids as the library, about a tenth of the
time once the common words are in the table.

It declines (``None``: the caller tokenizes with the library) where it is not
exact: a character outside printable ASCII, tab, LF, CR, the Latin-1 letters
and the common dashes, curly quotes, bullet and ellipsis (only the stretch
around it goes to the library, :meth:`FastPath.cut`); an added token's
text in the segment; and, by :func:`fast_path`, any tokenizer it does not
recognise in full (normaliser, pre-tokeniser, model, truncation, padding).
``BEARSDK_NO_EXTENSIONS=1`` selects the pure-Python twin
(:mod:`bearsdk.prompts._pretok_py`), the reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import attrs
import orjson

from bearsdk._twins import compiled
from bearsdk.prompts import _pretok_py

__all__ = [
    "DEFAULT_MAX_PIECES",
    "IMPLEMENTATION",
    "MAX_PIECES",
    "FastPath",
    "family_of",
    "fast_path",
    "piece_bpe",
]

_impl: ModuleType = compiled("bearsdk.prompts._pretok_c") or _pretok_py
IMPLEMENTATION: Final = "python" if _impl is _pretok_py else "cython"
"""Which twin :class:`FastPath` uses."""

MAX_PIECES: Final = _pretok_py.MAX_PIECES
"""The largest piece table."""
DEFAULT_MAX_PIECES: Final = 1 << 17
"""Pieces kept per tokenizer by default (about 3 MB at most, compiled)."""


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's bytes-to-characters map (every byte-level BPE uses it), keyed
    by the byte as a Latin-1 code point: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + n)
            n += 1
    return out


_BYTE_CHARS: Final = str.maketrans(_gpt2_byte_chars())
# NFC leaves every accepted character as it is (NFD splits the accented
# letters, NFKC the ellipsis).
_IDENTITY_NORMALIZERS: Final = frozenset({"NFC"})


def family_of(config: dict[str, Any]) -> str | None:
    """The cut family of a parsed ``tokenizer.json``; ``None`` where the fast path is not exact.

    Recognised: a BPE model without dropout, suffixes or byte fallback; no
    normaliser or NFC (the identity on the accepted characters); GPT-2's
    ``ByteLevel`` pre-tokeniser, or a ``Split`` on Llama 3's or Qwen2's
    expression (isolated, not inverted) before a ``ByteLevel`` without its
    own expression; no prefix space, truncation or padding.
    """
    model = config.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    if any(model.get(k) for k in ("dropout", "byte_fallback", "continuing_subword_prefix")):
        return None
    if model.get("end_of_word_suffix") or config.get("truncation") or config.get("padding"):
        return None
    norm = config.get("normalizer")
    if norm is not None and not (
        isinstance(norm, dict) and norm.get("type") in _IDENTITY_NORMALIZERS
    ):
        return None
    pre = config.get("pre_tokenizer")
    if _byte_level(pre, regex=True):
        return "gpt2"
    if not (isinstance(pre, dict) and pre.get("type") == "Sequence"):
        return None
    parts = pre.get("pretokenizers")
    if not (isinstance(parts, list) and len(parts) == 2 and _byte_level(parts[1], regex=False)):
        return None
    split = parts[0]
    if not (
        isinstance(split, dict)
        and split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and split.get("invert") is False
        and isinstance(split.get("pattern"), dict)
    ):
        return None
    pattern = split["pattern"].get("Regex")
    for name, (expr, _) in _pretok_py.FAMILIES.items():
        if name != "gpt2" and pattern == expr:
            return name
    return None


def _byte_level(pre: Any, regex: bool) -> bool:
    return (
        isinstance(pre, dict)
        and pre.get("type") == "ByteLevel"
        and pre.get("add_prefix_space") is False
        and pre.get("use_regex", True) is regex
    )


@attrs.define(eq=False)
class FastPath:
    """A tokenizer's piece table (build with :func:`fast_path`).

    Attributes:
        family: The cut family.
        encoder: The twin's piece encoder.
        added: The texts of the tokenizer's added tokens: a segment holding
            one is the library's to tokenize.
    """

    family: str
    encoder: Any
    added: tuple[str, ...] = ()
    _firsts: frozenset[str] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._firsts = frozenset(t[0] for t in self.added if t)

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids (without added special tokens), or ``None`` to use the library."""
        if self._has_added(text):
            return None
        ids: list[int] | None = self.encoder.encode(text)
        return ids

    def cut(self, text: str) -> tuple[list[int], str, list[int]]:
        """``text`` as ``(head ids, middle, tail ids)``: the library tokenizes the middle.

        Where the text has characters the fast path is not exact on, only the
        stretch from a piece boundary before the first of them to one after
        the last goes to the library: a space after a printable ASCII
        character starts a piece in every family, whatever came before it, and
        the expressions look neither behind nor, there, ahead. The middle is
        empty when the fast path takes it all, the whole text when it holds
        an added token.
        """
        if self._has_added(text):
            return [], text, []
        enc = self.encoder
        ids: list[int] | None = enc.encode(text)
        if ids is not None:
            return ids, "", []
        first = _UNSAFE.search(text)
        last = _LAST_UNSAFE.match(text)
        if first is None or last is None:  # (not reached: the encoder declined)
            return [], text, []
        b = _space_boundary_before(text, first.start())
        e = _space_boundary_after(text, last.end(1))
        head = enc.encode(text[:b]) if b else []
        tail = enc.encode(text[e:]) if e < len(text) else []
        return head, text[b:e], tail

    def _has_added(self, text: str) -> bool:
        return any(c in text for c in self._firsts) and any(t in text for t in self.added)


_UNSAFE: Final = re.compile(f"[^{_pretok_py.ACCEPTED}]")
_LAST_UNSAFE: Final = re.compile(f"(?s:.*)([^{_pretok_py.ACCEPTED}])")
# A space starts a piece when the character before it is printable ASCII, not a space.
_PIECE_START: Final = re.compile(r"(?<=[\x21-\x7e]) ")


def _space_boundary_before(text: str, p: int) -> int:
    """The last piece-starting space at or before ``p`` (0: none)."""
    b = 0
    for m in _PIECE_START.finditer(text, 0, p + 1):
        b = m.start()
    return b


def _space_boundary_after(text: str, q: int) -> int:
    """The first piece-starting space at or after ``q`` (the end: none)."""
    m = _PIECE_START.search(text, q)
    return len(text) if m is None else m.start()


def fast_path(tokenizer: Any, max_pieces: int = DEFAULT_MAX_PIECES) -> FastPath | None:
    """The fast path for a ``tokenizers.Tokenizer``, or ``None`` where it is not exact.

    Args:
        tokenizer: The tokenizer (its ``to_str()`` JSON is read once).
        max_pieces: Most pieces kept.
    """
    try:
        config = orjson.loads(tokenizer.to_str())
        model = tokenizer.model
    except Exception:  # not a tokenizers.Tokenizer (a test double): no fast path
        return None
    if not isinstance(config, dict):
        return None
    family = family_of(config)
    if family is None:
        return None
    added = tuple(
        str(t["content"])
        for t in config.get("added_tokens") or ()
        if isinstance(t, dict) and isinstance(t.get("content"), str) and t["content"]
    )
    return FastPath(family, _impl.PieceEncoder(family, piece_bpe(model), max_pieces), added)


def piece_bpe(model: Any) -> Callable[[str], list[int]]:
    """One piece's ids from a byte-level BPE model (``Tokenizer.model``), as
    the library computes them after its cut: the piece's UTF-8 bytes as
    GPT-2's characters, then the model."""

    def bpe(piece: str) -> list[int]:
        mapped = piece.encode("utf-8").decode("latin-1").translate(_BYTE_CHARS)
        return [t.id for t in model.tokenize(mapped)]

    return bpe
