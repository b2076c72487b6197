"""Exception types shared across bearsdk.

Every error that reports bad input names the field and the value it rejected, so
that a user can find the offending byte without a debugger.
"""

from __future__ import annotations

__all__ = ["BearError", "SnapshotError", "SpecError", "short_repr"]

# An error message is read by a person and stored in counters and logs: a bad
# value from the network must not make it large (a 15 MB value once made a
# 17 MB message) or make building it fail.
MAX_VALUE_CHARS = 120
MAX_FIELD_CHARS = 200
MAX_MESSAGE_CHARS = 1000


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}...[{len(text)} chars]"


def short_repr(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """A bounded ``repr`` of an untrusted value, safe for any object.

    Never recurses into containers (a value nested a thousand deep, or one
    that contains itself, makes ``repr`` raise ``RecursionError``), never
    converts a huge integer to decimal, and never raises.

    Args:
        value: Anything.
        limit: Most characters of the result.

    Returns:
        ``repr(value)`` for short scalars; a truncated form, or the type and
        length of a container, otherwise.
    """
    try:
        if value is None or type(value) in (bool, float):
            return repr(value)
        if type(value) is int:
            if value.bit_length() > 128:
                return f"<int of {value.bit_length()} bits>"
            return repr(value)
        if isinstance(value, str | bytes | bytearray):
            if len(value) <= limit // 2:
                return _clip(repr(value), limit)
            return f"{repr(value[: limit // 2])[: limit - 24]}...[{len(value)} chars]"
        if isinstance(value, list | tuple | dict | set | frozenset):
            if not value:
                return "{}" if isinstance(value, dict) else repr(type(value)())
            return f"<{type(value).__name__} of {len(value)}>"
        return f"<{type(value).__name__}>"
    except Exception:  # a hostile __len__ or __repr__: the type is enough
        return f"<{type(value).__name__}>"


class BearError(Exception):
    """Base class of every error bearsdk raises on purpose."""


class SnapshotError(BearError, ValueError):
    """A ``bear.snapshot/1`` document failed validation.

    Attributes:
        field: Dotted path of the offending field (``"requests[3].computed_tokens"``),
            or ``""`` when the document as a whole is unusable.
        value: The rejected value (``None`` when absent).
    """

    def __init__(self, field: str, message: str, value: object = None) -> None:
        self.field = _clip(field, MAX_FIELD_CHARS)
        self.value = value
        where = f"{self.field}: " if field else ""
        super().__init__(_clip(f"snapshot {where}{message}", MAX_MESSAGE_CHARS))


class SpecError(BearError, ValueError):
    """A scheduler-policy spec (or a parameter override) failed validation.

    The message reads ``scheduler 'NAME': FIELD must be ... (got VALUE)``.

    Attributes:
        scheduler: Name of the policy the error is about.
        field: Dotted path of the offending field.
        value: The rejected value.
    """

    def __init__(self, scheduler: str, field: str, message: str, value: object = None) -> None:
        self.scheduler = _clip(scheduler, MAX_FIELD_CHARS)
        self.field = _clip(field, MAX_FIELD_CHARS)
        self.value = value
        text = f"scheduler {self.scheduler!r}: {self.field} {message}"
        super().__init__(_clip(text, MAX_MESSAGE_CHARS))
