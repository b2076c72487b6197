#!/usr/bin/env python3
"""Check the prefix-caching facts of docs/prefix-caching.md against vLLM 0.33.

Each probe drives vLLM's real V1 scheduler (through apc_drive.Driver) on a
small crafted workload, or on a seeded apc_workloads workload for the
invariants, and prints ``PASS`` or ``FAIL`` with the probe id that the doc's
headings name. Exits 1 if any probe fails. Runs under the oracle virtualenv:

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/apc_probe.py [--only ID ...] [-v]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import apc_drive
import apc_workloads

BS = 16
SHADOW_SEEDS = [3, 4, 5, 6]
PROBES: dict[str, Callable[[], list[str]]] = {}


def probe(pid: str):
    """Register a probe; it returns a list of failure messages (empty: PASS)."""

    def wrap(fn):
        PROBES[pid] = fn
        return fn

    return wrap


def tok(seed: int, n: int) -> list[int]:
    """``n`` token ids, distinct across seeds with overwhelming probability."""
    return apc_workloads._tokens(apc_workloads.random.Random(f"probe-{seed}"), n)


def req(rid, prompt, out_len=1, arrival=None, after=None):
    """A workload request; the sampled ids never matter to these probes."""
    outs = tok(10_000 + len(rid) * 7 + sum(map(ord, rid)), out_len)
    if arrival is None and after is None:
        arrival = 0
    return apc_workloads._req(rid, prompt, outs, arrival_step=arrival, after=after)


def driver(cfg: dict[str, Any], workload, **hooks) -> apc_drive.Driver:
    """An apc_drive.Driver with block size ``BS`` and ``cfg`` over the defaults."""
    return apc_drive.Driver({"block_size": BS, **cfg}, workload, **hooks)


def block_ids(d: apc_drive.Driver, rid: str) -> list[int]:
    """The request's block table (empty once it is freed)."""
    return list(d.sched.kv_cache_manager.get_block_ids(rid)[0])


def free_queue(d: apc_drive.Driver) -> list[int]:
    """Block ids of vLLM's free queue, front (next popped) first."""
    return [b.block_id for b in d.pool.free_block_queue.get_all_free_blocks()]


def hashed_prefix(d: apc_drive.Driver, rid: str) -> int:
    """Leading blocks of the request that carry a block hash."""
    k = 0
    for i in block_ids(d, rid):
        if d.pool.blocks[i].block_hash is None:
            break
        k += 1
    return k


def cached_run(d: apc_drive.Driver, request) -> int:
    """Leading block hashes of ``request`` present in the cache (pure lookup)."""
    k = 0
    for h in request.block_hashes:
        if d.pool.get_cached_block(h, [0]) is None:
            break
        k += 1
    return k


def pure_hit(d: apc_drive.Driver, request) -> int:
    """What get_computed_blocks would return now, without touching anything."""
    _, n, _ = d.sched.kv_cache_manager.coordinator.find_longest_cache_hit(
        request.block_hashes, request.num_tokens - 1
    )
    return n


def first_admission(res, rid):
    """``(step, hit)`` of the request's first admission."""
    return res["admissions"][rid][0]


def check(fails: list[str], cond: bool, msg: str) -> None:
    """Record ``msg`` as a failure unless ``cond``."""
    if not cond:
        fails.append(msg)


# --- probes -------------------------------------------------------------------


