"""``bearsdk bench decisions``: decision cost against queue depth and pool size.

One :meth:`RouterCore.decide` call (predictors, one BEA estimate per instance,
BEAR) timed decision by decision, for pools of 3 to 256 instances whose
snapshots are 400 ms stale (so every estimate fast-forwards) and hold 56
decoding requests (each with its next token in flight, as async vLLM reports
them) plus 0 to 1,000 waiting ones each, with a 500 ms TTFT
target. The router's clock advances 100 µs per decision (10,000 decisions a
second) and the instances' snapshots were captured up to 50 ms apart, as a
polled pool's are, so that fast-forwarded views are rebuilt at their own
engine steps. The ``mixed`` rows draw each instance's depth from 0 to 1,000.

Each cell is run twice in the same process: with BEAR's default horizon
(estimates exact up to 2 x the target, lower bounds past it:
``docs/decision-cost.md``) and, for 8 instances, with ``horizon_factor =
inf`` (every estimate replayed to the first token), so that the effect of the
cut-off is a ratio measured in one run. Targets: median <= 100 µs and p99 <=
300 µs at 8 instances whatever the depth; median <= 1 ms at 256 instances.

``--dispatch`` times, at 8 instances and each depth, decisions that are each
sent (``record_dispatch``), 64 requests in flight across the pool (the oldest
completes as each is sent), against the same decisions never sent, alternating
decision by decision on two routers: a loaded router's steady state, where the
instance chosen last has its fast-forwarded view rebuilt at the next decision
(its overlay changed), with the ratio measured in one run.

``--tpot`` times, at 8 instances and each depth, the same decisions with a
TPOT target too (50 ms: BEA follows 32 tokens past the first at every
instance, each of which holds a request sent with a TPOT target, so that
BEAR's harm rule replays its residents alone too) against TTFT only,
alternating decision by decision on one router: the ratio is what routing on
TPOT costs (issue 21's bound: within 2x).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from bearsdk.bench import Timing
from bearsdk.bench.router import PROMPT, _configs
from bearsdk.cli import positive_int
from bearsdk.predictors import Predictor
from bearsdk.router.core import RouterCore
from bearsdk.router.decision import Decision
from bearsdk.selectors import BEAR
from bearsdk.snapshot import NCOLS, KVState, Snapshot

__all__ = ["decision_cost", "register"]

STALE_S = 0.4
STEP_S = 1e-4
TARGET_S = 0.5
RUNNING = 56
POOLS = (3, 8, 32, 256)
DEPTHS = (0, 10, 100, 200, 400, 1000)


def _snapshot(name: str, rng: random.Random, at: float, depth: int) -> Snapshot:
    rows = []
    for _ in range(RUNNING):
        p, o = rng.randint(200, 3000), rng.randint(1, 300)
        # Decoding under async scheduling: the next token is in flight (as
        # vLLM reports it, and as `bench router` builds its snapshots).
        rows.append((0, p, p + o, o, -1, -1, 1))
    for _ in range(depth):
        rows.append((1, rng.randint(300, 3000), 0, 0, -1, -1, 0))
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    held = int(sum(-(-int(r[2]) // 16) for r in rows))
    blocks = max(60_000, held + 1_000)
    return Snapshot(
        instance=name,
        seq=1,
        time=at,
        kv=KVState(16, blocks, blocks - held - 1),
        ids=tuple(f"{name}-r{i}" for i in range(len(rows))),
        table=table,
        inflight_remaining_s=rng.uniform(0.002, 0.03),
    )


TPOT_TARGET_S = 0.05


def decision_cost(
    n: int,
    depth: int | None,
    decisions: int,
    *,
    horizon_factor: float = 2.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-decision times (µs) with ``n`` instances ``depth`` deep (``None``: mixed)."""
    rng = random.Random(seed)
    t0 = 1_000.0
    clock = [t0]
    router = RouterCore(
        _configs(n),
        BEAR(horizon_factor=horizon_factor),
        predictor=Predictor.load_default(),
        clock=lambda: clock[0],
        explore=None,
    )
    depths = []
    for name in router.instances:
        d = rng.randint(0, 1000) if depth is None else depth
        depths.append(d)
        at = t0 - rng.uniform(0.0, 0.05)
        router.cache(name).offer(_snapshot(name, rng, at, d), received=at)
    msgs = [{"role": "user", "content": PROMPT}]
    samples = []
    modes: Counter[str] = Counter()
    warm = max(20, decisions // 10)
    for i in range(warm + decisions):
        clock[0] = t0 + STALE_S + i * STEP_S
        a = time.perf_counter_ns()
        dec = router.decide(msgs, ttft_target=TARGET_S)
        dt = time.perf_counter_ns() - a
        if i >= warm:
            samples.append(dt / 1e3)
            modes.update(c.estimator for c in dec.candidates)
    samples.sort()
    total = sum(modes.values())
    return {
        "instances": n,
        "waiting": "mixed" if depth is None else depth,
        "horizon_factor": horizon_factor,
        "median_us": round(statistics.median(samples), 2),
        "p99_us": round(samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))], 2),
        "per_instance_us": round(statistics.median(samples) / n, 3),
        "estimators": {k: round(v / total, 3) for k, v in sorted(modes.items())},
        "decisions": decisions,
    }


