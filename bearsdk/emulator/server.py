"""The emulated engine's HTTP API (aiohttp): vLLM's OpenAI-compatible endpoints,
``/metrics``, and the ``/bear/*`` snapshot, batch and fault endpoints.

=========================  =========================================================
``GET /v1/models``         the served model
``POST /v1/completions``   text completion (SSE with ``stream: true``)
``POST /v1/chat/completions``  chat completion (SSE with ``stream: true``)
``GET /health``            200 while the engine runs
``POST /tokenize``         ``{"prompt"}`` or ``{"messages"}`` -> token ids
``GET /version``           version string
``GET /metrics``           Prometheus text format, vLLM's metric names
``GET /bear/snapshot``     the latest ``bear.snapshot/1``
``GET /bear/snapshots``    NDJSON push stream of snapshots (coalescing, heartbeats)
``GET /bear/batches``      NDJSON stream of ``bear.batch/1`` records
``GET|POST /bear/faults``  read / set fault injection (``faults.py``)
``POST /bear/restart``     restart the engine (``{"downtime_s": 0.5}``)
=========================  =========================================================

The admin endpoints (``POST /bear/faults``, ``POST /bear/restart``) take no
credentials by default, which is fine on loopback (the default bind) where only
local processes reach them. With an admin token set (environment variable
``BEARSDK_ADMIN_TOKEN``, or :class:`HttpServer`'s ``admin_token``) they require
``Authorization: Bearer <token>`` and answer 401 without it; an engine bound to
any other address refuses to start without one.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import attrs
import orjson
from aiohttp import web

from bearsdk.emulator.api import (
    ApiError,
    ParsedRequest,
    parse_chat,
    parse_completion,
    schema_error,
)
from bearsdk.emulator.faults import MAX_DELAY_S as MAX_DOWNTIME_S
from bearsdk.emulator.faults import FaultDecision, FaultsError
from bearsdk.emulator.metrics import CONTENT_TYPE
from bearsdk.emulator.responses import (
    SseEncoder,
    chat_response,
    completion_response,
    models_response,
    prompt_tokens_details,
)
from bearsdk.emulator.text import ChatMessageError
from bearsdk.errors import BearError

if TYPE_CHECKING:
    from bearsdk.emulator.core import EngineCore
    from bearsdk.emulator.requests import RequestHandle

__all__ = [
    "ADMIN_TOKEN_ENV",
    "VERSION",
    "AdminTokenError",
    "HttpServer",
    "build_app",
    "is_loopback",
]

VERSION: Final = "0.33.0"
"""The vLLM version the emulator's API follows."""
_SSE: Final = "text/event-stream; charset=utf-8"
_NDJSON: Final = "application/x-ndjson"
_DONE: Final = b"data: [DONE]\n\n"

ADMIN_TOKEN_ENV: Final = "BEARSDK_ADMIN_TOKEN"
"""The environment variable holding the admin endpoints' bearer token."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminTokenError(BearError, ValueError):
    """An engine would expose its admin endpoints beyond loopback without a token."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves local processes only (``localhost``, 127/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _admin_token(inst: object, att: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or len(value) < 8):
        raise AdminTokenError(f"{att.name} must be a string of at least 8 characters (or unset)")


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(exc: ApiError) -> web.Response:
    return _json(exc.body(), exc.status)


def _drop(request: web.Request) -> None:
    """Reset the client's connection (the handler's response is then discarded)."""
    tr = request.transport
    if tr is not None:
        tr.abort()


