"""Every accepted snapshot replays in bounded work (issue 19).

States no engine can be in are refused when a snapshot is prepared; a replay
that reaches its work bound stops with a lower bound of the TTFT, flagged as
such, in both implementations.
"""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

import bearsdk
from bearsdk.estimators import BatchTimeModel, BEAEstimator
from bearsdk.replay import StopReason, implementations
from bearsdk.replay.types import MAX_REPLAY_WORK, MAX_REPLAY_WORK_PY
from bearsdk.schedulers import compile_scheduler
from bearsdk.snapshot import COLUMNS
from bearsdk.state import SnapshotCache

COEFFS = (4e-3, 2.2e-5, 5e-8, 1.2e-10)
BT = BatchTimeModel(*COEFFS)


def running(n: int, prompt: int = 1000, outputs: int = 24, output_len: int = 1024) -> np.ndarray:
    row = {
        "state": 0,
        "prompt_tokens": prompt,
        "computed_tokens": prompt + outputs - 1,
        "output_tokens": outputs,
        "max_tokens": -1,
        "output_len": output_len,
        "placeholders": 0,
    }
    return np.array([[row[c] for c in COLUMNS]] * n, dtype=np.int64)


def doc(n: int, seq: int = 1) -> bytes:
    reqs = [
        {
            "id": f"r{i}",
            "state": "running",
            "prompt_tokens": 1000,
            "computed_tokens": 1023,
            "output_tokens": 24,
            "output_len": 1024,
        }
        for i in range(n)
    ]
    d = {"schema": "bear.snapshot/1", "instance": "x", "seq": seq, "time": 0.0, "requests": reqs}
    return orjson.dumps(d)


def test_more_running_than_seats_is_refused(impl: str) -> None:
    rp = compile_scheduler(bearsdk.bind_scheduler("vllm-v1", {"max_num_seqs": 128}), impl)
    rp.prepare(running(128))  # at the limit: a real state
    with pytest.raises(ValueError, match=r"129 running.*max_num_seqs 128"):
        rp.prepare(running(129))


def test_cache_counts_the_refusal_and_keeps_the_good_snapshot(impl: str) -> None:
    est = BEAEstimator.for_scheduler("vllm-v1", BT, {"max_num_seqs": 128}, implementation=impl)
    cache = SnapshotCache("x", estimator=est)
    assert cache.offer_bytes(doc(64, seq=1))
    assert not cache.offer_bytes(doc(4096, seq=2))
    entry = cache.entry
    assert entry is not None
    assert entry.seq == 1
    stats = cache.stats()
    assert stats.rejected_total == 1
    assert stats.last_reject is not None
    assert "4096 running" in stats.last_reject
    assert len(stats.last_reject) < 1024


@pytest.mark.parametrize("scheduler", ["vllm-v1", "sarathi", "prefill-first"])
def test_work_bound_returns_a_lower_bound(impl: str, scheduler: str) -> None:
    # Every seat taken: the new request waits ~1000 batches for one.
    rp = compile_scheduler(bearsdk.bind_scheduler(scheduler, {"max_num_seqs": 64}), impl)
    prep = rp.prepare(running(64))
    full = rp.replay(prep, 2048, 100, COEFFS)
    assert full.stop_reason is StopReason.FIRST_TOKEN
    assert not full.lower_bound
    cut = rp.replay(prep, 2048, 100, COEFFS, max_work=2)
    assert cut.stop_reason is StopReason.BATCH_LIMIT
    assert cut.lower_bound
    assert cut.first_token_batch == 0
    assert 0 < cut.ttft_s < full.ttft_s


def test_batch_limit_returns_a_lower_bound(impl: str) -> None:
    rp = compile_scheduler(bearsdk.bind_scheduler("vllm-v1", {"max_num_seqs": 64}), impl)
    prep = rp.prepare(running(64))
    full = rp.replay(prep, 2048, 100, COEFFS)
    cut = rp.replay(prep, 2048, 100, COEFFS, max_batches=3, record=True)
    assert cut.stop_reason is StopReason.BATCH_LIMIT
    assert cut.batches is not None
    assert len(cut.batches) == 3
    assert cut.ttft_s == pytest.approx(sum(b.duration_s for b in cut.batches))
    assert 0 < cut.ttft_s < full.ttft_s


