"""Router replicas over Redis: the shared overlay, power-of-d ties, a Redis outage under load."""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Callable

import anyio
import pytest

from bearsdk.cluster import Cluster, DispatchEvent, PowerOfD, RedisBus, SharedOverlay
from bearsdk.cluster.local import LocalRedis
from bearsdk.errors import BearError
from bearsdk.io import Backoff
from bearsdk.predictors import Predictor
from bearsdk.router import AsyncRouter, ConfigError, InstanceConfig
from bearsdk.selectors import BEAR, Lagrangian, Option, Selection
from bearsdk.snapshot import KVState, RequestState, Snapshot

FAST = Backoff(initial_s=0.01, max_s=0.05)
T0 = 1.0e9  # a frozen clock: snapshots stay fresh, estimates are exact functions of state
PROMPT = "Summarise the following report in three sentences. " * 20


async def until(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll ``cond``: the state under test has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.002)


@pytest.fixture(scope="module")
def predictor() -> Predictor:
    # Loaded once: every router of these tests reads it, none writes it.
    return Predictor.load_default()


def twin_pool(snapshots: str = "poll") -> list[InstanceConfig]:
    """Two identical Qwen3-8B instances behind a dead URL (the tests feed the caches)."""
    return [
        InstanceConfig(
            name=f"i{k}",
            url="http://127.0.0.1:9",
            model="Qwen/Qwen3-8B",
            profile="qwen3-8b-h100",
            snapshots=snapshots,
            scheduler_params={"max_num_batched_tokens": 2048, "max_num_seqs": 64},
        )
        for k in range(2)
    ]


def busy(name: str) -> Snapshot:
    reqs = [RequestState(f"w{i}", "waiting", 1500, 0, 0) for i in range(4)]
    return Snapshot.build(reqs, instance=name, seq=1, time=T0, kv=KVState(16, 20_000, 19_000))


def router(predictor: Predictor, cluster: Cluster | None = None) -> AsyncRouter:
    r = AsyncRouter(
        twin_pool(),
        Lagrangian(delta=1.0),
        predictor=predictor,
        clock=lambda: T0,
        calibrate=False,
        cluster=cluster,
    )
    for name in r.instances:
        r.cache(name).offer(busy(name), received=T0)
    return r


# ---------------------------------------------------------------------- power of d


def options(*ttfts: float) -> list[Option]:
    return [Option(f"i{k}", "m", 0.5, 10.0, 0.495, t) for k, t in enumerate(ttfts)]


def test_power_of_d_draws_among_ties() -> None:
    pod = PowerOfD(BEAR(), seed=1)
    picks = {pod.select(options(0.1, 0.1, 0.1), 1.0).index for _ in range(200)}
    assert picks == {0, 1, 2}
    assert pod.ties_broken == 200
    assert pod.name == "bear"
    assert pod.latency == "bea"
    assert pod.lam == BEAR().lam


def test_power_of_d_prefers_the_faster_of_its_sample() -> None:
    pod = PowerOfD(BEAR(), d=2, seed=2)
    # Equal utility, one clearly slower: with d = 2 of 2, the faster always wins.
    assert {pod.select(options(0.30, 0.10), 1.0).index for _ in range(50)} == {1}


def test_power_of_d_leaves_real_differences_alone() -> None:
    pod = PowerOfD(BEAR(), seed=3)
    opts = options(0.1, 0.1)
    opts[1] = Option("i1", "m", 0.6, 10.0, 0.595, 0.1)  # better utility
    assert {pod.select(opts, 1.0).index for _ in range(20)} == {1}
    # Nothing feasible: BEAR's own rule (lowest TTFT, its own draw among ties) stands.
    late = options(2.0, 3.0, 2.0)
    sel = pod.select(late, 1.0)
    assert sel.index in (0, 2)
    assert sel == BEAR().select(late, 1.0)  # the same seed draws alike


def test_power_of_d_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"PowerOfD.d must be an integer >= 1 \(got 0\)"):
        PowerOfD(BEAR(), d=0)
    with pytest.raises(ValueError, match=r"PowerOfD.tolerance must be a finite number >= 0"):
        PowerOfD(BEAR(), tolerance=math.nan)


def test_power_of_d_keeps_selection_shape() -> None:
    sel = PowerOfD(BEAR(), seed=0).select(options(0.1, 0.1), 1.0)
    assert isinstance(sel, Selection)
    assert sel.feasible == (True, True)


