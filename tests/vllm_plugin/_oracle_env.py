"""Import paths for the scripts of this folder that run under the vllm-oracle interpreter.

The oracle's virtual environment (``../shared/tools/vllm-oracle/setup.sh``) has
vLLM 0.33 but not bearsdk, and not every bearsdk dependency (it lacks
``orjson``). :func:`setup` puts the repository first on ``sys.path`` (bearsdk
is used from the working tree, compiled extensions included: same CPython) and,
only if a bearsdk dependency is missing there, appends the bearsdk venv's
``site-packages`` *after* the oracle's own, so vLLM keeps its own versions of
everything it has. Point ``BEARSDK_FALLBACK_SITE`` at another ``site-packages``
to override. Nothing is installed into the oracle environment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared"))
ORACLE_DIR = SHARED / "tools" / "vllm-oracle"
BEARSDK_DEPS = ("orjson", "attrs", "anyio", "aiohttp", "numpy")


def fallback_site() -> Path | None:
    """The ``site-packages`` that provides bearsdk's dependencies the oracle lacks."""
    explicit = os.environ.get("BEARSDK_FALLBACK_SITE")
    if explicit:
        return Path(explicit)
    found = sorted((REPO / ".venv" / "lib").glob("python3.*/site-packages"))
    return found[0] if found else None


def setup() -> Path:
    """Make bearsdk and the oracle's scripts importable; returns the oracle's folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for p in (str(ORACLE_DIR), str(REPO)):
        if p not in sys.path:
            sys.path.insert(0, p)
    missing = [m for m in BEARSDK_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        site = fallback_site()
        if site is None:
            raise ImportError(
                f"bearsdk needs {missing}, which this interpreter lacks; set "
                "BEARSDK_FALLBACK_SITE to a site-packages that has them"
            )
        sys.path.append(str(site))
    return ORACLE_DIR
