"""Prefix caching in the simulator: agent sessions over caching engines, cache-aware baselines.

Multi-turn agent sessions run closed-loop in virtual time over simulated
engines with vLLM's automatic prefix caching (:class:`~bearsdk.sim.engine.SimEngine`
on the replay's own block pool, so the engines run exactly the semantics the
replay models). Sessions start at a Poisson rate; each resends its whole
conversation every turn (a system prompt shared by many sessions, chosen with
Zipf popularity, then its turns: the user's new text and the previous
answers), the next turn arriving when the previous answer is complete plus a
think time. Every turn gets the paper's TTFT target for its prompt length
(appendix A.2).

Policies:

* ``bear-cache``: BEAR with the prompt's token ids: BEA replays each
  candidate's snapshot, block pool included (``kv.prefix_cache``), so the new
  turn's admission hits what is cached there;
* ``bear``: BEAR without them (the cache is invisible to the router);
* ``llm-d-prefix``: llm-d's default scorer mix, prefix-cache hit share
  (weight 3), queue depth (2) and KV-cache utilisation (2), best total score;
* ``dynamo-kv``: Dynamo's KV router cost, the prompt blocks left to prefill
  (overlap-discounted, weight 1) plus the blocks the instance's requests hold,
  lowest cost;
* ``session-affinity``: consistent hashing of the session over the instances.

Both BEAR policies route through a :class:`~bearsdk.router.core.RouterCore`
given the engines' own flags, with ``expect_arrivals`` (the prompts still to
come folded into each TTFT estimate) and, for a turn no instance is predicted
to serve on time, the instance with the fewest requests in flight
(``BEAR(overload="least-requests")``), unless told otherwise. The baselines
read the engines' true state (their hits, queues and blocks): the best their
inputs could be. A trace's prompt is cut to what every instance serves (its
shared prefixes are at its front). Utility is the model's accuracy (the
router's predictor, the same for every policy) less ``lam`` times the
request's cost; OnTimeUtility counts it only when the first token met the
target (eq. 6).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any, Final

import attrs
import numpy as np

from bearsdk.replay.blocks import chain_keys
from bearsdk.sim.engine import (
    COMPLETE,
    FIRST_TOKEN,
    BatchNoise,
    EngineEvent,
    SimEngine,
    bind_engine,
)

__all__ = ["PREFIX_POLICIES", "PrefixRun", "run_prefix"]

PREFIX_POLICIES: Final = ("bear-cache", "bear", "llm-d-prefix", "dynamo-kv", "session-affinity")
"""The policies compared (module docstring)."""

_STEP_S: Final = 0.2
"""Engines advance at most this far between looks at the clock; no think time is
shorter, so a turn released by a completion never arrives in the past."""
_VOCAB: Final = 150_000


@attrs.frozen
class PrefixRun:
    """One policy at one session rate.

    Attributes:
        policy: One of :data:`PREFIX_POLICIES`. rate: Sessions started per second.
        turns: Turns served. on_time_utility: Eq. 6 over the turns.
        slo_attainment: Share of turns whose first token met the target.
        mean_ttft_s: Mean TTFT. p90_ttft_s: Its 90th percentile.
        hit_rate: Share of prompt tokens the engines found cached.
        composition: Turns per instance.
        decide_us: Mean routing decision time (the policy's own code).
    """

    policy: str
    rate: float
    turns: int
    on_time_utility: float
    slo_attainment: float
    mean_ttft_s: float
    p90_ttft_s: float
    hit_rate: float
    composition: dict[str, int]
    decide_us: float

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for JSON)."""
        return attrs.asdict(self)


@attrs.define
class _Session:
    ids: list[int]
    turn: int = 0
    # A trace's request: its prompt and output length, as given (one turn).
    fixed: tuple[list[int], int] | None = None


_HASH_TOKENS: Final = 512
"""Tokens per Mooncake hash id (the trace's block)."""


def mooncake_requests(path: str, count: int, rate: float) -> list[tuple[float, list[int], int]]:
    """The first ``count`` requests of a Mooncake trace as (arrival, prompt ids, output).

    Each hash id stands for 512 fixed token ids (so a shared hash id is a
    shared block, as the trace means), cut to the request's ``input_length``;
    the trace's timestamps are rescaled to a mean of ``rate`` requests/s.

    Raises:
        ValueError: A line that is not a request of the trace (named by number).
    """
    import orjson

    blocks: dict[int, list[int]] = {}
    rows: list[tuple[float, list[int], int]] = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if len(rows) >= count:
                break
            try:
                r = orjson.loads(line)
                ts, plen = float(r["timestamp"]), int(r["input_length"])
                out, hashes = int(r["output_length"]), [int(h) for h in r["hash_ids"]]
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: line {n} is not a Mooncake request ({exc})") from None
            if not (0 < plen <= 1 << 20 and 0 <= out <= 1 << 20 and len(hashes) <= 4096):
                raise ValueError(f"{path}: line {n}: lengths out of bounds")
            ids: list[int] = []
            for h in hashes:
                got = blocks.get(h)
                if got is None:
                    got = blocks[h] = _tokens(random.Random(f"mooncake-{h}"), _HASH_TOKENS)
                ids.extend(got)
            rows.append((ts / 1000.0, ids[:plen], max(1, out)))
    if not rows:
        return []
    span = rows[-1][0] - rows[0][0]
    scale = (len(rows) - 1) / span / rate if span > 0 and len(rows) > 1 else 1.0
    t0 = rows[0][0]
    return [((t - t0) * scale, ids, out) for t, ids, out in rows]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, _VOCAB) for _ in range(n)]


