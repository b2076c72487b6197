"""A model's chat template, rendered as vLLM renders it.

vLLM 0.33 renders a chat request's messages with the model's Jinja chat template
through transformers' ``apply_chat_template`` (``vllm/entrypoints/chat_utils.py``,
``apply_hf_chat_template``), then tokenizes the text without adding special
tokens (``ChatCompletionRequest.add_special_tokens`` defaults to ``False``).
transformers compiles the template in an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, its own
``tojson`` filter (``json.dumps`` with ``ensure_ascii=False``: no HTML
escaping), and the globals ``raise_exception`` and ``strftime_now``; it renders
with ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.
:class:`ChatTemplate` does the same, so its text is the engine's, byte for byte.

Message content given as a list of parts is joined as vLLM does for templates
that take string content: the text parts, one per line. Like vLLM
(``vllm/renderers/hf.py``, ``safe_apply_chat_template``), a template that never
names the ``developer`` role gets developer messages as system messages, all
system messages then merged into the first, separated by a blank line. A part that is not
text (an image) cannot be rendered here: :meth:`ChatTemplate.render` raises,
and the router routes without the prompt's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from bearsdk.errors import BearError, short_repr

__all__ = ["ChatTemplate", "ChatTemplateError", "normalise_messages"]


class ChatTemplateError(BearError, ValueError):
    """A template that does not compile or render, or messages it cannot take."""


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template sees them: list content joined into one string.

    Raises:
        ChatTemplateError: A message that is not a mapping, or a content part
            that is not text.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object (got {short_repr(m)})")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text"):
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}]: only text parts can be rendered "
                        f"(got {short_repr(part)})"
                    )
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "\n".join(texts)}
        out.append(dict(m))
    return out


def _developer_as_system(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(msgs):
        if m.get("role") == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        if m.get("role") == "system":
            merge = merge or i > 0 or bool(system)
            if m.get("content"):
                system.append(str(m["content"]))
        else:
            rest.append(m)
    if not merge:
        return [({**m, "role": "system"} if m.get("role") == "developer" else m) for m in msgs]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


@attrs.frozen
class ChatTemplate:
    """A compiled chat template and the special tokens it reads.

    Attributes:
        source: The Jinja source.
        special_tokens: Template variables from the tokenizer's configuration
            (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...).
    """

    source: str
    special_tokens: Mapping[str, str] = attrs.field(factory=dict)
    _compiled: Any = attrs.field(default=None, eq=False, repr=False, alias="_compiled")
    _developer: bool = attrs.field(init=False, eq=False, repr=False)

    @_developer.default
    def _names_developer(self) -> bool:
        return '"developer"' in self.source or "'developer'" in self.source

    @classmethod
    def from_string(
        cls, source: str, special_tokens: Mapping[str, str] | None = None
    ) -> ChatTemplate:
        """Compile ``source`` as transformers does.

        Raises:
            ChatTemplateError: The template does not compile, or ``jinja2`` is
                not installed.
        """
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ChatTemplateError(
                "chat templates need the optional 'jinja2' package: "
                "pip install 'bearsdk[tokenizers]'"
            ) from exc
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat_template does not compile: {exc}") from None
        return cls(source, dict(special_tokens or {}), compiled)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the engine builds from ``messages``.

        Raises:
            ChatTemplateError: The messages cannot be rendered (the template
                raised, or a part is not text).
        """
        import jinja2

        msgs = normalise_messages(messages)
        if any(m.get("role") == "developer" for m in msgs) and not self._developer:
            msgs = _developer_as_system(msgs)
        try:
            text: str = self._compiled.render(
                messages=msgs,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat_template: {exc}") from None
        except Exception as exc:  # messages a template was not written for (None + str, ...)
            raise ChatTemplateError(
                f"chat_template cannot render these messages: {type(exc).__name__}: "
                f"{short_repr(str(exc))}"
            ) from None
        return text
