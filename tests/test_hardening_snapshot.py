"""Untrusted snapshots (issue 19, defects 1-3): physical bounds, bounded errors, both decoders.

A snapshot comes from the network. Every number in it is bounded physically
(``docs/snapshots.md``, "Bounds"), every rejection is a one-line
:class:`SnapshotError` of at most 1 KB naming the field and the value, and the
cache keeps its last good snapshot whatever it is offered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bearsdk import BEAEstimator, SnapshotError
from bearsdk.estimators import BatchTimeModel
from bearsdk.snapshot import (
    MAX_BLOCK_SIZE,
    MAX_ID_CHARS,
    MAX_INFLIGHT_S,
    MAX_NUM_BLOCKS,
    MAX_PLACEHOLDERS,
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    MAX_SNAPSHOT_BYTES,
    MAX_TOTAL_TOKENS,
    decoders,
    snapshot_from_dict,
)
from bearsdk.state import Outcome, Reject, SnapshotCache

DECODERS = decoders()
BT = BatchTimeModel(4e-3, 2e-5, 5e-8, 1e-10)
MAX_MESSAGE = 1024


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "eng-0",
        "seq": 5,
        "time": 1000.0,
        "kv": {"block_size": 16, "num_blocks": 1000, "free_blocks": 900},
        "requests": [
            {
                "id": "r0",
                "state": "running",
                "prompt_tokens": 100,
                "computed_tokens": 100,
                "output_tokens": 1,
            },
            {
                "id": "r1",
                "state": "waiting",
                "prompt_tokens": 50,
                "computed_tokens": 0,
                "output_tokens": 0,
            },
        ],
    }
    d.update(over)
    return d


def outcome(name: str, data: bytes) -> tuple[str, Any]:
    try:
        s = DECODERS[name](data)
    except SnapshotError as exc:
        return "error", (str(exc), exc.field)
    return "ok", (s.to_dict(), s.table.tolist())


def same(data: bytes) -> tuple[str, Any]:
    """Decode with every decoder; they must agree exactly. Checks message bounds."""
    ref = outcome("python", data)
    for name in DECODERS:
        assert outcome(name, data) == ref, name
    if ref[0] == "error":
        msg = ref[1][0]
        assert len(msg.encode()) <= MAX_MESSAGE
        assert "\n" not in msg
    return ref


def rejects(data: bytes, field: str) -> str:
    kind, detail = same(data)
    assert kind == "error", detail
    msg, got_field = detail
    assert got_field == field, msg
    return str(msg)


def accepts(data: bytes) -> None:
    kind, detail = same(data)
    assert kind == "ok", detail


def cache() -> SnapshotCache:
    est = BEAEstimator.for_scheduler("vllm-v1", BT)
    return SnapshotCache("eng-0", estimator=est)


# --------------------------------------------------------------- defect 1


@pytest.mark.parametrize("bs", [MAX_BLOCK_SIZE + 1, 2**27, 2**61, 10**18, 2**63 - 1])
def test_block_size_beyond_the_cap_is_rejected_by_both_decoders(bs: int) -> None:
    d = base(kv={"block_size": bs, "num_blocks": 1000, "free_blocks": 900})
    msg = rejects(orjson.dumps(d), "kv.block_size")
    assert str(bs) in msg


def test_block_size_at_the_cap_is_accepted() -> None:
    kv = {"block_size": MAX_BLOCK_SIZE, "num_blocks": 8, "free_blocks": 7}
    accepts(orjson.dumps(base(kv=kv)))


@pytest.mark.parametrize("bs", [2**27, 2**61, 10**18, 2**63 - 1])
def test_cache_keeps_the_last_good_snapshot_on_a_huge_block_size(bs: int) -> None:
    c = cache()
    assert c.offer_bytes(orjson.dumps(base())) is Outcome.ACCEPTED
    good = c.entry
    d = base(seq=6, kv={"block_size": bs, "num_blocks": 1000, "free_blocks": 900})
    assert c.offer_bytes(orjson.dumps(d)) is Outcome.REJECTED
    assert c.entry is good
    assert c.stats().rejected == {str(Reject.FIELD): 1}
    assert "kv.block_size" in (c.stats().last_reject or "")


def test_num_blocks_beyond_the_cap_is_rejected() -> None:
    n = MAX_NUM_BLOCKS + 1
    kv = {"block_size": 16, "num_blocks": n, "free_blocks": 0}
    rejects(orjson.dumps(base(kv=kv)), "kv.num_blocks")


# --------------------------------------------------------------- defect 2


def nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


class Nest:
    """A JSON value nested ``depth`` lists deep (orjson writes at most 255)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"Nest({self.depth})"


