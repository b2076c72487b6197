"""Predictor files: one versioned, deterministic zip archive.

Layout of a ``.bearpred`` file (a zip archive, members in this order)::

    meta.json                     format, format version, feature version, pool,
                                  heads, feature names, provenance
    pipeline/components.npy       int32[hash_dim, n_components]
    pipeline/offset.npy           float64[n_components]
    heads/<head>/<array>.npy      the flat tree arrays of each head
    relative/weights.npy          float64[n_prompt_features, n_models] (if the predictor
    relative/intercept.npy        float64[n_models]                     has the head)

Arrays are ``.npy`` blobs (read without pickle), so a save/load round trip is
exact, and every member carries a CRC-32 that catches corruption. Timestamps and
permissions are fixed: the same predictor always produces the same bytes.

A file is refused with a clear :class:`~bearsdk.predictors.errors.PredictorFormatError`
when it is not a bearsdk predictor, is corrupt or truncated, or was written in
another format version (:data:`FORMAT_VERSION`) or with other feature
definitions (:data:`~bearsdk.predictors.features.FEATURE_VERSION`).
"""

from __future__ import annotations

from pathlib import Path

from bearsdk.predictors import _archive
from bearsdk.predictors._archive import (
    FILE_NAME,
    FORMAT,
    FORMAT_VERSION,
    encode_predictor,
    save_predictor,
)
from bearsdk.predictors.predictor import Predictor

__all__ = [
    "FILE_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "decode_predictor",
    "encode_predictor",
    "load_predictor",
    "save_predictor",
]


def load_predictor(path: str | Path) -> Predictor:
    """Read a predictor file (or the :data:`FILE_NAME` in a folder).

    Raises:
        PredictorFormatError: See the module docstring.
    """
    return _archive.decode(*_archive.read_file(path), Predictor)


def decode_predictor(data: bytes, where: str = "<bytes>") -> Predictor:
    """Rebuild a predictor from :func:`encode_predictor` bytes (``where`` names them in errors).

    Raises:
        PredictorFormatError: See the module docstring.
    """
    return _archive.decode(data, where, Predictor)
