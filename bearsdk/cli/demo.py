"""``bearsdk demo``: the main job on embedded defaults.

Three model instances (the shipped Qwen3 0.6B / 8B / 32B batch-time profiles)
carry different loads; for prompts of several lengths the demo predicts, with
BEA, the time to first token at each instance under each built-in scheduler, and
shows the simulated batches behind one estimate. Everything runs locally in a
second.
"""

from __future__ import annotations

import argparse
import random
import time

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.estimators.profiles import load_profile
from bearsdk.replay import IMPLEMENTATION
from bearsdk.schedulers import policy
from bearsdk.snapshot import KVState, RequestState, Snapshot

__all__ = ["register"]

# (batch-time profile, load: share of a busy instance's requests resident)
INSTANCES: dict[str, tuple[BatchTimeModel, float]] = {
    "qwen3-0.6b": (load_profile("qwen3-0.6b-h100"), 0.2),
    "qwen3-8b": (load_profile("qwen3-8b-h100"), 0.6),
    "qwen3-32b": (load_profile("qwen3-32b-2xh100"), 0.9),
}
SCHEDULERS = {
    "vllm-v1": {"max_num_batched_tokens": 8192, "max_num_seqs": 256},
    "sarathi": {"chunk_size": 2048, "max_num_seqs": 256},
    "prefill-first": {"max_num_batched_tokens": 16384, "max_num_seqs": 256, "max_model_len": 16384},
}


def _snapshot(name: str, load: float, seed: int) -> Snapshot:
    rng = random.Random(seed)
    reqs: list[RequestState] = []
    for i in range(int(120 * load)):
        p = rng.randint(200, 3000)
        o = rng.randint(1, 300)
        total = o + rng.randint(1, 500)
        reqs.append(RequestState(f"d{i}", "running", p, p + o - 1, o, 1024, total))
    for i in range(int(12 * load)):
        prompt = rng.randint(300, 4000)
        reqs.append(RequestState(f"w{i}", "waiting", prompt, 0, 0, 512, rng.randint(20, 400)))
    held = sum(-(-r.computed_tokens // 16) for r in reqs)
    return Snapshot.build(reqs, instance=name, kv=KVState(16, 120_000, 120_000 - held - 1))


def _run(args: argparse.Namespace) -> int:
    print(f"bearsdk demo: BEA time-to-first-token estimates (replay: {IMPLEMENTATION})\n")
    snaps = {n: _snapshot(n, load, i) for i, (n, (_, load)) in enumerate(INSTANCES.items())}
    for name, s in snaps.items():
        print(f"  {name:11} {s.num_running:4} running, {s.num_waiting:3} waiting")
    prompts = (256, 1024, 4096)
    for sched, params in SCHEDULERS.items():
        print(f"\nscheduler {sched} {params}")
        print(f"  {'instance':11}" + "".join(f"{f'prompt {p}':>16}" for p in prompts))
        for name, (bt, _) in INSTANCES.items():
            est = BEAEstimator(policy(sched, params), bt)
            prep = est.prepare(snaps[name])
            cells = []
            for p in prompts:
                r = est.estimate(prep, p, 200)
                cells.append(f"{r.ttft_s * 1000:9.1f} ms (b{r.first_token_batch})")
            print(f"  {name:11}" + "".join(f"{c:>16}" for c in cells))
    name = "qwen3-8b"
    est = BEAEstimator(policy("vllm-v1", SCHEDULERS["vllm-v1"]), INSTANCES[name][0])
    prep = est.prepare(snaps[name])
    r = est.estimate(prep, 4096, 200, explain=True)
    print(f"\nwhy: the batches before a 4096-token prompt's first token at {name} (vllm-v1)")
    print(f"  {'batch':>5} {'seqs':>5} {'prefill':>8} {'decode':>7} {'ms':>8}")
    for i, b in enumerate(r.batches or (), 1):
        ms = b.duration_s * 1e3
        print(f"  {i:>5} {b.num_seqs:>5} {b.prefill_tokens:>8} {b.decode_tokens:>7} {ms:>8.2f}")
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        est.ttft(prep, 4096, 200)
    dt = (time.perf_counter() - t0) / n * 1e6
    print(
        f"\none estimate at {name}: {dt:.1f} us ({len(snaps[name])} resident requests, "
        f"{r.first_token_batch} batches replayed)"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="the main job: BEA estimates on embedded defaults")
    p.set_defaults(func=_run)
