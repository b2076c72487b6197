"""Values the replay implementations return (shared by the compiled loop and its twin)."""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.errors import short_repr
from bearsdk.snapshot import COLUMNS

if TYPE_CHECKING:
    from bearsdk.prefix_cache import PrefixCacheState
    from bearsdk.schedulers.spec import Policy

__all__ = [
    "MAX_NEXT_TOKENS",
    "MAX_REPLAY_WORK",
    "MAX_REPLAY_WORK_PY",
    "MAX_TOKENS",
    "BatchRecord",
    "ReplayResult",
    "ReplayerProtocol",
    "StopReason",
    "check_arrival",
    "check_horizon",
    "check_next_tokens",
    "check_policy",
    "check_running",
    "check_table",
    "check_tokens",
]

MAX_TOKENS: Final = 1 << 40
"""The largest token count a replay accepts (far above any engine's, far below int64).

Both implementations refuse anything beyond it with the same ``ValueError``:
the compiled loop computes in 64-bit integers, and sums of a few counts this
size cannot overflow there.
"""

MAX_REPLAY_WORK: Final = 1 << 19
"""Work after which the compiled replay gives up (:attr:`StopReason.BATCH_LIMIT`).

One unit is one formed batch, or one request the batch touched one at a time
(served, materialised, folded back, or shifted when a preemption reorders the
queues); a unit costs about 5-10 ns, so a snapshot within the snapshot
contract's bounds replays in under 10 ms whatever it holds. Realistic states stay far
below it: the ``bearsdk bench replay`` scenarios take under 400 units, 1024
running requests with 3000 waiting about 20 thousand.
"""

MAX_REPLAY_WORK_PY: Final = 64 * MAX_REPLAY_WORK
"""The pure-Python twin's work bound, in its own units.

The twin touches every running request in every batch (the compiled loop folds
plain decodes into an aggregate), so one replay costs it more units than the
compiled one; its bound is larger so that it never stops before the compiled
loop on a replay the compiled loop finishes. The twins agree wherever neither
reaches its bound.
"""

MAX_NEXT_TOKENS: Final = 4096
"""The most tokens after the first a replay follows (``next_tokens``).

TPOT is judged over the first tens of tokens (llm-d's SLO-aware picker and
the serving benchmarks use 32 to 128); the bound keeps the per-replay token
log small and the replay's cost bounded by the batches it forms.
"""

# Lowest value accepted per column (max_tokens <= 0 means "none").
_COLUMN_MIN: Final = (0, 1, 0, 0, -MAX_TOKENS, -MAX_TOKENS, 0)


def check_tokens(value: object, name: str, minimum: int) -> int:
    """Return ``value`` as an int within ``[minimum, MAX_TOKENS]``.

    Raises:
        ValueError: It is not an integer, or out of range (the message names
            ``name`` and the value).
    """
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer (got {short_repr(value)})") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {short_repr(v)})")
    if v > MAX_TOKENS:
        raise ValueError(f"{name} must be <= 2**40 (got {short_repr(v)})")
    return v


def check_horizon(value: object) -> float:
    """Return ``value`` as a replay horizon: a number of seconds > 0, ``inf`` for none.

    Raises:
        ValueError: It is not a real number, or not > 0 (NaN included).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"horizon_s must be a number of seconds (got {short_repr(value)})")
    v = float(value)
    if not v > 0.0:
        raise ValueError(f"horizon_s must be > 0 (got {short_repr(value)})")
    return v


def check_arrival(value: object) -> float:
    """Return ``value`` as an arrival offset: a finite number of seconds >= 0.

    Raises:
        ValueError: It is not a real number, negative, infinite or NaN.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"arrival_s must be a number of seconds (got {short_repr(value)})")
    v = float(value)
    if not 0.0 <= v < math.inf:
        raise ValueError(f"arrival_s must be finite and >= 0 (got {short_repr(value)})")
    return v


def check_next_tokens(value: object) -> int:
    """Return ``value`` as a count of tokens to follow after the first.

    Raises:
        ValueError: It is not an integer in ``[0, MAX_NEXT_TOKENS]``.
    """
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"next_tokens must be an integer (got {short_repr(value)})") from None
    if not 0 <= v <= MAX_NEXT_TOKENS:
        raise ValueError(f"next_tokens must be in [0, {MAX_NEXT_TOKENS}] (got {short_repr(v)})")
    return v


