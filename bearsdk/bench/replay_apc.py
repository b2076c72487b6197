"""Prefix-caching scenarios of ``bearsdk bench replay`` (A1 agent sessions, A2 system prompts).

Each scenario runs a seeded workload of real token ids through the live
scheduler with vLLM's prefix caching on (``vllm-v1`` with
``enable_prefix_caching``; exact against vLLM 0.33, ``docs/prefix-caching.md``),
exports its snapshot with ``kv.prefix_cache`` mid-run, and times one
``ttft()`` of a new request that shares a prefix with it:

A1 agent sessions
    24 multi-turn sessions (each turn: the previous prompt, its output, new
    text); after four turns the fifth turns are arriving; the new request is a
    session's next turn.
A2 shared system prompts
    Three 1,500-token system prompts with Zipf popularity and 96 users; the new
    request is the most popular prompt with a new user message.

Each twin replays the snapshot with its blocks; the same snapshot replayed
without the extension (blocks counted, no hits) gives the ratio the issue asks
for, and shows what ignoring the cache does to the prediction (``ttft_ms``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs

from bearsdk.bench import time_call
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.replay import implementations
from bearsdk.replay.blocks import chain_keys
from bearsdk.replay.scheduler import SchedulerCore
from bearsdk.schedulers import bind_scheduler
from bearsdk.snapshot import Snapshot, snapshot_from_dict

__all__ = ["APC_SCENARIOS", "ApcScenario", "build_apc_scenarios", "run_apc"]

COEFFS = BatchTimeModel(4.0e-3, 2.2e-5, 5.0e-8, 1.2e-10)
BS = 16
PARAMS: dict[str, Any] = {
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 64,
    "block_size": BS,
    "num_gpu_blocks": 3000,
    "enable_prefix_caching": True,
}
APC_SCENARIOS = ("A1", "A2")


@attrs.frozen(eq=False)
class ApcScenario:
    """A prefix-caching snapshot and a new request sharing a prefix with it."""

    name: str
    description: str
    snapshot: Snapshot
    prompt_ids: tuple[int, ...]
    output_len: int


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 150_000) for _ in range(n)]


def _run(core: SchedulerCore, steps: int) -> None:
    """Run the engine loop (async: one batch in flight) for ``steps`` calls."""
    queue = []
    for _ in range(steps):
        queue.append(core.schedule())
        if len(queue) > 1:
            core.process(queue.pop(0))
    for b in queue:
        core.process(b)


def _agent() -> ApcScenario:
    rng = random.Random(5)
    core = SchedulerCore(bind_scheduler("vllm-v1", PARAMS))
    ctx = [_ids(rng, rng.randint(200, 600)) for _ in range(24)]
    n = 0
    for _turn in range(4):
        for s in range(24):
            out = _ids(rng, rng.randint(20, 120))
            core.add_request(f"s{s}.{n}", len(ctx[s]), len(out), len(out), ctx[s] + out)
            n += 1
            ctx[s] = ctx[s] + out + _ids(rng, rng.randint(40, 160))
        while core.has_work():
            _run(core, 50)
    for s in range(24):
        out = _ids(rng, rng.randint(20, 120))
        core.add_request(f"s{s}.{n}", len(ctx[s]), len(out), len(out), ctx[s] + out)
        n += 1
    _run(core, 6)
    prompt = ctx[3] + _ids(rng, 30) + _ids(rng, 80)
    snap = snapshot_from_dict(core.snapshot(output_len=True))
    return ApcScenario(
        "A1",
        "agent sessions: 24 sessions' fifth turns arriving, new request a next turn",
        snap,
        tuple(prompt),
        100,
    )


def _system() -> ApcScenario:
    rng = random.Random(6)
    core = SchedulerCore(bind_scheduler("vllm-v1", PARAMS))
    systems = [_ids(rng, 1500) for _ in range(3)]
    weights = [1.0, 0.5, 0.33]
    for u in range(96):
        sp = rng.choices(range(3), weights)[0]
        user = _ids(rng, rng.randint(100, 400))
        out = _ids(rng, rng.randint(30, 200))
        core.add_request(f"u{u}", 1500 + len(user), len(out), len(out), systems[sp] + user + out)
        if u % 8 == 7:
            _run(core, 3)
    _run(core, 4)
    prompt = systems[0] + _ids(rng, 250)
    snap = snapshot_from_dict(core.snapshot(output_len=True))
    return ApcScenario(
        "A2",
        "shared system prompts: 3 x 1,500 tokens, 96 users, new request the popular one",
        snap,
        tuple(prompt),
        100,
    )


def build_apc_scenarios() -> list[ApcScenario]:
    """A1 and A2 (deterministic)."""
    return [_agent(), _system()]


def _calls(sc: ApcScenario) -> dict[str, tuple[Callable[[], float], int]]:
    """The timed calls: with the blocks and counted, in each twin, replayed from
    the snapshot; and both compiled calls resumed, as the router repeats them on
    a kept view (``docs/decision-cost.md``, section 7)."""
    pol = bind_scheduler("vllm-v1", PARAMS)
    out: dict[str, tuple[Callable[[], float], int]] = {}
    for impl, factory in implementations().items():
        # Replayers of their own (compile_scheduler shares one per policy).
        rp = factory(pol)
        if hasattr(rp, "resume"):
            rp.resume = False
            resumed = factory(pol)
            out[f"{impl}_resumed"] = _call(resumed, sc, blocks=True)
            out[f"{impl}_counted_resumed"] = _call(resumed, sc, blocks=False)
        out[impl] = _call(rp, sc, blocks=True)
        out[f"{impl}_counted"] = _call(rp, sc, blocks=False)
    return out


def _call(rp: Any, sc: ApcScenario, blocks: bool) -> tuple[Callable[[], float], int]:
    """One ``ttft()`` of the new request: the snapshot with its blocks, or counted."""
    snap = sc.snapshot
    assert snap.kv is not None
    assert snap.prefix_cache is not None
    coeffs = COEFFS.replay_coeffs
    n = len(sc.prompt_ids)
    cache = snap.prefix_cache if blocks else None
    # Only with the blocks: the counted call is timed exactly as the router makes it.
    # (A tuple, as the router passes a prompt's chain: converted once, not per call.)
    kw: dict[str, Any] = {"prefix_keys": tuple(chain_keys(sc.prompt_ids, BS))} if blocks else {}
    prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=cache)
    k = rp.replay(prep, n, sc.output_len, coeffs, **kw).first_token_batch

    def call() -> float:
        return float(rp.ttft(prep, n, sc.output_len, coeffs, **kw))

    return call, k


def run_apc(rounds: int) -> dict[str, Any]:
    """Time A1 and A2; medians, p99s and the ratio to the counted replay of each."""
    report: dict[str, Any] = {}
    for sc in build_apc_scenarios():
        pc = sc.snapshot.prefix_cache
        assert pc is not None
        entry: dict[str, Any] = {
            "description": sc.description,
            "requests": len(sc.snapshot),
            "cached_blocks": pc.cached,
            "shared_blocks": sum(len(b) for b in pc.blocks)
            - len({b for bs in pc.blocks for b in bs}),
        }
        for name, (call, k) in _calls(sc).items():
            compiled = name.startswith("cython")
            t = time_call(
                call,
                batch=200 if compiled else 2,
                rounds=rounds if compiled else max(20, rounds // 10),
                warmup=2,
            )
            entry[name] = {**t.as_dict(), "first_token_batch": k, "ttft_ms": round(call() * 1e3, 3)}
        for impl in implementations():
            if impl in entry:
                entry[f"ratio_to_counted_{impl}"] = round(
                    entry[impl]["median_us"] / entry[f"{impl}_counted"]["median_us"], 2
                )
        report[sc.name] = entry
    return report