@probe("hash-chain")
def p_hash_chain() -> list[str]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1 import request as vreq
    from vllm.v1.core import kv_cache_utils as kcu

    fails: list[str] = []
    d = driver({}, [])
    x = tok(1, 40)

    def mk(rid, prompt):
        return vreq.Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=10, ignore_eos=True),
            pooling_params=None,
            block_hasher=d.hasher,
        )

    r1 = mk("a", x + tok(2, 30))
    r2 = mk("b", x[:32] + tok(3, 38))
    check(fails, len(r1.block_hashes) == 70 // BS, "one hash per full prompt block")
    check(fails, r1.block_hashes[:2] == r2.block_hashes[:2], "equal prefixes, equal hashes")
    check(fails, r1.block_hashes[2] != r2.block_hashes[2], "a differing block differs")
    check(fails, r1.block_hashes[3] != r2.block_hashes[3], "and every block after it")
    toks = list(r1.all_token_ids)
    parent = None
    for i, h in enumerate(r1.block_hashes):
        want = kcu.hash_block_tokens(sha256, parent, toks[i * BS : (i + 1) * BS], None)
        check(fails, h == want, f"block {i}: H(parent, tokens, extra_keys=None)")
        parent = h
    r1.append_output_token_ids(tok(4, 9))
    check(fails, len(r1.block_hashes) == 4, "79 tokens: still 4 hashes")
    r1.append_output_token_ids(tok(5, 1))
    check(fails, len(r1.block_hashes) == 5, "80 tokens: an output-filled block is hashed")
    want = kcu.hash_block_tokens(sha256, r1.block_hashes[3], list(r1.all_token_ids)[64:80], None)
    check(fails, r1.block_hashes[4] == want, "output blocks chain like prompt blocks")
    check(fails, d.sched.hash_block_size == BS, "hash_block_size == block_size")
    return fails


@probe("hit-length")
def p_hit_length() -> list[str]:
    fails: list[str] = []
    x = tok(10, 80)  # five full blocks, all cached by A
    cases = [
        ("aligned-prefix-64", x[:64], 48),
        ("one-past-64", x[:65], 64),
        ("aligned-full-80", x[:80], 64),
        ("x-plus-3", x + tok(11, 3), 80),
        ("diverge-at-40", x[:40] + tok(12, 30), 32),
        ("short-15", x[:15] + tok(13, 40), 0),
        ("exactly-16", x[:16], 0),
        ("17", x[:17], 16),
    ]
    for name, prompt, want in cases:
        wl = [req("A", x), req("B", prompt, after="A")]
        res = driver({}, wl).run()
        step, hit = first_admission(res, "B")
        t = len(prompt)
        run = 0
        for i in range(t // BS):
            if prompt[: (i + 1) * BS] == x[: (i + 1) * BS]:
                run += 1
            else:
                break
        formula = BS * min(run, (t - 1) // BS)
        sched = res["trace"][[r["step"] for r in res["trace"]].index(step)]["sched"]["B"]
        check(fails, hit == want, f"{name}: hit {hit} != {want}")
        check(fails, hit == formula, f"{name}: hit {hit} != bs*min(run,(T-1)//bs)={formula}")
        check(fails, sched == t - hit, f"{name}: scheduled {sched} != T - hit = {t - hit}")
    return fails


@probe("lookup-at-admission")
def p_lookup_at_admission() -> list[str]:
    fails: list[str] = []
    # Grows: B waits behind A (max_num_seqs=1), hits what A filled meanwhile.
    x = tok(20, 128)
    wl = [req("A", x, out_len=3), req("B", x + tok(21, 20))]
    seen: dict[str, int] = {}

    def before(d):
        r = d.sched.requests.get("B")
        if r is not None and "B" not in seen and r.num_computed_tokens == 0:
            seen["B"] = pure_hit(d, r)

    res = driver({"max_num_seqs": 1}, wl, before_schedule=before).run()
    check(fails, seen.get("B") == 0, f"grow: hit at arrival {seen.get('B')} != 0")
    check(fails, first_admission(res, "B")[1] == 128, "grow: hit at admission != 128")
    # Shrinks: C (admitted first) evicts A's cached blocks before B is admitted.
    x = tok(22, 64)
    wl = [
        req("A", x),
        req("C", tok(23, 160), arrival=1),
        req("B", x + tok(24, 8), arrival=1),
    ]
    seen.clear()
    res = driver({"max_num_seqs": 1, "num_blocks": 11}, wl, before_schedule=before).run()
    check(fails, seen.get("B") == 64, f"shrink: hit at arrival {seen.get('B')} != 64")
    check(fails, first_admission(res, "B")[1] == 0, "shrink: hit at admission != 0")
    return fails


@probe("same-step-hit")
def p_same_step_hit() -> list[str]:
    fails: list[str] = []
    x = tok(30, 100)
    for use_async in (False, True):
        wl = [req("A", x), req("B", x + tok(31, 20))]
        res = driver({"max_num_batched_tokens": 120, "use_async": use_async}, wl).run()
        tr = res["trace"][0]
        tag = "async" if use_async else "sync"
        check(fails, tr["sched"] == {"A": 100, "B": 20}, f"{tag}: step 0 {tr['sched']}")
        check(fails, first_admission(res, "B") == (0, 96), f"{tag}: B {res['admissions']['B']}")
    return fails


@probe("cache-on-schedule")
def p_cache_on_schedule() -> list[str]:
    fails: list[str] = []
    # A partial chunk: 40 of 100 tokens scheduled, 2 of 3 blocks hashed at once.
    got = {}

    def on_sched(d, so, rec):
        if rec["step"] == 0:
            got["n"] = (hashed_prefix(d, "A"), len(block_ids(d, "A")))

    wl = [req("A", tok(40, 100))]
    driver({"max_num_batched_tokens": 40}, wl, on_schedule=on_sched).run()
    check(fails, got.get("n") == (2, 3), f"chunk of 40: (hashed, blocks) = {got.get('n')}")
    fails += invariant_runs()
    return fails


def invariant_runs() -> list[str]:
    """hashed(r) == floor(M_r / bs) for every running r, after every call.

    M_r is the largest argument ever passed to cache_blocks for r since its
    last admission: min(num_computed_tokens, num_tokens) after each schedule
    that scheduled r, and (async only) min(num_computed_tokens -
    num_in_flight_tokens, num_tokens) after each update that processed r.
    """
    fails: list[str] = []
    runs = [
        ("agent", {"num_blocks": 150}),
        ("system", {"num_blocks": 200}),
        ("fewshot", {"num_blocks": 120, "long_prefill_token_threshold": 48}),
    ]
    for gen, cfg in runs:
        for use_async in (False, True):
            mx: dict[str, int] = {}
            bad: list[str] = []

            def verify(d, where, mx=mx, bad=bad):
                for r in d.sched.running:
                    k = hashed_prefix(d, r.request_id)
                    want = mx.get(r.request_id, 0) // BS
                    if k != want and len(bad) < 3:
                        bad.append(f"{where} {r.request_id}: {k} != {want}")

            def on_sched(d, so, rec, mx=mx, verify=verify):
                for rid in so.num_scheduled_tokens:
                    r = d.sched.requests[rid]
                    if rid in rec["admitted"]:
                        mx[rid] = 0
                    mx[rid] = max(mx.get(rid, 0), min(r.num_computed_tokens, r.num_tokens))
                verify(d, f"sched {rec['step']}")

            def on_upd(d, so, rec, mx=mx, verify=verify):
                if d.cfg["use_async"]:
                    for r in d.sched.running:
                        if r.request_id in so.num_scheduled_tokens:
                            m = min(r.num_computed_tokens - r.num_in_flight_tokens, r.num_tokens)
                            mx[r.request_id] = max(mx[r.request_id], m)
                verify(d, f"update {rec['step']}")

            wl = apc_workloads.GENERATORS[gen](seed=5)
            res = driver(
                {**cfg, "use_async": use_async}, wl, on_schedule=on_sched, on_update=on_upd
            ).run()
            tag = f"{gen}/{'async' if use_async else 'sync'}"
            fails += [f"{tag}: {b}" for b in bad]
            hits = [h for a in res["admissions"].values() for _, h in a]
            check(fails, all(h % BS == 0 for h in hits), f"{tag}: a hit not block-aligned")
            check(fails, any(h > 0 for h in hits), f"{tag}: no hits at all (weak probe)")
    return fails


@probe("free-cached-count")
def p_free_cached_count() -> list[str]:
    fails: list[str] = []
    got = {}

    def on_upd(d, so, rec):
        if "A" in rec["finished"]:
            hashed = [b for b in d.pool.blocks if b.block_hash is not None]
            got["v"] = (d.pool.get_num_free_blocks(), len(hashed), d.sched.get_kv_cache_usage())

    x = tok(50, 40)
    driver({"num_blocks": 11}, [req("A", x)], on_update=on_upd).run()
    check(fails, got.get("v") == (10, 2, 0.0), f"(free, hashed, usage) = {got.get('v')}")
    return fails


@probe("touch")
def p_touch() -> list[str]:
    fails: list[str] = []
    x = tok(60, 64)
    st: dict[str, Any] = {}

    def before(d):
        r = d.sched.requests.get("B")
        if r is not None and r.num_computed_tokens == 0 and "free0" not in st:
            st["free0"] = d.pool.get_num_free_blocks()
            st["q0"] = free_queue(d)

    def on_sched(d, so, rec):
        if "A" in rec["admitted"]:
            st["a_ids"] = block_ids(d, "A")
        if "B" in rec["admitted"]:
            ids = block_ids(d, "B")
            st["b_ids"] = ids
            st["free1"] = d.pool.get_num_free_blocks()
            st["refs"] = [d.pool.blocks[i].ref_cnt for i in ids]
            st["q1"] = free_queue(d)

    wl = [req("A", x), req("B", x + tok(61, 20), after="A")]
    driver({"num_blocks": 20}, wl, before_schedule=before, on_schedule=on_sched).run()
    a = st["a_ids"]
    check(fails, st["b_ids"][:4] == a, f"B's first blocks {st['b_ids'][:4]} != A's {a}")
    check(fails, st["refs"] == [1] * 6, f"ref counts {st['refs']}")
    check(fails, st["free1"] == st["free0"] - 6, "free drops by hit (4) + new (2) blocks")
    want_q = [i for i in st["q0"] if i not in a][2:]
    check(fails, st["q1"] == want_q, "hit blocks leave the queue; new ones pop from the front")
    return fails


@probe("admission-check")
def p_admission_check() -> list[str]:
    fails: list[str] = []
    x = tok(70, 64)
    # Hit blocks held by a running request need no free block.
    base = [req("A", x + tok(71, 8), out_len=60), req("D", tok(72, 70), out_len=60)]
    for name, b_prompt, wm, want_step in [
        ("shared-hit", x + tok(73, 16), 0.0, 1),
        ("no-hit", tok(74, 80), 0.0, None),
        ("shared-hit+watermark", x + tok(73, 16), 0.09, None),
    ]:
        wl = [*base, req("B", b_prompt, arrival=1)]
        res = driver({"num_blocks": 12, "watermark": wm}, wl).run()
        step, hit = first_admission(res, "B")
        if want_step is not None:
            check(fails, (step, hit) == (1, 64), f"{name}: B admitted {(step, hit)}")
        else:
            check(fails, step > 1, f"{name}: B admitted at step {step}, expected later")
    # The watermark only applies while some request is running.
    for name, n_tok, want_step in [("idle-4+5<=10", 64, 0), ("idle-6+5>10", 96, 0)]:
        res = driver({"num_blocks": 11, "watermark": 0.5}, [req("B", tok(77, n_tok))]).run()
        step = first_admission(res, "B")[0]
        check(fails, step == want_step, f"{name}: admitted at {step}")
    # Free-cached hit blocks still cost a free block each.
    base = [req("A", x), req("D", tok(75, 70), out_len=60)]
    for name, b_prompt, admitted_at_1 in [
        ("cached-hit-needs-6-of-5", x + tok(76, 32), False),
        ("cached-hit-needs-5-of-5", x + tok(76, 16), True),
    ]:
        wl = [*base, req("B", b_prompt, arrival=1)]
        res = driver({"num_blocks": 11}, wl).run()
        step, hit = first_admission(res, "B")
        if admitted_at_1:
            check(fails, (step, hit) == (1, 64), f"{name}: B admitted {(step, hit)}")
        else:
            check(fails, step >= res["finish_step"]["D"], f"{name}: B admitted at {step}")
    return fails


@probe("free-order")
def p_free_order() -> list[str]:
    fails: list[str] = []
    got = {}

    def on_upd(d, so, rec):
        if rec["finished"] and "q" not in got:
            got["q"] = free_queue(d)

    for apc, want in [(True, [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]), (False, [3, 2, 1, *range(4, 11)])]:
        got.clear()
        driver(
            {"num_blocks": 11, "prefix_caching": apc}, [req("A", tok(80, 40))], on_update=on_upd
        ).run()
        check(fails, got.get("q") == want, f"apc={apc}: one request freed: {got.get('q')}")
    got.clear()
    wl = [req("A", tok(81, 40)), req("B", tok(82, 40))]
    driver({"num_blocks": 11}, wl, on_update=on_upd).run()
    want = [6, 3, 7, 8, 9, 10, 2, 1, 5, 4]
    check(fails, got.get("q") == want, f"two freed in one update: {got.get('q')} != {want}")
    return fails


@probe("evict-order")
def p_evict_order() -> list[str]:
    fails: list[str] = []
    x = tok(90, 64)
    st: dict[str, Any] = {}

    def on_sched(d, so, rec):
        if "A" in rec["admitted"]:
            st["a"] = block_ids(d, "A")
            st["a_hashes"] = list(d.sched.requests["A"].block_hashes)
        if "C" in rec["admitted"]:
            st["c"] = block_ids(d, "C")
            st["h3"] = d.pool.get_cached_block(st["a_hashes"][3], [0])
            st["h2"] = d.pool.get_cached_block(st["a_hashes"][2], [0])
            st["blk4_hash"] = d.pool.blocks[st["a"][3]].block_hash

    wl = [
        req("A", x),
        req("C", tok(91, 112), after="A"),
        req("B", x + tok(92, 10), after="C"),
    ]
    res = driver({"num_blocks": 11}, wl, on_schedule=on_sched).run()
    check(fails, st["a"] == [1, 2, 3, 4], f"A's blocks {st['a']}")
    check(fails, st["c"] == [5, 6, 7, 8, 9, 10, 4], f"C popped {st['c']}")
    check(fails, st["h3"] is None, "evicting block 4 drops A's 4th hash from the map")
    check(fails, st["h2"] is not None, "A's 3rd hash survives")
    check(fails, first_admission(res, "B")[1] == 48, f"B hit {res['admissions']['B']}")
    return fails


@probe("dup-hash")
def p_dup_hash() -> list[str]:
    fails: list[str] = []
    x = tok(100, 64)
    st: dict[str, Any] = {}

    def on_sched(d, so, rec):
        # Last seen while scheduled: both prompts end up fully hashed.
        for rid in ("A", "B"):
            if rid in so.num_scheduled_tokens:
                ids = block_ids(d, rid)
                st[rid] = ids
                st[rid + "names"] = [d.names(d.pool.blocks[i].block_hash) for i in ids]
        if "E" in rec["admitted"]:
            st["e"] = block_ids(d, "E")

    wl = [
        req("A", x),
        req("B", list(x)),
        req("E", x + tok(101, 5), arrival=20),
    ]
    cfg = {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 16}
    res = driver(cfg, wl, on_schedule=on_sched).run()
    check(fails, first_admission(res, "B") == (0, 16), f"B: {res['admissions']['B']}")
    a, b, na, nb = st["A"], st["B"], st["Anames"], st["Bnames"]
    check(fails, a[0] == b[0], "B shares A's first block (same-step hit)")
    check(fails, a[1:] != b[1:] and not set(a[1:]) & set(b[1:]), f"own later blocks {a} {b}")
    check(fails, na == nb and None not in na, f"same hashes twice: {na} {nb}")
    check(fails, st["e"][:4] == b[:4], f"E hits the first-inserted copies {st['e']} vs B {b}")
    return fails


@probe("preempt-rehit")
def p_preempt_rehit() -> list[str]:
    fails: list[str] = []
    st: dict[str, Any] = {}

    def before(d):
        r = d.sched.requests.get("D")
        if r is not None and r.status.name == "PREEMPTED":
            st["run"] = cached_run(d, r)
            st["T"] = r.num_tokens

    def on_sched(d, so, rec):
        if "D" in rec["preempted"] and "pre_q" not in st:
            st["pre_q"] = free_queue(d)
            st["pre_a"] = block_ids(d, "A")
        elif "D" in so.num_scheduled_tokens and "pre_q" not in st:
            st["d_last"] = (block_ids(d, "D"), hashed_prefix(d, "D"))

    # Two equal requests fill the pool (8 blocks); at step 5 A needs a 5th
    # block, so D (the last admitted) is preempted with 4 full hashed blocks.
    wl = [req("A", tok(110, 60), out_len=40), req("D", tok(111, 60), out_len=40)]
    res = driver({"num_blocks": 9}, wl, before_schedule=before, on_schedule=on_sched).run()
    adm = res["admissions"]["D"]
    check(fails, len(adm) == 2, f"D admitted {adm} (expected one preemption)")
    if len(adm) != 2:
        return fails
    d_ids, d_hashed = st["d_last"]
    check(fails, d_hashed == len(d_ids) == 4, f"D before preemption {st['d_last']}")
    check(fails, st["pre_a"][-1] == d_ids[-1], "A's new block is the victim's tail block")
    check(fails, st["pre_q"] == d_ids[:-1][::-1], f"queue after preemption {st['pre_q']}")
    hit = adm[1][1]
    want = BS * min(st["run"], (st["T"] - 1) // BS)
    check(fails, hit == want, f"resumed hit {hit} != bs*min(run, (T-1)//bs) = {want}")
    check(fails, hit == 16, f"resumed hit {hit}: only D's first block survived")
    check(fails, st["T"] == 65, f"T at re-admission {st['T']} (60 prompt + 5 outputs)")
    check(fails, res["cached_tokens"]["D"] == 0, "cached_tokens keeps the first admission's hit")
    return fails


@probe("stats")
def p_stats() -> list[str]:
    fails: list[str] = []
    runs = [
        ("agent", 7, {"num_blocks": 45, "max_num_seqs": 6}),
        ("system", 7, {"num_blocks": 110}),
        ("fewshot", 7, {"num_blocks": 50, "max_num_seqs": 6}),
        ("fewshot", 3, {"num_blocks": 45, "max_num_seqs": 6, "use_async": True}),
    ]
    saw_pre = False
    for gen, seed, cfg in runs:
        wl = apc_workloads.GENERATORS[gen](seed=seed)
        res = driver(cfg, wl).run()
        tot = res["prefix_cache_totals"]
        adm = [a for tr in res["trace"] for a in tr["admitted"].values()]
        new = [a for a in adm if not a["resumed"]]
        re = [a for a in adm if a["resumed"]]
        saw_pre |= bool(re)
        want = {
            "requests": len(new),
            "queries": sum(a["num_tokens"] for a in new),
            "hits": sum(a["computed"] for a in new),
            "preempted_requests": len(re),
            "preempted_queries": sum(a["num_tokens"] for a in re),
            "preempted_hits": sum(a["computed"] for a in re),
        }
        check(fails, tot == want, f"{gen} {cfg}: {tot} != {want}")
    check(fails, saw_pre, "no run preempted anything (weak probe)")
    res = driver({"prefix_caching": False}, apc_workloads.agent_sessions(seed=7)).run()
    tot = res["prefix_cache_totals"]
    check(fails, not any(tot.values()), f"APC off: counters {tot}")
    return fails


@probe("cached-tokens")
def p_cached_tokens() -> list[str]:
    fails: list[str] = []
    saw_diff = False
    for gen, seed, cfg in [
        ("agent", 7, {"num_blocks": 45, "max_num_seqs": 6}),
        ("fewshot", 7, {"num_blocks": 50, "max_num_seqs": 6}),
        ("fewshot", 3, {"num_blocks": 45, "max_num_seqs": 6, "use_async": True}),
    ]:
        res = driver(cfg, apc_workloads.GENERATORS[gen](seed=seed)).run()
        for rid, adm in res["admissions"].items():
            ct = res["cached_tokens"].get(rid)
            check(fails, ct == adm[0][1], f"{gen}: {rid} cached_tokens {ct} != {adm[0][1]}")
            saw_diff |= any(h != adm[0][1] for _, h in adm[1:])
    check(fails, saw_diff, "no re-admission with a different hit (weak probe)")
    res = driver({"prefix_caching": False}, apc_workloads.agent_sessions(seed=7)).run()
    check(fails, not any(res["cached_tokens"].values()), "APC off: cached_tokens not all 0")
    return fails


@probe("multi-turn")
def p_multi_turn() -> list[str]:
    fails: list[str] = []
    x = tok(140, 50)
    for use_async in (False, True):
        for o1, want in [(29, 64), (30, 64), (31, 80)]:
            a = req("A", x, out_len=o1)
            b_prompt = x + a["output_ids"] + tok(141, 20)
            b = apc_workloads._req("B", b_prompt, tok(142, 2), after="A")
            res = driver({"use_async": use_async}, [a, b]).run()
            hit = first_admission(res, "B")[1]
            formula = BS * ((50 + o1 - 1) // BS)
            tag = f"async={use_async} P1+O1={50 + o1}"
            check(fails, hit == want == formula, f"{tag}: hit {hit} != {want}")
    return fails


@probe("long-prefill")
def p_long_prefill() -> list[str]:
    fails: list[str] = []
    x = tok(120, 96)
    cfg = {"long_prefill_token_threshold": 32}
    for name, extra, want in [
        ("alone", [], 60),
        ("with-another", [req("E", tok(121, 20), out_len=60)], 32),
    ]:
        wl = [req("A", x), *extra, req("B", x + tok(122, 60), after="A")]
        res = driver(cfg, wl).run()
        step, hit = first_admission(res, "B")
        sched = next(r for r in res["trace"] if r["step"] == step)["sched"]["B"]
        check(fails, (hit, sched) == (96, want), f"{name}: (hit, scheduled) = {(hit, sched)}")
    return fails


@probe("async")
def p_async() -> list[str]:
    fails: list[str] = []
    x = tok(150, 63)
    for use_async, hashed_at, want_hit in [(False, 1, 64), (True, 2, 48)]:
        a = req("A", x, out_len=5)
        # B resends A's prompt and A's first output: 64 tokens, A's 4th block.
        b = apc_workloads._req("B", x + a["output_ids"][:1] + tok(151, 10), [11], arrival_step=1)
        log: dict[int, int] = {}

        def on_sched(d, so, rec, log=log):
            if "A" in d.sched.requests:
                log.setdefault(hashed_prefix(d, "A"), rec["step"])

        res = driver({"use_async": use_async}, [a, b], on_schedule=on_sched).run()
        tag = "async" if use_async else "sync"
        check(fails, log.get(4) == hashed_at, f"{tag}: A's 4th block hashed at {log}")
        got = first_admission(res, "B")
        check(fails, got == (1, want_hit), f"{tag}: B admitted {got}, want (1, {want_hit})")
    return fails


@probe("null-block")
def p_null_block() -> list[str]:
    fails: list[str] = []
    d = driver({"num_blocks": 11, "watermark": 0.19}, [])
    check(fails, d.pool.blocks[0].is_null, "block 0 is the null block")
    check(fails, d.pool.get_num_free_blocks() == 10, "free at start = num_blocks - 1")
    check(fails, 0 not in free_queue(d), "null block never in the free queue")
    check(fails, free_queue(d) == list(range(1, 11)), "initial queue is ids 1..N-1")
    wb = d.sched.kv_cache_manager.watermark_blocks
    check(fails, wb == 2, f"watermark blocks int(0.19*11) = {wb}")
    res = driver({"num_blocks": 40}, apc_workloads.agent_sessions(seed=2)).run()
    usage_ok = all(
        abs(r["kv_usage"] - round(1 - r["num_free"] / 39, 4)) < 1e-9 for r in res["trace"]
    )
    check(fails, usage_ok, "kv usage = 1 - free / (num_blocks - 1)")
    return fails


@probe("apc-off")
def p_apc_off() -> list[str]:
    fails: list[str] = []
    x = tok(130, 64)
    wl = [req("A", x), req("B", x + tok(131, 10), after="A")]
    hashed = []

    def on_sched(d, so, rec):
        hashed.append(sum(b.block_hash is not None for b in d.pool.blocks))

    res = driver({"prefix_caching": False}, wl, on_schedule=on_sched).run()
    check(fails, first_admission(res, "B")[1] == 0, "no hit with APC off")
    check(fails, not any(hashed), "no block ever gets a hash")
    return fails


@probe("pool-invariants")
def p_pool_invariants() -> list[str]:
    """Free queue = exactly the ref-0 non-null blocks; map entries point at them."""
    fails: list[str] = []
    bad: list[str] = []

    def verify(d, so, rec):
        q = free_queue(d)
        zero = [b.block_id for b in d.pool.blocks if not b.is_null and b.ref_cnt == 0]
        if sorted(q) != sorted(zero) or len(q) != d.pool.get_num_free_blocks():
            bad.append(f"step {rec['step']}: queue != ref-0 blocks")
        held: dict[int, int] = {}
        for r in list(d.sched.running):
            for i in block_ids(d, r.request_id):
                held[i] = held.get(i, 0) + 1
        for i, n in held.items():
            if d.pool.blocks[i].ref_cnt != n:
                bad.append(f"step {rec['step']}: block {i} ref {d.pool.blocks[i].ref_cnt} != {n}")
        for b in d.pool.blocks:
            if b.block_hash is not None:
                m = d.pool.cached_block_hash_to_block
                if not m.contain(b.block_hash, b.block_id):
                    bad.append(f"step {rec['step']}: block {b.block_id} hash not in map")

    for gen, seed, cfg in [
        ("agent", 3, {"num_blocks": 60, "max_num_seqs": 6}),
        ("system", 3, {"num_blocks": 110, "use_async": True}),
        ("fewshot", 3, {"num_blocks": 45, "max_num_seqs": 6, "use_async": True}),
    ]:
        wl = apc_workloads.GENERATORS[gen](seed=seed)
        driver(cfg, wl, on_schedule=verify, on_update=verify).run()
    fails += bad[:5]
    return fails


class ShadowPool:
    """The block pool rebuilt from the rules of docs/prefix-caching.md alone.

    It sees only what a replay would know (each step's scheduled tokens and
    admissions, the requests' tokens and counters) and predicts every hit,
    preemption victim, block id and the exact free queue, which
    ``shadow-pool`` compares with vLLM's after every call.
    """

    def __init__(self, num_blocks: int, apc: bool) -> None:
        self.apc = apc
        self.queue = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key: list[Any] = [None] * num_blocks
        self.map: dict[Any, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.ncached: dict[str, int] = {}

    def chain(self, tokens) -> list[Any]:
        """Hash keys of the full blocks: block i's key names its token prefix."""
        out, parent = [], 0
        for i in range(len(tokens) // BS):
            # Python's tuple hash of ints is deterministic; a collision would
            # show up as a difference, not hide one.
            parent = hash((parent, tuple(tokens[i * BS : (i + 1) * BS])))
            out.append(parent)
        return out

    def lookup(self, tokens) -> list[int]:
        if not self.apc:
            return []
        hit = []
        for k in self.chain(tokens)[: (len(tokens) - 1) // BS]:
            if not self.map.get(k):
                break
            hit.append(self.map[k][0])
        return hit

    def pop(self, n: int) -> list[int]:
        got, self.queue = self.queue[:n], self.queue[n:]
        for b in got:
            if self.key[b] is not None:
                self.map[self.key[b]].remove(b)
                self.key[b] = None
            self.ref[b] = 1
        return got

    def cache(self, rid: str, tokens, upto: int) -> None:
        if not self.apc:
            return
        n_full = min(upto, len(tokens)) // BS
        chain = self.chain(tokens)
        for i in range(self.ncached[rid], n_full):
            b = self.blocks[rid][i]
            self.key[b] = chain[i]
            self.map.setdefault(chain[i], []).append(b)
        self.ncached[rid] = max(self.ncached[rid], n_full)

    def admit(self, rid: str, tokens, n: int) -> int:
        hit = self.lookup(tokens)
        for b in hit:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1
        self.blocks[rid] = hit + self.pop(-(-(len(hit) * BS + n) // BS) - len(hit))
        self.ncached[rid] = len(hit)
        self.cache(rid, tokens, len(hit) * BS + n)
        return len(hit) * BS

    def grow(self, rid: str, tokens, computed: int) -> None:
        self.blocks[rid] += self.pop(-(-computed // BS) - len(self.blocks[rid]))
        self.cache(rid, tokens, computed)

    def need(self, rid: str, computed: int) -> int:
        return -(-computed // BS) - len(self.blocks[rid])

    def free(self, rid: str) -> None:
        front, back = [], []
        for b in reversed(self.blocks.pop(rid)):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (back if self.apc and self.key[b] is not None else front).append(b)
        self.queue = front + self.queue + back
        self.ncached.pop(rid, None)


def shadow_run(cfg: dict[str, Any], workload) -> list[str]:
    """Drive vLLM and the shadow pool side by side; return the differences."""
    bad: list[str] = []
    st: dict[str, Any] = {"robj": {}}
    full = {**apc_drive.DEFAULTS, "block_size": BS, **cfg}
    sh = ShadowPool(full["num_blocks"], full["prefix_caching"])

    def compare(d, where):
        if len(bad) >= 3:
            return
        if free_queue(d) != sh.queue:
            bad.append(f"{where}: queue {free_queue(d)} != {sh.queue}")
        for rid, ids in sh.blocks.items():
            if block_ids(d, rid) != ids:
                bad.append(f"{where}: {rid} blocks {block_ids(d, rid)} != {ids}")
        hashed = {b.block_id for b in d.pool.blocks if b.block_hash is not None}
        mine = {b for b, k in enumerate(sh.key) if k is not None}
        if hashed != mine:
            bad.append(f"{where}: hashed blocks differ {sorted(hashed ^ mine)}")

    def before(d):
        st["running"] = [r.request_id for r in d.sched.running]

    def on_sched(d, so, rec):
        running = list(st["running"])
        freed = set()
        for rid, n in so.num_scheduled_tokens.items():
            r = d.sched.requests[rid]
            st["robj"][rid] = r
            toks = list(r.all_token_ids)
            if rid in rec["admitted"]:
                hit = sh.admit(rid, toks, n)
                if hit != rec["admitted"][rid]["computed"]:
                    bad.append(f"step {rec['step']}: {rid} hit {rec['admitted'][rid]} != {hit}")
                continue
            while sh.need(rid, r.num_computed_tokens) > len(sh.queue):
                victim = running.pop()
                sh.free(victim)
                freed.add(victim)
            sh.grow(rid, toks, r.num_computed_tokens)
        # A request that could not grow even alone preempts itself last.
        while set(so.preempted_req_ids) - freed:
            victim = running.pop()
            if victim in so.num_scheduled_tokens:
                bad.append(f"step {rec['step']}: victim {victim} was scheduled")
                break
            sh.free(victim)
            freed.add(victim)
        if freed != set(so.preempted_req_ids):
            bad.append(f"step {rec['step']}: preempted {so.preempted_req_ids} != {freed}")
        compare(d, f"sched {rec['step']}")

    def on_upd(d, so, rec):
        finished = set(rec["finished"])
        for rid in so.num_scheduled_tokens:
            r = st["robj"][rid]
            if rid not in sh.blocks:
                continue
            if d.cfg["use_async"]:
                sh.cache(rid, list(r.all_token_ids), r.num_computed_tokens - r.num_in_flight_tokens)
            if rid in finished:
                sh.free(rid)
        compare(d, f"update {rec['step']}")

    driver(cfg, workload, before_schedule=before, on_schedule=on_sched, on_update=on_upd).run()
    return bad


@probe("shadow-pool")
def p_shadow_pool() -> list[str]:
    fails: list[str] = []
    # Pools small enough that most allocations evict and some preempt.
    runs = [
        ("agent", {"num_blocks": 60, "max_num_seqs": 6}),
        ("agent", {"num_blocks": 60, "use_async": True}),
        ("system", {"num_blocks": 110}),
        ("system", {"num_blocks": 110, "use_async": True, "watermark": 0.05}),
        ("fewshot", {"num_blocks": 45, "max_num_seqs": 6}),
        ("fewshot", {"num_blocks": 50, "max_num_seqs": 6, "use_async": True}),
        ("fewshot", {"num_blocks": 60, "long_prefill_token_threshold": 40}),
        ("agent", {"num_blocks": 60, "prefix_caching": False}),
    ]
    for seed in SHADOW_SEEDS:
        for gen, cfg in runs:
            wl = apc_workloads.GENERATORS[gen](seed=seed)
            # Other seeds may hold a longer request than the pool.
            need = max(-(-(len(r["prompt"]) + r["output_len"] - 1) // BS) for r in wl)
            cfg = {**cfg, "num_blocks": max(cfg["num_blocks"], need + 1)}
            fails += [f"{gen}/{seed} {cfg}: {b}" for b in shadow_run(cfg, wl)]
    shared = Path(os.environ.get("BEARSDK_SHARED", apc_drive.REPO.parent / "shared"))
    trace = shared / "data" / "mooncake" / "conversation_trace.jsonl"
    if not trace.exists():
        print(f"    (shadow-pool: no Mooncake trace at {trace}, skipped)")
        return fails
    for seed in SHADOW_SEEDS[:2]:
        wl = apc_workloads.mooncake(trace, seed=seed, start=60 * seed, num_requests=60)
        need = max(-(-(len(r["prompt"]) + r["output_len"] - 1) // BS) for r in wl)
        for cfg in [{"num_blocks": need + 12}, {"num_blocks": need + 40, "use_async": True}]:
            fails += [f"mooncake/{seed} {cfg}: {b}" for b in shadow_run(cfg, wl)]
    return fails


def main(argv: list[str] | None = None) -> int:
    """Run the probes and print one PASS/FAIL line each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="probe ids to run (default: all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    ap.add_argument(
        "--shadow-seeds", type=int, nargs="*", help="workload seeds of shadow-pool (default 3-6)"
    )
    a = ap.parse_args(argv)
    if a.shadow_seeds:
        SHADOW_SEEDS[:] = a.shadow_seeds
    ids = a.only or list(PROBES)
    failed = 0
    for pid in ids:
        try:
            fails = PROBES[pid]()
        except Exception:
            fails = ["raised:\n" + traceback.format_exc()]
        failed += bool(fails)
        print(f"{'PASS' if not fails else 'FAIL'} {pid}")
        for f in fails if a.verbose else fails[:3]:
            print(f"    {f}")
    print(f"{len(ids) - failed}/{len(ids)} probes passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
