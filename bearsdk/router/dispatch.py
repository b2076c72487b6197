"""Dispatch: send a routed request, retry elsewhere on failure, hand back the answer.

:class:`Dispatcher` posts the request to the chosen instance over HTTP and, when
the instance fails before its response starts (connection refused, 5xx, a
stream head that never comes), moves on to the next-best candidate in the
decision's order, within ``retries``. What it observes (sends, failures, first
tokens, completions) goes back to the :class:`~bearsdk.router.core.RouterCore`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import attrs
import orjson

from bearsdk.errors import BearError
from bearsdk.router.core import RouterCore
from bearsdk.router.decision import Decision
from bearsdk.router.errors import (
    DispatchError,
    EngineRequestError,
    RequestError,
    check_max_tokens,
    check_timeout,
    prompt_text,
    short,
)
from bearsdk.router.slot import InstanceSlot
from bearsdk.router.stream import ChatResponse, ChatStream, EngineResponse, exc_text

if TYPE_CHECKING:
    from bearsdk.io.hop import HopSession

__all__ = ["Dispatcher"]

log = logging.getLogger("bearsdk.router")

# A streamed response's head comes before generation starts: waiting longer than
# this for it means the engine is stuck, whatever the request's own budget.
_STREAM_HEAD_TIMEOUT_S = 30.0


@attrs.define
class Dispatcher:
    """Sends requests for a :class:`~bearsdk.router.core.RouterCore`.

    Args:
        core: The core that decides and learns.
        retries: Further instances tried when one fails before its first byte.
        idle_timeout_s: Longest silence of an engine once its response head has arrived.
        max_event_bytes: Largest SSE line or event of a streamed response.
        max_body_bytes: Largest whole (not streamed) response body.
        session: The HTTP session (set while the router runs).
        hop: The lean client requests go by instead, when set
            (:mod:`bearsdk.io.hop`; the router's own, without a caller's session).
    """

    core: RouterCore
    retries: int = 2
    idle_timeout_s: float = 60.0
    max_event_bytes: int = 1 << 20
    max_body_bytes: int = 64 << 20
    session: aiohttp.ClientSession | None = None
    hop: HopSession | None = None

    async def send(
        self,
        path: str,
        prompt: str | Sequence[Mapping[str, Any]],
        body: dict[str, Any],
        ttft_target: float | None,
        stream: bool,
        timeout_s: float | None = None,
        *,
        instances: Collection[str] | None = None,
        decision: Decision | None = None,
        tpot_target: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> ChatStream | ChatResponse:
        if self.session is None:
            raise BearError("AsyncRouter is not started: use 'async with AsyncRouter(...)'")
        core = self.core
        max_tokens = check_max_tokens("max_tokens", body.get("max_tokens"))
        max_completion = check_max_tokens(
            "max_completion_tokens", body.get("max_completion_tokens")
        )
        timeout_s = check_timeout(timeout_s)
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be True or False (got {short(stream)})")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, Mapping):
            raise RequestError(f"stream_options must be an object (got {short(options)})")
        try:
            orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:  # caught here, not once per instance tried
            raise RequestError(f"the request's parameters are not JSON: {exc}") from None
        text = prompt_text(prompt)
        if decision is None:
            decision = core.decide(
                prompt,
                ttft_target=ttft_target,
                max_tokens=max_tokens or max_completion,
                instances=instances,
                tpot_target=tpot_target,
                prompt_token_ids=prompt_token_ids,
            )
        caller_usage = bool((options or {}).get("include_usage"))
        body["stream"] = stream
        if stream:
            # Usage feeds calibration; the caller sees it only if it asked.
            body["stream_options"] = {**(options or {}), "include_usage": True}
        attempts: list[tuple[str, str]] = []
        for name in self.fallback_order(decision):
            if len(attempts) > self.retries:
                break
            inst = core.find(name)
            if inst is None or inst.draining:
                continue
            if not inst.breaker.allows(core.clock()):
                continue
            try:
                resp, sent_at = await self._post(inst, path, body, decision, timeout_s, stream)
            except _Retryable as exc:
                attempts.append((name, exc.why))
                self.failed(inst, decision, exc.why, fault=exc.fault)
                continue
            if stream:
                return ChatStream(
                    self, inst, decision, resp, sent_at, caller_usage, text, timeout_s is not None
                )
            return await self._read_whole(inst, decision, resp, sent_at, text, timeout_s)
        raise DispatchError(
            f"request {decision.request_id}: every instance tried failed "
            f"({'; '.join(f'{n}: {e}' for n, e in attempts) or 'none routable'})",
            attempts,
            decision,
        )

    def fallback_order(self, d: Decision) -> Iterator[str]:
        """The chosen instance, then the others best first by the policy's scores.

        Every one is listed: :meth:`send` stops after ``retries`` further
        attempts, so instances that cannot be tried (drained, removed, circuit
        broken) do not use up the retries. The others are ranked only once the
        chosen one has failed (a decision builds its candidates when read).
        """
        yield d.instance
        cands = d.candidates
        rest = sorted(
            (i for i in range(len(cands)) if i != d.index),
            key=lambda i: -cands[i].score if not math.isnan(cands[i].score) else math.inf,
        )
        for i in rest:
            yield cands[i].instance

    async def _post(
        self,
        inst: InstanceSlot,
        path: str,
        body: dict[str, Any],
        d: Decision,
        timeout_s: float | None = None,
        stream: bool = True,
    ) -> tuple[EngineResponse, float]:
        assert self.session is not None
        cfg = inst.config
        total = cfg.timeout_s if timeout_s is None else timeout_s
        # A whole response's head comes only once it is generated: the request's
        # budget bounds it; a stream's head must come soon after sending.
        head = min(total, _STREAM_HEAD_TIMEOUT_S) if stream else total
        body["model"] = cfg.engine_model
        now = self.core.clock()
        inst.breaker.on_send(now)
        booked = False

        def book() -> None:
            nonlocal booked
            self.core.sent(inst, d, now)
            booked = True

        if self.hop is None:
            book()
        try:
            try:
                data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
                headers = {"Content-Type": "application/json", "X-Request-Id": d.request_id}
                resp: EngineResponse
                if self.hop is not None:
                    # Booked once the request is on its way on a kept connection,
                    # not before: the engine starts on it while the router writes
                    # it into its books (no decision comes between: nothing
                    # awaits). Before connecting a new one, as before any wait.
                    resp = await self.hop.post(
                        cfg.url + path,
                        data=data,
                        headers=headers,
                        total_s=total,
                        head_s=head,
                        on_dispatch=book,
                    )
                else:
                    with anyio.fail_after(head):
                        resp = await self.session.post(
                            cfg.url + path,
                            data=data,
                            headers=headers,
                            timeout=aiohttp.ClientTimeout(total=total),
                        )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # The caller's own budget running out says nothing about the
                # instance (a 1 ns deadline must not open every breaker); a
                # connect timeout or a stuck stream head does.
                callers = (
                    timeout_s is not None
                    and head == total
                    and isinstance(exc, TimeoutError)
                    and not isinstance(exc, aiohttp.ServerTimeoutError)
                )
                raise _Retryable(
                    f"the request's timeout_s ({total:g} s) ran out before the response"
                    if callers
                    else f"{type(exc).__name__}: {exc_text(exc)}",
                    fault=not callers,
                ) from None
            if resp.status >= 400:
                try:
                    with anyio.move_on_after(min(self.idle_timeout_s, 5.0)):
                        raw = await resp.content.read(64 << 10)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    raw = b""
                finally:
                    resp.close()
                text = raw.decode("utf-8", "replace")
                if resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status}: {text[:200]}")
                # The request itself is bad: another instance would refuse it too.
                self.core.unsent(inst, d)
                inst.breaker.on_success()
                raise EngineRequestError(resp.status, text, d)
        except _Retryable:
            if booked:
                self.core.unsent(inst, d)
            raise
        except EngineRequestError:
            raise
        except BaseException:
            # Cancelled (or a bug) while sending: the request is off the books,
            # and a probe slot it held is free for the next request.
            if booked:
                self.core.unsent(inst, d)
            inst.breaker.on_abandon()
            raise
        return resp, now

    async def _read_whole(
        self,
        inst: InstanceSlot,
        d: Decision,
        resp: EngineResponse,
        sent_at: float,
        text: str,
        timeout_s: float | None,
    ) -> ChatResponse:
        try:
            raw = await _read_body(resp, self.max_body_bytes, self.idle_timeout_s)
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise _BodyError(f"the response is not JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise _BodyError(f"the response is not a JSON object (got {short(doc)})")
        except (
            _BodyError,
            aiohttp.ClientError,
            OSError,
            TimeoutError,
            orjson.JSONDecodeError,
        ) as exc:
            resp.close()
            self.core.completed(inst, d, "error", None, text)
            callers = (
                timeout_s is not None
                and isinstance(exc, TimeoutError)
                and not isinstance(exc, aiohttp.ServerTimeoutError)
            )
            why = (
                exc.why
                if isinstance(exc, _BodyError)
                else f"the request's timeout_s ({timeout_s:g} s) ran out"
                if callers and timeout_s is not None
                else f"{type(exc).__name__}: {exc_text(exc)}"
            )
            if callers:
                inst.breaker.on_abandon()
            else:
                self.failed(inst, d, why, before_head=False)
            raise DispatchError(
                f"request {d.request_id}: {inst.name}: {why}", [(inst.name, why)], d
            ) from None
        except BaseException:
            resp.close()
            self.core.completed(inst, d, "cancelled", None, text)
            inst.breaker.on_abandon()
            raise
        resp.release()
        result = ChatResponse(doc)
        result.decision, result.instance = d, inst.name
        result.latency_s = self.core.clock() - sent_at
        # No first token was seen, only the whole answer: it teaches nothing about TTFT.
        inst.breaker.on_success()
        usage = result.get("usage")
        self.core.completed(inst, d, "ok", usage if isinstance(usage, Mapping) else None, text)
        return result

    def failed(
        self,
        inst: InstanceSlot,
        d: Decision,
        why: str,
        *,
        fault: bool = True,
        before_head: bool = True,
    ) -> None:
        if fault:
            inst.breaker.on_failure(self.core.clock())
        else:
            inst.breaker.on_abandon()
        when = "before answering" if before_head else "while answering"
        log.warning("request %s: %s failed %s: %s", d.request_id, inst.name, when, why)
        if before_head:
            for hook in self.core.hooks.on_failure:
                hook(d, inst.name, why)


class _Retryable(Exception):
    """An attempt failed before the response head: the next instance is tried.

    ``fault``: the instance is to blame (counts against its breaker).
    """

    def __init__(self, why: str, *, fault: bool = True) -> None:
        super().__init__(why)
        self.why = why
        self.fault = fault


class _BodyError(Exception):
    """A response body that breaks the protocol (too large, not JSON)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


async def _read_body(resp: EngineResponse, limit: int, idle_s: float) -> bytes:
    """The whole body, at most ``limit`` bytes, with at most ``idle_s`` between pieces."""
    parts: list[bytes] = []
    size = 0
    while True:
        with anyio.move_on_after(idle_s) as scope:
            piece = await resp.content.readany()
        if scope.cancelled_caught:
            raise _BodyError(f"the body stalled for {idle_s:g} s (idle_timeout_s)")
        if not piece:
            return b"".join(parts)
        size += len(piece)
        if size > limit:
            raise _BodyError(f"the body is larger than {limit} bytes (max_body_bytes)")
        parts.append(piece)
