"""Bounded exploration: an instance with no speed evidence is not locked out for good."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from bearsdk.estimators.batch_model import BatchTimeModel
from bearsdk.router import Exploration, InstanceConfig
from bearsdk.router.core import RouterCore
from bearsdk.router.explore import Explorer
from bearsdk.snapshot import NCOLS, Snapshot
from bearsdk.state.speed import SpeedTracker

PROFILE = "qwen3-8b-h100"


def test_the_share_is_what_was_asked_and_reproducible() -> None:
    ex = Explorer(Exploration(share=0.1, seed=7))
    draws = [ex.draw() for _ in range(20_000)]
    assert 0.09 < sum(draws) / len(draws) < 0.11
    again = Explorer(Exploration(share=0.1, seed=7))
    assert [again.draw() for _ in range(20_000)] == draws
    assert not any(Explorer(Exploration(share=0.0)).draw() for _ in range(1000))


def test_it_explores_the_oldest_evidence_that_could_be_on_time() -> None:
    ex = Explorer(Exploration(after_s=30.0, max_ratio=1.5))
    now, target = 100.0, 1.0
    # 0: chosen; 1: fresh evidence; 2: 40 s old; 3: none, but predicted 3x
    # the target; 4: not learned; 5: no replayed estimate.
    ttfts = [0.1, 0.2, 1.4, 3.0, 0.1, math.nan]
    at = [99.0, 95.0, 60.0, -math.inf, math.nan, -math.inf]
    assert ex.pick(0, ttfts, at, target, now) == (2, "explore: speed evidence 40 s old")
    # With a tighter target instance 2 could not be on time: nothing to explore.
    assert ex.pick(0, ttfts, at, 0.5, now) is None
    # Never the selector's own choice, and none yet beats old.
    at[3], ttfts[3] = -math.inf, 0.3
    assert ex.pick(0, ttfts, at, target, now) == (3, "explore: speed evidence none yet")
    assert ex.pick(3, ttfts, at, target, now) == (2, "explore: speed evidence 40 s old")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"share": 0.9}, r"exploration: share must be in \[0, 0.5\] \(got 0.9\)"),
        ({"after_s": 0}, r"exploration: after_s must be a finite number > 0 \(got 0\)"),
        ({"max_ratio": math.inf}, r"exploration: max_ratio must be a finite number > 0"),
    ],
)
def test_bad_settings_name_the_field(kw: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Exploration(**kw)


def _snap(name: str, seq: int, time: float, computed: int) -> Snapshot:
    # One request decoding: successive ones are speed evidence.
    row = (0, 100, computed, computed - 100, -1, -1, 0)
    table = np.array([row], dtype=np.int64).reshape(1, NCOLS)
    return Snapshot(name, seq, time, None, ("r0",), table, None, "e1")


def _router(explore: Exploration | None) -> tuple[RouterCore, list[float]]:
    clock = [1000.0]
    # Two instances of one model: BEAR's choice between them is the tie-break;
    # only "busy" gives speed evidence.
    cfgs = [
        InstanceConfig(name=n, url=f"http://{n}", model="Qwen/Qwen3-8B", profile=PROFILE)
        for n in ("busy", "idle")
    ]
    # Learning down to 0.05: "busy" proves faster than its profile, so the
    # selector prefers it and exploration has somewhere else to go.
    speed = SpeedTracker(BatchTimeModel(0.0, 0.0, 0.0, 0.0), min_factor=0.05)
    core = RouterCore(cfgs, clock=lambda: clock[0], explore=explore, speed=speed)
    return core, clock


@pytest.mark.parametrize("explore", [True, False])
def test_the_router_explores_the_instance_without_evidence(explore: bool) -> None:
    core, clock = _router(Exploration(share=0.2, seed=3) if explore else None)
    idle = core.cache("idle")
    busy = core.cache("busy")
    assert idle.offer(attrs.evolve(_snap("idle", 1, clock[0], 150), instance="idle"))
    explored = []
    for k in range(400):
        clock[0] += 0.1
        busy.offer(_snap("busy", k + 1, clock[0], 150 + 50 * k), received=clock[0])
        idle.offer(_snap("idle", k + 2, clock[0], 150), received=clock[0])
        d = core.decide("hello there", ttft_target=5.0)
        if d.explored:
            explored.append(d)
    sp = core.speed("busy")
    assert sp is not None
    assert sp.intervals > 100
    if not explore:
        assert explored == []
        return
    # About the share of decisions, each to the instance that gave no evidence
    # and while it was not the selector's choice, said so.
    assert 20 < len(explored) < 160
    assert all(d.instance == "idle" for d in explored)
    assert all(d.reason == "explore: speed evidence none yet" for d in explored)
    assert all(d.candidates[d.index].instance == "idle" for d in explored)