def test_twins_agree_on_the_batch_limit() -> None:
    impls = implementations()
    if "cython" not in impls:
        pytest.skip("compiled replay not built")
    out = []
    for name in ("python", "cython"):
        rp = impls[name](bearsdk.bind_scheduler("vllm-v1", {"max_num_seqs": 64}))
        prep = rp.prepare(running(64))
        out.append(rp.replay(prep, 2048, 100, COEFFS, max_batches=5, record=True))
    assert out[0].batches == out[1].batches
    assert out[0].ttft_s == pytest.approx(out[1].ttft_s)


def test_work_bound_must_be_an_integer(impl: str) -> None:
    rp = compile_scheduler(bearsdk.bind_scheduler("vllm-v1"), impl)
    prep = rp.prepare(running(4))
    with pytest.raises(ValueError, match="max_work"):
        rp.replay(prep, 16, 1, COEFFS, max_work=1.5)  # type: ignore[arg-type]


def test_the_twin_bound_is_the_larger() -> None:
    assert MAX_REPLAY_WORK_PY > MAX_REPLAY_WORK


def test_estimator_flags_a_replay_cut_by_the_default_bound() -> None:
    # Prefills with several tokens in flight (a forged state): the compiled loop
    # replays them on its exact path, past the default bound.
    if "cython" not in implementations():
        pytest.skip("compiled replay not built")
    reqs = [
        {
            "id": f"r{i}",
            "state": "running",
            "prompt_tokens": 16000,
            "computed_tokens": 15000,
            "output_tokens": 0,
            "output_len": 4096,
            "placeholders": 3,
        }
        for i in range(2048)
    ]
    d = {
        "schema": "bear.snapshot/1",
        "instance": "x",
        "seq": 1,
        "time": 0.0,
        "requests": reqs,
        "kv": {"block_size": 16, "num_blocks": 2048 * 1001, "free_blocks": 10},
    }
    params = {"max_num_seqs": 2048, "max_num_batched_tokens": 2048}
    est = BEAEstimator.for_scheduler("vllm-v1", BT, params, implementation="cython")
    cache = SnapshotCache("x", estimator=est)
    assert cache.offer_bytes(orjson.dumps(d)), cache.stats().last_reject
    entry = cache.entry
    assert entry is not None
    assert entry.prepared is not None
    e = est.estimate(entry.prepared, 2048, 100)
    assert e.stop_reason is StopReason.BATCH_LIMIT
    assert e.lower_bound
    assert math.isfinite(e.ttft_s)
    assert e.ttft_s > 0
    assert est.ttft(entry.prepared, 2048, 100) == pytest.approx(e.ttft_s)


def prefills_with_a_token_in_flight(n: int) -> np.ndarray:
    tab = running(n, prompt=1024, outputs=0)
    tab[:, COLUMNS.index("computed_tokens")] = 1001
    tab[:, COLUMNS.index("placeholders")] = 1
    return tab


def test_a_placeholder_pins_the_exact_path_only_until_it_lands() -> None:
    impls = implementations()
    if "cython" not in impls:
        pytest.skip("compiled replay not built")
    pol = bearsdk.bind_scheduler("vllm-v1", {"max_num_seqs": 256, "max_num_batched_tokens": 2048})
    tab = prefills_with_a_token_in_flight(256)
    ref = impls["python"](pol)
    big = 1 << 40  # the exact path all the way takes more than the default bound
    want = ref.replay(ref.prepare(tab), 2048, 100, COEFFS, record=True, max_work=big)
    c = impls["cython"](pol)
    runs = {}
    for slow in (False, True):
        c.force_slow = slow
        try:
            got = c.replay(c.prepare(tab), 2048, 100, COEFFS, record=True, max_work=big)
            runs[slow] = (got, c.last_work)
        finally:
            c.force_slow = False
    for got, _ in runs.values():
        assert got.batches == want.batches
        assert got.ttft_s == pytest.approx(want.ttft_s, rel=1e-9)
    # Once the in-flight tokens are delivered the aggregate takes over again:
    # far less work than the exact path all the way.
    assert runs[False][1] * 4 < runs[True][1]
