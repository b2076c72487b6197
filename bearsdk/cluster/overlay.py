"""The cross-replica dispatch overlay: every replica's dispatches in every replica's view.

A router's :class:`~bearsdk.state.DispatchOverlay` adds the requests *it* sent
to an instance to its view until a snapshot shows them. With several replicas
each sees only its own share, so between two snapshots they all find the same
instance emptiest and pile onto it. :class:`SharedOverlay` publishes each
dispatch of its replica (and its first token, and its end) on the bus, and
feeds the other replicas' events into its router's instance states through the
same overlay: a foreign dispatch joins the view as a waiting request (running
once its first token was seen), is advanced by fast-forward like an own one, and
leaves when a snapshot shows it, when its replica reports it finished, or when
it is older than a snapshot's capture less the overlay's grace.

Publishing is a queue append (:meth:`RedisBus.publish_dispatch`): the routing
path never waits for Redis. When the bus is down, each replica keeps its own
overlay, and the others' dispatches it already knows age out as usual.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs

from bearsdk import _validators as _v
from bearsdk.cluster.wire import DispatchEvent
from bearsdk.errors import BearError
from bearsdk.router.core import RouterCore
from bearsdk.router.decision import Decision

if TYPE_CHECKING:
    from bearsdk.router.router import AsyncRouter

__all__ = ["DispatchBus", "OverlayStats", "SharedOverlay"]


class DispatchBus(Protocol):
    """Where replicas exchange dispatch events (:class:`~bearsdk.cluster.RedisBus`;
    simulations plug in their own)."""

    def publish_dispatch(self, event: DispatchEvent) -> None:
        """Queue ``event`` for every replica (must not block)."""
        ...

    def subscribe_dispatches(self, callback: Callable[[DispatchEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every event read; returns the unsubscriber."""
        ...


