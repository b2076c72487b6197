"""Circuit breaking: stop sending to an instance that keeps failing, probe it back."""

from __future__ import annotations

import enum

import attrs

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
    ``max_cooldown_s``); then one probe request is let through: success closes
    the breaker, failure re-opens it.

    Args:
        threshold: Consecutive failures that open the breaker.
        cooldown_s: First cool-down.
        max_cooldown_s: Longest cool-down.
    """

    threshold: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 60.0
    _failures: int = attrs.field(default=0, init=False)
    _opened_at: float = attrs.field(default=0.0, init=False)
    _current_cooldown: float = attrs.field(default=0.0, init=False)
    _probing: bool = attrs.field(default=False, init=False)
    _state: BreakerState = attrs.field(default=BreakerState.CLOSED, init=False)
    opens: int = attrs.field(default=0, init=False)

    def state(self, now: float) -> BreakerState:
        """Current state (an open breaker turns half-open when its cool-down ends)."""
        if self._state is BreakerState.OPEN and now - self._opened_at >= self._current_cooldown:
            self._state = BreakerState.HALF_OPEN
            self._probing = False
        return self._state

    def allows(self, now: float) -> bool:
        """May a request be sent now? (Claims the probe slot when half-open.)"""
        st = self.state(now)
        if st is BreakerState.CLOSED:
            return True
        return st is BreakerState.HALF_OPEN and not self._probing

    def routable(self, now: float) -> bool:
        """Like :meth:`allows`, without claiming anything (for candidate lists)."""
        st = self.state(now)
        return st is BreakerState.CLOSED or (st is BreakerState.HALF_OPEN and not self._probing)

    def on_send(self, now: float) -> None:
        """A request is being sent."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probing = True

    def on_success(self) -> None:
        """The instance answered."""
        self._failures = 0
        self._probing = False
        self._current_cooldown = 0.0
        self._state = BreakerState.CLOSED

    def on_failure(self, now: float) -> None:
        """The instance failed (connection error, 5xx, timeout)."""
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.threshold:
            self._current_cooldown = (
                self.cooldown_s
                if self._current_cooldown == 0.0
                else min(self.max_cooldown_s, self._current_cooldown * 2)
            )
            self._opened_at = now
            self._state = BreakerState.OPEN
            self._probing = False
            self.opens += 1
