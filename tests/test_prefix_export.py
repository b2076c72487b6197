"""The live scheduler's incremental ``kv.prefix_cache`` export against the export from scratch.

A live :class:`SchedulerCore` wires its block pool on its first snapshot
(:class:`~bearsdk.replay.wired.WiredPool`): the wire numbering is then kept as
blocks are cached, evicted, touched and released, and a snapshot copies it.
Its documents must restore to what :func:`export_reference` (the walk over
every block) gives, at any step: the cached blocks may be numbered
differently (the wire leaves that open, except that equal keys keep their
first-cached-first order), nothing else may differ, and both replay alike.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bearsdk
from bearsdk.replay import ScheduledBatch, SchedulerCore
from bearsdk.replay import wired as wired_mod
from bearsdk.replay._replay_py import Replayer as PyReplayer
from bearsdk.replay.blocks import BlockPool, chain_keys
from bearsdk.replay.prefix import export, export_reference, restore
from bearsdk.replay.requests import CachedReq
from bearsdk.replay.wired import WiredPool
from bearsdk.snapshot import snapshot_from_dict

BS = 16
POLICIES: dict[str, dict[str, Any]] = {
    "sync-scarce": {"num_gpu_blocks": 48, "async_scheduling": False},
    "async-scarce": {"num_gpu_blocks": 64, "async_scheduling": True},
    "sync-lpt-wm": {
        "num_gpu_blocks": 150,
        "async_scheduling": False,
        "long_prefill_token_threshold": 48,
        "watermark": 0.05,
    },
    "async-roomy": {"num_gpu_blocks": 600, "async_scheduling": True},
    "async-huge": {"num_gpu_blocks": 400_000, "async_scheduling": True},
}
PREFIXES = [[1000 + 97 * p + i for i in range(480)] for p in range(3)]


def policy(name: str) -> bearsdk.BoundScheduler:
    return bearsdk.bind_scheduler(
        "vllm-v1",
        {
            "block_size": BS,
            "max_num_batched_tokens": 128,
            "max_num_seqs": 6,
            "max_model_len": 4096,
            "enable_prefix_caching": True,
            **POLICIES[name],
        },
    )


def residents(core: SchedulerCore) -> list[tuple[Sequence[int], int, list[int]]]:
    """What the scheduler hands its export: per request its blocks, how many are cached, keys."""
    out: list[tuple[Sequence[int], int, list[int]]] = []
    for r in (*core.running, *core.waiting):
        assert isinstance(r, CachedReq)
        held = r.block_ids if r in core.running else ()
        out.append((held, r.cached_blocks if held else 0, core._keys(r, r.num_tokens // BS)))
    return out


def _expand(rs: Sequence[Sequence[int]]) -> list[int]:
    return [i for s, c in rs for i in range(s, s + c)]


def canonical(pc: dict[str, Any], fields: Sequence[dict[str, Any]]) -> object:
    """A document with every index replaced by what it names.

    A cached block becomes (key, how many blocks of equal key come before
    it): the identity a restored pool gives it; a key past the cached blocks
    becomes the key. Two documents are the same state exactly when these are
    equal.
    """
    keys, n = pc["keys"], pc["cached"]
    seen: dict[int, int] = {}
    name: list[tuple[Any, ...]] = []
    for j, k in enumerate(keys):
        if j < n:
            name.append(("block", k, seen.get(k, 0)))
            seen[k] = seen.get(k, 0) + 1
        else:
            name.append(("key", k))
    assert len(set(name[n:])) == len(keys) - n  # a key past the blocks is named once
    return (
        sorted(name[:n]),
        [name[e] if e >= 0 else e for e in pc["free"]],
        [
            (
                [name[j] for j in _expand(d.get("blocks", []))],
                d.get("uncached_blocks", 0),
                [name[j] for j in _expand(d.get("chain", []))],
            )
            for d in fields
        ],
    )


def block_fields(doc: dict[str, Any]) -> list[dict[str, Any]]:
    names = ("blocks", "uncached_blocks", "chain")
    return [{k: d[k] for k in names if k in d} for d in doc["requests"]]


def check(core: SchedulerCore) -> dict[str, Any]:
    """The scheduler's snapshot against the export from scratch; returns the snapshot."""
    doc = core.snapshot(output_len=True)
    assert isinstance(core.pool, WiredPool)
    pc = doc["kv"]["prefix_cache"]
    want_pc, want_fields = export_reference(core.pool, residents(core))
    assert canonical(pc, block_fields(doc)) == canonical(want_pc, want_fields)
    assert pc["cached"] == core.pool.num_cached
    # The wire's rule: equal keys first cached first (what a restore finds first).
    holders = {k: list(v) for k, v in core.pool._cached.items()}
    wi = core.pool.wire_state.wi
    for k, bs in holders.items():
        assert [wi[b] for b in bs] == sorted(wi[b] for b in bs), k
    snapshot_from_dict(orjson.loads(orjson.dumps(doc)))  # valid on the wire
    return doc


