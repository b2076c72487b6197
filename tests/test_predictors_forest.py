"""Flattened tree ensembles: equal to LightGBM's own predictions, validated before use."""

from __future__ import annotations

from typing import Any

import lightgbm as lgb
import numpy as np
import numpy.typing as npt
import pytest

from bearsdk.predictors import PredictorFormatError, _impl
from bearsdk.predictors._forest import MAX_TREE_SPLITS, TreeEnsemble

BACKENDS = _impl.implementations()


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> _impl.Backend:
    return BACKENDS[request.param]


def _data(n: int, seed: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6))
    x[:, 5] = rng.integers(0, 40, n)  # categorical
    x[:, 3] = np.where(rng.random(n) < 0.3, 0.0, x[:, 3])
    x[:, :5][rng.random((n, 5)) < 0.05] = np.nan
    y = (
        2 * np.nan_to_num(x[:, 0])
        + np.sin(np.nan_to_num(x[:, 1]))
        + (x[:, 5] % 3)
        + 0.1 * rng.normal(size=n)
    )
    return x, y


def _booster(objective: str, **extra: object) -> lgb.Booster:
    x, y = _data(1500, 1)
    params = {
        "objective": objective,
        "verbose": -1,
        "num_leaves": 15,
        "learning_rate": 0.1,
        "min_data_in_leaf": 5,
        "num_threads": 1,
        "deterministic": True,
        **extra,
    }
    ds = lgb.Dataset(x, y, categorical_feature=[5], params={"verbose": -1})
    return lgb.train(params, ds, num_boost_round=40)


@pytest.fixture(scope="module", params=["huber", "regression", "quantile"])
def booster(request: pytest.FixtureRequest) -> lgb.Booster:
    return _booster(request.param)


def test_equals_lightgbm_bit_for_bit(backend: _impl.Backend, booster: lgb.Booster) -> None:
    ens = TreeEnsemble.from_lightgbm(booster.model_to_string())
    assert ens.n_trees == 40
    assert (ens.decision & 1).any(), "the fixture should exercise categorical splits"
    x, _ = _data(400, 2)
    x[:6, 5] = [0.5, -0.5, -3.0, 1e12, np.nan, 39.9]  # truncation, negatives, overflow, NaN
    x = np.ascontiguousarray(x)
    forest = backend.forest(**ens.evaluator_args())
    out = np.empty(x.shape[0])
    forest.predict_into(x, out)
    assert out.tobytes() == np.asarray(booster.predict(x)).tobytes()


def test_shared_walk_equals_row_walk(backend: _impl.Backend) -> None:
    ens = TreeEnsemble.from_lightgbm(_booster("huber").model_to_string())
    forest = backend.forest(**ens.evaluator_args())
    rng = np.random.default_rng(5)
    for n_rows in (1, 3, 8, 64, 70):
        x = np.repeat(rng.normal(size=(1, 6)), n_rows, axis=0)
        x[:, 5] = rng.integers(0, 45, n_rows)  # rows differ in the "model" column only
        x[:, 4] = rng.normal(size=n_rows)
        shared, plain = np.empty(n_rows), np.empty(n_rows)
        forest.predict_into(x, shared, 4)
        forest.predict_into(x, plain)
        assert shared.tobytes() == plain.tobytes()


def test_constant_trees_and_empty_inputs(backend: _impl.Backend) -> None:
    x = np.zeros((20, 2))
    y = np.full(20, 3.5)
    b = lgb.train(
        {"objective": "regression", "verbose": -1, "min_data_in_leaf": 1}, lgb.Dataset(x, y), 3
    )
    ens = TreeEnsemble.from_lightgbm(b.model_to_string())
    forest = backend.forest(**ens.evaluator_args())
    out = np.empty(4)
    forest.predict_into(np.ones((4, 2)), out)
    assert np.array_equal(out, b.predict(np.ones((4, 2))))
    forest.predict_into(np.ones((0, 2)), np.empty(0))
    with pytest.raises(ValueError, match="slots"):
        forest.predict_into(np.ones((4, 2)), np.empty(3))


def test_rejects_unsupported_models() -> None:
    x, y = _data(300, 3)
    binary = lgb.train(
        {"objective": "binary", "verbose": -1}, lgb.Dataset(x, (y > 1).astype(float)), 2
    )
    with pytest.raises(PredictorFormatError, match=r"objective must be one of .*\(got 'binary'\)"):
        TreeEnsemble.from_lightgbm(binary.model_to_string())


def _arrays(booster: lgb.Booster) -> tuple[TreeEnsemble, dict[str, npt.NDArray[Any]]]:
    ens = TreeEnsemble.from_lightgbm(booster.model_to_string())
    return ens, {k: v.copy() for k, v in ens.arrays().items()}


