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
   p99 ≤ 2 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import anyio
import orjson
from aiohttp import web

from bearsdk.bench import time_call
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
    # The predictors alone, for the breakdown.
    tp = time_call(lambda: pred.predict(PROMPT, quantiles=False), batch=20, rounds=rounds, warmup=5)
    return {
        "instances": n,
        "decide": t.as_dict(),
        "predictors_only": tp.as_dict(),
        "estimators": modes,
    }


async def serve_stub(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
    name: str,
    task_status: Any,
    backlog: int = 128,
) -> None:
    """Serve a stub engine on a free loopback port until cancelled; started with its URL.

    ``chat`` answers ``/v1/chat/completions``; ``/bear/snapshot`` says the engine
    is empty (so the router replays it) and ``/bear/batches`` is 404 (its
    profile's coefficients are kept).
    """

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def snapshot(request: web.Request) -> web.Response:
        doc = {
            "schema": "bear.snapshot/1",
            "instance": name,
            "seq": int(time.time() * 1e3),
            "time": time.time(),
            "requests": [],
        }
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/bear/batches", not_found)
    app.router.add_get("/bear/snapshot", snapshot)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        task_status.started(f"http://127.0.0.1:{port}")
        await anyio.sleep_forever()
    finally:
        await runner.cleanup()


async def _stub_engine(task_status: Any) -> None:
    """An engine that answers every chat completion at once with 8 chunks."""
    created = int(time.time())

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": created,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            }
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 50, "completion_tokens": 8, "total_tokens": 58},
        }
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    await serve_stub(chat, "stub", task_status)


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
        url = await tg.start(_stub_engine)
        cfgs = _configs(3, url)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            async with AsyncRouter(cfgs, BEAR(), session=session, calibrate=False) as router:

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


def _main(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"decision": [decision_latency(n, args.rounds) for n in (3, 8)]}
    if not args.skip_proxy:
        report["proxy"] = anyio.run(proxy_overhead, args.rate, args.seconds)
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
