#!/usr/bin/env python3
"""Replay vLLM's prefix-caching cases (``apc_cases.py``) from their snapshots and compare.

Each case's snapshot is vLLM 0.33's own scheduler state with its block pool
(``kv.prefix_cache``): it must pass bearsdk's validation, and the replay from
it (the new request's content keys looked up at its admission) must form
vLLM's batches up to the new request's first token: each request's tokens and
the context they start from, so eq. 12 prices the same batches.

    python tests/oracle/apc_replay.py /tmp/apc_cases.jsonl [--quiet]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator
from typing import Any, cast

from bearsdk.replay import implementations
from bearsdk.replay._replay_py import Replayer as PyReplayer
from bearsdk.replay.requests import CachedReq, PolicyGeometry, Req
from bearsdk.replay.scheduler import SchedulerCore
from bearsdk.replay.types import ReplayResult
from bearsdk.schedulers import bind_scheduler
from bearsdk.snapshot import snapshot_from_dict

try:
    from oracle.apc_live import vllm_v1_params
except ImportError:  # run as a script: this folder, not tests/, is on the path
    from apc_live import vllm_v1_params  # type: ignore[no-redef]


# Eq. 12 coefficients (seconds) for comparing the twins' sums.
COEFFS = (3e-3, 2e-5, 4e-8, 1e-9)


def _policy(cfg: dict[str, Any]) -> Any:
    return bind_scheduler("vllm-v1", vllm_v1_params(cfg))


def replay_batches(case: dict[str, Any]) -> list[dict[str, list[int]]]:
    """The replay's batches up to the new request's first token: ``{id: [tokens, context]}``.

    The pure twin's loop (``Replayer.replay``) run by hand, so that each
    request's context before its chunk can be read (eq. 12's terms).
    """
    cfg = case["config"]
    snap = snapshot_from_dict(case["snapshot"])
    assert snap.kv is not None
    rp = PyReplayer(_policy(cfg))
    prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    geo = PolicyGeometry(rp.policy)
    core = SchedulerCore.from_prepared(geo, prep)
    new = case["new"]
    cls = CachedReq if core.pool is not None else Req
    r = geo.make_req(new["id"], new["prompt_tokens"], 0, new["output_len"], new["max_tokens"], cls)
    if core.pool is not None:
        cast(CachedReq, r).keys = list(new["prefix_keys"])
    core.waiting.append(r)
    out: list[dict[str, list[int]]] = []
    for _ in range(100_000):
        b = core.schedule()
        if b.sched:
            out.append({q.rid: [n, q.computed - n] for q, n in b.sched.items()})
            if r in b.sampled:
                return out
        core.queue.append(b)
        if len(core.queue) >= geo.depth:
            core.process(core.queue.popleft())
    raise RuntimeError("no first token within 100,000 schedule() calls")


def replays(case: dict[str, Any], **kw: Any) -> Iterator[tuple[str, ReplayResult]]:
    """Each replay implementation's ``replay`` of ``case`` (its batches recorded)."""
    cfg, new = case["config"], case["new"]
    snap = snapshot_from_dict(case["snapshot"])
    assert snap.kv is not None
    for impl, make in implementations().items():
        rp = make(_policy(cfg))
        prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        res = rp.replay(
            prep,
            new["prompt_tokens"],
            new["output_len"],
            COEFFS,
            record=True,
            max_tokens=new["max_tokens"],
            prefix_keys=new["prefix_keys"] or None,
            **kw,
        )
        yield impl, res


def check(case: dict[str, Any]) -> str | None:
    """The first difference between vLLM's batches and the replay's, or ``None``."""
    got = replay_batches(case)
    want = case["vllm_batches"]
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        if w != g:
            return f"batch {i + 1}: vllm={w} bearsdk={g}"
    if len(want) != len(got):
        return f"first token: vllm batch {len(want)}, bearsdk {len(got)}"
    # Each twin's entry point agrees with the loop run by hand: the same
    # batches (tokens by request, eq. 12 terms) and the same TTFT to the bit.
    ref = None
    for impl, res in replays(case):
        if res.first_token_batch != len(want):
            got_k = res.first_token_batch
            return f"{impl} Replayer.replay: first token at {got_k}, vllm {len(want)}"
        assert res.batches is not None
        # The counted compiled loop (APC off) records no tokens by request and
        # sums runs of equal batches in closed form: its TTFT may differ in the
        # last bits (the issue allows 1e-9 s).
        toks = [b.tokens_by_request for b in res.batches if b.tokens_by_request is not None]
        if ref is None:
            ref = (res, toks)
        elif (toks and (res != ref[0] or toks != ref[1] or res.ttft_s != ref[0].ttft_s)) or abs(
            res.ttft_s - ref[0].ttft_s
        ) > 1e-9:
            return f"{impl} Replayer.replay differs from the pure twin's"
    return None


def load(path: str) -> list[dict[str, Any]]:
    """Cases from a JSON-lines file (gzipped when it ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    """Check every case; exit 1 if one differs."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--write-sample", metavar="OUT.jsonl.gz", help="keep a sample for CI")
    ap.add_argument(
        "--per-kind", type=int, default=3, help="sample cases per workload kind and config"
    )
    a = ap.parse_args(argv)
    cases = load(a.cases)
    by_config: dict[str, list[int]] = {}
    bad = 0
    for case in cases:
        try:
            diff = check(case)
        except Exception as e:
            diff = f"{type(e).__name__}: {e}"
        tally = by_config.setdefault(case["name"].split("@")[1].split("#")[0], [0, 0])
        tally[0] += diff is None
        tally[1] += 1
        if diff:
            bad += 1
            print(f"DIFF {case['name']}: {diff}"[:400])
        elif not a.quiet:
            print(f"ok   {case['name']}: {len(case['vllm_batches'])} batches")
    for name, (ok, total) in sorted(by_config.items()):
        print(f"{name:16s} {ok}/{total}")
    print(f"{len(cases) - bad}/{len(cases)} cases: first-token batch and every batch as vLLM's")
    if a.write_sample and not bad:
        kept: dict[str, int] = {}
        with gzip.open(a.write_sample, "wt") as f:
            for case in cases:
                c = case["name"].split("/")[0] + "@" + case["name"].split("@")[1].split("#")[0]
                if kept.get(c, 0) < a.per_kind:
                    kept[c] = kept.get(c, 0) + 1
                    f.write(json.dumps(case, separators=(",", ":")) + "\n")
        print(f"kept {sum(kept.values())} cases in {a.write_sample}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
