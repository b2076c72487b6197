"""The compiled ``kv.prefix_cache`` validator accepts only what the reference accepts.

``bearsdk._prefix_cache_c.validate`` is a fast path: it returns the validated
state or declines (None), and the reference
(:func:`bearsdk.prefix_cache.prefix_cache_from_dict`) decides whatever it
declines. So on every extension, valid or not, it must either decline or return
a state equal to the reference's, and it must decline every extension the
reference refuses. Extensions come from live prefix-caching engines, then are
damaged field by field.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_replay import POLICIES, WIDE_POLICIES, run_engine

from bearsdk import _twins
from bearsdk.errors import SnapshotError
from bearsdk.prefix_cache import PrefixCacheState, prefix_cache_from_dict
from bearsdk.snapshot import _row

fast = _twins.available("bearsdk._prefix_cache_c")
pytestmark = pytest.mark.skipif(fast is None, reason="compiled extensions not built")

FIELDS = ("keys", "cached", "free", "blocks", "uncached", "chains", "events_seq")


_DOCS: dict[tuple[str, int], dict[str, Any]] = {}


def _doc(name: str, seed: int) -> dict[str, Any]:
    if (name, seed) not in _DOCS:
        _DOCS[name, seed] = _engine_doc(name, seed)
    return copy.deepcopy(_DOCS[name, seed])


def _engine_doc(name: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals = [
        (rng.randint(0, 30), rng.randint(0, 2), rng.randint(0, 400), rng.randint(1, 300), 40)
        for _ in range(rng.randint(1, 30))
    ]
    _, _, eng = run_engine(name, arrivals, rng.randint(5, 40), seed)
    doc: dict[str, Any] = orjson.loads(orjson.dumps(eng.core.snapshot(output_len=True)))
    return doc


DOCS = [(name, seed) for name in sorted(POLICIES) + sorted(WIDE_POLICIES) for seed in range(3)]


def _args(doc: dict[str, Any]) -> tuple[Any, ...]:
    kv = doc["kv"]
    reqs = doc["requests"]
    rows = [_row(i, r)[1] for i, r in enumerate(reqs)]
    return kv["prefix_cache"], kv["block_size"], kv["num_blocks"], kv["free_blocks"], reqs, rows


def _reference(args: tuple[Any, ...]) -> PrefixCacheState | None:
    raw, bs, nb, free, reqs, rows = args
    try:
        return prefix_cache_from_dict(
            raw, block_size=bs, num_blocks=nb, free_blocks=free, requests=reqs, rows=rows
        )
    except SnapshotError:
        return None


def _same(a: PrefixCacheState, b: PrefixCacheState) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in FIELDS)


@pytest.mark.parametrize(("name", "seed"), DOCS)
def test_it_accepts_engine_states_as_the_reference_does(name: str, seed: int) -> None:
    args = _args(_doc(name, seed))
    want = _reference(args)
    assert want is not None
    assert fast is not None
    got = fast.validate(*args)
    assert got is not None
    assert _same(got, want)
    for f in ("keys", "free", "blocks", "uncached", "chains"):
        assert type(getattr(got, f)) is tuple


# A damage: which field, and a value to put there (or a change to make).
BAD = st.sampled_from(
    [-1, 0, 1, 2, 3, 7, 2**63 - 1, 2**63, -(2**63), True, 1.0, "1", None, [], [0], [[0, 1]]]
)


def _damage(doc: dict[str, Any], rng: random.Random, value: object) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    pc = d["kv"]["prefix_cache"]
    reqs = d["requests"]
    where = rng.choice(["keys", "cached", "free", "extra", "events", "req", "req", "req", "kv"])
    if where == "keys" and pc["keys"]:
        pc["keys"][rng.randrange(len(pc["keys"]))] = value
    elif where == "cached":
        c = pc["cached"]
        pc["cached"] = c + rng.choice([-1, 1]) if type(c) is int and rng.random() < 0.5 else value
    elif where == "free":
        f = pc["free"]
        op = rng.randrange(4)
        if op == 0 and f:
            f[rng.randrange(len(f))] = value
        elif op == 1 and f:
            del f[rng.randrange(len(f))]
        elif op == 2:
            f.insert(rng.randrange(len(f) + 1), value)
        elif f:
            f.append(f[rng.randrange(len(f))])
    elif where == "extra":
        pc["unknown"] = value
    elif where == "events":
        pc["events_seq"] = value
    elif where == "kv":
        key = rng.choice(["num_blocks", "free_blocks", "block_size"])
        d["kv"][key] = max(1, d["kv"][key] + rng.choice([-2, -1, 1, 5]))
    elif reqs:
        r = reqs[rng.randrange(len(reqs))]
        field = rng.choice(["blocks", "uncached_blocks", "chain"])
        runs = r.get(field)
        op = rng.randrange(5)
        if op == 0 or not isinstance(runs, list) or not runs:
            r[field] = value
        elif op == 1:
            run = runs[rng.randrange(len(runs))]
            if isinstance(run, list) and run:
                run[rng.randrange(len(run))] = value
        elif op == 2:
            runs.append(copy.deepcopy(runs[rng.randrange(len(runs))]))  # a block named twice
        elif op == 3 and isinstance(runs[0], list):
            runs[rng.randrange(len(runs))] = tuple(runs[0])
        else:
            run = runs[rng.randrange(len(runs))]
            if isinstance(run, list) and len(run) == 2 and type(run[1]) is int:
                run[1] += rng.choice([-1, 1, 50])
    return d


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(DOCS) - 1),
    seed=st.integers(0, 2**16),
    values=st.lists(BAD, min_size=1, max_size=3),
)
def test_it_never_accepts_what_the_reference_refuses(
    which: int, seed: int, values: list[object]
) -> None:
    name, doc_seed = DOCS[which]
    doc = _doc(name, doc_seed)
    rng = random.Random(seed)
    for v in values:
        doc = _damage(doc, rng, v)
    try:
        args = _args(doc)
    except SnapshotError:
        return  # the rows themselves are refused before the extension is read
    want = _reference(args)
    assert fast is not None
    got = fast.validate(*args)
    if want is None:
        assert got is None
    elif got is not None:
        assert _same(got, want)
