"""The public API: everything public is exported, typed and documented."""

from __future__ import annotations

import inspect

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
