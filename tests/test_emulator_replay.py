"""The emulated engine schedules by the policy spec: replaying batch formation from any
snapshot it publishes predicts the batch in which a request arriving then gets its
first token, exactly, for every replay implementation."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from bearsdk.emulator import EmulatedEngine, EngineConfig, PublishedSnapshot, RequestHandle
from bearsdk.replay import implementations
from bearsdk.replay.blocks import chain_keys
from bearsdk.schedulers import compile_scheduler
from bearsdk.snapshot import snapshot_from_dict

SMALL = {"max_num_seqs": 8, "num_gpu_blocks": 130, "max_model_len": 2048}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "vllm-v1-async": (
        "vllm-v1",
        {**SMALL, "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64},
    ),
    "vllm-v1-sync": (
        "vllm-v1",
        {**SMALL, "max_num_batched_tokens": 256, "async_scheduling": False, "watermark": 0.05},
    ),
    "sarathi": ("sarathi", {**SMALL, "chunk_size": 128}),
}


async def _until(cond: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        for _ in range(100_000):
            if cond():
                return
            await anyio.sleep(0.0005)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_replay_from_published_snapshot_predicts_first_token_batch(case: str) -> None:
    sched, params = CASES[case]
    cfg = EngineConfig(
        profile="qwen3-0.6b-h100",
        scheduler=sched,
        params=params,
        publish_output_len=True,
        serve_http=False,
        seed=7,
    )
    rng = random.Random(case)
    probes: list[tuple[PublishedSnapshot, RequestHandle, int, int]] = []

    def probe_waiting() -> bool:
        # Later arrivals can change a probe's fate (vLLM lifts the long-prefill cap
        # only for a request alone in the engine): a replay cannot foresee them, so
        # none arrives while a probe waits for its first token.
        return bool(probes) and probes[-1][1].first_token_batch == 0

    async with EmulatedEngine(cfg) as eng:

        async def background() -> None:
            for i in range(50):
                await anyio.sleep(rng.expovariate(300))
                await _until(lambda: not probe_waiting())
                out = rng.randint(1, 60)
                cap = rng.choice([None, out, out + 10])
                eng.submit_tokens(rng.randint(20, 500), out, max_tokens=cap, request_id=f"b{i}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(background)
            for k in range(25):
                await anyio.sleep(rng.uniform(0.0, 0.01))
                await _until(lambda: eng.snapshot_current and not probe_waiting())
                # Same task, no await: the probe arrives exactly in the published state.
                snap = eng.captured_snapshot
                p, n = rng.randint(1, 400), rng.randint(1, 30)
                h = eng.submit_tokens(p, n, max_tokens=n, request_id=f"probe{k}")
                probes.append((snap, h, p, n))
        with anyio.fail_after(20):
            for _, h, _, _ in probes:
                await h.result()
        policy = eng.policy
    busy = [s for s, _, _, _ in probes if s.doc["requests"]]
    assert len(busy) >= 10  # most probes land on a loaded engine
    if policy.async_scheduling:
        assert any("inflight" in s.doc for s in busy)
    # Probes queued behind others, some for many batches: the test is not trivial.
    assert max(h.first_token_batch - s.batches for s, h, _, _ in probes) >= 4
    for impl in implementations():
        rp = compile_scheduler(policy, impl)
        for snap, h, p, n in probes:
            s = snapshot_from_dict(snap.doc)
            assert s.kv is not None
            # With the cache (vllm-v1 as vLLM runs it), the snapshot's blocks and
            # the probe's own content keys.
            prep = rp.prepare(s.table, s.kv.free_blocks, cache=s.prefix_cache)
            ids = h.plan.prompt_ids
            keys = chain_keys(ids, policy.block_size) if ids is not None else None
            res = rp.replay(prep, p, n, max_tokens=n, prefix_keys=keys)
            assert h.first_token_batch > snap.batches
            assert res.first_token_batch == h.first_token_batch - snap.batches, (impl, h.id)
