"""The one place that chooses between a compiled module and its pure-Python twin.

Every hot path of bearsdk has two implementations (as aio-libs do it): a Cython
module built from ``cext/`` and a pure-Python twin that is the readable
reference and the test oracle. ``BEARSDK_NO_EXTENSIONS=1`` (read here, once, at
import) selects the twins everywhere; so does a build without extensions. Each
selector module asks :func:`compiled` for its extension and falls back to its
twin when it gets ``None``; :func:`loaded` reports the choice for every pair
(``bearsdk --version`` prints it).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = ["NO_EXTENSIONS", "PAIRS", "available", "compiled", "loaded"]

NO_EXTENSIONS: Final[bool] = os.environ.get("BEARSDK_NO_EXTENSIONS", "").strip().lower() not in {
    "",
    "0",
    "no",
    "false",
}
"""True when ``BEARSDK_NO_EXTENSIONS`` asks for the pure-Python twins."""

PAIRS: Final[dict[str, tuple[str, str]]] = {
    "replay": ("bearsdk.replay._replay_c", "bearsdk.replay._replay_py"),
    "snapshot": ("bearsdk._snapshot_c", "bearsdk.snapshot"),
    "prefix-cache": ("bearsdk._prefix_cache_c", "bearsdk.prefix_cache"),
    "features": ("bearsdk.predictors._features_c", "bearsdk.predictors._features_py"),
    "shm": ("bearsdk.io._shm_c", "bearsdk.io._shm_py"),
    "vllm-publisher": ("bearsdk.vllm._pub_c", "bearsdk.vllm._pub_py"),
    "prefix-index": ("bearsdk.kvevents._index_c", "bearsdk.kvevents._index_py"),
    "pretokenizer": ("bearsdk.prompts._pretok_c", "bearsdk.prompts._pretok_py"),
}
"""Each twin pair by name: (compiled module, pure-Python twin)."""


def available(name: str) -> ModuleType | None:
    """The compiled module ``name`` if it is built, whatever the environment says.

    For tests and benchmarks that run both implementations side by side.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def compiled(name: str) -> ModuleType | None:
    """The compiled module ``name`` to use, or ``None`` to use its twin.

    ``None`` when ``BEARSDK_NO_EXTENSIONS`` is set or the module is not built.
    """
    return None if NO_EXTENSIONS else available(name)


def _built(name: str) -> bool:
    if name in sys.modules:
        return True
    # Without importing: importing a submodule runs its packages' __init__, and
    # some pull in aiohttp and Redis; `bearsdk --version` must stay instant.
    parts = name.split(".")
    folder = Path(__file__).resolve().parent.joinpath(*parts[1:-1])
    return any(
        (folder / (parts[-1] + suffix)).is_file()
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def loaded() -> dict[str, str]:
    """``"cython"`` or ``"python"`` for every pair of :data:`PAIRS`: what is in use."""
    return {
        pair: "python" if NO_EXTENSIONS or not _built(ext) else "cython"
        for pair, (ext, _) in PAIRS.items()
    }
