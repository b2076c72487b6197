"""vLLM's OpenAI-compatible request validation and response shapes, for the emulator.

Requests are validated the way vLLM 0.33's server validates them, and rejected
with its error shapes: schema problems (a missing or mistyped field) as a 400
``{"error": {"message": "1 validation error: ...", "type": "Bad Request",
"param": "body.messages", "code": 400}}``; semantic problems (``max_tokens`` below
1 or above ``max_model_len``, a prompt longer than the context) as a 400
``BadRequestError`` whose message ends with ``(parameter=..., value=...)``; an
unknown model as a 404 ``NotFoundError``. The response shapes are in
``responses.py`` (re-exported here).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

# The response shapes live in responses.py; importable from here as before.
from bearsdk.emulator.responses import (
    SseEncoder,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    models_response,
    usage_chunk,
)
from bearsdk.emulator.text import ChatMessageError, classify_prompt, message_text, prompt_seed

if TYPE_CHECKING:
    from bearsdk.emulator.core import EngineCore
    from bearsdk.emulator.requests import GenerationPlan

__all__ = [
    "ApiError",
    "ParsedRequest",
    "SseEncoder",
    "chat_chunk",
    "chat_response",
    "chat_role_chunk",
    "completion_chunk",
    "completion_response",
    "models_response",
    "parse_chat",
    "parse_completion",
    "usage_chunk",
]

OUTPUT_LEN_HEADER: Final = "X-Bear-Output-Len"
OUTPUT_LEN_FIELD: Final = "bear_output_len"


class ApiError(Exception):
    """An HTTP error in vLLM's shape.

    Attributes:
        status: HTTP status.
        message: Human-readable message.
        type: vLLM's error type (``BadRequestError``, ``Bad Request``, ``NotFoundError``).
        param: The offending parameter, if any.
    """

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body (``ErrorResponse``)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def _summarize(value: object) -> object:
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def schema_error(loc: str, kind: str, msg: str, value: object) -> ApiError:
    """A request-schema error, shaped as vLLM reports pydantic's (``RequestValidationError``)."""
    err = {"type": kind, "loc": f"body.{loc}" if loc else "body", "msg": msg}
    err["input"] = _summarize(value)  # type: ignore[assignment]
    return ApiError(400, f"1 validation error:\n  {err}", "Bad Request", err["loc"])


def value_error(message: str, param: str, value: object = None) -> ApiError:
    """A semantic error, shaped as vLLM reports its ``VLLMValidationError``."""
    extras = [f"parameter={param}"]
    if value is not None:
        extras.append(f"value={value}")
    return ApiError(400, f"{message} ({', '.join(extras)})", "BadRequestError", param)


