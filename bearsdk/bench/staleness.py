"""``bearsdk bench staleness``: BEA's TTFT error under delayed snapshots, with and without fixes.

Ground truth is the scheduler itself run in virtual time
(:class:`~bearsdk.replay.SchedulerCore`, eq. 12 batch times), so the experiment is
exact and repeats bit for bit for a seed. One engine instance serves a Poisson
stream of requests; a share of it comes from other clients the router does not
know about. After every step the engine publishes its snapshot (the batch just
scheduled in flight, as ``bear.snapshot/1`` describes); the router sees each
snapshot ``delay`` seconds after its capture (0, 25, 100, 400 and 1000 ms, the
paper's appendix F grid). At every arrival of one of its own requests the
router estimates its TTFT from the latest snapshot it can see, four ways:

* ``paper``: BEA on the snapshot as it is (the paper's estimator);
* ``overlay``: plus the router's own dispatches the snapshot cannot show;
* ``fast-forward``: the snapshot advanced to now first (no dispatches);
* ``overlay+ff``: both (the dispatches arrive at their dispatch times).

then dispatches it. The router learns of its own requests' first tokens, later
tokens and completions when they happen (it streams them; each ends an engine
step, which fast-forwarded views are placed on: ``StalenessRules.anchor_steps``),
and of nothing else. Snapshots
carry no output lengths (as from a real engine): the estimator predicts them
with the workload's mean. The score is the mean absolute percentage error of the
predicted TTFT over the router's requests.

The same run also scores the unmodified-vLLM mode: a
:class:`~bearsdk.state.shadow.ShadowView` fed with the router's own events and
the engine's ``/metrics`` counts polled every 0.5 s (no snapshots at all), with
the overlay and fast-forward on top. ``--foreign-share`` shows what it loses
when other clients share the instance.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from bearsdk.cli import nonnegative_float, nonnegative_int, positive_float, positive_int
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.estimators.length import MeanLengthPredictor
from bearsdk.estimators.prefill import nominal_theta_pre
from bearsdk.io.metrics import EngineMetrics
from bearsdk.replay import SchedulerCore
from bearsdk.schedulers import bind_scheduler
from bearsdk.snapshot import decode_snapshot
from bearsdk.state.cache import SnapshotCache
from bearsdk.state.instance import InstanceState, StalenessRules
from bearsdk.state.shadow import ShadowView

__all__ = ["METHODS", "Workload", "register", "run"]

DELAYS_MS = (0, 25, 100, 400, 1000)
METHODS = ("paper", "overlay", "fast-forward", "overlay+ff")
COEFFS = BatchTimeModel(4.0e-3, 2.2e-5, 5.0e-8, 1.2e-10)
METRICS_S = 0.5  # the shadow view's /metrics poll interval
REFRESH_S = 0.02  # its snapshot refresh interval (MetricsSource.refresh_s)


@attrs.frozen
class Workload:
    """The experiment's engine and request stream.

    Attributes:
        requests: Arrivals (the router's and other clients' together).
        rate: Arrivals per second.
        foreign_share: Share of arrivals from clients the router does not see.
        prompt_mean: Mean prompt length (lognormal, sigma 0.8, in [16, 8000]).
        output_mean: Mean output length (lognormal, sigma 0.9, in [1, 2000]).
        params: Engine (vllm-v1) parameters.
        seed: Seeds the stream.
    """

    requests: int = 1500
    rate: float = 12.0
    foreign_share: float = 0.25
    prompt_mean: int = 1200
    output_mean: int = 220
    params: tuple[tuple[str, int], ...] = (
        ("max_num_batched_tokens", 4096),
        ("max_num_seqs", 48),
        ("num_gpu_blocks", 8000),
        ("block_size", 16),
    )
    seed: int = 1

    def arrivals(self) -> list[tuple[float, str, int, int, bool]]:
        """``(time, id, prompt, output, router's own)`` in time order."""
        rng = random.Random(self.seed)

        def lognormal(mean: float, sigma: float, lo: int, hi: int) -> int:
            mu = math.log(mean) - sigma * sigma / 2
            return min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))

        out = []
        t = 0.0
        for i in range(self.requests):
            t += rng.expovariate(self.rate)
            own = rng.random() >= self.foreign_share
            rid = f"{'q' if own else 'x'}{i}"
            p = lognormal(self.prompt_mean, 0.8, 16, 8000)
            o = lognormal(self.output_mean, 0.9, 1, 2000)
            out.append((t, rid, p, o, own))
        return out


def _variants(est: BEAEstimator, delays: Sequence[float]) -> dict[tuple[float, str], InstanceState]:
    policies = {
        "paper": StalenessRules.paper(),
        "overlay": StalenessRules(fast_forward_after_s=None, fallback_after_s=math.inf),
        "fast-forward": StalenessRules(overlay=False, fallback_after_s=math.inf),
        "overlay+ff": StalenessRules(fallback_after_s=math.inf),
    }
    out = {}
    for d in delays:
        # One cache per delay, shared by the four methods: they differ only in
        # what they do with its snapshot.
        # The router and the engine share the virtual clock: no transit cap needed.
        cache = SnapshotCache(
            f"delay-{d}", estimator=est, clock=lambda: 0.0, max_transit_s=math.inf
        )
        for m, pol in policies.items():
            out[(d, m)] = InstanceState(cache, est, fallback=None, rules=pol)
    return out


