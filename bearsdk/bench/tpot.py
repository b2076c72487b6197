"""``bearsdk bench tpot``: BEA's TPOT error against an emulated engine, and what it costs.

An emulated vLLM engine (``vllm-v1``, its ground-truth time model with noise,
in real time) serves a Poisson load with chat-like lengths; every fourth
arrival is a probe, during whose first tokens nothing else arrives. At
every arrival the router's view is the snapshot the engine published just
then; after the run, BEA replays each snapshot on past the new request's
first token (``next_tokens``, default 32) and predicts its mean time per
output token over tokens 1 to 33: the residents' finishes and admissions, the
prefill chunks that join its decode batches, and a preemption all shape it.
Three predictions:

* ``oracle``: the snapshot with the residents' true output lengths;
* ``predicted``: the same snapshot without them, the lengths from a mean
  predictor fitted to the workload (what a router without lengths has);
* ``router``: ``oracle`` with the prefills still to come folded in as the
  router folds them (``docs/tpot.md``): the eq. 12 prefill its dispatches of
  the last 10 s brought per second, ``rho``, stretches TPOT by ``1 / (1 - rho)``.

The truth is the engine's own: the end of the emulated GPU batch that computed
each token, less any time the GPU idled because the host loop was late (a
loaded machine, not the modelled hardware). The score is the mean absolute
percentage error of the mean inter-token time over three sets: the probes
(nothing arrived while they streamed, by construction: the replay itself, as
the vLLM oracle cases isolate it, in the states the load left), every request
whose tokens no later arrival touched, and every request. A request arriving
while another produces its first tokens adds its prefill to that one's
batches, which no snapshot taken before it arrived can know (the report gives
the mean error by the number of such arrivals). Also: how often the replay's
first-token batch is the engine's.

``--cost`` times the replay alone on those snapshots: the TTFT-only replay
against the one that follows ``next_tokens`` more (medians, p99s and their
ratio, one run).
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
import time
from typing import Any

import anyio

from bearsdk.bench import Timing, loop_line, loop_report
from bearsdk.bench.prefix import wait_published
from bearsdk.cli import positive_float, positive_int

__all__ = ["register", "run"]

KINDS = ("oracle", "predicted", "router")


PROBE_EVERY = 4
"""Every fourth arrival is a probe: the load waits while it streams its tokens."""


async def _run(
    requests: int, rate: float, next_tokens: int, seed: int, profile: str
) -> dict[str, Any]:
    from bearsdk.emulator import EmulatedEngine, EngineConfig

    cfg = EngineConfig(
        profile=profile,
        params={"max_num_seqs": 64},
        publish_output_len=True,
        serve_http=False,
        seed=seed,
    )
    rng = random.Random(seed)
    runs: list[tuple[Any, int, int, Any]] = []
    probes: set[int] = set()
    async with EmulatedEngine(cfg) as eng:
        policy = eng.policy
        bt = eng.calibrated_batch_time()

        async def one(i: int, prompt: int, out: int, streamed: anyio.Event | None) -> None:
            await wait_published(eng)
            pub = eng.captured_snapshot
            # Same task, no await: the request arrives in exactly that state.
            h = eng.submit_tokens(prompt, out, max_tokens=out, request_id=f"r{i}")
            runs.append((pub, prompt, out, h))
            if streamed is not None:
                probes.add(id(h))
                while h.produced < 1 + next_tokens and not h.done:
                    await h.changed()
                streamed.set()
            await h.result()

        async with anyio.create_task_group() as tg:
            for i in range(requests):
                prompt = rng.randint(64, 2000)
                out = rng.randint(1 + next_tokens, 4 * (1 + next_tokens))
                probe = anyio.Event() if i % PROBE_EVERY == PROBE_EVERY - 1 else None
                tg.start_soon(one, i, prompt, out, probe)
                if probe is not None:
                    # Nothing arrives while a probe streams its tokens: its TPOT is
                    # the state's, which the replay sees (the oracle cases' isolation).
                    await probe.wait()
                await anyio.sleep(rng.expovariate(rate))
        lag = eng.loop_stats()
        rows = [_row(eng, pub, p, o, h, next_tokens) for pub, p, o, h in runs]
        for r, (*_, h) in zip(rows, runs, strict=True):
            r["probe"] = id(h) in probes
    arrivals = sorted(r["arrival"] for r in rows)
    for r in rows:
        a, b = r.pop("window")
        # Requests that arrived while this one produced its tokens: their
        # prefills joined its batches, which no snapshot taken before could know.
        r["later"] = bisect.bisect_right(arrivals, b) - bisect.bisect_left(arrivals, a)
    mean_out = statistics.fmean(r["out"] for r in rows)
    _predict(rows, policy, bt, next_tokens, mean_out)
    _with_arrivals(rows, bt)
    report = _report(rows, profile, requests, rate, next_tokens, lag)
    report["_model"] = (policy, bt)
    return report


def _row(eng: Any, pub: Any, prompt: int, out: int, h: Any, next_tokens: int) -> dict[str, Any]:
    ends = h.token_ends[: 1 + next_tokens]
    idle = eng.idle_between(ends[0], ends[-1])
    # The batch in flight at capture ran on until the request arrived.
    age = h.arrival - pub.captured_at
    return {
        "pub": pub,
        "prompt": prompt,
        "out": out,
        "age": age,
        "tpot": (ends[-1] - ends[0] - idle) / (len(ends) - 1),
        "arrival": h.arrival,
        "window": (ends[0], ends[-1]),
        "first_batch": h.first_token_batch - pub.batches,
    }


def _predict(
    rows: list[dict[str, Any]], policy: Any, bt: Any, next_tokens: int, mean_out: float
) -> None:
    """Each row's predictions, after the run (CPU spent during it would slow the engine)."""
    from bearsdk.estimators.bea import BEAEstimator
    from bearsdk.estimators.length import MeanLengthPredictor
    from bearsdk.snapshot import snapshot_from_dict

    oracle = BEAEstimator(policy, bt)
    mean = max(1, round(mean_out))
    guess = BEAEstimator(policy, bt, length_predictor=MeanLengthPredictor(mean, mean // 4))
    for r in rows:
        doc = r.pop("pub").doc
        snap = snapshot_from_dict(doc)
        blind = snapshot_from_dict(
            {**doc, "requests": [_unknown(q) for q in doc.get("requests", ())]}
        )
        e = oracle.estimate(
            snap, r["prompt"], r["out"], max_tokens=r["out"], next_tokens=next_tokens
        )
        g = guess.estimate(blind, r["prompt"], max_tokens=r["out"], next_tokens=next_tokens)
        r["oracle"] = e.tpot_s
        r["predicted"] = g.tpot_s
        r["batch_ok"] = e.first_token_batch == r["first_batch"]
        r["snapshot"] = snap
        r["inflight"] = e.inflight_s


def _with_arrivals(rows: list[dict[str, Any]], bt: Any) -> None:
    """Each row's ``router`` prediction: the arrivals before it, as the router counts them."""
    from bearsdk.estimators.stats import InstanceStats

    stats = InstanceStats()
    c = bt.coeffs
    for i, r in enumerate(sorted(rows, key=lambda r: r["arrival"])):
        if r["oracle"] is not None:
            rho = min(stats.prefill_load(r["arrival"], c[1], c[3]), 0.9)
            r["router"] = r["oracle"] / (1.0 - rho)
        else:
            r["router"] = None
        stats.on_dispatch(f"r{i}", r["arrival"], r["prompt"])


def _unknown(q: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in q.items() if k != "output_len"}


def _mape(rows: list[dict[str, Any]], key: str) -> float:
    return 100.0 * statistics.fmean(abs(r[key] - r["tpot"]) / r["tpot"] for r in rows)


def _bias(rows: list[dict[str, Any]]) -> float:
    return 100.0 * statistics.fmean((r["oracle"] - r["tpot"]) / r["tpot"] for r in rows)


def _report(
    rows: list[dict[str, Any]],
    profile: str,
    requests: int,
    rate: float,
    next_tokens: int,
    lag: Any,
) -> dict[str, Any]:
    ok = [r for r in rows if all(r[k] is not None for k in KINDS)]
    alone = [r for r in ok if r["later"] == 0]
    probes = [r for r in ok if r["probe"]]
    tp = sorted(r["tpot"] for r in ok)
    return {
        "profile": profile,
        "requests": requests,
        "rate": rate,
        "next_tokens": next_tokens,
        "scored": len(ok),
        "tpot_ms": {
            "median": round(1e3 * statistics.median(tp), 3),
            "p10": round(1e3 * tp[len(tp) // 10], 3),
            "p90": round(1e3 * tp[(9 * len(tp)) // 10], 3),
        },
        "mape_pct": {k: round(_mape(ok, k), 2) for k in KINDS},
        # The replay's own accuracy: requests whose tokens no later arrival
        # touched (the snapshot then decides them; the oracle cases' isolation).
        # Probes: nothing arrived while they streamed, by construction.
        "probes": len(probes),
        "mape_pct_probes": {k: round(_mape(probes, k), 2) for k in KINDS} if probes else None,
        "isolated": len(alone),
        "mape_pct_isolated": {k: round(_mape(alone, k), 2) for k in KINDS} if alone else None,
        "bias_pct_by_later_arrivals": {
            str(n): round(_bias([r for r in ok if min(r["later"], 3) == n]), 2)
            for n in range(4)
            if any(min(r["later"], 3) == n for r in ok)
        },
        "first_token_batch_exact_pct": round(
            100.0 * statistics.fmean(r["batch_ok"] for r in ok), 1
        ),
        "loop": loop_report(lag),
        "_rows": ok,
    }


def cost(rows: list[dict[str, Any]], policy: Any, bt: Any, next_tokens: int) -> dict[str, Any]:
    """Replay time of each snapshot for its request: TTFT only, and on ``next_tokens`` more."""
    from bearsdk.estimators.bea import BEAEstimator

    est = BEAEstimator(policy, bt)
    coeffs = est.replay_coeffs
    clock = time.perf_counter_ns
    t1: list[float] = []
    tk: list[float] = []
    for r in rows:
        prep = est.prepare(r["snapshot"])
        rep, state = prep.replayer, prep.state
        for _ in range(3):
            a = clock()
            rep.replay(state, r["prompt"], r["out"], coeffs, max_tokens=r["out"])
            b = clock()
            rep.replay(
                state, r["prompt"], r["out"], coeffs, max_tokens=r["out"], next_tokens=next_tokens
            )
            c = clock()
            t1.append((b - a) / 1e3)
            tk.append((c - b) / 1e3)

    return {
        "ttft_only": Timing(t1).as_dict(),
        "with_tpot": Timing(tk).as_dict(),
        "ratio_median": round(statistics.median(tk) / statistics.median(t1), 2),
    }


def run(
    requests: int = 300,
    rate: float = 6.0,
    next_tokens: int = 32,
    seed: int = 1,
    profile: str = "qwen3-8b-h100",
) -> dict[str, Any]:
    """Run the experiment; return the TPOT MAPEs (:data:`KINDS`).

    The report's private ``_rows`` (the scored requests) and ``_model`` (the
    engine's policy and calibrated coefficients) feed :func:`cost`.
    """
    return anyio.run(_run, requests, rate, next_tokens, seed, profile)


def _main(args: argparse.Namespace) -> int:
    report = run(args.requests, args.rate, args.next_tokens, args.seed, args.profile)
    rows = report.pop("_rows")
    policy, bt = report.pop("_model")
    if args.cost:
        report["cost"] = cost(rows, policy, bt, args.next_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["mape_pct"]
    t = report["tpot_ms"]
    print(
        f"BEA TPOT over tokens 1-{1 + report['next_tokens']}, emulator ({report['profile']}, "
        f"{report['rate']} req/s Poisson, {report['scored']} requests; observed TPOT p10/p50/p90 "
        f"{t['p10']}/{t['median']}/{t['p90']} ms)"
    )
    print(
        f"  MAPE  oracle lengths {m['oracle']:6.2f} %   predicted lengths {m['predicted']:6.2f} %"
        f"   with the arrivals to come (the router's) {m['router']:6.2f} %"
    )
    pr = report["mape_pct_probes"]
    if pr:
        print(
            f"  MAPE on the {report['probes']} probes (nothing arrived while they streamed): "
            f"oracle lengths {pr['oracle']:6.2f} %   predicted lengths {pr['predicted']:6.2f} %"
        )
    iso = report["mape_pct_isolated"]
    if iso:
        print(
            f"  MAPE on the {report['isolated']} requests no later arrival touched: oracle "
            f"lengths {iso['oracle']:6.2f} %   predicted lengths {iso['predicted']:6.2f} %"
        )
    by = ", ".join(
        f"{'3+' if n == '3' else n}: {v:+.1f} %"
        for n, v in report["bias_pct_by_later_arrivals"].items()
    )
    print(f"  mean error by arrivals during its tokens (oracle lengths): {by}")
    print(f"  first-token batch exact: {report['first_token_batch_exact_pct']} %")
    print(loop_line(report["loop"]))
    if "cost" in report:
        c = report["cost"]
        print(
            f"  replay cost: TTFT only p50 {c['ttft_only']['median_us']} us "
            f"(p99 {c['ttft_only']['p99_us']}), with {report['next_tokens']} more tokens p50 "
            f"{c['with_tpot']['median_us']} us (p99 {c['with_tpot']['p99_us']}): "
            f"x{c['ratio_median']}"
        )
    sys.stdout.flush()
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``tpot`` benchmark."""
    p = bsub.add_parser("tpot", help="BEA TPOT MAPE on the emulator, and its replay cost")
    p.add_argument("--requests", type=positive_int, default=300, help="requests to send")
    p.add_argument("--rate", type=positive_float, default=6.0, help="arrivals per second")
    p.add_argument("--next-tokens", type=positive_int, default=32, help="tokens after the first")
    p.add_argument("--seed", type=int, default=1, help="workload and engine seed")
    p.add_argument("--profile", default="qwen3-8b-h100", help="emulator profile")
    p.add_argument("--cost", action="store_true", help="also time the replay (TTFT only vs TPOT)")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.set_defaults(func=_main)
