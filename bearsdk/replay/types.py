"""Values the replay implementations return (shared by the compiled loop and its twin)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from bearsdk.schedulers.spec import Policy

__all__ = ["BatchRecord", "ReplayResult", "ReplayerProtocol", "StopReason"]


class StopReason(enum.StrEnum):
    """Why a replay ended."""

    FIRST_TOKEN = "first-token"
    """The new request's prompt completed: its first token is computed."""
    NEVER_ADMITTED = "never-admitted"
    """Nothing can change any more and the new request is still not served
    (its prompt needs more KV blocks than the pool can ever free)."""
    BATCH_LIMIT = "batch-limit"
    """The replay gave up after ``max_batches`` batches."""


@attrs.frozen
class BatchRecord:
    """One simulated batch, described by the quantities eq. 12 prices.

    Attributes:
        num_seqs: Requests with tokens in the batch.
        prefill_tokens: Prompt (or recompute) tokens in the batch.
        decode_tokens: Decode tokens (one per decoding request).
        decode_context: Sum over decodes of the context length before the batch.
        prefill_attention: Sum over prefill chunks of ``t*c + t*(t+1)/2`` for a chunk
            of ``t`` tokens after ``c`` computed ones (eq. 12's last term).
        admitted: Requests admitted from the waiting queue in this batch.
        preempted: Requests preempted while forming this batch.
        duration_s: Eq. 12 time of the batch under the replay's coefficients.
        tokens_by_request: ``(request id, tokens)`` pairs, from the pure-Python
            implementation only (for step-by-step comparison with an engine); not
            part of equality.
    """

    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    decode_context: int
    prefill_attention: int
    admitted: int
    preempted: int
    duration_s: float = attrs.field(eq=False)
    tokens_by_request: tuple[tuple[str, int], ...] | None = attrs.field(default=None, eq=False)

    @property
    def total_tokens(self) -> int:
        """Tokens in the batch."""
        return self.prefill_tokens + self.decode_tokens


@attrs.frozen
class ReplayResult:
    """The outcome of replaying batch formation for a new request.

    Attributes:
        first_token_batch: 1-based index of the batch that completes the new
            request's prompt; ``0`` when the replay stopped before that.
        ttft_s: Sum of the eq. 12 times of batches ``1..first_token_batch``
            (``inf`` when never reached). Excludes any batch in flight at the
            snapshot; :class:`~bearsdk.BEAEstimator` adds that.
        stop_reason: Why the replay ended.
        batches: The simulated batches, when requested.
    """

    first_token_batch: int
    ttft_s: float
    stop_reason: StopReason
    batches: tuple[BatchRecord, ...] | None = None


class ReplayerProtocol(Protocol):
    """What both replay implementations provide (see :mod:`bearsdk.replay`)."""

    implementation: str
    policy: Policy

    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
    ) -> Any:
        """Turn a snapshot table (output lengths resolved) into replay state."""
        ...

    def ttft(
        self,
        prepared: Any,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float],
        max_tokens: int = -1,
    ) -> float:
        """Predicted time to first token only (``inf`` when never)."""
        ...

    def replay(
        self,
        prepared: Any,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
        record: bool = False,
        max_batches: int = 1_000_000,
        max_tokens: int = -1,
    ) -> ReplayResult:
        """Replay batch formation until the new request's first token."""
        ...
