"""``bearsdk bench replicas``: router replicas sharing state over Redis, against one router.

The same Poisson workload of the paper's four tasks (appendix A.2 TTFT targets)
goes, as streamed chat requests, through each setup on a fresh pool of emulated
engines (Qwen3-0.6B, two Qwen3-8B and Qwen3-32B; GPUs ``--slowdown`` times slower
than the profiled H100s, as in ``bearsdk demo``, so that this machine saturates
them in real time). With several replicas, requests are dealt to them in turn,
as a load balancer in front of application replicas would:

``single``
    One router takes all the traffic (the reference).
``independent``
    ``--replicas`` routers, each following the engines itself and seeing only
    its own dispatches (what N unrelated routers do).
``independent-pod``
    As ``independent``, with power-of-d tie-breaking.
``redis-snapshots``
    As ``independent``, with snapshots through Redis (a
    :class:`~bearsdk.cluster.RedisSnapshotBridge` follows the engines).
``shared``
    ``--replicas`` routers in a :class:`~bearsdk.cluster.Cluster`: snapshots
    through Redis (a :class:`~bearsdk.cluster.RedisSnapshotBridge` follows the
    engines), the shared dispatch overlay, power-of-d tie-breaking.
``shared-nopod``
    As ``shared``, ties broken toward the pool's first instance.
``shared-direct``
    As ``shared``, with each router following the engines itself (only
    dispatches go through Redis).
``kill``
    As ``shared``, with the Redis server killed a third into the arrivals and
    restarted at two thirds; scored per phase.

``--sim`` runs the same routers against simulated engines in virtual time
instead (``bearsdk/bench/_replicas_sim.py``): exact and repeatable, with the
snapshots' age and the bus latency as parameters (there ``kill`` is the bus
losing every event for the middle third), plus ``single-pod``, one router with
power-of-d ties, the reference for ``shared``.

Emulator setups run one after the other. In each, the engines, the bridge and
every router run in processes of their own, as they would on separate machines
(on one event loop, routers' work would slow the emulated GPUs down and delay
each other's snapshots), against a ``redis-server`` of its own (``--redis``
names an existing one instead; ``kill`` always starts its own). Requests cut
off after the last first token are charged their predicted output length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Final

import anyio
import attrs

from bearsdk.cli import nonnegative_float, positive_float, positive_int
from bearsdk.emulator.text import Tokenizer
from bearsdk.evaluation import RequestResult, RunSummary, drive_workload, summarize

__all__ = ["MODES", "POOL", "ModeResult", "register", "run_mode"]

POOL: Final = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100")
"""The emulated pool: the paper's three models, the middle one twice (near-equal rivals)."""

MODES: Final = (
    "single",
    "independent",
    "independent-pod",
    "redis-snapshots",
    "shared",
    "shared-nopod",
    "shared-direct",
    "kill",
)
"""The setups (see the module documentation)."""

_DEFAULT_MODES: Final = ("single", "independent", "shared", "kill")
"""The emulator runs ``bearsdk bench replicas`` makes unless told otherwise."""
_REDIS_MODES: Final = ("redis-snapshots", "shared", "shared-nopod", "shared-direct", "kill")
_PREFIX: Final = "bench"
_TAIL_S = 1.3  # longer than the largest A.2 target: every first-token outcome is known
_WARMUP_S = 1.0  # first snapshots reach every replica (through Redis too)


@attrs.frozen
class _Job:
    mode: str
    replicas: int
    rate: float
    duration_s: float
    seed: int
    lam: float
    slowdown: float
    snapshots: str
    poll_interval_s: float
    redis_url: str | None


