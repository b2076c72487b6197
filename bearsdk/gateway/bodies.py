"""Request bodies and headers: decoded strictly, before anything reaches an engine.

Bodies are untrusted. The known OpenAI fields (and vLLM's sampling extras) are
checked and passed to the engine; an unknown field or a wrong type or range is
a 400 whose OpenAI-style error names it (``param``). The gateway's own fields
never reach an engine: ``model`` (it picks the group), and the ``bear`` object
(``ttft_ms``, ``tpot_ms``, ``timeout_s``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs

from bearsdk.router.errors import short

__all__ = ["BadRequest", "ParsedRequest", "parse_request"]

Kind = Literal["chat", "completions"]

# Target headers: this gateway's names first, then the Gateway API Inference
# Extension / llm-d spellings, so clients written for either work unchanged.
TTFT_HEADERS: Final = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS: Final = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")

# A target longer than an hour is a unit mistake (seconds sent as ms is the
# other way round and lands below the floor).
_TARGET_MS: Final = (0.001, 3_600_000.0)
_MAX_MESSAGES: Final = 100_000


class BadRequest(Exception):
    """A body or header this gateway refuses (400); ``param`` names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _number(lo: float, hi: float) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi

    return check


def _integer(lo: int, hi: int) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    return check


def _of(*types: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def _stop(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, str)
        or (isinstance(v, list) and len(v) <= 16 and all(isinstance(x, str) for x in v))
    )


_COMMON: Final[dict[str, tuple[Callable[[Any], bool], str]]] = {
    "max_tokens": (_integer(1, 2**31 - 1), "an integer >= 1"),
    "temperature": (_number(0.0, 2.0), "a number in [0, 2]"),
    "top_p": (_number(0.0, 1.0), "a number in [0, 1]"),
    "n": (_integer(1, 128), "an integer in [1, 128]"),
    "stop": (_stop, "a string or a list of at most 16 strings"),
    "presence_penalty": (_number(-2.0, 2.0), "a number in [-2, 2]"),
    "frequency_penalty": (_number(-2.0, 2.0), "a number in [-2, 2]"),
    "logit_bias": (_of(dict), "an object"),
    "seed": (_integer(-(2**63), 2**63 - 1), "a 64-bit integer"),
    "user": (_of(str), "a string"),
    "stream_options": (_of(dict), "an object"),
    # vLLM's extra sampling parameters
    "top_k": (_integer(-1, 2**31 - 1), "an integer >= -1"),
    "min_p": (_number(0.0, 1.0), "a number in [0, 1]"),
    "repetition_penalty": (_number(0.0, 100.0), "a number in (0, 100]"),
    "min_tokens": (_integer(0, 2**31 - 1), "an integer >= 0"),
    "ignore_eos": (_of(bool), "true or false"),
    "skip_special_tokens": (_of(bool), "true or false"),
    "include_stop_str_in_output": (_of(bool), "true or false"),
}

FIELDS: Final[dict[Kind, dict[str, tuple[Callable[[Any], bool], str]]]] = {
    "chat": {
        **_COMMON,
        "max_completion_tokens": (_integer(1, 2**31 - 1), "an integer >= 1"),
        "logprobs": (_of(bool), "true or false"),
        "top_logprobs": (_integer(0, 20), "an integer in [0, 20]"),
        "response_format": (_of(dict), "an object"),
        "tools": (_of(list), "a list"),
        "tool_choice": (_of(str, dict), "a string or an object"),
        "parallel_tool_calls": (_of(bool), "true or false"),
        "chat_template_kwargs": (_of(dict), "an object"),
    },
    "completions": {
        **_COMMON,
        "echo": (_of(bool), "true or false"),
        "suffix": (_of(str), "a string"),
        "best_of": (_integer(1, 128), "an integer in [1, 128]"),
        "logprobs": (_integer(0, 20), "an integer in [0, 20]"),
    },
}
"""Per endpoint, the engine fields accepted and what each must be."""


