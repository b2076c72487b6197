"""Pure-Python replay of batch formation: the readable reference and test oracle.

The twin of ``cext/_replay_c.pyx``: the same :class:`Replayer` contract, which
property tests require to produce identical batch sequences. It holds only what
is twinned. The replay prepares a snapshot with the policy's geometry
(:mod:`bearsdk.replay.requests`) and runs the live scheduler
(:class:`~bearsdk.replay.scheduler.SchedulerCore`, the one the emulator and the
simulator run) from it in zero time until the new request's first token; the
compiled loop implements the same steps at C speed (aggregating plain decodes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from bearsdk.replay.requests import NEW_REQUEST_ID, CachedReq, PolicyGeometry, Prepared, content_key
from bearsdk.replay.scheduler import SchedulerCore
from bearsdk.replay.types import (
    MAX_REPLAY_WORK_PY,
    MAX_TOKENS,
    ReplayResult,
    check_arrival,
    check_horizon,
    check_next_tokens,
    check_tokens,
)

if TYPE_CHECKING:
    # Typing only: the scheduler package compiles specs for the replay, not
    # the reverse.
    from bearsdk.prefix_cache import PrefixCacheState
    from bearsdk.schedulers.spec import Policy

__all__ = ["IMPLEMENTATION", "Prepared", "Replayer"]

IMPLEMENTATION = "python"


class Replayer:
    """Replays a policy's batch formation from a prepared snapshot.

    Args:
        policy: The bound policy to interpret.
    """

    implementation = IMPLEMENTATION

    def __init__(self, policy: Policy) -> None:
        self._geo = PolicyGeometry(policy)
        self.policy = policy
        self._new_seen = False

    @property
    def last_new_examined(self) -> bool:
        """Whether the latest replay's admissions looked at the new request.

        ``False`` when it stopped while some request ahead of the new one was
        still waiting: its batches are then those of any new request.
        """
        return self._new_seen

    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
        cache: PrefixCacheState | None = None,
    ) -> Prepared:
        """Turn a snapshot table (output lengths resolved) into replay state.

        Args:
            table: ``int64`` rows in scheduling order (``bearsdk.snapshot.COLUMNS``);
                every ``output_len`` must be set (``>= 1``).
            free_blocks: Free KV blocks the engine reported; ``-1`` to derive them
                from the policy's pool size and the running requests' blocks.
            ids: Request ids (for step-by-step records); defaults to row numbers.
            cache: The snapshot's ``prefix_cache``: a prefix-caching policy then
                replays its blocks one by one (``docs/prefix-caching.md``).

        Returns:
            Replay-ready state.

        Raises:
            ValueError: An output length is missing or the table is malformed.
        """
        return self._geo.prepare(table, free_blocks, ids, cache)

    def ttft(
        self,
        prepared: Prepared,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float],
        max_tokens: int = -1,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = math.inf,
        arrival_s: float = 0.0,
    ) -> float:
        """Return only the predicted time to first token (``inf`` when never).

        Past ``horizon_s``: the time replayed through the first batch past it
        (a lower bound), as :meth:`replay` reports it.
        """
        return self.replay(
            prepared,
            prompt_tokens,
            output_len,
            coeffs,
            max_tokens=max_tokens,
            prefix_keys=prefix_keys,
            horizon_s=horizon_s,
            arrival_s=arrival_s,
        ).ttft_s

    def residents(
        self, prepared: Prepared, coeffs: Sequence[float], max_batches: int
    ) -> tuple[int, float]:
        """Replay the snapshot's requests alone, with no new request.

        What the residents' next batches cost if nothing is added: the
        baseline against which an admission's harm to them is measured
        (``docs/tpot.md``).

        Args:
            prepared: State from :meth:`prepare` (not modified).
            coeffs: Eq. 12 coefficients, as :meth:`replay` takes them.
            max_batches: Stop after this many batches.

        Returns:
            ``(batches, seconds)``: the batches formed (fewer than
            ``max_batches`` when the engine runs dry first) and their summed
            eq. 12 time.
        """
        limit = check_tokens(max_batches, "max_batches", 0)
        run = SchedulerCore.from_prepared(self._geo, prepared, False, coeffs)
        return run.run_residents(limit, MAX_REPLAY_WORK_PY)

    def replay(
        self,
        prepared: Prepared,
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
        """Replay batch formation until the new request's first token.

        Args:
            prepared: State from :meth:`prepare` (not modified).
            prompt_tokens: The new request's prompt length.
            output_len: Its (predicted) output length.
            coeffs: Eq. 12 coefficients ``(b0, b1, b2, b3)`` in seconds, optionally
                followed by the richer dense term's floor ``tau`` (tokens): the dense
                part then costs ``b1 * max(tokens, tau)``; and then by the keys a
                decode adds to its own context (``1.0``: it attends itself), as
                :attr:`~bearsdk.estimators.batch_time.BatchTimeModel.replay_coeffs`
                gives them.
            record: Return the simulated batches.
            max_batches: Give up after this many batches.
            max_tokens: The new request's output cap (``-1``: none).
            max_work: Give up after this much work: one unit per batch and per
                request in it or in the running list (default
                :data:`~bearsdk.replay.types.MAX_REPLAY_WORK_PY`).
            prefix_keys: Content keys of the new request's full prompt blocks
                (:func:`~bearsdk.replay.blocks.chain_keys`, or the engine's as
                ``kv.prefix_cache`` names them): with a prepared block pool, its
                admission hits whatever of them is cached by then.
            horizon_s: Stop at the first batch that ends past this time (seconds
                from the snapshot) before the first token, with
                :attr:`~bearsdk.replay.types.StopReason.HORIZON`: a decision that
                only needs "within the target?" pays for the horizon, not for
                the whole queue ahead.
            arrival_s: When the new request arrives (seconds from the
                snapshot's batch in flight ending): it joins the waiting queue
                before the first batch scheduled at or after it, the snapshot's
                requests running on meanwhile (an idle engine waits for it).
                So one prepared snapshot answers for requests arriving later,
                as fast-forwarding it to then would. Every time returned still
                counts from the replay's start: the TTFT is ``ttft_s`` less
                the arrival.
            next_tokens: Go on past the first token until the new request has
                sampled this many more (or its output ends; ``0``: stop at the
                first token). The batches then run as the engine would run
                them: a preemption of the new request, its recompute and the
                residents' finishes and admissions all shape its token times
                (``token_batches``, ``token_times_s``, ``tpot_s``). The
                horizon applies to the first token only.

        Returns:
            The first-token batch, the summed batch times, and optionally the
            batches. A replay that gives up returns
            :attr:`~bearsdk.replay.types.StopReason.BATCH_LIMIT` with the time of
            the batches replayed: a lower bound of the TTFT.
        """
        prompt_tokens = check_tokens(prompt_tokens, "prompt_tokens", 1)
        output_len = check_tokens(output_len, "output_len", -MAX_TOKENS)
        max_tokens = check_tokens(max_tokens, "max_tokens", -MAX_TOKENS)
        max_batches = check_tokens(max_batches, "max_batches", -MAX_TOKENS)
        work = MAX_REPLAY_WORK_PY if max_work is None else max_work
        work = check_tokens(work, "max_work", -MAX_TOKENS)
        horizon = check_horizon(horizon_s)
        arrival = check_arrival(arrival_s)
        follow = check_next_tokens(next_tokens)
        run = SchedulerCore.from_prepared(self._geo, prepared, record, coeffs)
        if run.pool is None:
            new = self._geo.make_req(
                NEW_REQUEST_ID, prompt_tokens, 0, max(output_len, 1), max_tokens
            )
        else:
            c = cast(
                CachedReq,
                self._geo.make_req(
                    NEW_REQUEST_ID, prompt_tokens, 0, max(output_len, 1), max_tokens, CachedReq
                ),
            )
            c.keys = [content_key(k, i) for i, k in enumerate(prefix_keys or ())][
                : prompt_tokens // self._geo.block_size
            ]
            new = c
        if arrival == 0.0:
            run.waiting.append(new)
        try:
            return run.go(new, max_batches, work, horizon, arrival, follow)
        finally:
            self._new_seen = run.watched_seen
