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
import numpy as np

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.length import LengthPredictor, MeanLengthPredictor, resolve_output_lengths
from bearsdk.replay import Replayer
from bearsdk.replay.types import BatchRecord, StopReason, check_arrival, check_horizon
from bearsdk.schedulers import Policy, bind_scheduler, compile_scheduler
from bearsdk.snapshot import (
    COL_COMPUTED,
    COL_PROMPT,
    COL_STATE,
    STATE_WAITING,
    Snapshot,
)

__all__ = ["BEAEstimator", "PreparedSnapshot", "TTFTEstimate", "prefill_ahead"]


_HORIZON_STOPS = 8
"""Horizon stops remembered per prepared state (a few targets' worth)."""


def _replay_coeffs(bt: BatchTimeModel) -> tuple[float, ...]:
    """The coefficients the replay loops take (:attr:`BatchTimeModel.replay_coeffs`)."""
    return bt.replay_coeffs


def _replay_horizon(horizon_s: float, prepared: PreparedSnapshot, arrival_s: float = 0.0) -> float:
    """The replay's horizon: the caller's, from the new request's arrival (``arrival_s``
    after the snapshot), less the batch in flight (which the replay starts after).

    A batch in flight that already reaches the horizon leaves the replay the
    smallest one there is: it stops after its first batch, past the horizon.
    """
    if horizon_s == math.inf:
        return horizon_s
    inflight = prepared.snapshot.inflight_remaining_s or 0.0
    # A float > 0 needs no further check (NaN is not > 0): the hot path's case.
    h = horizon_s if type(horizon_s) is float and horizon_s > 0.0 else check_horizon(horizon_s)
    return max(h + arrival_s - inflight, sys.float_info.min)


def _arrival(arrival_s: float) -> float:
    """``arrival_s`` checked: a finite float >= 0 passes without a call (the hot path)."""
    if type(arrival_s) is float and 0.0 <= arrival_s < math.inf:
        return arrival_s
    return check_arrival(arrival_s)


# Residents baselines kept per prepared state (one per window length asked).
_RESIDENTS_MEMO = 32


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
        token_batches: With ``next_tokens``: the batch index of each token
            followed, the first included (see
            :attr:`~bearsdk.replay.types.ReplayResult.token_batches`).
        tpot_s: With ``next_tokens``: predicted mean time per output token
            after the first, over the tokens followed (``None``: fewer than two).
        gap_p90_s: With ``next_tokens``: the 90th percentile of the predicted
            gaps between those tokens.
        window_s: With ``next_tokens``: the replay's time at the end of the
            batch of the last token followed, from the replay's start (the
            window over which an admission's harm to residents is measured).
    """

    ttft_s: float
    first_token_batch: int
    inflight_s: float
    stop_reason: StopReason
    batches: tuple[BatchRecord, ...] | None = None
    token_batches: tuple[int, ...] = ()
    tpot_s: float | None = None
    gap_p90_s: float | None = None
    window_s: float | None = None

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
        horizon_stops: Horizon stops of earlier replays of this state that
            hold for any new request (:meth:`BEAEstimator.ttft`).
    """

    snapshot: Snapshot
    replayer: Replayer
    state: Any
    in_order: bool = False
    """Whether no new request's first token can come before a one-token
    request's arriving no later (:meth:`BEAEstimator.admission_bound`)."""
    ahead_rows: int = 0
    """Which rows :attr:`ahead` counts: none (0: a new request may overtake),
    the waiting ones (1) or all (2); a property of the policy."""
    # Horizon stops reached before admission ever looked at the new request:
    # (replay horizon, time reached, coefficients, arrival), see BEAEstimator.ttft.
    horizon_stops: list[tuple[float, float, tuple[float, ...], float]] = attrs.field(
        factory=list, init=False, repr=False
    )
    # The one-token request's first token (BEAEstimator.admission_bound):
    # [coefficients, its arrival, its first token's time from the snapshot (None:
    # asked once, not replayed yet), whether exact (else where a replay stopped
    # at its horizon)], or empty.
    admission: list[Any] = attrs.field(factory=list, init=False, repr=False)
    # The residents replayed alone, by (coefficients, batches): the baseline of an
    # admission's harm is the same for every request and candidate (BEAEstimator.residents).
    residents_memo: dict[tuple[tuple[float, ...], int], tuple[int, float]] = attrs.field(
        factory=dict, init=False, repr=False
    )
    # The snapshot's cached block keys, as a set (built on the first prefix lookup;
    # a list holding it, the class being frozen).
    _cached_keys: list[frozenset[int]] = attrs.field(factory=list, init=False, repr=False)
    # ahead, counted when first read (an estimate with no horizon never reads it).
    _ahead: list[tuple[float, float]] = attrs.field(factory=list, init=False, repr=False)

    @property
    def ahead(self) -> tuple[float, float]:
        """The prefill work every new request waits behind, as eq. 12 counts it:
        ``(tokens, prefill attention)`` (see :meth:`BEAEstimator.bound`;
        ``(0, 0)`` where the policy lets a new request overtake)."""
        if not self._ahead:
            self._ahead.append(_prefill_of(self.snapshot, self.ahead_rows))
        return self._ahead[0]

    def cached_blocks(self, keys: Sequence[int]) -> int:
        """How many of a prompt's chain of keys the snapshot's cache holds, from the start.

        What the engine would hit were the request admitted at the snapshot (the
        replay looks up again at its admission). ``0`` without ``kv.prefix_cache``.
        """
        pc = self.snapshot.prefix_cache
        if pc is None:
            return 0
        if self.replayer.policy.prefix_caching:
            # The replay holds the pool: its content map answers (in C, compiled).
            return int(self.state.hit_blocks(keys))
        if not self._cached_keys:
            self._cached_keys.append(frozenset(pc.keys[: pc.cached]))
        got = self._cached_keys[0]
        n = 0
        for k in keys:
            if k not in got:
                break
            n += 1
        return n