class Engine:
    """A SchedulerCore driven as vLLM's EngineCore loop drives its scheduler."""

    def __init__(self, core: SchedulerCore, depth: int) -> None:
        self.core = core
        self.depth = depth
        self.queue: deque[ScheduledBatch] = deque()

    def tick(self) -> None:
        self.queue.append(self.core.schedule())
        if len(self.queue) >= self.depth:
            self.core.process(self.queue.popleft())


def tokens(rng: random.Random, prefix: int, shared: int, total: int) -> list[int]:
    head = PREFIXES[prefix][: min(shared, total)]
    return head + [rng.randrange(5000, 100_000) for _ in range(total - len(head))]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 30),  # arrival step
            st.integers(0, 2),  # which shared prefix
            st.integers(0, 480),  # how much of it
            st.integers(1, 500),  # prompt length
            st.integers(1, 60),  # output length
            st.booleans(),  # token ids known (else: keys only the request has)
        ),
        max_size=24,
    ),
    steps=st.integers(1, 160),
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([2, 512]),
    forget=st.sampled_from([4, 1 << 16]),
)
def test_the_incremental_export_is_the_export_from_scratch(
    name: str,
    arrivals: list[tuple[int, int, int, int, int, bool]],
    steps: int,
    seed: int,
    chunk: int,
    forget: int,
) -> None:
    saved = wired_mod._CHUNK, wired_mod._FORGET
    # Tiny chunks: the free list splits and joins; a tiny log: the export
    # forgets what it remembered between snapshots.
    wired_mod._CHUNK, wired_mod._FORGET = chunk, forget
    try:
        _drive(name, arrivals, steps, seed)
    finally:
        wired_mod._CHUNK, wired_mod._FORGET = saved


def _drive(
    name: str, arrivals: list[tuple[int, int, int, int, int, bool]], steps: int, seed: int
) -> None:
    rng = random.Random(seed)
    pol = policy(name)
    eng = Engine(SchedulerCore(pol), 2 if pol.async_scheduling else 1)
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    for step in range(steps):
        while i < len(pending) and pending[i][0] <= step:
            _, pfx, shared, plen, out, known = pending[i]
            ids = tokens(rng, pfx, shared, plen) + [
                rng.randrange(5000, 100_000) for _ in range(out)
            ]
            eng.core.add_request(f"r{i}", plen, out, out, token_ids=ids if known else None)
            i += 1
        if eng.core.has_work() or eng.queue:
            eng.tick()
        # Snapshots at random steps: several steps' changes in one export, or one.
        if rng.random() < 0.4:
            check(eng.core)
    check(eng.core)


def test_a_scarce_pool_evicts_preempts_and_still_exports_alike() -> None:
    # Many requests over three shared prefixes in a pool that holds two or three
    # of them: evictions every step, preemptions, equal content cached twice.
    rng = random.Random(7)
    pol = policy("async-scarce")
    eng = Engine(SchedulerCore(pol), 2)
    for i in range(40):
        ids = tokens(rng, i % 3, rng.randint(0, 480), rng.randint(100, 500))
        eng.core.add_request(f"r{i}", len(ids), 30, 30, token_ids=[*ids, *range(30)])
    preempted = 0
    for _ in range(600):
        if not eng.core.has_work():
            break
        b = eng.core.schedule()
        preempted += len(b.preempted)
        eng.queue.append(b)
        if len(eng.queue) >= 2:
            eng.core.process(eng.queue.popleft())
        check(eng.core)
    assert preempted > 0


