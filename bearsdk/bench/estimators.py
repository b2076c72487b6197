"""``bearsdk bench estimators``: cost of each TTFT estimator and of batch-time calibration.

Times one ``estimate_ttft`` of every estimator behind the common interface on a
loaded instance view, ``InstanceStats.view``, an online batch-time update, and a
robust eq. 12 fit of 2000 batches. Medians and p99s in microseconds.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np
import orjson

from bearsdk.bench import time_call
from bearsdk.cli import positive_int

__all__ = ["register"]


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``estimators`` benchmark."""
    p = bsub.add_parser("estimators", help="latency estimators and batch-time calibration")
    p.add_argument("--rounds", type=positive_int, default=200, help="timing rounds (default 200)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bearsdk.estimators.base import LatencyEstimator, RequestInfo
    from bearsdk.estimators.baselines import (
        LMDeployProxyEstimator,
        RouteBalanceEstimator,
        ScoreEstimator,
        SemanticRouterEstimator,
    )
    from bearsdk.estimators.batch_time import (
        BatchObservation,
        OnlineBatchTime,
        fit_batch_time,
        prefill_attention_of,
    )
    from bearsdk.estimators.lps import LPSEstimator
    from bearsdk.estimators.prefill import PrefillThroughputEstimator
    from bearsdk.estimators.profiles import get_profile
    from bearsdk.estimators.stats import InstanceStats

    rng = np.random.default_rng(0)
    prof = get_profile("qwen3-8b-h100")
    stats = InstanceStats()
    t = 0.0
    for i in range(3000):
        t += float(rng.exponential(0.1))
        stats.on_dispatch(f"r{i}", t, int(rng.integers(50, 2000)), int(rng.integers(10, 500)))
        if i >= 30:
            stats.on_first_token(f"r{i - 30}", t)
        if i >= 60:
            stats.on_complete(f"r{i - 60}", t, int(rng.integers(10, 500)))
    view = stats.view(t)
    req = RequestInfo(800, 200)
    estimators: dict[str, LatencyEstimator] = {
        "lps": LPSEstimator(theta_pre=prof.theta_pre, concurrency=64),
        "lps-eq15": LPSEstimator(theta_pre=prof.theta_pre, concurrency=64, variability=True),
        "prefill-tps": PrefillThroughputEstimator(prof.theta_pre),
        "score": ScoreEstimator(),
        "routebalance": RouteBalanceEstimator(),
        "lmdeploy-proxy": LMDeployProxyEstimator(),
        "semantic-router": SemanticRouterEstimator(),
    }
    results: dict[str, dict[str, float]] = {}
    for name, est in estimators.items():
        results[f"estimate_ttft/{name}"] = time_call(
            functools.partial(est.estimate_ttft, req, view), rounds=args.rounds
        ).as_dict()
    results["InstanceStats.view"] = time_call(
        lambda: stats.view(t), batch=10, rounds=args.rounds, warmup=2
    ).as_dict()
    online = OnlineBatchTime(prof.model)
    obs = []
    for _ in range(2000):
        p = int(rng.integers(0, 2048))
        d = int(rng.integers(1, 128))
        c = d * int(rng.integers(100, 4000))
        pa = prefill_attention_of(p, int(rng.integers(0, 4000))) if p else 0
        obs.append(
            BatchObservation(
                p, d, c, pa, prof.model.batch_time(p, d, c, pa) * float(rng.lognormal(0, 0.03))
            )
        )
    it = iter(obs * 1000)

    def online_step() -> None:
        o = next(it)
        online.observe(
            o.prefill_tokens, o.decode_tokens, o.decode_context, o.prefill_attention, o.duration_s
        )

    results["OnlineBatchTime.observe"] = time_call(online_step, rounds=args.rounds).as_dict()

    def online_step_and_read() -> None:
        online_step()
        _ = online.model

    results["OnlineBatchTime.model (resolve)"] = time_call(
        online_step_and_read, rounds=args.rounds
    ).as_dict()
    results["fit_batch_time (2000 batches)"] = time_call(
        lambda: fit_batch_time(obs), batch=1, rounds=max(5, args.rounds // 20), warmup=1
    ).as_dict()
    if args.json:
        sys.stdout.write(orjson.dumps(results).decode() + "\n")
    else:
        for name, r in results.items():
            med, p99 = r["median_us"], r["p99_us"]
            print(f"{name:36s} median {med:12.2f} us   p99 {p99:12.2f} us   n={r['n']}")
    return 0
