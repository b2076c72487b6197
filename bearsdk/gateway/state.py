"""The state behind one gateway process: router, keys, admission, decision history.

:class:`Gateway` holds what the HTTP endpoints (:mod:`bearsdk.gateway.app`)
share: the started router, the key ring, admission, the decisions kept for
``GET /bear/decisions/{id}``, and the count of requests in flight that a
drain waits for.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from bearsdk.gateway.admission import Admission
from bearsdk.gateway.config import GatewayConfig, GroupConfig
from bearsdk.gateway.keys import KeyRing, KeySpec
from bearsdk.router import AsyncRouter, Decision

if TYPE_CHECKING:
    from bearsdk.gateway.metrics import GatewayMetrics

__all__ = ["Gateway"]

# Candidates kept in the decision history at most, whatever decision_history says
# (a few hundred bytes each: 200,000 is about 80 MB).
_MAX_KEPT_CANDIDATES = 200_000


@attrs.define
class _Record:
    decision: Decision
    key: str | None
    model: str
    tpot_target_s: float | None = None
    ttft_s: float = math.nan
    outcome: str = "pending"


@attrs.define
class Gateway:
    """The state behind one gateway process: router, keys, admission, history.

    Args:
        router: A started router.
        config: The decoded configuration.
        metrics: Prometheus metrics (``None``: not installed).
        registry: Their ``prometheus_client`` registry (served on ``/metrics``).
    """

    router: AsyncRouter
    config: GatewayConfig
    metrics: GatewayMetrics | None = None
    registry: Any = None
    keys: KeyRing = attrs.field(init=False)
    admission: Admission = attrs.field(init=False)
    draining: bool = attrs.field(default=False, init=False)
    _history: OrderedDict[str, _Record] = attrs.field(factory=OrderedDict, init=False)
    _history_candidates: int = attrs.field(default=0, init=False)
    _members: dict[str, frozenset[str]] = attrs.field(factory=dict, init=False)
    _pool_seen: list[str] = attrs.field(factory=list, init=False)
    _in_flight: int = attrs.field(default=0, init=False)
    # Made only when a drain waits: a new event per busy spell costs more than
    # the rest of enter() (anyio looks its backend up).
    _idle: anyio.Event | None = attrs.field(default=None, init=False)
    _streams: set[anyio.CancelScope] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        self.keys = KeyRing(self.config.keys)
        self.admission = Admission(
            self.config.admission, on_outcome=self._on_admission, evidence=self._evidence
        )
        self.router.hooks.on_first_token.append(self._on_first_token)
        self.router.hooks.on_complete.append(self._on_complete)

    def _evidence(self) -> int:
        # Moves whenever any instance's cache accepts a snapshot.
        r = self.router
        return sum(r.cache(n).version for n in r.instances)

    # -------------------------------------------------------------- state

    def reconfigure(self, config: GatewayConfig) -> None:
        """Take a reloaded configuration's keys, groups and admission rule.

        The pool itself is changed by the server (instances added, drained).

        Raises:
            ConfigError: The reload would leave no key where there were keys
                (nothing changes).
        """
        # Keys first: it is the one step that can refuse (switching authentication
        # off by a reload), and then nothing else may have changed.
        self.keys.replace(config.keys)
        if config.router != self.config.router:
            from bearsdk.selectors import make_selector

            self.router.selector = make_selector(
                config.router.selector, **dict(config.router.selector_params)
            )
        self.config = config
        self.admission.config = config.admission
        self._members.clear()
        self._pool_seen = []

    def members(self, model: str) -> frozenset[str] | None:
        """Instances a request naming ``model`` may go to (``None``: unknown name)."""
        pool = self.router.instances
        if pool != self._pool_seen:
            self._members.clear()
            self._pool_seen = pool
        got = self._members.get(model)
        if got is not None:
            return got
        configs = [self.router.instance_config(n) for n in pool]
        group = self.config.group(model)
        if group is None:
            group = GroupConfig(name=model, models=(model,))
        found = group.members(configs)
        if not found and self.config.group(model) is None:
            return None
        self._members[model] = found
        return found

    def served_models(self) -> list[str]:
        """Group names, then every model an instance serves."""
        pool = [self.router.instance_config(n) for n in self.router.instances]
        names = [g.name for g in self.config.groups]
        names += sorted({c.model for c in pool} - set(names))
        return names

    def record(
        self, d: Decision, key: KeySpec | None, model: str, tpot_target_s: float | None = None
    ) -> None:
        """Keep ``d`` for ``GET /bear/decisions/{id}`` (bounded, oldest out)."""
        limit = self.config.server.decision_history
        if limit <= 0:
            return
        old = self._history.pop(d.request_id, None)
        if old is not None:
            self._history_candidates -= len(old.decision.candidates)
        self._history[d.request_id] = _Record(
            d, None if key is None else key.name, model, tpot_target_s
        )
        self._history_candidates += len(d.candidates)
        # Bounded in memory too: a decision over a large pool holds hundreds of candidates.
        while len(self._history) > limit or self._history_candidates > _MAX_KEPT_CANDIDATES:
            _, gone = self._history.popitem(last=False)
            self._history_candidates -= len(gone.decision.candidates)

    def decision(self, request_id: str) -> _Record | None:
        """A kept decision."""
        return self._history.get(request_id)

    def _on_first_token(self, d: Decision, instance: str, observed: float) -> None:
        rec = self._history.get(d.request_id)
        if rec is not None:
            rec.ttft_s = observed
        m = self.metrics
        if m is not None:
            pair = m.pair(rec.model if rec is not None else "", _model_of(d, instance))
            pair.ttft.observe(observed)
            if observed > d.ttft_target_s:
                pair.slo_violations.inc()

    def _on_complete(self, d: Decision, instance: str, outcome: str) -> None:
        rec = self._history.get(d.request_id)
        if rec is not None:
            rec.outcome = outcome

    def _on_admission(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.admission.labels(outcome).inc()
            self.metrics.queue_depth.set(self.admission.held)

    # -------------------------------------------------------------- drain

    def enter(self) -> None:
        """A request started."""
        self._in_flight += 1
        if self.metrics is not None:
            self.metrics.in_flight.set(self._in_flight)

    def leave(self) -> None:
        """A request ended."""
        self._in_flight -= 1
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()
        if self.metrics is not None:
            self.metrics.in_flight.set(self._in_flight)

    @property
    def in_flight(self) -> int:
        """Requests being served."""
        return self._in_flight

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests; wait up to ``grace_s`` for those in flight.

        Streams still running then are ended with an in-band error event.

        Returns:
            How many requests had to be cut.
        """
        self.draining = True
        with anyio.move_on_after(grace_s):
            await self._until_idle()
        cut = len(self._streams)
        for scope in list(self._streams):
            scope.cancel()
        with anyio.move_on_after(5.0):
            await self._until_idle()
        return cut

    async def _until_idle(self) -> None:
        if self._in_flight == 0:
            return
        if self._idle is None or self._idle.is_set():
            self._idle = anyio.Event()
        await self._idle.wait()


def _model_of(d: Decision, instance: str) -> str:
    if instance == d.instance:  # (the chosen one, built already: not every candidate)
        return d.chosen.model
    return next((c.model for c in d.candidates if c.instance == instance), "")
