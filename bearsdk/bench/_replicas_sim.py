"""Router replicas in virtual time: the real routers, simulated engines and a simulated bus.

``bearsdk bench replicas --sim`` runs the same setups as the emulator benchmark
without real time, so that the comparison is exact and repeatable (the
emulator's figures move by several hundredths between runs on a busy machine).
Engines are :class:`bearsdk.sim.SimEngine` instances (the instance's scheduler
spec and the emulator's ground-truth batch times in virtual time); the routers
are :class:`~bearsdk.router.core.RouterCore` instances on a virtual clock, fed
through their offline interface (``decide``, ``record_dispatch``,
``record_first_token``, ``record_complete``):

* every router sees, at each decision, the engines' snapshots as they were
  ``snapshot_delay_s`` earlier (a snapshot stream with that delay, whichever
  transport carries it);
* with the shared overlay, each replica's dispatch events reach the others
  ``bus_latency_s`` after they happen (:class:`SimBus`, standing in for Redis:
  about a millisecond on a LAN);
* requests are dealt to the replicas in turn;
* ``kill``: the bus loses every event published while it is down.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from bearsdk.cluster.wire import DispatchEvent
from bearsdk.emulator.text import Tokenizer
from bearsdk.evaluation import RequestResult, RunSummary, summarize

__all__ = ["SIM_MODES", "SimBus", "SimResult", "simulate"]

SIM_MODES: Final = (
    "single",
    "single-pod",
    "independent",
    "independent-pod",
    "shared",
    "shared-nopod",
    "kill",
)
"""The setups the simulation runs: the emulator benchmark's, less the Redis-specific
ones, plus ``single-pod`` (one router with power-of-d tie-breaking, the reference
for ``shared``). ``kill`` is ``shared`` with the bus down for the middle third of
the arrivals: events published then are lost (a real bus sends them late, when
they no longer matter), and snapshots keep coming (the sources' fallback)."""

_DISPATCH, _FIRST, _COMPLETE, _BUS = 0, 1, 2, 3


@attrs.define
class SimBus:
    """An in-memory :class:`~bearsdk.cluster.DispatchBus` with a fixed latency in virtual time.

    Args:
        latency_s: Delay between publishing an event and every subscriber reading it.
        schedule: ``schedule(time, callback, event)``: the simulation's event queue.
        now: The virtual clock.
        down: ``(start, end)``: the bus is down then (events published are lost).
    """

    latency_s: float
    schedule: Callable[[float, Callable[[DispatchEvent], None], DispatchEvent], None]
    now: Callable[[], float]
    down: tuple[float, float] | None = None
    _subs: list[Callable[[DispatchEvent], None]] = attrs.field(init=False, factory=list)
    _lost: int = attrs.field(init=False, default=0)

    @property
    def lost(self) -> int:
        """Events published while the bus was down."""
        return self._lost

    def publish_dispatch(self, event: DispatchEvent) -> None:
        """Deliver ``event`` to every subscriber ``latency_s`` from now (none while down)."""
        if self.down is not None and self.down[0] <= self.now() < self.down[1]:
            self._lost += 1
            return
        for cb in self._subs:
            self.schedule(self.now() + self.latency_s, cb, event)

    def subscribe_dispatches(self, callback: Callable[[DispatchEvent], None]) -> Callable[[], None]:
        """Subscribe; returns the unsubscriber."""
        self._subs.append(callback)
        return lambda: self._subs.remove(callback)


@attrs.frozen
class SimResult:
    """One simulated setup.

    Attributes:
        mode: The setup.
        replicas: Routers that took the traffic.
        summary: The run, scored.
        phases: The run scored by thirds of the arrivals (``before``,
            ``outage``, ``after``: the bus outage of ``kill``).
        foreign: Other replicas' dispatches added to views (all replicas).
        lost: Events lost while the bus was down.
    """

    mode: str
    replicas: int
    summary: RunSummary
    phases: dict[str, RunSummary] = attrs.field(factory=dict)
    foreign: int = 0
    lost: int = 0


_PREDICTOR: list[Any] = []


def _predictor() -> Any:
    # Loaded once per process: every router of every setup reads it, none writes it
    # (usage reports come without prompts here, so nothing is learnt from them).
    if not _PREDICTOR:
        from bearsdk.predictors import Predictor

        p = Predictor.load_default()
        tok = Tokenizer().counting()
        for m in p.models:
            p.set_tokenizer(m, tok)
        _PREDICTOR.append(p)
    return _PREDICTOR[0]


def simulate(
    mode: str,
    *,
    profiles: Sequence[str],
    replicas: int = 4,
    rate: float = 20.0,
    n: int = 600,
    seed: int = 0,
    lam: float = 5e-4,
    slowdown: float = 3.0,
    snapshot_delay_s: float = 0.0,
    bus_latency_s: float = 0.001,
) -> SimResult:
    """Run one setup in virtual time and score it.

    Args:
        mode: One of :data:`SIM_MODES`.
        profiles: The engines' emulator profiles.
        replicas: Routers in the replica setups.
        rate: Poisson arrival rate, requests/s.
        n: Requests.
        seed: Seeds the workload, the engines' batch-time noise and the draws.
        lam: Cost weight of the utility.
        slowdown: The engines' GPUs run this many times slower than profiled.
        snapshot_delay_s: Age of the snapshots routers see at each decision.
        bus_latency_s: Delay of dispatch events between replicas.

    Raises:
        ValueError: Unknown mode.
    """
    from bearsdk.cluster import PowerOfD, SharedOverlay
    from bearsdk.emulator import GroundTruthParams
    from bearsdk.emulator.timing import GroundTruthTimeModel
    from bearsdk.router import InstanceConfig
    from bearsdk.router.core import RouterCore
    from bearsdk.schedulers import get_scheduler
    from bearsdk.selectors import BEAR, Selector
    from bearsdk.sim.engine import COMPLETE, BatchNoise, EngineEvent, SimEngine, bind_engine
    from bearsdk.workload import synthetic_workload

    if mode not in SIM_MODES:
        raise ValueError(f"mode must be one of {', '.join(SIM_MODES)} (got {mode!r})")
    n_routers = 1 if mode.startswith("single") else replicas
    shared = mode in ("shared", "shared-nopod", "kill")
    pod = mode in ("shared", "independent-pod", "single-pod", "kill")
    items = synthetic_workload(n, rate, seed=seed)
    tok = Tokenizer()
    predictor = _predictor()
    prices = {m.name: (m.input_price, m.output_price) for m in predictor.pool}

    heap: list[tuple[float, int, int, Any]] = []
    order = itertools.count()
    clock = [0.0]

    def push(t: float, kind: int, payload: Any) -> None:
        heapq.heappush(heap, (t, next(order), kind, payload))

    # -- engines
    engines: list[SimEngine] = []
    configs: list[InstanceConfig] = []
    counts: dict[str, int] = {}
    for j, prof in enumerate(profiles):
        em = bind_engine(prof)
        tm = GroundTruthTimeModel(em.profile, GroundTruthParams(time_scale=slowdown), 0)
        k = counts.get(prof, 0)
        counts[prof] = k + 1
        name = f"{prof}-{k}"

        def sink(e: EngineEvent) -> None:
            push(e.time, _COMPLETE if e.kind == COMPLETE else _FIRST, e)

        engines.append(
            SimEngine(
                name, em.policy, em.max_model_len, tm, BatchNoise(tm.params, seed + 7919 * j), sink
            )
        )
        known = set(get_scheduler(em.config.scheduler).params)
        configs.append(
            InstanceConfig(
                name=name,
                url="http://sim.invalid",
                model=em.model_name,
                scheduler=em.config.scheduler,
                scheduler_params={k: v for k, v in em.policy.params if k in known},
                # Each instance's own calibration, as from a profiling run on its GPU.
                batch_time=tm.fit_eq12(
                    max_batched_tokens=em.policy.token_budget, max_seqs=em.policy.max_seqs
                ),
            )
        )
    names = [c.name for c in configs]
    models = {c.name: c.model for c in configs}
    times = [it.arrival_s for it in items]
    for e in engines:
        e.plan_captures([t - snapshot_delay_s for t in times])

    # -- routers
    span = times[-1] if times else 0.0
    thirds = (span / 3, 2 * span / 3)
    bus = SimBus(
        bus_latency_s,
        lambda t, cb, ev: push(t, _BUS, (cb, ev)),
        lambda: clock[0],
        thirds if mode == "kill" else None,
    )
    routers: list[RouterCore] = []
    overlays: list[SharedOverlay] = []
    for r in range(n_routers):
        policy: Selector = BEAR(lam=lam)
        if pod:
            policy = PowerOfD(policy, seed=seed * 1000 + r)
        router = RouterCore(configs, policy, predictor=predictor, clock=lambda: clock[0])
        routers.append(router)
        if shared:
            overlays.append(SharedOverlay(bus, replica=f"r{r}").attach(router))
    offered = [[-1] * len(engines) for _ in routers]

    # -- the run
    sent: dict[str, tuple[int, int, Any, int]] = {}  # rid -> (item, router, decision, engine)
    first: dict[int, float] = {}
    outputs: dict[int, int] = {}

    def deliver(upto: float) -> None:
        while heap and heap[0][0] <= upto:
            t, _, kind, payload = heapq.heappop(heap)
            clock[0] = t
            if kind == _BUS:
                cb, ev = payload
                cb(ev)
                continue
            rid = payload.rid
            i, r, d, j = sent[rid]
            if kind == _FIRST:
                first[i] = t
                routers[r].record_first_token(d, names[j], t - times[i])
            else:
                routers[r].record_complete(d, names[j], usage={"completion_tokens": outputs[i]})

    for i, it in enumerate(items):
        a = times[i]
        for e in engines:
            e.advance(a)
        deliver(a)
        clock[0] = a
        r = i % n_routers
        router = routers[r]
        for j, e in enumerate(engines):
            snap = e.captured(i)
            if snap.seq != offered[r][j]:
                offered[r][j] = snap.seq
                router.cache(names[j]).offer(snap, received=snap.time + snapshot_delay_s)
        d = router.decide(it.messages, ttft_target=it.ttft_target_s)
        router.record_dispatch(d)
        j = names.index(d.instance)
        prompt = tok.count(tok.render_chat(it.messages))
        out = it.outputs.get(models[d.instance], it.output_tokens)
        outputs[i] = engines[j].add_request(d.request_id, prompt, out, a)
        sent[d.request_id] = (i, r, d, j)
    for e in engines:
        e.drain()
    deliver(float("inf"))

    results = []
    for _rid, (i, _r, d, j) in sorted(sent.items(), key=lambda kv: kv[1][0]):
        it = items[i]
        model = models[names[j]]
        prompt = tok.count(tok.render_chat(it.messages))
        pin, pout = prices.get(model, (0.0, 0.0))
        ttft = first[i] - times[i] if i in first else None
        results.append(
            RequestResult(
                it.index,
                it.task,
                names[j],
                model,
                ttft,
                it.ttft_target_s,
                d.chosen.ttft_s,
                float(it.accuracy.get(model, 0.0)),
                prompt * pin + outputs[i] * pout,
                prompt,
                outputs[i],
            )
        )
    summary = summarize(mode, rate, results, lam=lam)
    phases = {}
    for name, lo, hi in (
        ("before", -1.0, thirds[0]),
        ("outage", thirds[0], thirds[1]),
        ("after", thirds[1], float("inf")),
    ):
        part = [r for r in results if lo <= times[r.index] < hi]
        if part:
            phases[name] = summarize(name, rate, part, lam=lam)
    foreign = sum(o.stats().applied for o in overlays)
    return SimResult(mode, n_routers, summary, phases, foreign, bus.lost)
