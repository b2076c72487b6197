"""Output-length predictors for resident requests whose length the snapshot omits.

BEA needs each resident request's remaining decode work (eq. 9). A snapshot
carries ``output_len`` only when it is known (tests, what-if analysis); the rest
are predicted. The predictor is pluggable; :class:`MeanLengthPredictor` is the
simple default until trained predictors are configured.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["LengthPredictor", "MeanLengthPredictor", "resolve_output_lengths"]


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts total output lengths of resident requests from what a snapshot shows."""

    def predict_lengths(
        self, prompt_tokens: npt.NDArray[np.int64], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Return the predicted total output length of each request (any integers;
        the caller enforces at least one more token and the ``max_tokens`` cap)."""
        ...


@attrs.frozen
class MeanLengthPredictor:
    """Predicts a fixed expected length, or the expected residual once a request is past it.

    A request that has already produced ``o`` tokens is predicted to produce
    ``max(mean, o + residual)`` in total: long generations tend to keep going,
    which a fixed mean ignores.

    Attributes:
        mean: Expected total output length of a fresh request (tokens).
        residual: Expected further tokens of a request already past ``mean``.
    """

    mean: int = 256
    residual: int = 64

    def predict_lengths(
        self, prompt_tokens: npt.NDArray[np.int64], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """See :class:`LengthPredictor`."""
        return np.maximum(self.mean, output_tokens + self.residual).astype(np.int64)


def resolve_output_lengths(
    table: npt.NDArray[np.int64], predictor: LengthPredictor
) -> npt.NDArray[np.int64]:
    """Return a copy of a snapshot table with every unknown ``output_len`` predicted.

    Predictions are clamped so a request still has at least one token to go and
    never exceeds its ``max_tokens``.
    """
    from bearsdk.snapshot import COL_MAX_TOKENS, COL_OUTPUT, COL_OUTPUT_LEN, COL_PROMPT

    out = np.array(table, dtype=np.int64, copy=True)
    missing = out[:, COL_OUTPUT_LEN] < 1
    if not missing.any():
        return out
    rows = out[missing]
    pred = np.asarray(
        predictor.predict_lengths(rows[:, COL_PROMPT], rows[:, COL_OUTPUT]), dtype=np.int64
    )
    pred = np.maximum(pred, rows[:, COL_OUTPUT] + 1)
    cap = rows[:, COL_MAX_TOKENS]
    pred = np.where(cap > 0, np.minimum(pred, cap), pred)
    out[missing, COL_OUTPUT_LEN] = pred
    return out
