"""bear.snapshot/1 decoding: strict validation, clear errors, round trips."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk import SnapshotError
from bearsdk.snapshot import (
    COL_OUTPUT_LEN,
    COL_STATE,
    KVState,
    RequestState,
    Snapshot,
    decode_snapshot,
    snapshot_from_dict,
)


def doc(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "qwen3-8b-0",
        "seq": 1234,
        "time": 1764480000.123,
        "kv": {"block_size": 16, "num_blocks": 30000, "free_blocks": 12000},
        "requests": [
            {
                "id": "r1",
                "state": "running",
                "prompt_tokens": 700,
                "computed_tokens": 512,
                "output_tokens": 0,
                "max_tokens": 256,
            },
            {
                "id": "r2",
                "state": "waiting",
                "prompt_tokens": 90,
                "computed_tokens": 0,
                "output_tokens": 0,
                "max_tokens": 64,
                "output_len": 41,
            },
        ],
    }
    d.update(over)
    return d


def test_contract_example_decodes() -> None:
    s = decode_snapshot(orjson.dumps(doc()))
    assert s.instance == "qwen3-8b-0"
    assert s.seq == 1234
    assert s.kv == KVState(16, 30000, 12000)
    assert s.ids == ("r1", "r2")
    assert s.num_running == 1
    assert s.num_waiting == 1
    assert s.table[1, COL_OUTPUT_LEN] == 41
    assert s.table[0, COL_OUTPUT_LEN] == -1
    assert s.table[:, COL_STATE].tolist() == [0, 1]
    assert not s.table.flags.writeable


def test_round_trip() -> None:
    d = doc(inflight={"remaining_s": 0.004})
    s = snapshot_from_dict(d)
    again = decode_snapshot(s.to_json())
    assert again.to_dict() == s.to_dict()
    assert again.inflight_remaining_s == 0.004
    assert s.requests()[1] == RequestState("r2", "waiting", 90, 0, 0, 64, 41)


def test_unknown_top_level_keys_are_ignored() -> None:
    assert len(snapshot_from_dict(doc(future_field={"x": 1}))) == 2


@pytest.mark.parametrize(
    ("mutate", "field", "value"),
    [
        (lambda d: d.update(schema="bear.snapshot/2"), "schema", "bear.snapshot/2"),
        (lambda d: d.update(seq=-1), "seq", -1),
        (lambda d: d.update(seq=True), "seq", True),
        (lambda d: d.update(time=math.nan), "time", math.nan),
        (lambda d: d["kv"].update(free_blocks=30001), "kv.free_blocks", 30001),
        (lambda d: d["kv"].update(colour="red"), "kv.colour", "red"),
        (lambda d: d["requests"][0].update(computed_tokens=-3), "requests[0].computed_tokens", -3),
        (lambda d: d["requests"][0].update(state="paused"), "requests[0].state", "paused"),
        (lambda d: d["requests"][0].update(priority=3), "requests[0].priority", 3),
        (lambda d: d["requests"][1].update(computed_tokens=5), "requests[1].computed_tokens", 5),
        (lambda d: d["requests"][1].update(output_len=65), "requests[1].output_len", 65),
        (lambda d: d["requests"][1].update(id="r1"), "requests[1].id", "r1"),
        (lambda d: d["requests"].reverse(), "requests[1].state", "running"),
        (lambda d: d["requests"][0].pop("prompt_tokens"), "requests[0].prompt_tokens", None),
    ],
)
def test_bad_fields_are_named(mutate: Any, field: str, value: object) -> None:
    d = doc()
    mutate(d)
    with pytest.raises(SnapshotError) as ei:
        snapshot_from_dict(d)
    assert ei.value.field == field
    assert field in str(ei.value)
    if value is not None and not (isinstance(value, float) and math.isnan(value)):
        assert repr(value) in str(ei.value)


def test_malformed_json() -> None:
    with pytest.raises(SnapshotError, match="not valid JSON"):
        decode_snapshot(b'{"schema": "bear.snapshot/1", ')


def test_build_validates() -> None:
    with pytest.raises(SnapshotError, match=r"requests\[0\].output_tokens"):
        Snapshot.build(
            [
                {
                    "id": "a",
                    "state": "running",
                    "prompt_tokens": 5,
                    "computed_tokens": 1,
                    "output_tokens": -1,
                }
            ]
        )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["schema", "instance", "seq", "time", "kv", "requests", "inflight", "x"]),
        json_values,
    ),
    st.booleans(),
)
def test_decoder_never_crashes(d: dict[str, Any], fix_schema: bool) -> None:
    """Any JSON document either decodes to a valid snapshot or raises SnapshotError."""
    if fix_schema:
        d["schema"] = "bear.snapshot/1"
    try:
        s = decode_snapshot(orjson.dumps(d, option=orjson.OPT_NON_STR_KEYS))
    except SnapshotError:
        return
    except orjson.JSONEncodeError:
        return
    assert len(s.ids) == s.table.shape[0]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_survives_garbage_bytes(data: bytes) -> None:
    with contextlib.suppress(SnapshotError):
        decode_snapshot(data)
