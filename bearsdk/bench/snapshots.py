"""``bearsdk bench snapshots``: the cost of taking in one snapshot, and the shm stress test.

Per snapshot of 64 resident requests (56 decoding with a placeholder each, 4
mid-prefill, 4 waiting; about 9 KB of JSON), each decoder (compiled scanner and
pure-Python reference) is timed for:

* ``decode``: bytes to a validated :class:`~bearsdk.Snapshot`;
* ``update``: :meth:`SnapshotCache.offer_bytes` without an estimator (decode,
  ordering checks, the swap);
* ``update+prepare``: the same with the instance's BEA estimator attached, so
  the replay state is built once, at acceptance;
* ``+lengths``: the same with the router's length predictor
  (:class:`~bearsdk.estimators.RememberedLengths`) remembering every resident,
  so each one's own predicted length is looked up (what a router runs).

Then prefix caching: the snapshots of a live prefix-caching engine (``vllm-v1``
with ``enable_prefix_caching``, real shared token ids) behind 96 and 320 users of
three long system prompts, whose ``kv.prefix_cache`` names every cached block and
each request's blocks and chain, decoded with the extension validated by the
compiled validator and by the reference alone.

Then the shared-memory seqlock: one write and one read of that payload per
implementation. ``--stress SECONDS`` adds the stress test: a writer process
publishes snapshots at ``--rate`` per second (each byte of a payload is a
function of its ``seq``), readers of both implementations read as fast as they
can, and every payload a reader accepts is compared byte for byte with the one
written under its ``seq``. An unchecked reader (no seqlock) runs alongside as a
control, showing that torn copies do happen on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from typing import Any

import orjson

from bearsdk.bench import time_call
from bearsdk.cli import nonnegative_float, positive_float, positive_int
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.estimators.length import RememberedLengths
from bearsdk.io import shm
from bearsdk.snapshot import decoders
from bearsdk.state.cache import SnapshotCache

__all__ = ["apc_payload", "register", "run", "snapshot_doc", "stress", "stress_payload"]

TARGET_US = 50.0
COEFFS = BatchTimeModel(4.0e-3, 2.2e-5, 5.0e-8, 1.2e-10)
PARAMS = {"max_num_batched_tokens": 8192, "max_num_seqs": 256}


def snapshot_doc(seq: int, n: int = 64, seed: int = 7) -> dict[str, Any]:
    """A realistic ``bear.snapshot/1`` with ``n`` resident requests (deterministic)."""
    rng = random.Random(seed)
    reqs: list[dict[str, Any]] = []
    n_wait = n // 16
    n_pre = n // 16
    for i in range(n - n_wait - n_pre):
        prompt = rng.randint(200, 3000)
        out = rng.randint(1, 400)
        reqs.append(
            {
                "id": f"cmpl-{rng.getrandbits(48):012x}-{i}",
                "state": "running",
                "prompt_tokens": prompt,
                "computed_tokens": prompt + out,
                "output_tokens": out,
                "max_tokens": out + rng.randint(10, 2000),
                "placeholders": 1,
            }
        )
    for i in range(n_pre):
        prompt = rng.randint(1000, 4000)
        reqs.append(
            {
                "id": f"cmpl-{rng.getrandbits(48):012x}-p{i}",
                "state": "running",
                "prompt_tokens": prompt,
                "computed_tokens": rng.randint(1, prompt - 1),
                "output_tokens": 0,
                "max_tokens": 1024,
            }
        )
    for i in range(n_wait):
        reqs.append(
            {
                "id": f"cmpl-{rng.getrandbits(48):012x}-w{i}",
                "state": "waiting",
                "prompt_tokens": rng.randint(100, 2000),
                "computed_tokens": 0,
                "output_tokens": 0,
                "max_tokens": 512,
            }
        )
    held = sum(-(-r["computed_tokens"] // 16) for r in reqs)
    return {
        "schema": "bear.snapshot/1",
        "instance": "qwen3-8b-0",
        "seq": seq,
        "time": 1764480000.0 + seq * 0.02,
        "epoch": "5f2c9a0e11d84b7c",
        "kv": {"block_size": 16, "num_blocks": 60000, "free_blocks": 60000 - held},
        "requests": reqs,
        "inflight": {"remaining_s": 0.0123},
    }


def _update_timer(payloads: list[bytes], est: BEAEstimator | None) -> Any:
    cache = SnapshotCache("bench", estimator=est, clock=lambda: 1764480000.0)
    state = {"i": 0}

    def call() -> None:
        i = state["i"]
        if i == len(payloads):
            i = 0
            cache.clear()  # seq starts over: a fresh cache, not an out-of-order reject
        cache.offer_bytes(payloads[i])
        state["i"] = i + 1

    return call, cache


def run(rounds: int, requests: int = 64) -> dict[str, Any]:
    """Time decode, update and update+prepare per decoder; shm write/read per implementation."""
    base = snapshot_doc(1, requests)
    payloads = [orjson.dumps({**base, "seq": s}) for s in range(1, 513)]
    est = BEAEstimator.for_scheduler("vllm-v1", COEFFS, PARAMS)
    remembered = RememberedLengths()
    for r in base["requests"]:
        remembered.remember(r["id"], 300)
    est_router = BEAEstimator.for_scheduler("vllm-v1", COEFFS, PARAMS, length_predictor=remembered)
    report: dict[str, Any] = {
        "requests": requests,
        "payload_bytes": len(payloads[0]),
        "target_us": TARGET_US,
        "decoders": {},
        "shm": {},
    }
    import bearsdk.snapshot as snapmod

    for name, dec in decoders().items():
        python = name == "python"
        batch, rnds = (5, max(20, rounds // 10)) if python else (50, rounds)
        entry: dict[str, Any] = {}
        entry["decode"] = time_call(partial(dec, payloads[0]), batch=batch, rounds=rnds)
        # offer_bytes calls decode_snapshot: select this decoder for the measurement
        saved = snapmod._scan
        if python:
            snapmod._scan = None
        try:
            call, cache = _update_timer(payloads, None)
            entry["update"] = time_call(call, batch=batch, rounds=rnds, warmup=2)
            call, cache = _update_timer(payloads, est)
            entry["update+prepare"] = time_call(call, batch=batch, rounds=rnds, warmup=2)
            assert cache.stats().rejected_total == 0
            call, cache = _update_timer(payloads, est_router)
            entry["+lengths"] = time_call(call, batch=batch, rounds=rnds, warmup=2)
        finally:
            snapmod._scan = saved
        report["decoders"][name] = {k: t.as_dict() for k, t in entry.items()}
    report["prefix_cache"] = _apc(rounds)
    with tempfile.TemporaryDirectory() as tmp:
        path = shm.segment_path("bench", tmp)
        for name in shm.implementations():
            with shm.ShmWriter(path, 1 << 20, implementation=name) as w:
                w.write(payloads[0])
                with shm.ShmReader(path, implementation=name) as r:

                    def read(r: shm.ShmReader = r) -> None:
                        res = r.read()
                        assert res.payload is not None
                        res.payload.release()

                    report["shm"][name] = {
                        "write": time_call(
                            partial(w.write, payloads[0]), batch=100, rounds=rounds
                        ).as_dict(),
                        "read": time_call(read, batch=100, rounds=rounds).as_dict(),
                    }
    return report


def apc_payload(users: int, seed: int = 6) -> bytes:
    """A prefix-caching engine's snapshot: ``users`` users of three 1,500-token prompts."""
    from bearsdk.replay.scheduler import SchedulerCore
    from bearsdk.schedulers import bind_scheduler

    rng = random.Random(seed)
    core = SchedulerCore(
        bind_scheduler(
            "vllm-v1",
            {
                "max_num_batched_tokens": 2048,
                "max_num_seqs": min(users, 256),
                "block_size": 16,
                "num_gpu_blocks": 40 * users,
                "enable_prefix_caching": True,
            },
        )
    )
    systems = [[rng.randrange(1000, 150_000) for _ in range(1500)] for _ in range(3)]
    queue: list[Any] = []
    for u in range(users):
        sp = rng.choices(range(3), [1.0, 0.5, 0.33])[0]
        user = [rng.randrange(1000, 150_000) for _ in range(rng.randint(100, 400))]
        out = [rng.randrange(1000, 150_000) for _ in range(rng.randint(30, 200))]
        core.add_request(f"u{u}", 1500 + len(user), len(out), len(out), systems[sp] + user + out)
        if u % 8 == 7:
            for _ in range(3):
                queue.append(core.schedule())
                if len(queue) > 1:
                    core.process(queue.pop(0))
    return orjson.dumps({**core.snapshot(output_len=True), "instance": "bench"})