def _int(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        raise schema_error(key, "int_type", "Input should be a valid integer", v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if math.isfinite(v) and v.is_integer():
            return int(v)
        raise schema_error(
            key,
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
            v,
        )
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise schema_error(
                key,
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
                v,
            ) from None
    raise schema_error(key, "int_type", "Input should be a valid integer", v)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return v.lower() in ("true", "1", "yes", "on")
    raise schema_error(key, "bool_parsing", "Input should be a valid boolean", v)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise schema_error("stop", "string_type", "Input should be a valid string or list", v)


@attrs.frozen
class ParsedRequest:
    """A validated generation request.

    Attributes:
        chat: Chat completion (else text completion).
        model: Model name to report.
        plan: What it generates.
        stream: SSE streaming.
        include_usage: Send the final usage chunk (``stream_options.include_usage``).
        continuous_usage: Usage on every chunk (``stream_options.continuous_usage_stats``).
        request_id: Response id (``cmpl-...`` / ``chatcmpl-...``).
        created: Unix time of creation.
    """

    chat: bool
    model: str
    plan: GenerationPlan
    stream: bool
    include_usage: bool
    continuous_usage: bool
    request_id: str
    created: int


def _common(
    body: Any, headers: Mapping[str, str], engine: EngineCore, required: str
) -> tuple[str, bool, bool, bool]:
    if not isinstance(body, dict):
        raise schema_error("", "model_attributes_type", "Input should be a valid dictionary", body)
    if required not in body:
        raise schema_error(required, "missing", "Field required", body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise schema_error("model", "string_type", "Input should be a valid string", model)
    if model and model != engine.model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {engine.model_name}.",
            "NotFoundError",
            "model",
        )
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise schema_error("stream_options", "model_type", "Input should be an object", opts)
        if opts and not stream:
            raise schema_error(
                "",
                "value_error",
                "Value error, Stream options can only be defined when `stream=True`. "
                "(parameter=stream_options)",
                body,
            )
        include = _bool(opts, "include_usage", False)
        continuous = include and _bool(opts, "continuous_usage_stats", False)
    n = _int(body, "n", 1)
    if n != 1:
        raise value_error(f"n must be 1 on the emulated engine, got {n}.", "n", n)
    return engine.model_name, stream, include, continuous


def _forced_len(body: Mapping[str, Any], headers: Mapping[str, str]) -> int | None:
    forced = _int(body, OUTPUT_LEN_FIELD, None)
    raw = headers.get(OUTPUT_LEN_HEADER)
    if forced is None and raw is not None:
        try:
            forced = int(raw.strip())
        except ValueError:
            raise value_error(
                f"{OUTPUT_LEN_HEADER} must be an integer, got {raw!r}.", OUTPUT_LEN_HEADER, raw
            ) from None
    if forced is not None and forced < 1:
        raise value_error(
            f"{OUTPUT_LEN_FIELD} must be at least 1, got {forced}.", OUTPUT_LEN_FIELD, forced
        )
    return forced


def _plan(
    engine: EngineCore,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    max_param: str,
    category: str,
    class_tokens: int,
    seed: int,
    text: str | None,
    prompt_ids: list[int] | None = None,
) -> GenerationPlan:
    mml = engine.max_model_len
    if max_tokens is not None and max_tokens > mml:
        raise value_error(
            f"{max_param}={max_tokens} cannot be greater than max_model_len={mml}. "
            "Please request fewer output tokens.",
            max_param,
            max_tokens,
        )
    if prompt_tokens > mml:
        raise value_error(
            f"This model's maximum context length is {mml} tokens. However, your prompt "
            f"contains {prompt_tokens} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            prompt_tokens,
        )
    effective = mml - prompt_tokens if max_tokens is None else min(max_tokens, mml - prompt_tokens)
    if effective < 1:
        raise value_error(
            f"max_tokens must be at least 1, got {effective}.", "max_tokens", effective
        )
    stop = _stop(body)
    ignore_eos = _bool(body, "ignore_eos", False)
    min_tokens = _int(body, "min_tokens", 0) or 0
    if min_tokens < 0:
        raise value_error(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens"
        )
    natural = _forced_len(body, headers)
    if natural is None and text is not None:
        natural = engine.answer_length(text)
    if natural is None:
        natural = engine.profile.lengths.sample(category, class_tokens, seed)
    return engine.plan(
        prompt_tokens,
        natural_len=natural,
        max_tokens=max_tokens,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        prompt_ids=prompt_ids,
    )


def _request_id(prefix: str, headers: Mapping[str, str]) -> str:
    rid = headers.get("X-Request-Id")
    return f"{prefix}-{rid}" if rid else f"{prefix}-{uuid.uuid4().hex}"


def parse_completion(body: Any, headers: Mapping[str, str], engine: EngineCore) -> ParsedRequest:
    """Validate a ``/v1/completions`` body.

    Raises:
        ApiError: The request is invalid (vLLM's status, type and message).
    """
    model, stream, include, continuous = _common(body, headers, engine, "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt is None or prompt == "" or prompt == []:
        raise schema_error(
            "",
            "value_error",
            "Value error, Either prompt or prompt_embeds must be provided and non-empty. "
            "(parameter=prompt)",
            body,
        )
    tok = engine.tokenizer
    # Token ids only where the prefix cache matches by them (encoding costs more
    # than counting).
    ids: list[int] | None = None
    if isinstance(prompt, str):
        if engine.prefix_caching:
            ids = tok.encode(prompt)
            prompt_tokens = len(ids)
        else:
            prompt_tokens = tok.count(prompt)
        category = classify_prompt(prompt, chat=False)
        seed = prompt_seed(engine.model_name, prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        prompt_tokens = len(prompt)
        if engine.prefix_caching:
            ids = list(prompt)
        category = "azure-conv"
        seed = prompt_seed(engine.model_name, prompt)
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise value_error(
            f"the emulated engine serves one prompt per request, got {len(prompt)}.",
            "prompt",
            len(prompt),
        )
    else:
        raise schema_error(
            "prompt", "string_type", "Input should be a valid string or list of token ids", prompt
        )
    plan = _plan(
        engine,
        body,
        headers,
        prompt_tokens=prompt_tokens,
        max_tokens=_int(body, "max_tokens", 16),
        max_param="max_tokens",
        category=category,
        class_tokens=prompt_tokens,
        seed=seed,
        text=prompt if isinstance(prompt, str) else None,
        prompt_ids=ids,
    )
    return ParsedRequest(
        False,
        model,
        plan,
        stream,
        include,
        continuous,
        _request_id("cmpl", headers),
        int(time.time()),
    )


def parse_chat(body: Any, headers: Mapping[str, str], engine: EngineCore) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        ApiError: The request is invalid (vLLM's status, type and message).
    """
    model, stream, include, continuous = _common(body, headers, engine, "messages")
    messages = body["messages"]
    tok = engine.tokenizer
    try:
        rendered = tok.render_chat(messages)
        last = ""
        for i, m in enumerate(messages):
            if m.get("role") == "user":
                last = message_text(m, i)
    except ChatMessageError as exc:
        raise schema_error(exc.field, "value_error", str(exc), exc.value) from None
    if not messages:
        raise schema_error("messages", "too_short", "List should have at least 1 item", messages)
    ids = tok.encode_chat(rendered) if engine.prefix_caching else None
    prompt_tokens = tok.count_chat(rendered) if ids is None else len(ids)
    max_param = "max_completion_tokens"
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_param = "max_tokens"
        max_tokens = _int(body, "max_tokens", None)
    plan = _plan(
        engine,
        body,
        headers,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        max_param=max_param,
        category=classify_prompt(last, chat=True),
        class_tokens=max(1, tok.count(last)),
        seed=prompt_seed(engine.model_name, rendered),
        text=last,
        prompt_ids=ids,
    )
    return ParsedRequest(
        True,
        model,
        plan,
        stream,
        include,
        continuous,
        _request_id("chatcmpl", headers),
        int(time.time()),
    )
