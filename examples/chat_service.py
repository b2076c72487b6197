"""A chat service embedding AsyncRouter: an OpenAI-compatible endpoint in front of a vLLM pool.

    python examples/chat_service.py                    # 3 emulated engines, port 8080
    python examples/chat_service.py --pool pool.toml   # real vLLM servers
    python examples/chat_service.py --self-test        # start, send a few requests, stop

Clients talk to it as to one OpenAI server (``model`` is ignored: the router
picks the instance). A request's TTFT target comes from the ``X-TTFT-Target``
header (seconds) or a ``ttft_target`` body field, else the router's rule; a
``timeout_s`` body field (0.01 to 3600 s) is the caller's own deadline, which
never counts against an instance. Bodies are untrusted: the known OpenAI and
vLLM sampling fields are checked and passed to the engine; an unknown field or
a wrong type is a 400 whose OpenAI-style error names it (``param``), bodies over
8 MiB are a 413, and a connection that sends no complete request head within
``--header-timeout`` seconds is closed.
Responses carry ``X-Bear-Instance`` and ``X-Bear-Request-Id``; streams are
passed through chunk by chunk. ``GET /router`` shows each instance's state and
prediction error, ``GET /metrics`` the router's Prometheus metrics (with the
``metrics`` extra installed).
"""

from __future__ import annotations

import signal
import sys


def _interrupted_early(signum: int, frame: object) -> None:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130)


if __name__ == "__main__":
    # Ctrl-C while the libraries below load: one line and 130, not a traceback
    # (the service installs its own handler once its event loop runs).
    signal.signal(signal.SIGINT, _interrupted_early)

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

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
    EngineRequestError,
    NoInstanceError,
)
from bearsdk.router import DecisionLog, PrometheusMetrics  # noqa: E402

ROUTER: web.AppKey[AsyncRouter] = web.AppKey("router", AsyncRouter)
REGISTRY: web.AppKey[Any] = web.AppKey("registry", object)

# Request bodies above this are refused (413) before they are read in full.
MAX_BODY_BYTES = 8 << 20
# A caller's own ``timeout_s`` must lie in this range: below it nothing can
# answer, above it a connection is held for longer than any request needs.
TIMEOUT_RANGE_S = (0.01, 3600.0)


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(lo: float, hi: float) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi

    return check


def _integer(lo: int, hi: int) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    return check


def _of(*types: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def _stop(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, str)
        or (isinstance(v, list) and len(v) <= 16 and all(isinstance(x, str) for x in v))
    )


# The OpenAI chat fields (and vLLM's sampling extras) passed to the engine, each
# with what it must be. Anything else is refused: it is a typo, or a field this
# service would forward without knowing what the engine makes of it.
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_integer(1, 2**31 - 1), "an integer >= 1"),
    "max_completion_tokens": (_integer(1, 2**31 - 1), "an integer >= 1"),
    "temperature": (_number(0.0, 2.0), "a number in [0, 2]"),
    "top_p": (_number(0.0, 1.0), "a number in [0, 1]"),
    "n": (_integer(1, 128), "an integer in [1, 128]"),
    "stop": (_stop, "a string or a list of at most 16 strings"),
    "presence_penalty": (_number(-2.0, 2.0), "a number in [-2, 2]"),
    "frequency_penalty": (_number(-2.0, 2.0), "a number in [-2, 2]"),
    "logit_bias": (_of(dict), "an object"),
    "logprobs": (_of(bool), "true or false"),
    "top_logprobs": (_integer(0, 20), "an integer in [0, 20]"),
    "seed": (_integer(-(2**63), 2**63 - 1), "a 64-bit integer"),
    "user": (_of(str), "a string"),
    "response_format": (_of(dict), "an object"),
    "tools": (_of(list), "a list"),
    "tool_choice": (_of(str, dict), "a string or an object"),
    "parallel_tool_calls": (_of(bool), "true or false"),
    "stream_options": (_of(dict), "an object"),
    # vLLM's extra sampling parameters
    "top_k": (_integer(-1, 2**31 - 1), "an integer >= -1"),
    "min_p": (_number(0.0, 1.0), "a number in [0, 1]"),
    "repetition_penalty": (_number(0.0, 100.0), "a number in (0, 100]"),
    "min_tokens": (_integer(0, 2**31 - 1), "an integer >= 0"),
    "ignore_eos": (_of(bool), "true or false"),
    "skip_special_tokens": (_of(bool), "true or false"),
    "include_stop_str_in_output": (_of(bool), "true or false"),
    "chat_template_kwargs": (_of(dict), "an object"),
}