def _apc(rounds: int) -> dict[str, Any]:
    """Decode prefix-caching snapshots: compiled validator, and the reference alone."""
    import bearsdk.snapshot as snapmod

    out: dict[str, Any] = {}
    for users in (96, 320):
        payload = apc_payload(users)
        doc = orjson.loads(payload)
        pc = doc["kv"]["prefix_cache"]
        entry: dict[str, Any] = {
            "requests": len(doc["requests"]),
            "keys": len(pc["keys"]),
            "payload_bytes": len(payload),
        }
        saved = snapmod._validate_pc
        try:
            for name in ("compiled", "reference"):
                if name == "reference":
                    snapmod._validate_pc = None
                elif saved is None:
                    continue
                t = time_call(
                    partial(snapmod.decode_snapshot, payload), batch=2, rounds=max(20, rounds // 5)
                )
                entry[name] = t.as_dict()
        finally:
            snapmod._validate_pc = saved
        out[str(users)] = entry
    return out


# ---------------------------------------------------------------------------
# Stress test: one writer process, readers that must never accept a torn copy.
# ---------------------------------------------------------------------------

_SEQ = re.compile(rb'"seq":(\d+)')


def stress_payload(k: int) -> bytes:
    """The payload written under ``seq`` ``k``: every byte a function of ``k``.

    Sizes vary (1-12 KB) so that consecutive payloads differ in length too.
    """
    n = 8 + (k * 7919) % 72
    reqs = [
        {
            "id": f"r{k}-{i}",
            "state": "waiting",
            "prompt_tokens": 1 + (k * 31 + i * 17) % 4000,
            "computed_tokens": 0,
            "output_tokens": 0,
        }
        for i in range(n)
    ]
    return orjson.dumps(
        {"schema": "bear.snapshot/1", "instance": "stress", "seq": k, "time": 0.0, "requests": reqs}
    )


def _writer_main(argv: list[str]) -> None:
    path, rate, seconds, impl = argv[0], float(argv[1]), float(argv[2]), argv[3]
    with shm.ShmWriter(path, 1 << 16, implementation=impl) as w:
        period = 1.0 / rate
        t0 = time.perf_counter()
        k = 0
        while True:
            now = time.perf_counter()
            if now - t0 >= seconds:
                break
            k += 1
            w.write(stress_payload(k))
            target = t0 + k * period
            while time.perf_counter() < target:  # pace by spinning: sleep is too coarse
                pass
        elapsed = time.perf_counter() - t0
    print(json.dumps({"writes": k, "seconds": round(elapsed, 3), "rate": round(k / elapsed)}))


def stress(
    seconds: float = 2.0, rate: float = 10_000.0, writer_impl: str | None = None
) -> dict[str, Any]:
    """Run the shared-memory stress test; return what the writer and each reader saw.

    Every payload a checked reader accepts must equal :func:`stress_payload` of its
    ``seq`` (``bad`` counts those that do not: it must be 0). The unchecked
    control reader's ``bad`` shows how often a copy without the seqlock is torn.
    """
    impls = shm.implementations()
    writer_impl = writer_impl or shm.IMPLEMENTATION
    with tempfile.TemporaryDirectory() as tmp:
        path = shm.segment_path("stress", tmp)
        shm.ShmWriter(path, 1 << 16, implementation=writer_impl).close()
        readers: dict[str, dict[str, int]] = {}
        stop = threading.Event()

        def check(data: bytes | memoryview) -> bool:
            m = _SEQ.search(bytes(data[:64]))
            return m is not None and bytes(data) == stress_payload(int(m.group(1)))

        def checked(name: str) -> None:
            c = {"reads": 0, "accepted": 0, "torn": 0, "busy": 0, "bad": 0}
            with shm.ShmReader(path, implementation=name) as r:
                while not stop.is_set():
                    res = r.read(retries=0, if_changed=True)
                    c["reads"] += 1
                    if res.status == "ok":
                        assert res.payload is not None
                        c["accepted"] += 1
                        if not check(res.payload):
                            c["bad"] += 1
                        res.payload.release()
                    elif res.status == "busy":
                        c["busy"] += 1
                c["torn"] = r.torn
            readers[name] = c

        def unchecked() -> None:
            c = {"reads": 0, "bad": 0}
            with shm.ShmReader(path, implementation=writer_impl) as r:
                while not stop.is_set():
                    data = r.read_unchecked()
                    c["reads"] += 1
                    if data and not check(data):
                        c["bad"] += 1
            readers["unchecked-control"] = c

        threads = [threading.Thread(target=checked, args=(n,)) for n in impls]
        threads.append(threading.Thread(target=unchecked))
        for t in threads:
            t.start()
        try:
            cmd = [sys.executable, "-m", "bearsdk.bench.snapshots", "--writer", str(path)]
            cmd += [str(rate), str(seconds), writer_impl]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, check=True, timeout=seconds + 60
            )
        finally:
            stop.set()
            for t in threads:
                t.join()
        writer = json.loads(proc.stdout)
    return {"writer": {**writer, "implementation": writer_impl}, "readers": readers}