def dumps(d: Any) -> bytes:
    """orjson.dumps, writing each :class:`Nest` as raw nested JSON."""
    nests: list[Nest] = []

    def default(o: object) -> str:
        if isinstance(o, Nest):
            nests.append(o)
            return f"@@nest{len(nests) - 1}@@"
        raise TypeError

    data = orjson.dumps(d, default=default)
    for i, n in enumerate(nests):
        data = data.replace(f'"@@nest{i}@@"'.encode(), b"[" * n.depth + b"0" + b"]" * n.depth)
    return data


@pytest.mark.parametrize("depth", [990, 1000, 1023])
@pytest.mark.parametrize("where", ["kv", "id", "instance", "seq", "inflight", "requests"])
def test_deeply_nested_value_is_a_clean_rejection(depth: int, where: str) -> None:
    d = base()
    if where == "kv":
        d["kv"]["block_size"] = Nest(depth)
    elif where == "id":
        d["requests"][0]["id"] = Nest(depth)
    elif where == "inflight":
        d["inflight"] = {"remaining_s": Nest(depth)}
    elif where == "requests":
        d["requests"] = [Nest(depth)]
    else:
        d[where] = Nest(depth)
    data = dumps(d)
    kind, _ = same(data)
    assert kind == "error"
    c = cache()
    assert c.offer_bytes(orjson.dumps(base(seq=1))) is Outcome.ACCEPTED
    good = c.entry
    assert c.offer_bytes(data) is Outcome.REJECTED
    assert c.entry is good
    assert len((c.stats().last_reject or "").encode()) <= 2 * MAX_MESSAGE


def test_nesting_deeper_than_json_allows_is_malformed() -> None:
    data = b'{"schema":"bear.snapshot/1","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    rejects(data, "")


def test_python_objects_nested_beyond_the_recursion_limit_are_a_clean_rejection() -> None:
    deep = nested(sys.getrecursionlimit() * 3)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    for bad in (deep, cyclic, {"k": deep}, 10**5000):
        for field in ("instance", "seq", "requests", "kv"):
            with pytest.raises(SnapshotError) as ei:
                snapshot_from_dict(base(**{field: bad}))
            assert len(str(ei.value).encode()) <= MAX_MESSAGE
            assert ei.value.field.startswith(field)


@pytest.mark.parametrize("size", [10**6, 15 * 10**6])
def test_a_huge_value_gives_a_short_message(size: int) -> None:
    d = base()
    d["requests"][0]["prompt_tokens"] = "x" * size
    msg = rejects(orjson.dumps(d), "requests[0].prompt_tokens")
    assert "xxx" in msg  # the value is shown, truncated


def test_a_huge_unknown_key_gives_a_short_message() -> None:
    d = base()
    d["requests"][0]["k" * 10**6] = 1
    d["kv"]["q" * 10**6] = 1
    for data in (orjson.dumps(d), orjson.dumps({**base(), "kv": d["kv"]})):
        kind, (_, field) = same(data)
        assert kind == "error"
        assert len(field) <= MAX_MESSAGE