@attrs.frozen
class ModeResult:
    """One setup's outcome.

    Attributes:
        mode: The setup.
        replicas: Routers that took the traffic.
        summary: The whole run, scored.
        phases: The run scored by arrival phase (``before``, ``outage``,
            ``after``: thirds of the arrivals; the outage of ``kill``).
        failovers: Switches of Redis sources to their direct fallback.
        foreign: Other replicas' dispatches added to views (summed over replicas).
        events_dropped: Dispatch events never sent (summed over replicas).
    """

    mode: str
    replicas: int
    summary: RunSummary
    phases: dict[str, RunSummary] = attrs.field(factory=dict)
    failovers: int = 0
    foreign: int = 0
    events_dropped: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready record."""

        def s(x: RunSummary) -> dict[str, Any]:
            return {
                "n": x.n,
                "on_time_utility": round(x.on_time_utility, 4),
                "attainment": round(x.attainment, 4),
                "ttft_p50_s": round(x.ttft_p50_s, 4),
                "ttft_p99_s": round(x.ttft_p99_s, 4),
                "failed": x.failed,
                "ttft_mape": round(x.ttft_mape, 4),
                "composition": {k: round(v, 3) for k, v in x.composition.items()},
                "arrival_lag_p99_s": round(x.arrival_lag_p99_s, 4),
            }

        return {
            "mode": self.mode,
            "replicas": self.replicas,
            **s(self.summary),
            "phases": {k: s(v) for k, v in self.phases.items()},
            "failovers": self.failovers,
            "foreign_dispatches": self.foreign,
            "events_dropped": self.events_dropped,
        }


def _policy(lam: float, pod: bool) -> Any:
    from bearsdk.cluster import PowerOfD
    from bearsdk.selectors import BEAR

    return PowerOfD(BEAR(lam=lam)) if pod else BEAR(lam=lam)


async def _engines(conn: Connection, job: _Job) -> None:
    """The engine process: the emulated pool, until the parent says stop."""
    from bearsdk.emulator import EnginePool, GroundTruthParams
    from bearsdk.router import InstanceConfig

    slow = GroundTruthParams(time_scale=job.slowdown)
    async with EnginePool.of(*POOL, seed=job.seed, time_model=slow) as pool:
        configs = [
            InstanceConfig(
                name=e.instance,
                url=e.url,
                model=e.model_name,
                # Each instance's own calibration, as from a profiling run on its GPU.
                batch_time=e.calibrated_batch_time(),
                snapshots="push",
                poll_interval_s=job.poll_interval_s,
            )
            for e in pool
        ]
        conn.send(configs)
        await anyio.to_thread.run_sync(conn.recv)


async def _bridge(conn: Connection, job: _Job, configs: list[Any], url: str) -> None:
    """The bridge process: follows the engines and writes their snapshots to Redis."""
    from bearsdk.cluster import RedisBus, RedisSnapshotBridge
    from bearsdk.io import PollSource, PushSource, SnapshotSource

    sources: dict[str, SnapshotSource] = {
        c.name: (
            PollSource(c.bear_url, interval_s=job.poll_interval_s, name=f"bridge:{c.name}")
            if job.snapshots == "poll"
            else PushSource(c.bear_url, name=f"bridge:{c.name}")
        )
        for c in configs
    }
    async with anyio.create_task_group() as tg:
        await tg.start(RedisSnapshotBridge(RedisBus(url, prefix=_PREFIX), sources).run)
        conn.send("ready")
        await anyio.to_thread.run_sync(conn.recv)
        tg.cancel_scope.cancel()


async def _replica(
    conn: Connection, job: _Job, configs: list[Any], url: str | None, share: int
) -> None:
    """A replica process: one router driving its share of the workload."""
    from bearsdk.cluster import Cluster, RedisBus
    from bearsdk.router import AsyncRouter
    from bearsdk.workload import synthetic_workload

    mode = job.mode
    n_routers = 1 if mode == "single" else job.replicas
    redis = mode in _REDIS_MODES
    items = synthetic_workload(max(1, round(job.rate * job.duration_s)), job.rate, seed=job.seed)
    mine = items[share::n_routers]
    cluster = None
    if redis:
        assert url is not None
        bus = RedisBus(url, prefix=_PREFIX)
        cluster = Cluster(bus, share_dispatches=mode != "redis-snapshots")
        if mode != "shared-direct":
            configs = [attrs.evolve(c, snapshots="redis") for c in configs]
    if job.snapshots == "poll" and configs[0].snapshots != "redis":
        configs = [attrs.evolve(c, snapshots="poll") for c in configs]
    pod = mode in ("shared", "independent-pod", "kill")
    router = AsyncRouter(configs, _policy(job.lam, pod), cluster=cluster)
    tok = Tokenizer().counting()
    from bearsdk.predictors import Predictor

    covered = router.predictor
    assert isinstance(covered, Predictor)  # the default one, extended with priors
    for c in configs:
        covered.set_tokenizer(c.model, tok)
    async with router:
        conn.send("ready")
        start_at = await anyio.to_thread.run_sync(conn.recv)
        await anyio.sleep(max(0.0, start_at - time.time()))
        results, lag = await drive_workload(router, mine, tail_s=_TAIL_S)
    failovers = foreign = dropped = 0
    if cluster is not None:
        failovers = sum(s.failovers for s in cluster.sources.values())
        foreign = cluster.overlay.stats().applied if cluster.overlay is not None else 0
        dropped = cluster.bus.stats().events_dropped
    conn.send((results, lag, failovers, foreign, dropped))


def _child(target: Any, conn: Connection, *args: Any) -> None:
    """Entry point of a worker process: run ``target`` and report a failure to the parent."""
    try:
        anyio.run(target, conn, *args)
    except BaseException as exc:
        with contextlib.suppress(OSError, ValueError):
            conn.send(f"error: {type(exc).__name__}: {exc}")
        raise


def _recv(conn: Connection, what: str, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"bench replicas: {what}: no answer within {timeout_s:g} s")
    got = conn.recv()
    if isinstance(got, str) and got.startswith("error: "):
        raise RuntimeError(f"bench replicas: {what} failed: {got[7:]}")
    return got


def _run(job: _Job) -> ModeResult:
    """Run one setup: engines, bridge and replicas each in a process of its own."""
    import multiprocessing

    from bearsdk.cluster.local import LocalRedis
    from bearsdk.workload import synthetic_workload

    # fork: the children inherit the imported package (no re-import per process).
    ctx: Any = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    mode = job.mode
    n_routers = 1 if mode == "single" else job.replicas
    redis = mode in _REDIS_MODES
    server: LocalRedis | None = None
    procs: list[Any] = []
    conns: list[Connection] = []

    def spawn(target: Any, *args: Any) -> Connection:
        parent: Connection
        child: Connection
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(target, child, *args), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
        return parent

    try:
        if redis and (job.redis_url is None or mode == "kill"):
            server = LocalRedis().start()
        url = server.url if server is not None else job.redis_url
        engines = spawn(_engines, job)
        configs = _recv(engines, "engines", 60.0)
        if redis and mode != "shared-direct":
            assert url is not None
            _recv(spawn(_bridge, job, configs, url), "bridge", 60.0)
        replicas = [spawn(_replica, job, configs, url, j) for j in range(n_routers)]
        for j, c in enumerate(replicas):
            _recv(c, f"replica {j}", 120.0)
        start_at = time.time() + _WARMUP_S
        for c in replicas:
            c.send(start_at)
        if mode == "kill":
            assert server is not None
            time.sleep(max(0.0, start_at + job.duration_s / 3 - time.time()))
            server.kill()
            time.sleep(max(0.0, start_at + 2 * job.duration_s / 3 - time.time()))
            server.start()
        results: list[RequestResult] = []
        lags: list[float] = []
        failovers = foreign = dropped = 0
        for j, c in enumerate(replicas):
            res, lag, f, fo, dr = _recv(c, f"replica {j}", job.duration_s + 120.0)
            results.extend(res)
            lags.append(lag)
            failovers, foreign, dropped = failovers + f, foreign + fo, dropped + dr
        wall = time.time() - start_at
    finally:
        for c in conns:
            with contextlib.suppress(OSError, ValueError):
                c.send("stop")
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.terminate()
                p.join()
        if server is not None:
            server.stop()
    results.sort(key=lambda r: r.index)
    summary = summarize(
        mode, job.rate, results, lam=job.lam, arrival_lag_p99_s=max(lags), wall_s=wall
    )
    # Scored by arrival phase for every setup: ``kill``'s phases compare with
    # ``shared``'s (the same requests, no outage), not with each other (the
    # engines start empty, so the first third is always the easiest).
    phases: dict[str, RunSummary] = {}
    if results:
        items = synthetic_workload(len(results), job.rate, seed=job.seed)
        arrival = {it.index: it.arrival_s for it in items}
        third = job.duration_s / 3
        for name, lo, hi in (
            ("before", 0.0, third),
            ("outage", third, 2 * third),
            ("after", 2 * third, math.inf),
        ):
            part = [r for r in results if lo <= arrival[r.index] < hi]
            if part:
                phases[name] = summarize(name, job.rate, part, lam=job.lam)
    return ModeResult(mode, n_routers, summary, phases, failovers, foreign, dropped)


def run_mode(
    mode: str,
    *,
    replicas: int = 4,
    rate: float = 20.0,
    duration_s: float = 15.0,
    seed: int = 0,
    lam: float = 5e-4,
    slowdown: float = 3.0,
    snapshots: str = "push",
    poll_interval_s: float = 0.1,
    redis_url: str | None = None,
) -> ModeResult:
    """Run one setup (see the module documentation) and score it.

    Raises:
        ValueError: Unknown mode or snapshot transport.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    if snapshots not in ("push", "poll"):
        raise ValueError(f"snapshots must be 'push' or 'poll' (got {snapshots!r})")
    job = _Job(
        mode, replicas, rate, duration_s, seed, lam, slowdown, snapshots, poll_interval_s, redis_url
    )
    return _run(job)


