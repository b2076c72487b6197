"""AsyncRouter: the embedded router (BEAR and friends) over a pool of vLLM instances.

::

    async with AsyncRouter(pool, policy=BEAR(lam=5e-4)) as router:
        decision = await router.route(prompt_or_messages, ttft_target=0.4)  # choose only
        stream = await router.chat(messages, ttft_target=0.4, stream=True)  # choose + dispatch
        async for chunk in stream:
            ...

The router owns an anyio task group: one snapshot source per instance (push,
poll, shared memory, or ``/metrics`` for unmodified vLLM) feeds that instance's
:class:`~bearsdk.state.SnapshotCache`; routing itself is synchronous CPU work on
the caller's event loop (predictors, then one TTFT estimate per instance, then
the policy). Dispatch streams the engine's SSE chunks to the caller as they
arrive, retries on the next-best instance when an instance fails before its
first byte, and feeds what it observes (TTFT, tokens, usage) back into the
estimators.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import aiohttp
import anyio
import anyio.abc
import attrs
import orjson

from bearsdk.errors import BearError, short_repr
from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
from bearsdk.estimators.baselines import (
    LMDeployProxyEstimator,
    RouteBalanceEstimator,
    ScoreEstimator,
    SemanticRouterEstimator,
)
from bearsdk.estimators.batch_time import BatchDataError, OnlineBatchTime, read_batches
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.estimators.length import RememberedLengths
from bearsdk.estimators.lps import LPSEstimator
from bearsdk.estimators.prefill import PrefillThroughputEstimator, nominal_theta_pre
from bearsdk.estimators.stats import InstanceStats
from bearsdk.predictors import PoolPrediction, Predictor
from bearsdk.router.breaker import BreakerState, CircuitBreaker
from bearsdk.router.config import ConfigError, InstanceConfig, cover_models, load_pool_config
from bearsdk.router.decision import Candidate, Decision
from bearsdk.router.targets import PaperTargets, TargetRule
from bearsdk.schedulers import policy as bind_policy
from bearsdk.selectors import BEAR, Option, Selector
from bearsdk.state import InstanceState, ShadowView, SnapshotCache, StalenessPolicy

if TYPE_CHECKING:
    from bearsdk.cluster import Cluster

__all__ = [
    "AsyncRouter",
    "ChatStream",
    "DispatchError",
    "NoInstanceError",
    "RequestError",
    "RouterHooks",
]

log = logging.getLogger("bearsdk.router")

_MICRO = 1e6  # cost unit: micro-dollars (price per million tokens x tokens)
# A streamed response's head comes before generation starts: waiting longer than
# this for it means the engine is stuck, whatever the request's own budget.
_STREAM_HEAD_TIMEOUT_S = 30.0
# Output caps above this are no request's (and overflow the engines' int32 counts).
_MAX_TOKENS_LIMIT = 2**31 - 1


def _short(value: object) -> str:
    """A bounded ``repr`` for error messages (safe on huge or deeply nested values)."""
    return short_repr(value, 80)


class RequestError(BearError, ValueError):
    """A request argument is invalid; the message names the argument and its value."""


def _check_target(value: object) -> float | None:
    """``ttft_target``: seconds > 0 (``inf``: no target), or ``None`` for the rule's."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"ttft_target must be a number of seconds > 0 (got {_short(value)})")
    target = float(value)
    if not target > 0:  # NaN fails this too
        raise RequestError(f"ttft_target must be a number of seconds > 0 (got {_short(value)})")
    return target


def _check_max_tokens(name: str, value: object) -> int | None:
    if value is None:
        return None
    # numpy integers count too (numbers.Integral); bools do not.
    n = 0 if isinstance(value, bool) or not isinstance(value, numbers.Integral) else int(value)
    if not 1 <= n <= _MAX_TOKENS_LIMIT:
        raise RequestError(
            f"{name} must be an integer in [1, {_MAX_TOKENS_LIMIT}] (got {_short(value)})"
        )
    return n


def _check_timeout(value: object) -> float | None:
    if value is None:
        return None
    t = 0.0 if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)
    if not (math.isfinite(t) and t > 0):
        raise RequestError(f"timeout_s must be a finite number > 0 (got {_short(value)})")
    return t


class NoInstanceError(BearError, RuntimeError):
    """No instance can take the request (all drained, removed or circuit-broken)."""


class DispatchError(BearError, RuntimeError):
    """Every instance tried failed before answering, or the stream broke.

    Attributes:
        attempts: ``(instance, error)`` per attempt, in order.
        decision: The routing decision the first attempt followed.
    """

    def __init__(
        self, message: str, attempts: list[tuple[str, str]], decision: Decision | None
    ) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.decision = decision


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


@attrs.define
class _Instance:
    config: InstanceConfig
    model_index: int
    cache: SnapshotCache
    state: InstanceState
    stats: InstanceStats
    breaker: CircuitBreaker
    prefill: PrefillThroughputEstimator
    shadow: ShadowView | None = None
    online: OnlineBatchTime | None = None
    scope: anyio.CancelScope | None = None
    draining: bool = False
    inflight: int = 0
    ttft_abs_err_sum: float = 0.0
    ttft_rel_err_sum: float = 0.0
    ttft_err_n: int = 0
    # What the replay cannot see: the HTTP round trip to the engine, its request
    # handling and token delivery. Learned from observed minus predicted TTFT.
    overhead_s: float = 0.0
    residuals: deque[float] = attrs.Factory(lambda: deque(maxlen=64))

    @property
    def name(self) -> str:
        return self.config.name


_BASELINE_ESTIMATORS: dict[str, LatencyEstimator] = {
    "score": ScoreEstimator(),
    "routebalance": RouteBalanceEstimator(),
    "lmdeploy": LMDeployProxyEstimator(),
    "semantic-router": SemanticRouterEstimator(),
}