# The compiled loop keeps a histogram of block_size entries per replay; the
# bound is the snapshot contract's (bearsdk.snapshot.MAX_BLOCK_SIZE).
MAX_REPLAY_BLOCK_SIZE: Final = 4096


def check_policy(p: Policy) -> None:
    """Refuse a policy whose numbers either implementation cannot replay alike.

    Specs bound their parameters when they are bound; this guards a
    :class:`~bearsdk.schedulers.Policy` built some other way (``attrs.evolve``)
    so that no size ever reaches an allocation unchecked.

    Raises:
        ValueError: The message names the field and the value.
    """
    if not 1 <= p.block_size <= MAX_REPLAY_BLOCK_SIZE:
        raise ValueError(
            f"policy {p.name!r}: block_size must be in [1, {MAX_REPLAY_BLOCK_SIZE}] "
            f"(got {short_repr(p.block_size)})"
        )
    fields = (
        ("token_budget", p.token_budget, 1),
        ("max_seqs", p.max_seqs, 1),
        ("max_model_len", p.max_model_len, 0),
        ("chunk_cap", p.chunk_cap, 0),
        ("num_blocks", p.num_blocks, 0),
        ("reserved_blocks", p.reserved_blocks, 0),
        ("watermark_blocks", p.watermark_blocks, 0),
    )
    for name, v, lo in fields:
        if not lo <= v <= MAX_TOKENS:
            raise ValueError(
                f"policy {p.name!r}: {name} must be in [{lo}, 2**40] (got {short_repr(v)})"
            )


def check_table(tab: npt.NDArray[np.int64]) -> None:
    """Refuse a snapshot table whose counts either implementation cannot replay alike.

    Args:
        tab: ``int64`` rows (``bearsdk.snapshot.COLUMNS``), already shape-checked.

    Raises:
        ValueError: A count is negative or beyond :data:`MAX_TOKENS`, a state is
            unknown, or a running request has more tokens computed than it has
            (prompt + outputs + placeholders); the message names row, column and value.
    """
    if tab.shape[0] == 0:
        return
    lo = np.asarray(_COLUMN_MIN, dtype=np.int64)
    bad = (tab < lo) | (tab > MAX_TOKENS)
    bad[:, 0] |= tab[:, 0] > 1
    running = tab[:, 0] == 0
    over = running & (tab[:, 2] > tab[:, 1] + tab[:, 3] + tab[:, 6])
    if not bad.any() and not over.any():
        return
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        v = int(tab[i, j])
        hi = 1 if j == 0 else MAX_TOKENS
        raise ValueError(
            f"row {i}: {COLUMNS[j]} must be in [{_COLUMN_MIN[j]}, {hi}] (got {short_repr(v)})"
        )
    i = int(np.argmax(over))
    raise ValueError(
        f"row {i}: computed_tokens must be <= prompt_tokens + output_tokens + placeholders "
        f"(got {int(tab[i, 2])} > {int(tab[i, 1] + tab[i, 3] + tab[i, 6])})"
    )


def check_running(p: Policy, running: int) -> None:
    """Refuse a snapshot with more running requests than the policy has seats.

    No engine runs more than ``max_num_seqs`` requests at once (vLLM stops
    admitting at that many and preempts back into the waiting queue), so such a
    state is forged or belongs to another configuration; replaying it would
    serve the excess one request at a time in every batch.

    Raises:
        ValueError: The message names the field and both values.
    """
    if running > p.max_seqs:
        raise ValueError(
            f"requests: {running} running, more than the policy {p.name!r} "
            f"runs at once (max_num_seqs {p.max_seqs})"
        )


