"""``bearsdk bench prefix``: BEA's TTFT error on a multi-turn agent workload with prefix caching.

An emulated vLLM engine (``vllm-v1`` with ``enable_prefix_caching``, real token
ids) serves concurrent agent sessions: each turn's prompt is the previous
turn's prompt, its output and new text, so every turn after the first hits the
blocks its predecessor left (when they survive eviction). At every arrival the
router's view is the snapshot the engine published just then, with the true
output lengths of its residents (oracle lengths); BEA predicts the new turn's
TTFT two ways:

* ``blocks``: the snapshot's ``kv.prefix_cache`` replayed block by block, the
  new turn's content keys looked up at its admission;
* ``ignored``: the same snapshot with the cache ignored (blocks counted, every
  prompt computed in full: what BEA did before prefix caching);
* ``online``: ``blocks`` with the instance's online recalibration, as
  :class:`~bearsdk.AsyncRouter` runs it: the engine's batch records
  (``/bear/batches``) feed :class:`~bearsdk.estimators.OnlineBatchTime`, whose
  eq. 12 coefficients replace the estimator's every 32 batches.

The score is the mean absolute percentage error against the TTFT the engine
measured, and how often the replay's first-token batch is the engine's. The
engine runs in real time with its ground-truth time model (noise included);
BEA uses the instance's calibrated eq. 12 coefficients (a profiling sweep of
its own GPU), so the error left with ``blocks`` is the time model's, not the
replay's; ``online`` fits them to the batches this workload forms. The batch
in flight at capture has run on until the request arrives: that part of it is
taken off every estimate, as the router's staleness handling does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Any

import anyio
import attrs

from bearsdk.bench import loop_line, loop_report
from bearsdk.cli import positive_int

__all__ = ["register", "run"]

KINDS = ("blocks", "online", "ignored")
"""The estimates compared (module docstring)."""


async def _run(sessions: int, turns: int, seed: int, profile: str) -> dict[str, Any]:
    from bearsdk.emulator import EmulatedEngine, EngineConfig
    from bearsdk.estimators.batch_time import OnlineBatchTime, read_batches
    from bearsdk.estimators.bea import BEAEstimator
    from bearsdk.replay.blocks import chain_keys
    from bearsdk.snapshot import snapshot_from_dict

    cfg = EngineConfig(
        profile=profile,
        params={"enable_prefix_caching": True, "max_num_seqs": 64},
        publish_output_len=True,
        serve_http=False,
        seed=seed,
    )
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    async with EmulatedEngine(cfg) as eng:
        policy = eng.policy
        bt = eng.calibrated_batch_time()
        with_blocks = BEAEstimator(policy, bt)
        ignored = BEAEstimator(attrs.evolve(policy, prefix_caching=False), bt)
        online = BEAEstimator(policy, bt)
        fit = OnlineBatchTime(bt)
        reader = eng.batch_hub.subscribe()

        async def recalibrate() -> None:
            # What AsyncRouter's runtime does with GET /bear/batches.
            accepted = 0
            while not reader.closed:
                await reader.wait()
                for obs in read_batches(reader.drain().decode().splitlines()):
                    if fit.observe_batch(obs):
                        accepted += 1
                        if accepted % 32 == 0:
                            online.batch_time = fit.model

        bs = policy.block_size
        vocab = 150_000

        async def session(s: int) -> None:
            ids = [rng.randrange(1, vocab) for _ in range(rng.randint(300, 1500))]
            await anyio.sleep(rng.uniform(0, 0.5))
            for t in range(turns):
                out = rng.randint(20, 200)
                await wait_published(eng)
                pub = eng.captured_snapshot
                # Same task, no await: the turn arrives in exactly that state.
                h = eng.submit_tokens(
                    len(ids), out, max_tokens=out, request_id=f"s{s}t{t}", prompt_ids=ids
                )
                # The batch in flight at capture has run on since: what is left of it.
                age = anyio.current_time() - pub.captured_at
                # The estimates are computed after the run: CPU spent here would
                # hold up the engine's loop (it shares this thread) and slow the
                # very TTFTs being predicted.
                pending.append((t, pub, ids, out, age, h, online.batch_time))
                await h.result()
                assert h.ttft is not None
                # A late loop (a busy machine) idles the emulated GPU and delivers
                # tokens after their batch ended: the host's time, not the GPU's.
                idle[h.id] = eng.idle_between(h.arrival, h.arrival + h.ttft) + h.first_token_late
                assert h.plan.output_ids is not None
                ids = [
                    *ids,
                    *h.plan.output_ids,
                    *(rng.randrange(1, vocab) for _ in range(rng.randint(30, 300))),
                ]
                if len(ids) + 400 > eng.max_model_len:
                    return
                await anyio.sleep(rng.expovariate(4.0))

        pending: list[tuple[int, Any, list[int], int, float, Any, Any]] = []
        idle: dict[str, float] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(recalibrate)
            async with anyio.create_task_group() as clients:
                for s in range(sessions):
                    clients.start_soon(session, s)
            tg.cancel_scope.cancel()
        eng.batch_hub.unsubscribe(reader)
        lag = eng.loop_stats()
    for t, pub, ids, out, age, h, bt_online in pending:
        assert h.ttft is not None
        snap = snapshot_from_dict(pub.doc)
        keys = chain_keys(ids, bs)
        est_b = with_blocks.estimate(snap, len(ids), out, max_tokens=out, prefix_keys=keys)
        est_i = ignored.estimate(snap, len(ids), out, max_tokens=out)
        online.batch_time = bt_online  # the coefficients it had when the turn arrived
        est_o = online.estimate(snap, len(ids), out, max_tokens=out, prefix_keys=keys)
        spent = min(age, est_b.inflight_s)
        k = h.first_token_batch - pub.batches
        rows.append(
            {
                "turn": t,
                "prompt": len(ids),
                "ttft": h.ttft - idle[h.id],
                "ttft_raw": h.ttft,
                "blocks": est_b.ttft_s - spent,
                "ignored": est_i.ttft_s - spent,
                "online": est_o.ttft_s - spent,
                # The replay's first-token batch against the engine's.
                "batch_ok": est_b.first_token_batch == k,
                "batch_ok_ignored": est_i.first_token_batch == k,
            }
        )
    return _report(rows, profile, sessions, turns, lag)


async def wait_published(eng: Any) -> None:
    """Wait until the engine's latest snapshot describes its state now."""
    with anyio.fail_after(10):
        for _ in range(1_000_000):
            if eng.snapshot_current:
                return
            await anyio.sleep(0.0005)