def _replica_id(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{att.name} must be a non-empty string (got {value!r})")


@attrs.frozen
class OverlayStats:
    """Counters of one :class:`SharedOverlay`.

    Attributes:
        published: Events of this replica queued for the bus.
        applied: Other replicas' dispatches added to an instance's view.
        shown: Other replicas' dispatches not added: the cached snapshot
            already showed them when they arrived.
        stale: Other replicas' dispatches older than ``max_age_s`` on arrival,
            or stamped more than ``max_age_s`` ahead of this replica's clock.
        unknown: Events about instances this router does not have.
        progress: Other replicas' first tokens and completions applied (a
            completion is applied only while it can change the view).
    """

    published: int
    applied: int
    shown: int
    stale: int
    unknown: int
    progress: int


# Validators run at init only: a hook on every private-state write costs
# microseconds on every event.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class SharedOverlay:
    """Shares one router replica's dispatches with the others over a :class:`RedisBus`.

    :meth:`attach` hooks it to a router (``AsyncRouter(..., cluster=...)`` does
    it for you); the bus must be running for events to flow.

    Args:
        bus: The replica's bus (a :class:`~bearsdk.cluster.RedisBus`, or any
            :class:`DispatchBus`).
        replica: This replica's id (unique among the replicas; default random).
        max_age_s: Other replicas' dispatches older than this when they arrive
            (a replica reconnecting reads the recent past), or stamped further
            ahead of this replica's clock (which would never age out), are ignored.
    """

    bus: DispatchBus
    replica: str = attrs.field(factory=lambda: secrets.token_hex(4), validator=_replica_id)
    max_age_s: float = attrs.field(default=5.0, validator=_v.positive)
    _router: RouterCore | None = attrs.field(init=False, default=None)
    _unsubscribe: Callable[[], None] | None = attrs.field(init=False, default=None)
    _published: int = attrs.field(init=False, default=0)
    _applied: int = attrs.field(init=False, default=0)
    _shown: int = attrs.field(init=False, default=0)
    _stale: int = attrs.field(init=False, default=0)
    _unknown: int = attrs.field(init=False, default=0)
    _progress: int = attrs.field(init=False, default=0)

    def stats(self) -> OverlayStats:
        """The counters so far."""
        return OverlayStats(
            published=self._published,
            applied=self._applied,
            shown=self._shown,
            stale=self._stale,
            unknown=self._unknown,
            progress=self._progress,
        )

    # ------------------------------------------------------------------ wiring

    def attach(self, router: RouterCore | AsyncRouter) -> SharedOverlay:
        """Publish ``router``'s dispatches and add the other replicas' to its view.

        Raises:
            BearError: Already attached.
        """
        if self._router is not None:
            raise BearError(f"shared overlay of replica {self.replica!r}: already attached")
        core = router if isinstance(router, RouterCore) else router.core
        self._router = core
        h = core.hooks
        h.on_dispatch.append(self._on_dispatch)
        h.on_first_token.append(self._on_first_token)
        h.on_complete.append(self._on_complete)
        h.on_failure.append(self._on_failure)
        self._unsubscribe = self.bus.subscribe_dispatches(self.apply)
        return self

    def detach(self) -> None:
        """Stop sharing (the router keeps what it has learnt)."""
        router, self._router = self._router, None
        if router is not None:
            h = router.hooks
            for hooks, fn in (
                (h.on_dispatch, self._on_dispatch),
                (h.on_first_token, self._on_first_token),
                (h.on_complete, self._on_complete),
                (h.on_failure, self._on_failure),
            ):
                if fn in hooks:
                    hooks.remove(fn)  # type: ignore[arg-type]
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # ------------------------------------------------------------------ own events

    def _publish(self, kind: str, d: Decision, instance: str, t: float) -> None:
        prompt, out = 0, None
        if kind == "dispatch":
            c = next((c for c in d.candidates if c.instance == instance), None)
            if c is None:
                return
            prompt, out = max(1, c.prompt_tokens), max(1, c.output_tokens)
        self.bus.publish_dispatch(
            DispatchEvent(self.replica, kind, instance, d.request_id, t, prompt, out)
        )
        self._published += 1

    def _now(self) -> float:
        assert self._router is not None
        return self._router.clock()

    def _on_dispatch(self, d: Decision, instance: str, now: float) -> None:
        self._publish("dispatch", d, instance, now)

    def _on_first_token(self, d: Decision, instance: str, ttft_s: float) -> None:
        self._publish("token", d, instance, self._now())

    def _on_complete(self, d: Decision, instance: str, outcome: str) -> None:
        self._publish("complete", d, instance, self._now())

    def _on_failure(self, d: Decision, instance: str, why: str) -> None:
        # Failed before answering: the engine holds no copy (the router closed it).
        self._publish("complete", d, instance, self._now())

    # ------------------------------------------------------------------ others' events

    def apply(self, ev: DispatchEvent) -> None:
        """Apply one event read from the bus (this replica's own are ignored)."""
        router = self._router
        if router is None or ev.replica == self.replica:
            return
        try:
            state = router.state(ev.instance)
        except BearError:
            self._unknown += 1
            return
        if ev.kind == "dispatch":
            # Ahead of this clock by as much: a skewed or forged clock. Such a
            # dispatch would never age out of the view.
            if abs(router.clock() - ev.time) > self.max_age_s:
                self._stale += 1
                return
            entry = router.cache(ev.instance).entry
            # The snapshot may have overtaken the event (Redis is one more hop
            # than the engine's stream): then the request is in the view already.
            if entry is not None and any(ev.rid in e for e in entry.snapshot.ids):
                self._shown += 1
                return
            try:
                state.on_dispatch(ev.rid, ev.prompt_tokens, ev.output_tokens, now=ev.time)
            except ValueError:
                return  # already pending (an event read twice after a reconnect)
            self._applied += 1
        elif ev.kind == "token":
            state.on_tokens(ev.rid, 1)
            self._progress += 1
        else:
            # A completion matters while this replica follows the request (its
            # dispatch still pending, or its length remembered: fast-forward
            # retires it, the length is forgotten) or when the snapshot holds it
            # under the replica's own id. Any other would change nothing but
            # would still make the instance's derived view be rebuilt.
            entry = router.cache(ev.instance).entry
            if state.tracks(ev.rid) or (entry is not None and ev.rid in entry.snapshot.ids):
                state.on_complete(ev.rid, now=ev.time)
                self._progress += 1
