"""BEA: the batch-evolution-aware TTFT estimator (eq. 9-12).

From a snapshot of an instance's resident requests plus a new request, replay the
instance's batch formation (its scheduler policy, compiled) until the batch that
completes the new request's prompt, and sum the eq. 12 times of the batches up to
and including it, plus whatever remains of the batch in flight at the snapshot.
The replay stops at the first token; residents are never simulated to completion
unless that is what frees the memory or the seat the new request waits for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.length import LengthPredictor, MeanLengthPredictor, resolve_output_lengths
from bearsdk.replay import Replayer
from bearsdk.replay.types import BatchRecord, StopReason, check_horizon
from bearsdk.schedulers import Policy, bind_scheduler, compile_scheduler
from bearsdk.snapshot import Snapshot

__all__ = ["BEAEstimator", "PreparedSnapshot", "TTFTEstimate"]


def _replay_coeffs(bt: BatchTimeModel) -> tuple[float, ...]:
    """The coefficients the replay loops take: eq. 12, plus the dense floor when on."""
    return bt.extended_coeffs if bt.has_dense_floor else bt.coeffs


def _replay_horizon(horizon_s: float, prepared: PreparedSnapshot) -> float:
    """The replay's horizon: the caller's, less the batch in flight (which it adds back).

    A batch in flight that already reaches the horizon leaves the replay the
    smallest one there is: it stops after its first batch, past the horizon.
    """
    if horizon_s == math.inf:
        return horizon_s
    inflight = prepared.snapshot.inflight_remaining_s or 0.0
    h = check_horizon(horizon_s)
    return max(h - inflight, sys.float_info.min)


@attrs.frozen
class TTFTEstimate:
    """A BEA prediction.

    Attributes:
        ttft_s: Predicted time to first token, seconds (``inf`` when the request
            would never be served from this state).
        first_token_batch: 1-based index of the batch that completes the prompt.
        inflight_s: Remaining time of the batch in flight at the snapshot,
            included in ``ttft_s``.
        stop_reason: Why the replay ended.
        batches: The simulated batches, when asked for (explains the estimate).
    """

    ttft_s: float
    first_token_batch: int
    inflight_s: float
    stop_reason: StopReason
    batches: tuple[BatchRecord, ...] | None = None

    @property
    def lower_bound(self) -> bool:
        """``ttft_s`` is only a lower bound, not an estimate.

        The replay reached its batch or work bound
        (:data:`~bearsdk.replay.types.MAX_REPLAY_WORK`), or the horizon it was
        given, before the first token: ``ttft_s`` is the time of the batches
        replayed (plus the batch in flight), and the true TTFT is at least that.
        """
        return self.stop_reason in (StopReason.BATCH_LIMIT, StopReason.HORIZON)


@attrs.frozen(eq=False)
class PreparedSnapshot:
    """A snapshot turned into replay state for one estimator (build once, estimate many).

    Attributes:
        snapshot: The source snapshot.
        replayer: The compiled policy (KV geometry from the snapshot when it has one).
        state: Implementation-specific replay state.
    """

    snapshot: Snapshot
    replayer: Replayer
    state: Any


@attrs.define
class BEAEstimator:
    """Predicts TTFT at one instance by replaying its scheduler from a snapshot.

    Args:
        policy: The instance's bound scheduler policy (see :func:`bearsdk.policy`).
        batch_time: The instance's eq. 12 coefficients.
        length_predictor: Predicts output lengths the snapshot omits.
        implementation: ``"cython"`` or ``"python"``; default: the loaded one.
    """

    policy: Policy
    # Recalibration swaps the model; the replay's coefficient tuple follows it.
    batch_time: BatchTimeModel = attrs.field(on_setattr=lambda inst, _a, v: inst._set_coeffs(v))
    length_predictor: LengthPredictor = attrs.field(factory=MeanLengthPredictor)
    implementation: str | None = None
    _coeffs: tuple[float, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._coeffs = _replay_coeffs(self.batch_time)

    def _set_coeffs(self, bt: BatchTimeModel) -> BatchTimeModel:
        self._coeffs = _replay_coeffs(bt)
        return bt

    @classmethod
    def for_scheduler(
        cls,
        scheduler: str,
        batch_time: BatchTimeModel,
        params: Mapping[str, object] | None = None,
        **kwargs: object,
    ) -> BEAEstimator:
        """Build an estimator for a registered scheduler and parameter overrides."""
        return cls(bind_scheduler(scheduler, params), batch_time, **kwargs)  # type: ignore[arg-type]

    def prepare(self, snapshot: Snapshot) -> PreparedSnapshot:
        """Resolve output lengths and build replay state for ``snapshot``.

        The snapshot's KV geometry (when present) overrides the policy's. A
        prefix-caching policy given a snapshot with ``kv.prefix_cache`` replays
        its blocks one by one (``docs/prefix-caching.md``).
        """
        pol = self.policy
        free = -1
        if snapshot.kv is not None:
            pol = pol.with_kv(snapshot.kv.block_size, snapshot.kv.num_blocks)
            free = snapshot.kv.free_blocks
        table = resolve_output_lengths(snapshot.table, self.length_predictor, snapshot.ids)
        replayer = compile_scheduler(pol, self.implementation)
        state = replayer.prepare(table, free, snapshot.ids, cache=snapshot.prefix_cache)
        return PreparedSnapshot(snapshot, replayer, state)

    def estimate(
        self,
        snapshot: Snapshot | PreparedSnapshot,
        prompt_tokens: int,
        output_len: int | None = None,
        *,
        max_tokens: int | None = None,
        explain: bool = False,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = math.inf,
    ) -> TTFTEstimate:
        """Predict the TTFT of a new request joining the instance's waiting queue.

        Args:
            snapshot: The instance's snapshot, or one prepared with :meth:`prepare`.
            prompt_tokens: The new request's prompt length.
            output_len: Its output length if known; else predicted.
            max_tokens: Its output cap, if any.
            explain: Also return the simulated batches.
            prefix_keys: Content keys of its full prompt blocks
                (:func:`~bearsdk.replay.blocks.chain_keys`): with a prefix-cache
                snapshot, its admission hits what of them is cached by then.
            horizon_s: Stop once the TTFT is known to exceed this (seconds, the
                batch in flight included): the estimate is then a lower bound
                past it (:attr:`TTFTEstimate.lower_bound`), at a cost bounded by
                the horizon rather than by the queue ahead.

        Returns:
            The estimate.
        """
        prep = snapshot if isinstance(snapshot, PreparedSnapshot) else self.prepare(snapshot)
        if output_len is None:
            import numpy as np

            output_len = int(
                self.length_predictor.predict_lengths(
                    np.array([prompt_tokens], dtype=np.int64), np.zeros(1, dtype=np.int64)
                )[0]
            )
            if max_tokens is not None:
                output_len = min(output_len, max_tokens)
        res = prep.replayer.replay(
            prep.state,
            prompt_tokens,
            max(1, output_len),
            _replay_coeffs(self.batch_time),
            record=explain,
            max_tokens=-1 if max_tokens is None else max_tokens,
            prefix_keys=prefix_keys,
            horizon_s=_replay_horizon(horizon_s, prep),
        )
        inflight = prep.snapshot.inflight_remaining_s or 0.0
        return TTFTEstimate(
            ttft_s=res.ttft_s + inflight,
            first_token_batch=res.first_token_batch,
            inflight_s=inflight,
            stop_reason=res.stop_reason,
            batches=res.batches,
        )

    def ttft(
        self,
        prepared: PreparedSnapshot,
        prompt_tokens: int,
        output_len: int,
        max_tokens: int | None = None,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = math.inf,
    ) -> float:
        """The hot path: predicted TTFT in seconds, nothing else (``inf`` when never).

        A replay that reaches the work bound or ``horizon_s`` returns the lower
        bound it reached (see :attr:`TTFTEstimate.lower_bound`): a long wait,
        ranked as such.

        Args:
            prepared: From :meth:`prepare`.
            prompt_tokens: The new request's prompt length.
            output_len: Its output length (capped by ``max_tokens``).
            max_tokens: Its output cap, if any.
            prefix_keys: Content keys of its full prompt blocks (see :meth:`estimate`).
            horizon_s: Stop once the TTFT is known to exceed this (see :meth:`estimate`).
        """
        if max_tokens is not None:
            output_len = min(output_len, max_tokens)
        t = prepared.replayer.ttft(
            prepared.state,
            prompt_tokens,
            max(1, output_len),
            self._coeffs,
            -1 if max_tokens is None else max_tokens,
            prefix_keys=prefix_keys,
            horizon_s=_replay_horizon(horizon_s, prepared),
        )
        return t + (prepared.snapshot.inflight_remaining_s or 0.0)
