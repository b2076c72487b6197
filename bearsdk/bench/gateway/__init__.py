"""``bearsdk bench gateway``: what ``bearsdk serve`` costs, and what it survives.

Three kinds of process, as in production: the stub engines (one child process:
two that answer a streamed chat completion at once,
``bearsdk.bench._stubs.stub_engine`` as the router bench's, and two slow ones
that send one chunk per ``max_tokens`` at a fixed interval), the gateway
(``python -m bearsdk serve --config FILE``, a child process with its own
interpreter, authenticating every request with an API key), and the load
generator (this process). Scenarios:

1. **latency**: open-loop arrivals at ``--rate`` for ``--seconds``, rotating
   straight-to-the-engine, through a bare aiohttp proxy (the floor: the same
   hop doing nothing else, in a process of its own) and through-the-gateway
   requests sent by the same client code; time to first and to last chunk,
   and what the proxy and the gateway add.
   Targets: added p50 <= 0.5 ms, p99 <= 2 ms at 500 requests/s. The
   generator's own lateness (how far behind schedule requests left) tells
   whether the rate was really offered.
2. **scaling**: closed-loop throughput with ``--clients`` concurrent clients
   against 1 .. ``--workers-max`` gateway workers, and the ratio. The cores are
   shared by generator, engines and workers: the report says how many there are
   and how busy each process was.
3. **streams**: ``--streams`` long streams held open at once through one worker,
   in three waves; the gateway's RSS idle, at each wave's peak and after it
   (bounded: the last wave adds nothing); streams that did not end with
   ``[DONE]`` are lost (target: 0).
4. **reload**: ``--inflight`` streams in flight, then the pool (one instance
   out, another in) and the key (replaced) change in ``gateway.toml`` and the
   gateway gets SIGHUP: every stream must end with ``[DONE]``; once the
   gateway logs the reload done, the new key works and goes to the new
   instance, the old one gets 401. Requests sent while it reloads are counted
   per instance they went to.
5. **sigterm**: ``--inflight`` streams in flight, half shorter and half longer
   than ``drain_grace_s``, then SIGTERM: each must complete or end with the
   in-band ``draining`` error within the grace, and the gateway exit 0.

Linux only: memory and CPU are read from ``/proc``.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import anyio
import attrs

from bearsdk.bench.gateway._common import TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS, Sizes
from bearsdk.bench.gateway._procs import _fd_limit, _Procs, _start_engines
from bearsdk.bench.gateway._scenarios import _Bench
from bearsdk.cli import positive_float, positive_int
from bearsdk.errors import BearError

__all__ = ["QUICK", "SCENARIOS", "Sizes", "register", "run"]

SCENARIOS = ("latency", "scaling", "streams", "reload", "sigterm")

QUICK = Sizes(
    rate=100.0,
    seconds=1.0,
    warmup_s=0.3,
    clients=8,
    scaling_s=1.0,
    workers_max=2,
    streams=40,
    waves=3,
    inflight=20,
    interval_s=0.05,
    chunks=20,
    open_rate=500.0,
    grace_s=0.5,
)


def run(sizes: Sizes, scenarios: tuple[str, ...]) -> dict[str, Any]:
    """Run ``scenarios`` with ``sizes``; the report (``problems`` lists what failed).

    Raises:
        BearError: A child process did not start (its last log line), or sizes too small.
    """
    n = int(sizes.rate * sizes.seconds)
    if "latency" in scenarios and n < 2:
        raise BearError(
            f"the latency test needs at least 2 requests, one per path: --rate {sizes.rate:g} "
            f"x --seconds {sizes.seconds:g} gives {n}"
        )
    # The gateway holds two descriptors per stream (client, engine), the generator one.
    fds = _fd_limit(2 * max(sizes.streams, sizes.inflight) + 1024)
    report: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "fd_limit": fds,
        },
        "sizes": attrs.asdict(sizes),
    }
    procs = _Procs()
    problems: list[str] = []
    notes: list[str] = []
    if not fds["enough"]:
        problems.append(
            f"open-files limit {fds['soft']} is under the {fds['needed']} needed: "
            f"streams may fail for want of descriptors (raise ulimit -n)"
        )
    try:
        with tempfile.TemporaryDirectory(prefix="bearsdk-bench-gateway-") as d:
            tmp = Path(d)
            engines, urls = _start_engines(procs, tmp, sizes.interval_s)
            bench = _Bench(sizes, procs, tmp, engines, urls["fast"], urls["slow"], problems, notes)
            for name in scenarios:
                report[name] = anyio.run(getattr(bench, name))
    finally:
        procs.close()
    report["notes"] = notes
    report["problems"] = problems
    return report


# ------------------------------------------------------------------ report


def _print(report: dict[str, Any], out: IO[str]) -> None:
    def p(text: str = "") -> None:
        print(text, file=out)

    m = report["machine"]
    fd = m["fd_limit"]
    p(
        f"machine: {m['cpu_count']} core(s), python {m['python']}, load {m['load_avg']}, "
        f"open files {fd['soft']} (need {fd['needed']})"
    )
    if "latency" in report:
        x = report["latency"]
        gl = x["generator_late_ms"]
        p(
            f"latency: {x['requests']} streamed requests at {x['rate_rps']:g}/s offered, "
            f"{x['achieved_rps']:g}/s achieved; generator late p50 {gl['p50']} p99 {gl['p99']} "
            f"max {gl['max']} ms; errors {x['errors']}"
        )
        for what, label in (("first", "first chunk"), ("last", "last chunk")):
            y = x[what]
            p(
                f"  {label:11}: direct p50 {y['direct_p50_ms']} p99 {y['direct_p99_ms']} | "
                f"gateway p50 {y['gateway_p50_ms']} p99 {y['gateway_p99_ms']} | "
                f"added p50 {y['added_p50_ms']} p99 {y['added_p99_ms']} ms"
            )
        for what, label in (("first", "first chunk"), ("last", "last chunk")):
            y = x[what]
            p(
                f"  {label:11}: a bare aiohttp proxy hop adds p50 {y['proxy_added_p50_ms']} "
                f"p99 {y['proxy_added_p99_ms']} ms (aiohttp server and client, nothing else)"
            )
        for what, label in (("first", "first chunk"), ("last", "last chunk")):
            y = x[what]
            p(
                f"  {label:11}: added p50 <= {TARGET_ADDED_P50_MS:g} ms "
                f"{'met' if y['meets_p50_target'] else 'MISSED'}, added p99 <= "
                f"{TARGET_ADDED_P99_MS:g} ms {'met' if y['meets_p99_target'] else 'MISSED'}"
            )
        p(f"  cpu (cores busy): {_cores(x['cpu_cores'])}")
    if "scaling" in report:
        x = report["scaling"]
        p(
            f"scaling: closed loop, {x['clients']} clients, {x['seconds']:g} s each, "
            f"{x['cpu_count']} core(s)"
        )
        d = x["direct"]
        p(f"  direct to the engine: {d['rps']:g} req/s ({_cores(d['cpu_cores'])})")
        for r in x["runs"]:
            p(
                f"  {r['workers']} worker(s): {r['rps']:g} req/s, last chunk p50 "
                f"{r['last_chunk_p50_ms']} p99 {r['last_chunk_p99_ms']} ms, errors {r['errors']} "
                f"({_cores(r['cpu_cores'])})"
            )
        p(f"  ratio {x['runs'][-1]['workers']}/1 workers: {x['ratio']}")
        if "note" in x:
            p(f"  note: {x['note']}")
    if "streams" in report:
        x = report["streams"]
        p(
            f"streams: {x['streams']} streams of {x['stream_s']:g} s opened at "
            f"{x['open_rate']:g}/s, one worker, decision_history {x['decision_history']}; "
            f"RSS idle {x['rss_idle_kib'] / 1024:.1f} MiB"
        )
        for i, w in enumerate(x["waves"], 1):
            p(
                f"  wave {i}: ok {w['ok']} lost {w['lost']}, open at once {w['peak_open']} "
                f"(gateway counts {w['gateway_in_flight']}), RSS peak "
                f"{w['rss_peak_kib'] / 1024:.1f} MiB, after {w['rss_after_kib'] / 1024:.1f} MiB"
            )
        growth = x.get("rss_growth_last_wave_kib")
        p(
            f"  {x['rss_per_stream_kib']:g} KiB per open stream"
            + ("" if growth is None else f"; last wave vs the one before: {growth:+d} KiB")
        )
    if "reload" in report:
        x = report["reload"]
        p(
            f"reload: {x['in_flight_at_reload']} streams in flight (gateway counts "
            f"{x['gateway_in_flight_at_reload']}), pool a -> b and key old -> new, SIGHUP; "
            f"done after {x['reload_done_ms']} ms"
        )
        during = ", ".join(f"{v} on {k}" for k, v in x["during_reload_instances"].items())
        p(
            f"  new key while reloading: {_counts(x['during_reload'])}"
            + (f" ({during})" if during else "")
        )
        p(f"  in-flight streams: ok {x['ok']}, failed {x['failed']}")
        p(
            f"  after: new key {_counts(x['new_key'])} on {', '.join(x['new_key_instances'])}; "
            f"old key: {_counts(x['old_key'])}"
        )
    if "sigterm" in report:
        x = report["sigterm"]
        p(
            f"sigterm: {x['in_flight_at_sigterm']} streams in flight ({x['short_stream_s']:g} s "
            f"and {x['long_stream_s']:g} s), drain_grace_s {x['drain_grace_s']:g}"
        )
        p(
            f"  completed {x['ok']}, clean draining error {x['clean_error']}, "
            f"failed {x['failed']}; "
            f"last stream ended {x['last_stream_end_after_sigterm_s']} s after SIGTERM; exit "
            f"{x['exit_status']} after {x['sigterm_to_exit_s']} s"
        )
    for name in SCENARIOS:
        for line in report.get(name, {}).get("gateway_log", []):
            p(f"gateway log ({name}): {line}")
        for r in report.get(name, {}).get("runs", []):
            for line in r.get("gateway_log", []):
                p(f"gateway log ({name}, {r['workers']} workers): {line}")
    for line in report["notes"]:
        p(f"note: {line}")
    probs = report["problems"]
    p("problems: none" if not probs else f"problems ({len(probs)}):")
    for line in probs:
        p(f"  - {line}")


def _cores(c: dict[str, Any]) -> str:
    text = f"generator {c['generator']:.2f}, engines {c['engines']:.2f}"
    if "gateway" in c:
        text += f", gateway {c['gateway']:.2f}"
        if len(c["gateway_processes"]) > 1:
            text += f" = {' + '.join(f'{v:.2f}' for v in c['gateway_processes'])}"
    if c.get("other") is not None:
        text += f", other processes {c['other']:.2f}"
    return text


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in c.items()) or "none"


def _main(args: argparse.Namespace) -> int:
    if not sys.platform.startswith("linux"):
        raise BearError("bench gateway reads /proc: it runs on Linux only")
    base = QUICK if args.quick else Sizes()
    over = {
        k: v
        for k, v in (
            ("rate", args.rate),
            ("seconds", args.seconds),
            ("streams", args.streams),
            ("inflight", args.inflight),
            ("workers_max", args.workers_max),
            ("clients", args.clients),
        )
        if v is not None
    }
    sizes = attrs.evolve(base, **over)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    report = run(sizes, scenarios)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, sys.stdout)
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "gateway",
        help="bearsdk serve: added latency, worker scaling, 2,000 streams, reload, SIGTERM",
        description=(
            "Runs stub engines and bearsdk serve as child processes and loads them from "
            "this one: latency added over calling the engine directly (same client, same "
            "run), throughput per worker count, memory with many streams open, and no "
            "stream lost through a reload (SIGHUP) or a drain (SIGTERM)."
        ),
    )
    p.add_argument(
        "--scenario", choices=(*SCENARIOS, "all"), default="all", help="what to run (default all)"
    )
    p.add_argument("--rate", type=positive_float, help="latency: requests/s (default 500)")
    p.add_argument("--seconds", type=positive_float, help="latency: measured seconds (default 10)")
    p.add_argument("--streams", type=positive_int, help="streams: held open at once (default 2000)")
    p.add_argument(
        "--inflight", type=positive_int, help="reload, sigterm: streams in flight (default 1000)"
    )
    p.add_argument("--workers-max", type=positive_int, help="scaling: 1 .. N workers (default 2)")
    p.add_argument("--clients", type=positive_int, help="scaling: concurrent clients (default 64)")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a measure)")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
