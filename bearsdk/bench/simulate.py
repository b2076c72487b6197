"""``bearsdk bench simulate``: wall time of a full policy comparison in simulation.

The acceptance workload of the simulator: 10,000 requests of the paper's four
tasks over its three-instance Qwen3 pool, routed by each of the ten built-in
policies (BEAR, the Lagrangian, Prefill-TPS and the seven baselines), at one
Poisson rate; ``--oracle`` adds the two oracles. Reports the time to build the
inputs (prompts, true lengths, predictions), each run's wall time, and the
total, spread over ``--workers`` processes (default: one per CPU). The target is
60 s on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

__all__ = ["register", "run"]

TARGET_S = 60.0


def run(
    requests: int = 10_000,
    rate: float = 8.0,
    workers: int | None = None,
    unique_prompts: int = 2000,
    oracle: bool = False,
    seed: int = 1,
) -> dict[str, Any]:
    """Run the benchmark; return its timings."""
    from bearsdk.sim.config import PAPER_POOL, POLICIES, SimConfig, SweepSpec, WorkloadSpec
    from bearsdk.sim.run import ORACLE, ORACLE_LATENCY, PolicySpec
    from bearsdk.sim.sweep import run_config
    from bearsdk.state import StalenessPolicy

    names = [*POLICIES, *((ORACLE, ORACLE_LATENCY) if oracle else ())]
    cfg = SimConfig(
        name="bench",
        requests=requests,
        seeds=(seed,),
        router_staleness=StalenessPolicy(),
        batch_time="profile",
        resident_lengths="predicted",
        predictor="default",
        pool=PAPER_POOL,
        workload=WorkloadSpec(unique_prompts=unique_prompts),
        policies=tuple(PolicySpec(n) for n in names),
        sweeps=(SweepSpec("bench", (rate,)),),
    )
    t0 = time.perf_counter()
    report = run_config(cfg, workers=workers)
    wall = time.perf_counter() - t0
    runs = [
        {
            "policy": r.scenario.policy.display,
            "wall_s": round(r.wall_s, 3),
            "batches": r.batches,
            "decide_us": round(r.decide_us, 1),
            "on_time_utility": round(r.on_time_utility, 4),
        }
        for r in report.results
    ]
    return {
        "requests": requests,
        "instances": len(PAPER_POOL),
        "policies": len(names),
        "rate": rate,
        "workers": report.workers,
        "cpus": os.cpu_count(),
        "inputs_s": round(report.prepare_s, 3),
        "runs_cpu_s": round(sum(r.wall_s for r in report.results), 3),
        "total_s": round(wall, 3),
        "target_s": TARGET_S,
        "within_target": wall <= TARGET_S,
        "runs": runs,
    }


def _main(args: argparse.Namespace) -> int:
    res = run(args.requests, args.rate, args.workers, args.unique_prompts, args.oracle, args.seed)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(
        f"simulate: {res['requests']} requests x {res['instances']} instances x "
        f"{res['policies']} policies at {res['rate']:g} qps on {res['workers']} worker(s)"
    )
    print(f"{'policy':<24} {'wall s':>7} {'batches':>9} {'decide us':>10} {'OnTimeUtility':>14}")
    for r in res["runs"]:
        print(
            f"{r['policy']:<24} {r['wall_s']:>7.2f} {r['batches']:>9} {r['decide_us']:>10.1f} "
            f"{r['on_time_utility']:>14.4f}"
        )
    verdict = "within" if res["within_target"] else "OVER"
    print(
        f"inputs {res['inputs_s']:.2f} s, runs {res['runs_cpu_s']:.2f} s of CPU, "
        f"total {res['total_s']:.2f} s wall ({verdict} the {res['target_s']:.0f} s target)"
    )
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("simulate", help="wall time of 10k requests x 3 instances x 10 policies")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    p.add_argument("--unique-prompts", type=int, default=2000, help="distinct prompts drawn from")
    p.add_argument("--oracle", action="store_true", help="add the two oracles")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)
