"""The compiled prefix index and chain hashing are their pure-Python twin's, call for call.

``cext/_index_c.pyx`` reproduces CPython's tuple hash lane for lane (the chain
keys every part of bearsdk shares) and keeps the index in two open-addressing
tables over a dense entry array. Generated operation streams (stores with
duplicate hashes, equal content under different hashes, removals of known and
unknown hashes, clears) must leave both twins answering every lookup alike,
through table growth and the dense array's hole filling.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk._twins import available
from bearsdk.kvevents import _index_py
from bearsdk.replay.blocks import chain_keys

_C = available("bearsdk.kvevents._index_c")
needs_c = pytest.mark.skipif(_C is None, reason="the compiled index is not built")

_INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
_TOKENS = st.lists(
    st.one_of(
        st.integers(0, 200_000),
        st.sampled_from([0, 1, -1, -2, (1 << 61) - 1, 1 << 61, -((1 << 61) - 1)]),
        _INT64,
    ),
    max_size=80,
)


@needs_c
@settings(max_examples=400)
@given(tokens=_TOKENS, block_size=st.integers(1, 9), cut=st.integers(0, 20))
def test_compiled_chain_keys_are_cpythons_tuple_hash_chain(
    tokens: list[int], block_size: int, cut: int
) -> None:
    assert _C is not None
    want = chain_keys(tokens, block_size)
    assert _C.chain_keys(tokens, block_size) == want
    assert _C.chain_keys(tuple(tokens), block_size, want[:cut]) == want
    parent = want[cut - 1] if 0 < cut <= len(want) else None
    tail = tokens[min(cut, len(want)) * block_size :] if parent is not None else tokens
    assert _C.extend_chain(parent, tail, block_size) == _index_py.extend_chain(
        parent, tail, block_size
    )


@needs_c
@given(h=st.one_of(st.binary(min_size=1, max_size=64), st.integers(-(1 << 63), (1 << 64) - 1)))
def test_compiled_hash_key_is_the_twins(h: bytes | int) -> None:
    assert _C is not None
    assert _C.hash_key(h) == _index_py.hash_key(h)


def _ops(seed: int, n: int) -> list[tuple[Any, ...]]:
    # Few hashes and contents, so duplicates, shared content and removal of
    # what is (and is not) there all happen; some hashes are bytes, some large.
    rng = random.Random(seed)
    pool: list[bytes | int] = [rng.randrange(1 << 64) for _ in range(30)]
    pool += [rng.randbytes(32) for _ in range(30)] + list(range(40))
    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        x = rng.random()
        if x < 0.55:
            m = rng.randint(1, 6)
            ops.append(
                (
                    "stored",
                    [rng.choice(pool) for _ in range(m)],
                    [rng.randrange(50) for _ in range(m)],
                )
            )
        elif x < 0.97:
            ops.append(("removed", [rng.choice(pool) for _ in range(rng.randint(1, 5))]))
        else:
            ops.append(("clear",))
    return ops


@needs_c
@settings(max_examples=60)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 400))
def test_compiled_index_answers_as_the_twin_after_every_operation(seed: int, n: int) -> None:
    assert _C is not None
    twins = [_C.PrefixCore(4, 1 << 20), _index_py.PrefixCore(4, 1 << 20)]
    rng = random.Random(seed ^ 0x5EED)
    for op in _ops(seed, n):
        for t in twins:
            getattr(t, op[0])(*op[1:])
        q = [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        a, b = twins
        assert a.blocks == b.blocks
        assert a.hit_blocks(q) == b.hit_blocks(q)
        assert a.engine_keys(q) == b.engine_keys(q)
        h = rng.randrange(40)
        assert a.parent_key(h) == b.parent_key(h)


@needs_c
def test_compiled_index_survives_growth_and_holes_at_scale() -> None:
    # Past several table doublings, then most entries removed in random order
    # (each removal moves the last entry into the hole): every survivor stays
    # findable under its hash and its content, as the twin says.
    assert _C is not None
    rng = random.Random(7)
    n = 30_000
    hashes = rng.sample(range(1 << 40), n)
    keys = [rng.randrange(n // 2) for _ in range(n)]  # half the content held twice
    c, p = _C.PrefixCore(16, 1 << 20), _index_py.PrefixCore(16, 1 << 20)
    for t in (c, p):
        t.stored(hashes, keys)
    gone = rng.sample(hashes, 25_000)
    for t in (c, p):
        t.removed(gone)
    assert c.blocks == p.blocks == n - 25_000
    for k in rng.sample(range(n // 2), 5_000):
        assert c.engine_keys([k]) == p.engine_keys([k])
    for h in rng.sample(hashes, 5_000):
        assert c.parent_key(h) == p.parent_key(h)


@needs_c
@pytest.mark.parametrize("n", [4_096, 50_000, 200_000])
def test_compiled_index_holds_a_cached_block_in_at_most_64_bytes(n: int) -> None:
    # Issue 16's memory bound, at any fill: entries grow by a quarter, the two
    # tables double before they pass three quarters full.
    assert _C is not None
    rng = random.Random(n)
    c = _C.PrefixCore(16, 1 << 30)
    for lo in range(0, n, 997):
        m = min(997, n - lo)
        c.stored(range(lo + 1, lo + m + 1), [rng.randrange(1 << 63) for _ in range(m)])
        if lo + m >= 4_096:
            assert c.memory_bytes <= 64 * c.blocks
    assert c.blocks == n


@pytest.mark.parametrize("core", ["py", "c"])
def test_bad_geometry_is_refused_by_both_twins(core: str) -> None:
    if core == "c" and _C is None:
        pytest.skip("the compiled index is not built")
    cls = _C.PrefixCore if core == "c" else _index_py.PrefixCore  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        cls(0, 10)
    with pytest.raises(ValueError, match="max_blocks"):
        cls(16, -1)
