"""Admission: what the gateway does when no instance is predicted to meet a request's target.

* ``best-effort``: send it anyway, where the selector's fallback puts it (the
  embedded router's behaviour).
* ``reject``: answer 429 at once, with ``Retry-After`` from the predicted drain
  time: how much later than its target the best instance would serve it now.
* ``queue``: hold it in a bounded router-side queue and decide again every
  ``recheck_ms`` as snapshots arrive, each time against what is left of its
  target (the wait counts against the client's TTFT); send it once an instance
  is predicted on time, give up with a 429 at the deadline (its target, or
  ``max_wait_ms``). A full queue rejects.

A selector that ignores targets (``feasible`` is ``None``) admits everything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from typing import Any

import anyio
import attrs

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


@attrs.define
class Admission:
    """One gateway's admission control (:mod:`bearsdk.gateway.admission`).

    Args:
        config: The ``[admission]`` section.
        clock: Monotonic seconds.
        on_outcome: Called with ``admitted``, ``rejected``, ``queued`` or ``expired``.
    """

    config: AdmissionConfig
    clock: Callable[[], float] = time.monotonic
    on_outcome: Callable[[str], None] = lambda outcome: None
    _held: int = attrs.field(default=0, init=False)

    @property
    def held(self) -> int:
        """Requests waiting in the queue now."""
        return self._held

    async def admit(
        self,
        decide: Callable[..., Decision],
        prompt: Any,
        *,
        ttft_target: float | None,
        max_tokens: int | None,
        instances: Collection[str],
    ) -> Decision:
        """Decide for a request and apply the admission rule.

        Args:
            decide: The router's ``decide``.
            prompt: Messages or prompt text.
            ttft_target: The request's target (``None``: the router's rule).
            max_tokens: Its output cap.
            instances: Where it may go.

        Returns:
            The decision to send it by.

        Raises:
            Refused: ``reject`` and late everywhere, or ``queue`` and the
                queue is full or the deadline passed.
            NoInstanceError: No instance can take it at all.
        """
        d: Decision = decide(
            prompt, ttft_target=ttft_target, max_tokens=max_tokens, instances=instances
        )
        mode = self.config.mode
        if mode == "best-effort" or on_time(d):
            self.on_outcome("admitted")
            return d
        if mode == "reject":
            self.on_outcome("rejected")
            raise _late(d)
        if self._held >= self.config.queue_size:
            self.on_outcome("rejected")
            raise Refused(
                f"the admission queue is full ({self.config.queue_size} requests held)",
                max(_MIN_RETRY_S, drain_time_s(d)),
                "queue_full",
            )
        return await self._wait(decide, prompt, d, max_tokens, instances)

    async def _wait(
        self,
        decide: Callable[..., Decision],
        prompt: Any,
        d: Decision,
        max_tokens: int | None,
        instances: Collection[str],
    ) -> Decision:
        start = self.clock()
        target = d.ttft_target_s
        wait = self.config.max_wait_ms / 1e3 if self.config.max_wait_ms > 0 else target
        deadline = start + min(wait, target)
        self._held += 1
        self.on_outcome("queued")
        try:
            while True:
                await anyio.sleep(self.config.recheck_ms / 1e3)
                now = self.clock()
                left = target - (now - start)
                if now >= deadline or left <= 0:
                    self.on_outcome("expired")
                    raise _late(d, waited_s=now - start)
                d = decide(prompt, ttft_target=left, max_tokens=max_tokens, instances=instances)
                if on_time(d):
                    self.on_outcome("admitted")
                    return d
        finally:
            self._held -= 1


def _late(d: Decision, waited_s: float = 0.0) -> Refused:
    drain = drain_time_s(d)
    best = min((c.ttft_s for c in d.candidates if math.isfinite(c.ttft_s)), default=math.inf)
    waited = f" after waiting {waited_s * 1e3:.0f} ms" if waited_s > 0 else ""
    return Refused(
        f"no instance is predicted to meet the TTFT target of {d.ttft_target_s * 1e3:.0f} ms"
        f"{waited} (best predicted {best * 1e3:.0f} ms)",
        max(_MIN_RETRY_S, drain),
        "slo_unattainable",
    )
