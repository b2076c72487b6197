"""``bearsdk bench replay``: per-estimate latency of the BEA replay, called from Python.

Four fixed scenarios (seeded, identical on every run):

S1 light
    8 decoding requests, nothing waiting; new prompt of 512 tokens.
S2 medium
    64 running (contexts 500-3000, 4 of them mid-prefill), 8 waiting of ~1500
    tokens; token budget 8192.
S3 heavy
    256 running, 64 waiting prompts of 2000-8000 tokens; budget 8192,
    ``max_num_seqs`` 1024.
S4 KV-bound
    Memory nearly full: the new request waits for completions through hundreds
    of decode-only batches before its prompt fits.

Each timing is one ``Replayer.ttft`` call on a prepared snapshot (the router's
hot path: snapshots are prepared once when they arrive), replayed from the
snapshot (``Replayer.resume`` off: the loop's own cost). The compiled loop's
``resumed`` column is the same call with resuming on, as the router runs it:
the call is repeated on one prepared snapshot, so every call after the second
starts from the state kept before the new request was first examined
(``docs/decision-cost.md``). All scenarios use the ``vllm-v1`` policy with
asynchronous scheduling, its default. The prefix-caching scenarios A1 and A2
are in :mod:`bearsdk.bench.replay_apc`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from bearsdk.bench import time_call
from bearsdk.cli import positive_int
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.replay import implementations
from bearsdk.schedulers import bind_scheduler
from bearsdk.snapshot import KVState, RequestState, Snapshot

__all__ = ["SCENARIOS", "Scenario", "build_scenarios", "register"]

# Qwen3-8B-on-H100-like coefficients; only their scale matters here.
COEFFS = BatchTimeModel(4.0e-3, 2.2e-5, 5.0e-8, 1.2e-10)

TARGETS_US = {"S1": 0.5, "S2": 2.0, "S3": 10.0, "S4": 10.0}


@attrs.frozen(eq=False)
class Scenario:
    """A benchmark scenario: a snapshot, a policy and a new request."""

    name: str
    description: str
    snapshot: Snapshot
    params: dict[str, Any]
    prompt_tokens: int
    output_len: int


def _decoder(
    rng: random.Random, rid: str, ctx_lo: int, ctx_hi: int, rem_lo: int, rem_hi: int
) -> RequestState:
    prompt = rng.randint(ctx_lo, ctx_hi)
    out = rng.randint(1, 200)
    total = out + rng.randint(rem_lo, rem_hi)
    # Async scheduling: one token of each decode is in flight.
    return RequestState(
        id=rid,
        state="running",
        prompt_tokens=prompt,
        computed_tokens=prompt + out,
        output_tokens=out,
        max_tokens=total,
        output_len=total,
        placeholders=1,
    )


def _waiting(rid: str, prompt: int, out: int) -> RequestState:
    return RequestState(
        id=rid,
        state="waiting",
        prompt_tokens=prompt,
        computed_tokens=0,
        output_tokens=0,
        max_tokens=out,
        output_len=out,
    )


def build_scenarios() -> list[Scenario]:
    """Return S1-S4 (deterministic)."""
    out = []
    rng = random.Random(1)
    reqs = [_decoder(rng, f"d{i}", 200, 1500, 50, 400) for i in range(8)]
    out.append(
        Scenario(
            "S1",
            "light: 8 decoding, nothing waiting, new prompt 512",
            Snapshot.build(reqs, kv=KVState(16, 50_000, 50_000 - 8 * 120)),
            {"max_num_batched_tokens": 8192, "max_num_seqs": 256},
            512,
            200,
        )
    )

    rng = random.Random(2)
    reqs = [_decoder(rng, f"d{i}", 500, 3000, 20, 600) for i in range(60)]
    for i in range(4):
        p = rng.randint(1000, 4000)
        reqs.append(
            RequestState(
                id=f"p{i}",
                state="running",
                prompt_tokens=p,
                computed_tokens=rng.randint(1, p // 2) * 2 // 2,
                output_tokens=0,
                max_tokens=300,
                output_len=rng.randint(50, 300),
            )
        )
    reqs += [_waiting(f"w{i}", rng.randint(1200, 1800), rng.randint(50, 400)) for i in range(8)]
    held = sum(-(-r.computed_tokens // 16) for r in reqs)
    out.append(
        Scenario(
            "S2",
            "medium: 64 running (4 mid-prefill), 8 waiting ~1500, budget 8192",
            Snapshot.build(reqs, kv=KVState(16, 60_000, 60_000 - 1 - held)),
            {"max_num_batched_tokens": 8192, "max_num_seqs": 256},
            1000,
            200,
        )
    )

    rng = random.Random(3)
    reqs = [_decoder(rng, f"d{i}", 300, 4000, 50, 2000) for i in range(256)]
    reqs += [_waiting(f"w{i}", rng.randint(2000, 8000), rng.randint(50, 500)) for i in range(64)]
    held = sum(-(-r.computed_tokens // 16) for r in reqs)
    out.append(
        Scenario(
            "S3",
            "heavy: 256 running, 64 waiting of 2000-8000, budget 8192, max_num_seqs 1024",
            Snapshot.build(reqs, kv=KVState(16, 200_000, 200_000 - 1 - held)),
            {"max_num_batched_tokens": 8192, "max_num_seqs": 1024},
            2000,
            200,
        )
    )

    rng = random.Random(21)
    reqs = [_decoder(rng, f"d{i}", 800, 1600, 1, 1600) for i in range(96)]
    held = sum(-(-r.computed_tokens // 16) for r in reqs)
    # 200 free blocks: the decodes keep growing into them while an 8000-token
    # prompt (500 blocks) waits for enough of them to finish; no preemption.
    free = 200
    out.append(
        Scenario(
            "S4",
            "KV-bound: 96 decoding, 200 blocks free; an 8000-token prompt waits for completions",
            Snapshot.build(reqs, kv=KVState(16, held + free + 1, free)),
            {"max_num_batched_tokens": 8192, "max_num_seqs": 256},
            8000,
            200,
        )
    )
    return out


SCENARIOS = ("S1", "S2", "S3", "S4")


# A policy registered at run time (not a built-in): vllm-v1's blocks, but
# preempted requests rejoin the back of the queue and admission skips past a
# request that does not fit. It must run on the same compiled loop, as fast.
CUSTOM_SPEC: dict[str, Any] = {
    "name": "bench-custom",
    "description": "runtime-registered variant of vllm-v1",
    "params": {
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "block_size": 16,
        "num_gpu_blocks": 0,
    },
    "budget": {"tokens": "$max_num_batched_tokens", "seqs": "$max_num_seqs"},
    "batch": {"stages": ["running", "waiting"], "async_scheduling": True},
    "prefill": {"chunked": True},
    "admission": {"on_blocked": "skip", "reserve_full_sequence": True},
    "kv": {"block_size": "$block_size", "num_blocks": "$num_gpu_blocks", "reserved_blocks": 1},
    "preemption": {"victim": "newest", "requeue": "back"},
}


def _prepared(
    sc: Scenario, impl: str, scheduler: str = "vllm-v1", resume: bool = False
) -> tuple[Callable[[], float], int, int]:
    pol = bind_scheduler(scheduler, sc.params)
    kv = sc.snapshot.kv
    assert kv is not None
    pol = pol.with_kv(kv.block_size, kv.num_blocks)
    # A replayer of its own (compile_scheduler shares one per policy).
    rp = implementations()[impl](pol)
    if hasattr(rp, "resume"):  # (the compiled loop's)
        rp.resume = resume
    prep = rp.prepare(sc.snapshot.table, kv.free_blocks, sc.snapshot.ids)
    coeffs = COEFFS.replay_coeffs
    res = rp.replay(prep, sc.prompt_tokens, sc.output_len, coeffs, record=True)
    preempted = sum(b.preempted for b in res.batches or ())

    def call() -> float:
        return rp.ttft(prep, sc.prompt_tokens, sc.output_len, coeffs)

    return call, res.first_token_batch, preempted


def run(impls: Sequence[str], rounds: int) -> dict[str, Any]:
    """Measure every scenario under each implementation; return the report."""
    from bearsdk.schedulers import register_scheduler, scheduler_names

    if CUSTOM_SPEC["name"] not in scheduler_names():
        register_scheduler(CUSTOM_SPEC)
    report: dict[str, Any] = {"targets_median_us": TARGETS_US, "scenarios": {}}
    for sc in build_scenarios():
        entry: dict[str, Any] = {"description": sc.description, "requests": len(sc.snapshot)}
        for impl in impls:
            call, k, preempted = _prepared(sc, impl)
            entry["first_token_batch"] = k
            entry["preemptions"] = preempted
            entry["ttft_ms"] = round(call() * 1000, 3)
            batch = 200 if impl == "cython" else 2
            t = time_call(
                call,
                batch=batch,
                rounds=rounds if impl == "cython" else max(20, rounds // 10),
                warmup=2,
            )
            entry[impl] = t.as_dict()
            if impl == "cython":
                call, _, _ = _prepared(sc, impl, resume=True)
                entry["cython_resumed"] = time_call(
                    call, batch=200, rounds=rounds, warmup=2
                ).as_dict()
            if impl == "cython" and sc.name in ("S2", "S3"):
                call, _, _ = _prepared(sc, impl, CUSTOM_SPEC["name"])
                entry["cython_custom_spec"] = time_call(
                    call, batch=200, rounds=rounds, warmup=2
                ).as_dict()
        if "cython" in entry and "python" in entry:
            entry["speedup"] = round(entry["python"]["median_us"] / entry["cython"]["median_us"], 1)
        if "cython" in entry:
            entry["meets_target"] = entry["cython"]["median_us"] <= TARGETS_US[sc.name]
        report["scenarios"][sc.name] = entry
    from bearsdk.bench.replay_apc import run_apc

    report["prefix_caching"] = run_apc(rounds)
    return report


def _main(args: argparse.Namespace) -> int:
    avail = implementations()
    impls = [i for i in ("cython", "python") if i in avail and (args.impl in (None, i))]
    report = run(impls, args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        "BEA replay: one Replayer.ttft call on a prepared snapshot (vllm-v1, async); microseconds"
    )
    hdr = f"{'':4} {'reqs':>5} {'batch':>6} {'ttft ms':>9}"
    for impl in impls:
        hdr += f" {impl + ' p50':>12} {impl + ' p99':>12}"
    resumed = "cython" in impls
    print(hdr + f" {'target':>7}" + (f" {'resumed p50':>12}" if resumed else ""))
    for name, e in report["scenarios"].items():
        line = f"{name:4} {e['requests']:>5} {e['first_token_batch']:>6} {e['ttft_ms']:>9.2f}"
        for impl in impls:
            line += f" {e[impl]['median_us']:>12.3f} {e[impl]['p99_us']:>12.3f}"
        line += f" {TARGETS_US[name]:>7}"
        if resumed:
            line += f" {e['cython_resumed']['median_us']:>12.3f}"
        print(line)
    print(
        "Prefix caching (vllm-v1, enable_prefix_caching): each twin with the blocks of "
        "kv.prefix_cache, and counted (the cache ignored); microseconds, TTFT, first-token batch"
    )
    for name, e in report["prefix_caching"].items():
        print(f"{name}  {e['description']}")
        for label in (
            "cython",
            "cython_counted",
            "cython_resumed",
            "cython_counted_resumed",
            "python",
            "python_counted",
        ):
            if label in e:
                x = e[label]
                print(
                    f"    {label:22s} p50 {x['median_us']:>10.3f} p99 {x['p99_us']:>10.3f}"
                    f"  ttft {x['ttft_ms']:>9.2f} ms  batch {x['first_token_batch']}"
                )
        for impl in ("cython", "python"):
            if f"ratio_to_counted_{impl}" in e:
                print(f"    with blocks / counted ({impl}): {e[f'ratio_to_counted_{impl}']}x")
    for name, e in report["scenarios"].items():
        if "cython_custom_spec" in e:
            c = e["cython_custom_spec"]
            print(
                f"{name} under the runtime-registered spec {CUSTOM_SPEC['name']!r}: "
                f"p50 {c['median_us']:.3f} us, p99 {c['p99_us']:.3f} us (compiled)"
            )
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("replay", help="per-estimate latency of the BEA replay (S1-S4)")
    p.add_argument("--impl", choices=("cython", "python"), help="only this implementation")
    p.add_argument("--rounds", type=positive_int, default=200, help="timing rounds per scenario")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
