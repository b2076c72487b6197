"""Plugins by registry (issue 18): a snapshot source and a latency estimator registered
here, from a test file, work through AsyncRouter, RouterCore and the simulator."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import anyio
import anyio.abc
import attrs
import numpy as np
import pytest

from bearsdk.estimators.base import InstanceView, RequestInfo
from bearsdk.estimators.registry import (
    EstimatorError,
    estimator_names,
    register_estimator,
    unregister_estimator,
)
from bearsdk.predictors import Predictor
from bearsdk.router import AsyncRouter, ConfigError, InstanceConfig
from bearsdk.router.core import RouterCore
from bearsdk.router.sources import (
    SourceContext,
    SourceError,
    register_snapshot_source,
    snapshot_source_names,
    unregister_snapshot_source,
)
from bearsdk.selectors import BEAR
from bearsdk.snapshot import KVState, RequestState, Snapshot
from bearsdk.state import SnapshotCache

PER_WAITING_S = 0.125


class QueueTimes:
    """A user's estimator: a fixed time per request the router counts as waiting."""

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        return PER_WAITING_S * (view.waiting + 1)


class ListSource:
    """A user's snapshot source: hands over snapshots it was given, then idles."""

    offered: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        snap = Snapshot.build(
            [RequestState("r0", "running", 100, 120, 20, None, None, 1)],
            instance=self.name,
            seq=1,
            time=cache.clock(),
            kv=KVState(16, 4096, 4000),
        )
        cache.offer(snap)
        ListSource.offered.append(self.name)
        task_status.started()
        await anyio.sleep_forever()


@pytest.fixture
def plugins() -> Iterator[None]:
    register_estimator("queue-times", lambda ctx: QueueTimes())
    register_snapshot_source("list", lambda ctx: ListSource(ctx.config.name))
    try:
        yield
    finally:
        unregister_estimator("queue-times")
        unregister_snapshot_source("list")


def _pool(snapshots: str = "push") -> list[InstanceConfig]:
    return [
        InstanceConfig(name=n, url="http://127.0.0.1:9", model=m, profile=p, snapshots=snapshots)
        for n, m, p in (
            ("small", "Qwen/Qwen3-0.6B", "qwen3-0.6b-h100"),
            ("big", "Qwen/Qwen3-8B", "qwen3-8b-h100"),
        )
    ]


def test_builtins_are_registered_the_same_way() -> None:
    assert {"bea", "prefill-tps", "none", "score"} <= set(estimator_names())
    assert {"push", "poll", "shm", "metrics", "redis"} <= set(snapshot_source_names())


def test_a_taken_or_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(EstimatorError, match="'bea' is already registered"):
        register_estimator("bea", lambda ctx: QueueTimes())
    with pytest.raises(SourceError, match="'push' is already registered"):
        register_snapshot_source("push", lambda ctx: ListSource("x"))
    with pytest.raises(ConfigError, match=r"snapshots must be one of push, .* \(got 'nope'\)"):
        InstanceConfig(name="a", url="http://h", model="m", snapshots="nope")
    with pytest.raises(ConfigError, match="latency estimator 'nope' is not registered"):
        RouterCore(_pool(), BEAR(latency="nope"), predictor=Predictor.load_default())


def test_a_registered_estimator_prices_every_candidate(plugins: None) -> None:
    # (price_all: by default a better utility on time leaves the rest unpriced.)
    sel = BEAR(latency="queue-times", price_all=True)
    core = RouterCore(_pool(), sel, predictor=Predictor.load_default())
    d = core.decide("hello", ttft_target=0.2)
    assert {c.estimator for c in d.candidates} == {"queue-times"}
    assert all(c.ttft_s == pytest.approx(PER_WAITING_S) for c in d.candidates)
    core.record_dispatch(d)
    # The router's own dispatch waits (no first token yet): the estimator sees it.
    again = core.decide("hello", ttft_target=0.2)
    by_name = {c.instance: c.ttft_s for c in again.candidates}
    assert by_name[d.instance] == pytest.approx(2 * PER_WAITING_S)


async def test_a_registered_source_and_estimator_work_through_async_router(
    plugins: None,
) -> None:
    ListSource.offered.clear()
    async with AsyncRouter(_pool("list"), BEAR(latency="queue-times")) as router:
        assert sorted(ListSource.offered) == ["big", "small"]
        for name in router.instances:
            entry = router.cache(name).entry
            assert entry is not None
            assert entry.snapshot.instance == name
        d = await router.route("hello", ttft_target=1.0)
        assert d.chosen.estimator == "queue-times"
        # BEA replays what the custom source delivered.
        router.selector = BEAR()
        d = await router.route("hello", ttft_target=1.0)
        assert d.chosen.estimator in ("bea", "overlay", "fast-forward")
        assert math.isfinite(d.chosen.ttft_s)
        await router.add_instance(attrs.evolve(_pool("list")[0], name="late"))
        assert router.cache("late").entry is not None
        router.remove_instance("late")
        assert "late" not in router.instances


