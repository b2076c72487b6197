#!/usr/bin/env python3
"""What publishing costs vLLM's engine thread per step, with 256 resident requests.

Runs under the vllm-oracle interpreter, on a CPU:

    "$BEARSDK_VLLM_ORACLE" tests/vllm_plugin/bench_publish.py [--json FILE]

vLLM 0.33's real scheduler (``--scheduler-cls bearsdk.vllm.BearScheduler``,
max_num_seqs 256, 8192-token budget) is filled with 256 requests of 1000
prompt tokens and driven, with fabricated model outputs, until all 256
decode; then ``--steps`` decode steps are timed. A step sleeps ``--gpu-ms``
where the engine would wait for the GPU (vLLM blocks on the model's future
there and releases the GIL, which is when the publisher thread formats and
delivers). What is measured is all the plugin adds to the engine thread in a
step: the time of its ``schedule()`` and ``update_from_output()`` minus the
time of vLLM's own methods inside them (timed around the calls to the base
class), so it includes the plugin's Python frames, its reads of the
scheduler, the capture, the bookkeeping and the timers' own overhead (also
printed). The shared-memory segment is a real one under ``/dev/shm``.

Scenarios (each for async and sync scheduling where it matters):

* ``default``: shadow counters (8 requests re-read per step), the engine
  thread captures, a publisher thread formats and writes the segment;
* ``default+batches``: the same with a ``/bear/batches`` reader connected
  (batch records delivered every step);
* ``inline``: ``BEARSDK_PUBLISH_THREAD=0``: formatting and the segment write
  on the engine thread too;
* ``full-read``: ``BEARSDK_PUBLISH_SHADOW=0``: every request read at every step;
* ``python``: the pure-Python capture (``BEARSDK_PUBLISH_IMPL=python``);
* ``disabled``: ``BEARSDK_PUBLISH=0``: the plugin's classes without a
  publisher, the measurement's floor (its timers and one more Python frame).

With prefix caching on (``apc*``; ``--no-apc`` leaves them out) the pool is warmed
first: ``--warm`` requests of 2000 distinct tokens each (one output token) leave
~125 cached blocks apiece in the free queue (``--warm 240``: 30,000; with the
residents' own, ~39,700 of the 40,000 blocks are cached), then the
256 residents share a 512-token system prompt and decode. ``apc`` is the
``default`` scenario with the ``kv.prefix_cache`` export, ``apc-inline`` the
``inline`` one, ``apc-disabled`` the floor with the cache on. The pool tracker's
wrappers run inside vLLM's own methods, which the net measure subtracts, so
``total_*`` (the whole ``schedule()`` plus ``update_from_output()``) is reported
too: the plugin's whole cost with the cache on is ``apc``'s total minus
``apc-disabled``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import driver
import gen_cases as G

from bearsdk.io.shm import ShmReader
from bearsdk.vllm import RecordingTransport, publisher_of

N_REQ = 256
PROMPT = 1000


def _config(async_scheduling: bool, apc: bool = False) -> dict[str, Any]:
    return dict(
        enable_prefix_caching=apc,
        max_num_batched_tokens=8192,
        max_num_seqs=N_REQ,
        max_model_len=8192,
        block_size=16,
        num_gpu_blocks=40000,
        long_prefill_token_threshold=0,
        watermark=0.0,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )


class _Clock:
    """Accumulates the time spent inside vLLM's own scheduler methods."""

    def __init__(self) -> None:
        self.ns = 0

    def wrap(self, fn: Any) -> Any:
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.ns += time.perf_counter_ns() - t

        return timed


SYSTEM_PROMPT = 512


def _apc_request(rid: str, prompt: list[int], max_tokens: int, hasher: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=hasher,
    )


def _warm(sched: Any, n: int, hasher: Any, depth: int) -> None:
    """Leave ~125 cached blocks per request in the free queue: 2000 distinct tokens each."""
    import random

    rng = random.Random(7)
    for i in range(n):
        prompt = [rng.randrange(10, 30000) for _ in range(2000)]
        sched.add_request(_apc_request(f"w{i}", prompt, 1, hasher))
    queue: list[Any] = []
    while sched.has_requests() or queue:
        if sched.has_requests():
            so = sched.schedule()
            queue.append((so, G.fabricate_output(sched, so)))
        if len(queue) >= depth or not sched.has_requests():
            s0, m0 = queue.pop(0)
            sched.update_from_output(s0, m0)


