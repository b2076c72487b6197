"""The load generator of ``bearsdk bench gateway``: streamed requests and their tally.

One client code for the engine and the gateway (:func:`_stream`), open-loop
arrivals on schedule (:func:`_open_loop`), quantiles and outcome counts.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, NamedTuple

import aiohttp
import anyio
import attrs
import orjson

from bearsdk.bench.gateway._common import MODEL, PROMPT


class Result(NamedTuple):
    """One streamed request as the client saw it."""

    status: int
    first_s: float
    last_s: float
    outcome: str
    """``ok`` ([DONE], no error event), ``error:CODE`` (an in-band error event),
    ``HTTP n`` or what went wrong."""
    instance: str
    ended: float
    """``perf_counter`` when it ended."""


@attrs.define
class _Open:
    """Streams that got their first chunk and have not ended, and the most at once."""

    now: int = 0
    peak: int = 0
    settled: int = 0  # got a first chunk, or ended without one

    def first(self) -> None:
        self.now += 1
        self.settled += 1
        self.peak = max(self.peak, self.now)


def _body(max_tokens: int) -> bytes:
    msgs = [{"role": "user", "content": PROMPT}]
    doc = {"model": MODEL, "messages": msgs, "stream": True, "max_tokens": max_tokens}
    return orjson.dumps(doc)


def _headers(secret: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    track: _Open | None = None,
) -> Result:
    """One streamed chat completion; the same code for the engine and the gateway."""
    t0 = time.perf_counter()
    first = math.nan
    status = 0
    instance = ""
    done = False
    error: str | None = None
    try:
        async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
            status = r.status
            instance = r.headers.get("x-bear-instance", "")
            if status != 200:
                await r.read()
                outcome = f"HTTP {status}"
            else:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        if math.isnan(first):
                            first = time.perf_counter() - t0
                            if track is not None:
                                track.first()
                        if line.startswith(b'data: {"error"'):
                            error = f"error:{_error_code(line)}"
                    elif line.startswith(b"data: [DONE]"):
                        done = True
                outcome = error or ("ok" if done else "ended without [DONE]")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        outcome = f"{type(exc).__name__}: {exc}".strip()
    end = time.perf_counter()
    if track is not None:
        if not math.isnan(first):
            track.now -= 1
        else:
            track.settled += 1
    return Result(status, first, end - t0, outcome, instance, end)


def _error_code(line: bytes) -> str:
    """The ``code`` of an in-band error event (``?`` if it has none)."""
    try:
        err = orjson.loads(line[6:]).get("error")
    except (ValueError, AttributeError):
        return "?"
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code is not None else "?"


def _session(limit: int = 0) -> aiohttp.ClientSession:
    # No connection cap (aiohttp's default is 100), no total timeout: streams are long.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=60.0)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout)


async def _open_loop(
    n: int, rate: float, send: Callable[[int], Coroutine[Any, Any, None]]
) -> tuple[list[float], float]:
    """Start ``send(i)`` for i < n at ``rate``/s on schedule; wait for all of them.

    Returns:
        How late each start was (s) and the rate achieved between first and last start.
    """
    late: list[float] = []
    starts: list[float] = []
    async with anyio.create_task_group() as tg:
        t0 = time.perf_counter() + 0.005
        for i in range(n):
            at = t0 + i / rate
            delay = at - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            now = time.perf_counter()
            late.append(max(0.0, now - at))
            starts.append(now)
            tg.start_soon(send, i)
    span = starts[-1] - starts[0] if n > 1 else 0.0
    return late, (n - 1) / span if span > 0 else math.nan


def _q(values: list[float], p: float) -> float:
    """Nearest-rank percentile (as the router bench's), ``nan`` when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


def _ms(x: float) -> float | None:
    return None if x != x else round(x * 1e3, 3)


def _outcomes(results: Iterable[Result]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def _gateway_in_flight(session: aiohttp.ClientSession, url: str) -> int | None:
    """``bearsdk_gateway_in_flight`` from ``/metrics`` (None without the metrics extra)."""
    try:
        async with session.get(url + "/metrics") as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, OSError):
        return None
    m = re.search(r"^bearsdk_gateway_in_flight (\S+)$", text, re.MULTILINE)
    return None if m is None else int(float(m.group(1)))


def _instances(results: Iterable[Result]) -> dict[str, int]:
    """Answered requests per instance (``x-bear-instance``)."""
    out: dict[str, int] = {}
    for r in results:
        if r.instance:
            out[r.instance] = out.get(r.instance, 0) + 1
    return dict(sorted(out.items()))


def _failures(results: Iterable[Result] | dict[str, list[Result]]) -> str:
    rs = [r for v in results.values() for r in v] if isinstance(results, dict) else results
    bad = _outcomes(r for r in rs if r.outcome != "ok")
    return "; ".join(f"{k} x{v}" for k, v in list(bad.items())[:5])