def test_a_registered_estimator_works_through_the_simulator(plugins: None) -> None:
    from bearsdk.sim import (
        PAPER_POOL,
        PolicySpec,
        Scenario,
        arrival_times,
        build_requests,
        run_scenario,
    )
    from bearsdk.workload import requests_at, task_prompts

    n = 60
    items = requests_at(task_prompts(30, seed=3), np.zeros(n), seed=3)
    rs = build_requests(items, PAPER_POOL, Predictor.load_default())
    sc = Scenario(PolicySpec("bear", (("latency", "queue-times"),)), 6.0, seed=3)
    r = run_scenario(rs, PAPER_POOL, sc, arrival_times("poisson", n, 6.0, 3))
    assert r.n == n
    assert set(r.ttft_mape) == {"all", "queue-times"}


def test_source_context_carries_the_routers_session_and_config() -> None:
    ctx = SourceContext(_pool()[0], session=None)  # type: ignore[arg-type]
    assert ctx.config.name == "small"
    assert ctx.cluster is None
    assert ctx.shadow is None


PLUGIN = """
from bearsdk.estimators.registry import register_estimator
from bearsdk.router.sources import register_snapshot_source


class PerWaiting:
    def estimate_ttft(self, request, view):
        return 0.125 * (view.waiting + 1)


register_estimator("per-waiting", lambda ctx: PerWaiting(), replace=True)


class Blind:
    # Never delivers a snapshot (its live form does not matter here).
    def deliver(self, snapshot, received):
        return None


register_snapshot_source(
    "blind", lambda ctx: None, simulated=lambda config: Blind(), replace=True
)
"""

SIM = """
[simulation]
name = "plugin"
requests = 60
seeds = [3]

[[pool]]
name = "small"
model = "Qwen/Qwen3-0.6B"
engine = "qwen3-0.6b-h100"

[[pool]]
name = "large"
model = "Qwen/Qwen3-32B"
engine = "qwen3-32b-2xh100"

[workload]
unique_prompts = 20

[policies]
bear = { latency = ["bea", "per-waiting"] }

[[sweep]]
name = "rates"
rates = [6]
"""


def test_a_plugin_estimator_works_through_bearsdk_simulate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bearsdk.cli import main

    (tmp_path / "bear_plugin_demo.py").write_text(PLUGIN)
    (tmp_path / "sim.toml").write_text(SIM)
    monkeypatch.syspath_prepend(str(tmp_path))
    # setenv, not delenv: load_plugins writes the variable, and only setenv restores
    # (removes) it afterwards, so it cannot leak into later tests' subprocesses.
    monkeypatch.setenv("BEARSDK_PLUGINS", "")
    try:
        argv = ["--plugin", "bear_plugin_demo", "simulate", "--config", str(tmp_path / "sim.toml")]
        rc = main([*argv, "--json", "--workers", "1"])
        out, _ = capsys.readouterr()
    finally:
        _drop_plugin()
    assert rc == 0
    rows = json.loads(out)["results"]
    assert {r["policy"] for r in rows} == {"bear(latency=bea)", "bear(latency=per-waiting)"}
    by = {r["policy"]: r for r in rows}
    assert "per-waiting" in by["bear(latency=per-waiting)"]["ttft_mape"]
    assert "per-waiting" not in by["bear(latency=bea)"]["ttft_mape"]


def _drop_plugin() -> None:
    if "per-waiting" in estimator_names():
        unregister_estimator("per-waiting")
    if "blind" in snapshot_source_names():
        unregister_snapshot_source("blind")


def test_a_plugin_snapshot_source_works_through_bearsdk_simulate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bearsdk.cli import main

    # Its own module name: an earlier test imported (and cached) the first one.
    (tmp_path / "bear_plugin_blind.py").write_text(PLUGIN)
    blind = SIM
    for engine in ('engine = "qwen3-32b-2xh100"', 'engine = "qwen3-0.6b-h100"'):
        blind = blind.replace(engine, f'{engine}\nsnapshots = "blind"')
    blind = blind.replace('latency = ["bea", "per-waiting"]', 'latency = ["bea"]')
    (tmp_path / "sim.toml").write_text(blind)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BEARSDK_PLUGINS", "")
    try:
        argv = ["--plugin", "bear_plugin_blind", "simulate", "--config", str(tmp_path / "sim.toml")]
        rc = main([*argv, "--json", "--workers", "1"])
        out, _ = capsys.readouterr()
    finally:
        _drop_plugin()
    assert rc == 0
    (row,) = json.loads(out)["results"]
    # No snapshot ever reached the router: every decision fell back to LPS.
    assert set(row["ttft_mape"]) == {"all", "lps"}


def test_a_source_without_a_simulated_form_is_refused_by_the_simulator(tmp_path: Path) -> None:
    from bearsdk.sim.config import SimConfigError, load_config

    small = 'engine = "qwen3-0.6b-h100"'
    cfg = SIM.replace(small, f'{small}\nsnapshots = "metrics"')
    (tmp_path / "sim.toml").write_text(cfg)
    with pytest.raises(SimConfigError, match="snapshots: source 'metrics' has no simulated form"):
        load_config(tmp_path / "sim.toml")
    (tmp_path / "sim.toml").write_text(cfg.replace('"metrics"', '"carrier-pigeon"'))
    with pytest.raises(SimConfigError, match=r"snapshots must be one of .*'carrier-pigeon'"):
        load_config(tmp_path / "sim.toml")


def test_a_plugin_that_cannot_be_imported_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bearsdk.cli import main

    assert main(["--plugin", "no_such_bear_plugin", "simulate", "--config", "x.toml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--plugin 'no_such_bear_plugin': cannot import it" in err
