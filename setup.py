"""Build script for bearsdk's Cython extensions.

Cython sources live in ``cext/`` and compile into extension modules inside the
``bearsdk`` package (as aio-libs do it). Environment switches:

* ``BEARSDK_NO_EXTENSIONS=1``: build and install the pure-Python package only.
* ``BEARSDK_CYTHON_DEBUG=1``: turn bounds, wraparound and initialisation checks
  back on (slower; for hunting memory errors in the hot loops).
"""

from __future__ import annotations

import os

from setuptools import setup

# Module name -> Cython source. The module lands next to its pure-Python twin.
EXTENSIONS = {
    "bearsdk.replay._replay_c": "cext/_replay_c.pyx",
    "bearsdk.replay._replay_apc_c": "cext/_replay_apc_c.pyx",
    "bearsdk.predictors._features_c": "cext/_features_c.pyx",
    "bearsdk._snapshot_c": "cext/_snapshot_c.pyx",
    "bearsdk._prefix_cache_c": "cext/_prefix_cache_c.pyx",
    "bearsdk.io._shm_c": "cext/_shm_c.pyx",
    "bearsdk.kvevents._index_c": "cext/_index_c.pyx",
    "bearsdk.prompts._pretok_c": "cext/_pretok_c.pyx",
    "bearsdk.vllm._pub_c": "cext/_vllm_pub_c.pyx",
}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _extensions() -> list:
    if _truthy("BEARSDK_NO_EXTENSIONS"):
        return []
    from Cython.Build import cythonize
    from setuptools import Extension

    debug = _truthy("BEARSDK_CYTHON_DEBUG")
    directives = {
        "language_level": 3,
        "boundscheck": debug,
        "wraparound": debug,
        "initializedcheck": debug,
        "cdivision": True,
        "nonecheck": debug,
        "embedsignature": True,
    }
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # The checked allocation helpers every module cimports (listed so that an
    # sdist ships them and a change rebuilds the modules).
    shared = ["cext/_mem.pxd", "cext/_pyint.pxd", "cext/_replay_defs.pxd"]
    exts = [
        Extension(name, [src], depends=shared, extra_compile_args=opt, define_macros=[])
        for name, src in EXTENSIONS.items()
    ]
    return cythonize(
        exts, compiler_directives=directives, include_path=["cext"], quiet=True, nthreads=_jobs()
    )


def _jobs() -> int:
    # Cython and the C compiler run per module; a fresh install builds them all
    # (twice in CI: lint, then the README's test command), so use every core.
    return max(1, min(len(EXTENSIONS), os.cpu_count() or 1))


setup(ext_modules=_extensions(), options={"build_ext": {"parallel": _jobs()}})
