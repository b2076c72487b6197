#!/usr/bin/env python3
"""Token-by-token cases from vLLM 0.33's real scheduler: the batch of each output token.

Ground truth for the replay's TPOT (issue 21): each case runs a seeded
workload through vLLM's scheduler (``apc_drive.Driver``) up to a random step,
exports the scheduler's state there as a ``bear.snapshot/1`` document (with
``kv.prefix_cache`` when prefix caching is on), adds a new request, stops every
later arrival, and runs on until the new request finishes. It records the
1-based batch index, counted from the snapshot as the replay counts it, of
every token vLLM samples for the new request (in async mode the batch that
computes the token, as for the first token), and vLLM's batches up to its
last token. ``tpot_check.py`` (bearsdk's environment) replays each case with
``next_tokens`` and compares. Runs under the vllm-oracle's virtualenv.

Workloads: the prefix-caching generators (agent sessions, shared system
prompts, few-shot bursts) and plain random prompts; engine configs: those of
``apc_sweep.CONFIGS`` (roomy, scarce KV with preemptions, async, a long-prefill
threshold, a watermark, block size 32, chunked prefill off, APC off) and
three starved pools in which the new request is preempted past its first
token and recomputes.

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/tpot_cases.py --seeds 3 --per-run 4 \\
        --out /tmp/tpot_cases.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import apc_cases  # noqa: E402
import apc_drive  # noqa: E402
import apc_sweep  # noqa: E402
import apc_workloads  # noqa: E402

# Beyond apc_sweep's: KV so scarce that the newest request (the new one, past
# its first token) is the preemption victim, sync and async.
CONFIGS: dict[str, dict[str, Any]] = {
    **apc_sweep.CONFIGS,
    "starved": {"num_blocks": 64},
    "starved-async": {"num_blocks": 64, "use_async": True},
    "starved-apc-off": {"num_blocks": 64, "prefix_caching": False, "use_async": True},
}


def plain(seed: int, n: int = 24) -> list[dict[str, Any]]:
    """Unrelated prompts (no shared prefix) with long outputs, arriving over 30 steps."""
    rng = random.Random(f"plain-{seed}")
    return [
        apc_workloads._req(
            f"p{i}",
            apc_workloads._tokens(rng, rng.randint(16, 700)),
            apc_workloads._tokens(rng, rng.randint(1, 90)),
            arrival_step=rng.randint(0, 30),
        )
        for i in range(n)
    ]


def workloads(seeds: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(name, workload)``: every prefix-caching generator and the plain one, per seed."""
    out = apc_sweep.workloads(seeds, None)
    for seed in range(seeds):
        out.append((f"plain/{seed}", plain(3000 + seed)))
    return out


def one_case(
    cfg: dict[str, Any], workload: list[dict[str, Any]], at: int, new: dict[str, Any]
) -> dict[str, Any] | None:
    """Run to step ``at``, snapshot, add ``new``, run until ``new`` finishes."""
    lengths = {r["id"]: r["output_len"] for r in workload}
    lengths[new["id"]] = new["output_len"]
    got: dict[str, Any] = {}
    token_steps: list[int] = []

    def before(d: apc_drive.Driver) -> None:
        if got or d.step < at:
            return
        got["snapshot"] = apc_cases.export(d.sched, lengths)
        got["step"] = d.step
        d.timed.clear()
        d.dependents.clear()
        d.spec[new["id"]] = new
        d.order[new["id"]] = len(d.order)
        req = d._make_request(new["id"])
        d.sched.add_request(req)
        got["prefix_keys"] = [apc_cases.key_of(h) for h in req.block_hashes]

    def on_schedule(d: apc_drive.Driver, so: Any, rec: dict[str, Any]) -> None:
        rec["ctx"] = {
            rid: d.sched.requests[rid].num_computed_tokens - n
            for rid, n in so.num_scheduled_tokens.items()
        }
        rid = new["id"]
        # The fake model samples a token for every scheduled request whose
        # prompt (or recompute) is complete: the same test as its _fabricate.
        if rid in so.num_scheduled_tokens and not d.sched.requests[rid].is_prefill_chunk:
            token_steps.append(rec["step"])

    d = apc_drive.Driver(cfg, workload, before_schedule=before, on_schedule=on_schedule)
    while d.iterate():
        if new["id"] in d.finish or d.calls > 200_000:
            break
    if not got or new["id"] not in d.finish:
        return None
    k0 = got["step"]
    last = token_steps[-1]
    batches = [
        {rid: [n, rec["ctx"][rid]] for rid, n in rec["sched"].items()}
        for rec in d.trace
        if k0 <= rec["step"] <= last
    ]
    return {
        "config": d.cfg,
        "snapshot": got["snapshot"],
        "new": {
            "id": new["id"],
            "prompt_tokens": len(new["prompt"]),
            "output_len": new["output_len"],
            "max_tokens": new["output_len"],
            "prefix_keys": got["prefix_keys"] if d.cfg["prefix_caching"] else [],
        },
        "token_batches": [s - k0 + 1 for s in token_steps],
        "vllm_batches": batches,
    }


def main(argv: list[str] | None = None) -> int:
    """Write cases as JSON lines: every workload x config, several snapshots each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--per-run", type=int, default=4, help="cases per workload and config")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    n = skipped = 0
    with open(a.out, "w") as f:
        for wname, w in workloads(a.seeds):
            for cname in a.configs.split(","):
                cfg = CONFIGS[cname]
                try:
                    full = apc_drive.Driver(cfg, w).run()
                except (RuntimeError, ValueError):
                    skipped += 1
                    continue
                steps = len(full["trace"])
                rng = random.Random(f"tpot:{wname}@{cname}")
                for j in range(a.per_run):
                    src = rng.choice(w)
                    cut = min(rng.randint(1, len(src["prompt"])), 1200)
                    tail = apc_workloads._tokens(rng, rng.choice([1, 16, 40, 200]))
                    out = rng.choice([1, 2, 8, 33, 40, 64, 120])
                    new = {
                        "id": f"new{j}",
                        "arrival_step": 0,
                        "prompt": src["prompt"][:cut] + tail,
                        "output_ids": apc_workloads._tokens(rng, out),
                        "output_len": out,
                    }
                    at = rng.randint(0, max(0, int(steps * 0.8)))
                    try:
                        case = one_case(cfg, w, at, new)
                    except (RuntimeError, ValueError):
                        case = None
                    if case is None:
                        skipped += 1
                        continue
                    case["name"] = f"{wname}@{cname}#{j}"
                    f.write(json.dumps(case) + "\n")
                    n += 1
    print(f"{n} cases ({skipped} skipped) in {time.monotonic() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
