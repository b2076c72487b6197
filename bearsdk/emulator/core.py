"""The emulated engine's core: vLLM's engine-core loop, run in real time on a ground-truth clock.

A :class:`~bearsdk.replay.SchedulerCore` bound to a registered policy (``vllm-v1``
by default) forms every batch; :class:`~bearsdk.emulator.timing.GroundTruthTimeModel`
says how long the batch runs on the emulated GPU, and the loop sleeps until then,
so tokens reach their :class:`~bearsdk.emulator.requests.RequestHandle` when the
batch completes. :class:`EngineCore` is the engine alone (scheduling, timing,
snapshots, metrics, faults), with no HTTP: :class:`~bearsdk.emulator.EmulatedEngine`
serves it over vLLM's API (``server.py`` is built around it).

With asynchronous scheduling (vLLM's default) the loop mirrors ``EngineCore``'s
batch queue: batch ``k + 1`` is scheduled, with placeholders for batch ``k``'s
tokens, while batch ``k`` still runs, and batch ``k``'s outputs are processed
when it completes. The emulator schedules batch ``k + 1`` *just in time*
(``schedule_lead_s`` before batch ``k`` completes, the latest moment that keeps
the GPU busy) rather than right after processing batch ``k - 1``, so that the
snapshot it publishes after processing a batch (one batch in flight, as
``bear.snapshot/1`` describes) stays exact for requests that arrive during
almost the whole step. Without asynchronous scheduling, the snapshot is
published right after scheduling, with that batch in flight. Either way a replay
from the latest snapshot, with a new request appended to the waiting queue,
forms the batches the engine forms next (``tests/test_emulator_replay.py``).
"""

from __future__ import annotations

import math
import secrets
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self, cast

import anyio
import anyio.abc
import attrs

from bearsdk._lifecycle import Runs
from bearsdk.emulator.config import EngineConfig, bind_config, config_check
from bearsdk.emulator.faults import Faults
from bearsdk.emulator.hubs import BatchHub, DelayLine, PublishedSnapshot, SnapshotHub, batch_record
from bearsdk.emulator.kvevents import KVEventFeed
from bearsdk.emulator.loopstats import LoopMeter, LoopStats
from bearsdk.emulator.metrics import EngineMetrics, GaugeValues
from bearsdk.emulator.profiles import EmulatorProfile, get_profile
from bearsdk.emulator.requests import (
    GenerationPlan,
    RequestHandle,
    RequestRecord,
    plan_generation,
)
from bearsdk.emulator.text import Tokenizer
from bearsdk.emulator.timing import BatchShape, GroundTruthTimeModel
from bearsdk.replay import ScheduledBatch, SchedulerCore
from bearsdk.replay.requests import RUNNING, CachedReq
from bearsdk.schedulers import Policy

if TYPE_CHECKING:
    from bearsdk.estimators.batch_time import BatchTimeModel

__all__ = ["EngineCore"]


@attrs.define(eq=False)
class _InFlight:
    batch: ScheduledBatch
    start: float
    end: float
    shape: BatchShape | None