class BadRequest(Exception):
    """A request body this service refuses (400); names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _parse_body(
    body: Any, header_target: str | None
) -> tuple[list[Any], bool, float | None, float | None, dict[str, Any]]:
    """``(messages, stream, ttft_target, timeout_s, engine params)`` from a request body.

    Raises:
        BadRequest: A field is missing, unknown or of the wrong type or range.
    """
    if not isinstance(body, dict):
        raise BadRequest(None, f"the body must be a JSON object (got {_short(body)})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", f"messages must be a non-empty list (got {_short(messages)})")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(
                "messages",
                f"messages[{i}] must be an object with a 'role' (got {_short(m)})",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"stream must be true or false (got {_short(stream)})")
    # ttft_target and timeout_s are this service's own fields, never the engine's.
    target = body.get("ttft_target", header_target)
    param = "ttft_target" if "ttft_target" in body else "X-TTFT-Target"
    if isinstance(target, str):
        try:
            target = float(target)
        except ValueError:
            raise BadRequest(param, f"{param} must be a number (got {_short(target)})") from None
    if target is not None and (
        isinstance(target, bool)
        or not isinstance(target, int | float)
        or not target > 0  # NaN fails too; inf: no target
    ):
        raise BadRequest(param, f"{param} must be a number of seconds > 0 (got {_short(target)})")
    timeout = body.get("timeout_s")
    lo, hi = TIMEOUT_RANGE_S
    if timeout is not None and not _number(lo, hi)(timeout):
        raise BadRequest(
            "timeout_s", f"timeout_s must be a number in [{lo:g}, {hi:g}] (got {_short(timeout)})"
        )
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("messages", "stream", "ttft_target", "timeout_s", "model"):
            continue  # model: the router chooses the instance
        if key not in FIELDS:
            raise BadRequest(key, f"unknown field {_short(key)}")
        if value is None:
            continue  # OpenAI clients send null for "not set"
        check, what = FIELDS[key]
        if not check(value):
            raise BadRequest(key, f"{key} must be {what} (got {_short(value)})")
        params[key] = value
    return (
        messages,
        stream,
        None if target is None else float(target),
        None if timeout is None else float(timeout),
        params,
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes", "BadRequestError")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _error(400, f"body is not JSON: {exc}", "BadRequestError")
    try:
        messages, stream, ttft_target, timeout_s, params = _parse_body(
            body, request.headers.get("X-TTFT-Target")
        )
    except BadRequest as exc:
        return _error(400, str(exc), "BadRequestError", exc.param)
    try:
        result = await router.chat(
            messages, ttft_target=ttft_target, stream=stream, timeout_s=timeout_s, **params
        )
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
            "breaker": str(router.breaker_state(name)),
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
    app = web.Application(client_max_size=MAX_BODY_BYTES)
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


def listen(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound before anything else starts.

    Raises:
        OSError: The address is in use, or not this machine's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=512)


def make_runner(app: web.Application, header_timeout_s: float) -> web.AppRunner:
    """The app's runner: a connection that sends no complete request head within
    ``header_timeout_s`` (a slow or stalled client) is closed, and so is a
    keep-alive connection idle that long; stopping waits for requests in flight
    at most half a second."""
    return web.AppRunner(
        app, access_log=None, keepalive_timeout=header_timeout_s, shutdown_timeout=0.5
    )


async def serve(args: argparse.Namespace, sock: socket.socket, stop: anyio.Event) -> int:
    """Run the service on ``sock`` until ``stop`` is set (130) or the self-test ends."""
    async with pool_for(args) as configs, AsyncRouter(configs, BEAR(lam=args.lam)) as router:
        if args.log_decisions:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            DecisionLog().attach(router)
        runner = make_runner(build_app(router), args.header_timeout)
        await runner.setup()
        try:
            site = web.SockSite(runner, sock)
            await site.start()
            host, port = sock.getsockname()[:2]
            url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
            print(f"chat service on {url} routing over {', '.join(router.instances)}", flush=True)
            if args.self_test:
                return 0 if await self_test(url) else 1
            await stop.wait()
            return 130
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()


async def main(args: argparse.Namespace) -> int:
    try:
        sock = listen(args.host, 0 if args.self_test else args.port)
    except OSError as exc:
        fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    stop = anyio.Event()
    rc = 130
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            # The first Ctrl-C (or SIGTERM) stops the service cleanly; a second
            # one stops waiting for the clean-up.
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    if stop.is_set():
                        tg.cancel_scope.cancel()
                    stop.set()

        tg.start_soon(on_signal)
        rc = await serve(args, sock, stop)
        tg.cancel_scope.cancel()
    return rc


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2."""
    print(f"{os.path.basename(sys.argv[0])}: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0 (got {text!r})")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pool_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--lam", type=float, default=5e-4, help="BEAR's cost weight")
    parser.add_argument(
        "--header-timeout",
        type=_positive,
        default=15.0,
        metavar="S",
        help="close connections that send no complete request head (or idle) this long (15)",
    )
    parser.add_argument("--log-decisions", action="store_true", help="one JSON line per event")
    parser.add_argument("--self-test", action="store_true", help="send a few requests and stop")
    cli = parser.parse_args()
    try:
        code = anyio.run(main, cli)
    except KeyboardInterrupt:  # before the signal handler was in place
        code = 130
    except BearError as exc:
        fail(str(exc))
    if code == 130:
        print("interrupted", file=sys.stderr)
    sys.exit(code)
