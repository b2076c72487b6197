"""Prefix caching in the simulator (issue 16): engines that cache, sessions that resend
their history, and a router view that keeps the cache while its dispatches are unseen."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import orjson
import pytest

from bearsdk.replay.blocks import chain_keys
from bearsdk.sim.engine import BatchNoise, EngineEvent, SimEngine, bind_engine
from bearsdk.sim.prefix import PREFIX_POLICIES, mooncake_requests, run_prefix
from bearsdk.snapshot import snapshot_from_dict
from bearsdk.state.overlay import Dispatch, DispatchOverlay


def _engine(events: list[EngineEvent]) -> SimEngine:
    em = bind_engine("qwen3-8b-h100", "vllm-v1", {"enable_prefix_caching": True})
    return SimEngine(
        "e", em.policy, em.max_model_len, em.time_model, BatchNoise(em.time_model.params, 1),
        events.append,
    )  # fmt: skip


def test_a_caching_sim_engine_hits_a_resent_history_and_publishes_its_pool() -> None:
    events: list[EngineEvent] = []
    e = _engine(events)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 100_000) for _ in range(3000)]
    answer = [rng.randrange(1, 100_000) for _ in range(40)]
    e.add_request("t0", len(prompt), len(answer), 0.0, prompt + answer)
    e.advance(0.01)
    assert e.snapshot().prefix_cache is not None
    e.advance(5.0)
    first = {ev.rid: ev.time for ev in events if ev.kind == 0}
    nxt = prompt + answer + [rng.randrange(1, 100_000) for _ in range(200)]
    e.add_request("t1", len(nxt), 10, 5.0, nxt)
    e.advance(6.0)
    first = {ev.rid: ev.time for ev in events if ev.kind == 0}
    # The second turn computes its new tokens only: far faster than the first.
    assert first["t1"] - 5.0 < 0.3 * first["t0"]


def test_the_overlay_keeps_the_block_pool_and_lets_waiting_dispatches_hit_it() -> None:
    events: list[EngineEvent] = []
    e = _engine(events)
    rng = random.Random(1)
    system = [rng.randrange(1, 100_000) for _ in range(4000)]
    e.add_request("a", len(system) + 8, 200, 0.0, [*system, *range(8), *range(200)])
    e.advance(1.0)
    snap = e.snapshot()
    assert snap.prefix_cache is not None
    mine = [*system, *range(50, 58)]
    keys = chain_keys(mine, 16)
    d = Dispatch("b", 1.0, len(mine), 20, None, 0, tuple(keys))
    view = DispatchOverlay.apply(snap, [d])
    assert view.prefix_cache is not None
    pc = view.prefix_cache
    assert [pc.keys[i] for i in pc.chains[-1]] == keys
    # The new request behind the dispatch: with the dispatch's keys it waits for
    # a short prefill (the system prompt is cached); without, a long one.
    from bearsdk.estimators.bea import BEAEstimator

    em = bind_engine("qwen3-8b-h100", "vllm-v1", {"enable_prefix_caching": True})
    est = BEAEstimator(em.policy, em.calibrated_batch_time())
    with_keys = est.estimate(view, len(mine), 20, prefix_keys=keys).ttft_s
    blind = DispatchOverlay.apply(snap, [attrs.evolve(d, prefix_keys=())])
    without = est.estimate(blind, len(mine), 20, prefix_keys=keys).ttft_s
    assert with_keys < 0.6 * without
    # A started dispatch holds blocks the pool does not show: counted, as before.
    started = DispatchOverlay.apply(snap, [attrs.evolve(d, outputs=1)])
    assert started.prefix_cache is None
    # The view is a valid snapshot: its document decodes, the dispatch's chain intact.
    again = snapshot_from_dict(view.to_dict()).prefix_cache
    assert again is not None
    assert [again.keys[i] for i in again.chains[-1]] == keys
    assert again.free == pc.free


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
def test_every_policy_serves_the_same_sessions(policy: str) -> None:
    r = run_prefix(policy, 2.0, duration_s=4.0, turns=3, seed=3)
    assert r.turns == sum(r.composition.values())
    # Same seed, same sessions: every policy serves every turn of each.
    assert r.turns == run_prefix("bear", 2.0, duration_s=4.0, turns=3, seed=3).turns
    assert 0.0 <= r.slo_attainment <= 1.0
    # Sessions resend their history and share system prompts: most of it is cached.
    assert r.hit_rate > 0.5


def test_an_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        run_prefix("round-robin", 1.0)


def _trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> str:
    path.write_bytes(
        b"".join(
            orjson.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
            + b"\n"
            for t, n, o, h in rows
        )
    )
    return str(path)


def test_mooncake_hash_ids_are_shared_blocks_and_times_are_rescaled(tmp_path: Path) -> None:
    f = _trace(
        tmp_path / "t.jsonl",
        [(0, 1000, 50, [0, 1]), (3000, 1500, 20, [0, 1, 2]), (6000, 700, 0, [0, 3])],
    )
    reqs = mooncake_requests(f, 10, 2.0)
    assert [len(ids) for _, ids, _ in reqs] == [1000, 1500, 700]
    # A shared hash id is 512 shared tokens; a different one is not.
    assert reqs[1][1][:1000] == reqs[0][1]
    assert reqs[2][1][:512] == reqs[0][1][:512]
    assert reqs[2][1][512:700] != reqs[0][1][512:700]
    # Two requests/s on average; an output of 0 is served as 1.
    assert [t for t, _, _ in reqs] == [0.0, 0.5, 1.0]
    assert [o for _, _, o in reqs] == [50, 20, 1]
    assert len(mooncake_requests(f, 2, 2.0)) == 2


def test_a_malformed_trace_line_is_named(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n{}\n')
    with pytest.raises(ValueError, match="line 2 is not a Mooncake request"):
        mooncake_requests(str(f), 10, 1.0)
    f.write_text('{"timestamp": 0, "input_length": -4, "output_length": 5, "hash_ids": [0]}\n')
    with pytest.raises(ValueError, match="line 1: lengths out of bounds"):
        mooncake_requests(str(f), 10, 1.0)


def test_a_trace_run_hits_the_prefixes_its_requests_share(tmp_path: Path) -> None:
    rows = [(400 * i, 2048 + 64 * i, 30, [0, 1, 2, 3, 100 + i, 200 + i]) for i in range(12)]
    f = _trace(tmp_path / "t.jsonl", rows)
    r = run_prefix("bear-cache", 3.0, duration_s=4.0, trace=f)
    assert r.turns == 12
    # Four shared blocks (2,048 tokens) of every prompt after the first are found,
    # less what went to an instance for the first time.
    assert 0.5 < r.hit_rate < 0.9


def test_bear_with_the_cache_beats_bear_without_it_under_load() -> None:
    # Deterministic virtual time: a loaded pool where the cache is most of each prompt.
    cached = run_prefix("bear-cache", 12.0, duration_s=4.0, turns=4, seed=5)
    blind = run_prefix("bear", 12.0, duration_s=4.0, turns=4, seed=5)
    assert cached.turns == blind.turns
    assert cached.on_time_utility > blind.on_time_utility
    assert cached.slo_attainment >= blind.slo_attainment


def test_the_bench_names_missing_trace_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bearsdk.cli import main

    code = main(["bench", "prefix-routing", "--workload", "mooncake", "--data-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "github.com/kvcache-ai/Mooncake" in err[0]


def test_session_affinity_keeps_a_session_on_one_instance_and_spreads_sessions() -> None:
    from bearsdk.sim.prefix import _ring_pick

    names = ["a", "b", "c"]
    picks = [_ring_pick(k, names) for k in range(3000)]
    assert picks == [_ring_pick(k, names) for k in range(3000)]
    shares = [picks.count(j) / len(picks) for j in range(3)]
    assert min(shares) > 0.2
    # A fourth instance takes sessions from the others and moves no other session.
    more = [_ring_pick(k, [*names, "d"]) for k in range(3000)]
    assert all(m in (p, 3) for p, m in zip(picks, more, strict=True))
    assert more.count(3) > 300


def test_the_bench_compares_each_rate_with_blind_bear_and_the_best_baseline() -> None:
    from bearsdk.bench.prefix_routing import rate_summary

    def run(policy: str, otu: float, slo: float) -> dict[str, object]:
        return {"policy": policy, "on_time_utility": otu, "slo_attainment": slo}

    runs = [
        run("bear-cache", 0.6, 0.99),
        run("bear", 0.5, 0.93),
        run("llm-d-prefix", 0.55, 0.98),
        run("dynamo-kv", 0.4, 0.9),
    ]
    line = rate_summary(runs)
    assert "bear-cache vs bear +20.0 % (bear on time 93.0 %)" in line
    assert "vs the best baseline, llm-d-prefix, +9.1 %" in line
    assert rate_summary(runs[1:]) == ""  # nothing to compare
    assert rate_summary(runs[:1]) == ""
