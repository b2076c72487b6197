"""AsyncRouter: the embedded router (BEAR and friends) over a pool of vLLM instances.

::

    async with AsyncRouter(pool, BEAR(lam=5e-4)) as router:
        decision = await router.route(prompt_or_messages, ttft_target=0.4)  # choose only
        stream = await router.chat(messages, ttft_target=0.4, stream=True)  # choose + dispatch
        async for chunk in stream:
            ...

AsyncRouter composes a :class:`~bearsdk.router.core.RouterCore` (the
synchronous decision and feedback), an instance runtime (``runtime.py``) and
dispatch (``dispatch.py``, ``stream.py``). ``async with`` owns an anyio task
group: one snapshot source per instance (push, poll, shared memory, or
``/metrics`` for unmodified vLLM) feeds that instance's
:class:`~bearsdk.state.SnapshotCache`; routing itself is synchronous CPU work on
the caller's event loop (predictors, then one TTFT estimate per instance, then
the policy). Dispatch streams the engine's SSE chunks to the caller as they
arrive, retries on the next-best instance when an instance fails before its
first byte, and feeds what it observes (TTFT, tokens, usage) back into the
estimators.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import aiohttp
import anyio
import anyio.abc

from bearsdk._lifecycle import Runs
from bearsdk.predictors.protocol import PoolPredictor
from bearsdk.router.breaker import BreakerState, CircuitBreaker
from bearsdk.router.config import ConfigError, InstanceConfig, load_pool_config
from bearsdk.router.core import DEFAULT_EXPLORATION, DEFAULT_SPEED, RouterCore
from bearsdk.router.decision import Decision
from bearsdk.router.dispatch import Dispatcher
from bearsdk.router.errors import (
    DispatchError,
    EngineRequestError,
    NoInstanceError,
    RequestError,
    short,
)
from bearsdk.router.explore import Exploration
from bearsdk.router.hooks import RouterHooks
from bearsdk.router.margin import TtftMargin
from bearsdk.router.runtime import InstanceRuntime
from bearsdk.router.slot import InstanceSlot
from bearsdk.router.sources import get_snapshot_source
from bearsdk.router.stream import ChatResponse, ChatStream
from bearsdk.router.targets import TargetRule
from bearsdk.selectors import Selector
from bearsdk.state import InstanceState, SnapshotCache, StalenessRules
from bearsdk.state.speed import SpeedTracker

if TYPE_CHECKING:
    from bearsdk.cluster import Cluster
    from bearsdk.io.base import SourceStats
    from bearsdk.io.hop import HopSession
    from bearsdk.prompts.tokenizer import ChatTokenizer

__all__ = [
    "AsyncRouter",
    "ChatResponse",
    "ChatStream",
    "DispatchError",
    "EngineRequestError",
    "NoInstanceError",
    "RequestError",
    "RouterHooks",
]

_UNSET: Any = object()


def _hop() -> HopSession | None:
    """The lean client for the engine hop, when ``httptools`` is installed."""
    # BEARSDK_HOP=aiohttp keeps aiohttp's client: to compare, or to rule the hop out.
    if os.environ.get("BEARSDK_HOP", "") == "aiohttp":
        return None
    try:
        from bearsdk.io.hop import HopSession
    except ImportError:
        return None
    return HopSession()


class AsyncRouter(Runs):
    """Routes each request to the best instance of a heterogeneous vLLM pool.

    Args:
        pool: Instances (:class:`~bearsdk.router.InstanceConfig` values), or the
            path of a TOML pool file; empty when every instance is added at run
            time (:meth:`add_instance`, a gateway's DNS discovery).
        selector: The selector (default :class:`~bearsdk.selectors.BEAR`);
            ``policy=`` is its old name (deprecated).
        predictor: Accuracy / length / cost predictor covering every instance's
            model (default: the shipped Qwen3 placeholder).
        targets: Rule giving a TTFT target to requests that carry none
            (default: the paper's appendix A.2 rule).
        staleness: How instances handle old snapshots (overlay, fast-forward,
            fallback to LPS).
        retries: Further instances tried when one fails before its first byte.
        clock: Time source (seconds); wall time, as engines stamp snapshots.
        session: An aiohttp session to reuse (default: the router's own). Without
            one, requests go to the engines by the router's lean HTTP/1.1 client
            when ``httptools`` is installed (:mod:`bearsdk.io.hop`, the
            ``gateway`` extra): about 0.1 ms less per request than aiohttp's
            (``BEARSDK_HOP=aiohttp`` in the environment keeps aiohttp's).
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
        speed: Learn each instance's speed from its snapshots (default
            settings: :data:`~bearsdk.router.core.DEFAULT_SPEED`; ``None``:
            replay the coefficients as they are). See ``docs/calibration.md``.
        margin: Widen each instance's TTFT estimates by its recent first
            tokens' spread (e.g. :data:`~bearsdk.router.margin.DEFAULT_MARGIN`;
            default ``None``: the point estimates as they are). See
            ``docs/calibration.md`` for what it buys and costs.
        explore: Bounded exploration of instances with no recent speed
            evidence (:class:`~bearsdk.router.Exploration`; ``None``: never).
        tokenizers: Per model (the pool's ``model`` names), its tokenizer: a
            :class:`~bearsdk.prompts.tokenizer.ChatTokenizer` or a model
            directory (``tokenizer.json`` and chat template; the
            ``tokenizers`` extra). Each request is then tokenized once per
            model as its engines do, and BEA replays every candidate with the
            prompt's exact length and block chain (the prefix the instance
            holds); see :mod:`bearsdk.router.prompts`.
        dispatch_prefixes: Estimate each prefix-caching instance's cached
            prefix from what the router sent there, where neither its KV events
            nor the prompt's token ids tell (approximate, by character blocks;
            :mod:`bearsdk.prompts.approx`).
        expect_arrivals: Add to each TTFT estimate the prefill that requests
            still to come will bring into the batch that completes the new
            request's prompt (:class:`~bearsdk.router.core.RouterCore`).
    """

    def __init__(
        self,
        pool: Sequence[InstanceConfig] | str | Path,
        selector: Selector | None = None,
        *,
        predictor: PoolPredictor | None = None,
        targets: TargetRule | None = None,
        staleness: StalenessRules | None = None,
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
        speed: SpeedTracker | None = DEFAULT_SPEED,
        margin: TtftMargin | None = None,
        explore: Exploration | None = DEFAULT_EXPLORATION,
        tokenizers: Mapping[str, ChatTokenizer | str | Path] | None = None,
        dispatch_prefixes: bool = False,
        expect_arrivals: bool = False,
        policy: Selector | None = _UNSET,
    ) -> None:
        if policy is not _UNSET:
            warnings.warn(
                "AsyncRouter(policy=...) is deprecated: pass selector=...",
                DeprecationWarning,
                stacklevel=2,
            )
            if selector is None:
                selector = policy
        if isinstance(idle_timeout_s, bool) or not (
            isinstance(idle_timeout_s, int | float)
            and math.isfinite(idle_timeout_s)
            and idle_timeout_s > 0
        ):
            raise ConfigError(
                f"idle_timeout_s must be a finite number > 0 (got {short(idle_timeout_s)})"
            )
        for field, size in (
            ("max_event_bytes", max_event_bytes),
            ("max_body_bytes", max_body_bytes),
        ):
            if isinstance(size, bool) or not isinstance(size, int) or size < 64:
                raise ConfigError(f"{field} must be an integer >= 64 (got {short(size)})")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 64:
            raise ConfigError(f"retries must be an integer in [0, 64] (got {short(retries)})")
        configs = load_pool_config(pool) if isinstance(pool, str | Path) else list(pool)
        self.cluster = cluster
        for cfg in configs:
            self._check_cluster(cfg)
        self.core = RouterCore(
            configs,
            selector,
            predictor=predictor,
            targets=targets,
            staleness=staleness,
            clock=clock,
            hooks=hooks,
            resident_lengths=resident_lengths,
            breaker=breaker,
            speed=speed,
            margin=margin,
            explore=explore,
            tokenizers=tokenizers,
            dispatch_prefixes=dispatch_prefixes,
            expect_arrivals=expect_arrivals,
        )
        self._dispatch = Dispatcher(
            self.core,
            retries=retries,
            idle_timeout_s=float(idle_timeout_s),
            max_event_bytes=max_event_bytes,
            max_body_bytes=max_body_bytes,
        )
        self._runtime = InstanceRuntime(self.core, calibrate=calibrate, cluster=cluster)
        self._session = session
        self._tg: anyio.abc.TaskGroup | None = None

    def _check_cluster(self, cfg: InstanceConfig) -> None:
        if get_snapshot_source(cfg.snapshots).needs_cluster and self.cluster is None:
            raise ConfigError(
                f"instance {cfg.name!r}: snapshots = {cfg.snapshots!r} needs a cluster "
                "(AsyncRouter(..., cluster=bearsdk.cluster.Cluster(...)))"
            )

    # ------------------------------------------------------------------ settings

    @property
    def selector(self) -> Selector:
        """The selector choosing among the candidates."""
        return self.core.selector

    @selector.setter
    def selector(self, value: Selector) -> None:
        self.core.selector = value

    @property
    def policy(self) -> Selector:
        """The selector (its old name)."""
        return self.core.selector

    @property
    def predictor(self) -> PoolPredictor:
        """The accuracy / length / cost predictor."""
        return self.core.predictor

    @property
    def targets(self) -> TargetRule:
        """The rule giving TTFT targets to requests that carry none."""
        return self.core.targets

    @property
    def staleness(self) -> StalenessRules:
        """How instances handle old snapshots."""
        return self.core.staleness

    @property
    def clock(self) -> Callable[[], float]:
        """The router's time source."""
        return self.core.clock

    @property
    def hooks(self) -> RouterHooks:
        """The observability callbacks."""
        return self.core.hooks

    @property
    def resident_lengths(self) -> str:
        """How BEA sizes the residents' outputs."""
        return self.core.resident_lengths

    @property
    def calibrate(self) -> bool:
        """Whether engines' batch records keep the coefficients calibrated."""
        return self._runtime.calibrate

    @property
    def retries(self) -> int:
        """Further instances tried when one fails before its first byte."""
        return self._dispatch.retries

    @property
    def idle_timeout_s(self) -> float:
        """Longest silence of an engine once its response head has arrived."""
        return self._dispatch.idle_timeout_s

    @property
    def max_event_bytes(self) -> int:
        """Largest SSE line or event of a streamed response."""
        return self._dispatch.max_event_bytes

    @property
    def max_body_bytes(self) -> int:
        """Largest whole response body."""
        return self._dispatch.max_body_bytes

    # ------------------------------------------------------------------ pool

    @property
    def instances(self) -> list[str]:
        """Names of the instances in the pool (draining ones included)."""
        return self.core.instances

    def instance_config(self, name: str) -> InstanceConfig:
        """The configuration of instance ``name``."""
        return self.core.slot(name).config

    def cache(self, name: str) -> SnapshotCache:
        """The snapshot cache of instance ``name`` (read-only use)."""
        return self.core.slot(name).cache

    def state(self, name: str) -> InstanceState:
        """The TTFT state of instance ``name``: extensions add dispatches the router
        did not make itself (another replica's) through its ``on_dispatch``,
        ``on_tokens`` and ``on_complete``."""
        return self.core.slot(name).state

    def _inst(self, name: str) -> InstanceSlot:
        return self.core.slot(name)

    async def add_instance(self, cfg: InstanceConfig) -> None:
        """Add an instance at run time; its snapshot source starts now."""
        self._check_cluster(cfg)
        slot = self.core.add(cfg)
        if self._tg is not None:
            await self._tg.start(self._runtime.run_instance, slot)

    def drain_instance(self, name: str) -> None:
        """Stop routing new requests to ``name``; requests in flight finish normally."""
        self.core.drain(name)

    def undrain_instance(self, name: str) -> None:
        """Route to ``name`` again."""
        self.core.drain(name, False)

    def source_stats(self, name: str) -> SourceStats | None:
        """Counters of ``name``'s snapshot source (``None`` while it is not running)."""
        return self._runtime.source_stats(name)

    def remove_instance(self, name: str) -> None:
        """Remove ``name`` from the pool: no new requests, its source stops.

        Streams in flight to it keep running until they end.
        """
        slot = self.core.remove(name)
        self._runtime.stop(slot.name)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run the sources (and the cluster) until cancelled; ``async with`` calls it.

        Ready once every source made its first attempt.
        """
        own = self._session is None
        session = self._session or aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        )
        self._dispatch.session = self._runtime.session = session
        self._dispatch.hop = self._runtime.hop = hop = _hop() if own else None
        try:
            async with anyio.create_task_group() as tg:
                if self.cluster is not None:
                    # Before the sources: Redis sources need the running bus.
                    await tg.start(self.cluster.run, self)
                for slot in self.core.slots():
                    await tg.start(self._runtime.run_instance, slot)
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            self._dispatch.session = self._runtime.session = None
            self._dispatch.hop = self._runtime.hop = None
            if own:
                # Shielded: a router left by a cancellation (Ctrl-C) must not leak
                # its session.
                with anyio.CancelScope(shield=True):
                    await session.close()
                    if hop is not None:
                        await hop.close()

    # ------------------------------------------------------------------ routing

    def decide(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        max_tokens: int | None = None,
        request_id: str | None = None,
        exclude: frozenset[str] = frozenset(),
        instances: Collection[str] | None = None,
        tpot_target: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Decision:
        """Choose an instance for a request (synchronous; no I/O).

        See :meth:`RouterCore.decide <bearsdk.router.core.RouterCore.decide>`.
        """
        return self.core.decide(
            prompt,
            ttft_target=ttft_target,
            max_tokens=max_tokens,
            request_id=request_id,
            exclude=exclude,
            instances=instances,
            tpot_target=tpot_target,
            prompt_token_ids=prompt_token_ids,
        )

    async def route(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        max_tokens: int | None = None,
        tpot_target: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Decision:
        """Choose an instance for a request without dispatching it (see :meth:`decide`)."""
        return self.core.decide(
            prompt,
            ttft_target=ttft_target,
            max_tokens=max_tokens,
            tpot_target=tpot_target,
            prompt_token_ids=prompt_token_ids,
        )

    # ------------------------------------------------------------------ dispatch

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = ...,
        tpot_target: float | None = ...,
        prompt_token_ids: Sequence[int] | None = ...,
        stream: Literal[True],
        timeout_s: float | None = ...,
        instances: Collection[str] | None = ...,
        decision: Decision | None = ...,
        **params: Any,
    ) -> ChatStream: ...

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = ...,
        tpot_target: float | None = ...,
        prompt_token_ids: Sequence[int] | None = ...,
        stream: Literal[False] = ...,
        timeout_s: float | None = ...,
        instances: Collection[str] | None = ...,
        decision: Decision | None = ...,
        **params: Any,
    ) -> ChatResponse: ...

    @overload
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = ...,
        tpot_target: float | None = ...,
        prompt_token_ids: Sequence[int] | None = ...,
        stream: bool = ...,
        timeout_s: float | None = ...,
        instances: Collection[str] | None = ...,
        decision: Decision | None = ...,
        **params: Any,
    ) -> ChatStream | ChatResponse: ...

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        tpot_target: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        stream: bool = False,
        timeout_s: float | None = None,
        instances: Collection[str] | None = None,
        decision: Decision | None = None,
        **params: Any,
    ) -> ChatStream | ChatResponse:
        """Route a chat request and send it (``/v1/chat/completions``).

        Args:
            messages: OpenAI chat messages.
            ttft_target: TTFT target, seconds (default: the target rule).
            tpot_target: Target mean time per output token after the first,
                seconds (default: none). BEAR then requires an instance
                predicted to meet both (BEA follows the first tokens too).
            prompt_token_ids: The prompt's token ids as the engines tokenize it
                (chat template applied): BEA prices each instance's cached
                prefix (see :meth:`RouterCore.decide
                <bearsdk.router.core.RouterCore.decide>`). Routing only: the
                engine gets the messages.
            stream: Stream the response: returns a :class:`ChatStream` yielding
                the engine's chunks as they arrive.
            timeout_s: This request's timeout, connect to last byte (default:
                the instance's ``timeout_s``). Running out before the response
                starts moves on to the next-best instance (the abandoned
                connection is closed, so the engine aborts its copy); after,
                it is a :class:`DispatchError`.
            instances: Route only among these instances (default: the whole
                pool): a model's instances, or a gateway's routing group.
            decision: Send as this decision says, made earlier by
                :meth:`decide` for this request (a gateway that admits on the
                prediction decides first); ``ttft_target``, ``tpot_target``,
                ``instances`` and the output cap are then the decision's.
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
            raise RequestError(f"messages must be a list of message objects (got {short(given)})")
        body = dict(params)
        body["messages"] = list(given)
        return await self._dispatch.send(
            "/v1/chat/completions",
            messages,
            body,
            ttft_target,
            stream,
            timeout_s,
            instances=instances,
            decision=decision,
            tpot_target=tpot_target,
            prompt_token_ids=prompt_token_ids,
        )

    @overload
    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = ...,
        tpot_target: float | None = ...,
        prompt_token_ids: Sequence[int] | None = ...,
        stream: Literal[True],
        timeout_s: float | None = ...,
        instances: Collection[str] | None = ...,
        decision: Decision | None = ...,
        **params: Any,
    ) -> ChatStream: ...

    @overload
    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = ...,
        tpot_target: float | None = ...,
        prompt_token_ids: Sequence[int] | None = ...,
        stream: Literal[False] = ...,
        timeout_s: float | None = ...,
        instances: Collection[str] | None = ...,
        decision: Decision | None = ...,
        **params: Any,
    ) -> ChatResponse: ...

    @overload
    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = ...,
        tpot_target: float | None = ...,
        prompt_token_ids: Sequence[int] | None = ...,
        stream: bool = ...,
        timeout_s: float | None = ...,
        instances: Collection[str] | None = ...,
        decision: Decision | None = ...,
        **params: Any,
    ) -> ChatStream | ChatResponse: ...

    async def completions(
        self,
        prompt: str,
        *,
        ttft_target: float | None = None,
        tpot_target: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        stream: bool = False,
        timeout_s: float | None = None,
        instances: Collection[str] | None = None,
        decision: Decision | None = None,
        **params: Any,
    ) -> ChatStream | ChatResponse:
        """Route a completion request and send it (``/v1/completions``); as :meth:`chat`."""
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string (got {short(prompt)})")
        body = dict(params)
        body["prompt"] = prompt
        return await self._dispatch.send(
            "/v1/completions",
            prompt,
            body,
            ttft_target,
            stream,
            timeout_s,
            instances=instances,
            decision=decision,
            tpot_target=tpot_target,
            prompt_token_ids=prompt_token_ids,
        )

    def _fallback_order(self, d: Decision) -> list[str]:
        return list(self._dispatch.fallback_order(d))

    # ------------------------------------------------------------------ feedback

    def record_dispatch(self, decision: Decision, instance: str | None = None) -> None:
        """Tell the router a request was sent (when something else than :meth:`chat`
        sends it); see :meth:`RouterCore.record_dispatch`."""
        self.core.record_dispatch(decision, instance)

    def record_first_token(self, decision: Decision, instance: str, ttft_s: float) -> None:
        """Tell the router the request's first token arrived after ``ttft_s`` seconds."""
        self.core.record_first_token(decision, instance, ttft_s)

    def record_complete(
        self,
        decision: Decision,
        instance: str,
        *,
        outcome: str = "ok",
        usage: Mapping[str, Any] | None = None,
        prompt: str = "",
    ) -> None:
        """Tell the router the request ended; see :meth:`RouterCore.record_complete`."""
        self.core.record_complete(decision, instance, outcome=outcome, usage=usage, prompt=prompt)

    def inflight(self, name: str) -> int:
        """Requests sent to ``name`` whose response has not ended (all finished: 0)."""
        return self.core.inflight(name)

    def breaker_state(self, name: str) -> BreakerState:
        """The state of ``name``'s circuit breaker now (closed, open or half-open)."""
        return self.core.breaker_state(name)

    def overhead(self, name: str) -> float:
        """The learned dispatch overhead added to ``name``'s replayed TTFTs now (seconds).

        See :meth:`RouterCore.overhead`: bounded by the fastest recent first
        token, fading while unconfirmed.
        """
        return self.core.overhead(name)

    def ttft_error(self, name: str) -> tuple[float, float, int]:
        """``(MAE seconds, MAPE, n)`` of the router's TTFT predictions at ``name`` so far."""
        return self.core.ttft_error(name)
