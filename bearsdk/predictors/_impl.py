"""Selects the compiled or the pure-Python hot paths.

Two implementations honour one contract:

* ``_features_c`` (built from ``cext/_features_c.pyx``): feature extraction and
  tree evaluation in C, used by default.
* ``_features_py`` and ``_forest_py``: the pure-Python twins, the readable
  reference and the test oracle.

Setting ``BEARSDK_NO_EXTENSIONS=1`` selects the twins (as does a build without
extensions). :data:`IMPLEMENTATION` says which one is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk import _twins
from bearsdk.predictors import _features_py, _forest_py

__all__ = [
    "IMPLEMENTATION",
    "Backend",
    "FeatureExtractor",
    "Forest",
    "add_linear",
    "backend",
    "hash_counts",
    "implementations",
    "predict_pool",
]

if TYPE_CHECKING:
    from bearsdk.predictors._features_py import (
        FeatureExtractor,
        add_linear,
        hash_counts,
        predict_pool,
    )
    from bearsdk.predictors._forest_py import Forest
else:
    FeatureExtractor = _features_py.FeatureExtractor
    Forest = _forest_py.Forest
    add_linear = _features_py.add_linear
    hash_counts = _features_py.hash_counts
    predict_pool = _features_py.predict_pool
    if _twins.compiled("bearsdk.predictors._features_c") is not None:
        from bearsdk.predictors._features_c import (
            FeatureExtractor,
            Forest,
            add_linear,
            hash_counts,
            predict_pool,
        )

IMPLEMENTATION: str = FeatureExtractor.implementation
"""``"cython"`` or ``"python"``: the implementation the predictors use."""


class ExtractorLike(Protocol):
    """The feature-extractor interface both implementations honour."""

    n_features: int

    def transform_into(self, text: str, out: npt.NDArray[np.float64]) -> None:
        """Write the prompt features of ``text`` into ``out``."""
        ...


class ForestLike(Protocol):
    """The tree-ensemble interface both implementations honour."""

    n_trees: int
    n_features: int

    def predict_into(
        self, x: npt.NDArray[np.float64], out: npt.NDArray[np.float64], shared: int = 0
    ) -> None:
        """Write each row's raw score into ``out``."""
        ...


@attrs.frozen
class Backend:
    """One implementation of the hot paths.

    Attributes:
        name: ``"cython"`` or ``"python"``.
        feature_extractor: The ``FeatureExtractor`` class.
        forest: The ``Forest`` class.
        hash_counts: Signed feature-hashing counts of a prompt.
        token_hash: The 64-bit hash of a lowercased token.
        predict_pool: Features plus every head for one prompt, in one call.
        add_linear: Adds the relative-accuracy head's linear term to rows.
    """

    name: str
    feature_extractor: Callable[..., ExtractorLike]
    forest: Callable[..., ForestLike]
    hash_counts: Callable[[str, int], tuple[npt.NDArray[np.int64], int]]
    token_hash: Callable[[str], int]
    predict_pool: Callable[..., None]
    add_linear: Callable[..., None]


def implementations() -> dict[str, Backend]:
    """Return every importable implementation by name (tests run against each)."""
    out = {
        "python": Backend(
            "python",
            _features_py.FeatureExtractor,
            _forest_py.Forest,
            _features_py.hash_counts,
            _features_py.token_hash,
            _features_py.predict_pool,
            _features_py.add_linear,
        )
    }
    try:
        from bearsdk.predictors import _features_c
    except ImportError:
        return out
    out["cython"] = Backend(
        "cython",
        _features_c.FeatureExtractor,
        _features_c.Forest,
        _features_c.hash_counts,
        _features_c.token_hash,
        _features_c.predict_pool,
        _features_c.add_linear,
    )
    return out


def backend() -> Backend:
    """Return the implementation in use (:data:`IMPLEMENTATION`)."""
    return implementations()[IMPLEMENTATION]
