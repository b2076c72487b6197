#!/usr/bin/env python3
"""Replay cases with prefix caching, taken from vLLM 0.33's real scheduler.

Each case runs a seeded token-id workload (``apc_workloads``) through vLLM's
scheduler (``apc_drive.Driver``) up to a random step, exports the scheduler's
state there as a ``bear.snapshot/1`` document with the ``kv.prefix_cache``
extension (``docs/contracts.md``), adds a new request that shares a prefix
with the workload (a cut of one of its prompts, plus new tokens), stops every
later arrival, and records vLLM's batches from that step to the new request's
first token: each request's tokens and the context they start from (what
eq. 12 prices). ``apc_replay.py`` (bearsdk's environment) replays each case
from its snapshot and compares. Runs under the vllm-oracle's virtualenv.

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/apc_cases.py --per-run 4 --seeds 4 \\
        --mooncake $BEARSDK_DATA/mooncake/conversation_trace.jsonl --out /tmp/apc_cases.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import apc_drive  # noqa: E402
import apc_sweep  # noqa: E402

KEY_MASK = (1 << 63) - 1


def key_of(h: bytes) -> int:
    """A vLLM block hash as a bear.snapshot content key: its last 8 bytes (the
    publisher's ``key_of``; vLLM's KV events send them as the int hash)."""
    return int.from_bytes(bytes(h)[-8:], "big") & KEY_MASK


def key_of_grouped(h: bytes) -> int:
    """:func:`key_of` of a hash with its 4-byte group id appended (the pool map's keys)."""
    return int.from_bytes(bytes(h)[-12:-4], "big") & KEY_MASK


def _runs(ix: list[int]) -> list[list[int]]:
    # bearsdk.prefix_cache.runs, again: this script runs where bearsdk is not installed.
    out: list[list[int]] = []
    for i in ix:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


def export(sched: Any, output_len: dict[str, int]) -> dict[str, Any]:
    """The scheduler's state right before ``schedule()``, as a snapshot with its block pool."""
    mgr = sched.kv_cache_manager
    pool = mgr.block_pool
    single = mgr.coordinator.single_type_managers[0]
    bs = single.block_size
    entries: list[tuple[int, int]] = []  # (block id, key), the map's order
    for k, v in pool.cached_block_hash_to_block._cache.items():
        for b in v.values() if isinstance(v, dict) else (v,):
            entries.append((b.block_id, key_of_grouped(k)))
    index = {b: j for j, (b, _) in enumerate(entries)}
    keys = [k for _, k in entries]
    by_value: dict[int, int] = {}
    for j, k in enumerate(keys):
        by_value.setdefault(k, j)
    free: list[int] = []
    for b in pool.free_block_queue.get_all_free_blocks():
        if b.block_hash is not None:
            free.append(index[b.block_id])
        elif free and free[-1] < 0:
            free[-1] -= 1
        else:
            free.append(-1)
    reqs = []
    order = [(r, "running") for r in sched.running] + [(r, "waiting") for r in sched.waiting]
    for r, state in order:
        d: dict[str, Any] = {
            "id": r.request_id,
            "state": state,
            "prompt_tokens": r.num_prompt_tokens,
            "computed_tokens": r.num_computed_tokens if state == "running" else 0,
            "output_tokens": r.num_output_tokens,
            "max_tokens": r.sampling_params.max_tokens,
            "output_len": output_len[r.request_id],
        }
        if state == "running" and r.num_output_placeholders:
            d["placeholders"] = r.num_output_placeholders
        held = list(single.req_to_blocks.get(r.request_id, ())) if state == "running" else []
        cached = single.num_cached_block.get(r.request_id, 0) if held else 0
        mine = [index[b.block_id] for b in held[:cached]]
        if mine:
            d["blocks"] = _runs(mine)
        if len(held) > cached:
            d["uncached_blocks"] = len(held) - cached
        known = r.num_tokens // bs
        chain = []
        for h in list(r.block_hashes)[len(mine) : known]:
            k = key_of(h)
            j = by_value.get(k)
            if j is None:
                j = by_value[k] = len(keys)
                keys.append(k)
            chain.append(j)
        if chain:
            d["chain"] = _runs(chain)
        reqs.append(d)
    return {
        "schema": "bear.snapshot/1",
        "instance": "vllm",
        "seq": 1,
        "time": 0.0,
        "kv": {
            "block_size": bs,
            "num_blocks": pool.num_gpu_blocks,
            "free_blocks": pool.get_num_free_blocks(),
            "prefix_cache": {"keys": keys, "cached": len(entries), "free": free},
        },
        "requests": reqs,
    }


def one_case(
    cfg: dict[str, Any],
    workload: list[dict[str, Any]],
    at: int,
    new: dict[str, Any],
    follow: bool = False,
) -> dict[str, Any] | None:
    """Run to step ``at``, snapshot, add ``new``, run to its first token.

    With ``follow``, run on until it finishes and also record the batch (from
    the snapshot, 1-based) of each token vLLM sampled for it: ``token_batches``,
    with ``vllm_batches`` up to the last (``tpot_cases.py``).
    """
    lengths = {r["id"]: r["output_len"] for r in workload}
    lengths[new["id"]] = new["output_len"]
    got: dict[str, Any] = {}
    token_steps: list[int] = []

    def before(d: apc_drive.Driver) -> None:
        if got or d.step < at:
            return
        got["snapshot"] = export(d.sched, lengths)
        got["step"] = d.step
        d.timed.clear()
        d.dependents.clear()
        d.spec[new["id"]] = new
        d.order[new["id"]] = len(d.order)
        req = d._make_request(new["id"])
        d.sched.add_request(req)
        got["prefix_keys"] = [key_of(h) for h in req.block_hashes]

    def contexts(d: apc_drive.Driver, so: Any, rec: dict[str, Any]) -> None:
        # Each request's context before its chunk: with the tokens, what eq. 12 needs.
        rec["ctx"] = {
            rid: d.sched.requests[rid].num_computed_tokens - n
            for rid, n in so.num_scheduled_tokens.items()
        }
        rid = new["id"]
        # The fake model samples a token for every scheduled request whose prompt
        # (or recompute) is complete: the same test as the driver's _fabricate.
        if rid in so.num_scheduled_tokens and not d.sched.requests[rid].is_prefill_chunk:
            token_steps.append(rec["step"])

    d = apc_drive.Driver(cfg, workload, before_schedule=before, on_schedule=contexts)
    done = d.finish if follow else d.first_token
    while d.iterate():
        if new["id"] in done or d.calls > 200_000:
            break
    d_done = done.get(new["id"])
    if not got or d_done is None:
        return None
    k0 = got["step"]
    last = token_steps[-1] if follow else d_done
    batches = [
        {rid: [n, rec["ctx"][rid]] for rid, n in rec["sched"].items()}
        for rec in d.trace
        if k0 <= rec["step"] <= last
    ]
    case: dict[str, Any] = {
        "config": d.cfg,
        "snapshot": got["snapshot"],
        "new": {
            "id": new["id"],
            "prompt_tokens": len(new["prompt"]),
            "output_len": new["output_len"],
            "max_tokens": new["output_len"],
            "prefix_keys": got["prefix_keys"],
        },
        "vllm_batches": batches,
    }
    if follow:
        case["token_batches"] = [st - k0 + 1 for st in token_steps]
    return case


NewRequest = Callable[[random.Random, dict[str, Any], dict[str, Any], int], dict[str, Any]]
"""Draws case ``j``'s new request from a workload request and the engine config."""


def write_cases(
    out: str,
    workloads: list[tuple[str, list[dict[str, Any]]]],
    configs: dict[str, dict[str, Any]],
    per_run: int,
    new_request: NewRequest,
    salt: str = "",
    follow: bool = False,
) -> tuple[int, int]:
    """Run every workload under every config, ``per_run`` cases each: ``(written, skipped)``."""
    n = skipped = 0
    with open(out, "w") as f:
        for wname, w in workloads:
            for cname, cfg in configs.items():
                try:
                    full = apc_drive.Driver(cfg, w).run()
                except (RuntimeError, ValueError):
                    skipped += 1
                    continue
                steps = len(full["trace"])
                rng = random.Random(f"{salt}{wname}@{cname}")
                for j in range(per_run):
                    new = new_request(rng, rng.choice(w), cfg, j)
                    at = rng.randint(0, max(0, int(steps * 0.8)))
                    try:
                        case = one_case(cfg, w, at, new, follow)
                    except (RuntimeError, ValueError):
                        case = None
                    if case is None:
                        skipped += 1
                        continue
                    case["name"] = f"{wname}@{cname}#{j}"
                    f.write(json.dumps(case) + "\n")
                    n += 1
    return n, skipped


def _new_request(
    rng: random.Random, src: dict[str, Any], cfg: dict[str, Any], j: int
) -> dict[str, Any]:
    """A cut of a workload prompt plus new tokens, a short answer."""
    bs = {**apc_drive.DEFAULTS, **cfg}["block_size"]
    cut = rng.choice([len(src["prompt"]), rng.randint(1, len(src["prompt"]))])
    cut = min(cut, 1500)
    tail = [rng.randrange(10, 1000) for _ in range(rng.choice([1, bs, 40, 200]))]
    out = rng.randint(1, 8)
    return {
        "id": f"new{j}",
        "arrival_step": 0,
        "prompt": src["prompt"][:cut] + tail,
        "output_ids": [rng.randrange(10, 1000) for _ in range(out)],
        "output_len": out,
    }


def main(argv: list[str] | None = None) -> int:
    """Write cases as JSON lines: every workload kind x seed x config, several steps each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--per-run", type=int, default=4, help="cases per workload and config")
    ap.add_argument("--mooncake", help="Mooncake JSONL with hash_ids")
    ap.add_argument("--configs", default=",".join(apc_sweep.CONFIGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    configs = {c: apc_sweep.CONFIGS[c] for c in a.configs.split(",")}
    n, skipped = write_cases(
        a.out, apc_sweep.workloads(a.seeds, a.mooncake), configs, a.per_run, _new_request
    )
    print(f"{n} cases ({skipped} skipped) in {time.monotonic() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