@attrs.define
class _Api:
    engine: EngineCore
    admin_token: str | None = None

    # -- plumbing ---------------------------------------------------------------------

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        """401 unless the request carries the admin token (``None``: go ahead)."""
        if self.admin_token is None:
            return None
        got = request.headers.get("Authorization", "")
        want = f"Bearer {self.admin_token}"
        # Constant time: the comparison must not reveal how much of a guess was right.
        if hmac.compare_digest(got.encode(), want.encode()):
            return None
        resp = _error(
            ApiError(401, "admin endpoint: Authorization: Bearer <token> required", "AuthError")
        )
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    async def _enter(self, request: web.Request) -> FaultDecision:
        """Apply request-path latency and decide this request's injected faults."""
        faults = self.engine.faults
        if faults.latency_s > 0:
            await anyio.sleep(faults.latency_s)
        return faults.decide(request.path)

    async def _reply(self, request: web.Request, resp: web.Response) -> web.StreamResponse:
        if self.engine.faults.latency_s > 0:
            await anyio.sleep(self.engine.faults.latency_s)
        return resp

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise schema_error(
                "0", "json_invalid", f"JSON decode error: {exc}", raw[:200]
            ) from None

    def _fault_response(self, request: web.Request, d: FaultDecision) -> web.Response | None:
        if d.error_status:
            status = d.error_status
            kind = "ServiceUnavailableError" if status == 503 else "InternalServerError"
            err = ApiError(status, f"emulated fault: HTTP {status}", kind)
            return _error(err)
        if d.drop_after_chunks == 0:
            _drop(request)
            return web.Response(status=500)
        return None

    # -- OpenAI endpoints ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _generate(
        self,
        request: web.Request,
        parse: Callable[[Any, Any, EngineCore], ParsedRequest],
    ) -> web.StreamResponse:
        decision = await self._enter(request)
        faulted = self._fault_response(request, decision)
        if faulted is not None:
            return faulted
        try:
            req = parse(await self._body(request), request.headers, self.engine)
        except ApiError as exc:
            return await self._reply(request, _error(exc))
        except ChatMessageError as exc:
            err = schema_error(exc.field, "value_error", str(exc), exc.value)
            return await self._reply(request, _error(err))
        h = self.engine.submit(req.plan, req.request_id)
        try:
            if req.stream:
                return await self._stream(request, req, h, decision)
            await self._wait_delivered(h, h.plan.output_len)
            if h.dropped:
                _drop(request)
                return web.Response(status=500)
            stop = h.plan.stop_reason if h.finish_reason == "stop" else None
            shape = chat_response if req.chat else completion_response
            details = self._prompt_details(req, h, stream=False)
            return _json(shape(req, h.text(), h.finish_reason, stop, h.produced, details))
        finally:
            if not h.done:
                self.engine.abort(h.id)

    def _prompt_details(
        self, req: ParsedRequest, h: RequestHandle, *, stream: bool
    ) -> dict[str, Any] | None:
        """``usage.prompt_tokens_details`` (``None`` unless the engine reports it)."""
        if not self.engine.config.enable_prompt_tokens_details:
            return None
        return prompt_tokens_details(
            req.chat, h.cached_tokens, h.created_cache_tokens, stream=stream
        )

    async def _wait_delivered(self, h: RequestHandle, upto: int) -> int:
        """Wait until tokens past the last sent are deliverable; return how many are.

        With added latency a token is deliverable ``latency_s`` after the engine
        emitted it.
        """
        lat = self.engine.faults.latency_s
        while True:
            n = h.produced
            if lat > 0 and n:
                now = anyio.current_time()
                times = h.token_times
                k = n
                while k > 0 and times[k - 1] + lat > now:
                    k -= 1
                if k < n:
                    if k >= upto:
                        return k
                    await anyio.sleep_until(times[k] + lat)
                    continue
            if h.done or n >= upto:
                return n
            await h.changed()

    async def _stream(
        self, request: web.Request, req: ParsedRequest, h: RequestHandle, d: FaultDecision
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": _SSE})
        await resp.prepare(request)
        prompt = h.plan.prompt_tokens
        texts = h.plan.texts
        enc = SseEncoder(req)
        cont = req.continuous_usage
        faults = self.engine.faults
        sent = chunks = 0
        try:
            while True:
                if faults.latency_s > 0:
                    n = await self._wait_delivered(h, sent + 1)
                else:
                    while h.produced == sent and not h.done:
                        await h.changed()
                    n = h.produced
                if h.dropped:
                    _drop(request)
                    return resp
                final = h.done and n == h.produced
                if n == sent and not final:
                    continue
                out = enc.role((prompt, 0) if cont else None) if req.chat and sent == 0 else b""
                finish = h.finish_reason if final else None
                stop = h.plan.stop_reason if finish == "stop" else None
                usage = (prompt, n) if cont else None
                out += enc.content("".join(texts[sent:n]), finish, stop, usage)
                sent = n
                if final:
                    if req.include_usage:
                        out += enc.usage(prompt, n, self._prompt_details(req, h, stream=True))
                    out += _DONE
                await resp.write(out)
                chunks += 1
                if 0 < d.drop_after_chunks <= chunks and not final:
                    _drop(request)
                    return resp
                if final:
                    return resp
        except ConnectionError:
            return resp

    # -- other vLLM endpoints --------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        await self._enter(request)
        return await self._reply(request, _json(models_response(self.engine, int(time.time()))))

    async def health(self, request: web.Request) -> web.StreamResponse:
        d = await self._enter(request)
        return self._fault_response(request, d) or await self._reply(request, web.Response())

    async def version(self, request: web.Request) -> web.StreamResponse:
        return _json({"version": VERSION})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        await self._enter(request)
        try:
            body = await self._body(request)
            if not isinstance(body, dict) or ("prompt" not in body and "messages" not in body):
                raise schema_error("prompt", "missing", "Field required", body)
            tok = self.engine.tokenizer
            if "messages" in body:
                text = tok.render_chat(body["messages"])
                pieces = tok.chat_pieces(text)
                ids = tok.encode_chat(text)
            else:
                prompt = body["prompt"]
                if not isinstance(prompt, str):
                    raise schema_error(
                        "prompt", "string_type", "Input should be a valid string", prompt
                    )
                pieces = tok.pieces(prompt)
                ids = [tok.token_id(p) for p in pieces]
        except ApiError as exc:
            return await self._reply(request, _error(exc))
        except ChatMessageError as exc:
            err = schema_error(exc.field, "value_error", str(exc), exc.value)
            return await self._reply(request, _error(err))
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": pieces if body.get("return_token_strs") else None,
        }
        return await self._reply(request, _json(out))

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        d = await self._enter(request)
        faulted = self._fault_response(request, d)
        if faulted is not None:
            return faulted
        body = self.engine.metrics.render(self.engine.gauges)
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = CONTENT_TYPE
        return await self._reply(request, resp)

    # -- bear endpoints --------------------------------------------------------------

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        d = await self._enter(request)
        faulted = self._fault_response(request, d)
        if faulted is not None:
            return faulted
        body = self.engine.latest_snapshot.json()
        return await self._reply(request, web.Response(body=body, content_type="application/json"))

    async def snapshots(self, request: web.Request) -> web.StreamResponse:
        d = await self._enter(request)
        faulted = self._fault_response(request, d)
        if faulted is not None:
            return faulted
        raw = request.query.get("min_interval_ms", "0")
        try:
            min_interval = float(raw) / 1000.0
            if not min_interval >= 0:
                raise ValueError(raw)
        except ValueError:
            msg = f"min_interval_ms must be a number >= 0 (got {raw!r})"
            return _error(ApiError(400, msg, "BadRequestError", "min_interval_ms"))
        engine = self.engine
        hub = engine.snapshots
        reader = hub.subscribe()
        resp = web.StreamResponse(headers={"Content-Type": _NDJSON})
        heartbeat = engine.config.heartbeat_s
        chunks = 0
        try:
            await resp.prepare(request)
            while True:
                with anyio.move_on_after(heartbeat):
                    await reader.wait()
                if reader.is_closed():
                    break
                snap = reader.take()
                if snap is None:
                    await resp.write(b"\n")
                    continue
                lat = engine.faults.latency_s
                if lat > 0:
                    await anyio.sleep_until(snap.captured_at + engine.faults.snapshot_delay_s + lat)
                    snap = reader.take() or snap
                await resp.write(snap.json() + b"\n")
                chunks += 1
                if 0 < d.drop_after_chunks <= chunks:
                    _drop(request)
                    break
                if min_interval > 0:
                    await anyio.sleep(min_interval)
        except ConnectionError:
            pass
        finally:
            hub.unsubscribe(reader)
        if reader.is_closed() and engine.snapshots is not hub:
            _drop(request)  # the engine restarted: the connection goes with it
        return resp

    async def batches(self, request: web.Request) -> web.StreamResponse:
        await self._enter(request)
        hub = self.engine.batch_hub
        reader = hub.subscribe()
        resp = web.StreamResponse(headers={"Content-Type": _NDJSON})
        heartbeat = self.engine.config.heartbeat_s
        try:
            await resp.prepare(request)
            while not reader.closed:
                with anyio.move_on_after(heartbeat):
                    await reader.wait()
                data = reader.drain()
                if data:
                    await resp.write(data)
                elif not reader.closed:
                    await resp.write(b"\n")
        except ConnectionError:
            pass
        finally:
            hub.unsubscribe(reader)
        if reader.closed and self.engine.batch_hub is not hub:
            _drop(request)
        return resp

    async def get_faults(self, request: web.Request) -> web.StreamResponse:
        return _json(self.engine.faults.to_dict())

    async def post_faults(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            body = await self._body(request)
            self.engine.faults.update(body)
        except ApiError as exc:
            return _error(exc)
        except FaultsError as exc:
            return _error(ApiError(400, str(exc), "BadRequestError"))
        return _json(self.engine.faults.to_dict())

    async def restart(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            body = await self._body(request) if request.can_read_body else {}
        except ApiError as exc:
            return _error(exc)
        if not isinstance(body, dict):
            return _error(ApiError(400, "body must be a JSON object", "BadRequestError"))
        downtime = body.get("downtime_s", 0.0)
        if (
            isinstance(downtime, bool)
            or not isinstance(downtime, (int, float))
            or not 0 <= downtime <= MAX_DOWNTIME_S
        ):
            return _error(
                ApiError(
                    400,
                    f"downtime_s must be a number in [0, {MAX_DOWNTIME_S:g}] "
                    f"(got {downtime!r:.80})",
                    "BadRequestError",
                    "downtime_s",
                )
            )
        self.engine.request_restart(float(downtime))
        return _json({"restarting": True, "downtime_s": float(downtime)})


def build_app(engine: EngineCore, admin_token: str | None = None) -> web.Application:
    """The aiohttp application serving ``engine``.

    Args:
        engine: The engine.
        admin_token: When set, ``POST /bear/faults`` and ``POST /bear/restart``
            require ``Authorization: Bearer <admin_token>``.
    """
    api = _Api(engine, admin_token)
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/health", api.health)
    app.router.add_get("/version", api.version)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/bear/snapshot", api.snapshot)
    app.router.add_get("/bear/snapshots", api.snapshots)
    app.router.add_get("/bear/batches", api.batches)
    app.router.add_get("/bear/faults", api.get_faults)
    app.router.add_post("/bear/faults", api.post_faults)
    app.router.add_post("/bear/restart", api.restart)
    return app


def _env_token() -> str | None:
    return os.environ.get(ADMIN_TOKEN_ENV) or None


@attrs.define
class HttpServer:
    """Serves one engine's API on a TCP port.

    The server is built around an engine (the engine knows nothing of it):
    :class:`~bearsdk.emulator.EmulatedEngine` starts and stops one around its
    core, and bounces it on a restart.

    Args:
        engine: The engine.
        admin_token: Bearer token of the admin endpoints (default: the
            ``BEARSDK_ADMIN_TOKEN`` environment variable; unset: none needed,
            which only a loopback address allows).
    """

    _engine: EngineCore
    admin_token: str | None = attrs.field(
        factory=_env_token, validator=_admin_token, repr=False, kw_only=True
    )
    _runner: web.AppRunner | None = attrs.field(default=None, init=False)
    _port: int = attrs.field(default=0, init=False)

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    async def start(self, host: str, port: int) -> None:
        """Bind and serve (``port`` 0: any free port).

        Raises:
            AdminTokenError: ``host`` is not a loopback address and no admin token is set.
            OSError: The port cannot be bound.
        """
        if self.admin_token is None and not is_loopback(host):
            raise AdminTokenError(
                f"emulated engine: binding {host!r} would let anyone who reaches it inject "
                f"faults and restart the engine: set {ADMIN_TOKEN_ENV} to a secret of at least "
                "8 characters (clients send it as 'Authorization: Bearer ...'), or bind 127.0.0.1"
            )
        runner = web.AppRunner(
            build_app(self._engine, self.admin_token),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        addr = runner.addresses[0]
        self._port = int(addr[1])

    async def stop(self) -> None:
        """Stop serving; open connections are closed."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            # Let the transports closed by the cleanup finish closing.
            await asyncio.sleep(0)
