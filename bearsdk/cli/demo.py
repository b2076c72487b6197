"""``bearsdk demo``: the main job on embedded defaults.

Three emulated vLLM engines (Qwen3-0.6B and 8B on one H100 each, Qwen3-32B on
two) run in process and in real time; a Poisson workload of the paper's four
tasks, each request with its appendix A.2 TTFT target, goes through
:class:`~bearsdk.router.AsyncRouter` as streamed chat requests, once per policy
and arrival rate, each run on fresh engines with the same requests. The table
shows OnTimeUtility (eq. 6), SLO attainment and where the requests went; the
plot (SVG, no plotting library needed) shows OnTimeUtility against the rate.

With ``--workload alpaca-eval`` (needs the AlpacaEval data) the pool is the
default real-data pool, FuseChat-3.0 Llama-3.2-1B / Qwen-2.5-7B / Gemma-2-9B,
on the emulator profiles nearest in size; each request is a held-out AlpacaEval
instruction (odd ids) whose true accuracy on each model is that model's
AlpacaEval 2.0 judgement, and each engine answers it with that model's real
answer length; the router's predictor is trained in place on the even ids.
AlpacaEval data are CC BY-NC 4.0: read in place, for evaluation only.

With ``--workload agents``, multi-turn agent sessions run on four emulated
prefix-caching engines, and BEAR routes them knowing the cache (the engines'
KV events and the prompts' tokens), approximately (what it sent where), or not
at all (:mod:`bearsdk.cli.demo_agents`).

Runs go in parallel worker processes (``--jobs``, default: one per idle core)
so that one run's engines do not steal another's event loop. Emulated engines
run in real time, so a busy machine makes them run late: a run whose requests
were sent late is rerun with fewer runs beside it, and one that still lags is
marked unreliable in the table. Ctrl-C stops the workers at once and prints the
runs already finished.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import attrs

from bearsdk.cli import demo_report
from bearsdk.cli.demo_jobs import (
    MAX_ARRIVAL_LAG_S,
    default_jobs,
    measured_busy,
    rerun_plan,
    usable_cpus,
)

if TYPE_CHECKING:
    from bearsdk.emulator import EngineConfig
    from bearsdk.evaluation import RunSummary
    from bearsdk.predictors import Predictor
    from bearsdk.workload import WorkItem

__all__ = [
    "ALPACA_INSTANCES",
    "DEMO_POLICIES",
    "DEMO_PROFILES",
    "WORKLOADS",
    "register",
    "run_policy",
]

DEMO_PROFILES = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100")
"""The three emulated instances (the paper's pool)."""

ALPACA_INSTANCES = (
    ("llama-1b", "FuseChat-Llama-3.2-1B-Instruct", "qwen3-0.6b-h100"),
    ("qwen-7b", "FuseChat-Qwen-2.5-7B-Instruct", "qwen3-8b-h100"),
    ("gemma-9b", "FuseChat-Gemma-2-9B-Instruct", "llama-3-8b-a100"),
)
"""``--workload alpaca-eval``: (instance, served model, emulator profile of the nearest size)."""

WORKLOADS = ("tasks", "alpaca-eval", "agents")
"""The paper's four synthetic tasks, or held-out AlpacaEval prompts with real judgements."""

DEMO_POLICIES = (
    "bear",
    "prefill-tps",
    "latency-agnostic",
    "routebalance",
    "score",
    "round-robin",
    "shortest-queue",
    "lmdeploy-proxy",
    "semantic-router",
)
"""BEAR, its Prefill-TPS ablation and the paper's seven baselines."""

_TAIL_S = 1.3  # longer than the largest A.2 target (1.12 s): every first-token outcome is known
_WARMUP_S = 0.3  # first snapshots reach the router


@attrs.frozen
class _Job:
    policy: str
    rate: float
    n: int
    seed: int
    lam: float
    slowdown: float = 1.0
    workload: str = "tasks"


@functools.cache
def _alpaca() -> tuple[Predictor, tuple[WorkItem, ...]]:
    """The real-data predictor (trained on even ids) and the held-out items (odd ids).

    Cached per process: the parent builds it before forking the workers.

    Raises:
        FileNotFoundError: The AlpacaEval data are not on this machine.
    """
    from bearsdk.data import data_dir
    from bearsdk.predictors import FUSECHAT3_POOL, TrainConfig, read_alpaca_eval
    from bearsdk.predictors.training import train_predictor
    from bearsdk.workload import alpaca_prompts

    # `_run` resolved --data-dir into BEARSDK_DATA, so workers find the same folder.
    root = data_dir(None, "alpaca-eval")
    data = read_alpaca_eval(root / "alpaca_eval", FUSECHAT3_POOL)
    even = range(0, len(data.prompts), 2)
    pred = train_predictor(data.select_prompts(list(even)), TrainConfig(quantiles=()))
    models = [m for _, m, _ in ALPACA_INSTANCES]
    items = alpaca_prompts(root / "alpaca_eval", models, prompt_ids=range(1, len(data.prompts), 2))
    return pred, tuple(items)


def _engines(job: _Job) -> tuple[list[EngineConfig], list[WorkItem], Predictor | None]:
    from bearsdk.emulator import EngineConfig, GroundTruthParams
    from bearsdk.workload import arrivals, synthetic_workload

    slow = GroundTruthParams(time_scale=job.slowdown)
    if job.workload == "tasks":
        configs = [
            EngineConfig(profile=p, seed=job.seed + i, time_model=slow)
            for i, p in enumerate(DEMO_PROFILES)
        ]
        return configs, synthetic_workload(job.n, job.rate, seed=job.seed), None
    from bearsdk.predictors import PromptTokenCounter

    trained, held_out = _alpaca()
    # Routers learn token counts from usage reports: each run starts from the
    # trained state, so runs (and policies) do not see one another's traffic.
    pred = attrs.evolve(
        trained,
        tokens=PromptTokenCounter.for_pool(
            trained.models, [m.chars_per_token for m in trained.pool]
        ),
    )
    import numpy as np

    rng = np.random.default_rng(job.seed)
    picks = rng.integers(0, len(held_out), size=job.n)
    times = arrivals(job.n, job.rate, seed=job.seed + 2)
    items = [
        attrs.evolve(held_out[int(j)], index=k, arrival_s=float(times[k]))
        for k, j in enumerate(picks)
    ]
    configs = [
        EngineConfig(
            profile=profile,
            instance=name,
            served_model_name=model,
            seed=job.seed + i,
            time_model=slow,
            # Each engine answers a prompt with its model's real answer length.
            answer_lengths={it.prompt: it.outputs[model] for it in held_out},
        )
        for i, (name, model, profile) in enumerate(ALPACA_INSTANCES)
    ]
    return configs, items, pred


async def _run_async(job: _Job) -> RunSummary:
    from bearsdk.emulator import EnginePool
    from bearsdk.evaluation import drive_workload, summarize
    from bearsdk.router import AsyncRouter, InstanceConfig
    from bearsdk.selectors import make_selector

    engine_configs, items, predictor = _engines(job)
    t0 = time.perf_counter()
    async with EnginePool(engine_configs) as pool:
        by_name = {e.instance: e for e in pool}
        configs = [
            InstanceConfig(
                name=e.instance,
                url=e.url,
                model=e.model_name,
                # Each instance's own calibration, as from a profiling run on its GPU.
                batch_time=e.calibrated_batch_time(),
                snapshots="push",
            )
            for e in pool
        ]

        def lookup(instance: str, request_id: str) -> tuple[int, int] | None:
            # vLLM names a chat request ``chatcmpl-<X-Request-Id>``.
            h = by_name[instance].request(f"chatcmpl-{request_id}")
            return None if h is None else (h.plan.prompt_tokens, h.plan.output_len)

        policy = make_selector(job.policy, lam=job.lam)
        router = AsyncRouter(configs, policy, predictor=predictor)
        from bearsdk.predictors import Predictor

        covered = router.predictor
        assert isinstance(covered, Predictor)  # the one given, extended with priors
        for e in pool:
            # Each model's own tokenizer, as a deployment loads its tokenizer.json.
            covered.set_tokenizer(e.model_name, e.tokenizer.counting())
        async with router:
            await anyio.sleep(_WARMUP_S)
            results, lag = await drive_workload(router, items, tail_s=_TAIL_S, lookup=lookup)
    return summarize(
        job.policy,
        job.rate,
        results,
        lam=job.lam,
        arrival_lag_p99_s=lag,
        wall_s=time.perf_counter() - t0,
    )


def run_policy(
    policy: str,
    rate: float,
    *,
    duration_s: float = 10.0,
    seed: int = 0,
    lam: float = 5e-4,
    workload: str = "tasks",
    slowdown: float = 1.0,
) -> RunSummary:
    """One demo run: a fresh emulated pool, ``rate * duration_s`` requests, one policy.

    Args:
        policy: A built-in policy name (:data:`bearsdk.selectors.SELECTORS`).
        rate: Mean Poisson arrival rate, requests/s.
        duration_s: Span of the arrivals, seconds.
        seed: Seeds the workload and the engines (same seed, same requests).
        lam: Cost weight of the utility.
        workload: One of :data:`WORKLOADS`.
        slowdown: Emulated GPUs run this many times slower than their profiles.

    Raises:
        ValueError: An unknown workload.
        DataNotFoundError: ``"alpaca-eval"`` without the AlpacaEval data.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS} (got {workload!r})")
    n = max(1, round(rate * duration_s))
    return anyio.run(_run_async, _Job(policy, rate, n, seed, lam, slowdown, workload))


def _run_job(job: _Job) -> RunSummary:
    return anyio.run(_run_async, job)


def _run_indexed(item: tuple[int, _Job]) -> tuple[int, RunSummary]:
    return item[0], _run_job(item[1])


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (it
    # terminates the workers), so no worker prints a traceback or leaks a session.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _execute(
    jobs: Sequence[tuple[int, _Job]], workers: int
) -> Generator[tuple[int, RunSummary], None, None]:
    """Make the runs, ``workers`` at a time; yield each as it finishes.

    In worker processes that ignore SIGINT: on Ctrl-C (or when the caller stops
    early) the parent terminates them at once instead of waiting for their runs.
    """
    if workers <= 1:
        for item in jobs:
            yield _run_indexed(item)
        return
    import multiprocessing

    # fork: no re-import per worker; the parent runs no event loop or threads yet.
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    # SIGINT is held back while the workers start, so that none starts without
    # ignoring it, and a Ctrl-C meanwhile reaches the parent once they have.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ctx.Pool(workers, initializer=_worker_init)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        raise
    with pool:  # leaving it terminates the workers
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        yield from pool.imap_unordered(_run_indexed, jobs)


_ORDER = (*DEMO_PROFILES, *(name for name, _, _ in ALPACA_INSTANCES))


def _table(summaries: Sequence[RunSummary], rates: Sequence[float]) -> str:
    return demo_report.table(summaries, rates, _ORDER, MAX_ARRIVAL_LAG_S)


_MAX_DURATION_S = 3600.0  # an hour of arrivals per run: far past any useful demo, bounded memory
_MAX_RATE = 1000.0  # requests/s: far above what emulated engines serve in real time
_MAX_SLOWDOWN = 1000.0


def _bounded(
    kind: Callable[[str], float], flag: str, lo: float, hi: float, *, lo_ok: bool = False
) -> Callable[[str], float]:
    """``type=`` for a number in ``(lo, hi]`` (``[lo, hi]`` with ``lo_ok``)."""
    what = f"{'>=' if lo_ok else '>'} {lo:g} and <= {hi:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} must be a number {what} (got {text[:40]!r})"
            ) from None
        if not (math.isfinite(value) and (lo <= value if lo_ok else lo < value) and value <= hi):
            raise argparse.ArgumentTypeError(f"{flag} must be {what} (got {text[:40]!r})")
        return value

    return parse


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--rates must be comma-separated numbers (got {text!r})"
        ) from None
    if not rates or any(not (math.isfinite(r) and 0 < r <= _MAX_RATE) for r in rates):
        raise argparse.ArgumentTypeError(
            f"--rates must be numbers > 0 and <= {_MAX_RATE:g} (got {text[:60]!r})"
        )
    return rates


def _policies(text: str) -> list[str]:
    from bearsdk.selectors import SELECTORS

    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        if n not in SELECTORS:
            raise argparse.ArgumentTypeError(
                f"--policies: {n!r} is not a policy (known: {', '.join(SELECTORS)})"
            )
    return names


_SLOWDOWN = {"tasks": 3.0, "alpaca-eval": 10.0, "agents": 10.0}
"""Default ``--slowdown`` per workload: AlpacaEval prompts (~40 tokens) prefill in
microseconds, so its engines must be slower for the TTFT targets to bind."""


def _run_agents(args: argparse.Namespace) -> int:
    from bearsdk.cli.demo_agents import AGENT_ROUTERS, agents_table, run_agents

    rates = args.rates or [2.0, 4.0, 8.0]
    print(
        f"bearsdk demo --workload agents: {len(AGENT_ROUTERS)} routers x {len(rates)} session "
        f"rates, {args.duration:g} s of session arrivals each, one run at a time",
        flush=True,
    )
    runs = run_agents(rates, duration_s=args.duration, seed=args.seed, slowdown=args.slowdown)
    print()
    print(agents_table(runs, args.slowdown))
    return 0


def _run(args: argparse.Namespace) -> int:
    from bearsdk.cli import writable_file

    if args.slowdown is None:
        args.slowdown = _SLOWDOWN[args.workload]
    if args.workload == "agents":
        return _run_agents(args)
    if args.rates is None:
        args.rates = [4.0, 10.0, 16.0]
    if args.plot is not None:
        # Before the runs: an unwritable plot must not cost the whole demo.
        writable_file(str(args.plot), "--plot")
    jobs = [
        _Job(
            p,
            r,
            max(1, round(r * args.duration)),
            args.seed,
            args.lam,
            args.slowdown,
            args.workload,
        )
        for r in args.rates
        for p in args.policies
    ]
    from bearsdk.replay import IMPLEMENTATION

    if args.jobs is not None:
        workers = min(args.jobs, len(jobs))
        chosen = ""
    else:
        cpus = usable_cpus()
        busy = measured_busy(cpus)
        workers = default_jobs(len(cpus), busy, len(jobs))
        chosen = f" ({len(cpus)} core(s), {busy:.1f} busy)"
    if args.workload == "alpaca-eval":
        from bearsdk.data import data_dir

        # Missing data is a one-line error naming the data set and its source.
        os.environ["BEARSDK_DATA"] = str(data_dir(args.data_dir, "alpaca-eval"))
        pred, held_out = _alpaca()  # before forking: the workers inherit it
        rel = "with" if pred.relative is not None else "without"
        engines = ", ".join(f"{m} on {p}" for _, m, p in ALPACA_INSTANCES)
        what = (
            f"held-out AlpacaEval prompts ({len(held_out)}; predictor trained on the other "
            f"half, {rel} a relative-accuracy head; data CC BY-NC 4.0, evaluation only)"
        )
    else:
        engines = ", ".join(DEMO_PROFILES)
        what = "the paper's four tasks"
    done: dict[int, RunSummary] = {}
    t0 = time.perf_counter()
    try:
        print(
            f"bearsdk demo: {len(args.policies)} policies x {len(args.rates)} arrival rates on "
            f"3 emulated engines ({engines}; {args.slowdown:g}x slower), {args.duration:g} s of "
            f"Poisson arrivals of {what} each, lam={args.lam:g}, replay: {IMPLEMENTATION}, "
            f"{workers} worker(s){chosen}",
            flush=True,
        )
        _make_runs(jobs, workers, done, t0)
    except KeyboardInterrupt:
        # The finished runs are results: show them, then let the command line
        # report the interruption (one line, exit 130).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        finished = [done[i] for i in sorted(done)]
        print(f"\ninterrupted: {len(finished)} of {len(jobs)} run(s) finished", flush=True)
        if finished:
            print(_table(finished, args.rates), flush=True)
        raise
    summaries = [done[i] for i in sorted(done)]
    print(_table(summaries, args.rates))
    lagged = [s for s in summaries if demo_report.unreliable(s, MAX_ARRIVAL_LAG_S)]
    if lagged:
        worst = max(s.arrival_lag_p99_s for s in lagged)
        print(
            f"\n! unreliable: {len(lagged)} run(s) sent requests late even when rerun (p99 "
            f"up to {worst * 1e3:.0f} ms, limit {MAX_ARRIVAL_LAG_S * 1e3:.0f} ms): the machine "
            "is busy with other work, so the emulated engines ran behind real time and "
            "those rows may rank the policies wrongly; rerun on a quieter machine."
        )
    if args.plot is not None:
        try:
            demo_report.svg(summaries, args.plot)
        except OSError as exc:
            from bearsdk.cli import error_line

            print(f"bearsdk demo: error: --plot: {error_line(exc)}", file=sys.stderr)
            return 2
        print(f"\nplot: {args.plot}")
    return 0


def _make_runs(jobs: Sequence[_Job], workers: int, done: dict[int, RunSummary], t0: float) -> None:
    """Make every run into ``done`` (by job index), rerunning those that lagged."""
    todo = list(range(len(jobs)))
    attempt = 0
    while todo:
        tag = "" if attempt == 0 else f" (rerun {attempt})"
        finished = 0
        with contextlib.closing(_execute([(i, jobs[i]) for i in todo], workers)) as runs:
            for i, s in runs:
                finished += 1
                old = done.get(i)
                # A rerun replaces a run only if it lagged less.
                if old is None or s.arrival_lag_p99_s < old.arrival_lag_p99_s:
                    done[i] = s
                print(
                    f"  [{finished:2}/{len(todo)}]{tag} {s.policy:17} {s.rate:5g} req/s  "
                    f"OnTimeUtility {s.on_time_utility:6.3f}  SLO {s.attainment:4.0%}  "
                    f"lag p99 {s.arrival_lag_p99_s * 1e3:4.0f} ms  "
                    f"({s.wall_s:4.1f} s, {time.perf_counter() - t0:5.1f} s elapsed)",
                    flush=True,
                )
        late, fewer = rerun_plan([done[i].arrival_lag_p99_s for i in todo], workers, attempt)
        if late:
            print(
                f"  {len(late)} run(s) sent requests late (p99 > "
                f"{MAX_ARRIVAL_LAG_S * 1e3:.0f} ms): rerunning them, {fewer} at a time",
                flush=True,
            )
        todo, workers = [todo[k] for k in late], fewer
        attempt += 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="the main job: BEAR and the baselines route a workload over 3 emulated engines",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=None,
        help="arrival rates, requests/s, comma-separated (default: 4,10,16; with "
        "--workload agents: sessions/s, default 2,4,8)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=list(DEMO_POLICIES),
        help="policies, comma-separated (default: BEAR, Prefill-TPS and the 7 baselines)",
    )
    p.add_argument(
        "--duration",
        type=_bounded(float, "--duration", 0.0, _MAX_DURATION_S),
        default=8.0,
        help="seconds of arrivals per run (default 8)",
    )
    p.add_argument(
        "--slowdown",
        type=_bounded(float, "--slowdown", 0.0, _MAX_SLOWDOWN),
        default=None,
        help="emulated GPUs run this many times slower than their profiles, so that rates "
        "this machine can emulate in real time load them (default 3; 10 with "
        "--workload alpaca-eval, whose prompts are short)",
    )
    p.add_argument(
        "--lam",
        type=_bounded(float, "--lam", 0.0, 1e6, lo_ok=True),
        default=5e-4,
        help="cost weight (default 5e-4)",
    )
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="tasks",
        help="the paper's four tasks on the Qwen3 pool (default), held-out AlpacaEval "
        "prompts with real judgements and answer lengths on the FuseChat-3.0 pool "
        "(needs the AlpacaEval data: --data-dir or BEARSDK_DATA, see docs/data.md), or "
        "multi-turn agent sessions on prefix-caching engines, BEAR with and without the cache",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder holding the data sets (default: $BEARSDK_DATA); only --workload alpaca-eval "
        "reads it",
    )
    p.add_argument(
        "--seed",
        type=_bounded(int, "--seed", 0, 2**32 - 1, lo_ok=True),
        default=0,
        help="workload and engine seed",
    )
    p.add_argument(
        "--jobs",
        type=_bounded(int, "--jobs", 1, 1024, lo_ok=True),
        default=None,
        help="parallel runs (default: one per idle core, measured at start)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("bearsdk-demo.svg"),
        help="where to save the plot (default bearsdk-demo.svg)",
    )
    p.add_argument("--no-plot", dest="plot", action="store_const", const=None)
    p.set_defaults(func=_run)
