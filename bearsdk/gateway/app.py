"""The gateway's HTTP face: OpenAI's endpoints over an :class:`~bearsdk.AsyncRouter`.

One request's path: authenticate (``Authorization: Bearer``), read the body
within its size and time caps, check it strictly, resolve ``model`` to a group
or a served model, take the key's budgets (model allowed, requests and tokens
per minute, concurrency), decide and admit (:mod:`bearsdk.gateway.admission`),
then send through the router and pass the answer back: a JSON body, or the
engine's SSE chunks one by one. Nothing reaches an engine before every check
passed. Errors have OpenAI's JSON shape and status codes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import anyio
import attrs
import orjson
from aiohttp import web

from bearsdk.gateway.admission import Refused
from bearsdk.gateway.bodies import BadRequest, Kind, ParsedRequest, parse_request
from bearsdk.gateway.config import GatewayConfig, ttft_target_s
from bearsdk.gateway.keys import Denied, KeySpec
from bearsdk.gateway.state import Gateway, _model_of
from bearsdk.router import (
    AsyncRouter,
    BreakerState,
    ChatStream,
    Decision,
    DispatchError,
    EngineRequestError,
    NoInstanceError,
    RequestError,
)
from bearsdk.router.errors import short

__all__ = ["GATEWAY", "Gateway", "build_app"]

access_log = logging.getLogger("bearsdk.gateway.access")
log = logging.getLogger("bearsdk.gateway")

# Characters per token for the token budget's estimate before the engine's
# usage corrects it (the predictors' own rule of thumb for English text).
_CHARS_PER_TOKEN = 4.0
# Output tokens charged to the token budget when a request gives no cap.
_DEFAULT_OUTPUT_TOKENS = 256


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def error_response(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _denied(exc: Denied) -> web.Response:
    headers = None if exc.retry_after_s is None else _retry_after(exc.retry_after_s)
    return error_response(exc.status, exc.message, exc.kind, exc.code, headers=headers)


async def _read_json(request: web.Request, gw: Gateway) -> Any:
    limit = gw.config.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    if request.content.is_eof():
        # The whole body came with the head (the usual case): nothing to wait for.
        raw = await request.read()
    else:
        with anyio.fail_after(gw.config.server.body_timeout_s):
            raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(None, f"the body is not JSON: {exc}") from None


@attrs.define
class _Access:
    """What one request's access-log line says, filled in as the request goes."""

    started: float
    key: str | None = None
    model: str | None = None
    stream: bool | None = None
    instance: str | None = None
    decision: str | None = None


async def _complete(request: web.Request, kind: Kind) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    info = _Access(time.perf_counter())
    resp: web.StreamResponse | None = None
    try:
        resp = await _handle(request, kind, gw, info)
        return resp
    finally:
        if gw.config.server.access_log:
            _access(request, info, resp)


