"""A chat service embedding AsyncRouter: an OpenAI-compatible endpoint in front of a vLLM pool.

    python examples/chat_service.py                    # 3 emulated engines, port 8080
    python examples/chat_service.py --pool pool.toml   # real vLLM servers
    python examples/chat_service.py --self-test        # start, send a few requests, stop

Clients talk to it as to one OpenAI server (``model`` is ignored: the router
picks the instance). A request's TTFT target comes from the ``X-TTFT-Target``
header (seconds) or a ``ttft_target`` body field, else the router's rule.
Responses carry ``X-Bear-Instance`` and ``X-Bear-Request-Id``; streams are
passed through chunk by chunk. ``GET /router`` shows each instance's state and
prediction error, ``GET /metrics`` the router's Prometheus metrics (with the
``metrics`` extra installed).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from typing import Any

import aiohttp
import anyio
import orjson
from _pool import add_pool_args, pool_for
from aiohttp import web

from bearsdk import (
    BEAR,
    AsyncRouter,
    BearError,
    ChatStream,
    DecisionLog,
    DispatchError,
    EngineRequestError,
    NoInstanceError,
    PrometheusMetrics,
)

ROUTER: web.AppKey[AsyncRouter] = web.AppKey("router", AsyncRouter)
REGISTRY: web.AppKey[Any] = web.AppKey("registry", object)


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _error(400, f"body is not JSON: {exc}", "BadRequestError")
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return _error(400, "body must be an object with a 'messages' list", "BadRequestError")
    target = body.pop("ttft_target", None) or request.headers.get("X-TTFT-Target")
    try:
        ttft_target = None if target is None else float(target)
    except ValueError:
        return _error(400, f"ttft_target must be a number (got {target!r})", "BadRequestError")
    if ttft_target is not None and not (math.isfinite(ttft_target) and ttft_target > 0):
        return _error(400, f"ttft_target must be > 0 (got {target!r})", "BadRequestError")
    messages = body.pop("messages")
    stream = bool(body.pop("stream", False))
    body.pop("model", None)
    try:
        result = await router.chat(messages, ttft_target=ttft_target, stream=stream, **body)
    except NoInstanceError as exc:
        return _error(503, str(exc), "ServiceUnavailableError")
    except EngineRequestError as exc:
        return web.Response(status=exc.status, body=exc.body, content_type="application/json")
    except DispatchError as exc:
        return _error(502, str(exc), "BadGatewayError")
    except BearError as exc:
        return _error(400, str(exc), "BadRequestError")
    if not isinstance(result, ChatStream):
        return web.Response(
            body=orjson.dumps(result),
            content_type="application/json",
            headers={
                "X-Bear-Instance": result.instance,
                "X-Bear-Request-Id": result.decision.request_id,
            },
        )
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Bear-Instance": result.instance,
            "X-Bear-Request-Id": result.decision.request_id,
        }
    )
    async with result:  # leaving it early (client gone) aborts the request at the engine
        await resp.prepare(request)
        try:
            async for event in result.raw():
                await resp.write(event)
        except DispatchError as exc:
            # The engine dropped the stream after it started: tell the client in-band.
            err = {"error": {"message": str(exc), "type": "BadGatewayError", "code": 502}}
            await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
    await resp.write_eof()
    return resp


async def router_state(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    out = {}
    for name in router.instances:
        mae, mape, n = router.ttft_error(name)
        entry = router.cache(name).entry
        out[name] = {
            "model": router.instance_config(name).model,
            "inflight": router.inflight(name),
            "snapshot_seq": None if entry is None else entry.snapshot.seq,
            "ttft_predictions": n,
            "ttft_mae_s": None if n == 0 else mae,
            "ttft_mape": None if n == 0 else mape,
            "dispatch_overhead_s": router.overhead(name),
        }
    return web.json_response(out, dumps=lambda o: orjson.dumps(o).decode())


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    if registry is None:
        return web.Response(status=404, text="install bearsdk[metrics] for /metrics\n")
    import prometheus_client

    return web.Response(
        body=prometheus_client.generate_latest(registry),
        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )


def build_app(router: AsyncRouter) -> web.Application:
    """The web app around a started router."""
    app = web.Application()
    app[ROUTER] = router
    try:
        import prometheus_client

        registry = prometheus_client.CollectorRegistry()
        PrometheusMetrics(registry).attach(router)
    except ImportError:
        registry = None
    app[REGISTRY] = registry
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/router", router_state)
    app.router.add_get("/metrics", metrics)
    return app


async def self_test(url: str) -> bool:
    """A few requests against the running service; True when all answered."""
    ok = True
    msgs = [{"role": "user", "content": "Give me three tips for writing clear code."}]
    async with aiohttp.ClientSession() as s:
        for stream in (True, False, True):
            body = {"model": "auto", "messages": msgs, "max_tokens": 24, "stream": stream}
            async with s.post(
                url + "/v1/chat/completions", json=body, headers={"X-TTFT-Target": "0.5"}
            ) as r:
                text = await r.text()
                inst = r.headers.get("X-Bear-Instance", "?")
                good = r.status == 200 and (("[DONE]" in text) if stream else '"choices"' in text)
                ok &= good
                verdict = "ok" if good else text
                print(f"  stream={stream!s:5} -> HTTP {r.status} from {inst}: {verdict}")
        async with s.get(url + "/router") as r:
            state = await r.json()
            print(
                "  /router:", ", ".join(f"{k}: {v['inflight']} in flight" for k, v in state.items())
            )
        async with s.post(url + "/v1/chat/completions", data=b"{") as r:
            ok &= r.status == 400
            print(f"  bad JSON -> HTTP {r.status}")
    return ok


async def main(args: argparse.Namespace) -> int:
    async with pool_for(args) as configs, AsyncRouter(configs, BEAR(lam=args.lam)) as router:
        if args.log_decisions:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            DecisionLog().attach(router)
        runner = web.AppRunner(build_app(router), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, 0 if args.self_test else args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://{args.host}:{port}"
        print(f"chat service on {url} routing over {', '.join(router.instances)}", flush=True)
        try:
            if args.self_test:
                return 0 if await self_test(url) else 1
            await anyio.sleep_forever()
        finally:
            await runner.cleanup()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pool_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--lam", type=float, default=5e-4, help="BEAR's cost weight")
    parser.add_argument("--log-decisions", action="store_true", help="one JSON line per event")
    parser.add_argument("--self-test", action="store_true", help="send a few requests and stop")
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(anyio.run(main, parser.parse_args()))
