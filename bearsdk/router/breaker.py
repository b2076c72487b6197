"""Circuit breaking: stop sending to an instance that keeps failing, probe it back."""

from __future__ import annotations

import enum

import attrs

from bearsdk import _validators as _v

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.StrEnum):
    """Closed: routable. Open: not routable. Half-open: one probe request allowed."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@attrs.define
class CircuitBreaker:
    """Consecutive-failure breaker with exponential cool-down.

    After ``threshold`` consecutive failures the instance stops receiving
    requests for ``cooldown_s`` (doubling on each re-open, up to
    ``max_cooldown_s``); then one probe request is let through. The probe's
    first valid answer (its response, or its first streamed event) closes the
    breaker; any failure of it (before or after the response head, mid-stream,
    a hang, garbage) re-opens it; a probe with no verdict after
    ``probe_timeout_s`` counts as failed, so a half-open breaker never waits on
    a probe forever.

    Args:
        threshold: Consecutive failures that open the breaker.
        cooldown_s: First cool-down.
        max_cooldown_s: Longest cool-down.
        probe_timeout_s: Longest wait for a probe's verdict.
    """

    threshold: int = attrs.field(default=3, validator=_v.count)
    cooldown_s: float = attrs.field(default=2.0, validator=_v.positive)
    max_cooldown_s: float = attrs.field(default=60.0, validator=_v.positive)
    probe_timeout_s: float = attrs.field(default=60.0, validator=_v.positive)
    _failures: int = attrs.field(default=0, init=False)
    _opened_at: float = attrs.field(default=0.0, init=False)
    _current_cooldown: float = attrs.field(default=0.0, init=False)
    _probing: bool = attrs.field(default=False, init=False)
    _probe_sent_at: float = attrs.field(default=0.0, init=False)
    _state: BreakerState = attrs.field(default=BreakerState.CLOSED, init=False)
    opens: int = attrs.field(default=0, init=False)

    def state(self, now: float) -> BreakerState:
        """Current state (an open breaker turns half-open when its cool-down ends)."""
        if self._state is BreakerState.OPEN and now - self._opened_at >= self._current_cooldown:
            self._state = BreakerState.HALF_OPEN
            self._probing = False
        elif (
            self._state is BreakerState.HALF_OPEN
            and self._probing
            and now - self._probe_sent_at >= self.probe_timeout_s
        ):
            self._open(now)
        return self._state

    def allows(self, now: float) -> bool:
        """May a request be sent now? (Claims the probe slot when half-open.)"""
        st = self.state(now)
        if st is BreakerState.CLOSED:
            return True
        return st is BreakerState.HALF_OPEN and not self._probing

    def routable(self, now: float) -> bool:
        """Like :meth:`allows`, without claiming anything (for candidate lists)."""
        if self._state is BreakerState.CLOSED:  # (a closed breaker has no timer to run)
            return True
        st = self.state(now)
        return st is BreakerState.CLOSED or (st is BreakerState.HALF_OPEN and not self._probing)

    def on_send(self, now: float) -> None:
        """A request is being sent."""
        if self.state(now) is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            self._probe_sent_at = now

    def on_answer(self) -> None:
        """The instance started a valid answer (a probe's verdict: it lives).

        Unlike :meth:`on_success` this keeps the failure count: a stream that
        starts and then breaks still counts towards opening the breaker.
        """
        if self._state is BreakerState.HALF_OPEN:
            self._state = BreakerState.CLOSED
            self._probing = False

    def on_success(self) -> None:
        """The instance answered in full."""
        self._failures = 0
        self._probing = False
        self._current_cooldown = 0.0
        self._state = BreakerState.CLOSED

    def on_abandon(self) -> None:
        """A request ended without a verdict on the instance (the caller's deadline
        or cancellation): a probe slot it held is free again."""
        self._probing = False

    def on_failure(self, now: float) -> None:
        """The instance failed (connection error, 5xx, hang, broken or garbage answer)."""
        self._failures += 1
        if self._state is BreakerState.OPEN:
            # Requests sent before it opened failing now: no new evidence, and
            # re-opening would stretch the cool-down past its configured bound.
            return
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._current_cooldown = (
            self.cooldown_s
            if self._current_cooldown == 0.0
            else min(self.max_cooldown_s, self._current_cooldown * 2)
        )
        self._opened_at = now
        self._state = BreakerState.OPEN
        self._probing = False
        self.opens += 1
