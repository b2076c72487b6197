"""Property tests: the compiled replay and its pure-Python twin agree, batch by batch.

Random snapshots are replayed under every built-in policy and under random
custom specs composed from the DSL's building blocks. The compiled loop is run
twice: normally (aggregated decodes, closed-form runs) and with its exact
per-request path forced, so both of its paths are checked against the twin.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bearsdk.replay import implementations
from bearsdk.schedulers import (
    BoundScheduler,
    compile_scheduler,
    get_scheduler,
    scheduler_names,
    spec_from_dict,
)
from bearsdk.snapshot import NCOLS

pytestmark = [
    # (Every test compares the twins side by side: the same in either CI pass.)
    pytest.mark.once,
    pytest.mark.skipif("cython" not in implementations(), reason="compiled replay not built"),
]

# BatchTimeModel.replay_coeffs of the default model: each decode's own key priced
# (decode_keys="attended"), which the closed-form decode runs must sum alike.
COEFFS = (0.003, 2e-5, 5e-8, 1e-10, 0.0, 1.0)
MAX_BATCHES = 400
# A pool every drawn snapshot fits in (the spec's physical bound on kv.num_blocks).
PROBE_POOL = 1 << 24


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def custom_policy(draw: st.DrawFn) -> BoundScheduler:
    stages = draw(
        st.sampled_from(
            [
                ["running", "waiting"],
                ["waiting", "running"],
                ["decodes", "prefills", "waiting"],
                ["waiting", "decodes", "prefills"],
            ]
        )
    )
    exclusive = draw(st.booleans())
    async_ = False if exclusive else draw(st.booleans())
    chunked = draw(st.booleans())
    budget = draw(st.integers(16, 1024))
    mml = draw(st.sampled_from([0, 256, 512, 1024, 2048]))
    allocate = draw(st.sampled_from(["on-demand", "prompt", "max-length"]))
    if allocate == "max-length" and mml == 0:
        mml = 1024
    if not chunked and mml > budget:
        budget = mml
    doc: dict[str, Any] = {
        "name": "custom",
        "params": {"budget": budget},
        "budget": {
            "tokens": "$budget",
            "seqs": draw(st.integers(1, min(budget, 24))),
            "max_model_len": mml,
            "count": draw(st.sampled_from(["tokens", "tokens", "padded"])),
        },
        "batch": {
            "stages": stages,
            "exclusive": exclusive,
            "admit_after_preemption": draw(st.booleans()),
            "async_scheduling": async_,
        },
        "prefill": {
            "chunked": chunked,
            "chunk_cap": draw(st.sampled_from([0, 0, 8, 64, 200]))
            if (mml == 0 or mml >= 200)
            else 0,
            "cap_exempt_when_alone": draw(st.booleans()),
        },
        "admission": {
            "on_blocked": draw(st.sampled_from(["stop", "skip"])),
            "reserve_full_sequence": draw(st.booleans()),
        },
        "kv": {
            "block_size": draw(st.sampled_from([1, 4, 16])),
            "reserved_blocks": draw(st.integers(0, 1)),
            "allocate": allocate,
            "watermark": draw(st.sampled_from([0.0, 0.0, 0.01, 0.1])),
            "watermark_applies": draw(st.sampled_from(["always", "while-running", "never"])),
            "decode_needs_free_block": draw(st.booleans()),
        },
        "preemption": {
            "victim": draw(st.sampled_from(["newest", "newest", "none"])),
            "requeue": draw(st.sampled_from(["front", "back"])),
            "keep_outputs": draw(st.booleans()),
        },
    }
    return spec_from_dict(doc).bind()


@st.composite
def builtin_policy(draw: st.DrawFn, name: str) -> BoundScheduler:
    spec = get_scheduler(name)
    pol = spec.bind()
    over: dict[str, object] = {}
    budget_param = next(
        k
        for k in ("max_num_batched_tokens", "chunk_size", "max_tokens_in_batch", "max_batch_tokens")
        if k in spec.params
    )
    budget = draw(st.integers(32, 1024))
    over[budget_param] = budget
    seq_param = next(k for k in ("max_num_seqs", "batch_size_cap") if k in spec.params)
    over[seq_param] = draw(st.integers(1, min(32, budget)))
    if "max_model_len" in spec.params:
        mml = draw(st.sampled_from([512, 1024, 2048]))
        if not pol.chunked_prefill:
            mml = min(mml, budget) if budget >= 256 else 0
            if mml == 0 and pol.allocate == "max-length":
                over[budget_param] = budget = 1024
                mml = 1024
        over["max_model_len"] = mml
    if "block_size" in spec.params:
        over["block_size"] = draw(st.sampled_from([1, 4, 16, 32]))
    if "long_prefill_token_threshold" in spec.params:
        mml_v = int(over.get("max_model_len", 0) or 0)
        over["long_prefill_token_threshold"] = draw(st.sampled_from([0, 0, 16, 128]))
        if mml_v and int(over["long_prefill_token_threshold"]) > mml_v:  # type: ignore[call-overload]
            over["long_prefill_token_threshold"] = 0
    for flag in ("async_scheduling", "enable_chunked_prefill", "scheduler_reserve_full_isl"):
        if flag in spec.params:
            over[flag] = draw(st.booleans())
    if over.get("enable_chunked_prefill") is False:
        mml_v = int(over.get("max_model_len", 0) or 0)  # type: ignore[call-overload]
        if mml_v == 0 or mml_v > budget:
            over["max_model_len"] = min(budget, 512) if budget >= 64 else budget
    for wm in ("watermark", "watermark_blocks_fraction"):
        if wm in spec.params:
            over[wm] = draw(st.sampled_from([0.0, 0.01, 0.1]))
    mml_final = int(over.get("max_model_len", 0) or 0)  # type: ignore[call-overload]
    if mml_final and int(over.get("long_prefill_token_threshold", 0) or 0) > mml_final:  # type: ignore[call-overload]
        over["long_prefill_token_threshold"] = 0
    return spec.bind(over)


@st.composite
def workload(draw: st.DrawFn, pol: BoundScheduler) -> dict[str, Any]:
    """A snapshot consistent with the policy, plus a new request."""
    mml = pol.max_model_len
    plim = (mml - 2) if mml else 3000
    rows = []
    n_run = draw(st.integers(0, min(pol.max_seqs, 16)))
    n_wait = draw(st.integers(0, 12))
    for _ in range(n_run):
        prompt = draw(st.integers(1, max(1, min(plim, 1500))))
        room = (mml - prompt) if mml else 600
        total = draw(st.integers(1, max(1, min(room, 600))))
        kind = draw(st.sampled_from(["decode", "decode", "prefill", "recompute"]))
        ph = 0
        if kind == "decode" and total >= 2:
            out = draw(st.integers(1, total - 1))
            ph = draw(st.integers(0, 1)) if pol.async_scheduling else 0
            if out + ph > total - 0:
                ph = 0
            computed = prompt + out - 1 + ph
        elif kind == "recompute" and total >= 2 and prompt + 1 > 2:
            out = draw(st.integers(1, total - 1))
            computed = draw(st.integers(1, prompt + out - 2))
        else:
            out = 0
            computed = draw(st.integers(1, prompt)) if prompt > 1 else 1
            if computed == prompt:
                ph = 1 if pol.async_scheduling and total >= 1 else 0
                if not ph:
                    computed = max(1, prompt - 1)
        max_tokens = total if draw(st.booleans()) else draw(st.integers(total, total + 50))
        if mml:
            max_tokens = min(max_tokens, mml - prompt)
            max_tokens = max(max_tokens, total)
        rows.append([0, prompt, computed, out, max_tokens, total, ph])
    for _ in range(n_wait):
        prompt = draw(st.integers(1, max(1, min(plim, 1500))))
        room = (mml - prompt) if mml else 600
        total = draw(st.integers(1, max(1, min(room, 600))))
        out = draw(st.integers(0, total - 1)) if draw(st.booleans()) else 0
        if mml and prompt + out >= mml:
            out = 0
        rows.append([1, prompt, 0, out, -1 if draw(st.booleans()) else total, total, 0])
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    new_prompt = draw(st.integers(1, max(1, min(plim, 2000))))
    new_out = draw(st.integers(1, 300))
    unlimited = draw(st.integers(0, 9)) == 0
    extra = draw(st.sampled_from([0, 1, 2, 5, 20, 100, 1000]))
    return {
        "table": table,
        "prompt": new_prompt,
        "out": new_out,
        "unlimited": unlimited,
        "extra": extra,
        # Tokens followed past the first (TPOT): none, a few, the router's 32, many.
        "follow": draw(st.sampled_from([0, 0, 1, 2, 7, 32, 200])),
    }


@st.composite
def tiny_workload(draw: st.DrawFn, pol: BoundScheduler) -> dict[str, Any]:
    """One or two residents with tiny counts, in any state the snapshot validator accepts.

    Engines never report some of these (every token computed, a placeholder
    on a request still prefilling, several placeholders), but a snapshot comes
    from the network: the twins must agree on them too (issue 19, defect 4).
    """
    mml = pol.max_model_len
    rows = []
    for _ in range(draw(st.integers(1, 2))):
        prompt = draw(st.integers(1, 6))
        out = draw(st.integers(0, 3))
        if mml and prompt + out >= mml:
            out = 0
        total = draw(st.integers(out + 1, out + 3))
        if mml:
            total = max(min(total, mml - prompt), out + 1)
        max_tokens = draw(st.sampled_from([-1, total, total + 2]))
        if mml and max_tokens > mml - prompt:
            max_tokens = -1
        # No engine runs more than max_num_seqs: the replay refuses such a state.
        if sum(r[0] == 0 for r in rows) < pol.max_seqs and draw(st.booleans()):
            ph = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))
            computed = draw(st.integers(0, prompt + out + ph))
            rows.append([0, prompt, computed, out, max_tokens, total, ph])
        else:
            rows.append([1, prompt, 0, out, max_tokens, total, 0])
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    plim = (mml - 2) if mml else 8
    return {
        "table": table,
        "prompt": draw(st.integers(1, max(1, min(plim, 8)))),
        "out": draw(st.integers(1, 4)),
        "unlimited": draw(st.integers(0, 3)) == 0,
        "extra": draw(st.sampled_from([0, 1, 2, 3, 8])),
        "follow": draw(st.sampled_from([0, 1, 2, 3, 5])),
    }


def _check(pol: BoundScheduler, w: dict[str, Any]) -> None:
    tw = compile_scheduler(pol, "python")
    # Size the pool so the running requests fit, with `extra` blocks to spare.
    probe = compile_scheduler(pol.with_kv(pol.block_size, PROBE_POOL), "python")
    held = PROBE_POOL - pol.reserved_blocks - probe.prepare(w["table"]).free_blocks
    if w["unlimited"]:
        p2 = pol.with_kv(pol.block_size, 0)
    else:
        p2 = pol.with_kv(pol.block_size, held + pol.reserved_blocks + w["extra"] + 1)
    tw = compile_scheduler(p2, "python")
    follow = w.get("follow", 0)
    ref = tw.replay(
        tw.prepare(w["table"]),
        w["prompt"],
        w["out"],
        COEFFS,
        record=True,
        max_batches=MAX_BATCHES,
        next_tokens=follow,
    )
    c = compile_scheduler(p2, "cython")
    for slow in (False, True):
        c.force_slow = slow
        try:
            got = c.replay(
                c.prepare(w["table"]),
                w["prompt"],
                w["out"],
                COEFFS,
                record=True,
                max_batches=MAX_BATCHES,
                next_tokens=follow,
            )
        finally:
            c.force_slow = False
        where = f"policy {p2}\nslow={slow}"
        assert got.first_token_batch == ref.first_token_batch, where
        assert got.stop_reason == ref.stop_reason, where
        assert got.batches is not None
        assert ref.batches is not None
        assert len(got.batches) == len(ref.batches), where
        for i, (a, b) in enumerate(zip(got.batches, ref.batches, strict=True)):
            assert a == b, f"{where}\nbatch {i + 1}:\n  compiled {a}\n  twin     {b}"
        if math.isfinite(ref.ttft_s):
            assert got.ttft_s == pytest.approx(ref.ttft_s, rel=1e-9, abs=1e-12)
        else:
            assert not math.isfinite(got.ttft_s)
        assert got.token_batches == ref.token_batches, where
        assert got.token_times_s == pytest.approx(ref.token_times_s, rel=1e-9, abs=1e-12), where
        # The residents alone (the baseline an admission's harm is measured against).
        for limit in (0, 1, 7, len(ref.batches) + 3):
            want = tw.residents(tw.prepare(w["table"]), COEFFS, limit)
            got_r = c.residents(c.prepare(w["table"]), COEFFS, limit)
            assert got_r[0] == want[0], where
            assert got_r[1] == pytest.approx(want[1], rel=1e-9, abs=1e-12), where
        if ref.first_token_batch:
            tb = ref.token_batches
            assert tb[0] == ref.first_token_batch, where
            assert all(a < b for a, b in itertools.pairwise(tb)), where
            # Every token wanted, unless a limit or a state it never resumes from stopped it.
            assert len(tb) <= min(1 + follow, w["out"]), where


SOAK = settings().max_examples > 1000
SETTINGS = settings(
    max_examples=settings().max_examples if SOAK else 120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("name", scheduler_names())
def test_builtin_policies_agree(name: str) -> None:
    if name not in {
        "vllm-v1",
        "sarathi",
        "prefill-first",
        "vidur-vllm",
        "vidur-sarathi",
        "vidur-orca",
    }:
        pytest.skip("not a built-in")

    @SETTINGS
    @given(st.data())
    def run(data: st.DataObject) -> None:
        pol = data.draw(builtin_policy(name))
        _check(pol, data.draw(workload(pol)))

    run()


@pytest.mark.parametrize("name", scheduler_names())
def test_builtin_policies_agree_on_tiny_snapshots(name: str) -> None:
    @SETTINGS
    @given(st.data())
    def run(data: st.DataObject) -> None:
        pol = data.draw(builtin_policy(name))
        _check(pol, data.draw(tiny_workload(pol)))

    run()


@settings(
    max_examples=settings().max_examples if SOAK else 400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_custom_policies_agree(data: st.DataObject) -> None:
    pol = data.draw(custom_policy())
    w = data.draw(workload(pol))
    assume(len(w["table"]) <= 28)
    _check(pol, w)


def _check_horizon(pol: BoundScheduler, w: dict[str, Any], where_frac: float) -> None:
    """A horizon stops both twins at the first batch past it, and nowhere else."""
    tw = compile_scheduler(pol, "python")
    full = tw.replay(
        tw.prepare(w["table"]), w["prompt"], w["out"], COEFFS, record=True, max_batches=MAX_BATCHES
    )
    assert full.batches is not None
    ends = list(np.cumsum([b.duration_s for b in full.batches]))
    if full.stop_reason == "first-token" and len(ends) >= 2:
        # Between two batch ends before the first token's (never on one).
        j = min(int(where_frac * (len(ends) - 1)), len(ends) - 2)
        lo = ends[j - 1] if j else 0.0
        if ends[j] - lo < 1e-9:
            return
        horizon = lo + (ends[j] - lo) / 2
        want = list(full.batches[: j + 1])
        reason = "horizon"
    else:
        horizon = (ends[-1] if ends else 0.0) + 1.0
        want = list(full.batches)
        reason = str(full.stop_reason)
    c = compile_scheduler(pol, "cython")
    for rp, slow in ((tw, False), (c, False), (c, True)):
        if rp is c:
            c.force_slow = slow
        try:
            prep = rp.prepare(w["table"])
            got = rp.replay(
                prep,
                w["prompt"],
                w["out"],
                COEFFS,
                record=True,
                max_batches=MAX_BATCHES,
                horizon_s=horizon,
            )
            t = rp.ttft(prep, w["prompt"], w["out"], COEFFS, horizon_s=horizon)
        finally:
            c.force_slow = False
        where = f"{rp.implementation} slow={slow} policy {pol}\nhorizon {horizon}"
        assert str(got.stop_reason) == reason, where
        assert got.batches is not None
        assert list(got.batches) == want, where
        if reason == "horizon":
            assert got.lower_bound, where
            assert got.ttft_s > horizon, where
            assert got.ttft_s == pytest.approx(ends[j], rel=1e-9), where
            assert t == pytest.approx(got.ttft_s, rel=1e-9), where
        elif math.isfinite(full.ttft_s):
            assert got.ttft_s == pytest.approx(full.ttft_s, rel=1e-9, abs=1e-12), where


@pytest.mark.parametrize("name", ["vllm-v1", "sarathi", "prefill-first"])
def test_a_horizon_stops_both_twins_at_the_same_batch(name: str) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def run(data: st.DataObject) -> None:
        pol = data.draw(builtin_policy(name))
        _check_horizon(pol, data.draw(workload(pol)), data.draw(st.floats(0.0, 1.0)))

    run()


@pytest.mark.parametrize("impl", sorted(implementations()))
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "1", True, None])
def test_a_bad_horizon_is_refused_by_name(impl: str, bad: object) -> None:
    rp = compile_scheduler(get_scheduler("vllm-v1").bind({}), impl)
    prep = rp.prepare(np.zeros((0, NCOLS), dtype=np.int64))
    with pytest.raises(ValueError, match="horizon_s"):
        rp.replay(prep, 10, 5, COEFFS, horizon_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="horizon_s"):
        rp.ttft(prep, 10, 5, COEFFS, horizon_s=bad)  # type: ignore[arg-type]
