"""RouterHooks: the router's observability callbacks."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from bearsdk.router.decision import Decision

__all__ = ["RouterHooks"]


@attrs.define
class RouterHooks:
    """Callbacks for observability; each runs synchronously on the event loop.

    Attributes:
        on_decision: Every routing decision.
        on_dispatch: ``(decision, instance, time)`` each time a request is sent
            to an instance (each attempt; ``time`` on the router's clock).
        on_first_token: ``(decision, instance, observed_ttft_s)`` when the first
            token of a dispatched request arrives.
        on_complete: ``(decision, instance, outcome)`` with outcome
            ``"ok"``, ``"error"`` or ``"cancelled"``.
        on_failure: ``(decision, instance, why)`` when an attempt fails before
            the response starts (the request moves on to the next-best instance).
    """

    on_decision: list[Callable[[Decision], None]] = attrs.Factory(list)
    on_dispatch: list[Callable[[Decision, str, float], None]] = attrs.Factory(list)
    on_first_token: list[Callable[[Decision, str, float], None]] = attrs.Factory(list)
    on_complete: list[Callable[[Decision, str, str], None]] = attrs.Factory(list)
    on_failure: list[Callable[[Decision, str, str], None]] = attrs.Factory(list)
