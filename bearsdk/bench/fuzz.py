"""``bearsdk bench fuzz``: untrusted snapshots through every delivery path into a router.

A snapshot comes from the network, so any byte string may arrive. This benchmark
generates ``--payloads`` of them (default 1,000,000; seeded, each one a function
of ``--seed`` and its index, so any finding can be regenerated) and checks what
the router does with each:

* **payloads**: valid ``bear.snapshot/1`` documents (0 to 64 requests, the KV
  geometry, placeholders, in-flight batches, epochs, numbers up to the decoders'
  physical bounds), most of them then mutated: fields set to boundary numbers
  (0, 1, -1, 2^31, 2^53, 2^63 - 1, 2^64 - 1, 10^30, 1e308, NaN, Infinity,
  1e999, 400-digit integers), wrong types, values nested up to 5,000 deep,
  strings up to 2 MB, fields deleted or unknown ones added, keys duplicated,
  requests reordered or duplicated, bytes truncated, flipped or inserted, a
  UTF-8 BOM, invalid UTF-8.
* **checks**, each payload: both decoders (compiled and pure, side by side in
  one process) accept or reject it identically, with the same snapshot or the
  same message; no exception other than the documented ``SnapshotError``
  escapes; a rejection's message is at most 1 KB; a :class:`SnapshotCache`
  with each replay twin's estimator (the scheduler rotating over every
  registered one) keeps its last good snapshot when the payload is rejected;
  when accepted, the compiled and the pure ``ttft()`` agree for three new
  requests; the payload then goes through the cache of a real
  :class:`~bearsdk.AsyncRouter` (two instances, the trained predictor, a frozen
  clock) and ``decide()`` chooses an instance (in the worker processes after
  every 10th payload; the pure twin's cache and ``ttft()`` on every 100th
  there, ``--twin-every``: the pure replay of a large snapshot costs tens of
  milliseconds; the transported payloads get every stage).
* **transports**, ``--transport N`` payloads per source (default 2,000) go
  through the real delivery paths first, each waited for before the next:
  ``poll`` (a :class:`~bearsdk.io.PollSource` against an HTTP endpoint on port 0
  serving the payload), ``push`` (a :class:`~bearsdk.io.PushSource` on a
  :class:`~bearsdk.io.SnapshotPublisher`'s stream), ``shm`` (a
  :class:`~bearsdk.io.shm.ShmWriter` segment read by a
  :class:`~bearsdk.io.shm.ShmSource`), ``redis`` (entries written into the key
  a :class:`~bearsdk.cluster.RedisSource` reads, on a server of its own or
  ``--redis-url``; skipped with a note without redis-py or redis-server). What
  each source delivered then goes through the checks above and the router's
  ``route()``. The rest go through the decoders and caches directly, in
  ``--jobs`` worker processes (a worker that dies is a crash: its payload
  range is reported): a transport costs about a millisecond of round trip per
  payload, which 1M payloads cannot afford, and adds nothing the decoders do
  not see (the bytes are compared on arrival).

Reported: payloads per source, crashes, exceptions escaping, twin
disagreements, kept-good-snapshot failures (each 0 to pass), the max and p99
time of a rejection by the router's cache, the largest rejection message, and
the max time of one accepted snapshot's compiled ``ttft()``; targets 10 ms,
1 KB and 10 ms. A call slower than 1 ms is timed twice more and the best of the
three kept: on a shared machine one slow call is more often the scheduler than
the payload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from bearsdk.bench._fuzz_checks import (
    EXAMPLES,
    MAX_MESSAGE,
    PROMPT,
    SOURCES,
    TARGET_S,
    Harness,
    Tally,
    good_snapshot,
    quiet_cache_logs,
)
from bearsdk.bench._fuzz_payloads import T0, payload
from bearsdk.state.cache import Outcome, SnapshotCache

if TYPE_CHECKING:
    pass

__all__ = ["SOURCES", "T0", "Harness", "Tally", "payload", "register", "run"]

# ---------------------------------------------------------------------- in-process part


def _work(seed: int, start: int, stop: int, twin_every: int, conn: Any) -> None:
    h = Harness(twin_every=twin_every, decide_every=10)
    tally = Tally()
    with quiet_cache_logs():
        for i in range(start, stop):
            h.check(payload(seed, i), i, tally)
    conn.send(tally)
    conn.close()


def _in_process(
    seed: int,
    start: int,
    n: int,
    jobs: int,
    chunk: int,
    twin_every: int,
    progress: Callable[[int], None],
) -> tuple[Tally, list[str]]:
    """Payloads ``start..start+n`` in worker processes; a worker that dies is a crash.

    ``jobs`` 0 runs them in this process (a crash then ends the run).
    """
    if jobs <= 0:
        h = Harness(twin_every=twin_every, decide_every=10)
        tally = Tally()
        for i in range(start, start + n):
            h.check(payload(seed, i), i, tally)
            if (i - start) % chunk == chunk - 1:
                progress(chunk)
        return tally, []
    # Not fork: the parent holds threads (the predictor's, aiohttp's), which a
    # forked child would inherit locked.
    ctx: Any = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
    ranges = [(a, min(a + chunk, start + n)) for a in range(start, start + n, chunk)]
    total = Tally()
    crashes: list[str] = []
    running: list[tuple[Any, Any, tuple[int, int]]] = []
    while ranges or running:
        while ranges and len(running) < jobs:
            rng = ranges.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_work, args=(seed, *rng, twin_every, send), daemon=True)
            p.start()
            send.close()
            running.append((p, recv, rng))
        for item in list(running):
            p, recv, rng = item
            if recv.poll(0.05):
                try:
                    total.merge(recv.recv())
                except EOFError:  # it died before sending its tally
                    p.join()
                    crashes.append(
                        f"payloads {rng[0]}..{rng[1] - 1} (seed {seed}): worker exited "
                        f"with {p.exitcode}"
                    )
                p.join()
                running.remove(item)
                progress(rng[1] - rng[0])
                _partial(total, crashes)
            elif not p.is_alive():
                p.join()
                if recv.poll(0):
                    continue  # the result arrived just now
                crashes.append(
                    f"payloads {rng[0]}..{rng[1] - 1} (seed {seed}): worker exited "
                    f"with {p.exitcode}"
                )
                running.remove(item)
                progress(rng[1] - rng[0])
    return total, crashes


def _partial(total: Tally, crashes: list[str]) -> None:
    """One line of the running totals on stderr (a long run cut short still reports)."""
    s = total.summary()
    del s["examples"]
    s["crashes"] = len(crashes)
    print(f"fuzz partial: {json.dumps(s)}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- transports


@attrs.define(on_setattr=attrs.setters.NO_OP)
class _Recorder(SnapshotCache):
    """A source's cache that also keeps the bytes it was offered (the transport's output)."""

    got: list[bytes] = attrs.field(init=False, factory=list)
    arrived: anyio.Event = attrs.field(init=False, factory=anyio.Event)

    def offer_bytes(
        self,
        data: bytes | bytearray | memoryview | str,
        *,
        source: str = "",
        fresh_connection: bool = False,
        received: float | None = None,
    ) -> Outcome:
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        self.got.append(raw)
        self.arrived.set()
        return super().offer_bytes(
            data, source=source, fresh_connection=fresh_connection, received=received
        )

    def note(self, raw: bytes) -> None:
        self.got.append(raw)
        self.arrived.set()


async def _deliver(
    send: Callable[[bytes], Any], rec: _Recorder, data: bytes, expect: bytes
) -> bytes | None:
    rec.got.clear()
    rec.arrived = anyio.Event()
    r = send(data)
    if hasattr(r, "__await__"):
        await r
    with anyio.move_on_after(1.0):
        while expect not in rec.got:
            await rec.arrived.wait()
            rec.arrived = anyio.Event()
        return expect
    return None


async def _transport(
    name: str, h: Harness, seed: int, n: int, redis_url: str | None
) -> tuple[Tally, int, str | None]:
    """``n`` payloads through one real source; returns the tally, undelivered, skip note."""
    from aiohttp import web

    from bearsdk.io import PollSource, PushSource, SnapshotPublisher

    tally = Tally()
    undelivered = 0
    rec = _Recorder("i0", log_interval_s=3600.0)
    base = 10**12 * (1 + SOURCES.index(name))
    stack = contextlib.AsyncExitStack()
    async with stack, anyio.create_task_group() as tg:
        send: Callable[[bytes], Any]
        if name in ("poll", "push"):
            pub = SnapshotPublisher("i0", heartbeat_s=0.5)
            app = web.Application()
            pub.add_routes(app)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            stack.callback(pub.close)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            src: Any = PollSource(url, interval_s=0.001) if name == "poll" else PushSource(url)
            send = pub.publish
        elif name == "shm":
            from bearsdk.io.shm import ShmSource, ShmWriter

            d = tempfile.mkdtemp(prefix="bearsdk-fuzz-")
            path = os.path.join(d, "bear.i0")
            writer = ShmWriter(path, capacity=4 << 20)
            stack.callback(os.rmdir, d)
            stack.callback(writer.close, unlink=True)
            writer.write(good_snapshot("i0").to_json())
            src = ShmSource(path, interval_s=0.0005)
            send = writer.write
        else:
            try:
                import redis.asyncio as aioredis
            except ImportError:
                return tally, 0, "skipped: redis-py is not installed (pip install 'bearsdk[redis]')"
            from bearsdk.cluster import RedisBus, RedisSource

            if redis_url is None:
                from bearsdk.cluster.local import LocalRedis, LocalRedisError

                try:
                    server = LocalRedis().start()
                except LocalRedisError as exc:
                    return tally, 0, f"skipped: no redis-server ({exc}); or pass --redis-url"
                stack.callback(server.stop)
                redis_url = server.url
            bus = RedisBus(redis_url, prefix=f"fuzz{uuid.uuid4().hex[:8]}")
            await tg.start(bus.run)
            raw = aioredis.Redis.from_url(redis_url)
            stack.push_async_callback(raw.aclose)
            key = bus.snapshot_key("i0")
            # RedisSource hands valid documents to the cache decoded: record the raw entries.
            bus.subscribe_snapshots("i0", rec.note)
            src = RedisSource(bus, "i0")

            async def send(data: bytes) -> None:
                await raw.xadd(key, {"d": data}, maxlen=1, approximate=False)

        await tg.start(src.run, rec)
        router = h.router
        assert router is not None
        for i in range(n):
            data = payload(seed, base + i)
            # The push stream keeps a document on one line.
            expect = data.replace(b"\n", b" ") if name == "push" else data
            if name == "push" and (not expect.strip() or len(expect) == 0):
                expect = b"\x00never"  # a blank line is a heartbeat: nothing to wait for
            got = await _deliver(send, rec, data, expect)
            if got is None:
                undelivered += 1
                continue
            h.check(got, base + i, tally)
            try:
                await router.route(PROMPT, ttft_target=5.0)
            except Exception as exc:
                tally.note("escapes", base + i, f"route: {type(exc).__name__}: {exc!s:.200}")
        if name == "redis":
            errs = bus.stats().callback_errors
            if errs:
                tally.other += errs
                tally.examples.append(f"redis: {errs} entries raised in a subscriber")
        tg.cancel_scope.cancel()
    return tally, undelivered, None


async def _transports(
    h: Harness, seed: int, n: int, sources: list[str], redis_url: str | None
) -> tuple[dict[str, dict[str, Any]], Tally]:
    out: dict[str, dict[str, Any]] = {}
    total = Tally()
    for name in sources:
        t0 = time.perf_counter()
        try:
            tally, undelivered, note = await _transport(name, h, seed, n, redis_url)
        except Exception as exc:  # a source's task died: that is a crash of the router
            out[name] = {"crashed": f"{type(exc).__name__}: {exc!s:.300}"}
            continue
        total.merge(tally)
        s = tally.summary()
        s["undelivered"] = undelivered
        s["seconds"] = round(time.perf_counter() - t0, 1)
        if note:
            s["note"] = note
        out[name] = s
    return out, total


# ---------------------------------------------------------------------- command


def run(
    payloads: int = 1_000_000,
    *,
    seed: int = 0,
    sources: tuple[str, ...] = SOURCES,
    transport: int = 2000,
    jobs: int = 1,
    redis_url: str | None = None,
    chunk: int = 10_000,
    twin_every: int = 100,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the fuzz benchmark; returns the report (see the module docstring).

    Args:
        payloads: Payloads in all (the transports' included).
        seed: Generator seed.
        sources: Transports to run ``transport`` payloads through each.
        transport: Payloads per transport.
        jobs: Worker processes for the rest (0: this process).
        redis_url: A Redis server for the ``redis`` source (default: start one).
        chunk: Payloads per worker process (a crash loses its chunk).
        twin_every: See :class:`Harness` (transported payloads: every one).
        progress: Called with the number of payloads each finished chunk checked.
    """
    t0 = time.perf_counter()
    h = Harness()
    per_source: dict[str, dict[str, Any]] = {}
    total = Tally()
    with quiet_cache_logs():
        if transport > 0 and sources:
            per_source, total = anyio.run(_transports, h, seed, transport, list(sources), redis_url)
        direct = max(0, payloads - total.payloads)
        tally, crashes = _in_process(
            seed, 0, direct, jobs, chunk, twin_every, progress or (lambda n: None)
        )
    total.merge(tally)
    crashed = len(crashes) + sum(1 for s in per_source.values() if "crashed" in s)
    summed = total.summary()
    del summed["examples"]
    summed["crashes"] = crashed
    summed["seconds"] = round(time.perf_counter() - t0, 1)
    passed = (
        crashed == 0
        and total.problems == 0
        and summed["reject_max_ms"] <= 1e3 * TARGET_S
        and summed["max_message_bytes"] <= MAX_MESSAGE
        and summed["accepted_ttft_max_ms"] <= 1e3 * TARGET_S
    )
    return {
        "seed": seed,
        "decoders": sorted(h.decoders),
        "replay": h.impls,
        "schedulers": h.schedulers,
        "twin_every": twin_every,
        "sources": per_source,
        "direct": tally.summary(),
        "crash_ranges": crashes,
        "total": summed,
        "passed": passed,
    }


