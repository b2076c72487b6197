"""The router's tokenizers: each model's prompt ids, once per request.

A router configured with a model's tokenizer (``RouterCore(tokenizers=...)``,
:class:`~bearsdk.prompts.tokenizer.ChatTokenizer` values or model directories)
tokenizes each request once per model among the candidates, as that model's
engines do, so that BEA replays every candidate with the prompt's exact length
and its block chain (the prefix the instance holds). A prompt a tokenizer cannot
take (a template that refuses it, an image part, an oversized text) routes
without ids for that model, as if no tokenizer were configured: tokenizing
never fails a request. :attr:`PromptEncoders.failures` counts those, by model.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from bearsdk.prompts.tokenizer import ChatTokenizer, PromptIds

__all__ = ["PromptEncoders"]


@attrs.define
class PromptEncoders:
    """Per-model tokenizers (see the module).

    Attributes:
        failures: Prompts a model's tokenizer could not take, by model.
    """

    _by_model: dict[str, ChatTokenizer] = attrs.field(factory=dict, alias="_by_model")
    failures: dict[str, int] = attrs.field(factory=dict)

    @classmethod
    def build(cls, tokenizers: Mapping[str, ChatTokenizer | str | Path] | None) -> PromptEncoders:
        """Load directories; keep tokenizers given as objects.

        Raises:
            TokenizerError: A directory or file that cannot be loaded.
            ChatTemplateError: A template that does not compile.
        """
        out = cls()
        for model, tok in (tokenizers or {}).items():
            out.set(model, tok)
        return out

    def set(self, model: str, tokenizer: ChatTokenizer | str | Path | None) -> None:
        """Tokenize ``model``'s prompts with ``tokenizer`` (``None``: stop)."""
        if tokenizer is None:
            self._by_model.pop(model, None)
            return
        if isinstance(tokenizer, str | Path):
            from bearsdk.prompts.tokenizer import load_chat_tokenizer

            tokenizer = load_chat_tokenizer(tokenizer)
        self._by_model[model] = tokenizer

    def __bool__(self) -> bool:
        return bool(self._by_model)

    def get(self, model: str) -> ChatTokenizer | None:
        """``model``'s tokenizer, if one is configured."""
        return self._by_model.get(model)

    def encode(
        self, prompt: str | Sequence[Mapping[str, Any]], models: Collection[str]
    ) -> dict[str, PromptIds]:
        """``prompt``'s ids for each of ``models`` that has a tokenizer and takes it."""
        from bearsdk.prompts.template import ChatTemplateError
        from bearsdk.prompts.tokenizer import TokenizerError

        out: dict[str, PromptIds] = {}
        for model in models:
            tok = self._by_model.get(model)
            if tok is None:
                continue
            try:
                out[model] = (
                    tok.encode_prompt(prompt)
                    if isinstance(prompt, str)
                    else tok.encode_chat(prompt)
                )
            except (ChatTemplateError, TokenizerError):
                self.failures[model] = self.failures.get(model, 0) + 1
        return out
