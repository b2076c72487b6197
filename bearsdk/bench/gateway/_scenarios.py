"""The scenarios of ``bearsdk bench gateway``: latency, scaling, streams, reload, sigterm."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import attrs

from bearsdk.bench.gateway._common import (
    _SETTLE_S,
    _STOP_S,
    NEW_KEY,
    OLD_KEY,
    TARGET_ADDED_P50_MS,
    TARGET_ADDED_P99_MS,
    Sizes,
    _until,
)
from bearsdk.bench.gateway._load import (
    Result,
    _body,
    _failures,
    _gateway_in_flight,
    _headers,
    _instances,
    _ms,
    _Open,
    _open_loop,
    _outcomes,
    _q,
    _session,
    _stream,
)
from bearsdk.bench.gateway._procs import (
    _Cpu,
    _exited,
    _Gateway,
    _gateway_toml,
    _Procs,
    _rss_kib,
    _signal,
    _start_gateway,
    _start_proxy,
    _stop_gateway,
    _tail,
    _trouble,
    _write,
)


@attrs.define
class _Bench:
    sizes: Sizes
    procs: _Procs
    tmp: Path
    engines: subprocess.Popen[bytes]
    fast: list[str]
    slow: list[str]
    problems: list[str] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)

    def cores(self, cpu: _Cpu, what: str) -> dict[str, Any]:
        """``cpu.cores()``, with a note when other processes took a share of the machine."""
        c = cpu.cores()
        if c["other"] is not None and c["other"] >= 0.25:
            self.notes.append(
                f"{what}: other processes kept {c['other']:.2f} core(s) busy during the "
                f"measurement: its times and rates are pessimistic"
            )
        return c

    def toml(
        self,
        instances: list[tuple[str, str]],
        key: tuple[str, str] = ("bench", OLD_KEY),
        workers: int = 1,
        history: int | None = None,
    ) -> Callable[[int], str]:
        grace = self.sizes.grace_s
        return lambda port: _gateway_toml(
            port, instances, [key], workers=workers, grace_s=grace, history=history
        )

    def check_log(self, gw: _Gateway, what: str, out: dict[str, Any]) -> None:
        lines = _trouble(gw.log)
        if lines:
            out["gateway_log"] = lines
            if any("Traceback" in ln for ln in lines):
                self.problems.append(f"{what}: the gateway logged a traceback (gateway log below)")

    async def latency(self) -> dict[str, Any]:
        z = self.sizes
        n = int(z.rate * z.seconds)
        inst = [("a", self.fast[0]), ("b", self.fast[1])]
        gw = await _start_gateway(self.procs, self.tmp, "latency", self.toml(inst))
        # The floor: the same hop through an aiohttp proxy that does nothing else.
        proxy = _start_proxy(self.procs, self.tmp, self.fast[0])
        body, headers = _body(8), _headers(OLD_KEY)
        results: dict[str, list[Result]] = {"direct": [], "proxy": [], "gateway": []}
        try:
            async with _session() as s:

                def sender(keep: bool) -> Callable[[int], Coroutine[Any, Any, None]]:
                    async def send(i: int) -> None:
                        # Rotate the paths, and the two engines on the direct path as
                        # the gateway spreads its requests over both.
                        path = ("direct", "proxy", "gateway")[i % 3]
                        url = {"direct": self.fast[(i // 3) % 2], "proxy": proxy}.get(path, gw.url)
                        r = await _stream(s, url, body, headers)
                        if keep:
                            results[path].append(r)

                    return send

                await _open_loop(max(2, int(z.rate * z.warmup_s)), z.rate, sender(False))
                cpu = _Cpu(self.engines.pid, gw.proc.pid)
                late, achieved = await _open_loop(n, z.rate, sender(True))
                cores = self.cores(cpu, "latency")
        finally:
            await _stop_gateway(gw)
        out: dict[str, Any] = {
            "rate_rps": z.rate,
            "achieved_rps": round(achieved, 1),
            "requests": n,
            "generator_late_ms": {
                "p50": _ms(_q(late, 0.5)),
                "p99": _ms(_q(late, 0.99)),
                "max": _ms(max(late)),
            },
            "cpu_cores": cores,
        }
        for path, rs in results.items():
            out[f"{path}_outcomes"] = _outcomes(rs)
        errors = sum(r.outcome != "ok" for rs in results.values() for r in rs)
        out["errors"] = errors
        if errors:
            self.problems.append(f"latency: {errors} request(s) failed: {_failures(results)}")
        for what in ("first", "last"):
            vals = {
                p: [getattr(r, f"{what}_s") for r in rs if r.outcome == "ok"]
                for p, rs in results.items()
            }
            d50, g50 = _q(vals["direct"], 0.5), _q(vals["gateway"], 0.5)
            d99, g99 = _q(vals["direct"], 0.99), _q(vals["gateway"], 0.99)
            p50, p99 = _q(vals["proxy"], 0.5), _q(vals["proxy"], 0.99)
            out[what] = {
                "direct_p50_ms": _ms(d50),
                "gateway_p50_ms": _ms(g50),
                "direct_p99_ms": _ms(d99),
                "gateway_p99_ms": _ms(g99),
                "added_p50_ms": _ms(g50 - d50),
                "added_p99_ms": _ms(g99 - d99),
                "proxy_added_p50_ms": _ms(p50 - d50),
                "proxy_added_p99_ms": _ms(p99 - d99),
                "meets_p50_target": (g50 - d50) * 1e3 <= TARGET_ADDED_P50_MS,
                "meets_p99_target": (g99 - d99) * 1e3 <= TARGET_ADDED_P99_MS,
            }
        self.check_log(gw, "latency", out)
        return out

    async def _closed_loop(self, url: str, seconds: float) -> tuple[float, list[Result]]:
        z = self.sizes
        body, headers = _body(8), _headers(OLD_KEY)
        done: list[Result] = []
        async with _session() as s:

            async def client(until: float, keep: bool) -> None:
                while time.perf_counter() < until:
                    r = await _stream(s, url, body, headers)
                    if keep and r.ended <= until:
                        done.append(r)

            async with anyio.create_task_group() as tg:
                warm = time.perf_counter() + z.warmup_s
                for _ in range(z.clients):
                    tg.start_soon(client, warm, False)
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(z.clients):
                    tg.start_soon(client, t0 + seconds, True)
        ok = sum(r.outcome == "ok" for r in done)
        return ok / seconds, done

    async def scaling(self) -> dict[str, Any]:
        z = self.sizes
        cores = os.cpu_count() or 1
        out: dict[str, Any] = {"clients": z.clients, "seconds": z.scaling_s, "cpu_count": cores}
        # The engines and the generator alone: the ceiling any gateway run is under.
        cpu = _Cpu(self.engines.pid, None)
        rps, done = await self._closed_loop(self.fast[0], z.scaling_s)
        out["direct"] = {"rps": round(rps, 1), "cpu_cores": self.cores(cpu, "scaling, direct")}
        runs: list[dict[str, Any]] = []
        inst = [("a", self.fast[0]), ("b", self.fast[1])]
        for w in range(1, z.workers_max + 1):
            gw = await _start_gateway(
                self.procs, self.tmp, f"workers{w}", self.toml(inst, workers=w), workers=w
            )
            try:
                cpu = _Cpu(self.engines.pid, gw.proc.pid)
                rps, done = await self._closed_loop(gw.url, z.scaling_s)
                run: dict[str, Any] = {
                    "workers": w,
                    "rps": round(rps, 1),
                    "last_chunk_p50_ms": _ms(_q([r.last_s for r in done], 0.5)),
                    "last_chunk_p99_ms": _ms(_q([r.last_s for r in done], 0.99)),
                    "errors": sum(r.outcome != "ok" for r in done),
                    "cpu_cores": self.cores(cpu, f"scaling, {w} worker(s)"),
                }
            finally:
                await _stop_gateway(gw)
            if run["errors"]:
                self.problems.append(
                    f"scaling: {run['errors']} request(s) failed with {w} worker(s): "
                    f"{_failures({'gateway': done})}"
                )
            self.check_log(gw, f"scaling {w}", run)
            runs.append(run)
        out["runs"] = runs
        base = runs[0]["rps"]
        out["ratio"] = round(runs[-1]["rps"] / base, 2) if base else None
        busy = z.workers_max + 2  # workers, the engines' process and this generator
        if cores < busy:
            out["note"] = (
                f"{cores} core(s) shared by the generator, the engines and {z.workers_max} "
                f"worker(s): throughput is bounded by the cores, not by the gateway; the "
                f"ratio does not show how it scales on a machine with a core per worker"
            )
        return out

    async def _hold(
        self,
        s: aiohttp.ClientSession,
        url: str,
        n: int,
        chunks: Callable[[int], int],
        secret: str,
        results: list[Result],
        track: _Open,
    ) -> None:
        """Open ``n`` streams at the open rate (open loop), each kept until it ends."""
        headers = _headers(secret)
        bodies = {c: _body(c) for c in {chunks(i) for i in range(n)}}

        async def send(i: int) -> None:
            results.append(await _stream(s, url, bodies[chunks(i)], headers, track))

        await _open_loop(n, self.sizes.open_rate, send)

    async def _wave(self, s: aiohttp.ClientSession, gw: _Gateway) -> dict[str, Any]:
        """Open ``streams`` long streams at once; RSS sampled all along."""
        z = self.sizes
        results: list[Result] = []
        track = _Open()
        peak_rss = 0
        counted: int | None = None
        sampling = anyio.Event()

        async def sample() -> None:
            nonlocal peak_rss
            while not sampling.is_set():
                peak_rss = max(peak_rss, _rss_kib(gw.proc.pid))
                await anyio.sleep(0.1)

        async def gw_count() -> None:
            # The gateway's own count, once every stream is open.
            nonlocal counted
            if await _until(lambda: track.settled >= z.streams, _SETTLE_S):
                counted = await _gateway_in_flight(s, gw.url)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sample)
            tg.start_soon(gw_count)
            await self._hold(s, gw.url, z.streams, lambda i: z.chunks, OLD_KEY, results, track)
            sampling.set()
        await anyio.sleep(1.0)
        lost = sum(r.outcome != "ok" for r in results)
        if lost:
            self.problems.append(
                f"streams: {lost} of {z.streams} stream(s) lost: {_failures(results)}"
            )
        if track.peak < z.streams:
            self.problems.append(f"streams: at most {track.peak} of {z.streams} were open at once")
        return {
            "ok": len(results) - lost,
            "lost": lost,
            "peak_open": track.peak,
            "gateway_in_flight": counted,
            "rss_peak_kib": peak_rss,
            "rss_after_kib": _rss_kib(gw.proc.pid),
            "outcomes": _outcomes(results),
        }

    async def streams(self) -> dict[str, Any]:
        z = self.sizes
        # A decision history as long as a wave is full after the first one: later waves'
        # growth is then a leak, not the history filling (10,000 decisions by default).
        toml = self.toml([("a", self.slow[0])], history=z.streams)
        gw = await _start_gateway(self.procs, self.tmp, "streams", toml)
        out: dict[str, Any] = {
            "streams": z.streams,
            "decision_history": z.streams,
            "stream_s": round((z.chunks - 1) * z.interval_s, 2),
            "open_rate": z.open_rate,
            "rss_idle_kib": _rss_kib(gw.proc.pid),
        }
        try:
            async with _session() as s:
                waves = [await self._wave(s, gw) for _ in range(z.waves)]
        finally:
            await _stop_gateway(gw)
        out["waves"] = waves
        peak = max(w["rss_peak_kib"] for w in waves)
        out["rss_per_stream_kib"] = round((peak - out["rss_idle_kib"]) / z.streams, 1)
        if len(waves) > 1:
            # The first wave sets the allocator's high-water mark; the last shows any leak.
            growth = waves[-1]["rss_after_kib"] - waves[-2]["rss_after_kib"]
            out["rss_growth_last_wave_kib"] = growth
            wave_kib = waves[0]["rss_peak_kib"] - out["rss_idle_kib"]
            # Allocator noise is a few MiB whatever the size.
            if growth > max(0.1 * wave_kib, 4096):
                self.problems.append(
                    f"streams: RSS still grew by {growth} KiB in the last wave "
                    f"(a wave's streams take {wave_kib} KiB): memory may not be bounded"
                )
        self.check_log(gw, "streams", out)
        return out

    async def reload(self) -> dict[str, Any]:
        z = self.sizes
        n = z.inflight
        gw = await _start_gateway(
            self.procs, self.tmp, "reload", self.toml([("a", self.slow[0])], ("old", OLD_KEY))
        )
        out: dict[str, Any] = {"inflight": n}
        results: list[Result] = []
        track = _Open()
        applied: float | None = None
        try:
            async with _session() as s, anyio.create_task_group() as tg:
                tg.start_soon(self._hold, s, gw.url, n, lambda i: z.chunks, OLD_KEY, results, track)
                if not await _until(lambda: track.settled >= n, _SETTLE_S):
                    self.problems.append(f"reload: only {track.settled} of {n} streams started")
                out["in_flight_at_reload"] = track.now
                out["gateway_in_flight_at_reload"] = await _gateway_in_flight(s, gw.url)
                # The pool moves from engine a to engine b, the key is replaced.
                text = _gateway_toml(
                    gw.port, [("b", self.slow[1])], [("new", NEW_KEY)], grace_s=z.grace_s
                )
                before = _count(gw.log, "reloaded ")
                _write(gw.config, text)
                t0 = time.perf_counter()
                _signal(gw.proc, signal.SIGHUP)
                probe = _body(2)
                window: list[Result] = []
                finished = anyio.Event()

                async def probing() -> None:
                    # New-key requests while the reload is under way: where do they go?
                    while not finished.is_set():
                        window.append(await _stream(s, gw.url, probe, _headers(NEW_KEY)))
                        await anyio.sleep(0.005)

                def logged() -> bool:
                    # The gateway's own word that the whole reload (keys and pool) is done.
                    return (
                        _count(gw.log, "reloaded ") > before or _count(gw.log, "reload refused") > 0
                    )

                async with anyio.create_task_group() as pt:
                    pt.start_soon(probing)
                    if await _until(logged, _SETTLE_S) and _count(gw.log, "reload refused") == 0:
                        applied = time.perf_counter() - t0
                    finished.set()
                out["reload_done_ms"] = _ms(applied) if applied is not None else None
                out["during_reload"] = _outcomes(window)
                out["during_reload_instances"] = _instances(window)
                new: list[Result] = []
                old: list[Result] = []
                async with anyio.create_task_group() as checks:

                    async def one(secret: str, into: list[Result]) -> None:
                        into.append(await _stream(s, gw.url, probe, _headers(secret)))

                    for _ in range(20):
                        checks.start_soon(one, NEW_KEY, new)
                        checks.start_soon(one, OLD_KEY, old)
                out["new_key"] = _outcomes(new)
                out["new_key_instances"] = sorted({r.instance for r in new})
                out["old_key"] = _outcomes(old)
        finally:
            code = await _stop_gateway(gw)
        failed = sum(r.outcome != "ok" for r in results)
        out.update(ok=len(results) - failed, failed=failed, outcomes=_outcomes(results))
        if applied is None:
            self.problems.append(f"reload: not applied: {_tail(gw.log)}")
        odd = {k: v for k, v in out.get("during_reload", {}).items() if k not in ("ok", "HTTP 401")}
        if odd:
            self.problems.append(f"reload: requests sent during the reload failed: {odd}")
        if out.get("during_reload_instances", {}).get("a"):
            self.notes.append(
                f"reload: {out['during_reload_instances']['a']} request(s) with the new key went "
                f"to instance a, which the new config removes, before the reload finished"
            )
        if failed:
            self.problems.append(
                f"reload: {failed} in-flight stream(s) failed: {_failures(results)}"
            )
        if out["new_key"] != {"ok": 20} or out["new_key_instances"] != ["b"]:
            self.problems.append(
                f"reload: new key after the reload: {out['new_key']} "
                f"on {out['new_key_instances']} (expected 20 ok on b)"
            )
        if out["old_key"] != {"HTTP 401": 20}:
            self.problems.append(f"reload: old key after the reload: {out['old_key']}")
        out["exit_status"] = code
        self.check_log(gw, "reload", out)
        return out

    async def sigterm(self) -> dict[str, Any]:
        z = self.sizes
        n = z.inflight
        ramp = n / z.open_rate
        # Half the streams end within the grace (they must complete), half outlast it
        # (they must get the in-band draining error when the grace ends).
        short = max(2, math.ceil((ramp + z.grace_s / 2) / z.interval_s) + 1)
        long = max(z.chunks, math.ceil((ramp + 2 * z.grace_s) / z.interval_s) + 1)
        gw = await _start_gateway(self.procs, self.tmp, "sigterm", self.toml([("a", self.slow[0])]))
        out: dict[str, Any] = {
            "inflight": n,
            "drain_grace_s": z.grace_s,
            "short_stream_s": round((short - 1) * z.interval_s, 2),
            "long_stream_s": round((long - 1) * z.interval_s, 2),
        }
        results: list[Result] = []
        track = _Open()
        t_term = 0.0
        exit_s = None
        try:
            async with _session() as s, anyio.create_task_group() as tg:
                tg.start_soon(
                    self._hold, s, gw.url, n, lambda i: long if i % 2 else short, OLD_KEY,
                    results, track,
                )  # fmt: skip
                if not await _until(lambda: track.settled >= n, _SETTLE_S):
                    self.problems.append(f"sigterm: only {track.settled} of {n} streams started")
                out["in_flight_at_sigterm"] = track.now
                t_term = time.perf_counter()
                _signal(gw.proc, signal.SIGTERM)
                if await _until(lambda: _exited(gw.proc), z.grace_s + _STOP_S):
                    exit_s = time.perf_counter() - t_term
        finally:
            code = await _stop_gateway(gw)
        ok = sum(r.outcome == "ok" for r in results)
        clean = sum(r.outcome == "error:draining" for r in results)
        failed = len(results) - ok - clean
        ends = [r.ended - t_term for r in results if r.ended > t_term]
        out.update(
            ok=ok,
            clean_error=clean,
            failed=failed,
            outcomes=_outcomes(results),
            last_stream_end_after_sigterm_s=round(max(ends), 3) if ends else None,
            sigterm_to_exit_s=None if exit_s is None else round(exit_s, 3),
            exit_status=code,
        )
        if failed:
            self.problems.append(f"sigterm: {failed} stream(s) failed: {_failures(results)}")
        if code != 0:
            self.problems.append(f"sigterm: the gateway exited with {code} (expected 0)")
        if ends and max(ends) > z.grace_s + 2.0:
            self.problems.append(
                f"sigterm: a stream ended {max(ends):.2f} s after SIGTERM (grace {z.grace_s:g} s)"
            )
        self.check_log(gw, "sigterm", out)
        return out


def _count(path: Path, text: str) -> int:
    """Lines of ``path`` that hold ``text``."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").count(text)
    except OSError:
        return 0