def _main(args: argparse.Namespace) -> int:
    report = run(args.rounds, args.requests)
    if args.stress:
        report["stress"] = stress(args.stress, args.rate)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"Snapshot intake, {report['requests']} resident requests "
        f"({report['payload_bytes']} bytes of JSON); microseconds per snapshot"
    )
    print(f"{'decoder':8} {'step':16} {'p50':>9} {'p99':>9}")
    for name, e in report["decoders"].items():
        for step, t in e.items():
            print(f"{name:8} {step:16} {t['median_us']:>9.2f} {t['p99_us']:>9.2f}")
    print(f"target: decode + cache update <= {TARGET_US:g} us")
    print("prefix caching: decode with kv.prefix_cache, microseconds per snapshot")
    for users, e in report["prefix_cache"].items():
        line = f"  {users} users: {e['requests']} requests, {e['keys']} keys, "
        line += f"{e['payload_bytes']} bytes;"
        for name in ("compiled", "reference"):
            if name in e:
                line += f" {name} p50 {e[name]['median_us']:.0f} p99 {e[name]['p99_us']:.0f};"
        print(line.rstrip(";"))
    print("shared-memory seqlock, one 64-request payload:")
    for name, e in report["shm"].items():
        for step, t in e.items():
            print(f"{name:8} {step:16} {t['median_us']:>9.2f} {t['p99_us']:>9.2f}")
    if "stress" in report:
        s = report["stress"]
        w = s["writer"]
        print(
            f"stress: writer ({w['implementation']}) {w['writes']} snapshots in "
            f"{w['seconds']} s ({w['rate']}/s)"
        )
        for name, c in s["readers"].items():
            print(f"  reader {name}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser("snapshots", help="snapshot decode + cache update cost; shm stress test")
    p.add_argument("--rounds", type=positive_int, default=200, help="timing rounds")
    p.add_argument(
        "--requests", type=positive_int, default=64, help="resident requests per snapshot"
    )
    p.add_argument(
        "--stress",
        type=nonnegative_float,
        default=0.0,
        metavar="SECONDS",
        help="also run the shm stress test",
    )
    p.add_argument(
        "--rate", type=positive_float, default=10_000.0, help="stress writer snapshots/s"
    )
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--writer"]:
        raise SystemExit("usage: python -m bearsdk.bench.snapshots --writer PATH RATE SECONDS IMPL")
    _writer_main(sys.argv[2:])