def run(
    scenario: str,
    async_scheduling: bool,
    steps: int,
    gpu_s: float,
    model_dir: str,
    warm: int = 240,
) -> dict[str, Any]:
    apc = scenario.startswith("apc")
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    env = {
        "BEARSDK_INSTANCE": "bench",
        "BEARSDK_PUBLISH_SHM": f"{shm_dir}/bear.bench-{os.getpid()}",
        "BEARSDK_PUBLISH_THREAD": "0" if scenario in ("inline", "apc-inline") else "1",
        "BEARSDK_PUBLISH_IMPL": "python" if scenario == "python" else "cython",
        "BEARSDK_PUBLISH_SHADOW": "0" if scenario == "full-read" else "1",
        "BEARSDK_PUBLISH": "0" if scenario in ("disabled", "apc-disabled") else "1",
    }
    os.environ.update(env)
    cfg = _config(async_scheduling, apc)
    sched = driver.plugin_scheduler(cfg, model_dir)
    pub = publisher_of(sched)
    assert (pub is None) == scenario.endswith("disabled")
    assert pub is None or (pub.prefix is not None) == apc
    hasher = None
    if apc:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher = get_request_block_hasher(cfg["block_size"], sha256)
    if pub is not None and scenario == "default+batches":
        pub.add_transport(RecordingTransport(batches=True))
    base = type(sched).__mro__[1]  # vLLM's Scheduler or AsyncScheduler
    clock = _Clock()
    names = ("schedule", "update_from_output")  # not nested in each other
    saved = {n: base.__dict__.get(n) for n in names}
    for n in names:
        setattr(base, n, clock.wrap(getattr(base, n)))
    try:
        depth = 2 if async_scheduling else 1
        if apc:
            _warm(sched, warm, hasher, depth)
            system = [11 + (j * 7) % 900 for j in range(SYSTEM_PROMPT)]
            for i in range(N_REQ):
                own = [(10 + i * 7919 + j) % 29000 + 10 for j in range(PROMPT - SYSTEM_PROMPT)]
                sched.add_request(_apc_request(f"r{i}", system + own, 6000, hasher))
        else:
            for i in range(N_REQ):
                sched.add_request(G.make_request(f"r{i}", PROMPT, 6000, i))
        queue: list[Any] = []
        per_step: list[float] = []
        pool = sched.kv_cache_manager.block_pool
        warm = 0
        pc = time.perf_counter_ns
        hooks = getattr(pub, "hooks", None)
        prefix = getattr(pub, "prefix", None)
        in_hooks: list[float] = []
        in_prefix: list[float] = []
        totals: list[float] = []
        while len(per_step) < steps:
            inner = clock.ns
            h0 = hooks.engine_ns if hooks is not None else 0
            p0 = prefix.engine_ns if prefix is not None else 0
            t = pc()
            so = sched.schedule()
            total = pc() - t
            queue.append((so, G.fabricate_output(sched, so)))
            if len(queue) >= depth:
                time.sleep(gpu_s)  # the GPU runs the batch; vLLM waits with the GIL released
                s0, m0 = queue.pop(0)
                t = pc()
                sched.update_from_output(s0, m0)
                total += pc() - t
            decoding = len(sched.running) == N_REQ and all(
                so.num_scheduled_tokens.get(r.request_id) == 1 for r in sched.running
            )
            if decoding:
                warm += 1
            if warm > 5:
                per_step.append((total - (clock.ns - inner)) / 1e3)
                totals.append(total / 1e3)
                if hooks is not None:
                    in_hooks.append((hooks.engine_ns - h0) / 1e3)
                if prefix is not None:
                    in_prefix.append((prefix.engine_ns - p0) / 1e3)
        stats = pub.stats() if pub is not None else None
        cached_blocks = sum(
            len(v) if isinstance(v, dict) else 1
            for v in pool.cached_block_hash_to_block._cache.values()
        )
        free_blocks = pool.get_num_free_blocks()
        doc_bytes = 0
        if pub is not None:
            with ShmReader(env["BEARSDK_PUBLISH_SHM"]) as reader:
                res = reader.read()
                doc_bytes = len(res.payload) if res.payload is not None else 0
    finally:
        for n, fn in saved.items():
            if fn is None:
                delattr(base, n)
            else:
                setattr(base, n, fn)
        sched.shutdown()
    per_step.sort()
    in_hooks.sort()
    in_prefix.sort()
    totals.sort()
    return {
        "scenario": scenario,
        "scheduling": "async" if async_scheduling else "sync",
        "steps": len(per_step),
        "median_us": round(statistics.median(per_step), 2),
        "p90_us": round(per_step[int(0.9 * len(per_step))], 2),
        "p99_us": round(per_step[int(0.99 * len(per_step))], 2),
        "hooks_median_us": round(statistics.median(in_hooks), 2) if in_hooks else None,
        "hooks_p99_us": round(in_hooks[int(0.99 * len(in_hooks))], 2) if in_hooks else None,
        "prefix_median_us": round(statistics.median(in_prefix), 2) if in_prefix else None,
        "prefix_p99_us": round(in_prefix[int(0.99 * len(in_prefix))], 2) if in_prefix else None,
        "total_median_us": round(statistics.median(totals), 2),
        "total_p99_us": round(totals[int(0.99 * len(totals))], 2),
        "cached_blocks": cached_blocks,
        "free_blocks": free_blocks,
        "captures": stats.captures if stats else 0,
        "published": stats.published if stats else 0,
        "failures": stats.failures if stats else 0,
        "shadow": stats.shadow if stats else None,
        "mismatches": stats.mismatches if stats else 0,
        "document_bytes": doc_bytes,
    }