class StopReason(enum.StrEnum):
    """Why a replay ended."""

    FIRST_TOKEN = "first-token"
    """The new request's prompt completed: its first token is computed."""
    NEVER_ADMITTED = "never-admitted"
    """Nothing can change any more and the new request is still not served
    (its prompt needs more KV blocks than the pool can ever free)."""
    BATCH_LIMIT = "batch-limit"
    """The replay gave up after ``max_batches`` batches or ``max_work`` units of
    work (:data:`MAX_REPLAY_WORK`): its ``ttft_s`` is then a lower bound (the
    time of the batches replayed), not an estimate."""
    HORIZON = "horizon"
    """The batches replayed before the first token already take longer than
    ``horizon_s``: the replay stopped at the first batch past it, and ``ttft_s``
    (the time through that batch, > ``horizon_s``) bounds the TTFT from below.
    Both twins stop at the same batch."""


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
            (``inf`` when never reached; with :attr:`StopReason.BATCH_LIMIT`, the
            sum over the batches replayed: a lower bound of the TTFT). Excludes
            any batch in flight at the snapshot; :class:`~bearsdk.BEAEstimator`
            adds that.
        stop_reason: Why the replay ended.
        batches: The simulated batches, when requested.
        token_batches: With ``next_tokens``: the 1-based batch index of each
            token the new request samples, its first token first, up to
            ``1 + next_tokens`` tokens or its output length. Shorter when the
            replay stopped before (a limit, or a state in which it can never
            resume); empty when it never reached the first token.
        token_times_s: The time at the end of each of those batches (the
            token's time, counted as ``ttft_s`` is; not part of equality: the
            compiled loop sums runs of equal batches in closed form).
    """

    first_token_batch: int
    ttft_s: float
    stop_reason: StopReason
    batches: tuple[BatchRecord, ...] | None = None
    token_batches: tuple[int, ...] = ()
    token_times_s: tuple[float, ...] = attrs.field(default=(), eq=False)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (``None``: under two tokens)."""
        t = self.token_times_s
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    @property
    def gap_p90_s(self) -> float | None:
        """The 90th percentile of the gaps between tokens (nearest rank; ``None``: under two)."""
        t = self.token_times_s
        if len(t) < 2:
            return None
        gaps = sorted(b - a for a, b in itertools.pairwise(t))
        return gaps[max(0, math.ceil(0.9 * len(gaps)) - 1)]

    @property
    def lower_bound(self) -> bool:
        """``ttft_s`` is only a lower bound (the replay stopped at a limit or its horizon)."""
        return self.stop_reason in (StopReason.BATCH_LIMIT, StopReason.HORIZON)


class ReplayerProtocol(Protocol):
    """What both replay implementations provide (see :mod:`bearsdk.replay`)."""

    implementation: str
    policy: Policy

    @property
    def last_new_examined(self) -> bool:
        """Whether the latest replay's admissions looked at the new request.

        ``False`` when the replay stopped while some request ahead of it was
        still waiting, before admission ever reached it: its batches (and a
        horizon stop among them) are then those of any new request, whatever
        its size, output or prefix keys.
        """
        ...

    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
        cache: PrefixCacheState | None = None,
    ) -> Any:
        """Turn a snapshot table (output lengths resolved) into replay state.

        With ``cache`` (the snapshot's ``kv.prefix_cache``) a prefix-caching
        policy replays the snapshot's blocks one by one.
        """
        ...

    def ttft(
        self,
        prepared: Any,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float],
        max_tokens: int = -1,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = math.inf,
        arrival_s: float = 0.0,
    ) -> float:
        """Predicted time to first token only (``inf`` when never).

        Past ``horizon_s`` the replay stops and returns the time it reached
        (a lower bound, > ``horizon_s``): what a caller that only asks
        "within the horizon?" needs, at a cost bounded by the horizon.
        With ``arrival_s`` the new request joins the waiting queue before the
        first batch scheduled at or after that time; every time, the answer
        included, still counts from the replay's start.
        """
        ...

    def residents(
        self, prepared: Any, coeffs: Sequence[float], max_batches: int
    ) -> tuple[int, float]:
        """The snapshot's requests alone, no new request: ``(batches, seconds)`` of
        the first ``max_batches`` batches (fewer when the engine runs dry)."""
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
        max_work: int | None = None,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = math.inf,
        arrival_s: float = 0.0,
        next_tokens: int = 0,
    ) -> ReplayResult:
        """Replay batch formation until the new request's first token (or ``horizon_s``).

        With ``next_tokens``, on past the first token until ``next_tokens``
        more are sampled (or its output ends): ``token_batches`` and
        ``token_times_s`` then give TPOT.
        """
        ...
