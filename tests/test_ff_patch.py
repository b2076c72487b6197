"""Fast-forwarded views patched between batches (``FastForward(patch_views=True)``).

While the virtual engine runs no batch, the only changes to its requests are
the router's dispatches arriving at the end of the waiting queue and requests
it saw complete: the next view is the last one patched, so that a decision
after a dispatch costs O(changes), not O(requests). Every view must be what
exporting the engine whole gives, whatever the order of dispatches,
completions, anchors, step ends and batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bearsdk.estimators import BatchTimeModel, BEAEstimator, RememberedLengths
from bearsdk.estimators.length import resolve_output_lengths
from bearsdk.snapshot import COL_OUTPUT_LEN, snapshot_from_dict
from bearsdk.state import Dispatch, FastForward

BT = BatchTimeModel(4e-3, 2.2e-5, 5e-8, 1.2e-10)
T0 = 100.0


def _snapshot(running: list[tuple[int, int, int]], waiting: list[int], kv: bool) -> Any:
    rows: list[dict[str, Any]] = []
    for i, (prompt, out, length) in enumerate(running):
        rows.append(
            {
                "id": f"chatcmpl-bear-00000000-{i:010d}" if i % 2 else f"r{i}",
                "state": "running",
                "prompt_tokens": prompt,
                "computed_tokens": prompt + out - 1,
                "output_tokens": out,
                "output_len": max(length, out + 1),
            }
        )
    for j, prompt in enumerate(waiting):
        rows.append(
            {
                "id": f"w{j}",
                "state": "waiting",
                "prompt_tokens": prompt,
                "computed_tokens": 0,
                "output_tokens": 0,
            }
        )
    doc: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "x",
        "seq": 1,
        "time": T0,
        "requests": rows,
        "inflight": {"remaining_s": 0.003},
    }
    if kv:
        doc["kv"] = {"block_size": 16, "num_blocks": 3000, "free_blocks": 1500}
    return snapshot_from_dict(doc)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("wait"), st.floats(0.0, 0.004)),  # mostly within one batch
        st.tuples(st.just("wait"), st.floats(0.004, 0.05)),
        st.tuples(st.just("send"), st.integers(1, 3000), st.integers(1, 40)),
        st.tuples(st.just("done"), st.integers(0, 1000)),
        st.tuples(st.just("first"), st.integers(0, 1000), st.floats(-0.003, 0.003)),
        st.tuples(st.just("step"), st.floats(-0.002, 0.002)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    running=st.lists(
        st.tuples(st.integers(1, 3000), st.integers(1, 50), st.integers(2, 60)), max_size=12
    ),
    waiting=st.lists(st.integers(1, 3000), max_size=8),
    kv=st.booleans(),
    budget=st.sampled_from([256, 2048]),
    ops=OPS,
)
def test_patched_views_are_the_engine_exported_whole(
    running: list[tuple[int, int, int]],
    waiting: list[int],
    kv: bool,
    budget: int,
    ops: list[tuple[Any, ...]],
) -> None:
    snap = _snapshot(running, waiting, kv)
    ffs = []
    for patch in (True, False):
        # Lengths the router remembers (its requests stay pinned: some are kept
        # on past their prediction, which a view predicts again).
        lengths = RememberedLengths(mean=30.0, residual=4)
        for i in range(1, len(running), 2):
            lengths.remember(f"bear-00000000-{i:010d}", 5 + i)
        est = BEAEstimator.for_scheduler(
            "vllm-v1",
            BT,
            {"max_num_batched_tokens": budget, "max_num_seqs": 16},
            length_predictor=lengths,
        )
        ffs.append((FastForward(snap, est, T0, patch_views=patch), lengths))
    now = T0
    sent: list[Dispatch] = []
    names = [rid for rid in snap.ids]
    for op in ops:
        kind = op[0]
        if kind == "wait":
            now += op[1]
        elif kind == "send":
            rid = f"bear-00000001-{len(sent):010d}"
            sent.append(Dispatch(rid, now, op[1], op[2], None))
            names.append(rid)
        for ff, lengths in ffs:
            if kind == "send":
                lengths.remember(sent[-1].rid, op[2])
            elif kind == "done" and names:
                ff.complete(names[op[1] % len(names)].removeprefix("chatcmpl-"))
            elif kind == "first" and names:
                ff.first_token(names[op[1] % len(names)], now - T0 + op[2], now)
            elif kind == "step":
                ff.step_end(max(0.0, now - T0 + op[1]), now)
            ff.advance(now, sent)
        (a, _), (b, _) = ffs
        va, vb = a.at(now), b.at(now)
        assert va.ids == vb.ids, op
        assert np.array_equal(va.table, vb.table), op
        assert va.kv == vb.kv
        assert va.inflight_remaining_s == vb.inflight_remaining_s
        assert a.exact_for(va, BT.b0) == b.exact_for(vb, BT.b0)
        # The patched count of tokens to go is what the view's rows say.
        assert a.exact_for(va, BT.b0) == FastForward.exact_for(a, vb, BT.b0)
        # A view is prepared unchecked (``lengths_known``): every length there.
        assert not len(va) or va.table[:, COL_OUTPUT_LEN].min() >= 1
        assert np.array_equal(
            resolve_output_lengths(va.table, a.estimator.length_predictor, va.ids), va.table
        )


def test_a_dispatch_between_batches_patches_the_view() -> None:
    """Not vacuous: a dispatch and a completion while no batch runs patch the
    last view (the rows it kept are the same objects), a batch rebuilds it."""
    snap = _snapshot([(500, 3, 40)] * 4, [800] * 3, kv=True)
    est = BEAEstimator.for_scheduler("vllm-v1", BT, {"max_num_batched_tokens": 2048})
    ff = FastForward(snap, est, T0)
    now = T0 + 0.0035  # the batch in flight at capture ended, the next one runs
    ff.advance(now, [])
    first = ff.at(now)
    sent = [Dispatch("bear-00000001-0000000001", now + 1e-4, 700, 30, None)]
    ff.advance(now + 2e-4, sent)
    ff.complete("w1")
    patched = ff.at(now + 2e-4)
    assert ff._export is not None
    assert not ff._dirty
    assert patched.ids == (*[i for i in first.ids if i != "w1"], sent[0].rid)
    assert patched.table[-1].tolist() == [1, 700, 0, 0, -1, 30, 0]
    ff.advance(now + 0.05, sent)  # batches run: the next view is exported whole
    assert ff._dirty
    ff.at(now + 0.05)
    assert not ff._dirty


def test_the_dispatch_bench_sends_each_decision_and_patches_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bearsdk.bench.decisions import dispatch_cost

    patched: list[bool] = []
    whole_or_patched = FastForward._rows

    def rows(self: FastForward) -> Any:
        patched.append(self._export is not None and not self._dirty)
        return whole_or_patched(self)

    monkeypatch.setattr(FastForward, "_rows", rows)
    r = dispatch_cost(10, 40)
    assert r["decisions"] == 40
    assert r["sent"]["median_us"] > 0.0
    assert r["not_sent"]["median_us"] > 0.0
    assert any(patched)  # views rebuilt after dispatches, patched between batches
    assert not all(patched)
