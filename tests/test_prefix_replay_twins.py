"""The compiled prefix-caching replay is the pure twin, block for block.

``cext/_replay_apc_c.pyx`` ports :class:`~bearsdk.replay.SchedulerCore` and
:class:`~bearsdk.replay.blocks.BlockPool` to C. Beyond forming the same batches
(test_prefix_replay.py, and vLLM's own states in test_apc_vllm_cases.py), its
pool must be the twin's wherever a replay stops: every block's holders and
content, and the free queue in eviction order, so that a rule broken in a way
the first token does not show yet (where a freed block goes, which one an
allocation evicts) still fails here.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import cast

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_replay import POLICIES, WIDE_POLICIES, policy, run_engine, tokens

import bearsdk
from bearsdk.replay import SchedulerCore
from bearsdk.replay._replay_apc_c import Replayer as ApcReplayer
from bearsdk.replay._replay_py import Replayer as PyReplayer
from bearsdk.replay.blocks import chain_keys
from bearsdk.replay.requests import NEW_REQUEST_ID, CachedReq, PolicyGeometry
from bearsdk.snapshot import Snapshot, snapshot_from_dict

COEFFS = (3e-3, 2e-5, 4e-8, 1e-9, 0.0, 1.0)  # decode_keys="attended"


def _content(k: int | None) -> int | str | None:
    # Keys of content only one request has are the replay's own serials; the
    # twins number them differently (the pure one at lookup, the compiled one
    # when the block is cached), and only their distinctness matters.
    return "own" if k is not None and k < 0 else k


def _pure_pool(core: SchedulerCore) -> tuple[list[int], list[object], list[tuple[int, object]]]:
    pool = core.pool
    assert pool is not None
    n = len(pool._ref)
    keys = [_content(pool.key_of(b)) for b in range(n)]
    return (
        [pool.held(b) for b in range(n)],
        keys,
        [(e, _content(k)) for e, k in pool.free_queue()],
    )


def _run_engine(
    name: str, arrivals: list[tuple[int, int, int, int, int]], at: int, seed: int
) -> tuple[bearsdk.BoundScheduler, random.Random, Snapshot]:
    pol, rng, eng = run_engine(name, arrivals, at, seed)
    doc = orjson.loads(orjson.dumps(eng.core.snapshot(output_len=True)))
    return pol, rng, snapshot_from_dict(doc)


# A workload's request (arrival step, prefix, shared tokens, prompt, output) and
# a new request (prefix, shared tokens, prompt, output), as run_engine and
# tokens take them.
ARRIVAL = st.tuples(
    st.integers(0, 10),
    st.integers(0, 2),
    st.integers(0, 400),
    st.integers(1, 300),
    st.integers(1, 60),
)
NEW = st.tuples(st.integers(0, 2), st.integers(0, 400), st.integers(1, 400), st.integers(1, 40))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(POLICIES)),
    arrivals=st.lists(ARRIVAL, max_size=16),
    at=st.integers(0, 60),
    news=st.lists(NEW, min_size=1, max_size=3),
    stop_after=st.integers(1, 60),
    seed=st.integers(0, 2**16),
    follow=st.sampled_from([0, 0, 3, 32]),
)
def test_the_compiled_pool_is_the_twins_wherever_a_replay_stops(
    name: str,
    arrivals: list[tuple[int, int, int, int, int]],
    at: int,
    news: list[tuple[int, int, int, int]],
    stop_after: int,
    seed: int,
    follow: int,
) -> None:
    _check_twins(name, arrivals, at, news, stop_after, seed, follow)


@pytest.mark.parametrize("name", sorted(WIDE_POLICIES))
def test_the_compiled_pool_is_the_twins_with_many_decodes_a_batch(name: str) -> None:
    # Up to 24 requests running: most batches serve their decodes as the
    # compiled loop's aggregate, and some need each request's place (a
    # preemption, a budget cut among them) and fold back.
    folded = 0
    for seed in range(16):
        rng = random.Random(seed)
        arrivals = [
            (
                rng.randint(0, 50),
                rng.randint(0, 2),
                rng.randint(0, 400),
                rng.randint(1, 300),
                rng.randint(1, 150),
            )
            for _ in range(rng.randint(10, 60))
        ]
        news = [
            (rng.randint(0, 2), rng.randint(0, 400), rng.randint(1, 400), rng.randint(1, 40))
            for _ in range(2)
        ]
        at, stop_after, follow = rng.randint(10, 70), rng.randint(1, 80), rng.choice([0, 3, 32])
        folded += _check_twins(name, arrivals, at, news, stop_after, seed, follow)
    assert folded > 100


def _check_twins(
    name: str,
    arrivals: list[tuple[int, int, int, int, int]],
    at: int,
    news: list[tuple[int, int, int, int]],
    stop_after: int,
    seed: int,
    follow: int,
) -> int:
    """Replay one engine's snapshot in both twins; the compiled loop's lazy batches."""
    folded = 0
    pol, rng, snap = _run_engine(name, arrivals, at, seed)
    assert snap.kv is not None
    assert snap.prefix_cache is not None
    geo = PolicyGeometry(pol)
    py = PyReplayer(pol)
    pp = py.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    cr = ApcReplayer(pol)
    cp = cr.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    assert cp.free_blocks == pp.free_blocks
    assert len(cp) == len(pp)
    # Several new requests against one prepared state: each replay starts from it.
    for pfx, shared, plen, out in news:
        keys = chain_keys(tokens(rng, pfx, shared, plen), pol.block_size)
        ends: list[float] = []
        # Stopped by the batch limit, run to the end, stopped by a horizon midway
        # through the batch the limit stopped at.
        for limit, horizon in ((stop_after, math.inf), (1_000_000, math.inf), (1_000_000, -1.0)):
            if horizon < 0:
                if len(ends) < 2:
                    continue
                j = min(stop_after, len(ends) - 1) - 1
                horizon = ((ends[j - 1] if j else 0.0) + ends[j]) / 2
            core = SchedulerCore.from_prepared(geo, pp, True, COEFFS)
            new = cast(CachedReq, geo.make_req(NEW_REQUEST_ID, plen, 0, out, -1, CachedReq))
            new.keys = keys[: plen // pol.block_size]
            core.waiting.append(new)
            want = core.go(new, limit, 10**9, horizon, next_tokens=follow)
            got = cr.replay(
                cp,
                plen,
                out,
                COEFFS,
                record=True,
                max_batches=limit,
                prefix_keys=keys,
                horizon_s=horizon,
                next_tokens=follow,
            )
            assert got == want
            assert got.token_times_s == want.token_times_s
            if math.isfinite(horizon) and horizon > 0:
                assert got.stop_reason == "horizon"
            elif limit == 1_000_000:
                assert want.batches is not None
                # (The horizon bounds the first token only.)
                first = want.batches[: want.first_token_batch]
                ends = list(itertools.accumulate(b.duration_s for b in first))
            assert got.batches is not None
            assert want.batches is not None
            assert [b.tokens_by_request for b in got.batches] == [
                b.tokens_by_request for b in want.batches
            ]
            assert got.ttft_s == want.ttft_s
            refs, bkeys, free = cr.last_blocks()
            assert (refs, [_content(k) for k in bkeys], [(e, _content(k)) for e, k in free]) == (
                _pure_pool(core)
            )
            assert cr.last_pool == (
                core.pool.num_free if core.pool else 0,
                len(core.running),
                len(core.waiting),
                len(refs),
            )
            assert cr.last_work > 0
            folded += cr.last_lazy_batches
            # The residents alone (last: it replays over this replayer's pool).
            assert cr.residents(cp, COEFFS, stop_after) == py.residents(pp, COEFFS, stop_after)
    return folded


def test_a_replay_that_names_blocks_from_a_run_and_evicts_matches_the_twin() -> None:
    # A scarce pool, long prompts sharing one prefix: every replay evicts.
    arrivals = [(s, 0, 320, 300, 30) for s in range(0, 12, 2)]
    pol, rng, snap = _run_engine("sync-scarce", arrivals, 25, 7)
    assert snap.kv is not None
    assert snap.prefix_cache is not None
    assert snap.prefix_cache.cached > 0
    keys = chain_keys(tokens(rng, 0, 400, 400), pol.block_size)
    out = {}
    for make in (PyReplayer, ApcReplayer):
        rp = make(pol)
        prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        out[make] = rp.replay(prep, 400, 5, COEFFS, record=True, prefix_keys=keys)
    assert out[PyReplayer] == out[ApcReplayer]
    assert out[PyReplayer].first_token_batch > 3


def test_a_chain_kept_as_a_tuple_prices_as_its_list_whatever_came_between() -> None:
    # The compiled replayer keeps the last tuple's converted keys: a list, another
    # tuple, a bad chain or another prompt length between two uses must not leak.
    arrivals = [(s, 0, 320, 300, 30) for s in range(0, 12, 2)]
    pol, rng, snap = _run_engine("sync-scarce", arrivals, 25, 7)
    assert snap.kv is not None
    a = chain_keys(tokens(rng, 0, 400, 400), pol.block_size)
    b = chain_keys(tokens(rng, 1, 100, 300), pol.block_size)
    py, cr = PyReplayer(pol), ApcReplayer(pol)
    pp, cp = (
        rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        for rp in (py, cr)
    )
    ta, tb = tuple(a), tuple(b)
    calls: list[tuple[int, object]] = [
        (400, ta), (400, a), (300, tb), (400, ta), (400, ta), (300, b), (160, ta),
        (400, None), (400, ta), (300, ()), (300, tb),
    ]  # fmt: skip
    for prompt, keys in calls:
        want = py.replay(pp, prompt, 5, COEFFS, record=True, prefix_keys=keys)
        assert cr.replay(cp, prompt, 5, COEFFS, record=True, prefix_keys=keys) == want
        assert cr.ttft(cp, prompt, 5, COEFFS, prefix_keys=keys) == want.ttft_s
    with pytest.raises(ValueError, match=r"prefix_keys\[1\]"):
        cr.replay(cp, 400, 5, prefix_keys=(a[0], -1))
    want = py.replay(pp, 400, 5, COEFFS, record=True, prefix_keys=ta)
    assert cr.replay(cp, 400, 5, COEFFS, record=True, prefix_keys=ta) == want


def test_bad_prefix_keys_and_foreign_states_are_refused() -> None:
    pol, _, snap = _run_engine("async-roomy", [(0, 1, 200, 200, 5)], 6, 1)
    assert snap.kv is not None
    cr = ApcReplayer(pol)
    cp = cr.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    with pytest.raises(ValueError, match=r"prefix_keys\[1\] must be an integer in \[0, 2\*\*63\)"):
        cr.replay(cp, 100, 3, prefix_keys=[1, -5])
    with pytest.raises(ValueError, match=r"prefix_keys\[0\]"):
        cr.replay(cp, 100, 3, prefix_keys=[2**63])
    with pytest.raises(ValueError, match="prepared state belongs to another policy"):
        ApcReplayer(policy("sync-scarce")).replay(cp, 100, 3)
    plain = bearsdk.bind_scheduler("vllm-v1", {"enable_prefix_caching": False})
    with pytest.raises(ValueError, match="does not cache prefixes"):
        ApcReplayer(plain)


def test_a_pool_built_in_code_is_checked_before_it_reaches_c_arrays() -> None:
    # The wire validator stands in front of snapshots; a PrefixCacheState built
    # directly must still never index past the compiled loop's arrays.
    import numpy as np

    from bearsdk.prefix_cache import PrefixCacheState

    pol = policy("sync-scarce")
    row = np.array([[0, 40, 40, 1, -1, 5, 0]], dtype=np.int64)  # running, 40 computed
    cr = ApcReplayer(pol)

    def state(**kw: object) -> PrefixCacheState:
        base: dict[str, object] = {
            "keys": (11, 12),
            "cached": 2,
            "free": (-10,),
            "blocks": ((0, 1),),
            "uncached": (1,),
            "chains": ((),),
        }
        return PrefixCacheState(**{**base, **kw})  # type: ignore[arg-type]

    assert len(cr.prepare(row, -1, None, state())) == 1
    bad = {
        "uncached": ((-3,), "uncached blocks must be an integer >= 0"),
        "keys": ((11, -1), r"keys\[1\] must be an integer in \[0, 2\*\*63\)"),
        "blocks": (((0, 5),), "cached block 5 out of range"),
        "chains": (((9,),), "chain key 9 out of range"),
        "free": ((0, -10), "block 0 is not a free cached block"),
        "cached": (3, r"cached must be in \[0, 2\]"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            cr.prepare(row, -1, None, state(**{field: value}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(POLICIES)),
    arrivals=st.lists(ARRIVAL, max_size=12),
    at=st.integers(0, 40),
    news=st.lists(NEW, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_both_twins_count_a_chains_hit_as_the_snapshot_lists_its_blocks(
    name: str,
    arrivals: list[tuple[int, int, int, int, int]],
    at: int,
    news: list[tuple[int, int, int, int]],
    seed: int,
) -> None:
    # The hit a router shows per candidate (BEAEstimator.cached_blocks) comes
    # from the prepared pool's content map: the snapshot's cached keys, from the
    # start of the chain.
    pol, rng, snap = _run_engine(name, arrivals, at, seed)
    assert snap.kv is not None
    pc = snap.prefix_cache
    assert pc is not None
    listed = set(pc.keys[: pc.cached])
    preps = [
        r.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=pc)
        for r in (PyReplayer(pol), ApcReplayer(pol))
    ]
    for pfx, shared, plen, _out in news:
        keys = chain_keys(tokens(rng, pfx, shared, plen), pol.block_size)
        want = next((i for i, k in enumerate(keys) if k not in listed), len(keys))
        assert [p.hit_blocks(keys) for p in preps] == [want, want]
    for p in preps:
        with pytest.raises(ValueError, match=r"prefix_keys\[1\] must be an integer"):
            p.hit_blocks([1, -2])
