"""Fast-forward: advance a stale snapshot to "now" by replaying the elapsed time.

An old snapshot shows requests that have since made progress, finished, or been
joined by new arrivals. :class:`FastForward` rebuilds the instance's scheduler
(:class:`~bearsdk.replay.SchedulerCore`, the live scheduler the replay runs)
from the snapshot, with output lengths predicted where unknown, and runs it in
virtual time with the instance's eq. 12 batch-time model, adding this router's
own dispatches as arrivals at their dispatch times. :meth:`FastForward.at`
returns the state at a given time as a snapshot that BEA replays as usual.

It is incremental: each call only simulates the time since the previous one, so
many estimates between two snapshots cost about what the engine itself ran.

The router knows more than the snapshot about its own requests: one it has not
seen complete is still running. Those (the ones its length predictor remembers,
:class:`~bearsdk.estimators.KnownLengths`) are *pinned*: they do not finish in
the virtual engine when they reach their predicted length, only when
:meth:`FastForward.complete` says so; one that outran its prediction is handed
back to the length predictor, conditioned on what it has produced by now.

Timing follows the replay's own convention (``BEAEstimator``: a snapshot's
TTFT is the remaining time of the batch in flight plus the replayed batches):
the batch executing at time ``t`` is scheduled, and the snapshot at ``t`` reports
its remaining time as ``inflight.remaining_s``.

The router also sees when its requests' first tokens come, and each one marks
the end of an engine batch: :meth:`FastForward.first_token` anchors the virtual
clock there. The virtual engine then runs ``lag`` seconds behind (or ahead of)
the caller's clock, so that an error of the batch-time model does not pile up
over the whole age of the snapshot, only since the last first token
(``docs/snapshots.md``, "Fast-forward"). Every later token the router streams
marks the end of an engine step too, without saying which:
:meth:`FastForward.step_end` moves the clock so that the nearest step end of
the virtual engine falls there (the phase of the batch in flight, which a new
request waits out first).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.estimators.bea import BEAEstimator
from bearsdk.estimators.length import resolve_output_lengths
from bearsdk.replay import SchedulerCore
from bearsdk.replay.requests import RUNNING, PolicyGeometry, Req
from bearsdk.snapshot import (
    COL_OUTPUT,
    COL_OUTPUT_LEN,
    COL_PLACEHOLDERS,
    NCOLS,
    STATE_RUNNING,
    STATE_WAITING,
    KVState,
    Snapshot,
    snapshot_from_dict,
)
from bearsdk.state.overlay import Dispatch

__all__ = ["MAX_ANCHOR_BATCHES", "STEP_ENDS_KEPT", "STEP_TOLERANCE_S", "FastForward"]

MAX_ANCHOR_BATCHES = 1024
"""The most batches :meth:`FastForward.first_token` runs on to meet a first
token the virtual engine has not produced yet (tens of milliseconds of Python
at most: an anchor the view cannot reach is not worth a stall)."""

STEP_ENDS_KEPT = 64
"""The virtual engine's latest step ends kept for :meth:`FastForward.step_end`
(seconds of steps at least: an engine step is a millisecond or more)."""

STEP_TOLERANCE_S = 5e-4
"""A kept view whose nearest step end is this close to the engine's latest is
kept (a token's network jitter is smaller; a view rebuilt costs a prepare)."""


def _to_go(r: Req) -> int:
    """Tokens ``r`` has left to its length, as a view's row counts them."""
    return r.target - r.outputs - (r.ph if r.status == RUNNING else 0)


def _position(ids: tuple[str, ...], rid: str) -> int:
    try:
        return ids.index(rid)
    except ValueError:
        return -1


def _table(doc: dict[str, Any]) -> tuple[tuple[str, ...], npt.NDArray[np.int64]]:
    ids = []
    rows = []
    for r in doc["requests"]:
        ids.append(r["id"])
        rows.append(
            [
                STATE_RUNNING if r["state"] == "running" else STATE_WAITING,
                r["prompt_tokens"],
                r["computed_tokens"],
                r["output_tokens"],
                r.get("max_tokens", -1),
                r.get("output_len", -1),
                r.get("placeholders", 0),
            ]
        )
    return tuple(ids), np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)