def run(workload: Workload, delays_ms: Sequence[int] = DELAYS_MS) -> dict[str, Any]:
    """Run the experiment; return MAPEs by delay and method, and run statistics."""
    pol = bind_scheduler("vllm-v1", dict(workload.params))
    est = BEAEstimator(pol, COEFFS, MeanLengthPredictor(mean=workload.output_mean))
    delays = [d / 1000.0 for d in delays_ms]
    states = _variants(est, delays)
    caches = {d: states[(d, METHODS[0])].cache for d in delays}
    offered: dict[float, int] = dict.fromkeys(delays, -1)
    core = SchedulerCore(pol)
    core.set_coeffs(COEFFS.replay_coeffs)
    depth = 2 if pol.async_scheduling else 1
    arrivals = deque(workload.arrivals())
    published: deque[tuple[float, int, dict[str, Any]]] = deque()
    horizon = max(delays) + 1.0
    # (time, 0 first token | 1 completion | 2 a later token, id)
    events: list[tuple[float, int, str]] = []
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    estimates: dict[tuple[float, str], dict[str, float]] = {k: {} for k in states}
    modes: dict[tuple[float, str], dict[str, int]] = {k: {} for k in states}
    seq = 0
    t = 0.0
    batches = 0
    # Unmodified vLLM: a shadow view from the router's own events and /metrics
    # polled every METRICS_S, in the same run (no snapshot reaches it).
    clock = [0.0]
    shadow_cache = SnapshotCache(
        "shadow", estimator=est, clock=lambda: clock[0], max_transit_s=math.inf
    )
    budget = dict(workload.params)["max_num_batched_tokens"]
    shadow_view = ShadowView(
        "bench", clock=lambda: clock[0], prefill_tokens_per_s=nominal_theta_pre(COEFFS, budget)
    )
    # (As the router keeps a shadow-fed instance: nothing to place its steps by.)
    shadow = InstanceState(
        shadow_cache,
        est,
        fallback=None,
        rules=StalenessRules(fallback_after_s=math.inf, anchor_steps=False),
    )
    shadow_est: dict[str, float] = {}
    polls: deque[tuple[float, EngineMetrics]] = deque()
    next_poll = 0.0
    last_refresh = -math.inf

    def see(now: float) -> None:
        # What the router has streamed back by now, then the snapshots each delay shows.
        nonlocal last_refresh
        clock[0] = now
        while events and events[0][0] <= now:
            et, kind, rid = heapq.heappop(events)
            for st in (*states.values(), shadow):
                if kind == 0:
                    st.on_tokens(rid, 1, at=et)
                    continue
                st.on_step_end(et)  # a later token, or the last
                if kind == 1:
                    st.on_complete(rid, now=et)
            if kind == 2:
                continue
            if kind == 0:
                shadow_view.on_tokens(rid, 1)
            else:
                shadow_view.on_complete(rid)
        while polls and polls[0][0] <= now:
            shadow_view.on_metrics(polls.popleft()[1], now=now)
        for rid, r in core.requests.items():
            if rid.startswith("q") and r.outputs:
                shadow_view.on_tokens(rid, r.outputs)  # streamed so far
        if now - last_refresh >= REFRESH_S:
            last_refresh = now
            shadow_view.refresh(shadow_cache)
        for d in delays:
            latest = None
            for cap, s, doc in published:
                if cap <= now - d:
                    latest = (cap, s, doc)
                else:
                    break
            if latest is not None and latest[1] != offered[d]:
                offered[d] = latest[1]
                snap = decode_snapshot(orjson.dumps(latest[2]))
                caches[d].offer(snap, received=now)

    def arrive(a: float, rid: str, prompt: int, output: int, own: bool) -> None:
        see(a)
        if own:
            for key, st in states.items():
                e = st.ttft(prompt, now=a)
                estimates[key][rid] = e.ttft_s
                modes[key][e.mode] = modes[key].get(e.mode, 0) + 1
            for st in states.values():
                st.on_dispatch(rid, prompt, now=a)
            shadow_est[rid] = shadow.ttft(prompt, now=a).ttft_s
            shadow.on_dispatch(rid, prompt, now=a)
            shadow_view.on_dispatch(rid, prompt, now=a)
        arrived[rid] = a
        core.add_request(rid, prompt, output)

    while arrivals or core.has_work():
        while arrivals and arrivals[0][0] <= t:
            arrive(*arrivals.popleft())
        batch = core.schedule()
        if not batch and all(q.inert() for q in core.queue):
            if not arrivals:
                break
            t = max(t, arrivals[0][0])  # idle until the next arrival
            continue
        dt = core.account(batch) if batch else 0.0
        if batch:
            batches += 1
        while next_poll <= t:
            used = 1.0 - core.free_blocks / pol.num_blocks
            m = EngineMetrics(
                core.num_running, core.num_waiting, used, pol.block_size, pol.num_blocks
            )
            polls.append((next_poll, m))
            next_poll += METRICS_S
        streamed = False
        for r in batch.sampled:
            if r.rid not in first:
                first[r.rid] = t + dt
                if r.rid.startswith("q"):
                    heapq.heappush(events, (t + dt, 0, r.rid))
            elif not streamed and r.rid.startswith("q"):
                # One of the router's streams gets a token: this step ended then.
                streamed = True
                heapq.heappush(events, (t + dt, 2, ""))
        core.queue.append(batch)
        if len(core.queue) >= depth:
            out = core.process(core.queue.popleft())
            # A batch's outputs are processed when it completes: at the end of
            # the previous batch in a pipelined engine, of this one otherwise.
            done_at = t if depth > 1 else t + dt
            for rid in out.finished:
                if rid.startswith("q"):
                    heapq.heappush(events, (done_at, 1, rid))
        if batch:
            seq += 1
            doc = core.snapshot(instance="bench", seq=seq, time=t)
            if dt > 0:
                doc["inflight"] = {"remaining_s": dt}
            published.append((t, seq, doc))
            while published and published[0][0] < t - horizon:
                published.popleft()
        t += dt

    truth = {rid: first[rid] - arrived[rid] for rid in first if rid.startswith("q")}
    # Score every cell on the same requests: those every cell could estimate
    # (the first ones arrive before a delayed snapshot is visible).
    common = {rid for rid, v in truth.items() if v > 0}
    for est_by_rid in estimates.values():
        common &= {rid for rid, e in est_by_rid.items() if math.isfinite(e)}
    common &= {rid for rid, e in shadow_est.items() if math.isfinite(e)}

    def mape(est_by_rid: dict[str, float]) -> float:
        errs = [abs(est_by_rid[rid] - truth[rid]) / truth[rid] for rid in common]
        return round(100.0 * sum(errs) / len(errs), 2)

    table: dict[str, dict[str, float]] = {}
    for (d, method), est_by_rid in estimates.items():
        table.setdefault(f"{round(d * 1000)}", {})[method] = mape(est_by_rid)
    ttfts = sorted(truth.values())
    return {
        "ground_truth": "SchedulerCore in virtual time (eq. 12 batch times)",
        "workload": attrs.asdict(workload),
        "own_requests": len(truth),
        "scored_requests": len(common),
        "batches": batches,
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
        "ttft_p90_s": round(ttfts[int(0.9 * len(ttfts))], 4),
        "mape_pct": table,
        "shadow_mape_pct": mape(shadow_est),
        "modes": {f"{round(d * 1000)}/{m}": v for (d, m), v in modes.items()},
    }