def _overtaking_impossible(pol: Policy) -> bool:
    """Whether a new request's first token comes after all the prefill queued ahead.

    So under FCFS admission with head-of-line blocking (nothing admitted past
    a blocked request), no per-request chunk cap (the cap leaves budget for
    the requests behind, which may then finish first), and preempted requests
    requeued in front (at the back, one preempted mid-prompt would redo its
    prompt after the new request). With chunked prefill, a stage that serves
    prefills must also come before admissions: else a request admitted with
    a first chunk finishes its prompt in a later stage, behind a new request
    admitted whole in the meantime. And budgets counted as tokens: counted
    padded (sequences x longest chunk), a long prompt left in the queue may
    not fit where a short new one does.
    """
    if "waiting" not in pol.stages:
        return False
    first = pol.stages.index("waiting")
    return (
        pol.on_blocked == "stop"
        and pol.budget_count == "tokens"
        and pol.chunk_cap == 0
        and (pol.victim == "none" or pol.requeue == "front")
        and (
            not pol.chunked_prefill or any(x in ("running", "prefills") for x in pol.stages[:first])
        )
    )


def first_tokens_in_order(pol: Policy) -> bool:
    """Whether a new request's first token never comes before that of a
    one-token request (one output token) arriving no later.

    Under :func:`_overtaking_impossible`'s conditions a new request waits for
    everything queued ahead whatever its length, and joins at a turn no
    earlier for arriving later (the residents' batches do not depend on it
    before it is admitted). A one-token request is admitted at the first turn
    with a token of budget, a seat and a block left, which any longer request
    needs too; with admissions the last stage, its batch holds the same
    residents' work as a longer one's would, and eq. 12's terms only grow with
    the new request's tokens. So the one-token request's first token is a
    lower bound on every new request's, for every arrival from its own on.
    (Where a stage comes after admissions, a long prompt can take the budget
    of decodes that the one-token request leaves in its batch.)
    """
    return _overtaking_impossible(pol) and pol.stages[-1] == "waiting"


def prefill_ahead(pol: Policy, snapshot: Snapshot) -> tuple[float, float]:
    """The prefill a new request waits behind, as :attr:`PreparedSnapshot.ahead`.

    Every waiting prompt, and the rest of every running one whose stage comes
    before admissions; ``(0, 0)`` where ``pol`` lets a new request overtake or
    the snapshot caches prefixes.
    """
    return _prefill_of(snapshot, _ahead_rows(pol))


def _ahead_rows(pol: Policy) -> int:
    """Which rows :func:`prefill_ahead` counts under ``pol``: none (0, a new
    request may overtake), the waiting ones (1), or all (2)."""
    if not _overtaking_impossible(pol):
        return 0
    st = pol.stages
    first = st.index("waiting")
    # All where running prompts are served before admissions: running and
    # waiting are the only states (a decoding request, its prompt computed,
    # adds nothing).
    return 2 if any(x in ("running", "prefills") for x in st[:first]) else 1


