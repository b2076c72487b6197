"""Errors of the predictors package.

Like every bearsdk error that reports bad input, these name the offending field
and the value they rejected.
"""

from __future__ import annotations

from typing import Final

from bearsdk.errors import BearError

__all__ = ["PredictorError", "PredictorFormatError"]

_UNSET: Final = object()


class PredictorError(BearError, ValueError):
    """Bad input to a predictor: a prompt, a model name, a training record, an option.

    The message reads ``FIELD MESSAGE (got VALUE)``.

    Attributes:
        field: Dotted path of the offending field (``"records[12].accuracy"``).
        value: The rejected value (``None`` when there is none to show).
    """

    def __init__(self, field: str, message: str, value: object = _UNSET) -> None:
        self.field = field
        self.value = None if value is _UNSET else value
        got = "" if value is _UNSET else f" (got {value!r})"
        super().__init__(f"{field} {message}{got}")


class PredictorFormatError(PredictorError):
    """A saved predictor cannot be used: corrupt, truncated, or of another format version.

    The message reads ``predictor file PATH: FIELD MESSAGE (got VALUE)``.

    Attributes:
        path: The file, when known.
    """

    def __init__(
        self, field: str, message: str, value: object = _UNSET, *, path: str | None = None
    ) -> None:
        super().__init__(field, message, value)
        self.path = path
        self.message = message
        if path is not None:
            self.args = (f"predictor file {path}: {self.args[0]}",)

    def at(self, path: str) -> PredictorFormatError:
        """Return this error with the file it concerns named in the message."""
        value = _UNSET if self.value is None else self.value
        return PredictorFormatError(self.field, self.message, value, path=path)
