"""A decision's candidates: built when read, and then the tuple they stand for."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import bearsdk.router.candidates as cands_mod
from bearsdk.router import Decision, InstanceConfig
from bearsdk.router.candidates import Candidates, candidate
from bearsdk.router.core import RouterCore
from bearsdk.snapshot import NCOLS, Snapshot

PROFILE = "qwen3-8b-h100"


def _snap(name: str, seq: int, time: float, waiting: int) -> Snapshot:
    rows = [(0, 100, 110, 10, -1, -1, 0)] + [(1, 500, 0, 0, -1, -1, 0)] * waiting
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    return Snapshot(name, seq, time, None, tuple(f"r{i}" for i in range(len(rows))), table, None)


def _core(n: int = 4) -> tuple[RouterCore, list[float]]:
    models = ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B"]
    cfgs = [
        InstanceConfig(name=f"i{k}", url=f"http://i{k}", model=models[k % 3], profile=PROFILE)
        for k in range(n)
    ]
    clock = [10.0]
    core = RouterCore(cfgs, clock=lambda: clock[0], explore=None)
    for k, c in enumerate(cfgs):
        assert core.cache(c.name).offer(_snap(c.name, 1, clock[0], 3 * k), received=clock[0])
    return core, clock


def _eager(d: Decision) -> tuple[object, ...]:
    c = d.candidates
    assert isinstance(c, Candidates)
    f = c._feasible
    return tuple(
        candidate(r, None if f is None else f[i], c._scores[i]) for i, r in enumerate(c._rows)
    )


def test_they_are_the_tuple_they_stand_for() -> None:
    core, _ = _core(5)
    d = core.decide("hello there", ttft_target=0.5)
    c = d.candidates
    assert isinstance(c, Candidates)
    # The same records an eager build gives (repr: unpriced ones hold nan).
    assert repr(tuple(c)) == repr(_eager(d))
    want = tuple(c)
    assert len(c) == 5
    assert c == want
    assert want == c  # (a tuple compares back through the reflected __eq__)
    assert hash(c) == hash(want)
    assert repr(c) == repr(want)
    assert tuple(c) == want
    # (Built once: the same objects on every read.)
    assert c[-1] is want[-1]
    assert c[1:4] == want[1:4]
    assert c[::-2] == want[::-2]
    assert d.chosen is want[d.index]
    assert attrs.evolve(d, candidates=want) == d
    assert c != want[:-1]
    assert c != list(want)
    for bad in (5, -6):
        with pytest.raises(IndexError, match=f"candidate index {bad} out of range for 5"):
            c[bad]


def test_the_request_path_builds_only_the_chosen_one(monkeypatch: pytest.MonkeyPatch) -> None:
    core, clock = _core(8)
    built: list[str] = []
    real = cands_mod.candidate

    def counting(row, feasible, score):  # type: ignore[no-untyped-def]
        built.append(row[0].instance)
        return real(row, feasible, score)

    monkeypatch.setattr(cands_mod, "candidate", counting)
    d = core.decide("hello there", ttft_target=0.5)
    assert built == []
    core.record_dispatch(d)
    clock[0] += 0.05
    core.record_first_token(d, d.instance, 0.05)
    core.record_complete(d, d.instance, outcome="ok")
    assert built == [d.instance]
    # Reading them all builds each once.
    assert len(list(d.candidates)) == 8
    list(d.candidates)
    assert sorted(built) == sorted(c.instance for c in d.candidates)
    assert "i0" in d.explain()
