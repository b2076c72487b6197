"""SnapshotCache: ordering, restarts, rejections (counted, logged), prepared state, fuzzing."""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bearsdk import BEAEstimator
from bearsdk.estimators import BatchTimeModel
from bearsdk.state import Outcome, Reject, SnapshotCache

BT = BatchTimeModel(4e-3, 2e-5, 5e-8, 1e-10)


def estimator() -> BEAEstimator:
    return BEAEstimator.for_scheduler(
        "vllm-v1", BT, {"max_num_batched_tokens": 2048, "max_num_seqs": 16}
    )


def doc(seq: int, *, epoch: str | None = "e1", n: int = 2, **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "eng-0",
        "seq": seq,
        "time": 1000.0 + seq,
        "kv": {"block_size": 16, "num_blocks": 1000, "free_blocks": 900},
        "requests": [
            {
                "id": f"r{i}",
                "state": "running",
                "prompt_tokens": 100 + i,
                "computed_tokens": 100 + i,
                "output_tokens": 1,
                "max_tokens": 50,
            }
            for i in range(n)
        ],
    }
    if epoch is not None:
        d["epoch"] = epoch
    d.update(over)
    return d


def raw(seq: int, **kw: Any) -> bytes:
    return orjson.dumps(doc(seq, **kw))


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(**kw: Any) -> SnapshotCache:
    kw.setdefault("clock", Clock())
    return SnapshotCache("eng-0", **kw)


def test_follows_seq_and_keeps_the_latest() -> None:
    c = make()
    assert c.version == 0
    assert math.isinf(c.age())
    assert c.offer_bytes(raw(1)) is Outcome.ACCEPTED
    assert c.offer_bytes(raw(3)) is Outcome.ACCEPTED
    assert c.offer_bytes(raw(3)) is Outcome.UNCHANGED
    assert c.offer_bytes(raw(2)) is Outcome.REJECTED
    entry = c.entry
    assert entry is not None
    assert entry.seq == 3
    s = c.stats()
    assert (s.accepted, s.unchanged, s.restarts) == (2, 1, 0)
    assert s.rejected == {"stale-seq": 1}
    assert "must be > the cached 3" in (s.last_reject or "")


def test_outcome_truthiness() -> None:
    assert Outcome.ACCEPTED
    assert not Outcome.UNCHANGED
    assert not Outcome.REJECTED


def test_new_epoch_is_a_restart() -> None:
    c = make()
    c.offer_bytes(raw(50, epoch="a"))
    assert c.offer_bytes(raw(0, epoch="b"))
    assert c.entry is not None
    assert c.entry.restarted
    assert c.stats().restarts == 1
    # the same epoch again: normal ordering resumes
    assert not c.offer_bytes(raw(0, epoch="b"))
    assert c.offer_bytes(raw(1, epoch="b"))


def test_without_epoch_only_a_fresh_connection_restarts() -> None:
    c = make()
    c.offer_bytes(raw(50, epoch=None))
    assert c.offer_bytes(raw(3, epoch=None)) is Outcome.REJECTED
    assert c.offer_bytes(raw(3, epoch=None), fresh_connection=True) is Outcome.ACCEPTED
    assert c.stats().restarts == 1
    # a fresh connection to the same run: same seq is unchanged, not a restart
    assert c.offer_bytes(raw(3, epoch=None), fresh_connection=True) is Outcome.UNCHANGED


def test_counting_up_stale_run_becomes_a_restart() -> None:
    c = make(restart_after_stale=3)
    c.offer_bytes(raw(100, epoch=None))
    outs = [c.offer_bytes(raw(s, epoch=None)) for s in (1, 2, 3, 4)]
    assert outs == [Outcome.REJECTED] * 3 + [Outcome.ACCEPTED]
    assert c.entry is not None
    assert c.entry.seq == 4
    # a non-monotone stale run never restarts
    c2 = make(restart_after_stale=2)
    c2.offer_bytes(raw(100, epoch=None))
    assert not any(c2.offer_bytes(raw(s, epoch=None)) for s in (5, 4, 5, 4, 5, 4))


