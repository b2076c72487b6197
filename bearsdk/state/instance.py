"""One instance's TTFT estimator over its snapshot cache, with staleness handled.

:class:`InstanceState` is what a router asks for a TTFT at one instance. It reads
the instance's :class:`~bearsdk.state.cache.SnapshotCache` and, depending on the
snapshot's age (:class:`StalenessRules`):

* **fresh**: BEA replays the cached prepared snapshot (nothing is prepared on
  this path);
* **overlay**: this router's dispatches the snapshot cannot show yet join its
  waiting queue, in order, so back-to-back decisions see each other;
* **fast-forward**: a snapshot older than ``fast_forward_after_s`` is first
  advanced to now (:class:`~bearsdk.state.fastforward.FastForward`), the
  dispatches arriving at their dispatch times;
* **fallback**: with no snapshot, or one older than ``fallback_after_s``, the
  fallback estimator (LPS by default) answers, until fresh snapshots return;
  except for the snapshot of an idle engine with nothing sent since, which
  stays exact (an idle engine publishes nothing).

Derived views (overlay, fast-forward) are prepared once and reused until the
snapshot, the set of pending dispatches, or (fast-forward) the time quantum
``refresh_s`` changes.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot
from bearsdk.estimators.length import RememberedLengths
from bearsdk.snapshot import Snapshot
from bearsdk.state.cache import CachedSnapshot, SnapshotCache
from bearsdk.state.fastforward import STEP_TOLERANCE_S, FastForward
from bearsdk.state.overlay import Dispatch, DispatchOverlay

__all__ = ["Estimate", "InstanceState", "StalenessPolicy", "StalenessRules"]

log = logging.getLogger("bearsdk.state")

MODES: Final = ("bea", "overlay", "fast-forward", "bound", "fallback", "none")


def _optional_age(inst: object, att: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and (math.isnan(value) or value < 0):
        raise ValueError(f"{att.name} must be a number >= 0 or None (got {value!r})")


def _age(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if math.isnan(value) or value < 0:
        raise ValueError(f"{att.name} must be a number >= 0 (inf: never) (got {value!r})")


def _default_fallback() -> LatencyEstimator:
    from bearsdk.estimators.lps import LPSEstimator

    return LPSEstimator()


@attrs.frozen
class StalenessRules:
    """How an instance's estimates handle snapshot age.

    Formerly ``StalenessPolicy``, which stays an alias.

    Attributes:
        overlay: Add this router's not-yet-visible dispatches to the view.
        fast_forward_after_s: Advance snapshots older than this to now, once
            the batch in flight at their capture has completed (``None``: never;
            younger snapshots only have the age deducted from that batch's
            remaining time, which is exact while it runs).
        fallback_after_s: Use the fallback estimator for snapshots older than
            this (``inf``: never).
        refresh_s: A fast-forwarded view is kept for up to this long, and
            always while the batch in flight in it runs: an estimate from it
            replays the view on to the decision (the new request arriving that
            much later), which is exact, and costs more the older the view.
        overlay_grace_s: See :class:`~bearsdk.state.overlay.DispatchOverlay`.
        overlay_expire_s: See :class:`~bearsdk.state.overlay.DispatchOverlay`.
        anchor: Anchor fast-forwarded views on the first tokens the router
            sees (:meth:`InstanceState.on_tokens`): closer estimates, but off by
            default, since an accurate view loses the margin a slow profile
            gave and BEAR has no other yet (``docs/snapshots.md``).
        anchor_steps: Place the batch in flight in fast-forwarded views where
            the engine's is: every token the router receives ends an engine
            step (:meth:`InstanceState.on_step_end`,
            :meth:`~bearsdk.state.fastforward.FastForward.step_end`).
    """

    overlay: bool = True
    fast_forward_after_s: float | None = attrs.field(default=0.01, validator=_optional_age)
    fallback_after_s: float = attrs.field(default=2.0, validator=_age)
    refresh_s: float = attrs.field(default=0.05, validator=_age)
    overlay_grace_s: float = attrs.field(default=0.05, validator=_age)
    overlay_expire_s: float = attrs.field(default=30.0, validator=_age)
    anchor: bool = False
    anchor_steps: bool = True

    @classmethod
    def paper(cls) -> StalenessRules:
        """BEA as the paper runs it: the cached snapshot as it is, whatever its age."""
        return cls(overlay=False, fast_forward_after_s=None, fallback_after_s=math.inf)


StalenessPolicy = StalenessRules
"""The old name of :class:`StalenessRules`, kept as an alias."""


@attrs.frozen
class Estimate:
    """A TTFT estimate and how it was made.

    Attributes:
        ttft_s: Predicted time to first token, seconds.
        mode: ``"bea"``, ``"overlay"``, ``"fast-forward"``, ``"fallback"``, or
            ``"none"`` (no snapshot and no fallback: ``inf``).
        age_s: Age of the snapshot used (``inf`` when none).
        pending: This router's dispatches added to the snapshot's view.
        lower_bound: ``ttft_s`` is past the horizon asked for and only a lower
            bound (mode ``"bound"``: from the prefill queued ahead alone, with
            nothing replayed; see :meth:`InstanceState.ttft`).
        tpot_s: Predicted mean time per output token after the first, over
            the ``next_tokens`` asked for (``nan``: not asked, or not known).
        resident_itl_s: With ``residents``: the mean batch time, which is every
            decoding resident's inter-token time, over the batches up to the
            new request's last followed token, with it admitted here.
        resident_itl_base_s: The same batches without it (``nan``: not asked,
            or no resident there).
    """

    ttft_s: float
    mode: str
    age_s: float
    pending: int = 0
    lower_bound: bool = False
    tpot_s: float = math.nan
    resident_itl_s: float = math.nan
    resident_itl_base_s: float = math.nan


EstimateFields = tuple[float, str, float, int, bool, float, float, float]
"""An :class:`Estimate`'s fields, in order."""
NAN: Final = math.nan