def test_validation_catches_malformed_trees() -> None:
    ens, good = _arrays(_booster("regression"))
    cases = []
    a = dict(good)
    a["left"] = good["left"].copy()
    a["left"][a["left"] >= 0] = 0  # a child pointing back at the root: a walk would never end
    cases.append((a, "left"))
    a = dict(good)
    a["feature"] = good["feature"].copy()
    a["feature"][0] = 99
    cases.append((a, "feature"))
    a = dict(good)
    a["right"] = good["right"].copy()
    a["right"][a["right"] < 0] = -1000
    cases.append((a, "right"))
    a = dict(good)
    a["leaf_value"] = good["leaf_value"][:-1]
    cases.append((a, "node_start"))
    a = dict(good)
    a["threshold"] = good["threshold"].astype(np.float32)
    cases.append((a, "threshold"))
    a = dict(good)
    del a["cat_words"]
    cases.append((a, "cat_words"))
    a = dict(good)
    a["cat_nwords"] = good["cat_nwords"] + 1000 * (good["decision"] & 1).astype(np.int32)
    cases.append((a, "cat_offset"))
    for arrays, field in cases:
        with pytest.raises(PredictorFormatError) as info:
            TreeEnsemble.from_arrays("regression", ens.n_features, arrays)
        assert info.value.field == field, info.value
    TreeEnsemble.from_arrays("regression", ens.n_features, good)


def _chain(splits: int) -> dict[str, npt.NDArray[np.generic]]:
    """One tree of ``splits`` splits in a chain: split k sends x <= k left, to leaf k."""
    k = np.arange(splits, dtype=np.int32)
    right = np.where(k < splits - 1, k + 1, ~np.int32(splits)).astype(np.int32)
    return {
        "feature": np.zeros(splits, np.int32),
        "threshold": k.astype(np.float64),
        "decision": np.zeros(splits, np.uint8),
        "left": ~k,
        "right": right,
        "cat_offset": np.zeros(splits, np.int32),
        "cat_nwords": np.zeros(splits, np.int32),
        "cat_words": np.zeros(0, np.uint32),
        "leaf_value": np.arange(splits + 1, dtype=np.float64) * 0.5,
        "node_start": np.array([0, splits], np.int32),
        "leaf_start": np.array([0, splits + 1], np.int32),
        "base": np.zeros(0, np.float64),
    }


def test_trees_up_to_the_split_bound_walk_exactly(backend: _impl.Backend) -> None:
    # The compiled walker keeps a tree's children in 16 bits: the largest tree
    # allowed reaches its deepest leaves, and one split more is refused by name.
    n = MAX_TREE_SPLITS
    ens = TreeEnsemble.from_arrays("regression", 1, _chain(n))
    forest = backend.forest(**ens.evaluator_args())
    # Row x goes right past every split below it: leaf ceil(x), the last past n - 1.
    x = np.array([[-1.0], [0.0], [0.5], [n / 2], [n - 1.0], [n - 0.5], [1e9]])
    out = np.empty(x.shape[0])
    forest.predict_into(x, out)
    leaf = np.minimum(np.ceil(np.maximum(x[:, 0], 0.0)), n)
    assert out.tolist() == (leaf * 0.5).tolist()
    with pytest.raises(PredictorFormatError) as info:
        TreeEnsemble.from_arrays("regression", 1, _chain(n + 1))
    assert info.value.field == "node_start"
    assert f"at most {n} splits" in str(info.value)
    if "cython" in BACKENDS:
        # The compiled walker refuses it too, when handed the arrays unchecked.
        args = {**_chain(n + 1), "n_features": 1}
        with pytest.raises(ValueError, match="0 to 16383 splits"):
            BACKENDS["cython"].forest(**args)


def test_per_model_base_is_added_after_the_trees(backend: _impl.Backend) -> None:
    booster = _booster("regression")
    base = np.array([0.5, -1.25, 3.0])
    ens = TreeEnsemble.from_lightgbm(booster.model_to_string(), base=base, base_feature=5)
    x, _ = _data(60, 4)
    x[:8, 5] = [0, 1, 2, 3, -1, np.nan, 2.0, 1e9]  # out-of-range ids get no base
    x = np.ascontiguousarray(x)
    forest = backend.forest(**ens.evaluator_args())
    out = np.empty(x.shape[0])
    forest.predict_into(x, out)
    ids = np.nan_to_num(x[:, 5], nan=-1.0)
    known = (ids >= 0) & (ids < 3)
    expected = np.asarray(booster.predict(x))
    expected[known] += base[ids[known].astype(int)]
    assert out.tobytes() == expected.tobytes()
    rows = np.repeat(x[:1], 5, axis=0)
    rows[:, 5] = [0, 1, 2, 0, 7]
    shared, plain = np.empty(5), np.empty(5)
    forest.predict_into(rows, shared, 5)
    forest.predict_into(rows, plain)
    assert shared.tobytes() == plain.tobytes()
    with pytest.raises(PredictorFormatError, match="base_feature must be -1 or a column"):
        TreeEnsemble.from_lightgbm(booster.model_to_string(), base=base, base_feature=6)
