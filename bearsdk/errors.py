"""Exception types shared across bearsdk.

Every error that reports bad input names the field and the value it rejected, so
that a user can find the offending byte without a debugger.
"""

from __future__ import annotations

__all__ = ["BearError", "SnapshotError", "SpecError"]


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
        self.field = field
        self.value = value
        where = f"{field}: " if field else ""
        super().__init__(f"snapshot {where}{message}")


class SpecError(BearError, ValueError):
    """A scheduler-policy spec (or a parameter override) failed validation.

    The message reads ``scheduler 'NAME': FIELD must be ... (got VALUE)``.

    Attributes:
        scheduler: Name of the policy the error is about.
        field: Dotted path of the offending field.
        value: The rejected value.
    """

    def __init__(self, scheduler: str, field: str, message: str, value: object = None) -> None:
        self.scheduler = scheduler
        self.field = field
        self.value = value
        super().__init__(f"scheduler {scheduler!r}: {field} {message}")