def _mape(rows: list[dict[str, Any]], key: str, truth: str = "ttft") -> float:
    return 100.0 * statistics.fmean(abs(r[key] - r[truth]) / r[truth] for r in rows)


def _report(
    rows: list[dict[str, Any]], profile: str, sessions: int, turns: int, lag: Any
) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 0]
    first = [r for r in rows if r["turn"] == 0]
    out: dict[str, Any] = {
        "profile": profile,
        "sessions": sessions,
        "turns": turns,
        "requests": len(rows),
        "median_ttft_ms": round(1e3 * statistics.median(r["ttft"] for r in rows), 2),
        "mape_pct": {k: round(_mape(rows, k), 2) for k in KINDS},
        "first_token_batch_exact_pct": {
            "blocks": round(100.0 * statistics.fmean(r["batch_ok"] for r in rows), 1),
            "ignored": round(100.0 * statistics.fmean(r["batch_ok_ignored"] for r in rows), 1),
        },
        "mape_pct_later_turns": {k: round(_mape(later, k), 2) for k in KINDS} if later else None,
        "mape_pct_first_turns": {k: round(_mape(first, k), 2) for k in KINDS} if first else None,
        # Against the TTFTs as measured, the host's lateness included.
        "mape_pct_raw": {k: round(_mape(rows, k, "ttft_raw"), 2) for k in KINDS},
    }
    out["loop"] = loop_report(lag)
    return out


def run(
    sessions: int = 16, turns: int = 6, seed: int = 1, profile: str = "qwen3-8b-h100"
) -> dict[str, Any]:
    """Run the experiment; return the MAPEs of the estimates (:data:`KINDS`)."""
    return anyio.run(_run, sessions, turns, seed, profile)


EXPORT_POOL = 41_000
EXPORT_RESIDENTS = 64


