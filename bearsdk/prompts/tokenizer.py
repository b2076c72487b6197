"""A model's prompts as token ids and block chains, as its vLLM engine computes them.

:class:`ChatTokenizer` holds a model's ``tokenizers`` tokenizer and chat
template. :meth:`~ChatTokenizer.encode_chat` renders messages as vLLM does
(:mod:`bearsdk.prompts.template`) and tokenizes the text without added special
tokens, as vLLM's chat endpoint does; :meth:`~ChatTokenizer.encode_prompt`
tokenizes a completion prompt with them, as its completions endpoint does. The
result, :class:`PromptIds`, gives the prompt's full-block content keys per
block size (:func:`bearsdk.kvevents.index.chain_keys`), computed once and
shared by every instance of the model.

Multi-turn sessions resend their whole conversation every turn, and chat
services put one system prompt in front of every conversation: most of a
rendered prompt was seen before. A chat template wraps every message in
special tokens, and a tokenizer splits text at special tokens before anything
else (no token spans one), so a prompt's ids are its segments' ids (the texts
between special tokens, tokenized alone) with the special tokens' ids between
them. The tokenizer keeps the segments it tokenized (bounded:
:attr:`~ChatTokenizer.cache_tokens`, least recently used first out) and
tokenizes only those it has not seen: a conversation's next turn costs its new
messages, a shared system prompt nothing. Whether the tokenizer really splits
that way is checked once, when it is built, on its own special tokens; where it
does not (a SentencePiece-style tokenizer that marks the start of a text),
every prompt is tokenized in full. A new segment of plain text, for a
byte-level BPE tokenizer of a family it knows, is tokenized piece by piece
from a table (:mod:`bearsdk.prompts.pretok`) rather than by the library.
"""

from __future__ import annotations

import array
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import orjson

from bearsdk.errors import BearError, short_repr
from bearsdk.prompts.ids import PromptIds
from bearsdk.prompts.pretok import DEFAULT_MAX_PIECES, MAX_PIECES, FastPath, fast_path
from bearsdk.prompts.template import ChatTemplate, ChatTemplateError

__all__ = ["ChatTokenizer", "PromptIds", "TokenizerError", "load_chat_tokenizer"]

MAX_PROMPT_CHARS: Final = 8 << 20
"""The longest prompt text tokenized (longer prompts route without token ids)."""


class TokenizerError(BearError, ValueError):
    """A tokenizer directory or file that cannot be loaded (the message names the file)."""


