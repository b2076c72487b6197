"""The router's errors, and the checks of a request's arguments that raise them."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bearsdk.errors import BearError, short_repr

if TYPE_CHECKING:
    from bearsdk.router.decision import Decision

__all__ = [
    "MAX_TOKENS_LIMIT",
    "DispatchError",
    "EngineRequestError",
    "NoInstanceError",
    "RequestError",
    "check_max_tokens",
    "check_target",
    "check_timeout",
    "check_token_ids",
    "prompt_text",
]

# Output caps above this are no request's (and overflow the engines' int32 counts).
MAX_TOKENS_LIMIT = 2**31 - 1


def short(value: object) -> str:
    """A bounded ``repr`` for error messages (safe on huge or deeply nested values)."""
    return short_repr(value, 80)


class RequestError(BearError, ValueError):
    """A request argument is invalid; the message names the argument and its value."""


class NoInstanceError(BearError, RuntimeError):
    """No instance can take the request (all drained, removed or circuit-broken)."""


class DispatchError(BearError, RuntimeError):
    """Every instance tried failed before answering, or the stream broke.

    Attributes:
        attempts: ``(instance, error)`` per attempt, in order.
        decision: The routing decision the first attempt followed.
    """

    def __init__(
        self, message: str, attempts: list[tuple[str, str]], decision: Decision | None
    ) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.decision = decision


class EngineRequestError(BearError, RuntimeError):
    """The engine refused the request (HTTP 4xx): it is not retried elsewhere.

    Attributes:
        status: The HTTP status.
        body: The engine's error body.
        decision: The routing decision.
    """

    def __init__(self, status: int, body: str, decision: Decision) -> None:
        super().__init__(
            f"request {decision.request_id}: {decision.instance} answered {status}: {body[:300]}"
        )
        self.status = status
        self.body = body
        self.decision = decision


def check_target(value: object, name: str = "ttft_target") -> float | None:
    """``ttft_target`` (or ``name``): seconds > 0 (``inf``: no target), or ``None``."""
    if value is None:
        return None
    # (A plain float, the common case, skips the ABC check: a decision's hot path.)
    if type(value) is not float and (
        isinstance(value, bool) or not isinstance(value, numbers.Real)
    ):
        raise RequestError(f"{name} must be a number of seconds > 0 (got {short(value)})")
    target = float(value)
    if not target > 0:  # NaN fails this too
        raise RequestError(f"{name} must be a number of seconds > 0 (got {short(value)})")
    return target


def check_max_tokens(name: str, value: object) -> int | None:
    """An output cap: an integer in ``[1, MAX_TOKENS_LIMIT]``, or ``None``."""
    if value is None:
        return None
    # numpy integers count too (numbers.Integral); bools do not.
    n = 0 if isinstance(value, bool) or not isinstance(value, numbers.Integral) else int(value)
    if not 1 <= n <= MAX_TOKENS_LIMIT:
        raise RequestError(
            f"{name} must be an integer in [1, {MAX_TOKENS_LIMIT}] (got {short(value)})"
        )
    return n


MAX_PROMPT_TOKEN_IDS = 1 << 21
"""The longest prompt whose token ids a decision takes (2M tokens: any model's context)."""


def check_token_ids(value: object) -> list[int] | None:
    """``prompt_token_ids``: a sequence of token ids (integers >= 0), or ``None``."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RequestError(f"prompt_token_ids must be a list of integers (got {short(value)})")
    if len(value) > MAX_PROMPT_TOKEN_IDS:
        raise RequestError(
            f"prompt_token_ids: at most {MAX_PROMPT_TOKEN_IDS} tokens (got {len(value)})"
        )
    # A list of plain ints in range, the common case, is checked in one compiled
    # pass (a per-element isinstance against numbers.Integral costs ~0.7 us a
    # token: 7 ms for a 10k-token conversation); the loop below says what is wrong.
    from bearsdk.kvevents.index import token_ids

    got = token_ids(value)
    if got is not None:
        return got
    ids: list[int] = []
    for i, t in enumerate(value):
        n = -1 if type(t) is bool or not isinstance(t, numbers.Integral) else int(t)
        if not 0 <= n < 1 << 63:
            raise RequestError(
                f"prompt_token_ids[{i}] must be an integer in [0, 2**63) (got {short(t)})"
            )
        ids.append(n)
    return ids


def check_timeout(value: object) -> float | None:
    """``timeout_s``: a finite number of seconds > 0, or ``None``."""
    if value is None:
        return None
    t = 0.0 if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)
    if not (math.isfinite(t) and t > 0):
        raise RequestError(f"timeout_s must be a finite number > 0 (got {short(value)})")
    return t


def prompt_text(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """The text the predictors read: a prompt, or the messages' contents joined.

    Raises:
        RequestError: Not a string, nor a list of message objects.
    """
    if isinstance(prompt, str):
        return prompt
    given: object = prompt  # callers' types are not checked at run time
    if type(given) is not list and not isinstance(given, Sequence):
        raise RequestError(
            f"messages must be a list of message objects, or a prompt string (got {short(prompt)})"
        )
    parts = []
    for i, m in enumerate(prompt):
        if (type(m) is not dict and not isinstance(m, Mapping)) or "content" not in m:
            raise RequestError(
                f"messages[{i}] must be an object with a 'content' field (got {short(m)})"
            )
        content = m["content"]
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # OpenAI content parts
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        elif content is not None:
            raise RequestError(
                f"messages[{i}].content must be a string or a list of parts (got {short(content)})"
            )
    return "\n".join(parts)
