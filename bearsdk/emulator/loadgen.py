"""An open-loop streaming load generator for OpenAI-compatible endpoints.

Poisson arrivals at ``rate`` requests/s for ``duration_s``, spread round-robin
over the endpoints; prompt and output lengths log-normal around the Azure 2023
conversation trace's medians (about 1000 prompt tokens, 129 output tokens; the
output length is forced with ``bear_output_len`` so every run carries the same
work). Each request streams (``/v1/completions``, ``stream_options.include_usage``)
and is timed at the client: time to the first content chunk, end to end, and the
``usage`` the server reported.

``python -m bearsdk.emulator.loadgen --url http://127.0.0.1:8001 --rate 20
--duration 30`` prints one JSON object per request, then a summary; the emulator
benchmark runs it in a separate process, so the client's CPU does not count
against the engines' event loop.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import anyio
import attrs
import orjson

__all__ = ["LoadSpec", "RequestResult", "main", "run_load", "summarize"]

_WORDS = tuple(
    "the a to of and in is it for on with as at by an be this that from or are was we can "  # noqa: SIM905
    "not but all one out up so if no its has new use how more time data".split(" ")
)


@attrs.frozen
class LoadSpec:
    """What load to offer.

    Attributes:
        urls: Base URLs of the endpoints (requests go round-robin).
        rate: Mean arrivals per second (Poisson).
        duration_s: How long to keep sending.
        seed: Seeds arrivals and lengths.
        prompt_median: Median prompt length, tokens.
        prompt_sigma: Log-normal sigma of prompt lengths.
        output_median: Median output length, tokens.
        output_sigma: Log-normal sigma of output lengths.
        max_prompt: Largest prompt.
        max_output: Largest output.
        timeout_s: Per-request timeout.
    """

    urls: tuple[str, ...]
    rate: float = 20.0
    duration_s: float = 30.0
    seed: int = 0
    prompt_median: float = 1020.0
    prompt_sigma: float = 0.985
    output_median: float = 129.0
    output_sigma: float = 0.856
    max_prompt: int = 8000
    max_output: int = 1024
    timeout_s: float = 120.0


@attrs.frozen
class RequestResult:
    """One request as the client saw it (seconds).

    Attributes:
        id: The ``X-Request-Id`` sent.
        url: Endpoint.
        sent: Client clock (``time.monotonic``) when sent.
        ttft: Time to the first content chunk (``None``: none arrived).
        e2e: Time to the end of the stream.
        prompt_tokens: ``usage.prompt_tokens`` reported.
        completion_tokens: ``usage.completion_tokens`` reported.
        chunks: Content chunks received.
        expected_tokens: Output length requested.
        error: Error text, if the request failed.
    """

    id: str
    url: str
    sent: float
    ttft: float | None
    e2e: float | None
    prompt_tokens: int
    completion_tokens: int
    chunks: int
    expected_tokens: int
    error: str | None = None


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    rid: str,
    prompt: str,
    out_len: int,
    timeout_s: float,
) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": 4096,
        "stream": True,
        "stream_options": {"include_usage": True},
        "bear_output_len": out_len,
    }
    t0 = time.monotonic()
    ttft: float | None = None
    chunks = ptoks = ctoks = 0
    try:
        with anyio.fail_after(timeout_s):
            async with session.post(
                url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
            ) as r:
                if r.status != 200:
                    text = (await r.text())[:200]
                    return RequestResult(rid, url, t0, None, None, 0, 0, 0, out_len, text)
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    obj = orjson.loads(line[6:])
                    if obj["choices"]:
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        chunks += 1
                    usage = obj.get("usage")
                    if usage:
                        ptoks, ctoks = usage["prompt_tokens"], usage["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return RequestResult(rid, url, t0, ttft, None, ptoks, ctoks, chunks, out_len, repr(exc))
    return RequestResult(rid, url, t0, ttft, time.monotonic() - t0, ptoks, ctoks, chunks, out_len)


async def run_load(spec: LoadSpec) -> list[RequestResult]:
    """Offer the load and return every request's result (in sending order)."""
    if not spec.urls:
        raise ValueError("urls must name at least one endpoint (got none)")
    if not (spec.rate > 0 and spec.duration_s > 0):
        raise ValueError(f"rate and duration_s must be > 0 (got {spec.rate}, {spec.duration_s})")
    rng = random.Random(spec.seed)
    plan: list[tuple[float, str, str, str, int]] = []
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.duration_s:
            break
        p = _lognormal(rng, spec.prompt_median, spec.prompt_sigma, 16, spec.max_prompt)
        o = _lognormal(rng, spec.output_median, spec.output_sigma, 1, spec.max_output)
        prompt = " ".join(rng.choices(_WORDS, k=p))
        plan.append((t, spec.urls[i % len(spec.urls)], f"lg{spec.seed}-{i}", prompt, o))
        i += 1
    results: list[RequestResult | None] = [None] * len(plan)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def fire(k: int) -> None:
            _, url, rid, prompt, o = plan[k]
            results[k] = await _one(session, url, rid, prompt, o, spec.timeout_s)

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for k, (at, *_rest) in enumerate(plan):
                await anyio.sleep_until(start + at)
                tg.start_soon(fire, k)
    return [r for r in results if r is not None]


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else math.nan


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput, TTFT and error counts of a run."""
    ok = [r for r in results if r.error is None and r.e2e is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    end = max((r.sent + (r.e2e or 0.0) for r in ok), default=0.0)
    start = min((r.sent for r in results), default=0.0)
    span = max(end - start, duration_s)
    return {
        "sent": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "usage_mismatches": sum(1 for r in ok if r.completion_tokens != r.expected_tokens),
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / span if span > 0 else 0.0,
        "ttft_median_s": statistics.median(ttfts) if ttfts else math.nan,
        "ttft_p99_s": _pct(ttfts, 0.99),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bearsdk.emulator.loadgen", description=__doc__)
    ap.add_argument("--url", action="append", required=True, help="endpoint base URL (repeat)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-median", type=float, default=129.0, help="median output tokens")
    ap.add_argument("--prompt-median", type=float, default=1020.0, help="median prompt tokens")
    args = ap.parse_args(argv)
    spec = LoadSpec(
        tuple(args.url),
        args.rate,
        args.duration,
        args.seed,
        prompt_median=args.prompt_median,
        output_median=args.output_median,
    )
    results = anyio.run(run_load, spec)
    out = sys.stdout.buffer
    for r in results:
        out.write(orjson.dumps(attrs.asdict(r)) + b"\n")
    out.write(orjson.dumps({"summary": summarize(results, spec.duration_s)}) + b"\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
