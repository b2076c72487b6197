"""The public API: small, typed, documented, lazy; the old names still resolve, with a warning."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys

import pytest

import bearsdk


def test_all_is_small() -> None:
    # What a user embedding the router needs; the rest lives in subpackages.
    assert 30 <= len(bearsdk.__all__) <= 42, len(bearsdk.__all__)


def test_all_is_complete_and_importable() -> None:
    for name in bearsdk.__all__:
        assert hasattr(bearsdk, name), name
    public = {n for n in dir(bearsdk) if not n.startswith("_")}
    # Submodules are reachable as attributes but are not API names.
    modules = {n for n in public if inspect.ismodule(getattr(bearsdk, n))}
    assert public - modules <= set(bearsdk.__all__) | {"annotations"}, (
        public - modules - set(bearsdk.__all__)
    )


def test_public_objects_have_docstrings() -> None:
    for name in bearsdk.__all__:
        obj = getattr(bearsdk, name)
        if callable(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def test_every_public_name_has_one_home() -> None:
    # The lazy loader and __all__ are two lists of one set of names.
    assert set(bearsdk._HOMES) | {"__version__", "twins"} == set(bearsdk.__all__)
    assert not set(bearsdk._HOMES) & set(bearsdk._MOVED)


@pytest.mark.parametrize("name", sorted(bearsdk._HOMES))
def test_a_public_name_is_its_homes_object(name: str) -> None:
    assert getattr(bearsdk, name) is getattr(importlib.import_module(bearsdk._HOMES[name]), name)


def test_import_loads_nothing_heavy() -> None:
    # `import bearsdk` must stay cheap: no emulator, simulator, cluster, Redis or
    # HTTP client code until a name that needs them is used.
    code = "import json, sys, bearsdk\nprint(json.dumps(sorted(sys.modules)))\n"
    loaded = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    ours = [m for m in loaded if m == "bearsdk" or m.startswith("bearsdk.")]
    assert ours == ["bearsdk"], ours
    heavy = ("aiohttp", "redis", "numpy", "lightgbm", "anyio", "attrs", "orjson")
    assert not [m for m in loaded if m.split(".")[0] in heavy]


def test_the_router_loads_no_emulator_sim_or_cluster() -> None:
    code = (
        "import json, sys, bearsdk\n"
        "bearsdk.AsyncRouter, bearsdk.BEAR, bearsdk.SchedulerSpec, bearsdk.StalenessRules\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    for pkg in ("bearsdk.emulator", "bearsdk.sim", "bearsdk.cluster", "redis"):
        assert not [m for m in loaded if m == pkg or m.startswith(pkg + ".")], pkg


def test_a_name_loads_its_home_on_first_use() -> None:
    code = (
        "import sys, bearsdk\n"
        "assert 'bearsdk.schedulers' not in sys.modules\n"
        "s = bearsdk.SchedulerSpec\n"
        "import bearsdk.schedulers\n"
        "assert s is bearsdk.schedulers.SchedulerSpec\n"
        "assert 'bearsdk.emulator' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = bearsdk.nope  # type: ignore[attr-defined]


def test_a_dropped_name_warns_and_still_resolves() -> None:
    from bearsdk.emulator import EmulatedEngine

    with pytest.warns(
        DeprecationWarning,
        match=r"^bearsdk\.EmulatedEngine is deprecated: import it from bearsdk\.emulator$",
    ):
        got = bearsdk.EmulatedEngine
    assert got is EmulatedEngine
    assert "EmulatedEngine" not in bearsdk.__all__
    assert "EmulatedEngine" not in dir(bearsdk)


def test_from_import_of_a_dropped_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="import it from bearsdk.snapshot"):
        from bearsdk import Snapshot
    from bearsdk.snapshot import Snapshot as home

    assert Snapshot is home


@pytest.mark.parametrize("name", sorted(bearsdk._MOVED))
def test_every_dropped_name_resolves_to_its_new_home(name: str) -> None:
    module, new = bearsdk._MOVED[name]
    with pytest.warns(DeprecationWarning, match=f"bearsdk.{name} is deprecated"):
        got = getattr(bearsdk, name)
    assert got is getattr(importlib.import_module(module), new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("policy", "bearsdk.bind_scheduler"),
        ("Policy", "bearsdk.schedulers.BoundScheduler"),
        ("compile_policy", "bearsdk.schedulers.compile_scheduler"),
        ("StalenessPolicy", "bearsdk.StalenessRules"),
    ],
)
def test_a_renamed_name_points_at_its_new_name(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"bearsdk.{old} is deprecated: use {new}$"):
        getattr(bearsdk, old)


def test_the_old_words_stay_aliases_in_their_subpackages() -> None:
    # No warning there: bearsdk's own code still uses them for one release.
    from bearsdk import schedulers, state
    from bearsdk.replay import compile

    assert schedulers.Policy is schedulers.BoundScheduler
    assert schedulers.policy is schedulers.bind_scheduler
    assert schedulers.compile_policy is schedulers.compile_scheduler is compile.compile_policy
    assert state.StalenessPolicy is state.StalenessRules


def test_instance_state_takes_rules_and_the_old_keyword() -> None:
    from bearsdk.estimators import BatchTimeModel
    from bearsdk.state import InstanceState, SnapshotCache, StalenessRules

    est = bearsdk.BEAEstimator(bearsdk.bind_scheduler("vllm-v1"), BatchTimeModel(4e-3, 0, 0, 0))
    paper = StalenessRules.paper()
    new = InstanceState(SnapshotCache("a"), est, rules=paper)
    old = InstanceState(SnapshotCache("b"), est, policy=paper)
    assert new.rules is paper
    assert old.rules is paper
    assert InstanceState(SnapshotCache("c"), est).rules == StalenessRules()


def test_twins_reports_every_pair() -> None:
    from bearsdk import _twins

    assert bearsdk.twins() == _twins.loaded()
    assert set(bearsdk.twins()) == set(_twins.PAIRS)