@pytest.mark.parametrize(
    ("data", "reason", "field"),
    [
        (b"{not json", Reject.MALFORMED, "not valid JSON"),
        (b"[1, 2]", Reject.MALFORMED, "JSON object"),
        (orjson.dumps(doc(9, schema="bear.snapshot/2")), Reject.SCHEMA, "schema"),
        (orjson.dumps(doc(-1)), Reject.FIELD, "seq"),
        (orjson.dumps(doc(9, epoch="")), Reject.FIELD, "epoch"),
        (
            orjson.dumps(doc(9, kv={"block_size": 16, "num_blocks": 1, "free_blocks": 0})),
            Reject.FIELD,
            "kv.num_blocks",
        ),
    ],
)
def test_bad_snapshots_are_rejected_counted_and_logged(
    data: bytes, reason: Reject, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    c = make()
    c.offer_bytes(raw(5))
    before = c.entry
    with caplog.at_level(logging.WARNING, logger="bearsdk.state.cache"):
        assert c.offer_bytes(data, source="test") is Outcome.REJECTED
    assert c.entry is before
    assert c.stats().rejected == {str(reason): 1}
    assert field in caplog.text
    assert str(reason) in caplog.text


def test_logging_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    c = make()
    with caplog.at_level(logging.WARNING, logger="bearsdk.state.cache"):
        for _ in range(50):
            c.offer_bytes(b"garbage")
    assert c.stats().rejected == {"malformed": 50}
    assert len(caplog.records) == 1


def test_instance_guard() -> None:
    c = make(expect_instance="other")
    assert c.offer_bytes(raw(1)) is Outcome.REJECTED
    assert c.stats().rejected == {"instance": 1}


def test_prepared_once_and_reused() -> None:
    est = estimator()
    c = make(estimator=est)
    c.offer_bytes(raw(1, n=3))
    e = c.entry
    assert e is not None
    assert e.prepared is not None
    assert e.prepared.snapshot is e.snapshot
    # reads hand out the same prepared object; no work on the read path
    assert c.entry is e
    assert est.ttft(e.prepared, 100, 10) > 0


def test_unreplayable_snapshot_is_rejected() -> None:
    est = BEAEstimator.for_scheduler("vllm-v1", BT, {"num_gpu_blocks": 10, "block_size": 16})
    c = make(estimator=est)
    # no kv in the snapshot: the policy's 10 blocks cannot hold the running requests
    assert c.offer_bytes(raw(1, n=3, kv=None)) is Outcome.REJECTED
    assert c.stats().rejected == {"unreplayable": 1}
    assert c.entry is None


def test_age_uses_capture_time_with_bounded_transit() -> None:
    clock = Clock(1000.0)
    c = make(clock=clock, max_transit_s=0.5)
    c.offer_bytes(raw(1, time=999.9))  # 100 ms in transit
    assert c.age() == pytest.approx(0.1)
    clock.t = 1001.0
    assert c.age() == pytest.approx(1.1)
    c.offer_bytes(raw(2, time=500.0))  # a skewed engine clock: transit capped
    assert c.entry is not None
    assert c.entry.captured == pytest.approx(1001.0 - 0.5)
    c.offer_bytes(raw(3, time=5000.0))  # an engine clock ahead: no negative transit
    assert c.age() == 0.0


async def test_wait_version() -> None:
    c = make()
    async with anyio.create_task_group() as tg:

        async def feed() -> None:
            await anyio.sleep(0.01)
            c.offer_bytes(raw(7))

        tg.start_soon(feed)
        with anyio.fail_after(5):
            e = await c.wait_version(0)
    assert e.seq == 7
    assert (await c.wait_version(0)).seq == 7


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=5),
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=5), ch, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_never_crashes_or_corrupts(data: st.DataObject) -> None:
    """Any bytes or one-field mutation: a clean outcome; a rejection leaves the cache as it was."""
    c = make(estimator=estimator())
    c.offer_bytes(raw(10, n=2))
    good = c.entry
    assert good is not None
    kind = data.draw(st.sampled_from(["bytes", "mutate", "truncate"]))
    if kind == "bytes":
        payload = data.draw(st.binary(max_size=200))
    else:
        d = doc(data.draw(st.integers(0, 20)), n=data.draw(st.integers(0, 3)))
        if kind == "mutate":
            target = d if data.draw(st.booleans()) or not d["requests"] else d["requests"][0]
            key = data.draw(st.sampled_from([*target.keys(), "extra"]))
            target[key] = data.draw(json_values)
        try:
            payload = orjson.dumps(d, option=orjson.OPT_NON_STR_KEYS)
        except orjson.JSONEncodeError:
            return
        if kind == "truncate":
            payload = payload[: data.draw(st.integers(0, len(payload)))]
    stats = c.stats()
    out = c.offer_bytes(payload)
    after = c.stats()
    if out is Outcome.ACCEPTED:
        e = c.entry
        assert e is not None
        assert e.version == good.version + 1
        assert e.prepared is not None
        assert e.snapshot.table.shape == (len(e.snapshot.ids), 7)
    else:
        assert c.entry is good
        assert good.snapshot.seq == 10
        assert after.accepted == stats.accepted
        if out is Outcome.REJECTED:
            assert after.rejected_total == stats.rejected_total + 1
