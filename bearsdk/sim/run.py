"""One simulation run: a request stream routed over simulated engines, in virtual time.

A run routes every request of a :class:`~bearsdk.sim.scenario.RequestSet` (arriving at the run's
times) with one policy. Router policies go through the real router,
:class:`~bearsdk.router.core.RouterCore` (the router without its I/O) on a virtual clock:

* before each decision the engines run up to the arrival; what the clients
  observed by then (first tokens, completions) is reported to the router in
  time order (``record_first_token``, ``record_complete``), and each instance's
  cache is offered the latest snapshot published at least ``staleness`` before
  (``SnapshotCache.offer(snapshot, received=published + staleness)``);
* ``router.decide`` picks the instance, ``record_dispatch`` follows, and the
  request joins that engine's waiting queue with its true length there;
* with an admission mode (:attr:`~bearsdk.sim.scenario.Scenario.admission`), a request no instance
  is predicted to serve on time is refused or held as the gateway would
  (:mod:`bearsdk.sim.admission`): held requests are decided again at each later
  arrival, before it.

Predictions (accuracy, output length, cost) come from the predictor computed
once per request and replayed through a stand-in with the predictor's interface
(they do not depend on the policy, and computing them is most of a decision's
cost). The **oracle** decides outside the router: for each instance it forecasts
the request's true TTFT from the engine's exact state (:meth:`SimEngine.forecast_ttft`)
and its true utility, then applies BEAR's rule (eq. 5) to the truth. The
**latency oracle** applies it to the true TTFT and the predicted utility.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.estimators.batch_time import OnlineBatchTime
from bearsdk.predictors.protocol import StagedPredictor
from bearsdk.router import InstanceConfig
from bearsdk.router.core import DEFAULT_SPEED, RouterCore
from bearsdk.router.decision import Decision
from bearsdk.router.margin import DEFAULT_MARGIN
from bearsdk.router.runtime import REBASE_EVERY
from bearsdk.selectors import make_selector
from bearsdk.sim.admission import SEND, SimAdmission
from bearsdk.sim.engine import COMPLETE, BatchNoise, EngineEvent, SimEngine, bind_engine
from bearsdk.sim.scenario import (
    ORACLE,
    ORACLE_LATENCY,
    TIMELINE_WINDOW_S,
    InstanceSpec,
    RequestSet,
    RunResult,
    Scenario,
    router_params,
)

if TYPE_CHECKING:
    from bearsdk.router.sources import SimulatedSource
    from bearsdk.snapshot import Snapshot
    from bearsdk.state import SnapshotCache

__all__ = ["run_scenario"]

_MICRO: Final = 1e6
_SAMPLES: Final = 4000


def _instance_config(spec: InstanceSpec, policy_params: dict[str, Any]) -> InstanceConfig:
    from bearsdk.estimators.batch_time import BatchTimeModel

    bt = BatchTimeModel(*spec.batch_time) if spec.batch_time is not None else None
    return InstanceConfig(
        name=spec.name,
        url="http://sim.invalid",
        model=spec.model,
        scheduler=spec.scheduler,
        scheduler_params=policy_params,
        profile=None if bt is not None else (spec.profile or spec.engine),
        batch_time=bt,
        snapshots=spec.snapshots,
    )


def _simulated_source(config: InstanceConfig) -> SimulatedSource:
    from bearsdk.router.sources import get_snapshot_source

    make = get_snapshot_source(config.snapshots).simulated
    if make is None:
        raise ValueError(
            f"{config.name}: snapshot source {config.snapshots!r} has no simulated form"
        )
    return make(config)


def _offer_due(cache: SnapshotCache, pending: list[tuple[float, Snapshot]], now: float) -> None:
    """Offer, in order, what a source handed over that has arrived by ``now``."""
    due = [p for p in pending if p[0] <= now]
    if not due:
        return
    pending[:] = [p for p in pending if p[0] > now]
    for received, snap in sorted(due, key=lambda p: p[0]):
        cache.offer(snap, received=received)


def _selector(s: Scenario, diagnose: bool = False) -> Any:
    params = dict(s.policy.params)
    params["lam"] = s.lam
    if s.policy.name == "lagrangian" and s.delta is not None:
        params["delta"] = s.delta
    sel: Any = make_selector(s.policy.name, **params)
    if diagnose and attrs.has(type(sel)) and "price_all" in attrs.fields_dict(type(sel)):
        # The diagnosis scores every candidate's estimate: leave none unpriced.
        sel = attrs.evolve(sel, price_all=True)
    return sel


def run_scenario(
    requests: RequestSet,
    instances: Sequence[InstanceSpec],
    scenario: Scenario,
    times: npt.NDArray[np.float64],
    *,
    decode_runs: bool = True,
    diagnose: bool = False,
) -> RunResult:
    """Route every request with the scenario's policy; measure the outcome.

    Args:
        requests: The requests (truth and predictions).
        instances: The pool.
        scenario: The run.
        times: Arrival time of each request (ascending).
        decode_runs: Let engines advance decode-only stretches in closed form.
        diagnose: Score every candidate's TTFT prediction against its true
            forecast (:attr:`RunResult.diagnosis`; costs a forecast per instance
            and decision).

    Returns:
        The run's metrics.
    """
    t_wall = time.perf_counter()
    n = len(requests)
    if len(times) != n:
        raise ValueError(f"times must give one arrival per request ({n}; got {len(times)})")
    names = [s.name for s in instances]
    heap: list[tuple[float, int, int, int, int]] = []
    counter = [0]
    rid_index: dict[str, int] = {}
    width = max(7, len(str(n)))
    rids = [f"q{i:0{width}d}" for i in range(n)]
    for i, r in enumerate(rids):
        rid_index[r] = i

    def sink(j: int) -> Any:
        def push(e: EngineEvent) -> None:
            counter[0] += 1
            heapq.heappush(heap, (e.time, counter[0], e.kind, rid_index[e.rid], j))

        return push

    engines: list[SimEngine] = []
    engine_flags: list[dict[str, Any]] = []
    true_scales: dict[str, float] = {}
    for j, spec in enumerate(instances):
        em = bind_engine(spec.engine, spec.scheduler, dict(spec.params))
        tm = em.time_model
        params = spec.time_params(scenario.seed)
        true_scales[spec.name] = params.time_scale
        if params != tm.params:
            from bearsdk.emulator.timing import GroundTruthTimeModel

            tm = GroundTruthTimeModel(em.profile, params, 0)
        # Each instance's noise is its own stream, the same for every policy.
        noise = BatchNoise(tm.params, scenario.seed * 1_000_003 + 7919 * (j + 1))
        engines.append(
            SimEngine(
                spec.name,
                em.policy,
                em.max_model_len,
                tm,
                noise,
                sink(j),
                decode_runs=decode_runs,
                speed_changes=spec.speed_changes,
                log_batches=scenario.online_batch_time,
            )
        )
        engine_flags.append(router_params(spec.scheduler, em.policy))

    first = np.full(n, np.nan)
    done = np.full(n, np.nan)  # when each request's last token came
    produced = np.zeros(n, dtype=np.int64)  # its output tokens, as its engine clamped them
    chosen = np.full(n, -1, dtype=np.int64)
    predicted = np.full(n, np.nan)
    # When each request reached its engine: its arrival, or later if admission held it.
    sent = np.array(times, dtype=np.float64, copy=True)
    estimator: list[str] = [""] * n
    decisions: list[Decision | None] = [None] * n
    done_out = requests.true_output  # what each request produces where it runs
    decide_s = 0.0
    decided = 0

    oracle = scenario.policy.name in (ORACLE, ORACLE_LATENCY)
    changes = any(spec.speed_changes for spec in instances)
    trace: list[tuple[float, dict[str, float]]] | None = [] if changes and not oracle else None
    trace_next = 0.0
    diag = _Diagnosis(names) if diagnose and not oracle else None
    router: RouterCore | None = None
    clock = [0.0]
    # Predictions were computed once for every policy: the core reads them from a table.
    feed = StagedPredictor(requests.models)
    # The oracles decide outside the router: admission (the router's rule) is not theirs.
    adm = (
        SimAdmission(scenario.admission, scenario.queue_size, scenario.max_wait_ms / 1000.0)
        if not oracle and scenario.admission != "best-effort"
        else None
    )
    # Snapshots for the rechecks after the last arrival, planned with the others.
    tail = adm.tail(times, requests.targets_s) if adm is not None else []
    if not oracle:
        configs = [_instance_config(s, engine_flags[j]) for j, s in enumerate(instances)]
        router = RouterCore(
            configs,
            _selector(scenario, diag is not None),
            predictor=feed,
            staleness=scenario.router_staleness,
            clock=lambda: clock[0],
            resident_lengths="calibrated"
            if scenario.resident_lengths == "calibrated"
            else "predicted",
            speed=DEFAULT_SPEED if scenario.speed == "learned" else None,
            margin=DEFAULT_MARGIN if scenario.margin == "learned" else None,
        )
        delay = scenario.staleness_s
        for e in engines:
            e.plan_captures([*(times - delay).tolist(), *(t - delay for t in tail)])
    caches = [router.cache(nm) for nm in names] if router is not None else []
    # The router's online eq. 12 fits, fed each engine's batch records as they
    # come and rebased on every 32 accepted, as AsyncRouter's runtime does.
    fits = (
        [_OnlineFit(router.slot(nm).batch_time) for nm in names]
        if router is not None and scenario.online_batch_time
        else []
    )
    sources = [_simulated_source(c) for c in configs] if router is not None else []
    offered = [-1] * len(engines)
    # What each source handed over and when the router may first see it.
    in_flight: list[list[tuple[float, Snapshot]]] = [[] for _ in engines]
    true_cost = requests.true_cost()
    utility = requests.true_accuracy - scenario.lam * true_cost
    judged = utility
    if scenario.policy.name == ORACLE_LATENCY:
        cols = [requests.models.index(s.model) for s in instances]
        judged = (
            requests.pred_accuracy[:, cols] - scenario.lam * _MICRO * requests.pred_cost[:, cols]
        )

    def deliver(upto: float) -> None:
        while heap and heap[0][0] <= upto:
            t, _, kind, i, j = heapq.heappop(heap)
            if kind == COMPLETE:
                done[i] = t
                if router is not None:
                    d = decisions[i]
                    assert d is not None
                    clock[0] = t
                    router.record_complete(
                        d, names[j], usage={"completion_tokens": int(done_out[i, j])}
                    )
            else:
                first[i] = t
                if router is not None:
                    d = decisions[i]
                    assert d is not None
                    clock[0] = t
                    # From dispatch, as the gateway's router measures it: a held
                    # request's wait is no part of the engine's first-token time.
                    router.record_first_token(d, names[j], t - float(sent[i]))

    def refresh(capture: int, now: float) -> None:
        """Offer each cache what its engine published and has reached the router by ``now``."""
        assert router is not None
        for j, e in enumerate(engines):
            snap = e.captured(capture)
            if snap.seq != offered[j]:
                offered[j] = snap.seq
                # The engines' first (empty) snapshots, published at 0, arrive late too.
                got = sources[j].deliver(snap, snap.time + scenario.staleness_s)
                if got is not None:
                    in_flight[j].append((got[1], got[0]))
            _offer_due(caches[j], in_flight[j], now)
        clock[0] = now

    def record(k: int, d: Decision) -> int:
        """Record request ``k``'s dispatch by ``d`` with the router; the instance's index."""
        assert router is not None
        router.record_dispatch(d)
        decisions[k] = d
        # A lower bound past the selector's horizon is no estimate: out of the MAPE.
        predicted[k] = math.nan if d.chosen.ttft_lower_bound else d.chosen.ttft_estimate_s
        estimator[k] = d.chosen.estimator
        return names.index(d.instance)

    def start(k: int, j: int, now: float) -> None:
        chosen[k] = j
        sent[k] = now
        produced[k] = engines[j].add_request(
            rids[k], int(requests.prompt_tokens[k]), int(requests.true_output[k, j]), now
        )

    def decide_held(k: int, left: float) -> Decision:
        assert router is not None
        feed.stage(requests.prediction(k))
        return router.decide(
            requests.texts[k],
            ttft_target=left,
            request_id=rids[k],
            tpot_target=requests.tpot_target(k),
        )

    def recheck(now: float) -> None:
        nonlocal decide_s, decided
        assert adm is not None
        t1 = time.perf_counter()
        decided += adm.recheck(now, decide_held, lambda k, d: start(k, record(k, d), now))
        decide_s += time.perf_counter() - t1

    for i in range(n):
        a = float(times[i])
        for e in engines:
            e.advance(a)
        deliver(a)
        t0 = time.perf_counter()
        best = -1
        d: Decision | None
        if router is None:
            best = _oracle_choice(engines, requests, judged, i, a)
            d = None
        else:
            refresh(i, a)
            if adm is not None and adm.held:
                decide_s += time.perf_counter() - t0
                recheck(a)
                t0 = time.perf_counter()
            t1 = time.perf_counter()
            for j, e in enumerate(engines):
                # The router streams its requests' tokens: the latest ended a step.
                at = e.streamed_at(a)
                if at is not None:
                    router.record_tokens(names[j], at=at)
                if fits and fits[j].feed(*e.take_batches()):
                    router.rebase(names[j], fits[j].online.model)
            feed.stage(requests.prediction(i))
            d = router.decide(
                requests.texts[i],
                ttft_target=float(requests.targets_s[i]),
                request_id=rids[i],
                tpot_target=requests.tpot_target(i),
            )
            verdict = SEND if adm is None else adm.admit(i, a, d, time.perf_counter() - t1)
            if verdict == SEND:
                best = record(i, d)
            if trace is not None and a >= trace_next:
                trace_next = a + 1.0
                trace.append((a, _factors(router, names)))
        decided += 1
        decide_s += time.perf_counter() - t0
        if diag is not None and d is not None:
            diag.observe(engines, requests, i, a, d)
        if best >= 0:
            start(i, best, a)
    if adm is not None:
        # No arrivals left to recheck at: the tail grid, until the queue is empty.
        for k, t in enumerate(tail):
            if not adm.held:
                break
            for e in engines:
                e.advance(t)
            deliver(t)
            refresh(n + k, t)
            recheck(t)
        assert not adm.held, "the tail outlasts every deadline"
    for e in engines:
        e.drain()
    deliver(math.inf)
    result = _measure(
        scenario,
        requests,
        names,
        times,
        first,
        chosen,
        predicted,
        estimator,
        utility,
        sent=sent,
        admission=adm,
        tpot=_tpot(first, done, produced),
        wall_s=time.perf_counter() - t_wall,
        decide_s=decide_s,
        decided=decided,
        batches=sum(e.batches for e in engines),
    )
    if diag is not None:
        result = attrs.evolve(
            result,
            diagnosis=diag.summary(),
            ttft_floor=diag.floor(chosen, first, sent, times),
        )
    if router is not None:
        result = attrs.evolve(result, speed=_learned_speed(router, names, true_scales))
    if changes:
        result = attrs.evolve(
            result, timeline=_timeline(times, first, requests.targets_s, trace or [])
        )
    return result


@attrs.define
class _OnlineFit:
    """One instance's online eq. 12 fit, as the router's runtime keeps it."""

    online: OnlineBatchTime = attrs.field(converter=OnlineBatchTime)
    _accepted: int = 0

    def feed(self, features: npt.NDArray[np.float64], durations: npt.NDArray[np.float64]) -> bool:
        """Fold in batch records; whether a rebase is due (every 32 accepted)."""
        due = False
        for f, d in zip(features.tolist(), durations.tolist(), strict=True):
            if self.online.observe(f[0], f[1], f[2], f[3], d):
                self._accepted += 1
                due = due or self._accepted % REBASE_EVERY == 0
        return due


def _factors(router: RouterCore, names: Sequence[str]) -> dict[str, float]:
    out = {}
    for nm in names:
        sp = router.speed(nm)
        if sp is not None:
            out[nm] = sp.factor
    return out


def _timeline(
    times: npt.NDArray[np.float64],
    first: npt.NDArray[np.float64],
    targets: npt.NDArray[np.float64],
    trace: Sequence[tuple[float, dict[str, float]]],
) -> tuple[dict[str, Any], ...]:
    met = (first - times) <= targets
    w = TIMELINE_WINDOW_S
    windows = np.floor(times / w).astype(np.int64)
    out: list[dict[str, Any]] = []
    k = 0
    for win in range(int(windows.max()) + 1 if len(times) else 0):
        sel = windows == win
        end = (win + 1) * w
        speed: dict[str, float] = {}
        while k < len(trace) and trace[k][0] < end:
            speed = trace[k][1]
            k += 1
        out.append(
            {
                "t": win * w,
                "requests": int(sel.sum()),
                "on_time": float(met[sel].mean()) if sel.any() else math.nan,
                **({"speed": speed} if speed else {}),
            }
        )
    return tuple(out)


def _learned_speed(
    router: RouterCore, names: Sequence[str], truth: Mapping[str, float]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for nm in names:
        sp = router.speed(nm)
        if sp is not None:
            out[nm] = {
                "time_scale": truth[nm],
                "factor": sp.factor,
                "stderr": sp.stderr,
                "steps": float(sp.steps),
                "overhead_s": router.overhead(nm),
                "margin": router.margin(nm),
            }
    return out


@attrs.define
class _Diagnosis:
    """Every candidate's predicted TTFT against its true forecast, per instance."""

    names: Sequence[str]
    _rows: list[tuple[int, str, float, float, float, bool]] = attrs.field(factory=list)
    # Per request: the chosen instance and its true forecast at the decision.
    _chosen: dict[int, tuple[int, float]] = attrs.field(factory=dict)

    def observe(
        self,
        engines: Sequence[SimEngine],
        requests: RequestSet,
        i: int,
        now: float,
        d: Decision | None,
    ) -> None:
        assert d is not None
        p = int(requests.prompt_tokens[i])
        target = float(requests.targets_s[i])
        for j, (e, c) in enumerate(zip(engines, d.candidates, strict=True)):
            true = e.forecast_ttft(p, int(requests.true_output[i, j]), now)
            self._rows.append((j, c.estimator, c.ttft_estimate_s, true, target, c.ttft_lower_bound))
            if j == d.index:
                self._chosen[i] = (j, true)

    def floor(
        self,
        chosen: npt.NDArray[np.int64],
        first: npt.NDArray[np.float64],
        sent: npt.NDArray[np.float64],
        times: npt.NDArray[np.float64],
    ) -> dict[str, float]:
        """The chosen instance's true forecast against the TTFT it gave: what a
        replay of the exact state at the decision (true lengths, true batch
        times) still misses, because requests that arrive later share the
        batches that complete the prompt (vLLM fills every batch's leftover
        budget with them). The floor under ``ttft_mape`` for any estimator
        that, like BEA, replays the present.

        Requests sent when they arrived, to the instance the observed decision
        chose (a held request was decided again later); ``n``, ``mape`` and
        ``bias`` (mean log of forecast over actual), or only ``n = 0``.
        """
        fc, got = [], []
        for i, (j, true) in self._chosen.items():
            service = float(first[i] - sent[i])
            if (
                chosen[i] == j
                and sent[i] == times[i]
                and math.isfinite(true)
                and math.isfinite(service)
                and service > 0
            ):
                fc.append(true)
                got.append(service)
        if not fc:
            # (No NaN: attrs compares results with ==, and NaN != NaN.)
            return {"n": 0.0}
        f, g = np.array(fc), np.array(got)
        return {
            "n": float(len(f)),
            "mape": float(np.mean(np.abs(f - g) / g)),
            "bias": float(np.mean(np.log(np.maximum(f, 1e-6) / g))),
        }

    def summary(self) -> dict[str, dict[str, float]]:
        """Per instance (and per instance and estimator): ``n``, ``mape``, ``bias``
        (mean log of predicted over true; predictions floored at 1 us), and the
        shares predicted infeasible
        though feasible (``false_miss``) and feasible though not (``false_hit``).

        Lower bounds past the selector's horizon (``bounds``: how many) count in
        the shares, not in ``mape`` and ``bias``: they are no estimates.
        """
        groups: dict[str, list[tuple[float, float, float, bool]]] = {}
        for j, est, p, t, tau, bound in self._rows:
            # A prediction of 0 (LPS without statistics) is kept: it is one.
            if not (math.isfinite(p) and math.isfinite(t) and t > 0 and p >= 0):
                continue
            for key in (self.names[j], f"{self.names[j]}/{est}"):
                groups.setdefault(key, []).append((p, t, tau, bound))
        out: dict[str, dict[str, float]] = {}
        for key, rows in sorted(groups.items()):
            a = np.array(rows, dtype=np.float64)
            pred, true, target = a[:, 0], a[:, 1], a[:, 2]
            exact = a[:, 3] == 0.0
            rel = np.abs(pred - true) / true
            out[key] = {
                "n": float(len(a)),
                "bounds": float(len(a) - int(exact.sum())),
                "mape": float(np.mean(rel[exact])) if exact.any() else math.nan,
                "bias": float(np.mean(np.log(np.maximum(pred[exact], 1e-6) / true[exact])))
                if exact.any()
                else math.nan,
                "false_miss": float(np.mean((pred > target) & (true <= target))),
                "false_hit": float(np.mean((pred <= target) & (true > target))),
            }
        return out


