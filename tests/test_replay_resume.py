"""Resuming a replay from the state kept before the new request was first examined.

The compiled loop keeps, on a prepared snapshot, the state at the top of the
last loop turn before admission first reached the new request; later ``ttft``
calls on that snapshot (an arrival joining at the same batch's end, the same
coefficients and replayer, a horizon past that turn) start there instead of at
the snapshot (``docs/decision-cost.md``). Checked: every answer equals the
twin's from the snapshot, whatever mix of requests, horizons, arrivals and
coefficients follows on one prepared snapshot; it resumes where it should, and
not where it must not.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_horizon_stops import _sized
from test_replay_property import COEFFS, builtin_policy, custom_policy, workload

from bearsdk.replay import implementations
from bearsdk.replay.types import MAX_REPLAY_WORK
from bearsdk.schedulers import BoundScheduler, bind_scheduler, compile_scheduler
from bearsdk.snapshot import NCOLS

pytestmark = pytest.mark.skipif(
    "cython" not in implementations(), reason="compiled replay not built"
)

OTHER_COEFFS = (0.004, 3e-5, 5e-8, 1e-10, 0.0, 1.0)
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(got: float, want: float) -> bool:
    if math.isinf(want):
        return math.isinf(got)
    return got == pytest.approx(want, rel=1e-9, abs=1e-12)


@st.composite
def _calls(draw: st.DrawFn, span: float) -> list[tuple[int, int, int, float, float, Any]]:
    """New requests replayed one after another on one prepared snapshot: prompt,
    output, output cap, horizon, arrival, coefficients (mostly repeated, so that
    resuming is exercised, sometimes changed, so that it must not be)."""
    span = span or 1.0
    arrivals = st.sampled_from([0.0, span * 1e-4, span * 0.2, span * 0.7])
    usual = draw(arrivals)
    calls = []
    for _ in range(draw(st.integers(3, 10))):
        odd = draw(st.integers(0, 4)) == 0
        calls.append(
            (
                draw(st.integers(1, 3000)),
                draw(st.integers(1, 300)),
                draw(st.sampled_from([-1, -1, 1, 7, 300])),
                draw(st.sampled_from([math.inf, math.inf, span * 0.3, span * 0.9, span * 3])),
                draw(arrivals) if odd else usual,
                draw(st.sampled_from([COEFFS, OTHER_COEFFS])) if odd else COEFFS,
            )
        )
    return calls


def _check(pol: BoundScheduler, w: dict[str, Any], data: st.DataObject) -> None:
    """Each call on one prepared snapshot against the same call on a fresh one,
    with resuming off (the twins' agreement is test_replay_property's)."""
    pol = _sized(pol, w)
    c, ref = _compiled(pol), _compiled(pol)
    ref.resume = False
    # Its exact per-request path too (every request materialised).
    c.force_slow = ref.force_slow = data.draw(st.booleans())
    span = ref.ttft(ref.prepare(w["table"]), w["prompt"], w["out"], COEFFS)
    calls = data.draw(_calls(span if math.isfinite(span) else 1.0))
    cp = c.prepare(w["table"])
    follow = w["follow"]
    for k, (prompt, out, cap, horizon, arrival, co) in enumerate(calls):
        where = f"policy {pol}\ncall {(prompt, out, cap, horizon, arrival, co)}"
        if k % 3 == 2:
            # replay() resumes too (unrecorded), following tokens past the first.
            args = (prompt, out, co)
            kw = {"max_tokens": cap, "horizon_s": horizon, "arrival_s": arrival}
            r = ref.replay(ref.prepare(w["table"]), *args, next_tokens=follow, **kw)
            g = c.replay(cp, *args, next_tokens=follow, **kw)
            if max(c.last_work, ref.last_work) >= MAX_REPLAY_WORK:
                continue
            where += f" following {follow}: resumed {c.last_resumed}"
            assert g.stop_reason == r.stop_reason, where
            assert g.first_token_batch == r.first_token_batch, where
            assert _same(g.ttft_s, r.ttft_s), where
            assert g.token_batches == r.token_batches, where
            assert g.token_times_s == pytest.approx(r.token_times_s, rel=1e-9, abs=1e-12), where
            continue
        want = ref.ttft(ref.prepare(w["table"]), prompt, out, co, cap, None, horizon, arrival)
        got = c.ttft(cp, prompt, out, co, cap, None, horizon, arrival)
        if max(c.last_work, ref.last_work) >= MAX_REPLAY_WORK:
            # Stopped by the work bound, a safety valve: a lower bound either way,
            # where the count of work units is not the same on both paths.
            continue
        assert _same(got, want), (
            f"{where}: resumed {c.last_resumed}: {got}, from the snapshot {want}"
        )


@st.composite
def queued(draw: st.DrawFn, pol: BoundScheduler) -> dict[str, Any]:
    """:func:`workload` with a queue ahead of the new request several batches
    long: where a replay has a state to resume from."""
    w = draw(workload(pol))
    mml = pol.max_model_len
    plim = (mml - 2) if mml else 3000
    rows = [list(r) for r in w["table"]]
    for _ in range(draw(st.integers(4, 30))):
        prompt = draw(st.integers(1, max(1, min(plim, 4 * pol.token_budget))))
        total = draw(st.integers(1, max(1, min((mml - prompt) if mml else 300, 300))))
        rows.append([1, prompt, 0, 0, -1 if draw(st.booleans()) else total, total, 0])
    w["table"] = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    return w


@pytest.mark.parametrize("name", ["vllm-v1", "sarathi", "prefill-first"])
@SETTINGS
@given(data=st.data())
def test_resumed_replays_equal_the_twins_builtin(name: str, data: st.DataObject) -> None:
    pol = data.draw(builtin_policy(name))
    _check(pol, data.draw(queued(pol)), data)


@SETTINGS
@given(data=st.data())
def test_resumed_replays_equal_the_twins_custom(data: st.DataObject) -> None:
    pol = data.draw(custom_policy())
    _check(pol, data.draw(queued(pol)), data)


def _deep(waiting: int = 60) -> np.ndarray:
    """16 decoding requests and a long FCFS queue of prompts ahead of the new one."""
    rows = [[0, 1000, 1000 + 20 + i, 20 + i, -1, 400, 1] for i in range(16)]
    rows += [[1, 1500 + 37 * i, 0, 0, -1, 200, 0] for i in range(waiting)]
    return np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)


def _compiled(pol: BoundScheduler) -> Any:
    """A compiled replayer of its own (compile_scheduler shares one per policy)."""
    return implementations()["cython"](pol)


def _policy() -> BoundScheduler:
    return bind_scheduler("vllm-v1", {"max_num_batched_tokens": 2048, "max_num_seqs": 256})


def test_a_deep_queue_resumes_from_the_third_replay_on() -> None:
    pol = _policy()
    table = _deep()
    c, ref = _compiled(pol), _compiled(pol)
    ref.resume = False
    cp, rp = c.prepare(table), ref.prepare(table)
    seen = []
    for prompt in (300, 301, 302, 5000, 1, 777):
        got = c.ttft(cp, prompt, 50, COEFFS)
        seen.append(c.last_resumed)
        assert got == pytest.approx(ref.ttft(rp, prompt, 50, COEFFS), rel=1e-9)
        assert not ref.last_resumed
    # The first replay finds where to keep the state, the second keeps it.
    assert seen == [False, False, True, True, True, True]
    # replay() resumes from it too, following tokens; recorded, it does not.
    got = c.replay(cp, 400, 50, COEFFS, next_tokens=8)
    assert c.last_resumed
    want = ref.replay(rp, 400, 50, COEFFS, next_tokens=8)
    assert got.token_times_s == pytest.approx(want.token_times_s, rel=1e-9)
    assert got.token_batches == want.token_batches
    c.replay(cp, 400, 50, COEFFS, record=True)
    assert not c.last_resumed


def test_it_does_not_resume_where_the_answer_could_differ() -> None:
    pol = _policy()
    table = _deep()
    c = _compiled(pol)
    tw = compile_scheduler(pol, "python")
    cp = c.prepare(table)

    def check(**kw: Any) -> bool:
        args = {"prompt_tokens": 300, "output_len": 50, "coeffs": COEFFS, **kw}
        got = c.ttft(cp, **args)
        want = tw.ttft(tw.prepare(table), **args)
        assert _same(got, want), kw
        return bool(c.last_resumed)

    assert not check()
    assert not check()
    assert check()
    # A horizon inside the batches before the kept state: those batches decide.
    assert not check(horizon_s=1e-6)
    # Other coefficients, or an arrival that joins at another batch's end.
    assert not check(coeffs=OTHER_COEFFS)
    assert not check(arrival_s=0.05)
    # ... which replaced the kept state: arrivals joining where that one did resume.
    assert not check(arrival_s=0.05)
    assert check(arrival_s=0.0500001)
    # Another replayer of the same policy, or the same one forced onto its exact path.
    other = _compiled(pol)
    other.ttft(cp, 300, 50, COEFFS, arrival_s=0.05)
    assert not other.last_resumed
    c.force_slow = True
    try:
        assert not check(arrival_s=0.05)
    finally:
        c.force_slow = False
    # Turned off, never.
    c.resume = False
    assert not check(arrival_s=0.05)
    assert not check(arrival_s=0.05)


def test_the_kept_state_survives_other_calls_on_the_replayer() -> None:
    """replay() and residents() on the same replayer, and other snapshots, in between."""
    pol = _policy()
    c = _compiled(pol)
    tw = compile_scheduler(pol, "python")
    a, b = _deep(60), _deep(20)
    ca, cb = c.prepare(a), c.prepare(b)
    for _ in range(2):
        c.ttft(ca, 300, 50, COEFFS)
    c.replay(ca, 10, 5, COEFFS, record=True)
    c.residents(ca, COEFFS, 7)
    c.ttft(cb, 300, 50, COEFFS)
    got = c.ttft(ca, 400, 50, COEFFS)
    assert c.last_resumed
    assert got == pytest.approx(tw.ttft(tw.prepare(a), 400, 50, COEFFS), rel=1e-9)


# ---------------------------------------------------------------------------
# The block-level loop (a snapshot with kv.prefix_cache under prefix caching)
# ---------------------------------------------------------------------------

APC_ARRIVAL = st.tuples(
    st.integers(0, 10),
    st.integers(0, 2),
    st.integers(0, 400),
    st.integers(1, 300),
    st.integers(1, 60),
)


def _apc_case(name: str, arrivals: list[Any], at: int, seed: int) -> tuple[Any, Any, Any]:
    import orjson
    from test_prefix_replay import run_engine

    from bearsdk.snapshot import snapshot_from_dict

    pol, rng, eng = run_engine(name, arrivals, at, seed)
    doc = orjson.loads(orjson.dumps(eng.core.snapshot(output_len=True)))
    return pol, rng, snapshot_from_dict(doc)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["sync-scarce", "async-scarce", "sync-lpt-wm", "async-roomy"]),
    arrivals=st.lists(APC_ARRIVAL, min_size=4, max_size=20),
    at=st.integers(0, 30),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_block_level_loop_resumes_to_the_same_answers_and_pool(
    name: str, arrivals: list[Any], at: int, seed: int, data: st.DataObject
) -> None:
    from test_prefix_replay import tokens

    from bearsdk.replay._replay_apc_c import Replayer as ApcReplayer
    from bearsdk.replay.blocks import chain_keys

    pol, rng, snap = _apc_case(name, arrivals, at, seed)
    assert snap.kv is not None
    c, ref = ApcReplayer(pol), ApcReplayer(pol)
    ref.resume = False
    cp = c.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    span = ref.ttft(
        ref.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache),
        200,
        20,
        COEFFS,
    )
    calls = data.draw(_calls(span if math.isfinite(span) and span > 0 else 1.0))
    for k, (plen, out, cap, horizon, arrival, co) in enumerate(calls):
        keys = chain_keys(
            tokens(rng, data.draw(st.integers(0, 2)), data.draw(st.integers(0, 400)), plen),
            pol.block_size,
        )
        rp = ref.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        kw = {"max_tokens": cap, "prefix_keys": keys, "horizon_s": horizon, "arrival_s": arrival}
        where = f"{name} call {k}: {(plen, out, cap, horizon, arrival, co)}"
        if k % 3 == 2:
            g = c.replay(cp, plen, out, co, next_tokens=3, **kw)
            r = ref.replay(rp, plen, out, co, next_tokens=3, **kw)
            where += f" resumed {c.last_resumed}"
            assert (g.stop_reason, g.first_token_batch, g.token_batches) == (
                r.stop_reason,
                r.first_token_batch,
                r.token_batches,
            ), where
            assert g.ttft_s == r.ttft_s, where
            assert g.token_times_s == r.token_times_s, where
        else:
            got = c.ttft(cp, plen, out, co, cap, keys, horizon, arrival)
            want = ref.ttft(rp, plen, out, co, cap, keys, horizon, arrival)
            assert got == want or (math.isinf(got) and math.isinf(want)), (
                f"{where}: resumed {c.last_resumed}: {got}, from the snapshot {want}"
            )
        # The pool where each stopped, block for block (the twins' own oracle).
        assert c.last_blocks() == ref.last_blocks(), where
        assert c.last_pool == ref.last_pool, where
        assert c.last_work == ref.last_work, where


def test_the_block_level_loop_resumes_a_queue_behind_shared_prefixes() -> None:
    # bench replay's A2: 96 users of three system prompts; a popular prompt's next user.
    from bearsdk.bench import replay_apc as A
    from bearsdk.replay._replay_apc_c import Replayer as ApcReplayer
    from bearsdk.replay.blocks import chain_keys

    sc = next(s for s in A.build_apc_scenarios() if s.name == "A2")
    snap = sc.snapshot
    assert snap.kv is not None
    pol = bind_scheduler("vllm-v1", A.PARAMS).with_kv(snap.kv.block_size, snap.kv.num_blocks)
    c, ref = ApcReplayer(pol), ApcReplayer(pol)
    ref.resume = False
    cp = c.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    rp = ref.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    keys = chain_keys(sc.prompt_ids, A.BS)
    n = len(sc.prompt_ids)
    seen = []
    for extra in range(4):
        got = c.ttft(cp, n + extra, sc.output_len, COEFFS, -1, keys)
        seen.append(c.last_resumed)
        assert got == ref.ttft(rp, n + extra, sc.output_len, COEFFS, -1, keys)
        assert c.last_blocks() == ref.last_blocks()
    assert seen == [False, False, True, True]
    # Through the counted loop's front, which hands such a snapshot to it.
    front = _compiled(pol)
    fp = front.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    for _ in range(3):
        front.ttft(fp, n, sc.output_len, COEFFS, -1, keys)
    assert front.last_resumed
    front.resume = False
    front.ttft(fp, n, sc.output_len, COEFFS, -1, keys)
    assert not front.last_resumed


@pytest.mark.parametrize("name", ["wide-async", "wide-sync"])
def test_the_block_level_loop_resumes_with_many_decodes_a_batch(name: str) -> None:
    # Up to 24 running: the lazy decodes' buckets and event heaps are kept too.
    import random

    from test_prefix_replay import tokens

    from bearsdk.replay._replay_apc_c import Replayer as ApcReplayer
    from bearsdk.replay.blocks import chain_keys

    resumed = lazies = 0
    for seed in range(24):
        r = random.Random(seed)
        arrivals = [
            (
                r.randint(0, 50),
                r.randint(0, 2),
                r.randint(0, 400),
                r.randint(1, 300),
                r.randint(1, 150),
            )
            for _ in range(r.randint(20, 60))
        ]
        pol, rng, snap = _apc_case(name, arrivals, r.randint(10, 60), seed)
        assert snap.kv is not None
        c, ref = ApcReplayer(pol), ApcReplayer(pol)
        ref.resume = False
        cp = c.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        for k in range(6):
            plen, out = r.randint(1, 400), r.randint(1, 40)
            keys = chain_keys(tokens(rng, r.randint(0, 2), r.randint(0, 400), plen), pol.block_size)
            rp = ref.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
            follow = (0, 3, 32)[k % 3]
            g = c.replay(cp, plen, out, COEFFS, prefix_keys=keys, next_tokens=follow)
            resumed += c.last_resumed
            lazies += c.last_lazy_batches
            w = ref.replay(rp, plen, out, COEFFS, prefix_keys=keys, next_tokens=follow)
            assert (g.ttft_s, g.token_batches, g.token_times_s) == (
                w.ttft_s,
                w.token_batches,
                w.token_times_s,
            ), f"seed {seed} call {k}"
            assert c.last_blocks() == ref.last_blocks(), f"seed {seed} call {k}"
            assert c.last_lazy_batches == ref.last_lazy_batches
    assert resumed > 20
    assert lazies > 100