def _prompt_text(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """The text the predictors read: a prompt, or the messages' contents joined.

    Raises:
        RequestError: Not a string, nor a list of message objects.
    """
    if isinstance(prompt, str):
        return prompt
    given: object = prompt  # callers' types are not checked at run time
    if not isinstance(given, Sequence):
        raise RequestError(
            f"messages must be a list of message objects, or a prompt string (got {_short(prompt)})"
        )
    parts = []
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or "content" not in m:
            raise RequestError(
                f"messages[{i}] must be an object with a 'content' field (got {_short(m)})"
            )
        content = m["content"]
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # OpenAI content parts
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        elif content is not None:
            raise RequestError(
                f"messages[{i}].content must be a string or a list of parts (got {_short(content)})"
            )
    return "\n".join(parts)


class AsyncRouter:
    """Routes each request to the best instance of a heterogeneous vLLM pool.

    Args:
        pool: Instances (:class:`~bearsdk.router.InstanceConfig` values), or the
            path of a TOML pool file.
        policy: The selection policy (default :class:`~bearsdk.selectors.BEAR`).
        predictor: Accuracy / length / cost predictor covering every instance's
            model (default: the shipped Qwen3 placeholder).
        targets: Rule giving a TTFT target to requests that carry none
            (default: the paper's appendix A.2 rule).
        staleness: How instances handle old snapshots (overlay, fast-forward,
            fallback to LPS).
        retries: Further instances tried when one fails before its first byte.
        clock: Time source (seconds); wall time, as engines stamp snapshots.
        session: An aiohttp session to reuse (default: the router's own).
        hooks: Observability callbacks.
        calibrate: Follow each engine's ``/bear/batches`` stream and keep its
            batch-time coefficients calibrated online (engines without the
            endpoint keep their profile).
        cluster: Share state with other router replicas over Redis
            (:class:`bearsdk.cluster.Cluster`): instances with
            ``snapshots = "redis"`` read their snapshots from it, and the
            replicas see each other's dispatches.
        resident_lengths: How BEA sizes the requests resident on an engine:
            ``"predicted"``, each of the router's own at the length predicted
            for it (the rest at the mean of those); ``"calibrated"``, as
            quantiles of the lengths seen completing
            (:class:`~bearsdk.estimators.RememberedLengths`).
        breaker: The circuit breaker's settings; each instance gets its own
            breaker with them (default: :class:`CircuitBreaker`'s defaults).
        idle_timeout_s: Longest silence of an engine once its response head
            has arrived (between body bytes, between stream chunks): longer is
            a failure of the instance, and the request ends with a
            :class:`DispatchError`.
        max_event_bytes: Largest SSE line or event of a streamed response
            (larger: the stream is closed with a :class:`DispatchError`).
        max_body_bytes: Largest whole (not streamed) response body.
    """

    def __init__(
        self,
        pool: Sequence[InstanceConfig] | str | Path,
        policy: Selector | None = None,
        *,
        predictor: Predictor | None = None,
        targets: TargetRule | None = None,
        staleness: StalenessPolicy | None = None,
        retries: int = 2,
        clock: Callable[[], float] = time.time,
        session: aiohttp.ClientSession | None = None,
        hooks: RouterHooks | None = None,
        calibrate: bool = True,
        cluster: Cluster | None = None,
        resident_lengths: Literal["predicted", "calibrated"] = "predicted",
        breaker: CircuitBreaker | None = None,
        idle_timeout_s: float = 60.0,
        max_event_bytes: int = 1 << 20,
        max_body_bytes: int = 64 << 20,
    ) -> None:
        if isinstance(idle_timeout_s, bool) or not (
            isinstance(idle_timeout_s, int | float)
            and math.isfinite(idle_timeout_s)
            and idle_timeout_s > 0
        ):
            raise ConfigError(
                f"idle_timeout_s must be a finite number > 0 (got {_short(idle_timeout_s)})"
            )
        for field, size in (
            ("max_event_bytes", max_event_bytes),
            ("max_body_bytes", max_body_bytes),
        ):
            if isinstance(size, bool) or not isinstance(size, int) or size < 64:
                raise ConfigError(f"{field} must be an integer >= 64 (got {_short(size)})")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 64:
            raise ConfigError(f"retries must be an integer in [0, 64] (got {_short(retries)})")
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_event_bytes = max_event_bytes
        self.max_body_bytes = max_body_bytes
        self._breaker = breaker if breaker is not None else CircuitBreaker()
        configs = load_pool_config(pool) if isinstance(pool, str | Path) else list(pool)
        if not configs:
            raise ConfigError("pool: needs at least one instance")
        if resident_lengths not in ("predicted", "calibrated"):
            raise ConfigError(
                f"resident_lengths must be 'predicted' or 'calibrated' (got {resident_lengths!r})"
            )
        self.resident_lengths = resident_lengths
        self.cluster = cluster
        self.policy: Selector = policy if policy is not None else BEAR()
        self.predictor = predictor if predictor is not None else Predictor.load_default()
        self.targets: TargetRule = targets if targets is not None else PaperTargets()
        self.staleness = staleness if staleness is not None else StalenessPolicy()
        self.retries = retries
        self.clock = clock
        self.hooks = hooks if hooks is not None else RouterHooks()
        self.calibrate = calibrate
        self._own_session = session is None
        self._session = session
        self._tg: anyio.abc.TaskGroup | None = None
        self._instances: dict[str, _Instance] = {}
        self._lengths: dict[str, RememberedLengths] = {}
        self._models = list(self.predictor.models)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        for cfg in configs:
            self._add(cfg)

    # ------------------------------------------------------------------ pool

    def _add(self, cfg: InstanceConfig) -> _Instance:
        if cfg.name in self._instances:
            raise ConfigError(f"instance {cfg.name!r}: duplicate name")
        if cfg.snapshots == "redis" and self.cluster is None:
            raise ConfigError(
                f"instance {cfg.name!r}: snapshots = 'redis' needs a cluster "
                "(AsyncRouter(..., cluster=bearsdk.cluster.Cluster(...)))"
            )
        # A model the predictor was not trained on routes with the predictor's prior.
        self.predictor = cover_models(self.predictor, [cfg])
        self._models = list(self.predictor.models)
        try:
            idx = self._models.index(cfg.model)
        except ValueError:
            raise ConfigError(
                f"instance {cfg.name!r}: model {cfg.model!r} is not in the predictor's pool "
                f"({', '.join(self._models)})"
            ) from None
        bt = cfg.batch_time_model()
        lengths = self._lengths.setdefault(
            cfg.model, RememberedLengths(calibrate=self.resident_lengths == "calibrated")
        )
        pol = bind_policy(cfg.scheduler, cfg.params)
        est = BEAEstimator(pol, bt, lengths)
        cache = SnapshotCache(cfg.name, est, expect_instance=None, clock=self.clock)
        # The fallback knows the instance: its prefill rate and its sequence cap
        # (LPS's defaults are off by orders of magnitude for a real engine).
        lps = LPSEstimator(theta_pre=nominal_theta_pre(bt), concurrency=pol.max_seqs)
        state = InstanceState(cache, est, policy=self.staleness, name=cfg.name, fallback=lps)
        inst = _Instance(
            config=cfg,
            model_index=idx,
            cache=cache,
            state=state,
            stats=InstanceStats(),
            breaker=attrs.evolve(self._breaker),
            prefill=PrefillThroughputEstimator(theta_pre=nominal_theta_pre(bt)),
            # Unmodified vLLM: the router's own events, reconciled with /metrics.
            shadow=(
                ShadowView(cfg.name, clock=self.clock, prefill_tokens_per_s=nominal_theta_pre(bt))
                if cfg.snapshots == "metrics"
                else None
            ),
            online=OnlineBatchTime(bt) if self.calibrate else None,
        )
        self._instances[cfg.name] = inst
        return inst

    @property
    def instances(self) -> list[str]:
        """Names of the instances in the pool (draining ones included)."""
        return list(self._instances)

    def instance_config(self, name: str) -> InstanceConfig:
        """The configuration of instance ``name``."""
        return self._inst(name).config

    def cache(self, name: str) -> SnapshotCache:
        """The snapshot cache of instance ``name`` (read-only use)."""
        return self._inst(name).cache

    def state(self, name: str) -> InstanceState:
        """The TTFT state of instance ``name``: extensions add dispatches the router
        did not make itself (another replica's) through its ``on_dispatch``,
        ``on_tokens`` and ``on_complete``."""
        return self._inst(name).state

    def _inst(self, name: str) -> _Instance:
        try:
            return self._instances[name]
        except KeyError:
            raise BearError(
                f"instance {name!r} is not in the pool ({', '.join(self._instances)})"
            ) from None

    async def add_instance(self, cfg: InstanceConfig) -> None:
        """Add an instance at run time; its snapshot source starts now."""
        inst = self._add(cfg)
        if self._tg is not None:
            await self._tg.start(self._run_source, inst)

    def drain_instance(self, name: str) -> None:
        """Stop routing new requests to ``name``; requests in flight finish normally."""
        self._inst(name).draining = True

    def undrain_instance(self, name: str) -> None:
        """Route to ``name`` again."""
        self._inst(name).draining = False

    def remove_instance(self, name: str) -> None:
        """Remove ``name`` from the pool: no new requests, its source stops.

        Streams in flight to it keep running until they end.
        """
        inst = self._instances.pop(self._inst(name).name)
        if inst.scope is not None:
            inst.scope.cancel()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncRouter:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            if self.cluster is not None:
                # Before the sources: Redis sources need the running bus.
                await self._tg.start(self.cluster.run, self)
            for inst in list(self._instances.values()):
                await self._tg.start(self._run_source, inst)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        tg, self._tg = self._tg, None
        try:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
        finally:
            if self._own_session and self._session is not None:
                # Shielded, and even when closing the group raised: a router left
                # by a cancellation (Ctrl-C) must not leak its session.
                with anyio.CancelScope(shield=True):
                    await self._session.close()
                self._session = None

    async def _run_source(
        self, inst: _Instance, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        from bearsdk.io import MetricsSource, PollSource, PushSource, ShmSource, segment_path

        cfg = inst.config
        source: Any
        if cfg.snapshots == "push":
            source = PushSource(cfg.bear_url, session=self._session, name=f"push:{cfg.name}")
        elif cfg.snapshots == "poll":
            source = PollSource(
                cfg.bear_url,
                interval_s=cfg.poll_interval_s,
                session=self._session,
                name=f"poll:{cfg.name}",
            )
        elif cfg.snapshots == "shm":
            source = ShmSource(cfg.shm_name or segment_path(cfg.name), name=f"shm:{cfg.name}")
        elif cfg.snapshots == "redis":
            assert self.cluster is not None  # checked when the instance was added
            # The engine's own push stream stands in while Redis is unusable.
            direct = PushSource(cfg.bear_url, session=self._session, name=f"push:{cfg.name}")
            source = self.cluster.source(cfg.name, direct)
        else:
            assert inst.shadow is not None
            source = MetricsSource(
                cfg.url,
                inst.shadow,
                interval_s=max(cfg.poll_interval_s, 0.2),
                session=self._session,
                name=f"metrics:{cfg.name}",
            )
        with anyio.CancelScope() as scope:
            inst.scope = scope
            if inst.online is None:
                await source.run(inst.cache, task_status=task_status)
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._follow_batches, inst)
                await source.run(inst.cache, task_status=task_status)

    async def _follow_batches(self, inst: _Instance) -> None:
        """Online recalibration from the engine's batch records (``GET /bear/batches``)."""
        assert inst.online is not None
        assert self._session is not None
        url = inst.config.bear_url + "/bear/batches"
        failures = 0
        while True:
            try:
                async with self._session.get(
                    url, timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0)
                ) as resp:
                    if resp.status == 404:
                        log.info(
                            "%s: no /bear/batches: keeping the profile's coefficients", inst.name
                        )
                        return
                    resp.raise_for_status()
                    failures = 0
                    await self._consume_batches(inst, resp)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                failures += 1
                log.debug("%s: batch stream: %s", inst.name, exc)
            await anyio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)))

    async def _consume_batches(self, inst: _Instance, resp: aiohttp.ClientResponse) -> None:
        online = inst.online
        assert online is not None
        accepted = 0
        async for line in resp.content:
            line = line.strip()
            if not line:
                continue
            try:
                (obs,) = read_batches([line.decode("utf-8", "replace")])
            except (BatchDataError, ValueError):
                continue  # counted by the engine's format; never folded in
            if online.observe_batch(obs):
                accepted += 1
                if accepted % 32 == 0:
                    # Swapping the model swaps the coefficients the replay uses.
                    inst.state.estimator.batch_time = online.model

    # ------------------------------------------------------------------ routing

    def _next_id(self) -> str:
        # Fixed width: no id is a prefix of another (engines embed it in their own,
        # and the overlay matches a dispatch to a snapshot's id by containment).
        return f"bear-{self._prefix}-{next(self._ids):010d}"

    def decide(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        max_tokens: int | None = None,
        request_id: str | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        """Choose an instance for a request (synchronous; no I/O).

        Args:
            prompt: A prompt, or chat messages.
            ttft_target: The request's TTFT target in seconds, > 0 (default: the
                router's target rule; ``math.inf``: no target, every instance
                is on time).
            max_tokens: The request's output cap.
            request_id: Id to record (default: a fresh one).
            exclude: Instances not to consider.

        Returns:
            The decision, with every candidate's predictions.

        Raises:
            RequestError: ``ttft_target``, ``max_tokens`` or ``request_id`` is not
                a valid value, or ``prompt`` is neither a string nor messages.
            NoInstanceError: No instance can take the request.
        """
        t0 = time.perf_counter()
        ttft_target = _check_target(ttft_target)
        max_tokens = _check_max_tokens("max_tokens", max_tokens)
        if request_id is not None and not (
            isinstance(request_id, str) and 0 < len(request_id) <= 256
        ):
            raise RequestError(
                f"request_id must be a string of 1 to 256 characters (got {_short(request_id)})"
            )
        now = self.clock()
        pred = self.predictor.predict(_prompt_text(prompt), quantiles=False)
        insts = [
            i
            for i in self._instances.values()
            if not i.draining and i.name not in exclude and i.breaker.routable(now)
        ]
        if not insts:
            raise NoInstanceError(
                "no instance can take the request (all drained, removed or failing)"
            )
        prompt_tokens = int(pred.prompt_tokens[insts[0].model_index])
        target = self.targets.target_for(prompt_tokens) if ttft_target is None else ttft_target
        options, extra = self._options(insts, pred, max_tokens, now)
        sel = self.policy.select(options, target)
        chosen = insts[sel.index]
        cands = tuple(
            Candidate(
                instance=o.instance,
                model=o.model,
                accuracy=o.accuracy,
                cost=o.cost,
                utility=o.utility,
                ttft_s=o.ttft_s,
                feasible=None if sel.feasible is None else sel.feasible[i],
                score=sel.scores[i],
                estimator=extra[i][0],
                snapshot_age_s=extra[i][1],
                queue=o.queue,
                prompt_tokens=extra[i][2],
                output_tokens=extra[i][3],
            )
            for i, o in enumerate(options)
        )
        j = chosen.model_index
        d = Decision(
            request_id=request_id or self._next_id(),
            policy=self.policy.name,
            instance=chosen.name,
            candidates=cands,
            index=sel.index,
            ttft_target_s=target,
            reason=sel.reason,
            prompt_tokens=int(pred.prompt_tokens[j]),
            output_tokens=int(pred.output_tokens[j]),
            decided_at=now,
            decide_s=time.perf_counter() - t0,
        )
        for hook in self.hooks.on_decision:
            hook(d)
        return d

    def _options(
        self, insts: list[_Instance], pred: PoolPrediction, max_tokens: int | None, now: float
    ) -> tuple[list[Option], list[tuple[str, float, int, int]]]:
        lam = self.policy.lam
        kind = self.policy.latency
        options: list[Option] = []
        extra: list[tuple[str, float, int, int]] = []
        # Plain lists: indexing numpy arrays element by element costs more.
        accs, outs = pred.accuracy.tolist(), pred.output_tokens.tolist()
        ptoks, costs = pred.prompt_tokens.tolist(), pred.cost_usd.tolist()
        for inst in insts:
            j = inst.model_index
            acc = accs[j]
            out = int(outs[j])
            if max_tokens is not None:
                out = min(out, max_tokens)
            ptok = max(1, int(ptoks[j]))
            cost = costs[j] * _MICRO
            queue = inst.inflight
            age = inst.cache.age(now)
            if kind == "bea":
                # The router's statistics only matter to the fallback estimator:
                # summarise them only when the snapshot cannot be replayed.
                view = self._view(inst, now) if age > self.staleness.fallback_after_s else None
                e = inst.state.ttft(ptok, out, max_tokens, now=now, view=view)
                ttft, est_name, age = e.ttft_s, "lps" if e.mode == "fallback" else e.mode, e.age_s
                if est_name != "lps":
                    ttft += inst.overhead_s
            elif kind == "none":
                ttft, est_name = math.nan, "none"
            else:
                est = inst.prefill if kind == "prefill-tps" else _BASELINE_ESTIMATORS[kind]
                ttft = est.estimate_ttft(RequestInfo(ptok, out, max_tokens), self._view(inst, now))
                est_name = kind
            options.append(
                Option(
                    inst.name,
                    inst.config.model,
                    acc,
                    cost,
                    acc - lam * cost,
                    ttft,
                    queue,
                    inst.inflight,
                )
            )
            extra.append((est_name, age, ptok, out))
        return options, extra

    def _view(self, inst: _Instance, now: float) -> InstanceView:
        entry = inst.cache.entry
        return inst.stats.view(
            now,
            snapshot=None if entry is None else entry.snapshot,
            snapshot_time=None if entry is None else entry.captured,
            name=inst.name,
        )

    async def route(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        max_tokens: int | None = None,
    ) -> Decision:
        """Choose an instance for a request without dispatching it (see :meth:`decide`)."""
        return self.decide(prompt, ttft_target=ttft_target, max_tokens=max_tokens)

    # ------------------------------------------------------------------ dispatch

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = ...,
        stream: Literal[True],
        timeout_s: float | None = ...,
        **params: Any,
    ) -> ChatStream: ...

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = ...,
        stream: Literal[False] = ...,
        timeout_s: float | None = ...,
        **params: Any,
    ) -> ChatResponse: ...

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = ...,
        stream: bool = ...,
        timeout_s: float | None = ...,
        **params: Any,
    ) -> ChatStream | ChatResponse: ...

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        stream: bool = False,
        timeout_s: float | None = None,
        **params: Any,
    ) -> ChatStream | ChatResponse:
        """Route a chat request and send it (``/v1/chat/completions``).

        Args:
            messages: OpenAI chat messages.
            ttft_target: TTFT target, seconds (default: the target rule).
            stream: Stream the response: returns a :class:`ChatStream` yielding
                the engine's chunks as they arrive.
            timeout_s: This request's timeout, connect to last byte (default:
                the instance's ``timeout_s``). Running out before the response
                starts moves on to the next-best instance (the abandoned
                connection is closed, so the engine aborts its copy); after,
                it is a :class:`DispatchError`.
            **params: Other OpenAI parameters (``max_tokens``, ``temperature``,
                ``stop``...), passed through; ``model`` is set per instance.

        Returns:
            The stream, or the engine's JSON response as a :class:`ChatResponse`
            (a dict that also says which instance answered).

        Raises:
            NoInstanceError: No instance can take it.
            DispatchError: Every instance tried failed before answering.
        """
        given: object = messages  # callers' types are not checked at run time
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise RequestError(f"messages must be a list of message objects (got {_short(given)})")
        body = dict(params)
        body["messages"] = list(given)
        return await self._send(
            "/v1/chat/completions", messages, body, ttft_target, stream, timeout_s
        )

    @overload
    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = ...,
        stream: Literal[True],
        timeout_s: float | None = ...,
        **params: Any,
    ) -> ChatStream: ...

    @overload
    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = ...,
        stream: Literal[False] = ...,
        timeout_s: float | None = ...,
        **params: Any,
    ) -> ChatResponse: ...

    @overload
    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = ...,
        stream: bool = ...,
        timeout_s: float | None = ...,
        **params: Any,
    ) -> ChatStream | ChatResponse: ...

    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = None,
        stream: bool = False,
        timeout_s: float | None = None,
        **params: Any,
    ) -> ChatStream | ChatResponse:
        """Route a completion request and send it (``/v1/completions``); as :meth:`chat`."""
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string (got {_short(prompt)})")
        body = dict(params)
        body["prompt"] = prompt
        return await self._send("/v1/completions", prompt, body, ttft_target, stream, timeout_s)

    async def _send(
        self,
        path: str,
        prompt: str | Sequence[Mapping[str, Any]],
        body: dict[str, Any],
        ttft_target: float | None,
        stream: bool,
        timeout_s: float | None = None,
    ) -> ChatStream | ChatResponse:
        if self._session is None:
            raise BearError("AsyncRouter is not started: use 'async with AsyncRouter(...)'")
        max_tokens = _check_max_tokens("max_tokens", body.get("max_tokens"))
        max_completion = _check_max_tokens(
            "max_completion_tokens", body.get("max_completion_tokens")
        )
        timeout_s = _check_timeout(timeout_s)
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be True or False (got {_short(stream)})")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, Mapping):
            raise RequestError(f"stream_options must be an object (got {_short(options)})")
        try:
            orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:  # caught here, not once per instance tried
            raise RequestError(f"the request's parameters are not JSON: {exc}") from None
        text = _prompt_text(prompt)
        decision = self.decide(
            prompt, ttft_target=ttft_target, max_tokens=max_tokens or max_completion
        )
        caller_usage = bool((options or {}).get("include_usage"))
        body["stream"] = stream
        if stream:
            # Usage feeds calibration; the caller sees it only if it asked.
            body["stream_options"] = {**(options or {}), "include_usage": True}
        attempts: list[tuple[str, str]] = []
        for name in self._fallback_order(decision):
            if len(attempts) > self.retries:
                break
            inst = self._instances.get(name)
            if inst is None or inst.draining:
                continue
            if not inst.breaker.allows(self.clock()):
                continue
            try:
                resp, sent_at = await self._post(inst, path, body, decision, timeout_s, stream)
            except _Retryable as exc:
                attempts.append((name, exc.why))
                self._failed(inst, decision, exc.why, fault=exc.fault)
                continue
            if stream:
                return ChatStream(
                    self, inst, decision, resp, sent_at, caller_usage, text, timeout_s is not None
                )
            return await self._read_whole(inst, decision, resp, sent_at, text, timeout_s)
        raise DispatchError(
            f"request {decision.request_id}: every instance tried failed "
            f"({'; '.join(f'{n}: {e}' for n, e in attempts) or 'none routable'})",
            attempts,
            decision,
        )

    def _fallback_order(self, d: Decision) -> list[str]:
        """The chosen instance, then the others best first by the policy's scores.

        Every one is listed: :meth:`_send` stops after ``retries`` further
        attempts, so instances that cannot be tried (drained, removed, circuit
        broken) do not use up the retries.
        """
        rest = sorted(
            (i for i in range(len(d.candidates)) if i != d.index),
            key=lambda i: (
                -d.candidates[i].score if not math.isnan(d.candidates[i].score) else math.inf
            ),
        )
        return [d.instance, *(d.candidates[i].instance for i in rest)]

    async def _post(
        self,
        inst: _Instance,
        path: str,
        body: dict[str, Any],
        d: Decision,
        timeout_s: float | None = None,
        stream: bool = True,
    ) -> tuple[aiohttp.ClientResponse, float]:
        assert self._session is not None
        cfg = inst.config
        total = cfg.timeout_s if timeout_s is None else timeout_s
        # A whole response's head comes only once it is generated: the request's
        # budget bounds it; a stream's head must come soon after sending.
        head = min(total, _STREAM_HEAD_TIMEOUT_S) if stream else total
        body["model"] = cfg.engine_model
        now = self.clock()
        inst.breaker.on_send(now)
        self._dispatched(inst, d, now)
        try:
            try:
                with anyio.fail_after(head):
                    resp = await self._session.post(
                        cfg.url + path,
                        data=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                        headers={"Content-Type": "application/json", "X-Request-Id": d.request_id},
                        timeout=aiohttp.ClientTimeout(total=total),
                    )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # The caller's own budget running out says nothing about the
                # instance (a 1 ns deadline must not open every breaker); a
                # connect timeout or a stuck stream head does.
                callers = (
                    timeout_s is not None
                    and head == total
                    and isinstance(exc, TimeoutError)
                    and not isinstance(exc, aiohttp.ServerTimeoutError)
                )
                raise _Retryable(
                    f"the request's timeout_s ({total:g} s) ran out before the response"
                    if callers
                    else f"{type(exc).__name__}: {_exc_text(exc)}",
                    fault=not callers,
                ) from None
            if resp.status >= 400:
                try:
                    with anyio.move_on_after(min(self.idle_timeout_s, 5.0)):
                        raw = await resp.content.read(64 << 10)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    raw = b""
                finally:
                    resp.close()
                text = raw.decode("utf-8", "replace")
                if resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status}: {text[:200]}")
                # The request itself is bad: another instance would refuse it too.
                self._undispatched(inst, d)
                inst.breaker.on_success()
                raise EngineRequestError(resp.status, text, d)
        except _Retryable:
            self._undispatched(inst, d)
            raise
        except EngineRequestError:
            raise
        except BaseException:
            # Cancelled (or a bug) while sending: the request is off the books,
            # and a probe slot it held is free for the next request.
            self._undispatched(inst, d)
            inst.breaker.on_abandon()
            raise
        return resp, now

    async def _read_whole(
        self,
        inst: _Instance,
        d: Decision,
        resp: aiohttp.ClientResponse,
        sent_at: float,
        text: str,
        timeout_s: float | None,
    ) -> ChatResponse:
        try:
            raw = await _read_body(resp, self.max_body_bytes, self.idle_timeout_s)
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise _BodyError(f"the response is not JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise _BodyError(f"the response is not a JSON object (got {_short(doc)})")
        except (
            _BodyError,
            aiohttp.ClientError,
            OSError,
            TimeoutError,
            orjson.JSONDecodeError,
        ) as exc:
            resp.close()
            self._complete(inst, d, "error", None, text)
            callers = (
                timeout_s is not None
                and isinstance(exc, TimeoutError)
                and not isinstance(exc, aiohttp.ServerTimeoutError)
            )
            why = (
                exc.why
                if isinstance(exc, _BodyError)
                else f"the request's timeout_s ({timeout_s:g} s) ran out"
                if callers and timeout_s is not None
                else f"{type(exc).__name__}: {_exc_text(exc)}"
            )
            if callers:
                inst.breaker.on_abandon()
            else:
                self._failed(inst, d, why, before_head=False)
            raise DispatchError(
                f"request {d.request_id}: {inst.name}: {why}", [(inst.name, why)], d
            ) from None
        except BaseException:
            resp.close()
            self._complete(inst, d, "cancelled", None, text)
            inst.breaker.on_abandon()
            raise
        resp.release()
        result = ChatResponse(doc)
        result.decision, result.instance = d, inst.name
        result.latency_s = self.clock() - sent_at
        # No first token was seen, only the whole answer: it teaches nothing about TTFT.
        inst.breaker.on_success()
        usage = result.get("usage")
        self._complete(inst, d, "ok", usage if isinstance(usage, Mapping) else None, text)
        return result

    # ------------------------------------------------------------------ feedback

    def _dispatched(self, inst: _Instance, d: Decision, now: float) -> None:
        c = next(c for c in d.candidates if c.instance == inst.name)
        inst.inflight += 1
        inst.state.on_dispatch(d.request_id, c.prompt_tokens, c.output_tokens, now=now)
        if inst.shadow is not None:
            inst.shadow.on_dispatch(d.request_id, c.prompt_tokens, output_len=c.output_tokens)
        inst.stats.on_dispatch(d.request_id, now, c.prompt_tokens, c.output_tokens)
        for hook in self.hooks.on_dispatch:
            hook(d, inst.name, now)

    def _undispatched(self, inst: _Instance, d: Decision) -> None:
        inst.inflight -= 1
        now = self.clock()
        inst.state.on_complete(d.request_id, now=now)
        inst.stats.on_abort(d.request_id, now)
        if inst.shadow is not None:
            inst.shadow.on_complete(d.request_id)

    def _failed(
        self,
        inst: _Instance,
        d: Decision,
        why: str,
        *,
        fault: bool = True,
        before_head: bool = True,
    ) -> None:
        if fault:
            inst.breaker.on_failure(self.clock())
        else:
            inst.breaker.on_abandon()
        when = "before answering" if before_head else "while answering"
        log.warning("request %s: %s failed %s: %s", d.request_id, inst.name, when, why)
        if before_head:
            for hook in self.hooks.on_failure:
                hook(d, inst.name, why)

    def _first_token(self, inst: _Instance, d: Decision, observed: float) -> None:
        now = self.clock()
        inst.breaker.on_answer()
        inst.state.on_tokens(d.request_id, 1)
        inst.stats.on_first_token(d.request_id, now)
        if inst.shadow is not None:
            inst.shadow.on_tokens(d.request_id, 1)
        if inst.name == d.instance:
            pred = d.chosen.ttft_s
            if math.isfinite(pred) and observed > 0:
                inst.ttft_abs_err_sum += abs(pred - observed)
                inst.ttft_rel_err_sum += abs(pred - observed) / observed
                inst.ttft_err_n += 1
                if d.chosen.estimator != "lps":
                    # The median of recent residuals: a mean would be dragged up by
                    # requests that reach the engine just after it formed the next
                    # batch (a whole batch late) and overpredict everything else.
                    inst.residuals.append(observed - (pred - inst.overhead_s))
                    inst.overhead_s = min(max(statistics.median(inst.residuals), 0.0), 0.25)
        for hook in self.hooks.on_first_token:
            hook(d, inst.name, observed)

    def _complete(
        self,
        inst: _Instance,
        d: Decision,
        outcome: str,
        usage: Mapping[str, Any] | None,
        prompt_text: str,
    ) -> None:
        now = self.clock()
        inst.inflight -= 1
        out = None if not usage else usage.get("completion_tokens")
        known = out if outcome == "ok" and isinstance(out, int) and out > 0 else None
        inst.state.on_complete(d.request_id, now=now, output_tokens=known)
        if inst.shadow is not None:
            inst.shadow.on_complete(d.request_id)
        if usage:
            ptok = usage.get("prompt_tokens")
            if isinstance(ptok, int) and ptok > 0 and prompt_text:
                # The engine's count teaches the predictor this model's tokens per char.
                self.predictor.observe_usage(inst.config.model, prompt_text, ptok)
        if outcome == "ok":
            inst.stats.on_complete(
                d.request_id, now, out if isinstance(out, int) and out > 0 else None
            )
        else:
            inst.stats.on_abort(d.request_id, now)
        for hook in self.hooks.on_complete:
            hook(d, inst.name, outcome)

    # ------------------------------------------------------------------ offline use

    def record_dispatch(self, decision: Decision, instance: str | None = None) -> None:
        """Tell the router a request was sent (when something else than :meth:`chat`
        sends it: a simulator, or an application with its own HTTP client).

        Args:
            decision: The decision the request followed.
            instance: Where it went (default: the decision's instance).
        """
        self._dispatched(self._inst(instance or decision.instance), decision, self.clock())

    def record_first_token(self, decision: Decision, instance: str, ttft_s: float) -> None:
        """Tell the router the request's first token arrived after ``ttft_s`` seconds."""
        self._first_token(self._inst(instance), decision, ttft_s)

    def record_complete(
        self,
        decision: Decision,
        instance: str,
        *,
        outcome: str = "ok",
        usage: Mapping[str, Any] | None = None,
        prompt: str = "",
    ) -> None:
        """Tell the router the request ended (``"ok"``, ``"error"`` or ``"cancelled"``).

        Args:
            decision: Its decision.
            instance: Where it ran.
            outcome: How it ended.
            usage: The engine's usage report, if any (teaches token counts).
            prompt: Its prompt text (with ``usage``, teaches token counts).
        """
        if outcome not in ("ok", "error", "cancelled"):
            raise BearError(f"outcome must be 'ok', 'error' or 'cancelled' (got {outcome!r})")
        self._complete(self._inst(instance), decision, outcome, usage, prompt)

    def inflight(self, name: str) -> int:
        """Requests sent to ``name`` whose response has not ended (all finished: 0)."""
        return self._inst(name).inflight

    def breaker_state(self, name: str) -> BreakerState:
        """The state of ``name``'s circuit breaker now (closed, open or half-open)."""
        return self._inst(name).breaker.state(self.clock())

    def overhead(self, name: str) -> float:
        """The learned dispatch overhead added to ``name``'s replayed TTFTs (seconds)."""
        return self._inst(name).overhead_s

    def ttft_error(self, name: str) -> tuple[float, float, int]:
        """``(MAE seconds, MAPE, n)`` of the router's TTFT predictions at ``name`` so far."""
        inst = self._inst(name)
        n = inst.ttft_err_n
        if n == 0:
            return (math.nan, math.nan, 0)
        return (inst.ttft_abs_err_sum / n, inst.ttft_rel_err_sum / n, n)


class _Retryable(Exception):
    """An attempt failed before the response head: the next instance is tried.

    ``fault``: the instance is to blame (counts against its breaker).
    """

    def __init__(self, why: str, *, fault: bool = True) -> None:
        super().__init__(why)
        self.why = why
        self.fault = fault


class _BodyError(Exception):
    """A response body that breaks the protocol (too large, not JSON)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _exc_text(exc: BaseException) -> str:
    text = str(exc) or "no details"
    return text if len(text) <= 200 else text[:200] + "..."


async def _read_body(resp: aiohttp.ClientResponse, limit: int, idle_s: float) -> bytes:
    """The whole body, at most ``limit`` bytes, with at most ``idle_s`` between pieces."""
    parts: list[bytes] = []
    size = 0
    while True:
        with anyio.move_on_after(idle_s) as scope:
            piece = await resp.content.readany()
        if scope.cancelled_caught:
            raise _BodyError(f"the body stalled for {idle_s:g} s (idle_timeout_s)")
        if not piece:
            return b"".join(parts)
        size += len(piece)
        if size > limit:
            raise _BodyError(f"the body is larger than {limit} bytes (max_body_bytes)")
        parts.append(piece)


class EngineRequestError(BearError, RuntimeError):
    """The engine refused the request (HTTP 4xx): it is not retried elsewhere.

    Attributes:
        status: The HTTP status.
        body: The engine's error body.
        decision: The routing decision.
    """

    def __init__(self, status: int, body: str, decision: Decision) -> None:
        super().__init__(
            f"request {decision.request_id}: {decision.instance} answered {status}: {body[:300]}"
        )
        self.status = status
        self.body = body
        self.decision = decision


class ChatResponse(dict[str, Any]):
    """A whole (not streamed) response: the engine's JSON object, as a dict.

    Attributes:
        decision: The routing decision.
        instance: The instance that answered (after retries, maybe not the
            decision's first choice).
        latency_s: Time from sending to the whole answer.
    """

    decision: Decision
    instance: str
    latency_s: float


class ChatStream:
    """A streamed response: the engine's chunks, as they arrive.

    Iterate it (``async for chunk in stream``) for parsed chunk objects, or
    :meth:`raw` for the SSE bytes as the engine sent them (proxies). Closing it
    early (``await stream.aclose()``, or leaving ``async with``) closes the
    connection, which aborts the request at the engine. A stream that breaks,
    stalls longer than the router's ``idle_timeout_s``, sends an event that is
    not a JSON object or one larger than ``max_event_bytes`` raises
    :class:`DispatchError`; the connection is closed and the request ends.

    Attributes:
        decision: The routing decision.
        instance: The instance answering.
        ttft_s: Observed time to the first chunk, once it arrived.
        usage: The engine's usage report, once it arrived.
    """

    def __init__(
        self,
        router: AsyncRouter,
        inst: _Instance,
        decision: Decision,
        resp: aiohttp.ClientResponse,
        sent_at: float,
        caller_usage: bool,
        prompt_text: str = "",
        caller_deadline: bool = False,
    ) -> None:
        self._router = router
        self._prompt_text = prompt_text
        self._inst = inst
        self.decision = decision
        self.instance = inst.name
        self._resp = resp
        self._sent_at = sent_at
        self._caller_usage = caller_usage
        self._caller_deadline = caller_deadline
        self.ttft_s: float | None = None
        self.usage: dict[str, Any] | None = None
        self._tokens = 0
        self._done = False
        self._eof = False
        # Incremental SSE parsing: bytes not yet consumed, from where the line
        # search resumes (each byte is searched once, whatever the pieces' sizes).
        self._buf = bytearray()
        self._scan = 0
        self._data: list[bytes] = []  # the current event's data lines
        self._event_size = 0
        self._limit = router.max_event_bytes
        self._idle_s = router.idle_timeout_s
        # Parsed-out events not yet handed over: (data, object). The stream is its
        # own iterator (no async-generator layers): a chunk costs a few microseconds.
        self._ready: deque[tuple[bytes, dict[str, Any]]] = deque()

    async def __aenter__(self) -> ChatStream:
        return self

    def __del__(self) -> None:
        # Dropped unread and unclosed: take the request off the books (and free a
        # probe slot) rather than count it in flight for ever.
        if not self._done:
            self._inst.breaker.on_abandon()
            self._finish("cancelled")
            self._resp.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading; the engine aborts the request when the connection closes."""
        if not self._done:
            self._inst.breaker.on_abandon()
            self._finish("cancelled")
        self._eof = True
        self._ready.clear()
        self._resp.close()

    def _finish(self, outcome: str) -> None:
        if not self._done:
            self._done = True
            self._router._complete(
                self._inst, self.decision, outcome, self.usage, self._prompt_text
            )

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            event = await self._next_event()
            if event is None:
                raise StopAsyncIteration
            if self._hidden(event[1]):
                continue
            return event[1]

    def _hidden(self, doc: dict[str, Any]) -> bool:
        """The usage chunk the router asked for on its own behalf."""
        return not self._caller_usage and not doc.get("choices") and doc.get("usage") is not None

    async def raw(self) -> AsyncIterator[bytes]:
        """The SSE events as the engine sent them (``data: ...\\n\\n``)."""
        while True:
            event = await self._next_event()
            if event is None:
                break
            data, doc = event
            if self._hidden(doc):
                continue
            if b"\n" in data:  # a multi-line event: one line for the proxy's clients
                data = orjson.dumps(doc)
            yield b"data: " + data + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def _next_event(self) -> tuple[bytes, dict[str, Any]] | None:
        """The next event, or ``None`` at the end of the stream."""
        while not self._ready:
            if self._eof:
                return None
            try:
                with anyio.move_on_after(self._idle_s) as idle:
                    piece = await self._resp.content.readany()
                if idle.cancelled_caught:
                    self._fail(f"stalled for {self._idle_s:g} s (idle_timeout_s)")
                if not piece:  # the engine closed the stream without [DONE]
                    self._end()
                    return None
                self._parse(piece)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # A timeout here is the request's total budget; the caller's own
                # budget is not the instance's fault.
                fault = not (
                    self._caller_deadline
                    and isinstance(exc, TimeoutError)
                    and not isinstance(exc, aiohttp.ServerTimeoutError)
                )
                why = "the request's timeout_s ran out" if not fault else ""
                self._fail(why or f"{type(exc).__name__}: {_exc_text(exc)}", fault=fault)
            except DispatchError:
                raise
            except BaseException:
                # Cancelled while waiting: the caller gave up on the request.
                self._eof = True
                self._inst.breaker.on_abandon()
                self._finish("cancelled")
                self._resp.close()
                raise
        return self._ready.popleft()

    def _fail(self, why: str, *, fault: bool = True) -> None:
        """End the stream on the instance's failure: close it, complete, raise."""
        self._eof = True
        self._ready.clear()
        self._resp.close()
        if fault:
            self._router._failed(self._inst, self.decision, why, before_head=False)
        else:
            self._inst.breaker.on_abandon()
        self._finish("error")
        raise DispatchError(
            f"request {self.decision.request_id}: stream from {self.instance} broke: {why}",
            [(self.instance, why)],
            self.decision,
        )

    def _parse(self, piece: bytes) -> None:
        buf = self._buf
        buf += piece
        pos = 0
        while True:
            nl = buf.find(b"\n", self._scan)
            if nl < 0:
                break
            end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl  # CRLF
            start, pos = pos, nl + 1
            self._scan = pos
            if end == start:
                if self._data and self._dispatch():
                    return
            elif buf.startswith(b"data:", start):
                start += 6 if buf.startswith(b"data: ", start) else 5
                self._event_size += end - start + 1
                if self._event_size > self._limit:
                    self._fail(f"an event is larger than {self._limit} bytes (max_event_bytes)")
                with memoryview(buf) as view:  # one copy of the payload, not three
                    self._data.append(bytes(view[start:end]))
            # Other fields (event:, id:, retry:) and comments carry nothing here.
        if pos:
            del buf[:pos]
            self._scan -= pos
        self._scan = len(buf)
        if len(buf) > self._limit:
            self._fail(f"a line is longer than {self._limit} bytes (max_event_bytes)")

    def _dispatch(self) -> bool:
        """Hand over the event just ended; True at ``[DONE]``."""
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        self._data = []
        self._event_size = 0
        if data == b"[DONE]":
            self._buf.clear()
            self._scan = 0
            self._end()
            return True
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            self._fail(f"an event is not a JSON object (got {_short(data[:80])})")
        self._observe(doc)
        self._ready.append((data, doc))
        return False

    def _end(self) -> None:
        self._eof = True
        if not self._done:
            self._inst.breaker.on_success()
        self._finish("ok")
        self._resp.release()

    def _observe(self, doc: dict[str, Any]) -> None:
        if self.ttft_s is None:
            self.ttft_s = self._router.clock() - self._sent_at
            self._router._first_token(self._inst, self.decision, self.ttft_s)
        usage = doc.get("usage")
        if usage and isinstance(usage, dict):
            self.usage = usage
        self._tokens += 1
