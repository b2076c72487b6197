"""``bearsdk demo --workload agents``: multi-turn agent sessions on prefix-caching engines.

Four emulated Qwen3-8B engines with vLLM's automatic prefix caching, each
publishing its KV events as vLLM does. Agent sessions arrive at a Poisson rate;
each runs several turns closed-loop (the next turn is sent when the previous
answer has streamed in, after a short think time) and resends its whole,
growing conversation every turn, behind one of three shared system prompts.
Every turn has the same TTFT target. Three routers are compared at each rate:

* ``BEAR + cache``: the router tokenizes each turn as the engines do (the
  model's tokenizer and chat template) and follows every engine's KV events,
  so BEA prices the prefix each engine holds;
* ``BEAR + dispatches``: no tokenizer, no events: what the router sent where,
  by character blocks (approximate);
* ``BEAR``: the cache unknown to the router (every prompt priced in full).

The table gives, per rate and router, the share of turns whose first token
met the target, the mean and p90 TTFT, and the share of prompt tokens the
engines found cached (their ``usage.prompt_tokens_details``).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import anyio
import attrs

__all__ = ["AGENT_ROUTERS", "AgentRun", "agents_table", "run_agents"]

AGENT_ROUTERS = ("BEAR + cache", "BEAR + dispatches", "BEAR")
"""The routers compared (module docstring)."""

_PROFILE = "qwen3-8b-h100"
_INSTANCES = 4
_TURNS = 5
_TARGET_S = 0.5
_WORDS = tuple(
    [
        "the",
        "agent",
        "reads",
        "file",
        "test",
        "code",
        "bug",
        "fix",
        "tool",
        "call",
        "result",
        "search",
        "query",
        "answer",
        "function",
        "value",
        "error",
        "list",
        "class",
        "import",
        "return",
        "self",
        "print",
        "args",
        "plan",
        "step",
        "next",
        "we",
        "it",
        "is",
        "that",
        "for",
        "with",
        "on",
        "this",
        "are",
        "from",
        "at",
        "which",
        "but",
        "have",
        "an",
        "they",
        "you",
        "were",
    ]
)


@attrs.frozen
class AgentRun:
    """One router at one rate.

    Attributes:
        router: One of :data:`AGENT_ROUTERS`.
        rate: Sessions per second.
        turns: Turns sent. on_time: Share whose TTFT met the target.
        mean_ttft_s: Mean TTFT. p90_ttft_s: 90th percentile TTFT.
        cached: Share of prompt tokens the engines found cached.
        failed: Turns that got no answer.
    """

    router: str
    rate: float
    turns: int
    on_time: float
    mean_ttft_s: float
    p90_ttft_s: float
    cached: float
    failed: int


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _run(
    router_kind: str, rate: float, duration_s: float, seed: int, slowdown: float
) -> AgentRun:
    from bearsdk.emulator import EngineConfig, EnginePool, GroundTruthParams
    from bearsdk.emulator.chat_tokenizer import stand_in_chat_tokenizer
    from bearsdk.router import AsyncRouter
    from bearsdk.selectors import BEAR

    params = {"enable_prefix_caching": True, "max_model_len": 32768}
    cfgs = [
        EngineConfig(
            profile=_PROFILE,
            params=params,
            instance=f"a{i}",
            seed=seed + i,
            time_model=GroundTruthParams(time_scale=slowdown),
            kv_events=router_kind == "BEAR + cache",
            enable_prompt_tokens_details=True,
        )
        for i in range(_INSTANCES)
    ]
    rng = random.Random(seed)
    systems = [_text(rng, rng.randint(2500, 5000)) for _ in range(3)]
    starts: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        starts.append(t)
        t += rng.expovariate(rate)
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = failed = 0
    async with EnginePool(cfgs) as pool:
        engines = list(pool)
        # (Only the "BEAR + cache" engines publish KV events.)
        confs = pool.instance_configs(calibrated=True)
        model = engines[0].model_name
        kw: dict[str, Any] = {}
        if router_kind == "BEAR + cache":
            kw["tokenizers"] = {model: stand_in_chat_tokenizer(engines[0].tokenizer)}
        elif router_kind == "BEAR + dispatches":
            kw["dispatch_prefixes"] = True
        async with AsyncRouter(confs, BEAR(), **kw) as router:
            await anyio.sleep(0.3)  # first snapshots; the event sockets join
            t0 = anyio.current_time()

            async def session(k: int, start: float) -> None:
                nonlocal prompt_tokens, cached_tokens, failed
                r = random.Random(seed * 7919 + k)
                await anyio.sleep(max(0.0, t0 + start - anyio.current_time()))
                msgs: list[dict[str, str]] = [
                    {"role": "system", "content": systems[min(2, int(r.paretovariate(1.2)) - 1)]}
                ]
                for _ in range(_TURNS):
                    msgs.append({"role": "user", "content": _text(r, r.randint(60, 400))})
                    try:
                        stream = await router.chat(
                            msgs,
                            ttft_target=_TARGET_S,
                            stream=True,
                            max_tokens=r.randint(24, 96),
                            stream_options={"include_usage": True},
                        )
                        parts = []
                        async with stream:
                            async for chunk in stream:
                                for c in chunk.get("choices") or ():
                                    parts.append((c.get("delta") or {}).get("content") or "")
                    except Exception:  # a failed turn ends the session; it is counted
                        failed += 1
                        return
                    if stream.ttft_s is not None:
                        ttfts.append(stream.ttft_s)
                    usage = stream.usage or {}
                    prompt_tokens += int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    cached_tokens += int(details.get("cached_tokens") or 0)
                    msgs.append({"role": "assistant", "content": "".join(parts)})
                    await anyio.sleep(r.expovariate(2.0))

            async with anyio.create_task_group() as tg:
                for k, s in enumerate(starts):
                    tg.start_soon(session, k, s)
    ttfts.sort()
    n = len(ttfts)
    return AgentRun(
        router=router_kind,
        rate=rate,
        turns=n + failed,
        on_time=sum(x <= _TARGET_S for x in ttfts) / max(1, n + failed),
        mean_ttft_s=statistics.fmean(ttfts) if ttfts else math.nan,
        p90_ttft_s=ttfts[int(0.9 * (n - 1))] if ttfts else math.nan,
        cached=cached_tokens / max(1, prompt_tokens),
        failed=failed,
    )


def run_agents(
    rates: Sequence[float],
    *,
    routers: Sequence[str] = AGENT_ROUTERS,
    duration_s: float = 12.0,
    seed: int = 0,
    slowdown: float = 3.0,
    progress: bool = True,
) -> list[AgentRun]:
    """Each router at each rate, one after the other, each on a fresh pool."""
    out = []
    for rate in rates:
        for kind in routers:
            t0 = time.perf_counter()
            run = anyio.run(_run, kind, rate, duration_s, seed, slowdown)
            out.append(run)
            if progress:
                print(
                    f"  {kind} at {rate:g} sessions/s: {run.turns} turns, "
                    f"{100 * run.on_time:.1f} % on time ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return out


def agents_table(runs: Sequence[AgentRun], slowdown: float) -> str:
    """The demo's table (Markdown)."""
    lines = [
        f"{_INSTANCES} x Qwen3-8B (emulated, prefix caching on, GPUs {slowdown:g}x slower than "
        f"the profile), agent sessions of {_TURNS} turns behind 3 shared system prompts, "
        f"TTFT target {_TARGET_S:g} s",
        "",
        "| sessions/s | router | turns | on time | mean TTFT | p90 TTFT | prompt cached |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.rate:g} | {r.router} | {r.turns} | {100 * r.on_time:.1f} % | "
            f"{1e3 * r.mean_ttft_s:.0f} ms | {1e3 * r.p90_ttft_s:.0f} ms | "
            f"{100 * r.cached:.1f} % |"
        )
    return "\n".join(lines)
