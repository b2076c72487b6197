"""Untrusted snapshots through every stage and every source (issue 19's fuzz suite).

Every payload goes through both decoders side by side, a cache per replay twin,
``ttft()`` of both twins and a real router's cache and ``decide()``
(:class:`bearsdk.bench.fuzz.Harness`); the transport test sends payloads through
the real poll, push, shared-memory and Redis sources first. Bounded for CI
(small ``max_examples``, no deadline); ``bearsdk bench fuzz`` runs 1M.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bearsdk.bench import fuzz
from bearsdk.bench.fuzz import Harness, Tally, payload
from bearsdk.replay import implementations
from bearsdk.snapshot import decoders
from bearsdk.state import SnapshotCache

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def harness() -> Harness:
    # One for the module: building the router and twelve caches is the slow part.
    return Harness(twin_every=1)


def check(h: Harness, data: bytes) -> Tally:
    tally = Tally()
    h.check(data, 0, tally)
    return tally


def assert_clean(t: Tally) -> None:
    assert t.escapes == 0, t.examples
    assert t.lost_good == 0, t.examples
    assert t.other == 0, t.examples
    assert t.disagreements == 0, t.examples
    assert t.max_message <= 1024


# ---------------------------------------------------------------------- the package's generator


@SETTINGS
@given(seed=st.integers(0, 2**16), index=st.integers(0, 2**40))
def test_generated_payloads_survive_every_stage(harness: Harness, seed: int, index: int) -> None:
    assert_clean(check(harness, payload(seed, index)))


def test_payloads_are_pure_functions_of_seed_and_index() -> None:
    a = [payload(3, i) for i in range(200)]
    assert a == [payload(3, i) for i in range(200)]
    assert len(set(a)) > 190
    valid = 0
    for data in a:
        try:
            decoders()["python"](data)
            valid += 1
        except Exception:
            pass
    assert 20 <= valid <= 150  # valid ones and many kinds of invalid ones


# ---------------------------------------------------------------------- hypothesis-built payloads

_BOUNDARY = [
    0, 1, -1, 2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
    10**18, 4096, 4097, 2**24, 2**24 + 1, 1024, 1025, 65_536, 0.5, 1e308, -0.0,
]  # fmt: skip
BOUNDARY = st.sampled_from(_BOUNDARY)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=10,
)
# Containers built fresh: a mutation may write into one a previous draw returned.
EVIL = BOUNDARY | JSON | st.sampled_from(["", "running", "waiting", "x" * 2000]) | st.builds(list)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    n_run, n_wait = draw(st.integers(0, 5)), draw(st.integers(0, 3))
    reqs: list[dict[str, Any]] = []
    for i in range(n_run + n_wait):
        running = i < n_run
        prompt = draw(st.sampled_from([1, 2, 16, 17, 500, 4000, 2**24 - 401]))
        out = draw(st.integers(0, 400)) if running else 0
        ph = draw(st.sampled_from([0, 0, 1, 2, 1024])) if running else 0
        r: dict[str, Any] = {
            "id": f"r{i}",
            "state": "running" if running else "waiting",
            "prompt_tokens": prompt,
            "computed_tokens": draw(st.integers(0, prompt + out + ph)) if running else 0,
            "output_tokens": out,
            "placeholders": ph,
        }
        if draw(st.booleans()):
            r["max_tokens"] = out + draw(st.integers(1, 3000))
        if draw(st.booleans()):
            r["output_len"] = draw(st.integers(out + 1, r.get("max_tokens", out + 3000)))
        reqs.append(r)
    doc: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "i0",
        "seq": draw(st.integers(1, 2**40)),
        "time": fuzz.T0,
        "requests": reqs,
    }
    if draw(st.booleans()):
        bs = draw(st.sampled_from([1, 16, 4096]))
        held = sum(-(-r["computed_tokens"] // bs) for r in reqs)
        nb = draw(st.integers(max(1, held), max(1, held) + 50_000))
        doc["kv"] = {"block_size": bs, "num_blocks": nb, "free_blocks": nb - held}
    if draw(st.booleans()):
        doc["inflight"] = {"remaining_s": draw(st.floats(0, 0.1))}
    if draw(st.booleans()):
        doc["epoch"] = draw(st.text(min_size=1, max_size=8))
    return doc


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    doc = draw(documents())
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from(["top", "request", "kv", "inflight"]))
        target: Any = doc
        rows = doc.get("requests")
        rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
        if where == "request" and rows:
            target = draw(st.sampled_from(rows))
        elif where in ("kv", "inflight") and isinstance(doc.get(where), dict):
            target = doc[where]
        key = draw(st.sampled_from([*sorted(target), "unknown"]))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(EVIL)
    try:
        data = orjson.dumps(doc)
    except TypeError:  # an integer beyond 64 bits: write it as text
        data = json.dumps(doc).encode()
    op = draw(st.integers(0, 5))
    if op == 1:
        data = data[: draw(st.integers(0, len(data)))]
    elif op == 2:
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.binary(min_size=1, max_size=4)) + data[i:]
    elif op == 3:
        d = draw(st.sampled_from([255, 990, 1000, 3000]))
        data = data.replace(b'"schema"', b'"deep":' + b"[" * d + b"]" * d + b',"schema"', 1)
    elif op == 4:
        data = b'{"seq":-1,' + data[1:] if data.startswith(b"{") else data
    return data


@SETTINGS
@given(data=payloads())
def test_hypothesis_payloads_survive_every_stage(harness: Harness, data: bytes) -> None:
    assert_clean(check(harness, data))


@pytest.mark.once  # (it replays every document on both twins itself)
@SETTINGS
@given(doc=documents())
def test_replay_twins_agree_on_valid_snapshots(harness: Harness, doc: dict[str, Any]) -> None:
    t = check(harness, orjson.dumps(doc))
    assert_clean(t)
    assert t.ttft_disagreements == 0, t.examples


# ---------------------------------------------------------------------- the issue's payloads


def _doc(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "i0",
        "seq": 5,
        "time": fuzz.T0,
        "kv": {"block_size": 16, "num_blocks": 1000, "free_blocks": 900},
        "requests": [
            {"id": "a", "state": "running", "prompt_tokens": 100, "computed_tokens": 100,
             "output_tokens": 3},
            {"id": "b", "state": "waiting", "prompt_tokens": 50, "computed_tokens": 0,
             "output_tokens": 0},
        ],
    }  # fmt: skip
    for path, v in changes.items():
        *head, last = path.split("__")
        t: Any = d
        for k in head:
            t = t[int(k)] if k.isdigit() else t[k]
        t[last] = v
    return d


ISSUE = {
    "block_size 2^63-1": _doc(kv__block_size=2**63 - 1),
    "block_size 10^18": _doc(kv__block_size=10**18),
    "block_size 2^27": _doc(kv__block_size=2**27),
    "output_tokens 2^63-1 waiting": _doc(requests__1__output_tokens=2**63 - 1),
    "placeholders 2^31": _doc(requests__0__placeholders=2**31),
    "prompt_tokens 2^40": _doc(requests__1__prompt_tokens=2**40),
    "num_blocks 2^62": _doc(kv__num_blocks=2**62, kv__free_blocks=2**62 - 10),
}


@pytest.mark.parametrize("name", sorted(ISSUE))
def test_the_issues_payloads_keep_the_good_snapshot(harness: Harness, name: str) -> None:
    t = check(harness, orjson.dumps(ISSUE[name]))
    assert_clean(t)
    assert t.rejected == 1  # each is beyond a physical bound


@pytest.mark.parametrize("depth", [990, 1000, 5000])
def test_deep_nesting_is_a_rejection_not_a_recursion_error(harness: Harness, depth: int) -> None:
    deep = b"[" * depth + b"]" * depth
    for data in (
        b'{"schema":"bear.snapshot/1","instance":"i0","seq":1,"time":1,"requests":' + deep + b"}",
        b'{"schema":' + deep + b"}",
    ):
        t = check(harness, data)
        assert_clean(t)
        assert t.rejected == 1


def test_a_huge_value_gives_a_short_message(harness: Harness) -> None:
    big = "x" * (15 << 20)
    t0 = time.perf_counter()
    t = check(harness, orjson.dumps(_doc(requests__0__id=big)))
    assert_clean(t)
    assert t.rejected == 1
    assert time.perf_counter() - t0 < 60  # generous: only "not quadratic" is meant


def test_a_forged_redis_entry_goes_through_validation() -> None:
    from bearsdk.cluster import RedisBus, RedisSource

    src = RedisSource(RedisBus(), "i0")
    cache = SnapshotCache("i0")
    good = orjson.dumps(_doc())
    src._deliver(cache, good)
    assert cache.entry is not None
    kept = cache.entry
    deep = b"[" * 990 + b"]" * 990
    for forged in (
        b'{"schema":"bear.snapshot/1","instance":"i0","seq":9,"time":1,"requests":' + deep + b"}",
        orjson.dumps(_doc(seq=9, kv__block_size=2**63 - 1)),
        b"\xff" * 100,
    ):
        src._deliver(cache, forged)
        assert cache.entry is kept
    assert cache.stats().rejected_total == 3
    assert all(len(m) <= 1024 + 256 for m in [cache.stats().last_reject or ""])


# ---------------------------------------------------------------------- transports


async def test_payloads_through_every_real_source(harness: Harness, redis_url: str) -> None:
    out, total = await fuzz._transports(harness, 7, 15, list(fuzz.SOURCES), redis_url)
    assert set(out) == set(fuzz.SOURCES)
    for name, s in out.items():
        assert "crashed" not in s, (name, s)
        assert s["payloads"] + s["undelivered"] == 15, (name, s)
        assert s["payloads"] >= 12, (name, s)
    assert total.escapes == 0, total.examples
    assert total.lost_good == 0, total.examples
    assert total.other == 0, total.examples
    assert total.disagreements == 0, total.examples


def test_bench_fuzz_command() -> None:
    cmd = [sys.executable, "-m", "bearsdk", "bench", "fuzz", "--payloads", "150"]
    cmd += ["--transport", "5", "--sources", "poll,shm", "--jobs", "1", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode in (0, 1), res.stderr  # 1: a target missed (times on a busy machine)
    report = json.loads(res.stdout)
    t = report["total"]
    assert t["payloads"] == 150
    assert t["crashes"] == 0
    assert t["escapes"] == 0
    assert t["lost_good_snapshot"] == 0
    assert set(report["sources"]) == {"poll", "shm"}


def test_bench_fuzz_rejects_an_unknown_source() -> None:
    cmd = [sys.executable, "-m", "bearsdk", "bench", "fuzz", "--sources", "poll,nope"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2
    assert "unknown source 'nope'" in res.stderr
    assert "Traceback" not in res.stderr


# ---------------------------------------------------------------------- found by bench fuzz

INVALID_UTF8_IN_INFLIGHT = (
    b'{"schema":"bear.snapshot/1","instance":"i0","seq":1,"time":1,"requests":[],'
    b'"inflight":{"remaining_s":0.0,"ex\xc9\xc2tra":1}}'
)


@pytest.mark.skipif(len(decoders()) < 2, reason="the compiled decoder is not built")
# Found by bearsdk bench fuzz, payload(0, 225981): the compiled scanner skipped an
# unknown key of 'inflight' without checking its UTF-8.
def test_decoders_agree_on_invalid_utf8_in_an_inflight_key() -> None:
    outcomes = []
    for dec in decoders().values():
        try:
            dec(INVALID_UTF8_IN_INFLIGHT)
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes == ["SnapshotError"] * len(outcomes)


@pytest.mark.skipif(len(implementations()) < 2, reason="the compiled replay is not built")
# Found by bearsdk bench fuzz --seed 1: the compiled replay stopped at its work
# bound (a lower bound) where the twin answered; the event heaps' compaction and a
# 2**19 bound let both answer.
@pytest.mark.parametrize("index", [500, 56700])
def test_replay_twins_agree_on_bench_fuzz_findings(harness: Harness, index: int) -> None:
    t = Tally()
    harness.check(payload(1, index), index, t)
    assert t.ttft_disagreements == 0, t.examples