@attrs.define
class FastForward:
    """A live virtual copy of one instance, started from one snapshot.

    Args:
        snapshot: The starting snapshot.
        estimator: The instance's estimator (policy, batch-time model, length predictor).
        captured: The snapshot's capture time on the caller's clock.
        max_batches: Stop simulating after this many batches in total.
        lag: Seconds the engine is known to run behind the batch-time model
            (:meth:`first_token`; a view rebuilt because it had run too far).

    Raises:
        ValueError: The snapshot cannot be replayed under the estimator's policy.
    """

    snapshot: Snapshot
    estimator: BEAEstimator
    captured: float
    max_batches: int = 1_000_000
    lag: float = attrs.field(default=0.0, kw_only=True)
    _core: SchedulerCore = attrs.field(init=False)
    _depth: int = attrs.field(init=False)
    _t: float = attrs.field(init=False)  # end of the last scheduled batch (offset from capture)
    _idle: bool = attrs.field(init=False, default=False)
    _added: set[str] = attrs.field(init=False, factory=set)
    _batches: int = attrs.field(init=False, default=0)
    _queue: list[Dispatch] = attrs.field(init=False, factory=list)
    # Requests the router has not seen complete, so still running, and those of
    # them kept past their predicted length.
    _pinned: set[str] = attrs.field(init=False, factory=set)
    _extended: set[str] = attrs.field(init=False, factory=set)
    _known: Any = attrs.field(init=False, default=None)  # the predictor's known_lengths
    # The router's requests whose first token the virtual engine has not produced
    # yet, and when it produced the others (offsets from capture): anchors.
    _watch: set[str] = attrs.field(init=False, factory=set)
    _firsts: dict[str, float] = attrs.field(init=False, factory=dict)
    _last_start: float = attrs.field(init=False, default=-math.inf)
    # Its latest step ends (offsets from capture, ascending): where a step end
    # the router saw is placed (step_end).
    _ends: deque[float] = attrs.field(init=False, factory=lambda: deque(maxlen=STEP_ENDS_KEPT))
    _kv: KVState | None = attrs.field(init=False, default=None)  # the views' kv (_kv_at)
    # The rows of the last view exported (without a block pool), and what changed
    # since: while no batch ran (not _dirty), only requests that arrived at the
    # end of the waiting queue or were removed, so the next view is that one
    # patched, and a dispatch or a completion costs O(changes), not O(requests).
    _export: tuple[tuple[str, ...], npt.NDArray[np.int64]] | None = attrs.field(
        init=False, default=None
    )
    _dirty: bool = attrs.field(init=False, default=True)
    _arrived: list[Req] = attrs.field(init=False, factory=list)
    _removed: list[str] = attrs.field(init=False, factory=list)
    patch_views: bool = attrs.field(default=True, kw_only=True)
    """Patch views between batches (:meth:`at`); off, every view is rebuilt
    whole (the reference the patched ones are tested against)."""
    # exact_for of the last view at() returned: (that view, its least tokens to go).
    _least: tuple[Snapshot, float] | None = attrs.field(init=False, default=None)
    # The fewest tokens to go of the router's requests in the engine (kept on
    # past their prediction aside), kept up to date between batches (None:
    # count them again).
    _held_least: float | None = attrs.field(init=False, default=None)
    overran: bool = attrs.field(init=False, default=False)
    """Whether the last anchor found the view further on than the engine."""

    def __attrs_post_init__(self) -> None:
        snap = self.snapshot
        est = self.estimator
        pol = est.policy
        free = -1
        if snap.kv is not None:
            pol = pol.with_kv(snap.kv.block_size, snap.kv.num_blocks)
            free = snap.kv.free_blocks
        geo = PolicyGeometry(pol)
        lengths = est.length_predictor
        table = resolve_output_lengths(snap.table, lengths, snap.ids)
        # Duck-typed (KnownLengths): a protocol isinstance check costs microseconds.
        self._known = getattr(lengths, "known_lengths", None)
        if self._known is not None and len(snap.ids):
            known = self._known(snap.ids, snap.table[:, COL_OUTPUT])
            self._pinned = {rid for rid, k in zip(snap.ids, known.tolist(), strict=True) if k > 0}
        # With the snapshot's block pool the virtual engine caches and evicts as
        # the engine does, and the views it exports keep the pool (a request's
        # cached prefix is priced on a fast-forwarded view too).
        prepared = geo.prepare(table, free, snap.ids, snap.prefix_cache)
        core = SchedulerCore.from_prepared(geo, prepared, False, est.replay_coeffs)
        core.requests = {r.rid: r for r in (*core.running, *core.waiting)}
        self._core = core
        self._depth = 2 if pol.async_scheduling else 1
        self._t = snap.inflight_remaining_s or 0.0
        if self._t > 0.0:
            self._ends.append(self._t)  # the batch in flight at capture ends then
        self._added = set(snap.ids)
        first_to_come = snap.table[:, COL_OUTPUT] == 0
        self._watch = {rid for rid, w in zip(snap.ids, first_to_come.tolist(), strict=True) if w}

    @property
    def simulated_batches(self) -> int:
        """Batches simulated so far (the cost of fast-forwarding)."""
        return self._batches

    def complete(self, rid: str) -> None:
        """The router saw ``rid`` finish: remove it from the virtual engine if resident."""
        self._added.add(rid)
        self._queue = [d for d in self._queue if d.rid != rid]
        core = self._core
        sid = self._sid(rid)
        self._watch.discard(sid)
        self._pinned.discard(sid)
        self._extended.discard(sid)
        r = core.requests.get(sid)
        if r is not None and self._held_least is not None and _to_go(r) <= self._held_least:
            self._held_least = None  # (it may have been the fewest)
        if core.abort_request(sid):
            if r is not None and r in self._arrived:
                self._arrived.remove(r)
            else:
                self._removed.append(sid)

    def _arrive(self, upto: float) -> None:
        while self._queue and self._queue[0].time - self.captured - self.lag <= upto:
            d = self._queue.pop(0)
            out = d.output_len
            if out is None:
                pred = self.estimator.length_predictor.predict_lengths(
                    np.array([d.prompt_tokens], dtype=np.int64), np.zeros(1, dtype=np.int64)
                )
                out = max(1, int(pred[0]))
            if d.max_tokens is not None:
                out = min(out, d.max_tokens)
            self._core.add_request(d.rid, d.prompt_tokens, max(1, out), d.max_tokens)
            # An idle engine serves it from its next step on: added here after
            # the clock moved back (a later lag), it would wait for an arrival
            # that has already come, forever.
            self._idle = False
            self._arrived.append(self._core.requests[d.rid])
            self._watch.add(d.rid)
            if self._known is not None and self._known([d.rid], np.zeros(1, np.int64))[0] > 0:
                self._pinned.add(d.rid)
                if self._held_least is not None:
                    self._held_least = min(self._held_least, _to_go(self._arrived[-1]))

    def advance(self, now: float, arrivals: list[Dispatch]) -> None:
        """Simulate up to ``now``, adding ``arrivals`` (in dispatch order) as they come.

        Args:
            now: The caller's clock.
            arrivals: Dispatches the snapshot does not show; ones already added
                are skipped, so the full list can be passed on every call.
        """
        for d in arrivals:
            if d.rid not in self._added:
                self._added.add(d.rid)
                self._queue.append(d)
        to = now - self.captured - self.lag
        self._run(to)
        self._arrive(to)

    def _run(self, to: float, until_first: str | None = None) -> None:
        """Simulate batches while they start at or before ``to`` (or, with
        ``until_first``, until that request's first token, whenever it comes)."""
        core = self._core
        while (self._t <= to) if until_first is None else (until_first not in self._firsts):
            if self._idle:
                # An idle engine wakes up at the next arrival; with none to come
                # it stays idle, whatever it was asked to run on to.
                nxt = self._queue[0].time - self.captured - self.lag if self._queue else math.inf
                if nxt > to or nxt == math.inf:
                    if until_first is None and to != math.inf:
                        self._t = to
                    break
                self._t = max(self._t, nxt)
                self._idle = False
            self._dirty = True  # (the view is exported whole next)
            self._held_least = None
            self._arrive(self._t)
            if self._pinned:
                self._hold_pinned()
            batch = core.schedule()
            dt = 0.0
            if batch:
                dt = core.account(batch)
                self._batches += 1
            elif all(q.inert() for q in core.queue):
                self._idle = True
                continue
            if batch:
                self._last_start = self._t
            core.queue.append(batch)
            if len(core.queue) >= self._depth:
                out = core.process(core.queue.popleft())
                if self._watch and out.tokens:
                    # The processed batch ends now (synchronous) or ended with
                    # the previous one (asynchronous: it was scheduled before).
                    end = self._t + dt if self._depth == 1 else self._t
                    for rid in out.tokens:
                        if rid in self._watch:
                            self._watch.discard(rid)
                            self._firsts[rid] = end
            self._t += dt
            if dt > 0.0:
                self._ends.append(self._t)
            if self._batches >= self.max_batches:
                break  # guards a zero-cost batch model; the snapshot is then approximate

    def first_token(self, rid: str, at: float, now: float | None = None) -> bool:
        """The router saw ``rid``'s first token ``at`` seconds after capture (its
        network and HTTP time taken off): anchor the virtual clock there
        (:attr:`lag` becomes ``at`` less the virtual engine's time of it).

        Where the virtual engine has not produced that token yet, the engine is
        ahead, and the virtual one runs on to it first. Where it has, and the
        engine turns out further behind than the view assumed, the batches
        simulated since are more than the engine ran: :attr:`overran` says so
        (the view is then rebuilt from the snapshot with the new lag, batches
        cannot be taken back). A request the view does not hold, or one it
        cannot bring to a first token within :data:`MAX_ANCHOR_BATCHES`,
        anchors nothing (and in the second case leaves the view :attr:`overran`).

        Args:
            rid: The request (the router's id).
            at: When its first token was produced, seconds after capture.
            now: The caller's clock, if it is further on (the view is to be
                advanced there next).

        Returns:
            Whether the clock was anchored.
        """
        sid = self._sid(rid)
        t = self._firsts.get(sid)
        if t is None:
            if sid not in self._watch:
                return False
            before = self._batches
            limit, self.max_batches = self.max_batches, before + MAX_ANCHOR_BATCHES
            try:
                self._run(math.inf, until_first=sid)
            finally:
                self.max_batches = limit
            t = self._firsts.get(sid)
            if t is None:
                # Run on for nothing: the view is now further on than anything
                # the engine confirmed.
                self.overran = self._batches > before
                return False
        was, self.lag = self.lag, at - t
        # A batch the view started later than the engine, on the new clock, can
        # have started by now: one batch too many.
        upto = (at if now is None else max(at, now - self.captured)) - self.lag
        self.overran = self.lag > was and self._last_start > upto
        return True

    def step_end(self, at: float, now: float | None = None) -> bool:
        """The engine ended a step ``at`` seconds after capture (a token the router
        received, its network and HTTP time taken off): move the virtual clock so
        that the nearest step end of the virtual engine falls there.

        A streamed token says when a step ended, not which one: where the
        batch-time model has drifted less than half a step since the snapshot
        (or the last anchor), the nearest is that step, and the view is where
        the engine is; where it drifted more, the view's steps are one or more
        off, but the batch in flight at the decision ends when the engine's
        does (what a new request waits out first). Like :meth:`first_token`,
        a clock moved back leaves the view :attr:`overran` when it had already
        simulated past the new clock.

        Args:
            at: When the step ended, seconds after capture.
            now: The caller's clock, if it is further on (the view is to be
                advanced there next).

        Returns:
            Whether the clock moved.
        """
        if not 0.0 <= at < math.inf:
            return False
        if not self._idle and self._t <= at - self.lag:
            self._run(at - self.lag)  # the engine is further on: the virtual one catches up
        off = self.step_offset(at)
        if off == 0.0 or not math.isfinite(off):
            return False
        was, self.lag = self.lag, self.lag + off
        upto = (at if now is None else max(at, now - self.captured)) - self.lag
        self.overran = self.lag > was and self._last_start > upto
        return True

    def step_offset(self, at: float) -> float:
        """How much later the engine's step ended at ``at`` (seconds after capture)
        than the nearest step end the virtual engine has reached (``nan``: not
        a time after capture, or no virtual step to compare with). Changes
        nothing: an engine further on than the view gives how far it is past
        the view's batch in flight."""
        if not 0.0 <= at < math.inf:
            return math.nan
        v = at - self.lag
        best = math.inf
        for e in reversed(self._ends):
            if abs(e - v) < abs(best - v):
                best = e
            if e < v:  # (ascending: the earlier ones are further still)
                break
        return v - best if best != math.inf else math.nan

    def _sid(self, rid: str) -> str:
        """``rid`` as the virtual engine names it (a snapshot's id may embed it)."""
        core = self._core
        if rid in core.requests or rid in self._firsts:
            return rid
        # The snapshot names it as the engine does (vLLM: ``chatcmpl-<id>``).
        return next((s for s in core.requests if rid in s), rid)

    def _hold_pinned(self) -> None:
        # A pinned request about to reach its predicted length gets one more
        # token to go, for as long as the router has not seen it finish (its
        # cap still ends it: the engine stops there too).
        pinned = self._pinned
        for r in self._core.running:
            if r.rid in pinned and r.target <= r.outputs + r.ph + 1 and r.target < r.limit:
                r.target = min(r.outputs + r.ph + 2, r.limit)
                self._extended.add(r.rid)

    def at(self, now: float) -> Snapshot:
        """The instance's state at ``now`` (call :meth:`advance` first) as a snapshot."""
        to = now - self.captured - self.lag
        remaining = self._t - to if (not self._idle and self._t > to) else 0.0
        snap = self.snapshot
        core = self._core
        cache = None
        if core.pool is None:
            ids, table = self._rows()
        else:
            self._arrived.clear()  # (views with blocks are exported whole)
            self._removed.clear()
            doc = core.snapshot(
                instance=snap.instance, seq=snap.seq, time=snap.time + to, output_len=True
            )
            ids, table = _table(doc)
            # The block pool advanced too: a replay of this view still hits the
            # prefixes cached by now (and the new request's keys find them).
            cache = snapshot_from_dict(doc).prefix_cache
        extended: list[int] = []
        if self._extended:
            # Kept running past its prediction: how much more is the predictor's
            # call again, given what it has produced by now.
            # (A scan in C per request kept on: a few, where a loop over the
            # view's rows would cost O(requests) per view.)
            extended = sorted(
                i for i in map(functools.partial(_position, ids), self._extended) if i >= 0
            )
            if extended:
                table = np.array(table)  # (the exported rows stay as they are)
                table[extended, COL_OUTPUT_LEN] = -1
                table = resolve_output_lengths(table, self.estimator.length_predictor)
        view = Snapshot(
            instance=snap.instance,
            seq=snap.seq,
            time=snap.time + max(0.0, to),
            kv=self._kv_at(),
            ids=ids,
            table=table,
            inflight_remaining_s=remaining if remaining > 0 else None,
            epoch=snap.epoch,
            prefix_cache=cache,
        )
        self._least = (view, self._tokens_to_go(view, extended))
        return view

    def _rows(self) -> tuple[tuple[str, ...], npt.NDArray[np.int64]]:
        """The virtual engine's requests as table rows: the last export patched
        with what arrived and left since, while no batch ran; else whole."""
        core = self._core
        last = self._export
        if last is None or self._dirty or not self.patch_views:
            ids, flat = core.rows()
            table = np.array(flat, dtype=np.int64).reshape(len(ids), NCOLS)
        else:
            ids, table = last
            parts = [table]
            if self._removed:
                try:
                    # (A scan in C per request removed: a few per view.)
                    gone = sorted({ids.index(rid) for rid in self._removed})
                except ValueError:  # not in the last view after all: rebuild it
                    self._dirty = True
                    return self._rows()
                parts, at = [], 0
                for i in gone:
                    parts.append(table[at:i])
                    at = i + 1
                parts.append(table[at:])
                for i in reversed(gone):
                    ids = ids[:i] + ids[i + 1 :]
            if self._arrived:
                new_ids, flat = core.rows_of(self._arrived)
                ids += new_ids
                parts.append(np.array(flat, dtype=np.int64).reshape(len(new_ids), NCOLS))
            if len(parts) > 1:
                table = np.concatenate(parts)
        self._export = (ids, table)
        self._dirty = False
        self._arrived.clear()
        self._removed.clear()
        return ids, table

    def _tokens_to_go(self, view: Snapshot, extended: list[int]) -> float:
        """The fewest tokens a request the router holds has left in ``view``
        (``inf``: none there): from the engine's requests, and for the ones
        kept past their prediction, from the view's re-predicted lengths."""
        held = self._pinned
        if not held:
            return math.inf
        least = self._held_least
        if least is None:
            reqs = self._core.requests
            least = math.inf
            for rid in held:
                r = reqs.get(rid)
                if r is not None and rid not in self._extended:
                    least = min(least, _to_go(r))
            self._held_least = least
        if extended:
            t = view.table[extended]
            left = t[:, COL_OUTPUT_LEN] - t[:, COL_OUTPUT] - t[:, COL_PLACEHOLDERS]
            least = min(least, int(left.min()))
        return least

    def _kv_at(self) -> KVState | None:
        kv = self.snapshot.kv
        if kv is None:
            return None
        free = self._core.free
        if self._kv is None or self._kv.free_blocks != free:
            # Kept while the free count stands (an evolve costs microseconds).
            self._kv = kv if kv.free_blocks == free else attrs.evolve(kv, free_blocks=free)
        return self._kv

    def exact_for(self, view: Snapshot, b0: float) -> float:
        """How long past ``view``'s batch in flight a replay of it stays what
        fast-forwarding gives: until a request the router holds running could
        reach its predicted length (which the replay would end there).

        Args:
            view: A snapshot :meth:`at` returned.
            b0: The shortest a batch can take (eq. 12's fixed term): a request
                ``n`` tokens short of its length needs ``n`` more batches.
        """
        held = self._pinned
        if not held:
            return math.inf
        kept = self._least
        if kept is not None and kept[0] is view:
            least = kept[1]  # (counted by at(), from the engine's requests)
        else:
            t = view.table
            rows = [i for i, rid in enumerate(view.ids) if rid in held]
            if not rows:
                return math.inf
            left = t[rows, COL_OUTPUT_LEN] - t[rows, COL_OUTPUT] - t[rows, COL_PLACEHOLDERS]
            least = int(left.min())
        return math.inf if least == math.inf else max(int(least) - 1, 0) * b0

    def elapsed(self, now: float) -> float:
        """Seconds of engine time simulated by ``now``."""
        return max(0.0, min(self._t, now - self.captured - self.lag))

    @staticmethod
    def worthwhile(age: float, threshold: float | None) -> bool:
        """Whether a snapshot of ``age`` seconds is old enough to fast-forward."""
        return threshold is not None and math.isfinite(age) and age > threshold