def export_cost(snapshots: int = 60, seed: int = 3) -> dict[str, Any]:
    """What writing ``kv.prefix_cache`` costs per snapshot with a warm, large pool.

    A live scheduler (``vllm-v1`` with the cache, async, a 41k-block pool, 64
    residents of which up to 56 run) serves requests over eight shared
    2,000-token system prompts until 94 % of the pool is cached; then, after
    each of ``snapshots`` steps, its export (the wired pool's, what
    ``SchedulerCore.snapshot`` runs) and the export from scratch
    (:func:`~bearsdk.replay.prefix.export_reference`, the walk over every
    block that it replaced) are timed on the same state, one after the other.
    """
    import time

    from bearsdk.replay.prefix import export, export_reference
    from bearsdk.replay.requests import CachedReq
    from bearsdk.replay.scheduler import SchedulerCore
    from bearsdk.replay.wired import WiredPool
    from bearsdk.schedulers import bind_scheduler

    bs = 16
    pol = bind_scheduler(
        "vllm-v1",
        {
            "block_size": bs,
            "max_num_batched_tokens": 8192,
            "max_num_seqs": 56,
            "num_gpu_blocks": EXPORT_POOL,
            "enable_prefix_caching": True,
            "async_scheduling": True,
            "max_model_len": 32768,
        },
    )
    core = SchedulerCore(pol)
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 150_000) for _ in range(2000)] for _ in range(8)]
    inflight: list[Any] = []
    n = 0

    def step() -> None:
        inflight.append(core.schedule())
        if len(inflight) > 1:
            core.process(inflight.pop(0))

    def top_up() -> None:
        nonlocal n
        while len(core.running) + len(core.waiting) < EXPORT_RESIDENTS:
            head = systems[rng.randrange(8)][: rng.randint(0, 2000)]
            user = [rng.randrange(1000, 150_000) for _ in range(rng.randint(200, 4000))]
            out = rng.randint(20, 300)
            ids = head + user + [rng.randrange(1000, 150_000) for _ in range(out)]
            core.add_request(f"r{n}", len(head) + len(user), out, out, ids)
            n += 1

    def residents() -> tuple[list[Any], list[Any]]:
        # What SchedulerCore._export_blocks hands the export.
        res, tags = [], []
        for r in (*core.running, *core.waiting):
            assert isinstance(r, CachedReq)
            held = r.block_ids if r in core.running else ()
            res.append((held, r.cached_blocks if held else 0, core._keys(r, r.num_tokens // bs)))
            tags.append((r, r.preemptions))
        return res, tags

    assert core.pool is not None
    while core.pool.num_cached < 0.94 * EXPORT_POOL:
        top_up()
        step()
    assert WiredPool.wire(core.pool)
    pool = core.pool
    export(pool, *residents())
    clock = time.perf_counter_ns
    new: list[float] = []
    ref: list[float] = []
    steps: list[float] = []
    cached = []
    for _ in range(snapshots):
        top_up()
        t0 = clock()
        step()
        steps.append((clock() - t0) / 1e3)
        res, tags = residents()
        t0 = clock()
        got, _ = export(pool, res, tags)
        new.append((clock() - t0) / 1e3)
        t0 = clock()
        want, _ = export_reference(pool, res)
        ref.append((clock() - t0) / 1e3)
        cached.append(got["cached"])
        if (got["cached"], len(got["free"])) != (want["cached"], len(want["free"])):
            raise AssertionError("the two exports name different blocks")

    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {
            "median_us": round(statistics.median(xs), 1),
            "p99_us": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1),
        }

    return {
        "pool_blocks": EXPORT_POOL,
        "residents": EXPORT_RESIDENTS,
        "snapshots": snapshots,
        "cached_blocks_median": int(statistics.median(cached)),
        "export_us": stats(new),
        "from_scratch_us": stats(ref),
        "step_us": stats(steps),
        "speedup": round(statistics.median(ref) / statistics.median(new), 1),
    }


def _print_export(e: dict[str, Any]) -> None:
    print(
        f"kv.prefix_cache export, warm pool ({e['cached_blocks_median']} of {e['pool_blocks']} "
        f"blocks cached, {e['residents']} residents, {e['snapshots']} snapshots): "
        f"p50 {e['export_us']['median_us']} us, p99 {e['export_us']['p99_us']} us; "
        f"from scratch p50 {e['from_scratch_us']['median_us']} us, "
        f"p99 {e['from_scratch_us']['p99_us']} us ({e['speedup']}x); "
        f"one scheduler step p50 {e['step_us']['median_us']} us"
    )


def _main(args: argparse.Namespace) -> int:
    if args.export_only:
        e = export_cost()
        if args.json:
            print(json.dumps({"export": e}, indent=2))
        else:
            _print_export(e)
        return 0
    report = run(args.sessions, args.turns, args.seed, args.profile)
    report["export"] = export_cost()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"BEA TTFT MAPE, multi-turn agent sessions on the emulator ({report['profile']}, "
        f"prefix caching on, oracle lengths): {report['requests']} requests, "
        f"{report['sessions']} sessions x up to {report['turns']} turns, median TTFT "
        f"{report['median_ttft_ms']} ms"
    )
    for name, label in (
        ("mape_pct", "all turns"),
        ("mape_pct_later_turns", "turns 2+"),
        ("mape_pct_first_turns", "first turns"),
        ("mape_pct_raw", "as measured"),
    ):
        m = report[name]
        if m:
            print(
                f"  {label:12s} with the blocks {m['blocks']:7.2f} %"
                f"   + online calibration {m['online']:7.2f} %"
                f"   cache ignored {m['ignored']:7.2f} %"
            )
    print(loop_line(report["loop"]))
    fb = report["first_token_batch_exact_pct"]
    print(
        f"  first-token batch exact: with the blocks {fb['blocks']} %, "
        f"cache ignored {fb['ignored']} % of requests"
    )
    _print_export(report["export"])
    sys.stdout.flush()
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``prefix`` benchmark."""
    p = bsub.add_parser(
        "prefix", help="BEA TTFT MAPE with prefix caching on the emulator (agent sessions)"
    )
    p.add_argument("--sessions", type=positive_int, default=16, help="concurrent sessions")
    p.add_argument("--turns", type=positive_int, default=6, help="turns per session")
    p.add_argument("--seed", type=int, default=1, help="workload and engine seed")
    p.add_argument("--profile", default="qwen3-8b-h100", help="emulator profile")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.add_argument(
        "--export-only",
        action="store_true",
        help="only what the kv.prefix_cache export costs with a warm 41k-block pool",
    )
    p.set_defaults(func=_main)
