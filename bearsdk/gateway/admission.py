"""Admission: what the gateway does when no instance is predicted to meet a request's target.

* ``best-effort``: send it anyway, where the selector's fallback puts it (the
  embedded router's behaviour).
* ``reject``: answer 429 at once, with ``Retry-After`` from the predicted drain
  time: how much later than its target the best instance would serve it now.
* ``queue``: hold it in a bounded router-side queue and decide again as
  snapshots arrive, each time against what is left of its target (the wait
  counts against the client's TTFT); send it once an instance is predicted on
  time, give up with a 429 at the deadline (its target, or ``max_wait_ms``). A
  full queue rejects.

Held requests cost nothing while nothing changes: one ticker per gateway
(:meth:`Admission.run`) looks every ``recheck_ms`` and decides again only
when a snapshot arrived since its last look (without new evidence a
prediction can only get later, as the target left shrinks), oldest first,
within a quarter of the interval's CPU; the rest wait for the next tick. So a
full queue of 1,024 requests cannot turn into 100,000 decisions a second.

A selector that ignores targets (``feasible`` is ``None``) admits everything.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import anyio
import anyio.abc
import attrs

from bearsdk.errors import BearError
from bearsdk.gateway.config import AdmissionConfig
from bearsdk.router.decision import Decision

__all__ = ["Admission", "Refused", "drain_time_s"]

# A 429's Retry-After is at least this (seconds): HTTP says whole seconds, and
# 0 would invite an immediate retry into the same overload.
_MIN_RETRY_S = 1.0


class Refused(Exception):
    """Admission refused the request (429).

    Attributes:
        retry_after_s: When trying again could succeed (predicted drain time).
        code: ``slo_unattainable`` (reject, or the queue's deadline passed) or
            ``queue_full``.
    """

    def __init__(self, message: str, retry_after_s: float, code: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code


def on_time(d: Decision) -> bool:
    """The decision's instance is predicted to meet the target (or targets are ignored)."""
    feasible = d.chosen.feasible
    return feasible is None or feasible


def drain_time_s(d: Decision) -> float:
    """How much later than its target the best candidate would serve the request now.

    A candidate whose TTFT is only a lower bound (the replay stopped at its
    horizon) gives a lower bound here too.
    """
    late = [
        c.ttft_s - d.ttft_target_s
        for c in d.candidates
        if math.isfinite(c.ttft_s) and c.ttft_s > d.ttft_target_s
    ]
    return min(late) if late else 0.0


@attrs.define(eq=False)
class _Held:
    """A request in the queue: what to decide it with, and its outcome once known."""

    prompt: Any
    max_tokens: int | None
    instances: Collection[str]
    tpot_target: float | None
    start: float
    target: float
    deadline: float
    last: Decision
    done: anyio.Event = attrs.Factory(anyio.Event)
    result: Decision | Refused | None = None


@attrs.define
class Admission:
    """One gateway's admission control (:mod:`bearsdk.gateway.admission`).

    Args:
        config: The ``[admission]`` section.
        clock: Monotonic seconds.
        on_outcome: Called with ``admitted``, ``rejected``, ``queued`` or ``expired``.
        evidence: A number that changes whenever a snapshot arrives (the sum of
            the pool's snapshot-cache versions); held requests are decided again
            only when it moved.
    """

    config: AdmissionConfig
    clock: Callable[[], float] = time.monotonic
    on_outcome: Callable[[str], None] = lambda outcome: None
    evidence: Callable[[], int] = lambda: 0
    _queue: deque[_Held] = attrs.field(factory=deque, init=False)
    _decide: Callable[..., Decision] | None = attrs.field(default=None, init=False)
    _running: bool = attrs.field(default=False, init=False)

    @property
    def held(self) -> int:
        """Requests waiting in the queue now."""
        return len(self._queue)

    async def admit(
        self,
        decide: Callable[..., Decision],
        prompt: Any,
        *,
        ttft_target: float | None,
        max_tokens: int | None,
        instances: Collection[str],
        tpot_target: float | None = None,
    ) -> Decision:
        """Decide for a request and apply the admission rule.

        Args:
            decide: The router's ``decide``.
            prompt: Messages or prompt text.
            ttft_target: The request's target (``None``: the router's rule).
            max_tokens: Its output cap.
            instances: Where it may go.
            tpot_target: Its TPOT target, if any: on time means meeting both.

        Returns:
            The decision to send it by.

        Raises:
            Refused: ``reject`` and late everywhere, or ``queue`` and the
                queue is full or the deadline passed.
            NoInstanceError: No instance can take it at all.
        """
        d: Decision = decide(
            prompt,
            ttft_target=ttft_target,
            max_tokens=max_tokens,
            instances=instances,
            tpot_target=tpot_target,
        )
        mode = self.config.mode
        if mode == "best-effort" or on_time(d):
            self.on_outcome("admitted")
            return d
        if mode == "reject" or not self._running:
            # Without its ticker (not started: a caller outside the gateway) the
            # queue would never move; refusing at once is the honest answer.
            self.on_outcome("rejected")
            raise _late(d)
        if len(self._queue) >= self.config.queue_size:
            self.on_outcome("rejected")
            raise Refused(
                f"the admission queue is full ({self.config.queue_size} requests held)",
                max(_MIN_RETRY_S, drain_time_s(d)),
                "queue_full",
            )
        self._decide = decide
        start = self.clock()
        target = d.ttft_target_s
        wait = self.config.max_wait_ms / 1e3 if self.config.max_wait_ms > 0 else target
        held = _Held(
            prompt, max_tokens, instances, tpot_target, start, target, start + min(wait, target), d
        )
        self._queue.append(held)
        self.on_outcome("queued")
        try:
            await held.done.wait()
        finally:
            if held.result is None:  # the caller gave up (cancelled) while held
                self._queue.remove(held)
        if isinstance(held.result, Refused):
            raise held.result
        assert held.result is not None
        return held.result

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The queue's ticker: runs until cancelled (the gateway's task group starts it)."""
        self._running = True
        seen = self.evidence()
        task_status.started()
        try:
            while True:
                await anyio.sleep(self.config.recheck_ms / 1e3)
                if not self._queue:
                    seen = self.evidence()
                    continue
                now_seen = self.evidence()
                self._tick(fresh=now_seen != seen)
                seen = now_seen
        finally:
            self._running = False
            # Nothing will move the queue any more: everyone held gets the 429 now.
            while self._queue:
                h = self._queue.popleft()
                h.result = _late(h.last, waited_s=self.clock() - h.start)
                h.done.set()

    def _tick(self, *, fresh: bool) -> None:
        """Expire what is past its deadline; with new evidence, decide again, oldest first."""
        t0 = time.perf_counter()
        budget_s = self.config.recheck_ms / 1e3 / 4
        decide = self._decide
        keep: deque[_Held] = deque()
        for h in self._queue:
            now = self.clock()
            left = h.target - (now - h.start)
            if now >= h.deadline or left <= 0:
                self._settle(h, _late(h.last, waited_s=now - h.start), "expired")
                continue
            if fresh and decide is not None and time.perf_counter() - t0 <= budget_s:
                try:
                    d = decide(
                        h.prompt,
                        ttft_target=left,
                        max_tokens=h.max_tokens,
                        instances=h.instances,
                        tpot_target=h.tpot_target,
                    )
                except BearError:
                    d = None  # e.g. no routable instance in its group right now: later
                if d is not None:
                    h.last = d
                    if on_time(d):
                        self._settle(h, d, "admitted")
                        continue
            keep.append(h)  # deadlines are still checked for everyone past the budget
        self._queue = keep

    def _settle(self, h: _Held, result: Decision | Refused, outcome: str) -> None:
        h.result = result
        h.done.set()
        self.on_outcome(outcome)


def _late(d: Decision, waited_s: float = 0.0) -> Refused:
    drain = drain_time_s(d)
    best = min((c.ttft_s for c in d.candidates if math.isfinite(c.ttft_s)), default=math.inf)
    waited = f" after waiting {waited_s * 1e3:.0f} ms" if waited_s > 0 else ""
    tpot = ""
    if d.tpot_target_s != math.inf:
        tpot = f" and the TPOT target of {d.tpot_target_s * 1e3:.1f} ms"
    return Refused(
        f"no instance is predicted to meet the TTFT target of {d.ttft_target_s * 1e3:.0f} ms"
        f"{tpot}{waited} (best predicted TTFT {best * 1e3:.0f} ms)",
        max(_MIN_RETRY_S, drain),
        "slo_unattainable",
    )