@functools.cache
def _ring(names: tuple[str, ...]) -> tuple[list[tuple[int, int]], list[int]]:
    """Consistent hashing: 64 points per instance on a ring of 64-bit hashes."""
    ring = sorted(
        (int.from_bytes(hashlib.blake2b(f"{n}#{v}".encode(), digest_size=8).digest(), "big"), j)
        for j, n in enumerate(names)
        for v in range(64)
    )
    return ring, [h for h, _ in ring]


def _ring_pick(session: int, names: Sequence[str]) -> int:
    ring, points = _ring(tuple(names))
    h = int.from_bytes(hashlib.blake2b(str(session).encode(), digest_size=8).digest(), "big")
    return ring[bisect.bisect_left(points, h) % len(ring)][1]


def run_prefix(
    policy: str,
    rate: float,
    *,
    duration_s: float = 60.0,
    turns: int = 6,
    systems: int = 8,
    zipf: float = 1.1,
    think_mean_s: float = 1.0,
    lam: float = 5e-4,
    seed: int = 0,
    pool: Sequence[tuple[str, str]] | None = None,
    trace: str | None = None,
    max_output: int = 256,
    expect_arrivals: bool = True,
    overload: str = "least-requests",
    affinity: str = "none",
) -> PrefixRun:
    """Run one policy over agent sessions (module docstring) in virtual time.

    Args:
        policy: One of :data:`PREFIX_POLICIES`.
        rate: Sessions started per second (Poisson) for ``duration_s``.
        duration_s: Span of the session starts.
        turns: Turns per session.
        systems: Shared system prompts (1,000 to 4,000 tokens each).
        zipf: Their popularity exponent.
        think_mean_s: Mean think time after an answer (plus 0.2 s).
        lam: Cost weight of the utility.
        seed: Workload and engine seed (the same sessions for every policy).
        pool: (emulator profile, model) per instance (default: the paper's,
            :data:`bearsdk.sim.PAPER_POOL`).
        trace: A Mooncake trace (JSONL) to replay instead of agent sessions:
            ``rate * duration_s`` of its requests, open-loop at ``rate``
            requests/s (:func:`mooncake_requests`), outputs cut to ``max_output``.
        max_output: Longest output of a trace's request.
        expect_arrivals: BEAR's router folds the prompts still to come into
            its TTFT estimates (``RouterCore(expect_arrivals=True)``).
        overload: Where both BEAR policies send a turn no instance is
            predicted to serve on time (:data:`bearsdk.selectors.bear.OVERLOAD_RULES`).
        affinity: Both BEAR policies' ``BEAR.affinity`` (``"home"``: a turn
            stays where its session's prefix is cached when that is on time;
            blind ``bear`` knows no cached tokens, so it is unchanged).

    Raises:
        ValueError: An unknown policy.
    """
    if policy not in PREFIX_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(PREFIX_POLICIES)} (got {policy!r})")
    if not 1 <= max_output <= 1 << 16:
        raise ValueError(f"max_output must be in [1, 65536] (got {max_output})")
    from bearsdk.predictors import Predictor
    from bearsdk.predictors.protocol import StagedPredictor
    from bearsdk.router import InstanceConfig
    from bearsdk.router.core import RouterCore
    from bearsdk.router.targets import PaperTargets
    from bearsdk.selectors import BEAR
    from bearsdk.sim.scenario import router_params

    if pool is None:
        from bearsdk.sim.config import PAPER_POOL

        pool = [(spec.engine, spec.model) for spec in PAPER_POOL]
    rng = random.Random(seed)
    sys_ids = [_tokens(rng, rng.randint(1000, 4000)) for _ in range(systems)]
    weights = [1.0 / (k + 1) ** zipf for k in range(systems)]
    starts: list[float] = []
    fixed: list[tuple[list[int], int]] = []
    if trace is not None:
        for t, ids, out in mooncake_requests(trace, max(1, round(rate * duration_s)), rate):
            starts.append(t)
            fixed.append((ids, min(out, max_output)))
    else:
        t = rng.expovariate(rate)
        while t < duration_s:
            starts.append(t)
            t += rng.expovariate(rate)

    events: list[EngineEvent] = []
    engines: list[SimEngine] = []
    names = [f"{profile}-{j}" for j, (profile, _) in enumerate(pool)]
    configs = []
    for j, (profile, model) in enumerate(pool):
        em = bind_engine(profile, "vllm-v1", {"enable_prefix_caching": True})
        noise = BatchNoise(em.time_model.params, seed * 1_000_003 + 7919 * (j + 1))
        engines.append(
            SimEngine(names[j], em.policy, em.max_model_len, em.time_model, noise, events.append)
        )
        configs.append(
            InstanceConfig(
                name=names[j],
                url="http://sim.invalid",
                model=model,
                # The engine's own flags (max_num_seqs, KV blocks): the router
                # replays what the engine runs.
                scheduler_params=router_params("vllm-v1", em.policy),
                batch_time=em.calibrated_batch_time(),
            )
        )
    fits = min(e.max_model_len for e in engines) - 1
    clock = [0.0]
    predictor = Predictor.load_default()
    feed = StagedPredictor(predictor.models)
    in_price = np.array([predictor.pool[c].input_price for c in range(len(predictor.models))])
    out_price = np.array([predictor.pool[c].output_price for c in range(len(predictor.models))])
    router = RouterCore(
        configs,
        BEAR(lam=lam, overload=overload, affinity=affinity),
        predictor=feed,
        clock=lambda: clock[0],
        expect_arrivals=expect_arrivals,
    )
    models = [m for _, m in pool]
    cols = [list(predictor.models).index(m) for m in models]
    targets = PaperTargets(seed)

    # Arrivals: (time, order, session). Each session's turn texts are drawn when
    # it starts, from its own generator: every policy sees the same sessions.
    heap: list[tuple[float, int, int]] = [(s, k, k) for k, s in enumerate(starts)]
    heapq.heapify(heap)
    order = len(starts)
    sessions: dict[int, _Session] = {}
    srng: dict[int, random.Random] = {}
    # rid -> (session, arrival, target, instance, output produced, utility, decision)
    live: dict[str, tuple[int, float, float, int, int, float, Any]] = {}
    ttfts: list[float] = []
    otu: list[float] = []
    met = 0
    prompt_sum = cached_sum = 0
    routed = dict.fromkeys(names, 0)
    decide_s = 0.0
    now = 0.0
    bs = engines[0].policy.block_size

    def deliver() -> None:
        nonlocal order, met, prompt_sum, cached_sum
        events.sort(key=lambda e: e.time)
        for e in events:
            k, arrival, target, j, produced, util, d = live[e.rid]
            clock[0] = e.time
            if e.kind == FIRST_TOKEN:
                ttft = e.time - arrival
                ttfts.append(ttft)
                ok = ttft <= target
                met += ok
                otu.append(util if ok else 0.0)
                if d is not None:
                    router.record_first_token(d, names[j], ttft)
            elif e.kind == COMPLETE:
                del live[e.rid]
                if d is not None:
                    router.record_complete(d, names[j], usage={"completion_tokens": produced})
                s = sessions[k]
                if s.fixed is None and s.turn < turns:
                    think = _STEP_S + srng[k].expovariate(1.0 / think_mean_s)
                    heapq.heappush(heap, (e.time + think, order, k))
                    order += 1
        events.clear()

    while heap or live:
        nxt = heap[0][0] if heap else math.inf
        if nxt > now:
            # In steps no longer than the shortest think time (see _STEP_S).
            now = min(nxt, now + _STEP_S)
            for e in engines:
                e.advance(now)
            deliver()
            continue
        a, _, k = heapq.heappop(heap)
        if k not in sessions:
            r = srng[k] = random.Random(seed * 7_919 + k)
            if fixed:
                sessions[k] = _Session([], fixed=fixed[k])
            else:
                head = sys_ids[r.choices(range(systems), weights)[0]]
                sessions[k] = _Session(list(head))
        s, r = sessions[k], srng[k]
        if s.fixed is not None:
            # Cut to what every instance serves (vLLM refuses a longer prompt); the
            # shared prefixes are at the front and survive the cut.
            s.ids, out = list(s.fixed[0][: fits - s.fixed[1]]), s.fixed[1]
        else:
            s.ids.extend(_tokens(r, r.randint(100, 800)))
            out = r.randint(30, 300)
        answer = _tokens(r, out)
        ptok = len(s.ids)
        rid = f"s{k}t{s.turn}"
        text = rid
        clock[0] = a
        target = targets.target_for(ptok)
        pred = predictor.predict(text, quantiles=False)
        # The router knows the prompt's length (as a router that counts tokens
        # does), whether or not it knows the tokens: only the cache is hidden.
        feed.stage(
            attrs.evolve(
                pred,
                prompt_tokens=np.full(len(pred.models), float(ptok)),
                cost_usd=(ptok * in_price + pred.output_tokens * out_price) / 1e6,
            )
        )
        if policy in ("bear-cache", "bear"):
            # Fresh snapshots, as a push source delivers them (not the router's cost).
            for e, nm in zip(engines, names, strict=True):
                router.cache(nm).offer(e.snapshot(), received=a)
        t0 = time.perf_counter()
        j, d = _choose(policy, router, engines, names, s.ids, rid, k, ptok, bs, target)
        decide_s += time.perf_counter() - t0
        m = cols[j]
        acc = float(pred.accuracy[m])
        price = predictor.pool[m]
        # Micro-dollars, as BEAR's utility weighs them (USD per million tokens x tokens).
        cost = ptok * price.input_price + out * price.output_price
        keys = chain_keys(s.ids, bs)
        pool_j = engines[j].core.pool
        assert pool_j is not None
        hit = len(pool_j.lookup(keys, (ptok - 1) // bs)) * bs
        prompt_sum += ptok
        cached_sum += hit
        produced = engines[j].add_request(rid, ptok, out, a, [*s.ids, *answer])
        live[rid] = (k, a, target, j, produced, acc - lam * cost, d)
        routed[names[j]] += 1
        s.ids.extend(answer[:produced])
        s.turn += 1
    n = len(ttfts)
    ttfts.sort()
    return PrefixRun(
        policy=policy,
        rate=rate,
        turns=n,
        on_time_utility=statistics.fmean(otu) if otu else math.nan,
        slo_attainment=met / max(1, n),
        mean_ttft_s=statistics.fmean(ttfts) if ttfts else math.nan,
        p90_ttft_s=ttfts[int(0.9 * (n - 1))] if ttfts else math.nan,
        hit_rate=cached_sum / max(1, prompt_sum),
        composition=routed,
        decide_us=1e6 * decide_s / max(1, n),
    )


def _choose(
    policy: str,
    router: Any,
    engines: Sequence[SimEngine],
    names: Sequence[str],
    ids: list[int],
    rid: str,
    session: int,
    ptok: int,
    bs: int,
    target: float,
) -> tuple[int, Any]:
    """The instance ``policy`` sends the turn to (and the router's decision)."""
    if policy in ("bear-cache", "bear"):
        # The engine's request id: the router matches its dispatches to the
        # snapshots' requests by it.
        d = router.decide(
            [{"role": "user", "content": rid}],
            prompt_token_ids=ids if policy == "bear-cache" else None,
            ttft_target=target,
            request_id=rid,
        )
        router.record_dispatch(d)
        return names.index(d.instance), d
    if policy == "session-affinity":
        return _ring_pick(session, names), None
    keys = chain_keys(ids, bs)
    scores = []
    for e in engines:
        core = e.core
        assert core.pool is not None
        hit = len(core.pool.lookup(keys, (ptok - 1) // bs))
        queue = len(core.waiting) + len(core.running)
        used = 1.0 - core.free / max(1, e.policy.num_blocks)
        if policy == "llm-d-prefix":
            # Higher is better: the share of the prompt cached, an empty queue, free KV.
            scores.append(-(3.0 * hit * bs / ptok + 2.0 / (1.0 + queue) + 2.0 * (1.0 - used)))
        else:
            held = e.policy.num_blocks - core.free
            scores.append((ptok + bs - 1) // bs - hit + held)
    return min(range(len(scores)), key=scores.__getitem__), None