def timer_overhead_us() -> float:
    clock = _Clock()
    f = clock.wrap(lambda: None)
    n = 100_000
    for _ in range(n):
        f()
    return clock.ns / n / 1e3


def _median_or_none(xs: list[Any]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 1) if vals else None


SCENARIOS = (
    ("disabled", True),
    ("default", True),
    ("default", False),
    ("default+batches", True),
    ("inline", True),
    ("inline", False),
    ("full-read", True),
    ("python", True),
    ("apc-disabled", True),
    ("apc", True),
    ("apc", False),
    ("apc-inline", True),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=1000, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every scenario, interleaved")
    ap.add_argument("--gpu-ms", type=float, default=2.0)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--warm", type=int, default=240, help="warm-up requests (apc scenarios)")
    ap.add_argument("--no-apc", action="store_true", help="leave the apc scenarios out")
    ap.add_argument("--only", help="comma-separated scenarios to run (default: all)")
    a = ap.parse_args()
    G._import_vllm()
    model_dir = G.tiny_model_dir()
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(a.rounds):
        for scenario, mode in SCENARIOS:
            if a.no_apc and scenario.startswith("apc"):
                continue
            if a.only and scenario not in a.only.split(",") and scenario != "disabled":
                continue
            r = run(scenario, mode, a.steps, a.gpu_ms / 1e3, model_dir, a.warm)
            runs.setdefault((r["scenario"], r["scheduling"]), []).append(r)
            print(json.dumps(r), flush=True)
    # A shared machine's noise moves whole runs: report the median run, and
    # the cost over the plugin without a publisher measured in the same rounds.
    floor = statistics.median(r["median_us"] for r in runs[("disabled", "async")])
    summary = []
    for (scenario, sched), rs in runs.items():
        med = statistics.median(r["median_us"] for r in rs)
        summary.append(
            {
                "scenario": scenario,
                "scheduling": sched,
                "median_us": round(med, 1),
                "p99_us": round(statistics.median(r["p99_us"] for r in rs), 1),
                "net_median_us": round(med - floor, 1),
                "hooks_median_us": _median_or_none([r["hooks_median_us"] for r in rs]),
                "hooks_p99_us": _median_or_none([r["hooks_p99_us"] for r in rs]),
                "prefix_median_us": _median_or_none([r["prefix_median_us"] for r in rs]),
                "prefix_p99_us": _median_or_none([r["prefix_p99_us"] for r in rs]),
                "total_median_us": round(statistics.median(r["total_median_us"] for r in rs), 1),
                "total_p99_us": round(statistics.median(r["total_p99_us"] for r in rs), 1),
                "cached_blocks": rs[-1]["cached_blocks"],
                "document_bytes": rs[-1]["document_bytes"],
                "mismatches": sum(r["mismatches"] for r in rs),
                "failures": sum(r["failures"] for r in rs),
            }
        )
    print("\nmedian over rounds (net = minus the 'disabled' floor: timers and the plugin's frames)")
    for row in summary:
        print(json.dumps(row))
    overhead = round(2 * timer_overhead_us(), 3)
    print(f"timer overhead included per step (2 timed base calls): {overhead} us", flush=True)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "summary": summary,
                    "runs": [r for rs in runs.values() for r in rs],
                    "timer_us": overhead,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