@attrs.define(eq=False)
class EngineCore(Runs):
    """One emulated vLLM engine without HTTP: engine loop, snapshots, metrics, faults.

    Use as an async context manager (runs the loop for the block), or run
    :meth:`run` in a task group with ``await tg.start(engine.run)``; submit
    requests with :meth:`submit` and wait on their handles. ``host``, ``port``
    and ``serve_http`` of the configuration are not its business (see
    :class:`~bearsdk.emulator.EmulatedEngine`).

    Args:
        config: How to run it.

    Raises:
        EngineConfigError: The configuration is invalid.
        KeyError: Unknown profile.
        SpecError: Unknown scheduler or bad policy parameter.
    """

    _config: EngineConfig = attrs.field(factory=EngineConfig)
    _profile: EmulatorProfile = attrs.field(init=False)
    _policy: Policy = attrs.field(init=False)
    _max_model_len: int = attrs.field(init=False)
    _timer: GroundTruthTimeModel = attrs.field(init=False)
    _tokenizer: Tokenizer = attrs.field(init=False)
    _faults: Faults = attrs.field(init=False)
    _metrics: EngineMetrics = attrs.field(init=False)
    _snapshots: SnapshotHub = attrs.field(init=False)
    _batch_hub: BatchHub = attrs.field(init=False)
    _core: SchedulerCore = attrs.field(init=False)
    _depth: int = attrs.field(init=False)
    _reqs: dict[str, RequestHandle] = attrs.field(init=False, factory=dict)
    _queue: deque[_InFlight] = attrs.field(init=False, factory=deque)
    _gpu_free: float = attrs.field(init=False, default=0.0)
    _wake: anyio.Event | None = attrs.field(init=False, default=None)
    _epoch: str = attrs.field(init=False, default="")
    _seq: int = attrs.field(init=False, default=0)
    _batches: int = attrs.field(init=False, default=0)
    _next_id: int = attrs.field(init=False, default=0)
    _version: int = attrs.field(init=False, default=0)
    _published_version: int = attrs.field(init=False, default=-1)
    _captured: PublishedSnapshot | None = attrs.field(init=False, default=None)
    _delay: DelayLine = attrs.field(init=False)
    _meter: LoopMeter = attrs.field(init=False, factory=LoopMeter)
    _request_log: deque[RequestRecord] = attrs.field(init=False)
    _batch_log: deque[dict[str, Any]] = attrs.field(init=False)
    _loop_scope: anyio.CancelScope | None = attrs.field(init=False, default=None)
    _run_tg: anyio.abc.TaskGroup | None = attrs.field(init=False, default=None)
    _running: bool = attrs.field(init=False, default=False)
    _kv: KVEventFeed | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        cfg = self._config
        self._profile = get_profile(cfg.profile)
        self._policy, self._max_model_len = bind_config(cfg, self._profile)
        self._depth = 2 if self._policy.async_scheduling else 1
        self._timer = GroundTruthTimeModel(self._profile, cfg.time_model, cfg.seed)
        self._tokenizer = Tokenizer(self._profile.arch.vocab)
        self._faults = Faults(seed=cfg.seed)
        self._metrics = EngineMetrics.for_policy(self.model_name, self._max_model_len, self._policy)
        self._request_log = deque(maxlen=cfg.log_size)
        self._batch_log = deque(maxlen=cfg.log_size)
        self._batch_hub = BatchHub(cfg.batch_buffer)
        # The hub is looked up when a snapshot falls due: a restart replaces it.
        self._delay = DelayLine(
            lambda: self._faults.snapshot_delay_s, lambda s: self._snapshots.publish(s)
        )
        if cfg.kv_events:
            config_check(
                self._policy.prefix_caching,
                "kv_events",
                "needs prefix caching (enable_prefix_caching)",
                cfg.kv_events,
            )
            self._kv = KVEventFeed(self._policy.block_size)
        self._reset_state()

    def _reset_state(self) -> None:
        self._core = SchedulerCore(self._policy)
        if self._kv is not None:
            self._core.record_kv_events()
            self._kv.cleared()
        self._reqs.clear()
        self._queue.clear()
        self._gpu_free = 0.0
        self._epoch = secrets.token_hex(8)
        self._seq = 0
        self._batches = 0
        self._version = 0
        self._published_version = -1
        self._delay.clear()
        self._metrics.reset()
        first = PublishedSnapshot(0, self._snapshot_doc(None, 0.0), 0, 0.0)
        self._captured = first
        if hasattr(self, "_snapshots"):
            self._snapshots.publish(first)
        else:
            self._snapshots = SnapshotHub(first)

    # -- properties -----------------------------------------------------------------

    @property
    def kv_events_endpoints(self) -> tuple[str, str | None] | None:
        """Where the KV events go: ``(PUB, replay ROUTER)`` once running (``kv_events``)."""
        if self._kv is None or not self._running:
            return None
        pub = self._kv.publisher
        return pub.endpoint, pub.replay_endpoint

    @property
    def config(self) -> EngineConfig:
        """The configuration."""
        return self._config

    @property
    def profile(self) -> EmulatorProfile:
        """The emulated model/GPU profile."""
        return self._profile

    @property
    def policy(self) -> Policy:
        """The bound scheduler policy (with the engine's KV geometry)."""
        return self._policy

    @property
    def max_model_len(self) -> int:
        """Context length the engine accepts."""
        return self._max_model_len

    @property
    def instance(self) -> str:
        """Instance name in snapshots."""
        return self._config.instance or f"{self._config.profile}-0"

    @property
    def model_name(self) -> str:
        """Served model name."""
        return self._config.served_model_name or self._profile.model

    @property
    def prefix_caching(self) -> bool:
        """Whether the scheduler caches prefixes (``enable_prefix_caching``)."""
        return self._core.pool is not None

    @property
    def tokenizer(self) -> Tokenizer:
        """The stand-in tokenizer."""
        return self._tokenizer

    def answer_length(self, text: str) -> int | None:
        """The known natural output length of a prompt (``EngineConfig.answer_lengths``)."""
        return self._config.answer_lengths.get(text)

    @property
    def time_model(self) -> GroundTruthTimeModel:
        """The ground-truth batch-time model."""
        return self._timer

    def calibrated_batch_time(self) -> BatchTimeModel:
        """Eq. 12 coefficients from a profiling sweep of this engine's own GPU, within its
        scheduler's token and sequence budgets (what ``bearsdk calibrate`` would fit)."""
        return self._timer.fit_eq12(
            max_batched_tokens=self._policy.token_budget, max_seqs=self._policy.max_seqs
        )

    @property
    def faults(self) -> Faults:
        """Fault settings (mutable)."""
        return self._faults

    @property
    def metrics(self) -> EngineMetrics:
        """The Prometheus metrics."""
        return self._metrics

    @property
    def epoch(self) -> str:
        """Identifies this run of the engine (changes on restart)."""
        return self._epoch

    @property
    def snapshots(self) -> SnapshotHub:
        """Published snapshots (after any publishing delay)."""
        return self._snapshots

    @property
    def batch_hub(self) -> BatchHub:
        """Batch-record readers."""
        return self._batch_hub

    @property
    def latest_snapshot(self) -> PublishedSnapshot:
        """The latest published snapshot, as readers see it."""
        return self._snapshots.latest

    @property
    def captured_snapshot(self) -> PublishedSnapshot:
        """The latest captured snapshot (before any publishing delay)."""
        assert self._captured is not None
        return self._captured

    @property
    def snapshot_current(self) -> bool:
        """Whether nothing changed since the latest snapshot was captured."""
        return self._published_version == self._version

    @property
    def batches_scheduled(self) -> int:
        """Non-empty batches scheduled since start (or restart)."""
        return self._batches

    @property
    def num_running(self) -> int:
        """Running requests."""
        return self._core.num_running

    @property
    def num_waiting(self) -> int:
        """Waiting requests."""
        return self._core.num_waiting

    @property
    def request_log(self) -> Sequence[RequestRecord]:
        """Recently finished requests (bounded by ``log_size``)."""
        return self._request_log

    def request(self, rid: str) -> RequestHandle | None:
        """The handle of a resident (waiting or running) request, ``None`` if not resident."""
        return self._reqs.get(rid)

    @property
    def batch_log(self) -> Sequence[dict[str, Any]]:
        """Recent ``bear.batch/1`` records (bounded by ``log_size``)."""
        return self._batch_log

    def gauges(self) -> GaugeValues:
        """Running/waiting counts and KV usage, as ``/metrics`` reports them."""
        core, p = self._core, self._policy
        total = p.num_blocks - p.reserved_blocks
        usage = 1.0 - core.free_blocks / total if total > 0 else 0.0
        return GaugeValues(core.num_running, core.num_waiting, usage)

    def loop_stats(self) -> LoopStats:
        """Lateness of the loop against real time, over the recent steps."""
        return self._meter.stats()

    def idle_between(self, start: float, end: float) -> float:
        """Time the emulated GPU idled with work waiting (a late loop) between two instants.

        Over the recent steps (the lag window). A TTFT less this is what the
        emulated hardware took, whatever else the machine running it did.
        """
        return self._meter.idle_between(start, end)

    def lag_samples(self) -> list[float]:
        """The recent per-step lateness samples (seconds)."""
        return list(self._meter.lags)

    def reset_loop_stats(self) -> None:
        """Forget lag samples (e.g. after a warm-up)."""
        self._meter.reset()

    # -- requests ---------------------------------------------------------------------

    def plan(
        self,
        prompt_tokens: int,
        *,
        natural_len: int,
        max_tokens: int | None = None,
        seed: int = 0,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        prompt_ids: Sequence[int] | None = None,
    ) -> GenerationPlan:
        """Fix what a request generates on this engine's context
        (:func:`~bearsdk.emulator.requests.plan_generation` documents the arguments;
        ``prompt_ids`` are kept, with the outputs' ids, only by a prefix-caching engine)."""
        caching = prompt_ids is not None and self.prefix_caching
        return plan_generation(
            self._max_model_len,
            prompt_tokens,
            natural_len=natural_len,
            max_tokens=max_tokens,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            prompt_ids=prompt_ids if caching else None,
            tokenizer=self._tokenizer if caching else None,
        )

    def submit(self, plan: GenerationPlan, request_id: str | None = None) -> RequestHandle:
        """Add a request to the waiting queue.

        Args:
            plan: What it generates (see :meth:`plan`).
            request_id: Engine id (default: a fresh ``req-N``); made unique if resident.

        Returns:
            Its handle.

        Raises:
            ValueError: The prompt does not fit the context.
        """
        if plan.prompt_tokens >= self._max_model_len or plan.prompt_tokens < 1:
            raise ValueError(
                f"prompt_tokens must be in [1, {self._max_model_len - 1}] "
                f"(got {plan.prompt_tokens})"
            )
        self._next_id += 1
        rid = request_id or f"req-{self._next_id}"
        if rid in self._reqs:
            rid = f"{rid}-{self._next_id}"
        h = RequestHandle(rid, plan, anyio.current_time())
        # The cache matches blocks by the ids of the prompt and of the outputs to come.
        ids = plan.token_ids if self._core.pool is not None else None
        self._core.add_request(rid, plan.prompt_tokens, plan.output_len, plan.max_tokens, ids)
        self._reqs[rid] = h
        self._metrics.observe_submitted(plan)
        self._touch()
        return h

    def submit_tokens(
        self,
        prompt_tokens: int,
        output_len: int,
        *,
        max_tokens: int | None = None,
        request_id: str | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> RequestHandle:
        """Submit a request by lengths alone (tests, simulations): shorthand for
        :meth:`plan` with ``natural_len=output_len`` and :meth:`submit`
        (``prompt_ids``: its prompt's token ids, for the prefix cache)."""
        if prompt_ids is not None and len(prompt_ids) != prompt_tokens:
            raise ValueError(
                f"prompt_ids must have prompt_tokens={prompt_tokens} ids (got {len(prompt_ids)})"
            )
        plan = self.plan(
            prompt_tokens, natural_len=output_len, max_tokens=max_tokens, prompt_ids=prompt_ids
        )
        return self.submit(plan, request_id)

    def abort(self, rid: str, *, reason: str = "abort") -> bool:
        """Abort a resident request (client gone); ``False`` if it is not resident."""
        h = self._reqs.pop(rid, None)
        if h is None:
            return False
        self._core.abort_request(rid)
        self._finish(h, reason, anyio.current_time())
        self._touch()
        return True

    def _touch(self) -> None:
        self._version += 1
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    def _finish(self, h: RequestHandle, reason: str, now: float) -> None:
        record = h.finish(reason, now)
        self._metrics.observe_finished(h, reason, now)
        self._request_log.append(record)

    # -- snapshots --------------------------------------------------------------------

    def _snapshot_doc(self, inflight: _InFlight | None, now: float) -> dict[str, Any]:
        seq = -1
        if self._kv is not None:
            # Every event up to this state goes out first, so the snapshot can name
            # the last batch it includes: a router that lost batches rebuilds from it.
            seq = self._kv.flush(self._core)
        doc = self._core.snapshot(
            instance=self.instance,
            seq=self._seq,
            time=time.time(),
            output_len=self._config.publish_output_len,
        )
        doc["epoch"] = self._epoch
        if seq >= 0:
            doc["kv"]["prefix_cache"]["events_seq"] = seq
        if inflight is not None and inflight.shape is not None:
            doc["inflight"] = {"remaining_s": max(0.0, inflight.end - now)}
            if self._depth == 1:
                # A synchronous core counts the in-flight batch's tokens as computed
                # but has no placeholders: give its sampled tokens theirs, as the
                # snapshot contract describes the batch in flight.
                sampled = set(inflight.batch.sampling)
                for r in doc["requests"]:
                    if r["id"] in sampled and r["state"] == "running":
                        r["placeholders"] = r.get("placeholders", 0) + 1
        return doc

    def _publish(self, inflight: _InFlight | None) -> None:
        if self._published_version == self._version:
            return
        now = anyio.current_time()
        self._seq += 1
        snap = PublishedSnapshot(self._seq, self._snapshot_doc(inflight, now), self._batches, now)
        self._captured = snap
        self._published_version = self._version
        self._delay.put(snap)

    # -- the engine loop --------------------------------------------------------------

    def _launch(self, b: ScheduledBatch) -> _InFlight:
        now = anyio.current_time()
        if not b:
            # The step a snapshot with a batch in flight offers to new arrivals is
            # spent: one arriving now waits for that batch to complete, so the
            # published state no longer tells a replay when it is scheduled.
            self._version += 1
            return _InFlight(b, now, now, None)
        self._batches += 1
        self._version += 1
        shape = BatchShape(b.pre, b.dec, b.dctx, b.patt, len(b.sched), len(b.sampled))
        dur = self._timer.sample(shape) + self._faults.take_stall()
        start = max(now, self._gpu_free)
        if self._queue and now > self._gpu_free:
            self._meter.idle_gpu_s += now - self._gpu_free
            self._meter.idle_spans.append((self._gpu_free, now))
        end = start + dur
        self._gpu_free = end
        k = self._batches
        reqs = self._reqs
        for rid in b.sampling:
            h = reqs.get(rid)
            if h is not None and h.first_token_batch == 0:
                h.first_token_batch = k
        if b.admitted:
            cached = self._core.requests if self._core.pool is not None else None
            for rid in b.tokens:
                h = reqs.get(rid)
                if h is not None and h.scheduled_at is None:
                    h.scheduled_at = now
                    if cached is not None:
                        h.cached_tokens = cast(CachedReq, cached[rid]).cached_tokens
        m = self._metrics
        m.observe("vllm:iteration_tokens_total", b.pre + b.dec)
        if b.preempted:
            m.inc("vllm:num_preemptions", len(b.preempted))
        return _InFlight(b, start, end, shape)

    def _complete(self, f: _InFlight) -> None:
        out = self._core.process(f.batch)
        if self._kv is not None:
            self._kv.flush(self._core)
        self._version += 1
        now = anyio.current_time()
        if f.shape is not None:
            self._meter.steps += 1
            self._record_batch(f)
        m = self._metrics
        if self._core.pool is not None:
            m.observe_prefix_cache(self._core.pool)
        reqs = self._reqs
        if out.tokens:
            m.inc("vllm:generation_tokens", len(out.tokens))
        itl = m.histograms["vllm:inter_token_latency_seconds"]
        for rid in out.tokens:
            h = reqs.get(rid)
            if h is None:
                continue
            times = h.token_times
            if times:
                itl.observe(now - times[-1])
            else:
                m.observe("vllm:time_to_first_token_seconds", now - h.arrival)
                m.inc("vllm:prompt_tokens", h.plan.prompt_tokens)
                if f.shape is not None:
                    h.first_token_late = max(0.0, now - f.end)
                if self._core.pool is not None:
                    self._cache_created(h)
            times.append(now)
            h.token_ends.append(f.end if f.shape is not None else now)
            h.produced += 1
            h.notify()
        for rid in out.finished:
            h = reqs.pop(rid, None)
            if h is not None:
                self._finish(h, h.plan.finish_reason, now)

    def _cache_created(self, h: RequestHandle) -> None:
        """Set vLLM's ``created_cache_tokens`` of a request whose first token arrived.

        vLLM takes the tokens of the request's hashed blocks when its first output
        is processed (``v1/core/sched/scheduler.py:2453-2458``,
        ``v1/core/kv_cache_manager.py:760-789``), capped at the prompt, less the hit
        (``v1/metrics/stats.py:343-346``): every full prompt block by then, unless
        the request was preempted (asynchronous scheduling) while its first token
        was in flight and holds no blocks.
        """
        r = self._core.requests.get(h.id)
        if r is None or r.status == RUNNING:  # a request finishing now still held them
            bs = self._policy.block_size
            h.created_cache_tokens = bs * (h.plan.prompt_tokens // bs) - h.cached_tokens

    def _record_batch(self, f: _InFlight) -> None:
        assert f.shape is not None
        rec = batch_record(self.instance, self._epoch, f.shape, f.end - f.start)
        self._batch_log.append(rec)
        if self._batch_hub.has_readers:
            self._batch_hub.publish(rec)

    async def _sleep_until(self, deadline: float, *, measure: bool) -> None:
        await anyio.sleep_until(deadline)
        if measure:
            self._meter.lags.append(max(0.0, anyio.current_time() - deadline))

    async def _engine_loop(self) -> None:
        core, q, depth = self._core, self._queue, self._depth
        lead = self._config.schedule_lead_s
        while True:
            if len(q) >= depth:
                f = q.popleft()
                if f.shape is not None:
                    await self._sleep_until(f.end, measure=True)
                self._complete(f)
                if depth > 1:
                    self._publish(q[0] if q else None)
                continue
            if q:
                head = q[0]
                if head.shape is not None:
                    await self._sleep_until(
                        head.end - min(lead, 0.8 * (head.end - head.start)), measure=False
                    )
            b = core.schedule()
            if not b and all(x.batch.inert() for x in q):
                # Nothing scheduled and nothing in flight that could change that:
                # sleep until a request arrives or leaves.
                while q:
                    self._complete(q.popleft())
                self._publish(None)
                if self._published_version == self._version:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                continue
            f = self._launch(b)
            q.append(f)
            if depth == 1 or len(q) == 1:
                self._publish(f)

    async def _supervise(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        while True:
            with anyio.CancelScope() as scope:
                self._loop_scope = scope
                await self._engine_loop()
            # The loop was cancelled for a restart: the state is already reset.

    # -- lifecycle --------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[Self]) -> None:
        """Run the engine loop until cancelled.

        Use with ``await task_group.start(engine.run)`` (it reports ready once the
        loop runs), or enter the engine with ``async with``, which does the same.
        On the way out every resident request is dropped and the hubs close.
        """
        if self._running:
            raise RuntimeError("this engine is already running")
        self._running = True
        try:
            async with anyio.create_task_group() as tg:
                self._run_tg = tg
                await tg.start(self._supervise)
                await tg.start(self._delay.run)
                if self._kv is not None:
                    await tg.start(self._kv.run)
                task_status.started(self)
                await anyio.sleep_forever()
        finally:
            self._run_tg = None
            self._running = False
            for h in list(self._reqs.values()):
                h.dropped = True
                self.abort(h.id)
            self._snapshots.close()
            self._batch_hub.close()

    def request_restart(self, downtime_s: float = 0.0) -> None:
        """Start :meth:`restart` in the background (for callers a restart would wait on,
        such as an HTTP handler: stopping the server waits for its handlers)."""
        if self._run_tg is None:
            raise RuntimeError("the engine is not running")
        self._run_tg.start_soon(self.restart, downtime_s)

    async def restart(self, downtime_s: float = 0.0) -> None:
        """Emulate an engine restart.

        Every request in flight is dropped, the engine is down for ``downtime_s``
        (served over HTTP, the port refuses connections meanwhile), and it comes
        back with no requests, a new ``epoch``, ``seq`` starting over at 0 and
        zeroed metrics.
        """
        self._reset_for_restart(downtime_s)
        await anyio.sleep(downtime_s)

    def _reset_for_restart(self, downtime_s: float) -> None:
        """The synchronous part of a restart: drop everything, start a new epoch."""
        config_check(
            math.isfinite(downtime_s) and downtime_s >= 0, "downtime_s", "must be >= 0", downtime_s
        )
        # Everything synchronous first: the loop, cancelled here, restarts on the
        # fresh state the next time it runs.
        if self._loop_scope is not None:
            self._loop_scope.cancel()
        for h in list(self._reqs.values()):
            h.dropped = True
            h.done = True
            h.finish_reason = "abort"
            h.notify()
        self._snapshots.close()
        self._batch_hub.close()
        self._snapshots = SnapshotHub(self._snapshots.latest)
        self._batch_hub = BatchHub(self._config.batch_buffer)
        self._reset_state()
