"""Tree-ensemble evaluation in numpy: the reference twin of the compiled ``Forest``.

All rows and all trees advance one level per step (vectorised), so the cost is
a few dozen numpy calls per ensemble rather than one Python step per node. The
decision rules are LightGBM's (``Tree::NumericalDecision`` and
``CategoricalDecision``) and the leaf values are summed in tree order with a
sequential ``cumsum``, so results equal the compiled walker and
``Booster.predict`` bit for bit.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ["IMPLEMENTATION", "ZERO_THRESHOLD", "Forest"]

IMPLEMENTATION: Final = "python"

ZERO_THRESHOLD: Final = float(np.float32(1e-35))
"""LightGBM's ``kZeroThreshold``: a float literal, widened to double."""


class Forest:
    """A validated :class:`~bearsdk.predictors._forest.TreeEnsemble`, ready to evaluate."""

    implementation: Final = IMPLEMENTATION

    def __init__(
        self,
        feature: npt.NDArray[np.int32],
        threshold: npt.NDArray[np.float64],
        decision: npt.NDArray[np.uint8],
        left: npt.NDArray[np.int32],
        right: npt.NDArray[np.int32],
        cat_offset: npt.NDArray[np.int32],
        cat_nwords: npt.NDArray[np.int32],
        cat_words: npt.NDArray[np.uint32],
        leaf_value: npt.NDArray[np.float64],
        node_start: npt.NDArray[np.int32],
        leaf_start: npt.NDArray[np.int32],
        base: npt.NDArray[np.float64],
        n_features: int,
        base_feature: int = -1,
    ) -> None:
        n_trees = int(node_start.shape[0]) - 1
        n_nodes = np.diff(node_start)
        n_leaves = np.diff(leaf_start)
        width = max(int(n_nodes.max(initial=0)), 1)
        tree = np.repeat(np.arange(n_trees), n_nodes)
        col = np.arange(feature.shape[0]) - node_start[tree]

        def pad(values: npt.NDArray[Any], fill: int | float = 0) -> npt.NDArray[Any]:
            out = np.full((n_trees, width), fill, dtype=values.dtype)
            out[tree, col] = values
            return out

        self._feature = pad(feature)
        self._threshold = pad(threshold)
        self._decision = pad(decision)
        self._left = pad(left, -1)
        self._right = pad(right, -1)
        self._cat_offset = pad(cat_offset)
        self._cat_nwords = pad(cat_nwords)
        self._cat_words = cat_words if cat_words.shape[0] else np.zeros(1, dtype=np.uint32)
        lwidth = max(int(n_leaves.max(initial=0)), 1)
        ltree = np.repeat(np.arange(n_trees), n_leaves)
        lcol = np.arange(leaf_value.shape[0]) - leaf_start[ltree]
        self._leaves = np.zeros((n_trees, lwidth), dtype=np.float64)
        self._leaves[ltree, lcol] = leaf_value
        self._root = np.where(n_nodes > 0, 0, -1).astype(np.int64)
        self.n_trees = n_trees
        self.n_features = n_features
        self._base = np.asarray(base, dtype=np.float64)
        self._base_feature = base_feature

    def predict_into(
        self, x: npt.NDArray[np.float64], out: npt.NDArray[np.float64], shared: int = 0
    ) -> None:
        """Write the ensemble's raw score of each row of ``x`` into ``out``.

        ``shared`` (rows agree on columns ``[0, shared)``) lets the compiled
        walker share work between rows; here every row is walked anyway.
        """
        if not 0 <= shared <= x.shape[1]:
            raise ValueError(f"shared must be in [0, {x.shape[1]}], got {shared}")
        if x.ndim != 2 or x.shape[1] < self.n_features:
            raise ValueError(
                f"rows have {x.shape[1:]} features, the ensemble reads {self.n_features}"
            )
        if out.shape[0] != x.shape[0]:
            raise ValueError(f"out has {out.shape[0]} slots for {x.shape[0]} rows")
        n_rows = x.shape[0]
        if n_rows == 0:
            return
        if self.n_trees == 0:
            out[:] = 0.0
            self._add_base(x, out)
            return
        node = np.broadcast_to(self._root, (n_rows, self.n_trees)).copy()
        while True:
            r, t = np.nonzero(node >= 0)
            if r.size == 0:
                break
            n = node[r, t]
            node[r, t] = np.where(
                self._go_left(x[r, self._feature[t, n]], t, n), self._left[t, n], self._right[t, n]
            )
        leaves = self._leaves[np.arange(self.n_trees), ~node]
        out[:] = np.cumsum(leaves, axis=1)[:, -1]
        self._add_base(x, out)

    def _add_base(self, x: npt.NDArray[np.float64], out: npt.NDArray[np.float64]) -> None:
        # After the trees, as `booster.predict(x) + init_score` would add it.
        if self._base_feature < 0:
            return
        v = x[:, self._base_feature]
        with np.errstate(invalid="ignore"):
            ok = (v >= 0) & (v < self._base.shape[0])
        out[ok] += self._base[v[ok].astype(np.int64)]

    def _go_left(
        self, fval: npt.NDArray[np.float64], t: npt.NDArray[np.intp], n: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.bool_]:
        dec = self._decision[t, n]
        missing = (dec >> 2) & 3
        nan = np.isnan(fval)
        f0 = np.where(nan & (missing != 2), 0.0, fval)
        default = ((missing == 1) & (np.abs(f0) <= ZERO_THRESHOLD)) | (
            (missing == 2) & np.isnan(f0)
        )
        with np.errstate(invalid="ignore"):
            numeric = np.where(default, (dec & 2) > 0, f0 <= self._threshold[t, n])
            usable = ~nan & (fval > -1.0) & (fval < 2147483648.0)
        iv = np.where(usable, fval, 0.0).astype(np.int64)
        word = iv >> 5
        inside = usable & (word < self._cat_nwords[t, n])
        bits = self._cat_words[np.where(inside, self._cat_offset[t, n] + word, 0)]
        categorical = inside & (((bits >> (iv & 31).astype(np.uint32)) & 1) == 1)
        result: npt.NDArray[np.bool_] = np.where((dec & 1) > 0, categorical, numeric)
        return result