def test_missing_kv_field_is_named_in_declaration_order_whatever_the_hash_seed() -> None:
    code = (
        "from bearsdk.snapshot import snapshot_from_dict\n"
        "from bearsdk.errors import SnapshotError\n"
        "try:\n"
        "    snapshot_from_dict({'schema': 'bear.snapshot/1', 'instance': 'a', 'seq': 0,"
        " 'time': 0, 'requests': [], 'kv': {}})\n"
        "except SnapshotError as e:\n"
        "    print(e.field)\n"
    )
    fields = set()
    for seed in ("0", "1", "2", "3", "4", "5"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        fields.add(out.stdout.strip())
    assert fields == {"kv.block_size"}


# --------------------------------------------------------------- defect 3


def one(state: str = "running", **over: Any) -> bytes:
    r: dict[str, Any] = {
        "id": "r0",
        "state": state,
        "prompt_tokens": 100,
        "computed_tokens": 0,
        "output_tokens": 0,
    }
    r.update(over)
    return orjson.dumps(base(requests=[r], kv=None))


@pytest.mark.parametrize("state", ["running", "waiting"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("output_tokens", 2**63 - 1),
        ("output_tokens", MAX_REQUEST_TOKENS + 1),
        ("prompt_tokens", 2**63 - 1),
        ("prompt_tokens", MAX_REQUEST_TOKENS + 1),
        ("max_tokens", 2**63 - 1),
        ("max_tokens", MAX_REQUEST_TOKENS + 1),
        ("output_len", 2**63 - 1),
        ("output_len", MAX_REQUEST_TOKENS + 1),
    ],
)
def test_token_counts_beyond_the_cap_are_rejected(state: str, field: str, value: int) -> None:
    msg = rejects(one(state, **{field: value}), f"requests[0].{field}")
    assert str(value) in msg


def test_sequence_beyond_the_cap_is_rejected() -> None:
    half = MAX_REQUEST_TOKENS // 2 + 1
    rejects(one(prompt_tokens=half, output_tokens=half), "requests[0].output_tokens")
    accepts(one(prompt_tokens=MAX_REQUEST_TOKENS - 10, output_tokens=10, computed_tokens=5))


@pytest.mark.parametrize("ph", [MAX_PLACEHOLDERS + 1, 2**31, 2**31 + 5, 2**63 - 1])
def test_placeholders_beyond_the_cap_are_rejected(ph: int) -> None:
    msg = rejects(one(placeholders=ph, output_tokens=3), "requests[0].placeholders")
    assert str(ph) in msg


def test_waiting_request_with_huge_output_does_not_reach_route() -> None:
    c = cache()
    assert c.offer_bytes(orjson.dumps(base(seq=1))) is Outcome.ACCEPTED
    assert c.offer_bytes(one("waiting", output_tokens=2**63 - 1)) is Outcome.REJECTED
    assert c.entry is not None
    assert c.entry.seq == 1


def test_too_many_requests_are_rejected() -> None:
    reqs = [
        {
            "id": f"r{i}",
            "state": "waiting",
            "prompt_tokens": 1,
            "computed_tokens": 0,
            "output_tokens": 0,
        }
        for i in range(MAX_REQUESTS + 1)
    ]
    rejects(orjson.dumps(base(requests=reqs, kv=None)), "requests")


def test_total_tokens_beyond_the_cap_are_rejected() -> None:
    n = MAX_TOTAL_TOKENS // MAX_REQUEST_TOKENS + 1
    reqs = [
        {
            "id": f"r{i}",
            "state": "waiting",
            "prompt_tokens": MAX_REQUEST_TOKENS,
            "computed_tokens": 0,
            "output_tokens": 0,
        }
        for i in range(n)
    ]
    rejects(orjson.dumps(base(requests=reqs, kv=None)), f"requests[{n - 1}].prompt_tokens")
    accepts(orjson.dumps(base(requests=reqs[:-1], kv=None)))


@pytest.mark.parametrize("field", ["id", "instance", "epoch"])
def test_names_beyond_the_cap_are_rejected(field: str) -> None:
    name = "n" * (MAX_ID_CHARS + 1)
    if field == "id":
        d = base()
        d["requests"][0]["id"] = name
        rejects(orjson.dumps(d), "requests[0].id")
    else:
        rejects(orjson.dumps(base(**{field: name})), field)


def test_inflight_beyond_the_cap_is_rejected() -> None:
    for rs in (MAX_INFLIGHT_S * 2, 1e300):
        rejects(orjson.dumps(base(inflight={"remaining_s": rs})), "inflight.remaining_s")


# ------------------------------------------------- twins agree at the bounds

BOUNDARY = st.sampled_from(
    [0, 1, -1, 2, 15, 16, 17, MAX_BLOCK_SIZE, MAX_BLOCK_SIZE + 1, MAX_PLACEHOLDERS,
     MAX_PLACEHOLDERS + 1, MAX_NUM_BLOCKS, MAX_NUM_BLOCKS + 1, MAX_REQUEST_TOKENS,
     MAX_REQUEST_TOKENS + 1, MAX_TOTAL_TOKENS, 2**31 - 1, 2**31, 2**32, 10**18 - 1, 10**18,
     2**63 - 1, 2**63, 2**64 - 1, -(2**63), 0.5, 1.0, 1e300, True, False, None, "1", [1], {}]
)  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["kv.block_size", "kv.num_blocks", "kv.free_blocks", "seq", "inflight"]
                + [
                    f"requests[{i}].{f}"
                    for i in (0, 1)
                    for f in ("prompt_tokens", "computed_tokens", "output_tokens",
                              "max_tokens", "output_len", "placeholders")
                ]
            ),
            BOUNDARY | st.integers(-5, 5000) | st.builds(Nest, st.integers(1, 1100)),
        ),
        min_size=1,
        max_size=4,
    )
)  # fmt: skip
def test_both_decoders_agree_at_the_bounds(edits: list[tuple[str, Any]]) -> None:
    d = base()
    for path, value in edits:
        if path.startswith("requests["):
            i = int(path[9])
            d["requests"][i][path.split(".", 1)[1]] = value
        elif path.startswith("kv."):
            d["kv"][path[3:]] = value
        elif path == "inflight":
            d["inflight"] = {"remaining_s": value}
        else:
            d[path] = value
    try:
        data = dumps(d)
    except orjson.JSONEncodeError:  # 2**64 and beyond
        return
    same(data)
    c = cache()
    assert c.offer_bytes(data) in (Outcome.ACCEPTED, Outcome.REJECTED)


# ------------------------------------------------- the cache never raises