@attrs.frozen
class ParsedRequest:
    """A checked request.

    Attributes:
        kind: ``chat`` or ``completions``.
        model: The ``model`` asked for (``None``: the gateway's default).
        prompt: The messages (chat) or the prompt text (completions).
        stream: Stream the response (SSE).
        params: Engine parameters, checked.
        ttft_target_s: The request's TTFT target (``None``: the configured rule).
        tpot_target_s: Its time-per-output-token target, if given.
        timeout_s: The caller's own deadline for the whole request.
    """

    kind: Kind
    model: str | None
    prompt: Any
    stream: bool
    params: dict[str, Any]
    ttft_target_s: float | None
    tpot_target_s: float | None
    timeout_s: float | None

    @property
    def max_tokens(self) -> int | None:
        """The request's output cap, if it gives one."""
        v = self.params.get("max_completion_tokens", self.params.get("max_tokens"))
        return v if isinstance(v, int) else None

    def prompt_chars(self) -> int:
        """Characters of prompt text (for the token budget's estimate)."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        n = 0
        for m in self.prompt:
            c = m.get("content")
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                n += sum(len(p.get("text", "")) for p in c if isinstance(p, Mapping))
        return n


def _target_ms(param: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise BadRequest(
                param, f"{param} must be a number of milliseconds (got {short(value)})"
            ) from None
    lo, hi = _TARGET_MS
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise BadRequest(
            param,
            f"{param} must be a number of milliseconds in [{lo:g}, {hi:g}] (got {short(value)})",
        )
    return float(value) / 1e3


def _header_target(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = headers.get(name)
        if value is not None:
            return _target_ms(name, value.strip())
    return None


def _bear(
    body: Mapping[str, Any], max_timeout_s: float
) -> tuple[float | None, float | None, float | None]:
    ext = body.get("bear")
    if ext is None:
        return None, None, None
    if not isinstance(ext, Mapping):
        raise BadRequest("bear", f"bear must be an object (got {short(ext)})")
    for key in ext:
        if key not in ("ttft_ms", "tpot_ms", "timeout_s"):
            raise BadRequest(
                f"bear.{key}",
                f"bear.{key} is not a known field (known: ttft_ms, tpot_ms, timeout_s)",
            )
    ttft = None if ext.get("ttft_ms") is None else _target_ms("bear.ttft_ms", ext["ttft_ms"])
    tpot = None if ext.get("tpot_ms") is None else _target_ms("bear.tpot_ms", ext["tpot_ms"])
    timeout = ext.get("timeout_s")
    if timeout is not None and not _number(0.01, max_timeout_s)(timeout):
        raise BadRequest(
            "bear.timeout_s",
            f"bear.timeout_s must be a number in [0.01, {max_timeout_s:g}] (got {short(timeout)})",
        )
    return ttft, tpot, None if timeout is None else float(timeout)


def _messages(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", f"messages must be a non-empty list (got {short(messages)})")
    if len(messages) > _MAX_MESSAGES:
        raise BadRequest(
            "messages", f"messages holds {len(messages)} entries (at most {_MAX_MESSAGES})"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(
                "messages", f"messages[{i}] must be an object with a 'role' (got {short(m)})"
            )
    return messages


def parse_request(
    kind: Kind, body: Any, headers: Mapping[str, str], *, max_timeout_s: float = 600.0
) -> ParsedRequest:
    """Check a decoded JSON body (and the target headers) for ``kind``'s endpoint.

    Raises:
        BadRequest: A field is missing, unknown, or of the wrong type or range.
    """
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body must be a JSON object (got {short(body)})")
    if kind == "chat":
        prompt: Any = _messages(body.get("messages"))
        own = "messages"
    else:
        prompt = body.get("prompt")
        own = "prompt"
        if not isinstance(prompt, str):
            raise BadRequest(
                "prompt",
                f"prompt must be a string (got {short(prompt)}); send one prompt per request",
            )
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and 0 < len(model) <= 256):
        raise BadRequest("model", f"model must be a name (got {short(model)})")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"stream must be true or false (got {short(stream)})")
    ttft, tpot, timeout = _bear(body, max_timeout_s)
    if ttft is None:
        ttft = _header_target(headers, TTFT_HEADERS)
    if tpot is None:
        tpot = _header_target(headers, TPOT_HEADERS)
    fields = FIELDS[kind]
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in (own, "model", "stream", "bear"):
            continue
        check = fields.get(key)
        if check is None:
            raise BadRequest(key, f"unknown field {short(key)}")
        if value is None:
            continue  # OpenAI clients send null for "not set"
        if not check[0](value):
            raise BadRequest(key, f"{key} must be {check[1]} (got {short(value)})")
        params[key] = value
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        stream=stream,
        params=params,
        ttft_target_s=ttft,
        tpot_target_s=tpot,
        timeout_s=timeout,
    )


def is_finite_positive(x: float) -> bool:
    """``x`` is a finite number > 0."""
    return math.isfinite(x) and x > 0