def _oracle_choice(
    engines: Sequence[SimEngine],
    requests: RequestSet,
    utility: npt.NDArray[np.float64],
    i: int,
    now: float,
) -> int:
    """BEAR's rule (eq. 5) on the true TTFT: best ``utility`` among instances whose
    true TTFT meets the target, else the lowest true TTFT; ties broken as the
    selectors break them (lower TTFT, then a draw seeded by the request)."""
    target = float(requests.targets_s[i])
    p = int(requests.prompt_tokens[i])
    ttft = [e.forecast_ttft(p, int(requests.true_output[i, j]), now) for j, e in enumerate(engines)]
    feasible = [j for j, t in enumerate(ttft) if t <= target]
    if feasible:
        best_u = max(float(utility[i, j]) for j in feasible)
        ties = [j for j in feasible if float(utility[i, j]) == best_u]
    else:
        ties = list(range(len(engines)))
    low = min(ttft[j] for j in ties)
    ties = [j for j in ties if ttft[j] == low]
    # A deterministic draw: identical instances share the requests.
    return ties[(i * 2654435761) % len(ties)]


def _tpot(
    first: npt.NDArray[np.float64], done: npt.NDArray[np.float64], out: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    """Each request's TPOT as vLLM reports it: (last token - first) / (outputs - 1).

    ``nan`` for a request with one output token (it has no TPOT: any target is
    met) or never served.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(out >= 2, (done - first) / np.maximum(out - 1, 1), np.nan)


def _measure(
    scenario: Scenario,
    requests: RequestSet,
    names: Sequence[str],
    times: npt.NDArray[np.float64],
    first: npt.NDArray[np.float64],
    chosen: npt.NDArray[np.int64],
    predicted: npt.NDArray[np.float64],
    estimator: Sequence[str],
    utility: npt.NDArray[np.float64],
    *,
    sent: npt.NDArray[np.float64] | None = None,
    admission: SimAdmission | None = None,
    tpot: npt.NDArray[np.float64] | None = None,
    wall_s: float,
    decide_s: float,
    decided: int | None = None,
    batches: int,
) -> RunResult:
    n = len(times)
    idx = np.arange(n)
    if sent is None:
        sent = times
    # A refused request (chosen -1) has no first token and no utility: -1 must not
    # index the last instance's column (numpy would), nor NaN compare as anything.
    served = chosen >= 0
    ttft = first - times
    met = served & (np.where(served, ttft, np.inf) <= requests.targets_s)
    tp_targets = requests.tpot_targets_s
    ttft_met = float(met.mean())
    tpot_stats: dict[str, float | None] = {}
    if tp_targets is not None and tpot is not None:
        # On time means both: the first token by its target, then the stream at its pace.
        tpot_ok = served & ~(tpot > tp_targets)  # a lone token (nan) has no pace to miss
        met = met & tpot_ok
        known = served & np.isfinite(tpot)
        tp = tpot[known]
        tpot_stats = {
            "ttft_attainment": ttft_met,
            "tpot_attainment": float(tpot_ok[served].mean()) if served.any() else None,
            # The share of served requests whose stream was slower than their target.
            "tpot_missed": float((known & (tpot > tp_targets)).sum() / max(int(served.sum()), 1)),
            "mean_tpot_s": float(tp.mean()) if tp.size else None,
            "p90_tpot_s": float(np.quantile(tp, 0.9)) if tp.size else None,
        }
    u = np.where(served, utility[idx, np.maximum(chosen, 0)], 0.0)
    comp: dict[str, dict[str, int]] = {}
    for j, nm in enumerate(names):
        mine = chosen == j
        comp[nm] = {
            "routed": int(mine.sum()),
            "met": int((mine & met).sum()),
            "missed": int((mine & ~met).sum()),
        }
    mape: dict[str, float] = {}
    mape_n: dict[str, int] = {}
    # Both from dispatch: a held request's prediction was made when it was sent.
    service = first - sent
    ok = served & np.isfinite(predicted) & (service > 0)
    if ok.any():
        err = np.abs(predicted[ok] - service[ok]) / service[ok]
        mape["all"] = float(err.mean())
        mape_n["all"] = int(err.size)
        est = np.array(estimator, dtype=object)[ok]
        for name in sorted(set(est.tolist())):
            mine = est == name
            mape[str(name)] = float(err[mine].mean())
            mape_n[str(name)] = int(mine.sum())
    else:
        mape["all"] = math.nan
        mape_n["all"] = 0
    step = max(1, n // _SAMPLES)
    wait = sent - times
    samples = tuple(
        (
            int(chosen[i]),
            float(predicted[i] + wait[i]),
            float(ttft[i]),
            float(requests.targets_s[i]),
        )
        for i in range(0, n, step)
    )
    span = float(times[-1] - times[0]) if n > 1 else 0.0
    got = ttft[served]
    rej = admission.reject_decide_us() if admission is not None else None
    return RunResult(
        scenario=scenario,
        n=n,
        on_time_utility=float(np.where(met, u, 0.0).mean()),
        slo_attainment=float(met.mean()),
        mean_utility=float(u.mean()),
        mean_ttft_s=float(got.mean()) if got.size else math.nan,
        p90_ttft_s=float(np.quantile(got, 0.9)) if got.size else math.nan,
        composition=comp,
        ttft_mape=mape,
        ttft_mape_n=mape_n,
        wall_s=wall_s,
        decide_us=decide_s / max(n if decided is None else decided, 1) * 1e6,
        batches=batches,
        samples=samples,
        goodput_rps=int(met.sum()) / span if span > 0 else None,
        rejected=admission.rejected if admission is not None else 0,
        queued=admission.queued if admission is not None else 0,
        expired=admission.expired if admission is not None else 0,
        reject_decide_us_max=rej[0] if rej is not None else None,
        reject_decide_us_p99=rej[1] if rej is not None else None,
        tpot=tpot_stats,
    )