def test_the_first_export_of_a_wired_pool_is_the_reference_byte_for_byte() -> None:
    rng = random.Random(3)
    core = SchedulerCore(policy("async-roomy"))
    eng = Engine(core, 2)
    for i in range(12):
        ids = tokens(rng, i % 3, 300, 400)
        core.add_request(f"r{i}", len(ids), 20, 20, token_ids=[*ids, *range(20)])
        eng.tick()
    assert type(core.pool) is BlockPool
    want = export_reference(core.pool, residents(core))
    doc = core.snapshot()
    assert type(core.pool) is WiredPool
    got = (doc["kv"]["prefix_cache"], block_fields(doc))
    assert orjson.dumps(got) == orjson.dumps(want)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), alphabet=st.integers(2, 60), chunk=st.sampled_from([3, 512]))
def test_a_wired_pool_schedules_as_a_plain_one(seed: int, alphabet: int, chunk: int) -> None:
    # The same random operations on a plain pool and on a wired one (the
    # scheduler's calls, in any mix): same free queue, same cache, same lookups.
    # Keys from a small alphabet, so that equal content is cached many times
    # over and evicted in any order; tiny free-list chunks split and join.
    rng = random.Random(seed)
    saved = wired_mod._CHUNK
    wired_mod._CHUNK = chunk
    try:
        plain = BlockPool(50, reserved=1)
        wired = plain.copy()
        assert WiredPool.wire(wired)
        held: list[list[int]] = []
        keys: list[list[int]] = []
        for _ in range(1500):
            if rng.random() < 0.6 and plain.num_free:
                # Half the keys from the alphabet (some negative), half fresh.
                ks = [
                    rng.randrange(alphabet) - 3 if rng.random() < 0.5 else rng.randrange(10**9)
                    for _ in range(rng.randint(1, 10))
                ]
                hit = plain.lookup(ks, len(ks))
                assert wired.lookup(ks, len(ks)) == hit
                n = min(len(ks) - len(hit), plain.num_free - plain.evictable(hit))
                if n < 0:
                    continue
                plain.touch(hit)
                wired.touch(iter(hit))
                got = plain.allocate(n)
                assert wired.allocate(n) == got
                blocks = hit + got
                upto = rng.randint(len(hit), len(blocks))
                plain.cache(blocks, ks, len(hit), upto)
                wired.cache(blocks, ks, len(hit), upto)
                held.append(blocks)
                keys.append(ks)
            elif held:
                j = rng.randrange(len(held))
                blocks = held.pop(j)
                keys.pop(j)
                plain.release(reversed(blocks))
                wired.release(reversed(blocks))
            assert wired.free_queue() == plain.free_queue()
            assert wired.cached_blocks() == plain.cached_blocks()
            assert wired.num_free == plain.num_free
            if rng.random() < 0.1:
                res = []
                for b, k in zip(held, keys, strict=True):
                    cached = 0
                    while cached < len(b) and plain.key_of(b[cached]) is not None:
                        cached += 1
                    more = [rng.randrange(alphabet) - 3 for _ in range(rng.randint(0, 6))]
                    res.append((b, cached, [*k[:cached], *more]))
                got_pc, got_f = export(wired, res)
                want_pc, want_f = export_reference(plain, res)
                assert canonical(got_pc, got_f) == canonical(want_pc, want_f)
                wi = wired.wire_state.wi
                for _, bs in plain._cached.items():
                    assert [wi[b] for b in bs] == sorted(wi[b] for b in bs)
    finally:
        wired_mod._CHUNK = saved
    assert type(plain.copy()) is BlockPool
    assert type(wired.copy()) is BlockPool  # replays run on plain copies