# ---------------------------------------------------------------------- configuration


def test_redis_snapshots_need_a_cluster(predictor: Predictor) -> None:
    with pytest.raises(ConfigError, match=r"instance 'i0': snapshots = 'redis' needs a cluster"):
        AsyncRouter(twin_pool("redis"), predictor=predictor)
    with pytest.raises(ConfigError, match=r"snapshots must be one of push, poll, shm, metrics"):
        InstanceConfig(name="x", url="http://h", model="m", snapshots="carrier-pigeon")


def test_state_accessor(predictor: Predictor) -> None:
    r = router(predictor)
    assert r.state("i0").name == "i0"
    with pytest.raises(BearError, match="instance 'nope' is not in the pool"):
        r.state("nope")


# ---------------------------------------------------------------------- replicas


def decide_in_turn(routers: list[AsyncRouter], n: int) -> list[str]:
    out = []
    for k in range(n):
        r = routers[k % len(routers)]
        d = r.decide(PROMPT, ttft_target=5.0)
        r.record_dispatch(d)
        out.append(d.instance)
    return out


async def test_replicas_with_the_shared_overlay_decide_like_one_router(
    redis_url: str, predictor: Predictor
) -> None:
    single = decide_in_turn([router(predictor)], 12)
    # Without sharing, each replica sees only its own dispatches: all four pile
    # onto the same instance, round after round.
    independent = decide_in_turn([router(predictor) for _ in range(4)], 12)
    assert independent[:4] == [independent[0]] * 4
    assert single[:4] != [single[0]] * 4

    px = f"herd{uuid.uuid4().hex[:8]}"  # the server may be shared with other tests
    clusters = [
        Cluster(RedisBus(redis_url, prefix=px, backoff=FAST), replica=f"r{k}") for k in range(4)
    ]
    replicas = [router(predictor, c) for c in clusters]
    async with contextlib.AsyncExitStack() as stack:
        for r in replicas:
            await stack.enter_async_context(r)
        await until(lambda: all(c.bus.connected for c in clusters))
        shared = []
        for k in range(12):
            r = replicas[k % 4]
            d = r.decide(PROMPT, ttft_target=5.0)
            r.record_dispatch(d)
            shared.append(d.instance)
            # Every other replica has it in its view before the next decision.
            await until(
                lambda k=k: (
                    sum(c.overlay.stats().applied for c in clusters if c.overlay is not None)
                    == 3 * (k + 1)
                )
            )
        assert shared == single
        views = {len(r.state(n).overlay) for r in replicas for n in ("i0", "i1")}
        assert views == {6}  # every replica holds all 12 dispatches, 6 per instance


async def test_overlay_ignores_own_unknown_stale_and_shown_events(predictor: Predictor) -> None:
    class Loopback:
        def __init__(self) -> None:
            self.subs: list[Callable[[DispatchEvent], None]] = []
            self.sent: list[DispatchEvent] = []

        def publish_dispatch(self, event: DispatchEvent) -> None:
            self.sent.append(event)

        def subscribe_dispatches(
            self, callback: Callable[[DispatchEvent], None]
        ) -> Callable[[], None]:
            self.subs.append(callback)
            return lambda: self.subs.remove(callback)

    bus = Loopback()
    r = router(predictor)
    ov = SharedOverlay(bus, replica="me").attach(r)
    with pytest.raises(BearError, match="already attached"):
        ov.attach(r)
    d = r.decide(PROMPT, ttft_target=5.0)
    r.record_dispatch(d)
    assert [e.kind for e in bus.sent] == ["dispatch"]
    assert bus.sent[0].rid == d.request_id
    ov.apply(bus.sent[0])  # its own: ignored
    ov.apply(DispatchEvent("other", "dispatch", "nowhere", "x1", T0, 10))
    ov.apply(DispatchEvent("other", "dispatch", "i0", "x2", T0 - 60.0, 10))
    # A forged (or badly skewed) future stamp would never age out of the view.
    ov.apply(DispatchEvent("other", "dispatch", "i0", "x4", T0 + 1e9, 10))
    ov.apply(DispatchEvent("other", "dispatch", "i0", "w1", T0, 10))  # the snapshot has it
    ov.apply(DispatchEvent("other", "dispatch", "i1", "x3", T0, 10, 5))
    ov.apply(DispatchEvent("other", "token", "i1", "x3", T0))
    s = ov.stats()
    assert (s.published, s.applied, s.unknown, s.stale, s.shown, s.progress) == (1, 1, 1, 2, 1, 1)
    assert "x4" not in {x.rid for x in r.state("i0").overlay}
    assert [x.rid for x in r.state("i1").overlay if x.started] == ["x3"]
    ov.apply(DispatchEvent("other", "complete", "i1", "x3", T0))
    assert "x3" not in {x.rid for x in r.state("i1").overlay}
    ov.detach()
    assert bus.subs == []
    r.record_dispatch(r.decide(PROMPT, ttft_target=5.0))
    assert len(bus.sent) == 1  # detached: nothing published