def _table(groups: dict[str, list[ModeResult]], refs: Sequence[str]) -> str:
    """One row per setup: medians over seeds (the range when there are several)."""

    def med(xs: list[float]) -> float:
        return float(statistics.median(xs))

    def otu(mode: str) -> float:
        return med([r.summary.on_time_utility for r in groups.get(mode, [])] or [math.nan])

    head = f"  {'setup':16} {'routers':>7} {'OnTimeUtility':>13} {'range':>13} {'SLO':>6}"
    head += "".join(f" {'vs ' + ref:>16}" for ref in refs if ref in groups)
    head += f" {'TTFT p50':>9} {'p99':>7} {'failed':>6} {'foreign':>8} {'failovers':>9}"
    lines = [head]

    def row(label: str, routers: int, runs: list[RunSummary], extra: list[ModeResult]) -> str:
        u = [x.on_time_utility for x in runs]
        span = f"{min(u):.3f}-{max(u):.3f}" if len(u) > 1 else ""
        text = f"  {label:16} {routers:7} {med(u):13.3f} {span:>13} "
        text += f"{med([x.attainment for x in runs]):6.1%}"
        for ref in refs:
            if ref in groups:
                base = otu(ref)
                rel = f"{med(u) / base - 1:+.1%}" if base > 0 and extra else ""
                text += f" {rel:>16}"
        text += f" {med([x.ttft_p50_s for x in runs]) * 1e3:7.0f}ms"
        text += f" {med([x.ttft_p99_s for x in runs]) * 1e3:5.0f}ms {sum(x.failed for x in runs):6}"
        if extra:
            text += f" {sum(r.foreign for r in extra):8} {sum(r.failovers for r in extra):9}"
        return text

    for mode, runs in groups.items():
        lines.append(row(mode, runs[0].replicas, [r.summary for r in runs], runs))
        if mode not in ("kill", "shared", "independent") or "kill" not in groups:
            continue
        for phase in runs[0].phases:
            parts = [r.phases[phase] for r in runs if phase in r.phases]
            lines.append(row(f"  {phase}", runs[0].replicas, parts, []))
    return "\n".join(lines)


