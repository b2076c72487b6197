"""The public API: everything public is exported, typed and documented."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import bearsdk


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
    assert set(bearsdk._HOMES) | {"__version__"} == set(bearsdk.__all__)


def test_import_loads_nothing_heavy() -> None:
    # `import bearsdk` must stay cheap: no emulator, simulator, Redis or HTTP
    # client code until a name that needs them is used.
    code = (
        "import sys, bearsdk\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith(('bearsdk', 'aiohttp',"
        " 'redis', 'numpy', 'lightgbm')))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.split(",") == ["bearsdk"], out


def test_a_name_loads_its_home_on_first_use() -> None:
    code = (
        "import sys, bearsdk\n"
        "assert 'bearsdk.snapshot' not in sys.modules\n"
        "s = bearsdk.decode_snapshot\n"
        "import bearsdk.snapshot\n"
        "assert s is bearsdk.snapshot.decode_snapshot\n"
        "assert 'bearsdk.emulator' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = bearsdk.nope  # type: ignore[attr-defined]