async def _handle(
    request: web.Request, kind: Kind, gw: Gateway, info: _Access
) -> web.StreamResponse:
    if gw.draining:
        return error_response(503, "the gateway is shutting down", "server_error", "draining")
    try:
        key = gw.keys.authenticate(request.headers.get("Authorization"))
    except Denied as exc:
        return _denied(exc)
    try:
        body = await _read_json(request, gw)
        req = parse_request(
            kind, body, request.headers, max_timeout_s=gw.config.router.max_timeout_s
        )
    except web.HTTPRequestEntityTooLarge:
        limit = gw.config.server.max_body_bytes
        return error_response(
            413, f"the body is larger than {limit} bytes", "invalid_request_error", "body_too_large"
        )
    except TimeoutError:
        return error_response(
            408, "the body did not arrive in time", "invalid_request_error", "body_timeout"
        )
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error", "invalid_value", exc.param)
    model = req.model or gw.config.default_model
    info.key = None if key is None else key.name
    info.model = model
    info.stream = req.stream
    members = gw.members(model)
    if members is None:
        return error_response(
            404,
            f"the model {short(model)} does not exist (GET /v1/models lists them)",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    try:
        lease = gw.keys.admit(key, model, _token_estimate(req))
    except Denied as exc:
        _count_error(gw, model, exc.code)
        return _denied(exc)
    gw.enter()
    try:
        return await _serve(request, gw, req, key, model, members, lease, info)
    finally:
        gw.leave()


def _token_estimate(req: ParsedRequest) -> int:
    out = req.max_tokens or _DEFAULT_OUTPUT_TOKENS
    return math.ceil(req.prompt_chars() / _CHARS_PER_TOKEN) + out


def _count_error(gw: Gateway, model: str, code: str) -> None:
    if gw.metrics is not None:
        gw.metrics.errors.labels(model, code).inc()


async def _serve(
    request: web.Request,
    gw: Gateway,
    req: ParsedRequest,
    key: KeySpec | None,
    model: str,
    members: frozenset[str],
    lease: Any,
    info: _Access,
) -> web.StreamResponse:
    started = info.started
    used: int | None = None
    try:
        target = req.ttft_target_s if req.ttft_target_s is not None else ttft_target_s(gw.config)
        try:
            d = await gw.admission.admit(
                gw.router.decide,
                req.prompt,
                ttft_target=target,
                max_tokens=req.max_tokens,
                instances=members,
                tpot_target=req.tpot_target_s,
            )
        except Refused as exc:
            _count_error(gw, model, exc.code)
            return error_response(
                429, str(exc), "rate_limit_error", exc.code, headers=_retry_after(exc.retry_after_s)
            )
        gw.record(d, key, model, req.tpot_target_s)
        info.decision = d.request_id
        if gw.metrics is not None:
            # While the engine works on the request, not before it is sent.
            asyncio.get_running_loop().call_soon(_observe_decision, gw, model, d)
        send = gw.router.chat if req.kind == "chat" else gw.router.completions
        try:
            result = await send(
                req.prompt,
                stream=req.stream,
                timeout_s=req.timeout_s,
                decision=d,
                **req.params,
            )
        except NoInstanceError as exc:
            _count_error(gw, model, "no_instance")
            return error_response(503, str(exc), "server_error", "no_instance")
        except EngineRequestError as exc:
            _count_error(gw, model, f"engine_{exc.status}")
            return web.Response(status=exc.status, body=exc.body, content_type="application/json")
        except DispatchError as exc:
            _count_error(gw, model, "dispatch_failed")
            return error_response(502, str(exc), "server_error", "dispatch_failed")
        except RequestError as exc:
            _count_error(gw, model, "invalid_value")
            return error_response(400, str(exc), "invalid_request_error", "invalid_value")
        headers = {"x-bear-instance": result.instance, "x-bear-decision": d.request_id}
        info.instance = result.instance
        if not isinstance(result, ChatStream):
            usage = result.get("usage")
            used = _total_tokens(usage)
            _done(gw, model, d, result.instance, 200, started)
            return web.Response(
                body=orjson.dumps(result), content_type="application/json", headers=headers
            )
        resp = await _stream(request, gw, result, headers)
        used = _total_tokens(result.usage)
        _done(gw, model, d, result.instance, resp.status, started)
        return resp
    finally:
        lease.release(used)


def _observe_decision(gw: Gateway, model: str, d: Decision) -> None:
    assert gw.metrics is not None
    pair = gw.metrics.pair(model, d.chosen.model)
    pair.prediction_duration.observe(d.decide_s)
    if math.isfinite(d.chosen.ttft_s):
        pair.predicted_ttft.observe(d.chosen.ttft_estimate_s)


def _total_tokens(usage: object) -> int | None:
    if isinstance(usage, Mapping):
        total = usage.get("total_tokens")
        if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
            return total
    return None


class _EventStream(web.StreamResponse):
    """An SSE response whose head leaves with its first chunk: one write, not two.

    (aiohttp's own ``Response`` buffers its head so; a stream sends it at
    ``prepare()`` unless told otherwise.)
    """

    _send_headers_immediately = False


async def _stream(
    request: web.Request, gw: Gateway, result: ChatStream, headers: dict[str, str]
) -> web.StreamResponse:
    resp = _EventStream(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    tail = b""
    try:
        async with result:  # leaving early (client gone, drain) aborts the request at the engine
            await resp.prepare(request)
            with anyio.CancelScope() as scope:
                gw._streams.add(scope)
                try:
                    async for chunk in result.raw_chunks():
                        if result.ended:
                            # The last one leaves with the end of the body (one write).
                            tail = chunk
                        else:
                            await resp.write(chunk)
                except DispatchError as exc:
                    # The engine dropped the stream after it started: tell the client in-band.
                    tail = _sse_error(str(exc), "dispatch_failed")
                finally:
                    gw._streams.discard(scope)
            if scope.cancelled_caught:
                tail = _sse_error("the gateway is shutting down", "draining")
        await resp.write_eof(tail)
    except ConnectionError:
        # The client went away; leaving the stream above aborted the engine's copy.
        pass
    return resp


def _sse_error(message: str, code: str) -> bytes:
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(err) + b"\n\n"


def _done(gw: Gateway, model: str, d: Decision, instance: str, status: int, started: float) -> None:
    m = gw.metrics
    if m is not None:
        target = _model_of(d, instance)
        m.answered(model, target, str(status)).inc()
        m.pair(model, target).duration.observe(time.perf_counter() - started)


def _access(request: web.Request, info: _Access, resp: web.StreamResponse | None) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    line = {
        "ts": round(time.time(), 3),
        "method": request.method,
        "path": request.path,
        # No response: the handler was cancelled (client gone, shutdown); 499 as nginx says it.
        "status": 499 if resp is None else resp.status,
        "remote": request.remote,
        "key": info.key,
        "model": info.model,
        "stream": info.stream,
        "instance": info.instance,
        "decision": info.decision,
        "ms": round((time.perf_counter() - info.started) * 1e3, 3),
    }
    access_log.info(_dumps(line))


# ---------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _complete(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _complete(request, "completions")


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: groups and served models, those the key may use."""
    gw = request.app[GATEWAY]
    try:
        key = gw.keys.authenticate(request.headers.get("Authorization"))
    except Denied as exc:
        return _denied(exc)
    names = gw.served_models()
    if key is not None and key.models:
        names = [n for n in names if n in key.models]
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "bearsdk"} for n in names]
    return web.Response(
        body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
    )


async def decision(request: web.Request) -> web.Response:
    """``GET /bear/decisions/{id}``: why a request went where it went."""
    gw = request.app[GATEWAY]
    try:
        key = gw.keys.authenticate(request.headers.get("Authorization"))
    except Denied as exc:
        return _denied(exc)
    rid = request.match_info["id"]
    rec = gw.decision(rid)
    # Another key's decisions are not found rather than forbidden: ids are not secrets,
    # but whose traffic went where is.
    if rec is None or (key is not None and rec.key != key.name):
        return error_response(
            404, f"no decision {short(rid)} is kept", "invalid_request_error", "decision_not_found"
        )
    d = rec.decision
    body = {
        "id": d.request_id,
        "model": rec.model,
        "selector": d.selector,
        "instance": d.instance,
        "reason": d.reason,
        "ttft_target_s": d.ttft_target_s,
        "tpot_target_s": None if d.tpot_target_s == math.inf else d.tpot_target_s,
        "observed_ttft_s": None if math.isnan(rec.ttft_s) else rec.ttft_s,
        "outcome": rec.outcome,
        "decide_s": d.decide_s,
        "explored": d.explored,
        "candidates": [_finite(attrs.asdict(c)) for c in d.candidates],
        "explain": d.explain(),
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _finite(doc: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN or infinity: an unknown estimate is null.
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in doc.items()
    }


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: the process answers."""
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: 200 once every instance has a first snapshot or is marked down."""
    gw = request.app[GATEWAY]
    router = gw.router
    waiting = []
    for name in router.instances:
        if router.cache(name).entry is not None:
            continue
        if router.breaker_state(name) is not BreakerState.CLOSED:
            continue
        stats = router.source_stats(name)
        if stats is not None and stats.failures > 0:
            continue  # tried and failed: down, not pending
        waiting.append(name)
    if gw.draining:
        return web.Response(status=503, text="draining\n")
    if waiting:
        return web.Response(status=503, text=f"waiting for snapshots: {', '.join(waiting)}\n")
    return web.Response(text="ready\n")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text (with the ``metrics`` extra)."""
    registry = request.app[GATEWAY].registry
    if registry is None:
        return web.Response(status=404, text="install bearsdk[metrics] for /metrics\n")
    import prometheus_client

    gw = request.app[GATEWAY]
    if gw.metrics is not None:
        # Read at scrape time: the key ring holds the counts, not a second copy here.
        for name, use in gw.keys.usage().items():
            gw.metrics.key_in_flight.labels(name).set(use["in_flight"])
    return web.Response(
        body=prometheus_client.generate_latest(registry),
        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )


def build_app(router: AsyncRouter, config: GatewayConfig) -> web.Application:
    """The gateway's aiohttp application around a started router."""
    registry = None
    gm = None
    try:
        import prometheus_client

        from bearsdk.gateway.metrics import GatewayMetrics
        from bearsdk.router import PrometheusMetrics

        registry = prometheus_client.CollectorRegistry()
        PrometheusMetrics(registry, defer=True).attach(router)
        gm = GatewayMetrics(registry)
    except ImportError:
        pass
    app = web.Application(client_max_size=config.server.max_body_bytes)
    app[GATEWAY] = Gateway(router, config, metrics=gm, registry=registry)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/bear/decisions/{id}", decision)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