def _sources(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    for s in names:
        if s not in SOURCES:
            raise argparse.ArgumentTypeError(f"unknown source {s!r} (one of {', '.join(SOURCES)})")
    return names


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {v})")
    return v


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "fuzz", help="untrusted snapshots through every source into a router (1M by default)"
    )
    p.add_argument("--payloads", type=_count, default=1_000_000, help="payloads in all")
    p.add_argument("--seed", type=int, default=0, help="generator seed (payloads repeat)")
    p.add_argument(
        "--sources", type=_sources, default=SOURCES, help="real transports: poll,push,shm,redis"
    )
    p.add_argument("--transport", type=_count, default=2000, help="payloads through each transport")
    p.add_argument(
        "--jobs", type=_count, default=os.cpu_count() or 1, help="worker processes (0: none)"
    )
    p.add_argument("--redis-url", default=None, help="a Redis server (default: start one)")
    p.add_argument(
        "--twin-every",
        type=_count,
        default=100,
        help="pure twin's cache and ttft() on every Nth payload of the workers",
    )
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    done = [0]
    last = [time.monotonic()]

    def progress(n: int) -> None:
        done[0] += n
        if not args.json and time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            print(f"  ... {done[0]} payloads checked in process", file=sys.stderr, flush=True)

    report = run(
        args.payloads,
        seed=args.seed,
        sources=args.sources,
        transport=args.transport,
        jobs=args.jobs,
        redis_url=args.redis_url,
        twin_every=max(1, args.twin_every),
        progress=progress,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["passed"] else 1
    t = report["total"]
    print(f"fuzz: {t['payloads']} payloads, seed {report['seed']}, {t['seconds']} s")
    print(f"{'source':8} {'payloads':>9} {'accepted':>9} {'escapes':>8} {'disagree':>9} "
          f"{'lost':>5} {'rej max':>8} {'rej p99':>8} {'msg max':>8} {'ttft max':>9}")  # fmt: skip
    rows = dict(report["sources"])
    rows["direct"] = report["direct"]
    for name, s in rows.items():
        if "crashed" in s:
            print(f"{name:8} crashed: {s['crashed']}")
            continue
        if "note" in s:
            print(f"{name:8} {s['note']}")
            continue
        print(
            f"{name:8} {s['payloads']:>9} {s['accepted']:>9} {s['escapes']:>8} "
            f"{s['twin_disagreements']:>9} {s['lost_good_snapshot']:>5} "
            f"{s['reject_max_ms']:>6.2f}ms {s['reject_p99_ms']:>6.3f}ms "
            f"{s['max_message_bytes']:>7}B {s['accepted_ttft_max_ms']:>7.2f}ms"
            + (f"  ({s['undelivered']} undelivered)" if s.get("undelivered") else "")
        )
    print(
        f"crashes {t['crashes']}, exceptions escaping {t['escapes']}, twin disagreements "
        f"{t['twin_disagreements']} (twin pairs where a replay reached its work bound, not "
        f"compared: {t['ttft_work_bounded']}), good snapshot lost {t['lost_good_snapshot']}, other "
        f"{t['other_failures']}; rejection max {t['reject_max_ms']} ms (p99 "
        f"{t['reject_p99_ms']} ms), message max {t['max_message_bytes']} B, accepted ttft() "
        f"max {t['accepted_ttft_max_ms']} ms (targets 10 ms, 1024 B, 10 ms)"
    )
    print(
        f"slowest: accepted ttft() payload {t['slowest_ttft_payload']}, rejection payload "
        f"{t['slowest_reject_payload']} (regenerate: bearsdk.bench.fuzz.payload(seed, index))"
    )
    for line in report["crash_ranges"]:
        print(f"  crash: {line}")
    examples = list(report["direct"]["examples"])
    for s in report["sources"].values():
        examples += s.get("examples", [])
    for line in examples[:EXAMPLES]:
        print(f"  {line}")
    print("PASS" if report["passed"] else "FAIL")
    return 0 if report["passed"] else 1
