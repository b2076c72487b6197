"""Byte-level BPE on plain text with a piece cache: the pure-Python twin.

The readable reference (and test oracle) of ``bearsdk.prompts._pretok_c``;
:mod:`bearsdk.prompts.pretok` picks one. A byte-level BPE tokenizer
(GPT-2's, Llama 3's, Qwen2's) cuts text into pieces with one regular
expression, then runs BPE on each piece alone: a piece's ids never depend on
its neighbours. Natural text repeats its pieces (words with their leading
space), so an encoder that cuts text the same way and remembers each piece's
ids tokenizes a prompt with one table lookup a piece, where the ``tokenizers``
library runs its regular expression engine over every character.

The cut is each family's expression restricted to the characters it is
exact on here (:data:`LETTERS`, :data:`MARKS`): printable ASCII, tab, line
feed and carriage return, the Latin-1 letters, and the dashes, curly quotes,
bullet and ellipsis of running text. There ``\\p{L}`` is ``[A-Za-z]`` and the
Latin-1 letters, ``\\p{N}`` is ``[0-9]``, ``\\s`` is ``[ \\t\\n\\r]`` and the
marks are punctuation. Text with any other character gets ``None``: the
caller tokenizes it with the library.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Final

__all__ = [
    "ACCEPTED",
    "FAMILIES",
    "LATIN1_LETTERS",
    "LETTERS",
    "MARKS",
    "MAX_PIECES",
    "MAX_PIECE_BYTES",
    "PieceEncoder",
]

LATIN1_LETTERS: Final = "\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u00ff"
"""The Latin-1 letters (a character class body): U+00C0-U+00FF but U+00D7 and U+00F7."""
LETTERS: Final = "A-Za-z" + LATIN1_LETTERS
"""``\\p{L}`` on the characters the cut accepts (a character class body)."""
MARKS: Final = "\u2013\u2014\u2018\u2019\u201c\u201d\u2022\u2026"
"""The non-ASCII punctuation it accepts: en and em dashes, curly quotes, bullet, ellipsis."""
ACCEPTED: Final = "\\t\\n\\r\\x20-\\x7e" + LATIN1_LETTERS + MARKS
"""Every character the cut accepts (a character class body)."""

_L = LETTERS
# Each family's expression as the tokenizers library has it (the cut itself is
# specified by this text), and its form on the accepted characters for Python's
# re, which tries the alternatives in order and backtracks as Oniguruma does.
FAMILIES: Final[dict[str, tuple[str, str]]] = {
    "gpt2": (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{_L}]+| ?[0-9]+| ?[^\s{_L}0-9]+|\s+(?!\S)|\s+",
    ),
    "llama3": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{_L}0-9]?[{_L}]+|[0-9]{{1,3}}"
        rf"| ?[^\s{_L}0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{_L}0-9]?[{_L}]+|[0-9]"
        rf"| ?[^\s{_L}0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
"""Family name -> (the tokenizer's expression, its form on the accepted characters)."""

MAX_PIECE_BYTES: Final = 64
"""Pieces longer than this in UTF-8 are tokenized every time, not kept (a run
of one character repeated, a long hash: rare, and each would take a table
entry for itself)."""

MAX_ID: Final = 0x7FFFFFFF
"""The largest token id (ids are kept as 32-bit integers)."""

MAX_PIECES: Final = 1 << 24
"""The largest ``max_pieces``."""

_UNSAFE: Final = re.compile(f"[^{ACCEPTED}]")


class PieceEncoder:
    """Cuts text as a byte-level BPE tokenizer does and keeps each piece's ids.

    Args:
        family: One of :data:`FAMILIES`.
        bpe: The ids of one piece, as the tokenizer's model gives them (called
            for pieces not kept yet).
        max_pieces: Most pieces kept; past it the table starts over (bounded
            memory, whatever the text).
    """

    def __init__(
        self, family: str, bpe: Callable[[str], Sequence[int]], max_pieces: int = 1 << 18
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)} (got {family!r})")
        if type(max_pieces) is not int or not 0 < max_pieces <= MAX_PIECES:
            raise ValueError(f"max_pieces must be an int in 1..{MAX_PIECES} (got {max_pieces!r})")
        self.family = family
        self.max_pieces = max_pieces
        self._bpe = bpe
        self._cut = re.compile(FAMILIES[family][1])
        self._kept: dict[str, tuple[int, ...]] = {}

    @property
    def kept(self) -> int:
        """Pieces kept now."""
        return len(self._kept)

    def pieces(self, text: str) -> list[str] | None:
        """``text`` cut into pieces, or ``None`` when it has a character the cut is not exact on."""
        if type(text) is not str:
            raise TypeError(f"text must be a str (got {type(text).__name__})")
        if _UNSAFE.search(text):
            return None
        return self._cut.findall(text)

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids, or ``None`` (see :meth:`pieces`)."""
        parts = self.pieces(text)
        if parts is None:
            return None
        kept = self._kept
        out: list[int] = []
        for p in parts:
            got = kept.get(p)
            if got is None:
                got = tuple(self._bpe(p))
                for i in got:
                    if not 0 <= i <= MAX_ID:
                        raise ValueError(f"bpe: token id must be in 0..{MAX_ID} (got {i})")
                if len(p.encode()) <= MAX_PIECE_BYTES:
                    if len(kept) >= self.max_pieces:
                        kept.clear()
                    kept[p] = got
            out.extend(got)
        return out