# ---------------------------------------------------------------------- simulation


def test_simulated_replicas_match_one_router() -> None:
    pytest.importorskip("bearsdk.sim.engine", reason="bearsdk.sim (simulated engines) is absent")
    from bearsdk.bench._replicas_sim import simulate
    from bearsdk.bench.replicas import POOL

    def otu(mode: str) -> float:
        r = simulate(mode, profiles=POOL, rate=32.0, n=240, seed=0)
        assert r.summary.failed == 0
        return r.summary.on_time_utility

    single, independent, shared = otu("single"), otu("independent"), otu("shared-nopod")
    assert abs(shared / single - 1) <= 0.05
    assert independent < shared - 0.02
    # The bus down for the middle third: its events are lost, nothing fails.
    kill = simulate("kill", profiles=POOL, rate=32.0, n=60, seed=0)
    assert kill.lost > 0
    assert kill.summary.failed == 0
    assert set(kill.phases) == {"before", "outage", "after"}


# ---------------------------------------------------------------------- emulator, Redis killed


async def test_redis_outage_under_load_fails_no_request(redis_server: LocalRedis) -> None:
    from bearsdk.cluster import RedisSnapshotBridge
    from bearsdk.emulator import EnginePool
    from bearsdk.evaluation import drive_workload
    from bearsdk.workload import synthetic_workload

    items = synthetic_workload(48, 16.0, seed=5)  # about 3 s of arrivals
    async with (
        EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100", heartbeat_s=0.1) as pool,
        anyio.create_task_group() as tg,
    ):
        direct = pool.instance_configs()
        bridge = RedisSnapshotBridge.for_pool(
            RedisBus(redis_server.url, prefix="kill", backoff=FAST), direct, backoff=FAST
        )
        await tg.start(bridge.run)
        configs = pool.instance_configs(snapshots="redis")
        clusters = [
            Cluster(RedisBus(redis_server.url, prefix="kill", backoff=FAST), recover_after_s=0.2)
            for _ in range(3)
        ]
        predictor = Predictor.load_default()
        async with contextlib.AsyncExitStack() as stack:
            routers = [
                await stack.enter_async_context(
                    AsyncRouter(configs, PowerOfD(BEAR()), predictor=predictor, cluster=c)
                )
                for c in clusters
            ]

            async def outage() -> None:
                await anyio.sleep(1.0)
                redis_server.kill()
                await anyio.sleep(1.0)
                await anyio.to_thread.run_sync(redis_server.start)

            results = []

            async def drive(j: int) -> None:
                res, _ = await drive_workload(routers[j], items[j::3], max_tokens=16)
                results.extend(res)

            async with anyio.create_task_group() as drivers:
                drivers.start_soon(outage)
                for j in range(3):
                    drivers.start_soon(drive, j)
            assert len(results) == len(items)
            assert [r.error for r in results if r.error or r.instance is None] == []
            sources = [s for c in clusters for s in c.sources.values()]
            assert all(s.failovers >= 1 for s in sources)
            await until(lambda: not any(s.using_fallback for s in sources), 5.0)
            await until(lambda: all(c.bus.connected for c in clusters))
            assert sum(c.overlay.stats().applied for c in clusters if c.overlay) > 0
        tg.cancel_scope.cancel()


def test_bench_replicas_sim_command(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("bearsdk.sim.engine", reason="bearsdk.sim (simulated engines) is absent")
    from bearsdk.cli import main

    argv = ["bench", "replicas", "--sim", "--requests", "40", "--modes", "single,shared"]
    assert main([*argv, "--snapshot-delay", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"single", "shared"}
    assert doc["shared"][0]["replicas"] == 4
    assert doc["shared"][0]["foreign_dispatches"] == 3 * 40
    with pytest.raises(SystemExit):
        main(["bench", "replicas", "--modes", "nope"])
    assert "not a setup" in capsys.readouterr().err