def _main(args: argparse.Namespace) -> int:
    w = Workload(
        requests=args.requests, rate=args.rate, foreign_share=args.foreign_share, seed=args.seed
    )
    report = run(w, args.delays)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"TTFT MAPE (%) of BEA under snapshot delay; ground truth: {report['ground_truth']}; "
        f"{report['own_requests']} router requests, {w.foreign_share:.0%} foreign load, "
        f"TTFT p50 {report['ttft_p50_s'] * 1000:.0f} ms, p90 {report['ttft_p90_s'] * 1000:.0f} ms"
    )
    print(f"{'delay ms':>8} " + " ".join(f"{m:>13}" for m in METHODS))
    for d, row in report["mape_pct"].items():
        print(f"{d:>8} " + " ".join(f"{row[m]:>13.2f}" for m in METHODS))
    rows = report["mape_pct"]
    zero = rows[str(args.delays[0])]["paper"]
    print(f"change against the zero-delay paper figure ({zero:.2f} %), percentage points:")
    for d, row in rows.items():
        print(f"{d:>8} " + " ".join(f"{row[m] - zero:>+13.2f}" for m in METHODS))
    print("change against the same method at zero delay, percentage points:")
    for d, row in rows.items():
        base = rows[str(args.delays[0])]
        print(f"{d:>8} " + " ".join(f"{row[m] - base[m]:>+13.2f}" for m in METHODS))
    print(
        f"unmodified vLLM (shadow view from the router's own requests, /metrics every "
        f"{METRICS_S:g} s, overlay+ff): {report['shadow_mape_pct']:.2f} %"
    )
    return 0


def _share(text: str) -> float:
    v = nonnegative_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1] (got {text!r})")
    return v


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("staleness", help="BEA TTFT MAPE under snapshot delay, with overlay/FF")
    p.add_argument("--requests", type=positive_int, default=1500, help="arrivals (all clients)")
    p.add_argument("--rate", type=positive_float, default=12.0, help="arrivals per second")
    p.add_argument("--foreign-share", type=_share, default=0.25, help="share from other clients")
    p.add_argument("--seed", type=nonnegative_int, default=1)
    p.add_argument(
        "--delays",
        type=nonnegative_int,
        nargs="+",
        default=list(DELAYS_MS),
        help="snapshot delays, ms",
    )
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
