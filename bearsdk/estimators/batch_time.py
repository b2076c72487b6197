"""The four-term token-batch time model of eq. 12.

``T = b0 + b1 * tokens + b2 * sum(decode context) + b3 * sum(prefill attention)``,
where a prefill chunk of ``t`` tokens after ``c`` computed ones contributes
``t*c + t*(t+1)/2`` to the attention sum. The compiled replay evaluates the same
expression inside its loop from the four coefficients.
"""

from __future__ import annotations

import math

import attrs

from bearsdk.replay.types import BatchRecord

__all__ = ["BatchTimeModel"]


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"batch-time coefficient {att.name} must be a finite number >= 0 (got {value!r})"
        )


@attrs.frozen
class BatchTimeModel:
    """Eq. 12 coefficients of one model instance, in seconds.

    Attributes:
        b0: Fixed per-batch overhead.
        b1: Per token (dense layers).
        b2: Per unit of decode context (attention over the KV cache).
        b3: Per unit of prefill attention (``t*c + t*(t+1)/2``).
    """

    b0: float = attrs.field(converter=float, validator=_nonneg)
    b1: float = attrs.field(converter=float, validator=_nonneg)
    b2: float = attrs.field(converter=float, validator=_nonneg)
    b3: float = attrs.field(converter=float, validator=_nonneg)

    @property
    def coeffs(self) -> tuple[float, float, float, float]:
        """``(b0, b1, b2, b3)``, the form the replay loop takes."""
        return (self.b0, self.b1, self.b2, self.b3)

    def batch_time(
        self, prefill_tokens: int, decode_tokens: int, decode_context: int, prefill_attention: int
    ) -> float:
        """Return the predicted duration of a batch with this composition (seconds)."""
        return (
            self.b0
            + self.b1 * (prefill_tokens + decode_tokens)
            + self.b2 * decode_context
            + self.b3 * prefill_attention
        )

    def time_of(self, batch: BatchRecord) -> float:
        """Return the predicted duration of a simulated batch (seconds)."""
        return self.batch_time(
            batch.prefill_tokens, batch.decode_tokens, batch.decode_context, batch.prefill_attention
        )