def _names(known: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(
                    f"{name!r} is not a setup (known: {', '.join(known)})"
                )
        if not names:
            raise argparse.ArgumentTypeError("name at least one setup")
        return names

    return parse


def _numbers(kind: type[float] | type[int], what: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            out = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated numbers (got {text!r})"
            ) from None
        if not out or any(not math.isfinite(x) or x < 0 for x in out):
            raise argparse.ArgumentTypeError(f"must be numbers >= 0 (got {text!r})")
        return out

    return parse


def _report(groups: dict[str, list[ModeResult]], refs: Sequence[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps({m: [r.as_dict() for r in rs] for m, rs in groups.items()}, indent=2))
    else:
        print(_table(groups, refs))


def _main_sim(args: argparse.Namespace) -> int:
    from bearsdk.bench._replicas_sim import SIM_MODES, simulate

    modes = args.modes or list(SIM_MODES)
    bad = [m for m in modes if m not in SIM_MODES]
    if bad:
        print(f"bearsdk bench replicas --sim: {', '.join(bad)}: not simulated "
              f"(known: {', '.join(SIM_MODES)})")  # fmt: skip
        return 2
    n = args.requests
    if not args.json:
        print(
            f"bearsdk bench replicas --sim: {n} requests at {args.rate:g} req/s in virtual time "
            f"over {len(POOL)} simulated engines ({', '.join(POOL)}), slowdown "
            f"{args.slowdown:g}, {args.replicas} replicas, dispatch events "
            f"{args.bus_latency * 1e3:g} ms between replicas, seeds "
            f"{','.join(map(str, args.seeds))}",
            flush=True,
        )
    for delay in args.snapshot_delay:
        groups: dict[str, list[ModeResult]] = {}
        for mode in modes:
            for seed in args.seeds:
                r = simulate(
                    mode,
                    profiles=POOL,
                    replicas=args.replicas,
                    rate=args.rate,
                    n=n,
                    seed=seed,
                    lam=args.lam,
                    slowdown=args.slowdown,
                    snapshot_delay_s=delay,
                    bus_latency_s=args.bus_latency,
                )
                groups.setdefault(mode, []).append(
                    ModeResult(mode, r.replicas, r.summary, r.phases, foreign=r.foreign)
                )
        if not args.json:
            print(f"\nsnapshots {delay * 1e3:g} ms old at each decision")
        _report(groups, ("single", "single-pod"), args.json)
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.sim:
        return _main_sim(args)
    from bearsdk.cluster.local import LocalRedis, LocalRedisError

    modes = args.modes or list(_DEFAULT_MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"bearsdk bench replicas: {', '.join(bad)}: unknown (known: {', '.join(MODES)})")
        return 2
    if any(m in _REDIS_MODES for m in modes):
        try:
            LocalRedis().start().stop()  # fail early and clearly without redis-server
        except LocalRedisError as exc:
            if args.redis is None or "kill" in modes:
                print(f"bearsdk bench replicas: {exc}")
                return 2
    if not args.json:
        print(
            f"bearsdk bench replicas: {args.rate:g} req/s for {args.duration:g} s "
            f"({round(args.rate * args.duration)} requests) over {len(POOL)} emulated engines "
            f"({', '.join(POOL)}), slowdown {args.slowdown:g}, snapshots {args.snapshots}"
            + (f" every {args.poll_interval * 1e3:g} ms" if args.snapshots == "poll" else "")
            + f", {args.replicas} replicas, seeds {','.join(map(str, args.seeds))}",
            flush=True,
        )
    groups: dict[str, list[ModeResult]] = {}
    # Seeds outermost: a busy spell of the machine then hits every setup alike.
    for seed in args.seeds:
        for mode in modes:
            r = run_mode(
                mode,
                replicas=args.replicas,
                rate=args.rate,
                duration_s=args.duration,
                seed=seed,
                lam=args.lam,
                slowdown=args.slowdown,
                snapshots=args.snapshots,
                poll_interval_s=args.poll_interval,
                redis_url=args.redis,
            )
            groups.setdefault(mode, []).append(r)
            if not args.json:
                s = r.summary
                print(
                    f"  seed {seed} {mode:16} OnTimeUtility {s.on_time_utility:6.3f}  "
                    f"SLO {s.attainment:6.1%}  failed {s.failed}  ({s.wall_s:4.1f} s)",
                    flush=True,
                )
    _report(groups, ("single",), args.json)
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "replicas",
        help="router replicas sharing snapshots and dispatches over Redis vs one router",
        description="Emulated engines in real time, real Redis (default), or --sim: the "
        "same routers against simulated engines in virtual time (exact, repeatable).",
    )
    p.add_argument(
        "--modes",
        type=_names((*MODES, "single-pod")),
        default=None,
        help=f"setups, comma-separated (default: {','.join(_DEFAULT_MODES)}; with --sim, "
        f"every simulated one; known: {','.join(MODES)},single-pod)",
    )
    p.add_argument("--sim", action="store_true", help="virtual time (simulated engines and bus)")
    p.add_argument("--replicas", type=positive_int, default=4, help="routers in the replica setups")
    p.add_argument("--rate", type=positive_float, default=32.0, help="arrival rate, requests/s")
    p.add_argument(
        "--seeds",
        type=_numbers(int, "--seeds"),
        default=[0],
        help="workload and engine seeds, comma-separated (medians over them)",
    )
    p.add_argument(
        "--slowdown", type=positive_float, default=3.0, help="emulated GPUs this many times slower"
    )
    p.add_argument("--lam", type=nonnegative_float, default=5e-4, help="cost weight (default 5e-4)")
    emu = p.add_argument_group("emulator runs")
    emu.add_argument(
        "--duration", type=positive_float, default=20.0, help="seconds of arrivals per run"
    )
    emu.add_argument(
        "--snapshots",
        choices=("push", "poll"),
        default="push",
        help="how routers (or the bridge) follow the engines (default push: every step)",
    )
    emu.add_argument(
        "--poll-interval",
        type=positive_float,
        default=0.1,
        help="seconds between polls (--snapshots poll)",
    )
    emu.add_argument(
        "--redis", default=None, help="an existing server's URL (default: start redis-server)"
    )
    sim = p.add_argument_group("--sim runs")
    sim.add_argument("--requests", type=positive_int, default=1000, help="requests per run")
    sim.add_argument(
        "--snapshot-delay",
        type=_numbers(float, "--snapshot-delay"),
        default=[0.0, 0.05],
        help="age of the snapshots at each decision, seconds, comma-separated (default 0,0.05)",
    )
    sim.add_argument(
        "--bus-latency",
        type=nonnegative_float,
        default=0.001,
        help="delay of dispatch events between replicas, seconds (default 0.001)",
    )
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
