"""The predictor archive: writing a Predictor's parts and reading them back.

The format is documented in :mod:`bearsdk.predictors.serialize`, its public
home. This module sits below :class:`~bearsdk.predictors.predictor.Predictor`:
it reads a Predictor's fields to write one and is handed the class to build
one, so that the class can save and load itself without an import cycle.
"""

from __future__ import annotations

import io
import os
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt
import orjson

from bearsdk.predictors._forest import ARRAY_FIELDS, TreeEnsemble
from bearsdk.predictors.errors import PredictorError, PredictorFormatError
from bearsdk.predictors.features import FEATURE_VERSION, FeaturePipeline
from bearsdk.predictors.pool import pool_from_dicts
from bearsdk.predictors.relative import RelativeAccuracy

if TYPE_CHECKING:
    # Typing only: the class is handed in by whoever builds one (the archive
    # sits below the Predictor, which saves and loads itself through it).
    from bearsdk.predictors.predictor import Predictor

__all__ = [
    "FILE_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "decode",
    "encode_predictor",
    "read_file",
    "save_predictor",
]

FORMAT: Final = "bearsdk.predictor"
FORMAT_VERSION: Final = 2
"""Version of the archive layout; a file of another version is refused on load."""
FILE_NAME: Final = "predictor.bearpred"
"""File name used when a folder is given to save or load."""

_EPOCH: Final = (1980, 1, 1, 0, 0, 0)


def _written_by() -> str:
    from bearsdk import __version__

    return f"bearsdk {__version__}"