def test_cache_survives_a_decoder_or_replay_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Last resort: whatever a decoder or the replay raises costs one snapshot."""
    import bearsdk.state.cache as cache_mod

    c = cache()
    assert c.offer_bytes(orjson.dumps(base(seq=1))) is Outcome.ACCEPTED
    good = c.entry

    def boom(data: object) -> Any:
        raise RecursionError("x" * 10**6)

    monkeypatch.setattr(cache_mod, "decode_snapshot", boom)
    assert c.offer_bytes(orjson.dumps(base(seq=2))) is Outcome.REJECTED
    monkeypatch.undo()

    def overflow(*args: object) -> Any:
        raise OverflowError("Python int too large to convert to C long")

    from bearsdk.estimators.bea import BEAEstimator

    monkeypatch.setattr(BEAEstimator, "prepare", overflow)
    assert c.offer_bytes(orjson.dumps(base(seq=3))) is Outcome.REJECTED
    assert c.entry is good
    assert c.stats().rejected == {str(Reject.MALFORMED): 1, str(Reject.UNREPLAYABLE): 1}
    assert len(c.stats().last_reject or "") < MAX_MESSAGE


# ------------------------------------------- through the router's sources


@pytest.mark.parametrize("kind", ["poll", "push"])
async def test_hostile_snapshots_through_a_source_leave_the_last_good_one(kind: str) -> None:
    """Defects 1-3 as an engine would send them: the source and the cache survive."""
    import anyio
    from aiohttp import web

    from bearsdk.io import Backoff, PollSource, PushSource, SnapshotPublisher

    pub = SnapshotPublisher("eng-0", heartbeat_s=0.1)
    app = web.Application()
    pub.add_routes(app)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    fast = Backoff(initial_s=0.01, max_s=0.05)
    src = (
        PollSource(url, interval_s=0.005, timeout_s=1.0, backoff=fast)
        if kind == "poll"
        else PushSource(url, heartbeat_s=0.1, connect_timeout_s=1.0, backoff=fast)
    )
    c = cache()
    epoch = pub.epoch or "e"

    def wait_for(cond: Any) -> Any:
        async def go() -> None:
            with anyio.fail_after(20):
                while not cond():  # noqa: ASYNC110
                    await anyio.sleep(0.005)

        return go()

    try:
        async with anyio.create_task_group() as tg:
            await tg.start(src.run, c)
            pub.publish(orjson.dumps(base(seq=10, epoch=epoch)))
            await wait_for(lambda: c.entry is not None and c.entry.seq == 10)
            good = c.entry
            r0 = dict(base()["requests"][0])
            hostile = [
                base(seq=11, epoch=epoch, kv={**base()["kv"], "block_size": 2**63 - 1}),
                base(seq=12, epoch=epoch, kv={**base()["kv"], "block_size": 2**27}),
                base(seq=13, epoch=epoch, instance=Nest(990)),
                base(seq=14, epoch=epoch, requests=[{**r0, "id": Nest(990)}]),
                base(seq=15, epoch=epoch, kv=None, requests=[
                    {"id": "w", "state": "waiting", "prompt_tokens": 5, "computed_tokens": 0,
                     "output_tokens": 2**63 - 1}]),
                base(seq=16, epoch=epoch, kv=None, requests=[{**r0, "placeholders": 2**31}]),
            ]  # fmt: skip
            for i, d in enumerate(hostile):
                pub.publish(dumps(d))
                await wait_for(lambda i=i: c.stats().rejected_total >= i + 1)
                assert c.entry is good
            pub.publish(orjson.dumps(base(seq=17, epoch=epoch)))
            await wait_for(lambda: c.entry is not None and c.entry.seq == 17)
            tg.cancel_scope.cancel()
    finally:
        pub.close()
        await runner.cleanup()
    assert c.stats().rejected == {str(Reject.FIELD): len(hostile)}


# ------------------------------------------------------- document size


def test_a_document_beyond_the_size_cap_is_refused_unparsed() -> None:
    c = cache()
    assert c.offer_bytes(orjson.dumps(base())) is Outcome.ACCEPTED
    good = c.entry
    d = base(seq=6)
    d["requests"][0]["id"] = "r"
    # Valid JSON, valid fields: only its size is wrong (padding in whitespace).
    data = orjson.dumps(d)[:-1] + b" " * MAX_SNAPSHOT_BYTES + b"}"
    assert c.offer_bytes(data) is Outcome.REJECTED
    assert c.entry is good
    assert c.stats().rejected == {str(Reject.TOO_LARGE): 1}
    assert str(MAX_SNAPSHOT_BYTES) in (c.stats().last_reject or "")
    # Just under the cap, the same document is taken.
    small = orjson.dumps(d)
    assert c.offer_bytes(small[:-1] + b" " * (MAX_SNAPSHOT_BYTES - len(small)) + b"}") is (
        Outcome.ACCEPTED
    )
