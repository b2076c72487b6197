"""``bearsdk bench router``: what routing costs.

1. **Decision latency**: one :meth:`RouterCore.decide` call (predictors for the
   prompt, one BEA estimate per instance from its cached snapshot, the policy,
   the decision record) with 3 and 8 instances whose snapshots hold 64 resident
   requests each. Target: median ≤ 100 µs for 8 instances.
2. **Proxy overhead**: time to first chunk and to the last chunk of a streamed
   chat completion through the router versus straight to the engine, at a
   steady 200 requests/s alternating the two paths. The engine is a stub that
   answers at once (8 chunks), so the difference is the router's own cost
   (decision, dispatch, streaming pass-through). Targets: added p50 ≤ 0.5 ms,
   p99 ≤ 2 ms. The router goes by its own client (:mod:`bearsdk.io.hop` when
   ``httptools`` is installed), the direct calls by an aiohttp session.
3. **CPU per request**: the process's CPU time per streamed request at the same
   steady rate, routed and direct in alternating phases, with the stub engine
   in a child process so that only the caller and the router are counted; the
   difference is what routing costs the caller's process (snapshot polling
   included). Target: ≤ 0.3 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import aiohttp
import anyio
import orjson

from bearsdk.bench import time_call
from bearsdk.bench._stubs import stub_engine
from bearsdk.cli import positive_float, positive_int
from bearsdk.errors import BearError
from bearsdk.predictors import Predictor
from bearsdk.router import AsyncRouter, InstanceConfig
from bearsdk.router.core import RouterCore
from bearsdk.selectors import BEAR
from bearsdk.snapshot import KVState, RequestState, Snapshot

__all__ = ["register"]

PROMPT = (
    "You are a careful assistant. Read the following report and summarize its key findings "
    "in three sentences, then list two open questions it leaves unanswered. " * 6
)
PROFILES = {
    "Qwen/Qwen3-0.6B": "qwen3-0.6b-h100",
    "Qwen/Qwen3-8B": "qwen3-8b-h100",
    "Qwen/Qwen3-32B": "qwen3-32b-2xh100",
}


def _snapshot(name: str, seed: int, now: float) -> Snapshot:
    rng = random.Random(seed)
    reqs = []
    for i in range(56):
        p, o = rng.randint(200, 3000), rng.randint(1, 300)
        reqs.append(RequestState(f"d{i}", "running", p, p + o, o, None, None, 1))
    for i in range(8):
        reqs.append(RequestState(f"w{i}", "waiting", rng.randint(300, 3000), 0, 0))
    held = sum(-(-r.computed_tokens // 16) for r in reqs)
    return Snapshot.build(
        reqs, instance=name, seq=1, time=now, kv=KVState(16, 60_000, 60_000 - held - 1)
    )


def _configs(n: int, url: str = "http://127.0.0.1:9") -> list[InstanceConfig]:
    models = list(PROFILES)
    return [
        InstanceConfig(
            name=f"i{k}",
            url=url,
            model=models[k % 3],
            profile=PROFILES[models[k % 3]],
            snapshots="poll",
            scheduler_params={"max_num_batched_tokens": 8192, "max_num_seqs": 256},
        )
        for k in range(n)
    ]


def decision_latency(n: int, rounds: int) -> dict[str, Any]:
    """Median/p99 of ``decide`` with ``n`` instances holding fresh snapshots."""
    # A frozen clock keeps every snapshot fresh, as a live push source would:
    # this measures the steady state, not fast-forwarding of aging snapshots.
    t0 = time.time()
    pred = Predictor.load_default()
    router = RouterCore(_configs(n), BEAR(), predictor=pred, clock=lambda: t0)
    for k, name in enumerate(router.instances):
        router.cache(name).offer(_snapshot(name, k, t0))
    msgs = [{"role": "user", "content": PROMPT}]
    d = router.decide(msgs, ttft_target=0.5)
    modes = sorted({c.estimator for c in d.candidates})
    t = time_call(lambda: router.decide(msgs, ttft_target=0.5), batch=20, rounds=rounds, warmup=5)
    # The predictors alone, for the breakdown: what decide() calls.
    tp = time_call(lambda: pred.predict_lists(PROMPT), batch=20, rounds=rounds, warmup=5)
    return {
        "instances": n,
        "decide": t.as_dict(),
        "predictors_only": tp.as_dict(),
        "estimators": modes,
    }


async def proxy_overhead(rate: float, seconds: float) -> dict[str, Any]:
    """Added time-to-first-chunk and time-to-last-chunk of routing a stream.

    Raises:
        BearError: ``rate * seconds`` is under 2 requests: one path would get none.
    """
    n = int(rate * seconds) if rate > 0 and seconds > 0 else 0
    if n < 2:
        raise BearError(
            f"the proxy test needs at least 2 requests, one per path: --rate {rate:g} x "
            f"--seconds {seconds:g} gives {n}"
        )
    messages = [{"role": "user", "content": PROMPT}]
    body = {"messages": messages, "stream": True, "max_tokens": 8}
    direct: dict[str, list[float]] = {"first": [], "last": []}
    routed: dict[str, list[float]] = {"first": [], "last": []}
    async with anyio.create_task_group() as tg:
        url = await tg.start(stub_engine)
        cfgs = _configs(3, url)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            async with AsyncRouter(cfgs, BEAR(), calibrate=False) as router:

                async def via_router() -> None:
                    t0 = time.perf_counter()
                    first = None
                    stream = await router.chat(messages, stream=True, max_tokens=8)
                    async for _ in stream:
                        if first is None:
                            first = time.perf_counter() - t0
                    routed["first"].append(first or 0.0)
                    routed["last"].append(time.perf_counter() - t0)

                async def direct_call() -> None:
                    t0 = time.perf_counter()
                    first = None
                    async with session.post(
                        url + "/v1/chat/completions",
                        data=orjson.dumps(body),
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        async for line in resp.content:
                            if line.startswith(b"data: {") and first is None:
                                first = time.perf_counter() - t0
                    direct["first"].append(first or 0.0)
                    direct["last"].append(time.perf_counter() - t0)

                start = time.perf_counter()
                async with anyio.create_task_group() as load:
                    for i in range(n):
                        delay = start + i / rate - time.perf_counter()
                        if delay > 0:
                            await anyio.sleep(delay)
                        load.start_soon(via_router if i % 2 else direct_call)
        finally:
            await session.close()
        tg.cancel_scope.cancel()

    def q(v: list[float], p: float) -> float:
        s = sorted(v)
        return s[min(len(s) - 1, round(p * (len(s) - 1)))] * 1000

    out: dict[str, Any] = {
        "rate_rps": rate,
        "requests": len(direct["first"]) + len(routed["first"]),
    }
    for what in ("first", "last"):
        d50, r50 = statistics.median(direct[what]) * 1000, statistics.median(routed[what]) * 1000
        d99, r99 = q(direct[what], 0.99), q(routed[what], 0.99)
        out[what] = {
            "direct_p50_ms": round(d50, 3),
            "router_p50_ms": round(r50, 3),
            "direct_p99_ms": round(d99, 3),
            "router_p99_ms": round(r99, 3),
            "added_p50_ms": round(r50 - d50, 3),
            "added_p99_ms": round(r99 - d99, 3),
        }
    return out


async def cpu_per_request(rate: float, requests: int, phases: int = 4) -> dict[str, Any]:
    """CPU milliseconds of this process per streamed request, routed and direct.

    The stub engine runs in a child process. Each path gets ``phases`` phases of
    ``requests / phases`` requests at ``rate``, alternating, after a warm-up.
    """
    import tempfile
    from pathlib import Path

    from bearsdk.bench.gateway._procs import _Procs, _start_engines

    messages = [{"role": "user", "content": PROMPT}]
    body = orjson.dumps({"messages": messages, "stream": True, "max_tokens": 8})
    headers = {"Content-Type": "application/json"}
    per = max(1, requests // phases)
    cpu = {"router": 0.0, "direct": 0.0}
    with tempfile.TemporaryDirectory(prefix="bearsdk-bench-") as tmp:
        procs = _Procs()
        try:
            _, urls = _start_engines(procs, Path(tmp), 0.25)
            url = urls["fast"][0]
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            try:
                async with AsyncRouter(_configs(3, url), BEAR(), calibrate=False) as router:

                    async def routed() -> None:
                        stream = await router.chat(messages, stream=True, max_tokens=8)
                        async for _ in stream:
                            pass

                    async def direct() -> None:
                        target = url + "/v1/chat/completions"
                        async with session.post(target, data=body, headers=headers) as resp:
                            async for _ in resp.content:
                                pass

                    for call in (routed, direct):
                        for _ in range(min(per, 100)):
                            await call()
                    for _ in range(phases):
                        for name, call in (("router", routed), ("direct", direct)):
                            c0, start = time.process_time(), time.perf_counter()
                            async with anyio.create_task_group() as load:
                                for i in range(per):
                                    delay = start + i / rate - time.perf_counter()
                                    if delay > 0:
                                        await anyio.sleep(delay)
                                    load.start_soon(call)
                            cpu[name] += time.process_time() - c0
            finally:
                await session.close()
        finally:
            procs.close()
    n = per * phases
    return {
        "rate_rps": rate,
        "requests_per_path": n,
        "router_ms": round(cpu["router"] / n * 1e3, 4),
        "direct_ms": round(cpu["direct"] / n * 1e3, 4),
        "added_ms": round((cpu["router"] - cpu["direct"]) / n * 1e3, 4),
    }


def _main(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"decision": [decision_latency(n, args.rounds) for n in (3, 8)]}
    if not args.skip_proxy:
        report["proxy"] = anyio.run(proxy_overhead, args.rate, args.seconds)
        report["cpu"] = anyio.run(cpu_per_request, args.rate, int(args.rate * args.seconds))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("route decision (predictors + BEA per instance + BEAR), microseconds")
    for r in report["decision"]:
        d, p = r["decide"], r["predictors_only"]
        print(
            f"  {r['instances']} instances: p50 {d['median_us']:8.1f}  p99 {d['p99_us']:8.1f}"
            f"   (predictors alone p50 {p['median_us']:.1f}; "
            f"estimators {', '.join(r['estimators'])})"
        )
    if "proxy" in report:
        pr = report["proxy"]
        print(f"proxy overhead at {pr['rate_rps']:.0f} requests/s ({pr['requests']} requests), ms")
        for what, label in (("first", "first chunk"), ("last", "last chunk")):
            x = pr[what]
            print(
                f"  {label:11}: direct p50 {x['direct_p50_ms']:.3f} p99 {x['direct_p99_ms']:.3f} | "
                f"router p50 {x['router_p50_ms']:.3f} p99 {x['router_p99_ms']:.3f} | "
                f"added p50 {x['added_p50_ms']:.3f} p99 {x['added_p99_ms']:.3f}"
            )
        c = report["cpu"]
        print(
            f"CPU per streamed request at {c['rate_rps']:.0f} requests/s "
            f"({c['requests_per_path']} per path, engine in another process), ms: "
            f"routed {c['router_ms']:.3f} | direct {c['direct_ms']:.3f} | "
            f"added {c['added_ms']:.3f} (target <= 0.3)"
        )
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("router", help="route() decision latency and proxy overhead")
    p.add_argument("--rounds", type=positive_int, default=200, help="timing rounds for decisions")
    p.add_argument(
        "--rate", type=positive_float, default=200.0, help="requests/s for the proxy test"
    )
    p.add_argument(
        "--seconds", type=positive_float, default=10.0, help="duration of the proxy test"
    )
    p.add_argument("--skip-proxy", action="store_true", help="decision latency only")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