_SMALL_TABLE = 32


def _prefill_of(snapshot: Snapshot, rows: int) -> tuple[float, float]:
    if not rows or snapshot.prefix_cache is not None or not len(snapshot):
        # Cached blocks shorten prefills by what the snapshot cannot say yet.
        return (0.0, 0.0)
    t = snapshot.table
    if len(t) <= _SMALL_TABLE:
        # In exact integers, row by row: cheaper than numpy's calls for a few
        # rows (a fast-forwarded view, rebuilt after each dispatch, often holds
        # a few); the same sums wherever numpy's floats are exact.
        tokens = attention = 0
        for row in t.tolist():
            if rows == 2 or row[COL_STATE] == STATE_WAITING:
                pp, cc = row[COL_PROMPT], min(row[COL_COMPUTED], row[COL_PROMPT])
                tokens += pp - cc
                attention += pp * (pp + 1) - cc * (cc + 1)
        return (float(tokens), attention * 0.5)
    if rows == 1:
        t = t[t[:, COL_STATE] == STATE_WAITING]
    p = t[:, COL_PROMPT].astype(np.float64)
    c = np.minimum(t[:, COL_COMPUTED], t[:, COL_PROMPT]).astype(np.float64)
    # A chunked prompt's attention terms telescope: the chunks of one request
    # from c computed tokens to p sum to p(p+1)/2 - c(c+1)/2 however it is cut.
    return (float(p.sum() - c.sum()), float((p @ (p + 1.0) - c @ (c + 1.0)) * 0.5))


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
    # The compiled replayer of the last KV geometry seen, with what its policy
    # says once for all: (policy, implementation, geometry, replayer,
    # first_tokens_in_order, _ahead_rows); re-binding and looking it up per
    # snapshot costs as much as preparing the requests.
    _compiled: tuple[Policy, str | None, tuple[int, int] | None, Replayer, bool, int] | None = (
        attrs.field(init=False, default=None)
    )

    def __attrs_post_init__(self) -> None:
        self._coeffs = _replay_coeffs(self.batch_time)

    def _set_coeffs(self, bt: BatchTimeModel) -> BatchTimeModel:
        self._coeffs = _replay_coeffs(bt)
        return bt

    @property
    def replay_coeffs(self) -> tuple[float, ...]:
        """The coefficients the replay runs on (:attr:`BatchTimeModel.replay_coeffs`:
        eq. 12's four, then the dense floor's ``tau`` and the decode convention
        where needed); fast-forward times its batches with the same."""
        return self._coeffs

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

    def prepare(self, snapshot: Snapshot, *, lengths_known: bool = False) -> PreparedSnapshot:
        """Resolve output lengths and build replay state for ``snapshot``.

        The snapshot's KV geometry (when present) overrides the policy's. A
        prefix-caching policy given a snapshot with ``kv.prefix_cache`` replays
        its blocks one by one (``docs/prefix-caching.md``).

        Args:
            snapshot: The instance's state.
            lengths_known: Every row's ``output_len`` is known and valid (a
                fast-forwarded view's: its virtual engine holds each one), so
                the table is used as it is, unchecked.
        """
        kv = snapshot.kv
        geometry = None if kv is None else (kv.block_size, kv.num_blocks)
        memo = self._compiled
        if (
            memo is None
            or memo[0] is not self.policy  # identity: equality of policies costs microseconds
            or memo[1] != self.implementation
            or memo[2] != geometry
        ):
            pol = self.policy if kv is None else self.policy.with_kv(kv.block_size, kv.num_blocks)
            replayer = compile_scheduler(pol, self.implementation)
            memo = (
                self.policy,
                self.implementation,
                geometry,
                replayer,
                first_tokens_in_order(replayer.policy),
                _ahead_rows(replayer.policy),
            )
            self._compiled = memo
        replayer = memo[3]
        table = (
            snapshot.table
            if lengths_known
            else resolve_output_lengths(snapshot.table, self.length_predictor, snapshot.ids)
        )
        free = -1 if kv is None else kv.free_blocks
        state = replayer.prepare(table, free, snapshot.ids, cache=snapshot.prefix_cache)
        return PreparedSnapshot(
            snapshot, replayer, state, snapshot.prefix_cache is None and memo[4], memo[5]
        )

    def residents(self, prepared: PreparedSnapshot, batches: int) -> tuple[int, float]:
        """The snapshot's requests alone for ``batches`` batches: ``(formed, seconds)``.

        The baseline an admission's harm to the residents is measured against
        (``docs/tpot.md``), remembered on ``prepared`` (it does not depend on
        the new request): with one prepared state per snapshot and overlay, the
        second replay is paid once, not once per request.
        """
        coeffs = self._coeffs
        memo = prepared.residents_memo
        key = (coeffs, batches)
        got = memo.get(key)
        if got is None:
            got = prepared.replayer.residents(prepared.state, coeffs, batches)
            if len(memo) >= _RESIDENTS_MEMO:
                del memo[next(iter(memo))]
            memo[key] = got
        return got

    def admission_bound(
        self, prepared: PreparedSnapshot, arrival_s: float, horizon_s: float = math.inf
    ) -> float:
        """A lower bound on :meth:`ttft` for any new request arriving ``arrival_s``
        after the snapshot, whatever its prompt and output: the first token of a
        one-token request (:func:`first_tokens_in_order`), replayed once per
        prepared state and coefficients and kept.

        Where a queue is long, that request's first token is most of anyone's:
        the bound settles "later than the horizon", or "later than the lowest
        TTFT found so far", with no replay of each request's own. The replay
        is run the second time the state is asked (a state asked once, as a
        snapshot polled between two decisions is, costs no extra replay) and
        stops at ``horizon_s`` (its time then is still a lower bound). ``0``
        where no bound is kept: the policy lets requests overtake, the
        snapshot caches prefixes, or the state was not asked before.
        """
        if not prepared.in_order:
            return 0.0
        coeffs = self._coeffs
        arrival = _arrival(arrival_s)
        memo = prepared.admission
        if memo and memo[0] is coeffs and arrival >= memo[1]:
            k = memo[2]
            if k is not None and (memo[3] or k - arrival > horizon_s):
                return float(k - arrival) if k != -math.inf else 0.0
            # Asked again, or kept from a replay stopped short of this horizon:
            # replay now, at this arrival (a later one is reached no earlier).
            inflight = prepared.snapshot.inflight_remaining_s or 0.0
            h = _replay_horizon(horizon_s, prepared, arrival)
            start = max(arrival - inflight, 0.0)
            t = float(prepared.replayer.ttft(prepared.state, 1, 1, coeffs, 1, None, h, start))
            if t == math.inf:
                # Never admitted: a state stuck before it is (a resident that
                # preempts itself for good). The replay ends there, but one
                # arriving after the stuck step waits idle for it and goes on:
                # it orders nothing. No bound, for good, at any arrival.
                memo[1:] = -math.inf, -math.inf, True
                return 0.0
            memo[1:] = arrival, t + inflight, t <= h
            return t + inflight - arrival
        memo[:] = [coeffs, arrival, None, False]
        return 0.0

    def bound(self, prepared: PreparedSnapshot, prompt_tokens: int) -> float:
        """A lower bound on :meth:`ttft` for a new request, in O(1).

        The new request's first token needs its own prompt prefilled and, where
        the policy lets nothing overtake, all the prefill queued ahead of it
        (:attr:`PreparedSnapshot.ahead`); eq. 12's terms are all non-negative,
        so those tokens alone cost at least ``b1`` each, their attention ``b3``
        per unit, and they fill at least ``ceil(tokens / token budget)``
        batches of ``b0``. Decodes, preemptions and the requests sent since
        only add to it. It is what lets the router answer "later than the
        horizon" without replaying a long queue (``docs/decision-cost.md``).
        With prefix caching on the snapshot, a prompt's cached blocks are not
        known here: the bound is then 0.
        """
        snap = prepared.snapshot
        if snap.prefix_cache is not None:
            return 0.0
        c = self._coeffs
        p = float(prompt_tokens) if prompt_tokens > 1 else 1.0
        ahead_tokens, ahead_attention = prepared.ahead
        tokens = ahead_tokens + p
        attention = ahead_attention + p * (p + 1.0) * 0.5
        batches = math.ceil(tokens / prepared.replayer.policy.token_budget)
        t = c[0] * batches + c[1] * tokens + c[3] * attention
        # Below the replay's own sums by more than their rounding.
        return t * (1.0 - 1e-9) + (snap.inflight_remaining_s or 0.0)

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
        arrival_s: float = 0.0,
        next_tokens: int = 0,
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
            arrival_s: When the new request arrives, seconds after the
                snapshot: the replay runs the snapshot's requests on until then
                (it joins the waiting queue before the first batch scheduled at
                or after it), so one prepared snapshot answers for later
                arrivals exactly; ``ttft_s`` counts from the arrival, batch
                indices and records from the snapshot. Within the batch in
                flight this is that batch's remaining time less the arrival.
            next_tokens: Replay on past the first token until this many more
                are sampled (or its output ends), for ``tpot_s`` and
                ``gap_p90_s``: the residents' finishes, admissions and a
                preemption of this request all shape its token times.

        Returns:
            The estimate.
        """
        prep = snapshot if isinstance(snapshot, PreparedSnapshot) else self.prepare(snapshot)
        arrival = _arrival(arrival_s)
        inflight = prep.snapshot.inflight_remaining_s or 0.0
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
            horizon_s=_replay_horizon(horizon_s, prep, arrival),
            arrival_s=max(arrival - inflight, 0.0),
            next_tokens=next_tokens,
        )
        return TTFTEstimate(
            ttft_s=res.ttft_s + inflight - arrival,
            first_token_batch=res.first_token_batch,
            inflight_s=inflight,
            stop_reason=res.stop_reason,
            batches=res.batches,
            token_batches=res.token_batches,
            tpot_s=res.tpot_s,
            gap_p90_s=res.gap_p90_s,
            window_s=res.token_times_s[-1] if res.token_times_s else None,
        )

    def ttft(
        self,
        prepared: PreparedSnapshot,
        prompt_tokens: int,
        output_len: int,
        max_tokens: int | None = None,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = math.inf,
        arrival_s: float = 0.0,
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
            horizon_s: Stop once the TTFT is known to exceed this (see
                :meth:`estimate`); when :meth:`bound` already does, that bound
                is the answer, with nothing replayed.
            arrival_s: When it arrives, seconds after the snapshot (see
                :meth:`estimate`); the answer counts from then.
        """
        return self.ttft_from(
            prepared,
            prompt_tokens,
            output_len,
            max_tokens,
            prefix_keys,
            horizon_s,
            arrival_s,
            True,
        )

    def ttft_from(
        self,
        prepared: PreparedSnapshot,
        prompt_tokens: int,
        output_len: int,
        max_tokens: int | None,
        prefix_keys: Sequence[int] | None,
        horizon_s: float,
        arrival_s: float,
        check_bound: bool,
    ) -> float:
        """:meth:`ttft`, positional, for a caller that may have found
        :meth:`bound` within ``horizon_s + arrival_s`` already (``check_bound``
        false: it is not computed again)."""
        if max_tokens is not None:
            output_len = min(output_len, max_tokens)
        arrival = _arrival(arrival_s)
        h = _replay_horizon(horizon_s, prepared, arrival)
        inflight = prepared.snapshot.inflight_remaining_s or 0.0
        start = max(arrival - inflight, 0.0)  # its arrival in the replay's time
        coeffs = self._coeffs
        if horizon_s != math.inf:
            if check_bound and prefix_keys is None and prepared.ahead[0] > 0.0:
                # Known late from the queue ahead alone: no replay at all. (With
                # nothing queued ahead, a replay meets the horizon about as soon.)
                lb = self.bound(prepared, prompt_tokens)
                if lb > horizon_s + arrival:
                    return lb - arrival
            for lo, reached, co, came in prepared.horizon_stops:
                # The batches up to the stop did not depend on the new request,
                # and the first batch ending past ``h`` is the one that ended
                # past ``lo`` for every ``h`` in [lo, reached): the same answer.
                # A later arrival is reached later still (it joins behind
                # whatever waited), never an earlier one.
                if lo <= h < reached and co is coeffs and start >= came:
                    return reached + inflight - arrival
        rep = prepared.replayer
        t = rep.ttft(
            prepared.state,
            prompt_tokens,
            max(1, output_len),
            coeffs,
            -1 if max_tokens is None else max_tokens,
            prefix_keys,
            h,
            start,
        )
        if h < t < math.inf and not rep.last_new_examined:
            stops = prepared.horizon_stops
            if len(stops) >= _HORIZON_STOPS:
                del stops[0]
            stops.append((h, t, coeffs, start))
        return t + inflight - arrival
