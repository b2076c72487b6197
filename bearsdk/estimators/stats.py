"""Online statistics of one instance, from what a router observes (feeds :class:`InstanceView`).

The router reports each request's dispatch, first token, progress and completion
(and, when the engine exposes them, its running/waiting counts and executed
batches); :meth:`InstanceStats.view` turns the rolling window into the
:class:`~bearsdk.estimators.base.InstanceView` every estimator reads.

Rates cover the last ``window_s`` seconds (or the time since the first event,
when shorter); recent TTFTs are the last ``max_samples`` observed, as the vLLM
Semantic Router keeps them. Times are the router's clock in seconds (any
monotonic origin); an event that arrives slightly out of order is accepted.
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from bearsdk.estimators.base import InstanceView
from bearsdk.snapshot import Snapshot

__all__ = ["InstanceStats"]


def _check_time(name: str, now: float) -> float:
    if not math.isfinite(now):
        raise ValueError(f"{name} must be a finite time in seconds (got {now!r})")
    return float(now)


@attrs.define
class _Req:
    t_dispatch: float
    prompt: int
    predicted: int | None
    produced: int = 0
    t_first: float | None = None
    unqueued: bool = False


@attrs.define
class _Window:
    """Samples ``(t, a, b)`` of the last ``window`` seconds (at most ``cap``), with running sums."""

    cap: int
    _t: deque[float] = attrs.field(factory=deque)
    _a: deque[float] = attrs.field(factory=deque)
    _b: deque[float] = attrs.field(factory=deque)
    sa: float = 0.0
    saa: float = 0.0
    sb: float = 0.0

    def push(self, t: float, a: float, b: float = 0.0) -> None:
        self._t.append(t)
        self._a.append(a)
        self._b.append(b)
        self.sa += a
        self.saa += a * a
        self.sb += b
        if len(self._t) > self.cap:
            self._pop()

    def _pop(self) -> None:
        self._t.popleft()
        a = self._a.popleft()
        self.sb -= self._b.popleft()
        self.sa -= a
        self.saa -= a * a
        if not self._t:  # re-zero: no drift accumulates across idle periods
            self.sa = self.saa = self.sb = 0.0

    def prune(self, start: float) -> None:
        while self._t and self._t[0] < start:
            self._pop()

    @property
    def n(self) -> int:
        return len(self._t)

    @property
    def first_t(self) -> float:
        return self._t[0]

    def mean(self) -> float | None:
        return self.sa / len(self._t) if self._t else None

    def scv(self) -> float | None:
        n = len(self._t)
        if n < 3 or self.sa <= 0:
            return None
        m = self.sa / n
        var = max(0.0, (self.saa - n * m * m) / (n - 1))
        return var / (m * m)


@attrs.define
class _TimeAverage:
    """Exponentially weighted time average of ``running`` over the time a queue existed."""

    horizon: float
    num: float = 0.0
    den: float = 0.0
    last: float | None = None
    running: int = 0
    waiting: int = 0

    def advance(self, now: float) -> None:
        if self.last is not None and now > self.last:
            decay = math.exp(-(now - self.last) / self.horizon)
            mass = self.horizon * (1.0 - decay)
            saturated = self.waiting > 0 and self.running > 0
            self.num = self.num * decay + (self.running * mass if saturated else 0.0)
            self.den = self.den * decay + (mass if saturated else 0.0)
        if self.last is None or now > self.last:
            self.last = now

    def set(self, now: float, running: int, waiting: int) -> None:
        self.advance(now)
        self.running, self.waiting = running, waiting

    def value(self, now: float) -> float | None:
        self.advance(now)
        # Below ~1% of a horizon of saturation the average is noise.
        return self.num / self.den if self.den > 0.01 * self.horizon else None


@attrs.define
class InstanceStats:
    """Accumulates per-instance observations for the latency estimators.

    Every event and :meth:`view` cost O(1) amortised (running sums over the
    window), except summing pending work over the requests in flight.

    Args:
        window_s: Length of the rolling window for rates and averages, seconds
            (also the time constant of the saturated-concurrency average).
        max_samples: Recent observed TTFTs kept (and cap on every window's samples).
        ttft_alpha: Weight of a new TTFT in :attr:`InstanceView.ttft_ewma_s`.
        default_output_tokens: Output length assumed for a dispatched request
            whose prediction is unknown, when summing pending decode tokens.
    """

    window_s: float = 60.0
    max_samples: int = 1000
    ttft_alpha: float = 0.3
    default_output_tokens: int = 256
    _reqs: dict[str, _Req] = attrs.field(init=False, factory=dict)
    _gaps: _Window = attrs.field(init=False)
    _completions: _Window = attrs.field(init=False)
    _tpots: _Window = attrs.field(init=False)
    _prefill: _Window = attrs.field(init=False)
    _batches: _Window = attrs.field(init=False)
    _load: _Window = attrs.field(init=False)
    _ttfts: deque[float] = attrs.field(init=False, factory=deque)
    _busy: deque[tuple[float, float]] = attrs.field(init=False, factory=deque)
    _busy_since: float | None = attrs.field(init=False, default=None)
    _router_sat: _TimeAverage = attrs.field(init=False)
    _engine_sat: _TimeAverage = attrs.field(init=False)
    _engine_last: tuple[float, int, int] | None = attrs.field(init=False, default=None)
    _last_arrival: float | None = attrs.field(init=False, default=None)
    _ttft_ewma: float | None = attrs.field(init=False, default=None)
    _dispatched: int = attrs.field(init=False, default=0)
    _completed: int = attrs.field(init=False, default=0)
    _started: float | None = attrs.field(init=False, default=None)
    _waiting: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s must be a finite number > 0 (got {self.window_s!r})")
        if self.max_samples < 3:
            raise ValueError(f"max_samples must be >= 3 (got {self.max_samples!r})")
        if not (0.0 < self.ttft_alpha <= 1.0):
            raise ValueError(f"ttft_alpha must be in (0, 1] (got {self.ttft_alpha!r})")
        if self.default_output_tokens < 1:
            raise ValueError(
                f"default_output_tokens must be >= 1 (got {self.default_output_tokens!r})"
            )
        cap = self.max_samples
        self._gaps = _Window(cap)
        self._completions = _Window(cap)
        self._tpots = _Window(cap)
        self._prefill = _Window(cap)
        self._batches = _Window(cap)
        self._load = _Window(cap)
        self._router_sat = _TimeAverage(self.window_s)
        self._engine_sat = _TimeAverage(self.window_s)

    # ------------------------------------------------------------------ events

    def _touch(self, now: float) -> None:
        if self._started is None or now < self._started:
            self._started = now

    def _router_state(self, now: float) -> None:
        self._router_sat.set(now, len(self._reqs) - self._waiting, self._waiting)

    def on_dispatch(
        self,
        request_id: str,
        now: float,
        prompt_tokens: int,
        output_tokens: int | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """A request was sent to the instance.

        Args:
            request_id: Unique id (router's).
            now: Dispatch time.
            prompt_tokens: Prompt length.
            output_tokens: Predicted output length, if any.
            cached_tokens: Of the prompt, tokens the instance holds cached (they
                bring no prefill work).

        Raises:
            ValueError: A duplicate id or a bad value (named).
        """
        now = _check_time("now", now)
        if request_id in self._reqs:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if (
            isinstance(prompt_tokens, bool)
            or not isinstance(prompt_tokens, int)
            or prompt_tokens < 1
        ):
            raise ValueError(f"prompt_tokens must be an integer >= 1 (got {prompt_tokens!r})")
        if output_tokens is not None and (
            isinstance(output_tokens, bool)
            or not isinstance(output_tokens, int)
            or output_tokens < 1
        ):
            raise ValueError(
                f"output_tokens must be an integer >= 1 or None (got {output_tokens!r})"
            )
        self._touch(now)
        if not self._reqs:
            self._busy_since = now
        req = _Req(now, prompt_tokens, output_tokens)
        # Nothing queued ahead: its TTFT is (mostly) its own prefill, usable for theta_pre.
        req.unqueued = self._waiting == 0
        self._reqs[request_id] = req
        self._waiting += 1
        self._dispatched += 1
        # Eq. 12's prefill terms of what it computes: tokens, and attention (chunks
        # telescope; a cached prefix is attended to, not computed).
        c = min(max(0, cached_tokens), prompt_tokens - 1)
        p = prompt_tokens
        self._load.push(now, float(p - c), (p * (p + 1) - c * (c + 1)) / 2.0)
        if self._last_arrival is not None:
            self._gaps.push(now, max(0.0, now - self._last_arrival))
        self._last_arrival = now
        self._router_state(now)

    def prefill_load(self, now: float, b1: float, b3: float, horizon_s: float = 10.0) -> float:
        """Seconds of prefill per second that this router's recent dispatches brought.

        Each dispatch's prompt priced by eq. 12's dense and attention terms
        (``b1`` per token, ``b3`` per attention unit), over the last
        ``horizon_s`` seconds (or the span of the samples kept, when more
        arrived): what the requests still to come will likely add to every
        batch a request decodes in (:meth:`RouterCore.decide` uses it for TPOT).
        """
        w = self._load
        w.prune(now - horizon_s)
        if not w.n or self._started is None:
            return 0.0
        span = min(horizon_s, now - self._started)
        if w.n >= w.cap:
            span = min(span, now - w.first_t)
        if span <= 0.0:
            return 0.0
        return (b1 * w.sa + b3 * w.sb) / span

    def on_first_token(self, request_id: str, now: float) -> float:
        """The request's first token arrived; return its TTFT (seconds)."""
        now = _check_time("now", now)
        req = self._get(request_id)
        if req.t_first is not None:
            return req.t_first - req.t_dispatch
        req.t_first = now
        req.produced = max(req.produced, 1)
        self._waiting -= 1
        ttft = max(0.0, now - req.t_dispatch)
        self._ttfts.append(ttft)
        if len(self._ttfts) > self.max_samples:
            self._ttfts.popleft()
        a = self.ttft_alpha
        self._ttft_ewma = ttft if self._ttft_ewma is None else a * ttft + (1 - a) * self._ttft_ewma
        if req.unqueued and ttft > 0:
            self._prefill.push(now, float(req.prompt), ttft)
        self._router_state(now)
        return ttft

    def on_tokens(self, request_id: str, now: float, output_tokens: int) -> None:
        """Progress: the request has produced ``output_tokens`` tokens so far."""
        _check_time("now", now)
        req = self._get(request_id)
        if output_tokens > req.produced:
            if req.t_first is None:
                self.on_first_token(request_id, now)
            req.produced = output_tokens

    def on_complete(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        """The request finished.

        Args:
            request_id: Its id.
            now: Completion time.
            output_tokens: Tokens it generated (default: the progress reported).
        """
        now = _check_time("now", now)
        req = self._get(request_id)
        if output_tokens is not None and (isinstance(output_tokens, bool) or output_tokens < 0):
            raise ValueError(f"output_tokens must be an integer >= 0 (got {output_tokens!r})")
        if req.t_first is None:
            self.on_first_token(request_id, now)
        out = req.produced if output_tokens is None else int(output_tokens)
        del self._reqs[request_id]
        self._completed += 1
        self._completions.push(now, float(out))
        if out >= 2 and req.t_first is not None and now > req.t_first:
            self._tpots.push(now, (now - req.t_first) / (out - 1))
        self._end_busy(now)
        self._router_state(now)

    def on_abort(self, request_id: str, now: float) -> None:
        """The request failed or was cancelled: forget it without counting a completion."""
        now = _check_time("now", now)
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        if req.t_first is None:
            self._waiting -= 1
        self._end_busy(now)
        self._router_state(now)

    def on_load(self, now: float, running: int, waiting: int) -> None:
        """Engine-reported counts (e.g. ``vllm:num_requests_running`` / ``_waiting``)."""
        now = _check_time("now", now)
        if running < 0 or waiting < 0:
            raise ValueError(f"running and waiting must be >= 0 (got {running!r}, {waiting!r})")
        self._touch(now)
        self._engine_sat.set(now, int(running), int(waiting))
        self._engine_last = (now, int(running), int(waiting))

    def on_batch(self, now: float, prefill_tokens: int, duration_s: float) -> None:
        """An executed batch, when the engine reports them (for ``theta_pre``)."""
        now = _check_time("now", now)
        if prefill_tokens > 0 and math.isfinite(duration_s) and duration_s > 0:
            self._batches.push(now, float(prefill_tokens), float(duration_s))

    def _get(self, request_id: str) -> _Req:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise ValueError(f"request_id {request_id!r} is not in flight") from None

    def _end_busy(self, now: float) -> None:
        if not self._reqs and self._busy_since is not None:
            self._busy.append((self._busy_since, max(now, self._busy_since)))
            self._busy_since = None
            if len(self._busy) > self.max_samples:
                self._busy.popleft()

    # ------------------------------------------------------------------ view

    @property
    def unfinished(self) -> int:
        """Dispatched requests not yet completed."""
        return len(self._reqs)

    def busy_time(self, start: float, end: float) -> float:
        """Seconds in ``[start, end]`` with at least one unfinished request."""
        total = 0.0
        for a, b in self._busy:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                total += hi - lo
        if self._busy_since is not None:
            total += max(0.0, end - max(self._busy_since, start))
        return total

    def view(
        self,
        now: float,
        *,
        snapshot: Snapshot | None = None,
        snapshot_time: float | None = None,
        name: str = "",
    ) -> InstanceView:
        """Summarise the window ending at ``now`` into an :class:`InstanceView`.

        Args:
            now: Current time (same clock as the events).
            snapshot: The instance's latest valid snapshot, if any.
            snapshot_time: When that snapshot was captured, on this clock
                (default: now, i.e. age 0).
            name: Instance name.
        """
        now = _check_time("now", now)
        start = now - self.window_s
        for w in (self._gaps, self._completions, self._tpots, self._prefill, self._batches):
            w.prune(start)
        while self._busy and self._busy[0][1] < start:
            self._busy.popleft()
        span = 0.0 if self._started is None else min(self.window_s, now - self._started)

        def rate(count: float) -> float | None:
            return count / span if span > 0 else None

        pending_pre = 0
        pending_dec = 0
        default = self.default_output_tokens
        for r in self._reqs.values():
            if r.t_first is None:
                pending_pre += r.prompt
            goal = r.predicted if r.predicted is not None else default
            if goal > r.produced:
                pending_dec += goal - r.produced
        running, waiting = len(self._reqs) - self._waiting, self._waiting
        engine = self._engine_last is not None and self._engine_last[0] >= start
        if engine and self._engine_last is not None:
            _, running, waiting = self._engine_last
        concurrency = (self._engine_sat if engine else self._router_sat).value(now)
        comps = self._completions
        busy = self.busy_time(start, now)
        theta = None
        if self._batches.n:
            theta = self._batches.sa / self._batches.sb
        elif self._prefill.n >= 3:
            # Without engine batch reports: prompt tokens per second of TTFT of
            # requests that found no queue (includes decode interference: a lower bound).
            theta = self._prefill.sa / self._prefill.sb
        age = math.inf
        if snapshot is not None:
            age = 0.0 if snapshot_time is None else max(0.0, now - snapshot_time)
        return InstanceView(
            name=name,
            now=now,
            snapshot=snapshot,
            snapshot_age_s=age,
            dispatched=self._dispatched,
            unfinished=len(self._reqs),
            running=running,
            waiting=waiting,
            pending_prefill_tokens=pending_pre,
            pending_decode_tokens=pending_dec,
            arrival_rate=rate(self._gaps.n),
            completion_rate=rate(comps.n),
            service_rate=comps.n / busy if comps.n and busy > 0 else None,
            output_token_rate=rate(max(0.0, comps.sa)),
            mean_tpot_s=self._tpots.mean(),
            mean_output_tokens=comps.mean(),
            ttft_ewma_s=self._ttft_ewma,
            arrival_scv=self._gaps.scv(),
            service_scv=comps.scv(),
            concurrency=concurrency,
            prefill_throughput=theta,
            recent_ttfts_s=tuple(self._ttfts),
        )
