"""``bearsdk demo``: the main job on embedded defaults.

Three emulated vLLM engines (Qwen3-0.6B and 8B on one H100 each, Qwen3-32B on
two) run in process and in real time; a Poisson workload of the paper's four
tasks, each request with its appendix A.2 TTFT target, goes through
:class:`~bearsdk.router.AsyncRouter` as streamed chat requests, once per policy
and arrival rate, each run on fresh engines with the same requests. The table
shows OnTimeUtility (eq. 6), SLO attainment and where the requests went; the
plot (SVG, no plotting library needed) shows OnTimeUtility against the rate.

With ``--workload alpaca-eval`` (needs the shared data) the pool is the
default real-data pool, FuseChat-3.0 Llama-3.2-1B / Qwen-2.5-7B / Gemma-2-9B,
on the emulator profiles nearest in size; each request is a held-out AlpacaEval
instruction (odd ids) whose true accuracy on each model is that model's
AlpacaEval 2.0 judgement, and each engine answers it with that model's real
answer length; the router's predictor is trained in place on the even ids.
AlpacaEval data are CC BY-NC 4.0: read in place, for evaluation only.

Runs go in parallel worker processes (``--jobs``, default: one per core) so
that one run's engines do not steal another's event loop.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import attrs
import numpy as np

from bearsdk.evaluation import RunSummary, drive_workload, summarize
from bearsdk.replay import IMPLEMENTATION

if TYPE_CHECKING:
    from bearsdk.emulator import EngineConfig
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

WORKLOADS = ("tasks", "alpaca-eval")
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
    from bearsdk.estimators.dense import shared_data_dir
    from bearsdk.predictors import FUSECHAT3_POOL, TrainConfig, read_alpaca_eval
    from bearsdk.predictors.training import train_predictor
    from bearsdk.workload import alpaca_prompts

    root = shared_data_dir()
    if root is None or not (root / "alpaca_eval" / "prompts.csv").is_file():
        raise FileNotFoundError(
            "--workload alpaca-eval needs the AlpacaEval tables of the shared data "
            "(shared/data/alpaca_eval); set BEARSDK_SHARED to the shared folder"
        )
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
        for e in pool:
            # Each model's own tokenizer, as a deployment loads its tokenizer.json.
            router.predictor.set_tokenizer(e.model_name, e.tokenizer.counting())
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
        FileNotFoundError: ``"alpaca-eval"`` without the shared data.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS} (got {workload!r})")
    n = max(1, round(rate * duration_s))
    return anyio.run(_run_async, _Job(policy, rate, n, seed, lam, slowdown, workload))


def _run_job(job: _Job) -> RunSummary:
    return anyio.run(_run_async, job)


def _short(instance: str) -> str:
    return instance.split("-h100")[0].split("-2xh100")[0].removeprefix("qwen3-")


def _predicts_ttft(policy: str) -> bool:
    from bearsdk.selectors import make_selector

    return make_selector(policy).latency in ("bea", "prefill-tps")


_ORDER = (*DEMO_PROFILES, *(name for name, _, _ in ALPACA_INSTANCES))


def _table(summaries: Sequence[RunSummary], rates: Sequence[float]) -> str:
    instances = sorted(
        {k for s in summaries for k in s.composition if k},
        key=lambda k: next((i for i, p in enumerate(_ORDER) if k.startswith(p)), 9),
    )
    head = f"  {'policy':17} {'OnTimeUtility':>13} {'SLO':>6} {'TTFT p50':>9} {'p99':>7}  "
    head += " ".join(f"{_short(i):>6}" for i in instances) + "  failed  TTFT pred. error"
    lines = []
    for rate in rates:
        rows = sorted((s for s in summaries if s.rate == rate), key=lambda s: -s.on_time_utility)
        if not rows:
            continue
        lines.append(f"\narrival rate {rate:g} req/s ({rows[0].n} requests)")
        lines.append(head)
        best = rows[0].on_time_utility
        for s in rows:
            mark = " *" if s.on_time_utility == best else "  "
            comp = " ".join(f"{s.composition.get(i, 0.0):6.0%}" for i in instances)
            # The chosen instance's predicted TTFT against the observed one (MAPE),
            # for the policies that predict a TTFT in seconds (the baselines' latency
            # scores are in their own units).
            err = f"{s.ttft_mape:15.0%}" if _predicts_ttft(s.policy) else ""
            lines.append(
                f"{mark}{s.policy:17} {s.on_time_utility:13.3f} {s.attainment:6.0%} "
                f"{s.ttft_p50_s * 1e3:7.0f}ms {s.ttft_p99_s * 1e3:5.0f}ms  {comp}  {s.failed:6}"
                f"  {err}"
            )
    return "\n".join(lines)


_COLORS = (
    "#d62728",
    "#ff7f0e",
    "#1f77b4",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _svg(summaries: Sequence[RunSummary], path: Path) -> None:
    """OnTimeUtility against arrival rate, one line per policy (plain SVG)."""
    policies = list(dict.fromkeys(s.policy for s in summaries))
    rates = sorted({s.rate for s in summaries})
    w, h, left, right, top, bottom = 760, 440, 70, 190, 40, 60
    ys = [s.on_time_utility for s in summaries]
    y_lo, y_hi = min(0.0, min(ys)), max(ys) * 1.08 or 1.0
    x_lo, x_hi = rates[0], rates[-1] if rates[-1] > rates[0] else rates[0] + 1

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * (w - left - right)

    def py(y: float) -> float:
        return h - bottom - (y - y_lo) / (y_hi - y_lo) * (h - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2 - right / 2:.0f}" y="22" text-anchor="middle" font-size="15">'
        "OnTimeUtility (eq. 6) by arrival rate</text>",
    ]
    for k in range(6):
        y = y_lo + (y_hi - y_lo) * k / 5
        out.append(
            f'<line x1="{left}" x2="{w - right}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
            f'<text x="{left - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>'
        )
    for r in rates:
        out.append(f'<text x="{px(r):.1f}" y="{h - bottom + 18}" text-anchor="middle">{r:g}</text>')
    out.append(
        f'<text x="{(left + w - right) / 2:.0f}" y="{h - 18}" text-anchor="middle">'
        "arrival rate (requests/s)</text>"
    )
    for i, pol in enumerate(policies):
        color = _COLORS[i % len(_COLORS)]
        pts = sorted((s.rate, s.on_time_utility) for s in summaries if s.policy == pol)
        path_d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        width = 3 if pol == "bear" else 1.5
        out.append(
            f'<polyline points="{path_d}" fill="none" stroke="{color}" stroke-width="{width}"/>'
        )
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = top + 10 + i * 18
        out.append(
            f'<line x1="{w - right + 15}" x2="{w - right + 35}" y1="{ly}" y2="{ly}" '
            f'stroke="{color}" stroke-width="{width}"/>'
            f'<text x="{w - right + 40}" y="{ly + 4}">{pol}</text>'
        )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--rates must be comma-separated numbers (got {text!r})"
        ) from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be positive numbers (got {text!r})")
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


_SLOWDOWN = {"tasks": 3.0, "alpaca-eval": 10.0}
"""Default ``--slowdown`` per workload: AlpacaEval prompts (~40 tokens) prefill in
microseconds, so its engines must be slower for the TTFT targets to bind."""


def _run(args: argparse.Namespace) -> int:
    if args.slowdown is None:
        args.slowdown = _SLOWDOWN[args.workload]
    if not (math.isfinite(args.slowdown) and args.slowdown > 0):
        print(f"bearsdk demo: --slowdown must be > 0 (got {args.slowdown})", file=sys.stderr)
        return 2
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
    workers = max(1, min(args.jobs or (os.cpu_count() or 1), len(jobs)))
    if args.workload == "alpaca-eval":
        try:
            pred, held_out = _alpaca()  # before forking: the workers inherit it
        except FileNotFoundError as exc:
            print(f"bearsdk demo: {exc}", file=sys.stderr)
            return 2
        rel = "with" if pred.relative is not None else "without"
        engines = ", ".join(f"{m} on {p}" for _, m, p in ALPACA_INSTANCES)
        what = (
            f"held-out AlpacaEval prompts ({len(held_out)}; predictor trained on the other "
            f"half, {rel} a relative-accuracy head; data CC BY-NC 4.0, evaluation only)"
        )
    else:
        engines = ", ".join(DEMO_PROFILES)
        what = "the paper's four tasks"
    print(
        f"bearsdk demo: {len(args.policies)} policies x {len(args.rates)} arrival rates on "
        f"3 emulated engines ({engines}; {args.slowdown:g}x slower), {args.duration:g} s of "
        f"Poisson arrivals of {what} each, lam={args.lam:g}, replay: {IMPLEMENTATION}, "
        f"{workers} worker(s)",
        flush=True,
    )
    summaries: list[RunSummary] = []
    t0 = time.perf_counter()

    def progress(s: RunSummary) -> None:
        summaries.append(s)
        print(
            f"  [{len(summaries):2}/{len(jobs)}] {s.policy:17} {s.rate:5g} req/s  "
            f"OnTimeUtility {s.on_time_utility:6.3f}  SLO {s.attainment:4.0%}  "
            f"({s.wall_s:4.1f} s, {time.perf_counter() - t0:5.1f} s elapsed)",
            flush=True,
        )

    if workers == 1:
        for job in jobs:
            progress(_run_job(job))
    else:
        import multiprocessing

        # fork: no re-import per worker; the parent runs no event loop or threads yet.
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as ex:
            futures = [ex.submit(_run_job, job) for job in jobs]
            for fut in as_completed(futures):
                progress(fut.result())
    print(_table(summaries, args.rates))
    lagged = [s for s in summaries if s.arrival_lag_p99_s > 0.05]
    if lagged:
        worst = max(s.arrival_lag_p99_s for s in lagged)
        print(
            f"\nnote: {len(lagged)} run(s) sent requests late (p99 up to {worst * 1e3:.0f} ms): "
            "the machine is busy, so the emulated engines ran behind real time; try --jobs 1."
        )
    if args.plot is not None:
        _svg(summaries, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="the main job: BEAR and the baselines route a workload over 3 emulated engines",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=[4.0, 10.0, 16.0],
        help="arrival rates, requests/s, comma-separated (default: 4,10,16)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=list(DEMO_POLICIES),
        help="policies, comma-separated (default: BEAR, Prefill-TPS and the 7 baselines)",
    )
    p.add_argument(
        "--duration", type=float, default=8.0, help="seconds of arrivals per run (default 8)"
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=None,
        help="emulated GPUs run this many times slower than their profiles, so that rates "
        "this machine can emulate in real time load them (default 3; 10 with "
        "--workload alpaca-eval, whose prompts are short)",
    )
    p.add_argument("--lam", type=float, default=5e-4, help="cost weight (default 5e-4)")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="tasks",
        help="the paper's four tasks on the Qwen3 pool (default), or held-out AlpacaEval "
        "prompts with real judgements and answer lengths on the FuseChat-3.0 pool "
        "(needs the shared data)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    p.add_argument("--jobs", type=int, default=0, help="parallel runs (default: one per core)")
    p.add_argument(
        "--plot",
        type=Path,
        default=Path("bearsdk-demo.svg"),
        help="where to save the plot (default bearsdk-demo.svg)",
    )
    p.add_argument("--no-plot", dest="plot", action="store_const", const=None)
    p.set_defaults(func=_run)