def _npy(arr: npt.NDArray[Any]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def encode_predictor(pred: Predictor) -> bytes:
    """Return the archive bytes of ``pred`` (deterministic)."""
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "feature_version": pred.pipeline.version,
        "written_by": _written_by(),
        "pool": [m.to_dict() for m in pred.pool],
        "heads": {
            name: {
                "objective": ens.objective,
                "n_features": ens.n_features,
                "n_trees": ens.n_trees,
                "base_feature": ens.base_feature,
                "quantile": pred.quantiles.get(name),
            }
            for name, ens in sorted(pred.heads.items())
        },
        "feature_names": list(pred.feature_names),
        "info": pred.info,
        "relative": None if pred.relative is None else pred.relative.info(),
    }
    members: list[tuple[str, bytes]] = [
        ("meta.json", orjson.dumps(meta, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)),
        ("pipeline/components.npy", _npy(pred.pipeline.components)),
        ("pipeline/offset.npy", _npy(pred.pipeline.offset)),
    ]
    for name, ens in sorted(pred.heads.items()):
        for field, arr in ens.arrays().items():
            members.append((f"heads/{name}/{field}.npy", _npy(arr)))
    if pred.relative is not None:
        members.append(("relative/weights.npy", _npy(pred.relative.weights)))
        members.append(("relative/intercept.npy", _npy(pred.relative.intercept)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, data, compresslevel=9)
    return buf.getvalue()


def save_predictor(pred: Predictor, path: str | Path) -> Path:
    """Write ``pred`` to ``path`` (a file, or an existing folder / a path ending in ``/``
    to hold :data:`FILE_NAME`), atomically. Returns the file written."""
    target = Path(path)
    if target.is_dir() or str(path).endswith(("/", os.sep)):
        target = target / FILE_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    data = encode_predictor(pred)
    fd, tmp = tempfile.mkstemp(prefix=".predictor-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def read_file(path: str | Path) -> tuple[bytes, str]:
    """Return the bytes of a predictor file (or the :data:`FILE_NAME` in a folder)
    and the path that names them in errors.

    Raises:
        PredictorFormatError: The file cannot be read.
    """
    target = Path(path)
    if target.is_dir():
        target = target / FILE_NAME
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise PredictorFormatError(
            "file", f"cannot be read: {exc.strerror}", path=str(target)
        ) from exc
    return data, str(target)


def _check_meta(meta: object) -> dict[str, Any]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PredictorFormatError("meta.json", f"does not describe a {FORMAT!r} file")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise PredictorFormatError(
            "format_version",
            "is not supported: the file was written by "
            f"{meta.get('written_by', 'an unknown writer')} "
            f"in format version {version}, this {_written_by()} reads format version "
            f"{FORMAT_VERSION}; retrain with `bearsdk train` or load it with the release "
            "that wrote it",
            version,
        )
    if meta.get("feature_version") != FEATURE_VERSION:
        raise PredictorFormatError(
            "feature_version",
            "is not supported: the file's prompt features are version "
            f"{meta.get('feature_version')}, this {_written_by()} computes version "
            f"{FEATURE_VERSION}; retrain with `bearsdk train`",
            meta.get("feature_version"),
        )
    for key, kind in (("pool", list), ("heads", dict), ("feature_names", list), ("info", dict)):
        if not isinstance(meta.get(key), kind):
            raise PredictorFormatError(key, f"must be a JSON {kind.__name__}")
    return meta


def _array(zf: zipfile.ZipFile, name: str) -> npt.NDArray[Any]:
    try:
        raw = zf.read(name)
    except KeyError:
        raise PredictorFormatError(name, "is missing from the archive") from None
    arr: npt.NDArray[Any] = np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    return arr


def _relative(zf: zipfile.ZipFile, meta: dict[str, Any]) -> RelativeAccuracy | None:
    rel = meta.get("relative")
    if rel is None:
        return None
    if not isinstance(rel, dict):
        raise PredictorFormatError("relative", "must be a JSON object or null")
    penalty, gain, n = rel.get("penalty"), rel.get("loo_spearman_gain"), rel.get("n_prompts")
    if not isinstance(penalty, float):
        raise PredictorFormatError("relative.penalty", "must be a number", penalty)
    if not isinstance(gain, float):
        raise PredictorFormatError("relative.loo_spearman_gain", "must be a number", gain)
    if not isinstance(n, int) or isinstance(n, bool):
        raise PredictorFormatError("relative.n_prompts", "must be an int", n)
    return RelativeAccuracy(
        _array(zf, "relative/weights.npy"), _array(zf, "relative/intercept.npy"), penalty, gain, n
    )


def _decode(zf: zipfile.ZipFile, cls: type[Predictor]) -> Predictor:
    try:
        raw_meta = zf.read("meta.json")
    except KeyError:
        raise PredictorFormatError(
            "meta.json", "is missing: not a bearsdk predictor file"
        ) from None
    meta = _check_meta(orjson.loads(raw_meta))
    pipeline = FeaturePipeline(
        _array(zf, "pipeline/components.npy"),
        _array(zf, "pipeline/offset.npy"),
        meta["feature_version"],
    )
    pool = pool_from_dicts(meta["pool"], field="pool")
    heads: dict[str, TreeEnsemble] = {}
    quantiles: dict[str, float] = {}
    for name, head in meta["heads"].items():
        if not isinstance(head, dict):
            raise PredictorFormatError(f"heads.{name}", "must be a JSON object")
        arrays = {field: _array(zf, f"heads/{name}/{field}.npy") for field in ARRAY_FIELDS}
        n_features = head.get("n_features")
        if not isinstance(n_features, int) or isinstance(n_features, bool):
            raise PredictorFormatError(f"heads.{name}.n_features", "must be an int", n_features)
        base_feature = head.get("base_feature", -1)
        if not isinstance(base_feature, int) or isinstance(base_feature, bool):
            raise PredictorFormatError(f"heads.{name}.base_feature", "must be an int", base_feature)
        heads[name] = TreeEnsemble.from_arrays(
            str(head.get("objective")), n_features, arrays, base_feature
        )
        q = head.get("quantile")
        if q is not None:
            if not isinstance(q, float):
                raise PredictorFormatError(f"heads.{name}.quantile", "must be a number", q)
            quantiles[name] = q
    pred = cls(pipeline, pool, heads, quantiles, meta["info"], _relative(zf, meta))
    if list(pred.feature_names) != meta["feature_names"]:
        raise PredictorFormatError(
            "feature_names", "differ from the features this bearsdk computes; retrain the predictor"
        )
    return pred


def decode(data: bytes, where: str, cls: type[Predictor]) -> Predictor:
    """Rebuild a ``cls`` from :func:`encode_predictor` bytes (``where`` names them in errors).

    Raises:
        PredictorFormatError: See :mod:`bearsdk.predictors.serialize`.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            return _decode(zf, cls)
    except PredictorFormatError as exc:
        raise exc.at(where) from None
    except PredictorError as exc:
        raise PredictorFormatError("content", f"is invalid: {exc}", path=where) from exc
    except (
        zipfile.BadZipFile,
        zlib.error,
        EOFError,
        orjson.JSONDecodeError,
        ValueError,
        OSError,
    ) as exc:
        raise PredictorFormatError(
            "file", f"is corrupt or truncated, not a readable bearsdk predictor ({exc})", path=where
        ) from exc