@attrs.define(eq=False)
class ChatTokenizer:
    """A model's tokenizer and chat template (see the module).

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` (or anything with its
            ``encode(text, add_special_tokens=...)`` returning ``ids``, its
            ``encode_batch``, ``decode`` and ``get_added_tokens_decoder``).
        template: The chat template (``None``: the model takes no chat
            requests; :meth:`encode_chat` raises).
        special_ids: Ids of the tokenizer's special tokens (where a prompt is
            cut into segments).
        cache_tokens: Most token ids kept from earlier segments, all requests
            together (``0``: every prompt tokenized in full).
        fast_pieces: Most pieces the plain-text fast path keeps
            (:mod:`bearsdk.prompts.pretok`; ``0``: the library tokenizes
            everything). It is used only where the tokenizer is one it is
            exact for.

    Attributes:
        split_at_specials: Whether a text tokenizes as its segments between
            special tokens do, end to end (checked when built; segments are
            reused only then).
        tokenized: Tokens tokenized. reused: Tokens taken from the segment cache.
    """

    tokenizer: Any
    template: ChatTemplate | None
    special_ids: frozenset[int] = frozenset()
    cache_tokens: int = 4_000_000
    fast_pieces: int = attrs.field(default=DEFAULT_MAX_PIECES)
    split_at_specials: bool = attrs.field(init=False, default=False)
    tokenized: int = attrs.field(init=False, default=0)
    reused: int = attrs.field(init=False, default=0)
    _specials: dict[str, int] = attrs.field(init=False, factory=dict)
    _splitter: re.Pattern[str] | None = attrs.field(init=False, default=None)
    _segments: OrderedDict[str, array.array[int]] = attrs.field(init=False, factory=OrderedDict)
    _held: int = attrs.field(init=False, default=0)
    _fast: FastPath | None = attrs.field(init=False, default=None)

    @fast_pieces.validator
    def _check_fast_pieces(self, _a: attrs.Attribute[int], value: int) -> None:
        if type(value) is not int or not 0 <= value <= MAX_PIECES:
            raise TokenizerError(
                f"fast_pieces must be an int in 0..{MAX_PIECES} (got {short_repr(value)})"
            )

    def __attrs_post_init__(self) -> None:
        for i in sorted(self.special_ids):
            text = self.tokenizer.decode([i], skip_special_tokens=False)
            if text and self.tokenizer.encode(text, add_special_tokens=False).ids == [i]:
                self._specials[str(text)] = i
        self.split_at_specials = self._check_split()
        if self.split_at_specials:
            # Longest first: a special token that starts another must not cut it.
            names = sorted(self._specials, key=len, reverse=True)
            self._splitter = re.compile("(" + "|".join(map(re.escape, names)) + ")")
        if self.fast_pieces > 0:
            self._fast = fast_path(self.tokenizer, self.fast_pieces)

    def _check_split(self) -> bool:
        if not self._specials:
            return False
        enc = self.tokenizer.encode
        for s in list(self._specials)[:4]:
            for a, b in (("Hello there", " world\n"), ("x", "\n\nNew line"), ("", "ab c")):
                whole = enc(a + s + b, add_special_tokens=False).ids
                parts = [*enc(a, add_special_tokens=False).ids, self._specials[s]]
                if whole != parts + enc(b, add_special_tokens=False).ids:
                    return False
        return True

    def encode_prompt(self, text: str) -> PromptIds:
        """A completion prompt's ids, special tokens added as vLLM's completions
        endpoint adds them.

        Raises:
            TokenizerError: ``text`` is not a string or is too long.
        """
        if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
            raise TokenizerError(
                f"prompt must be a string of at most {MAX_PROMPT_CHARS} characters "
                f"(got {short_repr(text)})"
            )
        ids = list(self.tokenizer.encode(text, add_special_tokens=True).ids)
        self.tokenized += len(ids)
        return PromptIds(ids)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> PromptIds:
        """The ids vLLM's chat endpoint computes for ``messages``.

        Raises:
            ChatTemplateError: No template, or messages it cannot render.
            TokenizerError: The rendered prompt is too long.
        """
        if self.template is None:
            raise ChatTemplateError("this model has no chat template")
        text = self.template.render(messages)
        if len(text) > MAX_PROMPT_CHARS:
            raise TokenizerError(
                f"rendered prompt: at most {MAX_PROMPT_CHARS} characters (got {len(text)})"
            )
        if self._splitter is None:
            return self._by_segments([text], keep=False)
        return self._by_segments(self._splitter.split(text), keep=self.cache_tokens > 0)

    def _by_segments(self, parts: list[str], keep: bool) -> PromptIds:
        # parts: text, special, text, special, ..., text (re.split with a group).
        cache = self._segments
        pieces: list[Any] = []
        # The library's share: index in pieces (which holds the text it gets),
        # the segment, and the fast path's ids before and after that text.
        missing: list[tuple[int, str, list[int], list[int]]] = []
        reused = 0
        fast = self._fast
        for i, part in enumerate(parts):
            if i % 2:
                pieces.append((self._specials[part],))
                continue
            if not part:
                continue
            got = cache.get(part) if keep else None
            if got is not None:
                cache.move_to_end(part)
                reused += len(got)
                pieces.append(got)
                continue
            head, middle, tail = fast.cut(part) if fast is not None else ([], part, [])
            if middle:
                missing.append((len(pieces), part, head, tail))
                pieces.append(middle)
                continue
            self.tokenized += len(head)
            if keep:
                self._keep(part, array.array("q", head))
            pieces.append(head)
        if missing:
            texts = [pieces[k] for k, _, _, _ in missing]
            for (k, part, head, tail), mid in zip(missing, self._encode_batch(texts), strict=True):
                got = array.array("q", head)
                got.extend(mid)
                got.extend(tail)
                pieces[k] = got
                self.tokenized += len(got)
                if keep:
                    self._keep(part, got)
        ids: list[int] = []
        for piece in pieces:
            ids.extend(piece)
        self.reused += reused
        return PromptIds(ids, reused=reused)

    def _encode_batch(self, texts: list[str]) -> list[array.array[int]]:
        """The library's ids for ``texts`` (no special tokens added)."""
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [array.array("q", e.ids) for e in encs]

    def _keep(self, text: str, ids: array.array[int]) -> None:
        # Memory: the ids (8 bytes each) and the text (about 4 characters a token).
        cost = len(ids) + len(text) // 4 + 1
        if cost > self.cache_tokens:
            return
        self._segments[text] = ids
        self._held += cost
        while self._held > self.cache_tokens:
            old, gone = self._segments.popitem(last=False)
            self._held -= len(gone) + len(old) // 4 + 1


def load_chat_tokenizer(
    path: str | Path, *, cache_tokens: int = 4_000_000, fast_pieces: int = DEFAULT_MAX_PIECES
) -> ChatTokenizer:
    """A model directory's tokenizer and chat template, as vLLM loads them.

    ``path`` is a Hugging Face model directory (``tokenizer.json``, with the
    chat template and special tokens from ``chat_template.jinja`` or
    ``tokenizer_config.json``) or a ``tokenizer.json`` file (no chat template).
    ``cache_tokens`` and ``fast_pieces`` are :class:`ChatTokenizer`'s.

    Raises:
        TokenizerError: A file is missing or unreadable, or ``tokenizers`` is
            not installed.
        ChatTemplateError: The chat template does not compile.
    """
    p = Path(path)
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    try:
        from tokenizers import Tokenizer  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise TokenizerError(
            "needs the optional 'tokenizers' package: pip install 'bearsdk[tokenizers]'"
        ) from exc
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # the Rust side raises plain Exception
        raise TokenizerError(f"{tok_file.name}: cannot be loaded: {exc}") from None
    config: dict[str, Any] = {}
    if p.is_dir() and (p / "tokenizer_config.json").is_file():
        try:
            config = orjson.loads((p / "tokenizer_config.json").read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise TokenizerError(f"tokenizer_config.json: cannot be read: {exc}") from None
        if not isinstance(config, dict):
            raise TokenizerError("tokenizer_config.json: must be an object")
    source: Any = None
    if p.is_dir() and (p / "chat_template.jinja").is_file():
        source = (p / "chat_template.jinja").read_text()
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: vLLM uses "default"
            source = next(
                (
                    t.get("template")
                    for t in source
                    if isinstance(t, dict) and t.get("name") == "default"
                ),
                None,
            )
    specials = {
        k: t
        for k, v in config.items()
        if k.endswith("_token") and (t := _token_text(v)) is not None
    }
    template = ChatTemplate.from_string(source, specials) if isinstance(source, str) else None
    special_ids = frozenset(
        int(i) for i, t in tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
    )
    return ChatTokenizer(tok, template, special_ids, cache_tokens, fast_pieces)


def _token_text(v: Any) -> str | None:
    # tokenizer_config.json names a special token as a string or an AddedToken object.
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None
