"""attrs validators shared by the configuration values of every subsystem.

Each names the field and the value it refused, so a bad setting reads the same
wherever it was given.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

import attrs

from bearsdk.errors import short_repr

__all__ = ["count", "fraction", "positive", "unknown_field"]


def unknown_field(label: str, key: object, known: Sequence[str]) -> str:
    """The strict decoders' message for a key they do not know.

    ``LABEL: 'KEY' is not a known field; did you mean 'X'? (known: A, B)``: the
    key bounded and quoted (it is untrusted), the closest known name if one is
    close, and the known names in the order given.
    """
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{label}: {short_repr(key)} is not a known field{hint} (known: {', '.join(known)})"


def positive(inst: object, att: attrs.Attribute[Any], value: object) -> None:
    """A finite number > 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{att.name} must be a finite number > 0 (got {value!r})")


def count(inst: object, att: attrs.Attribute[Any], value: object) -> None:
    """An integer >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{att.name} must be an integer >= 1 (got {value!r})")


def fraction(inst: object, att: attrs.Attribute[Any], value: object) -> None:
    """A number in [0, 1] (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{att.name} must be in [0, 1] (got {value!r})")
