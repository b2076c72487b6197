"""vLLM's OpenAI-compatible response shapes, for the emulator.

Response objects (whole responses, SSE chunks, usage) carry the fields vLLM
serializes, in its order, so clients that read vLLM read these unchanged.
:class:`SseEncoder` writes the streamed chunks straight to bytes. Requests are
parsed and validated in ``api.py``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from bearsdk.emulator.api import ParsedRequest
    from bearsdk.emulator.core import EngineCore

__all__ = [
    "SseEncoder",
    "chat_chunk",
    "chat_response",
    "chat_role_chunk",
    "completion_chunk",
    "completion_response",
    "models_response",
    "prompt_tokens_details",
    "usage_chunk",
]


def _usage(
    prompt: int,
    completion: int,
    *,
    details: bool = False,
    prompt_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        u["prompt_tokens_details"] = prompt_details
        u["completion_tokens_details"] = None
    elif prompt_details is not None:
        u["prompt_tokens_details"] = prompt_details
    return u


def prompt_tokens_details(chat: bool, cached: int, created: int, *, stream: bool) -> dict[str, Any]:
    """``usage.prompt_tokens_details`` as vLLM 0.33 reports it with
    ``--enable-prompt-tokens-details``.

    ``cached_tokens`` is the prefix-cache hit of the request's first admission;
    the chat server also reports ``created_cache_tokens`` (the completions
    server leaves it unset: ``entrypoints/openai/completion/serving.py:508-511``,
    ``:668-675``; chat: ``entrypoints/openai/chat_completion/serving.py:95-114``).
    A streamed final usage chunk is serialized without its ``None`` fields,
    a whole response with them.

    Args:
        chat: A chat completion (else a text completion).
        cached: ``cached_tokens``.
        created: ``created_cache_tokens`` (chat only).
        stream: For the final usage chunk of a stream.
    """
    d: dict[str, Any] = {"cached_tokens": cached}
    if chat:
        d["created_cache_tokens"] = created
    elif not stream:
        d["created_cache_tokens"] = None
    if not stream:
        d["multimodal_tokens"] = None
    return d


def completion_chunk(
    req: ParsedRequest,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    usage: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One ``text_completion`` stream chunk."""
    d: dict[str, Any] = {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_token_ids": None,
                "token_ids": None,
                "weight_versions": None,
            }
        ],
    }
    if usage is not None:
        d["usage"] = _usage(*usage)
    d["kv_transfer_params"] = None
    return d


def chat_role_chunk(req: ParsedRequest, usage: tuple[int, int] | None = None) -> dict[str, Any]:
    """The first chat stream chunk (the assistant role)."""
    d: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if usage is not None:
        d["usage"] = _usage(*usage)
    d["prompt_token_ids"] = None
    d["prompt_text"] = None
    return d


def chat_chunk(
    req: ParsedRequest,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    usage: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with content."""
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": finish,
    }
    if finish is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = None
    if finish is not None:
        choice["weight_versions"] = None
    d: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": [choice],
    }
    if usage is not None:
        d["usage"] = _usage(*usage)
    d["kv_transfer_params"] = None
    return d


class SseEncoder:
    """The SSE events of one streaming response, encoded from pre-built parts.

    The hot path of the server (one event per request per engine step): it yields
    byte-for-byte what :func:`completion_chunk`, :func:`chat_chunk`,
    :func:`chat_role_chunk` and :func:`usage_chunk` serialize to.

    Args:
        req: The validated request.
    """

    __slots__ = ("_chat", "_head", "_usage_head")

    def __init__(self, req: ParsedRequest) -> None:
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        head = orjson.dumps(
            {"id": req.request_id, "object": obj, "created": req.created, "model": req.model}
        )[:-1]
        self._chat = req.chat
        self._head = b"data: " + head + b',"choices":[{"index":0,'
        self._usage_head = b"data: " + head + b',"choices":[],"usage":'

    @staticmethod
    def _usage(usage: tuple[int, int] | None) -> bytes:
        if usage is None:
            return b""
        return b',"usage":' + orjson.dumps(_usage(*usage))

    def content(
        self,
        text: str,
        finish: str | None,
        stop_reason: str | None,
        usage: tuple[int, int] | None = None,
    ) -> bytes:
        """One content event (``finish`` set on the last)."""
        t = orjson.dumps(text)
        f = orjson.dumps(finish)
        if self._chat:
            tail = b""
            if finish is not None:
                tail = b',"stop_reason":' + orjson.dumps(stop_reason)
            tail += b',"token_ids":null'
            if finish is not None:
                tail += b',"weight_versions":null'
            body = b'"delta":{"content":' + t + b'},"logprobs":null,"finish_reason":' + f + tail
        else:
            body = (
                b'"text":' + t + b',"logprobs":null,"finish_reason":' + f + b',"stop_reason":'
                + orjson.dumps(stop_reason)
                + b',"prompt_token_ids":null,"token_ids":null,"weight_versions":null'
            )  # fmt: skip
        return self._head + body + b"}]" + self._usage(usage) + b',"kv_transfer_params":null}\n\n'

    def role(self, usage: tuple[int, int] | None = None) -> bytes:
        """The first chat event (the assistant role)."""
        return (
            self._head
            + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            + self._usage(usage)
            + b',"prompt_token_ids":null,"prompt_text":null}\n\n'
        )

    def usage(
        self, prompt: int, completion: int, prompt_details: dict[str, Any] | None = None
    ) -> bytes:
        """The final ``usage`` event."""
        u = _usage(prompt, completion, prompt_details=prompt_details)
        return self._usage_head + orjson.dumps(u) + b"}\n\n"


def usage_chunk(
    req: ParsedRequest,
    prompt: int,
    completion: int,
    prompt_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The final stream chunk with ``usage`` (``stream_options.include_usage``)."""
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [],
        "usage": _usage(prompt, completion, prompt_details=prompt_details),
    }


def completion_response(
    req: ParsedRequest,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    completion: int,
    prompt_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` response."""
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
                "weight_versions": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(
            req.plan.prompt_tokens, completion, details=True, prompt_details=prompt_details
        ),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_response(
    req: ParsedRequest,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    completion: int,
    prompt_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` response."""
    return {
        "id": req.request_id,
        "object": "chat.completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": None,
                "routed_experts": None,
                "weight_versions": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(
            req.plan.prompt_tokens, completion, details=True, prompt_details=prompt_details
        ),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def models_response(engine: EngineCore, created: int) -> dict[str, Any]:
    """``GET /v1/models``."""
    name = engine.model_name
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": engine.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
