"""Admission control in the simulator: the gateway's rule (:mod:`bearsdk.gateway.admission`)
applied in virtual time.

:func:`~bearsdk.sim.run.run_scenario` decides every arrival with the router, then
asks :meth:`SimAdmission.admit` what to do with the decision:

* ``best-effort``: send it, where the selector's fallback put it (the
  simulator's behaviour without an admission axis, bit for bit);
* ``reject``: unless an instance is predicted on time
  (:func:`~bearsdk.gateway.admission.on_time`), the request is refused at once
  (the gateway's immediate 429): not dispatched, no first token;
* ``queue``: unless on time, it is held (FIFO) if fewer than ``queue_size``
  are, else refused. A held request is decided again against what is left of
  its target (target minus the time it waited) and sent once an instance is
  predicted on time; at its deadline, ``arrival + min(target, max_wait)``, it
  expires (the gateway's 429 after waiting).

**Recheck granularity.** The gateway rechecks a held request every
``recheck_ms`` (10 ms by default). The simulator captures engine snapshots at
arrival instants, so it rechecks every held request at each later arrival,
before deciding that arrival: at 25 qps that is every 40 ms on average, coarser
than the gateway below 100 qps (a held request may be sent or expire a little
later than the gateway would). After the last arrival there are no arrivals
left to recheck at: held requests are rechecked every :data:`TAIL_RECHECK_S`
(the gateway's default ``recheck_ms``) until each is sent or expires.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.gateway.admission import on_time
from bearsdk.gateway.config import ADMISSION_MODES
from bearsdk.router.decision import Decision

__all__ = ["HOLD", "REJECT", "SEND", "TAIL_RECHECK_S", "Held", "SimAdmission"]

SEND: Final = "send"
"""Verdict: dispatch the request now."""
HOLD: Final = "hold"
"""Verdict: the request waits in the admission queue."""
REJECT: Final = "reject"
"""Verdict: refused at once (the gateway's immediate 429)."""

TAIL_RECHECK_S: Final = 0.010
"""Recheck period after the last arrival: the gateway's default ``recheck_ms``."""


@attrs.frozen
class Held:
    """A request waiting in the admission queue.

    Attributes:
        index: The request's row in the run's :class:`~bearsdk.sim.scenario.RequestSet`.
        arrival: When it arrived (its TTFT counts from here).
        target: Its TTFT target, seconds.
        deadline: When it expires: ``arrival + min(target, max_wait)``.
    """

    index: int
    arrival: float
    target: float
    deadline: float

    def left(self, now: float) -> float:
        """What is left of its target at ``now``: the target to decide it against."""
        return self.target - (now - self.arrival)


@attrs.define
class SimAdmission:
    """One run's admission control: the queue and its counters.

    Args:
        mode: One of :data:`~bearsdk.gateway.config.ADMISSION_MODES`.
        queue_size: Most requests held at once (``queue``).
        max_wait_s: Longest a request is held (``0``: its target).

    Attributes:
        rejected: Requests refused at arrival (``reject`` late everywhere, or
            ``queue`` full): the gateway's immediate 429s.
        queued: Requests held at least once.
        expired: Held requests that reached their deadline unsent (the
            gateway's 429 after waiting).
        reject_decide_s: Wall time of the decision that refused each rejected
            request: what the gateway spends between a request's arrival and its 429.
        horizon_errors: Rechecks the router refused with ``ValueError: horizon_s
            must be > 0``: a left target under half an instance's learned
            first-token overhead makes ``RouterCore``'s replay horizon negative
            (a router bug the gateway's queue can hit too); the simulator counts
            the request as still late, which it is (nothing serves a request in
            under the overhead).

    Raises:
        ValueError: An unknown mode, ``queue_size < 1`` or ``max_wait_s < 0``.
    """

    mode: str
    queue_size: int = 1024
    max_wait_s: float = 0.0
    rejected: int = attrs.field(default=0, init=False)
    queued: int = attrs.field(default=0, init=False)
    expired: int = attrs.field(default=0, init=False)
    reject_decide_s: list[float] = attrs.field(factory=list, init=False)
    horizon_errors: int = attrs.field(default=0, init=False)
    _held: deque[Held] = attrs.field(factory=deque, init=False)

    def __attrs_post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(
                f"admission must be one of {', '.join(ADMISSION_MODES)} (got {self.mode!r})"
            )
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1 (got {self.queue_size!r})")
        if not (math.isfinite(self.max_wait_s) and self.max_wait_s >= 0):
            raise ValueError(f"max_wait_s must be a finite number >= 0 (got {self.max_wait_s!r})")

    @property
    def held(self) -> int:
        """Requests waiting now."""
        return len(self._held)

    def admit(self, index: int, arrival: float, d: Decision, decide_s: float) -> str:
        """What to do with an arriving request, given the router's decision for it.

        Args:
            index: Its row.
            arrival: Its arrival time (now).
            d: The decision, against its whole target.
            decide_s: Wall time the decision took (kept if it refuses the request).

        Returns:
            :data:`SEND`, :data:`HOLD` or :data:`REJECT`.
        """
        if self.mode == "best-effort" or on_time(d):
            return SEND
        if self.mode == "queue" and len(self._held) < self.queue_size:
            target = d.ttft_target_s
            wait = self.max_wait_s if self.max_wait_s > 0 else target
            self._held.append(Held(index, arrival, target, arrival + min(wait, target)))
            self.queued += 1
            return HOLD
        self.rejected += 1
        self.reject_decide_s.append(decide_s)
        return REJECT

    def take(self, now: float) -> list[Held]:
        """Empty the queue for a recheck at ``now``: the held requests still alive, in
        FIFO order; those at their deadline (or with nothing left of their target)
        expire. Put back each that stays late with :meth:`keep`.
        """
        live: list[Held] = []
        for h in self._held:
            if now >= h.deadline or h.left(now) <= 0:
                self.expired += 1
            else:
                live.append(h)
        self._held.clear()
        return live

    def keep(self, h: Held) -> None:
        """Hold ``h`` again (rechecked and still late everywhere), behind those kept before."""
        self._held.append(h)

    def recheck(
        self,
        now: float,
        decide: Callable[[int, float], Decision],
        send: Callable[[int, Decision], None],
    ) -> int:
        """Decide every held request again against what is left of its target.

        In FIFO order, each seeing the ones sent before it: expire those at
        their deadline, send those now predicted on time, hold the others.

        Args:
            now: The recheck's time (the router's snapshots are as of now).
            decide: ``decide(index, target)``: the router's decision for a
                request against ``target``.
            send: ``send(index, decision)``: dispatch it by that decision, now.

        Returns:
            Decisions made.
        """
        made = 0
        for h in self.take(now):
            made += 1
            try:
                d = decide(h.index, h.left(now))
            except ValueError as exc:
                # RouterCore cuts BEA's horizon (2x the target) by an instance's
                # first-token overhead: a target under half of it makes the horizon
                # negative and the replay refuses it. Nothing is on time with so
                # little left: still late, and counted.
                if "horizon_s must be > 0" not in str(exc):
                    raise
                self.horizon_errors += 1
                self.keep(h)
                continue
            if on_time(d):
                send(h.index, d)
            else:
                self.keep(h)
        return made

    def tail(self, times: npt.NDArray[np.float64], targets: npt.NDArray[np.float64]) -> list[float]:
        """The recheck instants after the last arrival: every :data:`TAIL_RECHECK_S`
        until the longest hold any request could have has passed (none but for ``queue``).

        Args:
            times: The run's arrival times (ascending).
            targets: Each request's TTFT target.
        """
        if self.mode != "queue" or not len(times):
            return []
        hold = float(np.max(targets))
        if self.max_wait_s > 0:
            hold = min(hold, self.max_wait_s)
        # One step past the longest hold: at the last instant, every deadline has passed.
        steps = math.ceil(hold / TAIL_RECHECK_S) + 1
        last = float(times[-1])
        return [last + TAIL_RECHECK_S * (k + 1) for k in range(steps)]

    def reject_decide_us(self) -> tuple[float, float] | None:
        """Max and 99th percentile of :attr:`reject_decide_s`, microseconds (``None`` if none)."""
        if not self.reject_decide_s:
            return None
        a = np.asarray(self.reject_decide_s) * 1e6
        return float(a.max()), float(np.quantile(a, 0.99))
