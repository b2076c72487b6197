"""Embedding AsyncRouter in your own aiohttp service: one OpenAI-style endpoint.

    python examples/chat_service.py                    # 3 emulated engines, port 8080
    python examples/chat_service.py --pool pool.toml   # real vLLM servers
    python examples/chat_service.py --self-test        # start, send a few requests, stop

This is the few lines an application needs to put BEAR in front of its own
handler. For a ready gateway (API keys, budgets, admission, metrics, reloads,
workers), run ``bearsdk serve --config gateway.toml`` instead (docs/gateway.md):
it validates every body field, which this example leaves to the engine.
"""

from __future__ import annotations

import signal
import sys


def _interrupted_early(signum: int, frame: object) -> None:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130)


if __name__ == "__main__":
    # Ctrl-C while the libraries below load: one line and 130, not a traceback.
    signal.signal(signal.SIGINT, _interrupted_early)

import argparse  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from typing import NoReturn  # noqa: E402

import aiohttp  # noqa: E402
import anyio  # noqa: E402
import orjson  # noqa: E402
from _pool import add_pool_args, pool_for  # noqa: E402
from aiohttp import web  # noqa: E402

from bearsdk import (  # noqa: E402
    BEAR,
    AsyncRouter,
    BearError,
    ChatStream,
    DispatchError,
    NoInstanceError,
)

ROUTER: web.AppKey[AsyncRouter] = web.AppKey("router", AsyncRouter)


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    try:
        body = orjson.loads(await request.read())
        messages = body["messages"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return _error(400, "the body must be a JSON object with messages")
    stream = body.get("stream") is True
    try:
        # The TTFT target: the router's rule by prompt length (pass ttft_target= to set one).
        result = await router.chat(messages, stream=stream, max_tokens=body.get("max_tokens"))
    except NoInstanceError as exc:
        return _error(503, str(exc))
    except DispatchError as exc:  # every instance tried failed
        return _error(502, str(exc))
    except BearError as exc:  # the request's own fault
        return _error(400, str(exc))
    headers = {"x-bear-instance": result.instance}
    if not isinstance(result, ChatStream):
        return web.Response(
            body=orjson.dumps(result), content_type="application/json", headers=headers
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    async with result:  # leaving early (client gone) aborts the request at the engine
        await resp.prepare(request)
        async for event in result.raw():
            await resp.write(event)
    await resp.write_eof()
    return resp


async def self_test(url: str) -> bool:
    """A few requests against the running service; True when all answered."""
    ok = True
    msgs = [{"role": "user", "content": "Give me three tips for writing clear code."}]
    async with aiohttp.ClientSession() as s:
        for stream in (True, False, True):
            body = {"messages": msgs, "max_tokens": 24, "stream": stream}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                text = await r.text()
                good = r.status == 200 and (("[DONE]" in text) if stream else '"choices"' in text)
                ok &= good
                inst = r.headers.get("x-bear-instance", "?")
                verdict = "ok" if good else text
                print(f"  stream={stream!s:5} -> HTTP {r.status} from {inst}: {verdict}")
        async with s.post(url + "/v1/chat/completions", data=b"{") as r:
            ok &= r.status == 400
            print(f"  bad JSON -> HTTP {r.status}")
    return ok


async def main(args: argparse.Namespace, sock: socket.socket) -> int:
    async with pool_for(args) as configs, AsyncRouter(configs, BEAR()) as router:
        app = web.Application()
        app[ROUTER] = router
        app.router.add_post("/v1/chat/completions", chat_completions)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            url = "http://{}:{}".format(*sock.getsockname()[:2])
            # The receiver first: a Ctrl-C right after the ready line must find it,
            # not the start-up handler (which, raised inside an import, is ignored).
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                print(
                    f"chat service on {url} routing over {', '.join(router.instances)}",
                    flush=True,
                )
                if args.self_test:
                    return 0 if await self_test(url) else 1
                async for _ in signals:
                    return 130
            return 130
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2."""
    print(f"{os.path.basename(sys.argv[0])}: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pool_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--self-test", action="store_true", help="send a few requests and stop")
    cli = parser.parse_args()
    try:
        listening = socket.create_server((cli.host, 0 if cli.self_test else cli.port), backlog=512)
    except OSError as exc:
        fail(f"cannot listen on {cli.host}:{cli.port}: {exc.strerror or exc}")
    try:
        code = anyio.run(main, cli, listening)
    except KeyboardInterrupt:  # before the signal handler was in place
        code = 130
    except BearError as exc:
        fail(str(exc))
    if code == 130:
        print("interrupted", file=sys.stderr)
    sys.exit(code)
