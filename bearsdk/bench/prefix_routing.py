"""``bearsdk bench prefix-routing``: BEAR with and without the cache, and the prefix-aware
baselines, on multi-turn agent sessions in the simulator.

Virtual time (:mod:`bearsdk.sim.prefix`): the paper's pool (Qwen3-0.6B, 8B,
32B) with prefix caching, agent sessions closed-loop behind shared system
prompts, the paper's TTFT targets. Per rate and policy: OnTimeUtility (eq. 6),
SLO attainment, TTFT, the share of prompt tokens the engines found cached, and
where the turns went.

``--workload mooncake`` replays the Mooncake conversation trace instead
(``mooncake/conversation_trace.jsonl`` under ``--data-dir``; rates are then
requests/s): each 512-token hash id is a block of fixed token ids, so the
trace's shared prefixes are shared blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bearsdk.cli import positive_int

__all__ = ["rate_summary", "register"]

_TRACE = "conversation_trace.jsonl"


def _rates(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers (got {text!r})") from None
    if not out or any(not 0 < r <= 1000 for r in out):
        raise argparse.ArgumentTypeError(f"rates must be in (0, 1000] sessions/s (got {text!r})")
    return out


def _policies(text: str) -> list[str]:
    from bearsdk.sim.prefix import PREFIX_POLICIES

    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in PREFIX_POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"policies must be among {', '.join(PREFIX_POLICIES)} (got {text!r})"
        )
    return out


def _main(args: argparse.Namespace) -> int:
    from bearsdk.sim.prefix import run_prefix

    if args.rates is None:
        args.rates = [1.0, 2.0, 3.0] if args.workload == "mooncake" else [8.0, 12.0, 16.0]
    trace = None
    if args.workload == "mooncake":
        from bearsdk.data import data_dir

        trace = str(data_dir(args.data_dir, "mooncake") / "mooncake" / _TRACE)
    runs: list[dict[str, Any]] = []
    for rate in args.rates:
        for policy in args.policies:
            r = run_prefix(
                policy,
                rate,
                duration_s=args.duration,
                seed=args.seed,
                trace=trace,
                expect_arrivals=not args.no_arrivals,
                overload=args.overload,
                affinity=args.affinity,
            )
            runs.append(r.as_dict())
            if not args.json:
                comp = ", ".join(f"{k.rsplit('-', 2)[0]} {v}" for k, v in r.composition.items())
                print(
                    f"{rate:6g}/s {policy:17s} OTU {r.on_time_utility:.4f}  SLO "
                    f"{100 * r.slo_attainment:5.1f} %  TTFT mean {1e3 * r.mean_ttft_s:6.1f} ms "
                    f"p90 {1e3 * r.p90_ttft_s:6.1f} ms  cached {100 * r.hit_rate:4.1f} %  "
                    f"turns {r.turns} ({comp})",
                    flush=True,
                )
        if not args.json:
            verdict = rate_summary(runs[-len(args.policies) :])
            if verdict:
                print(f"{rate:6g}/s {verdict}", flush=True)
    if args.json:
        print(json.dumps(runs, indent=2))
    sys.stdout.flush()
    return 0


def rate_summary(runs: list[dict[str, Any]]) -> str:
    """One rate's comparison: BEAR with the cache against BEAR without it (and
    how often the latter met its targets) and against the best prefix-aware
    baseline, by OnTimeUtility; empty when ``bear-cache`` is not among ``runs``."""
    by = {r["policy"]: r for r in runs}
    cache = by.get("bear-cache")
    if cache is None:
        return ""
    otu = cache["on_time_utility"]
    parts = []
    blind = by.get("bear")
    if blind is not None:
        parts.append(
            f"bear-cache vs bear {_gain(otu, blind['on_time_utility'])} "
            f"(bear on time {100 * blind['slo_attainment']:.1f} %)"
        )
    base = [r for p, r in by.items() if p not in ("bear-cache", "bear")]
    if base:
        best = max(base, key=lambda r: r["on_time_utility"])
        gain = _gain(otu, best["on_time_utility"])
        parts.append(f"vs the best baseline, {best['policy']}, {gain}")
    return "; ".join(parts)


def _gain(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f} %" if b > 0 else "n/a"


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``prefix-routing`` benchmark."""
    from bearsdk.selectors.bear import AFFINITY_RULES, OVERLOAD_RULES
    from bearsdk.sim.prefix import PREFIX_POLICIES

    p = bsub.add_parser(
        "prefix-routing",
        help="simulated agent sessions on prefix-caching engines: BEAR with and without the "
        "cache against prefix-aware baselines",
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=None,
        help="sessions/s (default 8,12,16), or requests/s for mooncake (default 1,2,3)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=list(PREFIX_POLICIES),
        help=f"comma-separated (default: {','.join(PREFIX_POLICIES)})",
    )
    p.add_argument(
        "--duration", type=positive_int, default=30, help="seconds of session starts per run"
    )
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    p.add_argument(
        "--workload",
        choices=("agents", "mooncake"),
        default="agents",
        help="agent sessions (default) or the Mooncake conversation trace",
    )
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder holding the public data sets (mooncake/; default: $BEARSDK_DATA, "
        "see docs/data.md)",
    )
    p.add_argument(
        "--no-arrivals",
        action="store_true",
        help="BEA as the paper defines it: no allowance for the prompts still to come",
    )
    p.add_argument(
        "--overload",
        choices=OVERLOAD_RULES,
        default="least-requests",
        help="where both BEAR policies send a turn no instance is predicted to serve on "
        "time (default least-requests; lowest-ttft: the paper's)",
    )
    p.add_argument(
        "--affinity",
        choices=AFFINITY_RULES,
        default="none",
        help="both BEAR policies' affinity (home: a turn stays where its session's prefix "
        "is cached when that is predicted on time)",
    )
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