@attrs.define
class InstanceState:
    """TTFT estimates for one instance from its snapshot cache.

    Args:
        cache: The instance's cache (its estimator is set to ``estimator`` if unset).
        estimator: The instance's BEA estimator.
        fallback: Answers without a usable snapshot (default: LPS); ``None``:
            replay even a snapshot past ``fallback_after_s``, ``inf`` without one.
        rules: Staleness handling.
        name: Instance name (default: the cache's).
        policy: The old name of ``rules`` (keyword only), kept for one release;
            it wins when given.
    """

    cache: SnapshotCache
    estimator: BEAEstimator
    fallback: LatencyEstimator | None = attrs.field(factory=_default_fallback)
    rules: StalenessRules = attrs.field(factory=StalenessRules)
    name: str = ""
    policy: StalenessRules | None = attrs.field(default=None, kw_only=True, eq=False, repr=False)
    _overlay: DispatchOverlay = attrs.field(init=False)
    _reconciled: int = attrs.field(init=False, default=-1)
    _completed: deque[tuple[str, float]] = attrs.field(
        init=False, factory=lambda: deque(maxlen=256)
    )
    _ff: FastForward | None = attrs.field(init=False, default=None)
    _ff_version: int = attrs.field(init=False, default=-1)
    # The latest first token the router saw here (request, engine-side time), and
    # whether the fast-forward of the current snapshot has been anchored on it.
    _first: tuple[str, float] | None = attrs.field(init=False, default=None)
    _anchored: tuple[str, float] | None = attrs.field(init=False, default=None)
    # The latest engine step end seen (engine-side time), and the one the
    # fast-forward of the current snapshot was placed on.
    _step_end: float = attrs.field(init=False, default=-math.inf)
    _placed: float = attrs.field(init=False, default=-math.inf)
    _view_key: tuple[int, int, bool] | None = attrs.field(init=False, default=None)
    _view_at: float = attrs.field(init=False, default=-math.inf)
    _view_until: float = attrs.field(init=False, default=0.0)  # reuse it up to this age
    _view: PreparedSnapshot | None = attrs.field(init=False, default=None)
    _view_pending: int = attrs.field(init=False, default=0)
    _mode: str = attrs.field(init=False, default="none")
    _switches: int = attrs.field(init=False, default=0)
    _ff_errors: int = attrs.field(init=False, default=0)
    _overlay_refused: tuple[int, int, bool] | None = attrs.field(init=False, default=None)
    # The kept fast-forwarded view's entry, key and rules, set by _forwarded:
    # while all three hold, estimate_fields finds the view without _prepared.
    _hot: tuple[CachedSnapshot, tuple[int, int, bool], StalenessRules] | None = attrs.field(
        init=False, default=None
    )

    def __attrs_post_init__(self) -> None:
        if self.cache.estimator is None:
            self.cache.estimator = self.estimator
        elif self.cache.estimator is not self.estimator:
            raise ValueError("cache.estimator must be this instance's estimator (or unset)")
        self.name = self.name or self.cache.instance
        if self.policy is not None:
            self.rules = self.policy
        self.policy = self.rules  # readers of the old attribute see the rules in use
        p = self.rules
        self._overlay = DispatchOverlay(grace_s=p.overlay_grace_s, expire_s=p.overlay_expire_s)

    # ------------------------------------------------------------------ events

    @property
    def overlay(self) -> DispatchOverlay:
        """This router's dispatches not yet visible in a snapshot."""
        return self._overlay

    @property
    def mode(self) -> str:
        """The mode of the latest estimate."""
        return self._mode

    @property
    def switches(self) -> int:
        """Switches between replay and fallback so far."""
        return self._switches

    @property
    def fast_forward_errors(self) -> int:
        """Fast-forwards and dispatch overlays that failed (the snapshot was then
        replayed as it is)."""
        return self._ff_errors

    def on_dispatch(
        self,
        rid: str,
        prompt_tokens: int,
        output_len: int | None = None,
        max_tokens: int | None = None,
        *,
        now: float | None = None,
        prefix_keys: Sequence[int] = (),
    ) -> None:
        """The router sent request ``rid`` to this instance.

        Args:
            rid: The router's request id.
            prompt_tokens: Prompt length.
            output_len: Predicted output length (``None``: the estimator predicts).
            max_tokens: The request's output cap.
            now: Dispatch time (default: the cache clock).
            prefix_keys: Its prompt's full-block keys, as the instance's
                snapshots name blocks (a view that adds it lets it hit them).
        """
        t = self.cache.clock() if now is None else now
        lengths = self.estimator.length_predictor
        keys = tuple(prefix_keys)
        if isinstance(lengths, RememberedLengths) and output_len is not None and output_len > 0:
            replayed = lengths.calibrated(output_len)
            self._overlay.add(Dispatch(rid, t, prompt_tokens, replayed, max_tokens, 0, keys))
            # Once a snapshot shows the request, its own prediction still applies.
            lengths.remember(rid, output_len)
        else:
            self._overlay.add(Dispatch(rid, t, prompt_tokens, output_len, max_tokens, 0, keys))

    def on_tokens(self, rid: str, output_tokens: int, *, at: float | None = None) -> None:
        """The router has received ``output_tokens`` tokens of ``rid`` so far (1: first token).

        A dispatch the snapshot cannot show yet then counts as running, with its
        prompt computed, rather than as waiting.

        Args:
            rid: The request.
            output_tokens: Tokens received so far.
            at: With the first token: when the engine produced it, on the cache
                clock (its arrival less the network and HTTP time). With
                :attr:`StalenessRules.anchor`, a fast-forwarded view anchors its
                clock there (:meth:`FastForward.first_token`).
        """
        self._overlay.progress(rid, output_tokens)
        if at is not None:
            self.on_step_end(at)
        if output_tokens == 1 and at is not None and math.isfinite(at) and self.rules.anchor:
            self._first = (rid, at)
            if self._ff is not None and at >= self._ff.captured:
                self._anchor(self._ff, self.cache.clock())

    def on_step_end(self, at: float) -> None:
        """An engine step here ended at ``at`` (cache clock): a token the router
        received, less the network and HTTP time.

        With :attr:`StalenessRules.anchor_steps`, the next fast-forwarded view
        places its batch in flight there (the latest such time counts; one
        that is not a finite time is ignored).
        """
        if self._step_end < at < math.inf:
            self._step_end = at

    def on_complete(
        self, rid: str, *, now: float | None = None, output_tokens: int | None = None
    ) -> None:
        """The router saw ``rid`` finish (or fail): it no longer loads the instance.

        Args:
            rid: The request.
            now: When (default: the cache clock).
            output_tokens: Its true output length, when it finished and it is
                known (teaches :class:`~bearsdk.estimators.RememberedLengths`).
        """
        t = self.cache.clock() if now is None else now
        self._overlay.discard(rid)
        lengths = self.estimator.length_predictor
        if isinstance(lengths, RememberedLengths):
            if output_tokens is not None and output_tokens > 0:
                lengths.observe(rid, output_tokens)
            else:
                lengths.forget(rid)
        self._completed.append((rid, t))
        if self._ff is not None:
            self._ff.complete(rid)
            self._view_key = None

    def tracks(self, rid: str) -> bool:
        """Whether request ``rid`` (a router id) is one this state is following: a
        dispatch no snapshot has shown yet, or one whose length it remembers."""
        if rid in self._overlay:
            return True
        lengths = self.estimator.length_predictor
        return isinstance(lengths, RememberedLengths) and rid in lengths

    # ------------------------------------------------------------------ estimates

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """:class:`~bearsdk.estimators.base.LatencyEstimator`: the TTFT at this instance.

        ``view`` feeds the fallback; the snapshot comes from the cache (its
        clock is used, not ``view.now``).
        """
        return self.ttft(
            request.prompt_tokens, request.output_tokens, request.max_tokens, view=view
        ).ttft_s

    def ttft(
        self,
        prompt_tokens: int,
        output_len: int | None = None,
        max_tokens: int | None = None,
        *,
        now: float | None = None,
        view: InstanceView | None = None,
        horizon_s: float = math.inf,
        next_tokens: int = 0,
        residents: bool = False,
        prefix_keys: Sequence[int] | None = None,
    ) -> Estimate:
        """Predict the TTFT of a new request sent to this instance now.

        Args:
            prompt_tokens: Its prompt length.
            output_len: Its output length if known; else predicted.
            max_tokens: Its output cap.
            now: The time of the decision (default: the cache clock).
            view: What the router knows of the instance, for the fallback.
            horizon_s: The caller only needs to know whether the TTFT exceeds
                this: past it the estimate may be a lower bound
                (:attr:`Estimate.lower_bound`), found from the prefill queued
                ahead before any fast-forward or replay where that suffices
                (:meth:`~bearsdk.estimators.bea.BEAEstimator.bound`), else by a
                replay stopped there. The cost is then bounded by the horizon,
                not by the queue (``docs/decision-cost.md``).
            next_tokens: Also predict its TPOT: the replay goes on past the
                first token until this many more are sampled
                (:attr:`Estimate.tpot_s`). Only a replay knows it: the
                fallback and the bound leave it ``nan``.
            residents: With ``next_tokens``, also the residents' inter-token
                time over the same batches with and without the new request
                (a second replay, of the residents alone:
                :attr:`Estimate.resident_itl_s`, ``docs/tpot.md``).
            prefix_keys: The content keys of its full prompt blocks
                (:func:`~bearsdk.replay.blocks.chain_keys` of its token ids): where
                the snapshot carries the block pool (``kv.prefix_cache``), its
                admission hits what is cached then (``docs/prefix-caching.md``).

        Returns:
            The estimate and how it was made.
        """
        return Estimate(
            *self.estimate_fields(
                prompt_tokens,
                output_len,
                max_tokens,
                now,
                view,
                horizon_s,
                next_tokens,
                residents,
                prefix_keys,
            )
        )

    def estimate_fields(
        self,
        prompt_tokens: int,
        output_len: int | None,
        max_tokens: int | None,
        now: float | None,
        view: InstanceView | Callable[[float], InstanceView] | None,
        horizon_s: float,
        next_tokens: int,
        residents: bool,
        prefix_keys: Sequence[int] | None,
    ) -> EstimateFields:
        """:meth:`ttft`, positional, as :class:`Estimate`'s fields in order: the
        router's hot path, which has no use for the object. ``view`` may be
        a function of ``now`` giving it: it is only asked for when the
        fallback estimates."""
        now = self.cache.clock() if now is None else now
        entry = self.cache.entry
        age = math.inf if entry is None else entry.age(now)
        if entry is None or (
            age > self.rules.fallback_after_s
            and self.fallback is not None
            and not self._idle(entry)
        ):
            if self.fallback is None:
                return self._set((math.inf, "none", age, 0, False, NAN, NAN, NAN), now)
            if view is None:
                v = InstanceView(name=self.name, now=now)
            else:
                v = view if isinstance(view, InstanceView) else view(now)
            req = RequestInfo(prompt_tokens, output_len, max_tokens)
            t = self.fallback.estimate_ttft(req, v)
            return self._set((t, "fallback", age, 0, False, NAN, NAN, NAN), now)
        est = self.estimator
        checked = None
        if horizon_s != math.inf:
            base = entry.prepared
            if base is not None and base.ahead[0] > 0.0 and base.snapshot.prefix_cache is None:
                # The engine got through at most ``age`` seconds of that work since.
                lb = est.bound(base, prompt_tokens) - min(age, 1e9)
                if lb > horizon_s:
                    got: EstimateFields = (lb, "bound", age, 0, True, NAN, NAN, NAN)
                    # (Most estimates keep their mode: no call to log a switch.)
                    return got if self._mode == "bound" else self._set(got, now)
                checked = base
        hot, kept = self._hot, self._view
        dt = now - self._view_at
        if (
            hot is not None
            and kept is not None
            and hot[0] is entry
            and self._view_key is hot[1]
            and hot[1][1] == self._overlay.version
            and self._step_end == self._placed
            and hot[2] is self.rules
            and 0.0 <= dt <= self._view_until
        ):
            # The kept fast-forwarded view, as _prepared would find it.
            prep, mode, pending, elapsed = kept, "fast-forward", self._view_pending, dt
        else:
            prep, mode, pending, elapsed = self._prepared(entry, now, age)
        if checked is not None and next_tokens == 0 and prefix_keys is None and prep.in_order:
            # Later than the horizon whatever the request: a one-token request's
            # first token from the same state says so (a replay kept per state;
            # read here where it is kept exact, the hot path's case).
            a = prep.admission
            if a and a[3] and a[0] is est.replay_coeffs and elapsed >= a[1]:
                lb = a[2] - elapsed
            else:
                lb = est.admission_bound(prep, elapsed, horizon_s)
            if lb > horizon_s:
                got = (lb, "bound", age, pending, True, NAN, NAN, NAN)
                return got if self._mode == "bound" else self._set(got, now)
        if next_tokens > 0:
            e = est.estimate(
                prep,
                prompt_tokens,
                output_len,
                max_tokens=max_tokens,
                horizon_s=horizon_s,
                arrival_s=elapsed,
                next_tokens=next_tokens,
                prefix_keys=prefix_keys,
            )
            t = e.ttft_s
            tpot = math.nan if e.tpot_s is None else e.tpot_s
            itl_with, itl_base = math.nan, math.nan
            if residents and e.window_s is not None and e.token_batches:
                last = e.token_batches[-1]
                ran, t_ran = est.residents(prep, last)
                if ran > 0:
                    # Every decoding resident gets one token per batch: its
                    # inter-token time is the mean batch time. (Residents that
                    # finish inside the window are compared over the batches they
                    # saw against the whole window's mean with the new request: a
                    # small underestimate of a small harm.)
                    itl_with, itl_base = e.window_s / last, t_ran / ran
            return self._set((t, mode, age, pending, t > horizon_s, tpot, itl_with, itl_base), now)
        if output_len is None:
            t = est.estimate(
                prep,
                prompt_tokens,
                None,
                max_tokens=max_tokens,
                horizon_s=horizon_s,
                arrival_s=elapsed,
                prefix_keys=prefix_keys,
            ).ttft_s
        else:
            # The same view, arriving as old as the bound above assumed: the
            # replay's own check of that bound would fail again.
            t = est.ttft_from(
                prep,
                prompt_tokens,
                output_len,
                max_tokens,
                prefix_keys,
                horizon_s,
                elapsed,
                prep is not checked or elapsed != age,
            )
        got = (t, mode, age, pending, t > horizon_s, NAN, NAN, NAN)
        return got if self._mode == mode else self._set(got, now)

    def _anchor(self, ff: FastForward, now: float) -> bool:
        """Anchor ``ff``'s clock on the latest first token (once per view).

        A view that had run further than the engine is dropped: the next
        estimate rebuilds it from the snapshot on the anchored clock.
        """
        assert self._first is not None
        rid, at = self._first
        self._anchored = self._first
        ok = ff.first_token(rid, at - ff.captured, now)
        if ff.overran:
            self._ff = self._fast_forward(ff.snapshot, ff.captured, ff.lag)
        if ok or ff.overran:
            self._view_key = None  # the kept view ran on another clock
        return ok

    def _in_step(self, now: float) -> bool:
        """Whether the kept view agrees with the latest step end seen (to within
        :data:`~bearsdk.state.fastforward.STEP_TOLERANCE_S`): else it is rebuilt
        and placed there."""
        end, ff = self._step_end, self._ff
        if end == self._placed:
            return True
        if (
            ff is not None
            and self.rules.anchor_steps
            and ff.captured <= end <= now
            and abs(ff.step_offset(end - ff.captured)) > STEP_TOLERANCE_S
        ):
            return False
        self._placed = end  # (nothing to place it by counts as agreeing: nan)
        return True

    def _place(self, ff: FastForward, now: float) -> bool:
        """Place ``ff``'s batch in flight at the latest step end seen (once per
        step end): as :meth:`_anchor`, a view that had run too far is rebuilt."""
        self._placed = end = self._step_end
        moved = ff.step_end(end - ff.captured, now)
        if ff.overran:
            self._ff = self._fast_forward(ff.snapshot, ff.captured, ff.lag)
        return moved

    def _fast_forward(self, snap: Snapshot, captured: float, lag: float = 0.0) -> FastForward:
        """A view of ``snap`` (on a clock ``lag`` behind), without the requests
        the router has seen complete since its capture."""
        ff = FastForward(snap, self.estimator, captured, lag=lag)
        for rid, t in self._completed:
            if t >= captured:
                ff.complete(rid)
        return ff

    def _idle(self, entry: CachedSnapshot) -> bool:
        """The snapshot shows an idle engine and nothing was sent since: an idle
        engine publishes nothing, so its last snapshot stays exact however old."""
        snap = entry.snapshot
        return (
            len(snap) == 0
            and not snap.inflight_remaining_s
            and not self._overlay.unseen(entry.captured)
        )

    def _set(self, e: EstimateFields, now: float) -> EstimateFields:
        mode, age = e[1], e[2]
        if mode == self._mode:  # (no switch to log: every estimate but a few)
            return e
        was_fallback = self._mode in ("fallback", "none")
        is_fallback = mode in ("fallback", "none")
        if was_fallback != is_fallback and self._mode != "none":
            self._switches += 1
            log.info(
                "%s: %s (snapshot age %.3f s)",
                self.name,
                "snapshots stale or missing: using the fallback estimator"
                if is_fallback
                else "fresh snapshots again: replaying them",
                age,
            )
        elif self._mode == "none" and is_fallback and mode == "fallback":
            log.info("%s: no snapshot yet: using the fallback estimator", self.name)
        self._mode = mode
        return e

    def _prepared(
        self, entry: CachedSnapshot, now: float, age: float
    ) -> tuple[PreparedSnapshot, str, int, float]:
        """The view to replay, its mode, the dispatches added, and the time to deduct."""
        ov = self._overlay
        if entry.version != self._reconciled:
            self._reconciled = entry.version
            ov.reconcile(entry.snapshot, entry.captured)
        base = entry.prepared
        if base is None:  # the cache had no estimator when it accepted this one
            base = self.estimator.prepare(entry.snapshot)
        pending = ov.unseen(entry.captured) if self.rules.overlay else []
        threshold = self.rules.fast_forward_after_s
        elapsed = 0.0
        # An idle instance (nothing resident, nothing sent since) stays as it was:
        # fast-forwarding its snapshot would only cost time.
        if threshold is not None and (len(entry.snapshot) or pending):
            inflight = entry.snapshot.inflight_remaining_s or 0.0
            if age >= inflight and FastForward.worthwhile(age, threshold):
                got = self._forwarded(entry, now, pending)
                if got is not None:
                    return got[0], "fast-forward", self._view_pending, got[1]
            # While the batch in flight at capture runs, the replay's batches are
            # unchanged and start that much sooner: deduct the age, exactly.
            elapsed = min(age, inflight)
        if not pending:
            return base, "bea", 0, elapsed
        key = (entry.version, ov.version, False)
        if key == self._overlay_refused:
            return base, "bea", 0, elapsed
        if self._view_key != key or self._view is None:
            snap = DispatchOverlay.apply(
                entry.snapshot, pending, max_running=self.estimator.policy.max_seqs
            )
            try:
                self._view = self.estimator.prepare(snap)
            except (ValueError, RecursionError) as exc:
                # A view the replay refuses: the snapshot as it is, until either
                # changes (a decision is never lost to the overlay).
                self._overlay_refused = key
                self._ff_errors += 1
                log.warning("%s: dispatch overlay refused (%s); using the snapshot", self.name, exc)
                return base, "bea", 0, elapsed
            self._view_key = key
            self._view_pending = len(pending)
        return self._view, "overlay", self._view_pending, elapsed

    def _forwarded(
        self, entry: CachedSnapshot, now: float, pending: list[Dispatch]
    ) -> tuple[PreparedSnapshot, float] | None:
        """The view advanced to about ``now``, and the time to deduct from its estimates."""
        key = (entry.version, self._overlay.version, True)
        view = self._view
        if view is not None and self._view_key == key:
            dt = now - self._view_at
            # The estimates replay the view on to the decision (the new request
            # arrives dt after it): exact for as long as fast-forwarding would
            # have done the same (see _forwarded's end).
            if 0.0 <= dt <= self._view_until and self._in_step(now):
                self._hot = (entry, self._view_key, self.rules)
                return view, dt
        try:
            if self._ff is None or self._ff_version != entry.version:
                self._ff = self._fast_forward(entry.snapshot, entry.captured)
                self._ff_version = entry.version
                self._anchored = None
                self._placed = -math.inf
            self._ff.advance(now, pending)
            first = self._first
            if (
                first is not None
                and first != self._anchored
                and first[1] >= self._ff.captured
                and self._anchor(self._ff, now)
            ):
                self._ff.advance(now, pending)
            end = self._step_end
            if end != self._placed:
                if self.rules.anchor_steps and self._ff.captured <= end <= now:
                    if self._place(self._ff, now):
                        self._ff.advance(now, pending)
                else:
                    self._placed = end  # (from before the snapshot: nothing to place)
            ff = self._ff
            snap = ff.at(now)
            self._view = self.estimator.prepare(snap, lengths_known=True)
        except (ValueError, RecursionError) as exc:
            # A state the scheduler twin rejects: estimate from the snapshot as it is.
            self._ff_errors += 1
            log.warning("%s: fast-forward failed (%s); using the snapshot as it is", self.name, exc)
            self._ff = None
            return None
        self._view_key = key
        self._view_at = now
        self._view_pending = len(pending)
        # Kept while its batch in flight runs (the engine is then only further
        # into it), and beyond for up to refresh_s while no request the router
        # holds running could reach its predicted length: fast-forward would
        # keep it running, a replay of the view would end it.
        inflight = snap.inflight_remaining_s or 0.0
        b0 = self.estimator.replay_coeffs[0]
        self._view_until = max(
            inflight, min(self.rules.refresh_s, inflight + self._ff.exact_for(snap, b0))
        )
        self._hot = (entry, key, self.rules)
        return self._view, 0.0
