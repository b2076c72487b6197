"""The emulated engine's tokenizer and chat template as the router loads a model's.

A router that hashes prompts into block chains (:mod:`bearsdk.prompts`) must
tokenize exactly as the engine does. Against vLLM it loads the model's
``tokenizer.json`` and chat template; against the emulator, whose stand-in
tokenizer has no ``tokenizer.json``, :func:`stand_in_chat_tokenizer` gives the
same thing: the stand-in in the ``tokenizers.Tokenizer`` shape and the ChatML
template the emulator renders chat requests with (``Tokenizer.render_chat``),
so that the router's ids are the engine's, token for token.

One difference from a real tokenizer is kept on purpose: the emulator
tokenizes a completion prompt without splitting out ``<|...|>`` markers (and a
chat prompt with), so ``encode(..., add_special_tokens=True)`` (the
completions path) does the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from bearsdk.emulator.text import _MARKER, _SPECIALS, _TOKEN, Tokenizer

if TYPE_CHECKING:
    from bearsdk.prompts.tokenizer import ChatTokenizer

__all__ = ["CHATML_TEMPLATE", "StandInTokenizers", "stand_in_chat_tokenizer"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The emulator's chat template (ChatML, as Qwen's without tools or thinking)."""


@attrs.frozen
class _Encoding:
    ids: list[int]
    offsets: list[tuple[int, int]]


@attrs.frozen
class _Added:
    content: str
    special: bool = True


@attrs.frozen
class StandInTokenizers:
    """The emulator's :class:`~bearsdk.emulator.text.Tokenizer` with the methods of
    ``tokenizers.Tokenizer`` that :class:`~bearsdk.prompts.tokenizer.ChatTokenizer` uses."""

    tokenizer: Tokenizer

    def encode(self, sequence: str, add_special_tokens: bool = True) -> _Encoding:
        """Ids and character offsets of ``sequence`` (see the module for the flag)."""
        tok = self.tokenizer
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        segments = [sequence] if add_special_tokens else _MARKER.split(sequence)
        at = 0
        for i, seg in enumerate(segments):
            if i % 2:
                ids.append(tok.special_id(seg))
                offsets.append((at, at + len(seg)))
            else:
                for m in _TOKEN.finditer(seg):
                    ids.append(tok.token_id(m.group()))
                    offsets.append((at + m.start(), at + m.end()))
            at += len(seg)
        return _Encoding(ids, offsets)

    def encode_batch(
        self, sequences: Sequence[str], add_special_tokens: bool = True
    ) -> list[_Encoding]:
        """:meth:`encode` of each of ``sequences``."""
        return [self.encode(s, add_special_tokens) for s in sequences]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of special tokens (the stand-in cannot decode others: ``""``)."""
        if skip_special_tokens:
            return ""
        names = {self.tokenizer.special_id(m): m for m in _SPECIALS}
        return "".join(names.get(i, "") for i in ids)

    def get_added_tokens_decoder(self) -> dict[int, _Added]:
        """The named special tokens by id."""
        return {self.tokenizer.special_id(m): _Added(m) for m in _SPECIALS}


def stand_in_chat_tokenizer(
    tokenizer: Tokenizer, *, cache_tokens: int = 4_000_000
) -> ChatTokenizer:
    """What the router loads for an emulated model: its tokenizer and ChatML template.

    Raises:
        ChatTemplateError: ``jinja2`` is not installed.
    """
    from bearsdk.prompts.template import ChatTemplate
    from bearsdk.prompts.tokenizer import ChatTokenizer

    adapter = StandInTokenizers(tokenizer)
    specials = frozenset(adapter.get_added_tokens_decoder())
    template = ChatTemplate.from_string(CHATML_TEMPLATE, {"eos_token": "<|im_end|>"})
    return ChatTokenizer(adapter, template, specials, cache_tokens)