def test_equal_content_cached_twice_keeps_its_order_through_holes() -> None:
    pool = BlockPool(8)
    assert WiredPool.wire(pool)
    a = pool.allocate(3)
    pool.cache(a, [10, 11, 12], 0, 3)
    b = pool.allocate(2)
    pool.cache(b, [10, 11], 0, 2)  # the same content again: second holders
    pool.release(reversed(a))
    c = pool.allocate(4)  # 3 uncached + the first of a's blocks freed: 12 evicted
    assert pool.key_of(a[2]) is None
    pool.cache(c, [20, 21, 22, 23], 0, 4)
    res = [(b, 2, [10, 11]), (c, 4, [20, 21, 22, 23])]
    got_pc, got_f = export(pool, res)
    want_pc, want_f = export_reference(pool, res)
    assert canonical(got_pc, got_f) == canonical(want_pc, want_f)
    # Restored, 10's first holder (free, a's) is what a lookup finds first.
    st_ = snapshot_from_dict(
        {
            "schema": "bear.snapshot/1",
            "instance": "x",
            "seq": 0,
            "time": 0.0,
            "kv": {
                "block_size": 1,
                "num_blocks": 8,
                "free_blocks": pool.num_free,
                "prefix_cache": got_pc,
            },
            "requests": [
                {
                    "id": "b",
                    "state": "running",
                    "prompt_tokens": 2,
                    "computed_tokens": 2,
                    "output_tokens": 0,
                    **got_f[0],
                },
                {
                    "id": "c",
                    "state": "running",
                    "prompt_tokens": 4,
                    "computed_tokens": 4,
                    "output_tokens": 0,
                    **got_f[1],
                },
            ],
        }
    )
    assert st_.prefix_cache is not None
    back = restore(st_.prefix_cache).pool
    first = back.lookup([10], 1)[0]
    assert back.held(first) == 0  # a's block, free, cached first


def test_a_restored_pool_with_uncached_blocks_behind_cached_ones_is_exported_from_scratch() -> None:
    pool = BlockPool.restore([5, 6], [0, 0], [-2, 0, -3, 1])
    assert not WiredPool.wire(pool)
    assert type(pool) is BlockPool
    pc, _ = export(pool, [])
    assert pc == {"keys": [5, 6], "cached": 2, "free": [-2, 0, -3, 1]}


def _replay(doc: dict[str, Any], pol: bearsdk.BoundScheduler, prompt: list[int]) -> object:
    snap = snapshot_from_dict(doc)
    assert snap.kv is not None
    rp = PyReplayer(pol)
    prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    res = rp.replay(prep, len(prompt), 3, record=True, prefix_keys=chain_keys(prompt, BS))
    assert res.batches is not None
    return res.first_token_batch, [dict(b.tokens_by_request) for b in res.batches]


def test_both_exports_replay_alike() -> None:
    rng = random.Random(5)
    pol = policy("sync-lpt-wm")
    eng = Engine(SchedulerCore(pol), 1)
    for i in range(30):
        ids = tokens(rng, i % 3, rng.randint(100, 480), rng.randint(100, 500))
        eng.core.add_request(f"r{i}", len(ids), 20, 20, token_ids=[*ids, *range(20)])
        for _ in range(4):
            eng.tick()
    doc = check(eng.core)
    ref = dict(doc)
    ref["kv"] = dict(doc["kv"])
    ref["kv"]["prefix_cache"], fields = export_reference(eng.core.pool, residents(eng.core))  # type: ignore[arg-type]
    names = ("blocks", "uncached_blocks", "chain")
    ref["requests"] = [
        {**{k: v for k, v in d.items() if k not in names}, **f}
        for d, f in zip(doc["requests"], fields, strict=True)
    ]
    prompt = tokens(rng, 1, 400, 450)
    assert _replay(doc, pol, prompt) == _replay(ref, pol, prompt)


def test_a_block_cached_while_free_sends_the_export_back_to_the_walk() -> None:
    # No scheduler does it, but the pool allows it: a free block with no
    # content (at the queue's front) becomes findable. The wired pool then
    # exports from scratch until its free queue has the usual shape again.
    pool = BlockPool(6)
    assert WiredPool.wire(pool)
    a = pool.allocate(3)
    pool.cache(a, [1, 2, 3], 0, 2)
    pool.release(reversed(a))  # a[2] uncached: the front; a[0], a[1] the back
    pool.cache([a[2]], [9], 0, 1)  # a free block cached: the front is now cached
    assert not pool.wire_state.ok
    for _ in range(2):
        got = export(pool, [])
        assert got == export_reference(pool, [])
        assert got[0]["free"][0] == 2  # the block cached at the front
    assert pool.allocate(1) == [a[2]]  # evicts it: the usual shape again
    assert WiredPool.wire(pool)  # already wired: rebuilt
    assert pool.wire_state.ok
    b = pool.allocate(4)
    pool.cache(b, [5, 6, 7, 8], 0, 4)
    res = [(b, 4, [5, 6, 7, 8, 10])]
    assert canonical(*export(pool, res)) == canonical(*export_reference(pool, res))
