"""The emulator's KV events over ZeroMQ, as vLLM publishes them, feeding a prefix index."""

from __future__ import annotations

import random
from collections.abc import Callable

import anyio
import attrs
import pytest

from bearsdk.emulator import EngineConfig, EngineConfigError
from bearsdk.emulator.core import EngineCore
from bearsdk.kvevents.index import PrefixIndex
from bearsdk.kvevents.transport import KVEventSubscriber
from bearsdk.replay.blocks import chain_keys

PARAMS = {
    "enable_prefix_caching": True,
    "num_gpu_blocks": 400,
    "max_num_seqs": 16,
    "max_model_len": 4096,
}


async def _until(cond: Callable[[], bool]) -> None:
    """Poll ``cond`` for up to 10 s (the subscriber is a socket loop: no event to wait on)."""
    with anyio.fail_after(10):
        for _ in range(1_000_000):
            if cond():
                return
            await anyio.sleep(0.01)


def _config(**kw: object) -> EngineConfig:
    return EngineConfig(
        profile="qwen3-0.6b-h100", params=PARAMS, serve_http=False, kv_events=True, seed=1, **kw
    )


@attrs.define
class _Run:
    """What a driven workload saw: its prompts, the lookups checked while it ran
    (only once the index had caught up), and when the index was rebuilt."""

    prompts: list[list[int]] = attrs.Factory(list)
    lookups: int = 0
    agree: int = 0
    rebuilt_at: int = -1


async def _drive(
    eng: EngineCore, idx: PrefixIndex, sub: KVEventSubscriber, rng: random.Random, drop_at: int
) -> _Run:
    """300 requests over five shared system prompts (eviction pressure in a
    400-block pool); three batches are lost on the PUB socket at ``drop_at``."""
    feed, pool = eng._kv, eng._core.pool
    assert feed is not None
    assert pool is not None
    bs = eng.policy.block_size
    systems = [[rng.randrange(1, 100_000) for _ in range(rng.randint(100, 600))] for _ in range(5)]
    run = _Run()
    async with anyio.create_task_group() as tg:
        await tg.start(sub.run)
        await anyio.sleep(0.2)  # a SUB socket joins late (ZeroMQ's slow joiner)
        handles = []
        for i in range(300):
            p = rng.choice(systems) + [
                rng.randrange(1, 100_000) for _ in range(rng.randint(10, 200))
            ]
            run.prompts.append(p)
            out = rng.randint(2, 20)
            handles.append(
                eng.submit_tokens(len(p), out, max_tokens=out, request_id=f"r{i}", prompt_ids=p)
            )
            if i == drop_at:
                feed.publisher.drop_next = 3  # kept for replay, if anyone asks
            await anyio.sleep(0.003)
            if sub.rebuilt and run.rebuilt_at < 0:
                run.rebuilt_at = i
            if not sub.resyncing and sub.last_seq == feed.publisher.last_seq:
                for _ in range(20):
                    q = rng.choice(run.prompts)
                    keys = chain_keys(q[: rng.randint(1, len(q))], bs)
                    run.lookups += 1
                    run.agree += idx.hit_blocks(keys) == len(pool.lookup(keys, len(keys)))
        with anyio.fail_after(20):
            for h in handles:
                await h.result()
        await _until(lambda: sub.last_seq == feed.publisher.last_seq and not sub.resyncing)
        tg.cancel_scope.cancel()
    # Caught up, the index is the engine's cache exactly; in flight it lags by
    # at most the evictions of the step being scheduled (vLLM publishes after it).
    for q in run.prompts:
        keys = chain_keys(q, bs)
        assert idx.hit_blocks(keys) == len(pool.lookup(keys, len(keys)))
    assert idx.blocks == pool.num_cached
    return run


async def test_the_index_follows_the_engine_and_a_lost_batch_is_replayed() -> None:
    async with EngineCore(_config()) as eng:
        ends = eng.kv_events_endpoints
        assert ends is not None
        idx = PrefixIndex(eng.policy.block_size, 100_000)
        sub = KVEventSubscriber(idx, ends[0], ends[1])
        run = await _drive(eng, idx, sub, random.Random(1), drop_at=150)
    assert run.lookups > 1000
    assert run.agree >= 0.99 * run.lookups
    assert (sub.replayed, sub.resyncs, sub.bad) == (3, 0, 0)


