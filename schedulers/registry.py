"""The registry of scheduler specs: built-ins plus those users register."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from bearsdk.errors import SpecError
from bearsdk.schedulers.spec import SchedulerSpec, load_spec, spec_from_dict

__all__ = ["get_scheduler", "register_scheduler", "scheduler_names", "unregister_scheduler"]

_lock = threading.Lock()
_registry: dict[str, SchedulerSpec] = {}
_builtins: frozenset[str] = frozenset()
_loaded = False


def _load_builtins() -> None:
    global _loaded, _builtins
    with _lock:
        if _loaded:
            return
        names = []
        for entry in sorted(
            resources.files("bearsdk.schedulers").joinpath("specs").iterdir(), key=str
        ):
            if entry.name.endswith(".toml"):
                with resources.as_file(entry) as path:
                    spec = load_spec(path)
                _registry[spec.name] = spec
                names.append(spec.name)
        _builtins = frozenset(names)
        _loaded = True


def register_scheduler(
    spec: SchedulerSpec | Mapping[str, Any] | str | Path, *, replace: bool = False
) -> SchedulerSpec:
    """Register a scheduler spec so that instances and replays can name it.

    Args:
        spec: A :class:`SchedulerSpec`, its dict form, or the path of a TOML file.
        replace: Allow replacing a registered spec of the same name (never a
            built-in).

    Returns:
        The registered spec.

    Raises:
        SpecError: The spec is invalid, or the name is taken.
    """
    _load_builtins()
    if isinstance(spec, str | Path):
        spec = load_spec(spec)
    elif not isinstance(spec, SchedulerSpec):
        spec = spec_from_dict(spec)
    with _lock:
        if spec.name in _builtins:
            raise SpecError(
                spec.name, "name", "is a built-in scheduler and cannot be replaced", spec.name
            )
        if spec.name in _registry and not replace:
            raise SpecError(
                spec.name, "name", "is already registered (pass replace=True)", spec.name
            )
        _registry[spec.name] = spec
    return spec


def unregister_scheduler(name: str) -> None:
    """Remove a user-registered scheduler.

    Raises:
        SpecError: The name is a built-in or not registered.
    """
    _load_builtins()
    with _lock:
        if name in _builtins:
            raise SpecError(name, "name", "is a built-in scheduler and cannot be removed", name)
        if name not in _registry:
            raise SpecError(name, "name", "is not registered", name)
        del _registry[name]


def get_scheduler(name: str) -> SchedulerSpec:
    """Return the registered spec called ``name``.

    Raises:
        SpecError: No such scheduler (the message lists the known ones).
    """
    _load_builtins()
    try:
        return _registry[name]
    except KeyError:
        known = ", ".join(sorted(_registry))
        raise SpecError(
            name, "name", f"is not a registered scheduler (known: {known})", name
        ) from None


def scheduler_names() -> list[str]:
    """Return the names of every registered scheduler, sorted."""
    _load_builtins()
    return sorted(_registry)
