"""The compiled snapshot scanner against the reference decoder: same snapshots, same errors."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bearsdk import SnapshotError
from bearsdk.snapshot import DECODER, Snapshot, decoders

DECODERS = decoders()
needs_c = pytest.mark.skipif("cython" not in DECODERS, reason="compiled decoder not built")


def outcome(name: str, data: bytes | str) -> tuple[str, Any]:
    try:
        s = DECODERS[name](data)
    except SnapshotError as exc:
        return "error", (str(exc), exc.field)
    return "ok", (s.to_dict(), s.table.tolist(), s.table.dtype.str, s.epoch)


def same(data: bytes | str) -> tuple[str, Any]:
    ref = outcome("python", data)
    for name in DECODERS:
        assert outcome(name, data) == ref, name
    return ref


@st.composite
def requests(draw: st.DrawFn) -> list[dict[str, Any]]:
    n_run = draw(st.integers(0, 6))
    n_wait = draw(st.integers(0, 4))
    out: list[dict[str, Any]] = []
    for i in range(n_run + n_wait):
        running = i < n_run
        prompt = draw(st.integers(1, 5000))
        output = draw(st.integers(0, 300)) if running else draw(st.sampled_from([0, 0, 7]))
        ph = draw(st.integers(0, 2)) if running else 0
        r: dict[str, Any] = {
            "id": draw(st.sampled_from([f"r{i}", f"req-{i}-é", f"{i}"])),
            "state": "running" if running else "waiting",
            "prompt_tokens": prompt,
            "computed_tokens": draw(st.integers(0, prompt + output + ph)) if running else 0,
            "output_tokens": output,
        }
        if draw(st.booleans()):
            r["max_tokens"] = output + draw(st.integers(1, 500))
        if draw(st.booleans()):
            cap = r.get("max_tokens", output + 1000)
            r["output_len"] = draw(st.integers(output + 1, cap))
        if ph or draw(st.booleans()):
            r["placeholders"] = ph
        out.append(r)
    return out


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    reqs = draw(requests())
    d: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": draw(st.sampled_from(["i0", "qwen3-8b-0", "ünï"])),
        "seq": draw(st.integers(0, 2**40)),
        "time": draw(st.floats(-1e12, 1e12, allow_nan=False) | st.integers(-(10**12), 10**12)),
        "requests": reqs,
    }
    if draw(st.booleans()):
        held = sum(-(-r["computed_tokens"] // 16) for r in reqs)
        nb = held + draw(st.integers(0, 1000)) + 1
        d["kv"] = {"block_size": 16, "num_blocks": nb, "free_blocks": draw(st.integers(0, nb))}
    if draw(st.booleans()):
        d["inflight"] = {"remaining_s": draw(st.floats(0, 1, allow_nan=False) | st.just(0))}
    if draw(st.booleans()):
        d["epoch"] = draw(st.sampled_from(["a1b2", "e", None]))
    if draw(st.booleans()):
        d["future"] = {"x": [1, 2.5, "s", None, True, {"y": []}]}
    return d


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch, max_size=3),
    max_leaves=8,
)


def paths(d: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(d, dict):
        for k, v in d.items():
            out += paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += paths(v, (*prefix, i))
    return out


def serialize(d: Any, style: int) -> bytes:
    if style == 0:
        return orjson.dumps(d)
    if style == 1:
        return json.dumps(d, indent=1, ensure_ascii=False).encode()
    if style == 2:
        return json.dumps(d, ensure_ascii=True, separators=(" ,", ": ")).encode()
    return (" \r\n\t" + json.dumps(d) + "\n ").encode()


@needs_c
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.integers(0, 3))
def test_valid_documents_decode_identically(d: dict[str, Any], style: int) -> None:
    kind, _ = same(serialize(d, style))
    assert kind == "ok"


@needs_c
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.data(), st.integers(0, 3))
def test_mutated_documents_agree(d: dict[str, Any], data: st.DataObject, style: int) -> None:
    """Replace, drop or retype any one value: same snapshot or the same error."""
    where = data.draw(st.sampled_from(paths(d)[1:]))
    parent: Any = d
    for k in where[:-1]:
        parent = parent[k]
    action = data.draw(st.sampled_from(["replace", "drop", "int-as-float"]))
    if action == "drop":
        del parent[where[-1]]
    elif action == "int-as-float" and type(parent[where[-1]]) is int:
        parent[where[-1]] = float(parent[where[-1]])
    else:
        parent[where[-1]] = data.draw(json_values)
    try:
        raw = serialize(d, style)
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return
    same(raw)


@needs_c
@pytest.mark.parametrize(
    "raw",
    [
        b'{"schema":"bear.snapshot/1","schema":"bear.snapshot/1","instance":"a","seq":1,'
        b'"time":0,"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],"seq":2}',
        b'{"schema":"bear.snapshot/1","instance":"a\\u0062","seq":1,"time":0,"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":1e400,"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],"x":1e400}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":18446744073709551615,"time":0,'
        b'"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":9223372036854775807,"time":0,'
        b'"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":-0,"time":-0.0,"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[]}x',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],}',
        b'{"schema":"bear.snapshot/1","instance":"\xed\xa0\x80","seq":1,"time":0,"requests":[]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],"x":"\\ud800"}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],"epoch":""}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],"epoch":3}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0.1e1,"requests":['
        b'{"id":"r","state":"running","prompt_tokens":9223372036854775807,'
        b'"computed_tokens":0,"output_tokens":0}]}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],'
        b'"inflight":{"remaining_s":0,"remaining_s":1}}',
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":[],'
        b'"inflight":{"remaining_s":-0.0,"other":[1,{"a":null}]}}',
        b"\xef\xbb\xbf{}",
        b"",
        b"   ",
        b"[]",
        b"null",
        b"NaN",
    ],
)
def test_edge_cases_agree(raw: bytes) -> None:
    same(raw)
    same(raw.decode("utf-8", errors="surrogateescape"))


@needs_c
def test_int64_overflow_is_a_field_error() -> None:
    raw = (
        b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,"requests":['
        b'{"id":"r","state":"running","prompt_tokens":18446744073709551615,'
        b'"computed_tokens":0,"output_tokens":0}]}'
    )
    kind, (msg, field) = same(raw)
    assert kind == "error"
    assert field == "requests[0].prompt_tokens"
    assert "16777216" in msg  # the cap on a request's tokens (MAX_REQUEST_TOKENS)


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_agree(raw: bytes) -> None:
    same(raw)


@needs_c
def test_scanner_takes_typical_documents() -> None:
    """The fast path must actually decode what publishers send (not defer everything)."""
    from bearsdk import _snapshot_c

    snap = Snapshot.build(
        [
            {
                "id": "a",
                "state": "running",
                "prompt_tokens": 10,
                "computed_tokens": 10,
                "output_tokens": 3,
                "max_tokens": 50,
                "placeholders": 1,
            },
            {
                "id": "b",
                "state": "waiting",
                "prompt_tokens": 5,
                "computed_tokens": 0,
                "output_tokens": 0,
            },
        ],
        instance="x",
        seq=7,
        time=1764480000.5,
        epoch="e1",
        inflight_remaining_s=0.004,
    )
    parts = _snapshot_c.decode(snap.to_json())
    assert parts is not None
    assert parts[0] == "x"
    assert parts[7] == "e1"
    assert np.array_equal(parts[5], snap.table)
    assert DECODER == "cython"


def test_epoch_round_trips() -> None:
    for dec in DECODERS.values():
        snap = dec(
            b'{"schema":"bear.snapshot/1","instance":"a","seq":1,"time":0,'
            b'"requests":[],"epoch":"e7"}'
        )
        assert snap.epoch == "e7"
        assert dec(snap.to_json()).epoch == "e7"
        assert math.isfinite(snap.time)