async def test_a_gap_nothing_can_fill_is_rebuilt_from_the_next_snapshot() -> None:
    # No replay socket: three lost batches are gone for good. The emulator's
    # snapshots say which batch they include, and the index is rebuilt from the
    # first one past the gap, then exact again.
    from bearsdk.prefix_cache import PrefixCacheState
    from bearsdk.snapshot import snapshot_from_dict

    async with EngineCore(_config()) as eng:
        ends = eng.kv_events_endpoints
        assert ends is not None

        def latest() -> PrefixCacheState | None:
            return snapshot_from_dict(eng.latest_snapshot.doc).prefix_cache

        idx = PrefixIndex(eng.policy.block_size, 100_000)
        sub = KVEventSubscriber(idx, ends[0], None, snapshots=latest, resync_interval_s=0.02)
        run = await _drive(eng, idx, sub, random.Random(2), drop_at=100)
    assert (sub.resyncs, sub.rebuilt, sub.replayed, sub.bad) == (1, 1, 0, 0)
    # Rebuilt within a few requests of the loss (a snapshot per step).
    assert 100 <= run.rebuilt_at <= 120
    assert run.lookups > 500
    assert run.agree >= 0.99 * run.lookups


async def test_a_restart_starts_the_sequence_and_the_index_over() -> None:
    async with EngineCore(_config()) as eng:
        ends = eng.kv_events_endpoints
        assert ends is not None
        idx = PrefixIndex(eng.policy.block_size, 100_000)
        sub = KVEventSubscriber(idx, ends[0], None)
        async with anyio.create_task_group() as tg:
            await tg.start(sub.run)
            await anyio.sleep(0.2)
            p = list(range(1, 300))
            await eng.submit_tokens(len(p), 2, max_tokens=2, request_id="a", prompt_ids=p).result()
            await _until(lambda: idx.blocks > 0)
            await eng.restart()
            await _until(lambda: idx.blocks == 0)
            tg.cancel_scope.cancel()


def test_kv_events_need_prefix_caching() -> None:
    with pytest.raises(EngineConfigError, match="kv_events"):
        EngineCore(
            EngineConfig(
                profile="qwen3-0.6b-h100",
                params={**PARAMS, "enable_prefix_caching": False},
                serve_http=False,
                kv_events=True,
            )
        )


async def test_the_router_prices_the_prefix_an_instance_announced_in_its_events() -> None:
    from bearsdk.emulator import EnginePool
    from bearsdk.router import AsyncRouter, InstanceConfig
    from bearsdk.selectors import BEAR

    params = {"enable_prefix_caching": True, "max_model_len": 8192}
    cfgs = [
        EngineConfig(
            profile="qwen3-8b-h100", params=params, instance=f"e{i}", seed=i, kv_events=True
        )
        for i in range(2)
    ]
    rng = random.Random(5)
    ids = [rng.randrange(1, 100_000) for _ in range(4000)]
    async with EnginePool(cfgs) as pool:
        confs = []
        for e in pool:
            ends = e.kv_events_endpoints
            assert ends is not None
            confs.append(
                InstanceConfig(
                    name=e.instance,
                    url=e.url,
                    model=e.model_name,
                    profile=e.config.profile,
                    kv_events=ends[0],
                    kv_events_replay=ends[1],
                )
            )
        async with AsyncRouter(confs, BEAR()) as router:
            warm_engine = next(iter(pool))
            warm, cold = (e.instance for e in pool)
            await anyio.sleep(0.2)  # the SUB sockets join
            await warm_engine.submit_tokens(len(ids), 2, max_tokens=2, prompt_ids=ids).result()
            index = router.core.slot(warm).kv_index
            assert index is not None
            await _until(lambda: index.hit_blocks(chain_keys(ids, 16)) >= len(ids) // 16 - 1)
            await _until(lambda: not len(router.cache(warm).entry.snapshot))  # type: ignore[union-attr]
            d = router.decide(
                [{"role": "user", "content": "hi"}], ttft_target=5.0, prompt_token_ids=ids
            )
            t = {c.instance: c.ttft_s for c in d.candidates}
            assert t[warm] < 0.5 * t[cold]
            assert d.instance == warm
            # What the instance announced: its index's hit, in tokens.
            cached = {c.instance: c.cached_tokens for c in d.candidates}
            assert cached[warm] >= len(ids) - 16
            assert cached[cold] == 0
            assert router.core.slot(cold).kv_index is not None