def tpot_cost(depth: int | None, decisions: int, seed: int = 0) -> dict[str, Any]:
    """Decisions at 8 instances with and without a TPOT target, alternating on one router.

    Each turn times a TTFT-only decision and one with :data:`TPOT_TARGET_S`
    on the same state, so that the ratio is paired, not two cells apart on a
    noisy machine.
    """
    t0 = 1_000.0
    clock = [t0]
    router = _pool8(depth, seed, clock, Predictor.load_default())
    msgs = [{"role": "user", "content": PROMPT}]
    clock[0] = t0 + STALE_S
    for name in router.instances:
        # A request with a TPOT target already there: every instance's residents
        # are weighed (BEAR's harm rule: a second replay, of the residents alone).
        sent = router.decide(
            msgs, ttft_target=TARGET_S, tpot_target=TPOT_TARGET_S, instances=[name]
        )
        router.record_dispatch(sent)
    base, tpot = _alternating(
        clock,
        t0,
        decisions,
        lambda: router.decide(msgs, ttft_target=TARGET_S),
        lambda: router.decide(msgs, ttft_target=TARGET_S, tpot_target=TPOT_TARGET_S),
    )
    return _paired_row(depth, decisions, ("ttft_only", base), ("with_tpot", tpot))


def _alternating(
    clock: list[float],
    t0: float,
    decisions: int,
    first: Callable[[], Decision],
    second: Callable[[], Decision],
    after: Callable[[Decision], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Time ``first`` then ``second`` (µs) at each of ``decisions`` steps of
    ``clock`` from ``t0``, after a warm-up; ``after`` gets ``second``'s
    decision, untimed."""
    warm = max(20, decisions // 10)
    clock_ns = time.perf_counter_ns
    a_us: list[float] = []
    b_us: list[float] = []
    for i in range(warm + decisions):
        clock[0] = t0 + STALE_S + i * STEP_S
        a = clock_ns()
        first()
        b = clock_ns()
        dec = second()
        c = clock_ns()
        if after is not None:
            after(dec)
        if i >= warm:
            a_us.append((b - a) / 1e3)
            b_us.append((c - b) / 1e3)
    return a_us, b_us


def _pool8(depth: int | None, seed: int, clock: list[float], pred: Predictor) -> RouterCore:
    """A BEAR router on 8 instances, ``depth`` deep (``None``: mixed), on ``clock``."""
    rng = random.Random(seed)
    t0 = clock[0]
    router = RouterCore(_configs(8), BEAR(), predictor=pred, clock=lambda: clock[0], explore=None)
    for name in router.instances:
        d = rng.randint(0, 1000) if depth is None else depth
        at = t0 - rng.uniform(0.0, 0.05)
        router.cache(name).offer(_snapshot(name, rng, at, d), received=at)
    return router


def _paired_row(
    depth: int | None,
    decisions: int,
    first: tuple[str, list[float]],
    second: tuple[str, list[float]],
) -> dict[str, Any]:
    return {
        "instances": 8,
        "waiting": "mixed" if depth is None else depth,
        first[0]: Timing(first[1]).as_dict(),
        second[0]: Timing(second[1]).as_dict(),
        "ratio_median": round(statistics.median(second[1]) / statistics.median(first[1]), 2),
        "decisions": decisions,
    }


IN_FLIGHT = 64


def dispatch_cost(depth: int | None, decisions: int, seed: int = 0) -> dict[str, Any]:
    """Decisions at 8 instances each sent (64 in flight) against the same never
    sent, alternating on two routers with the same snapshots and clock."""
    t0 = 1_000.0
    clock = [t0]
    pred = Predictor.load_default()
    still, sent = (_pool8(depth, seed, clock, pred) for _ in range(2))
    msgs = [{"role": "user", "content": PROMPT}]
    flying: deque[Decision] = deque()

    def send(dec: Decision) -> None:
        sent.record_dispatch(dec)
        flying.append(dec)
        if len(flying) > IN_FLIGHT:
            old = flying.popleft()
            sent.record_complete(old, old.instance)

    base, after = _alternating(
        clock,
        t0,
        decisions,
        lambda: still.decide(msgs, ttft_target=TARGET_S),
        lambda: sent.decide(msgs, ttft_target=TARGET_S),
        send,
    )
    return _paired_row(depth, decisions, ("not_sent", base), ("sent", after))


def _paired(
    args: argparse.Namespace,
    cost: Callable[[int | None, int], dict[str, Any]],
    key: str,
    timings: tuple[str, str],
    labels: tuple[str, str],
) -> int:
    """Print (or report as JSON under ``key``) ``cost``'s two ``timings`` at each depth."""
    rows = []
    for depth in (*DEPTHS, None):
        r = cost(depth, args.decisions)
        rows.append(r)
        if not args.json:
            a, b = r[timings[0]], r[timings[1]]
            print(
                f"   8 instances {r['waiting']!s:>6} waiting: {labels[0]} p50 "
                f"{a['median_us']:8.1f} p99 {a['p99_us']:8.1f} us; {labels[1]} p50 "
                f"{b['median_us']:8.1f} p99 {b['p99_us']:8.1f} us: x{r['ratio_median']}",
                flush=True,
            )
    if args.json:
        print(json.dumps({key: rows}, indent=2))
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.tpot:
        return _paired(
            args,
            tpot_cost,
            "tpot",
            ("ttft_only", "with_tpot"),
            ("TTFT only", "with a TPOT target"),
        )
    if args.dispatch:
        return _paired(
            args, dispatch_cost, "dispatch", ("not_sent", "sent"), ("never sent", "each sent")
        )
    rows = []
    for n in POOLS:
        for depth in (*DEPTHS, None):
            k = args.decisions if n <= 32 else max(50, args.decisions // 8)
            rows.append(decision_cost(n, depth, k))
            if n == 8:
                rows.append(decision_cost(8, depth, k, horizon_factor=math.inf))
            if not args.json:
                for r in rows[-2 if n == 8 else -1 :]:
                    hf = "exact" if r["horizon_factor"] == math.inf else "cut  "
                    mix = ", ".join(f"{k} {v:.0%}" for k, v in r["estimators"].items())
                    print(
                        f"{r['instances']:4d} instances {r['waiting']!s:>6} waiting {hf}: "
                        f"p50 {r['median_us']:9.1f}  p99 {r['p99_us']:9.1f} us  "
                        f"({r['per_instance_us']:.2f} us/instance; {mix})",
                        flush=True,
                    )
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "decisions", help="decision cost vs queue depth (0-1,000) and pool size (3-256)"
    )
    p.add_argument("--decisions", type=positive_int, default=2000, help="timed decisions per cell")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.add_argument(
        "--tpot", action="store_true", help="only: decisions with a TPOT target vs TTFT only"
    )
    p.add_argument(
        "--dispatch",
        action="store_true",
        help="only: decisions each sent (64 in flight) vs never sent",
    )
    p.set_defaults(func=_main)
