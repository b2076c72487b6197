"""Tree ensembles in flat arrays: parsed from LightGBM, validated, evaluated without it.

LightGBM's own ``Booster.predict`` costs tens of microseconds of call overhead
per call, more than the whole pool budget. A trained booster is therefore
flattened into the arrays of :class:`TreeEnsemble` (LightGBM's own node layout:
``left``/``right`` >= 0 name internal nodes, ``~leaf`` a leaf) and walked by the
compiled ``Forest`` (or its numpy twin). Both replicate LightGBM's decision rules
and sum trees in order, so they equal ``Booster.predict`` bit for bit.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors.errors import PredictorFormatError

__all__ = [
    "ARRAY_FIELDS",
    "MAX_FEATURES",
    "MAX_TREE_SPLITS",
    "SUPPORTED_OBJECTIVES",
    "TreeEnsemble",
]

SUPPORTED_OBJECTIVES: Final = ("regression", "huber", "quantile")
"""Objectives whose prediction is the raw score (no output transform)."""
MAX_TREE_SPLITS: Final = 16_383
"""Splits per tree: the compiled walker numbers a tree's splits and leaves in
16 bits, which halves its nodes (LightGBM's default tree has 30 splits)."""
MAX_FEATURES: Final = 32_767
"""Feature columns an ensemble may read (16 bits in the compiled walker)."""

ARRAY_FIELDS: Final = (
    "feature",
    "threshold",
    "decision",
    "left",
    "right",
    "cat_offset",
    "cat_nwords",
    "cat_words",
    "leaf_value",
    "node_start",
    "leaf_start",
    "base",
)
"""The arrays a tree ensemble is made of (and stored as, one file each)."""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split()] if text.strip() else []


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split()] if text.strip() else []


@attrs.frozen(eq=False, repr=False)
class TreeEnsemble:
    """A regression tree ensemble in LightGBM's node layout, every tree's nodes concatenated.

    Attributes:
        objective: The LightGBM objective it was trained with (one of
            :data:`SUPPORTED_OBJECTIVES`).
        n_features: Number of input features (columns a row must have).
        feature: ``int32[N]`` split feature of each internal node.
        threshold: ``float64[N]`` split threshold (numerical splits).
        decision: ``uint8[N]`` LightGBM decision type: bit 0 categorical, bit 1
            default-left, bits 2-3 missing type (0 none, 1 zero, 2 NaN).
        left: ``int32[N]`` left child, tree-local: ``>= 0`` an internal node, ``< 0``
            leaf ``~left``.
        right: ``int32[N]`` right child, likewise.
        cat_offset: ``int32[N]`` categorical splits: first word of the category
            bitset in ``cat_words``.
        cat_nwords: ``int32[N]`` categorical splits: length of the bitset in words (0 otherwise).
        cat_words: ``uint32[C]`` category bitsets (category ``c`` goes left when bit ``c`` is set).
        leaf_value: ``float64[L]`` leaf outputs.
        node_start: ``int32[T + 1]`` first internal node of each tree (tree ``t`` owns
            ``node_start[t]:node_start[t + 1]``; a single-leaf tree owns none).
        leaf_start: ``int32[T + 1]`` first leaf of each tree.
        base: ``float64[K]`` per-category offset added after the trees: a row whose
            column ``base_feature`` holds ``k`` in ``[0, K)`` scores ``trees + base[k]``
            (the per-model init score the trees were boosted from); empty for none.
        base_feature: The column ``base`` is indexed by, ``-1`` for none.
    """

    objective: str
    n_features: int
    feature: npt.NDArray[np.int32]
    threshold: npt.NDArray[np.float64]
    decision: npt.NDArray[np.uint8]
    left: npt.NDArray[np.int32]
    right: npt.NDArray[np.int32]
    cat_offset: npt.NDArray[np.int32]
    cat_nwords: npt.NDArray[np.int32]
    cat_words: npt.NDArray[np.uint32]
    leaf_value: npt.NDArray[np.float64]
    node_start: npt.NDArray[np.int32]
    leaf_start: npt.NDArray[np.int32]
    base: npt.NDArray[np.float64] = attrs.field(factory=lambda: np.zeros(0, dtype=np.float64))
    base_feature: int = -1

    @property
    def n_trees(self) -> int:
        """Number of trees."""
        return int(self.node_start.shape[0]) - 1

    def __repr__(self) -> str:
        return (
            f"TreeEnsemble(objective={self.objective!r}, n_trees={self.n_trees}, "
            f"n_leaves={self.leaf_value.shape[0]}, n_features={self.n_features}, "
            f"base_feature={self.base_feature})"
        )

    def arrays(self) -> dict[str, npt.NDArray[np.generic]]:
        """Return the arrays by field name (the serialised form, with :attr:`objective`,
        :attr:`n_features` and :attr:`base_feature` kept by the caller)."""
        return {name: getattr(self, name) for name in ARRAY_FIELDS}

    def evaluator_args(self) -> dict[str, Any]:
        """Return the keyword arguments of either implementation's ``Forest``."""
        return {**self.arrays(), "n_features": self.n_features, "base_feature": self.base_feature}

    @classmethod
    def from_arrays(
        cls,
        objective: str,
        n_features: int,
        arrays: dict[str, npt.NDArray[np.generic]],
        base_feature: int = -1,
    ) -> TreeEnsemble:
        """Rebuild and validate an ensemble from :meth:`arrays`.

        Raises:
            PredictorFormatError: An array is missing, of the wrong type or shape,
                or the trees are not well-formed.
        """
        dtypes = {
            "feature": np.int32,
            "threshold": np.float64,
            "decision": np.uint8,
            "left": np.int32,
            "right": np.int32,
            "cat_offset": np.int32,
            "cat_nwords": np.int32,
            "cat_words": np.uint32,
            "leaf_value": np.float64,
            "node_start": np.int32,
            "leaf_start": np.int32,
            "base": np.float64,
        }
        values: dict[str, npt.NDArray[np.generic]] = {}
        for name, dtype in dtypes.items():
            arr = arrays.get(name)
            if arr is None:
                raise PredictorFormatError(name, "is missing")
            if arr.dtype != dtype or arr.ndim != 1:
                raise PredictorFormatError(
                    name, f"must be a 1-d {np.dtype(dtype).name} array", f"{arr.dtype}{arr.shape}"
                )
            values[name] = np.ascontiguousarray(arr)
        ens = cls(
            objective=objective,
            n_features=n_features,
            base_feature=base_feature,
            **values,  # type: ignore[arg-type]
        )
        ens.validate()
        return ens

    def validate(self) -> None:
        """Check that every walk ends inside the arrays (the compiled walker trusts this).

        Raises:
            PredictorFormatError: Naming the first inconsistency found.
        """
        if self.objective not in SUPPORTED_OBJECTIVES:
            raise PredictorFormatError(
                "objective", f"must be one of {SUPPORTED_OBJECTIVES}", self.objective
            )
        if not 1 <= self.n_features <= MAX_FEATURES:
            raise PredictorFormatError(
                "n_features", f"must be in [1, {MAX_FEATURES}]", self.n_features
            )
        n = self.feature.shape[0]
        for name in ("threshold", "decision", "left", "right", "cat_offset", "cat_nwords"):
            if getattr(self, name).shape[0] != n:
                raise PredictorFormatError(
                    name, f"must have {n} entries", getattr(self, name).shape
                )
        ns, ls = self.node_start, self.leaf_start
        if ns.shape[0] < 1 or ls.shape != ns.shape or ns[0] != 0 or ls[0] != 0:
            raise PredictorFormatError("node_start", "must start at 0 and match leaf_start")
        if ns[-1] != n or ls[-1] != self.leaf_value.shape[0]:
            raise PredictorFormatError("node_start", "must end at the node and leaf counts")
        n_nodes = np.diff(ns)
        n_leaves = np.diff(ls)
        if (n_nodes < 0).any() or (n_leaves != n_nodes + 1).any():
            raise PredictorFormatError(
                "leaf_start", "each tree must have one more leaf than splits"
            )
        if n and int(n_nodes.max()) > MAX_TREE_SPLITS:
            raise PredictorFormatError(
                "node_start", f"a tree has at most {MAX_TREE_SPLITS} splits", int(n_nodes.max())
            )
        if n and ((self.feature < 0) | (self.feature >= self.n_features)).any():
            raise PredictorFormatError("feature", f"must be in [0, {self.n_features})")
        if not np.isfinite(self.leaf_value).all():
            raise PredictorFormatError("leaf_value", "must be finite")
        if not np.isfinite(self.base).all():
            raise PredictorFormatError("base", "must be finite")
        if isinstance(self.base_feature, bool) or not -1 <= self.base_feature < self.n_features:
            raise PredictorFormatError(
                "base_feature",
                f"must be -1 or a column in [0, {self.n_features})",
                self.base_feature,
            )
        tree_of = np.repeat(np.arange(self.n_trees), n_nodes)
        local = np.arange(n) - ns[tree_of]
        for name in ("left", "right"):
            child = getattr(self, name)
            internal = child >= 0
            # Children come after their parent (LightGBM numbers nodes in split
            # order), so a walk strictly advances and ends.
            if (internal & ((child <= local) | (child >= n_nodes[tree_of]))).any():
                raise PredictorFormatError(
                    name, "an internal child must follow its parent in its tree"
                )
            if (~internal & (~child >= n_leaves[tree_of])).any():
                raise PredictorFormatError(name, "a leaf child is out of range")
        cat = (self.decision & 1).astype(bool)
        words = self.cat_words.shape[0]
        if (self.cat_nwords < 0).any() or (
            cat & ((self.cat_offset < 0) | (self.cat_offset + self.cat_nwords > words))
        ).any():
            raise PredictorFormatError("cat_offset", "a category bitset is out of range")
        if ((self.decision >> 2) > 2).any():
            raise PredictorFormatError("decision", "has an unknown missing-value type")

    @classmethod
    def from_lightgbm(
        cls,
        model: str,
        *,
        base: npt.NDArray[np.float64] | None = None,
        base_feature: int = -1,
    ) -> TreeEnsemble:
        """Flatten a LightGBM text model (``Booster.model_to_string()``).

        Args:
            model: The model text.
            base: Per-category init scores the booster was trained from (LightGBM
                does not keep them in the model), indexed by column ``base_feature``.
            base_feature: The column ``base`` is indexed by.

        Raises:
            PredictorFormatError: The model is not a single-output regression
                ensemble of constant-leaf trees with a supported objective.
        """
        header, _, body = model.partition("\nTree=")
        head = dict(line.split("=", 1) for line in header.splitlines() if "=" in line)
        objective = head.get("objective", "").split(" ")[0]
        if objective not in SUPPORTED_OBJECTIVES:
            raise PredictorFormatError(
                "objective", f"must be one of {SUPPORTED_OBJECTIVES}", objective
            )
        if head.get("num_class", "1") != "1" or head.get("num_tree_per_iteration", "1") != "1":
            raise PredictorFormatError("num_class", "must be 1 (a single regression output)")
        if "average_output" in header:
            raise PredictorFormatError("average_output", "random-forest mode is not supported")
        n_features = int(head["max_feature_idx"]) + 1
        ints: dict[str, list[int]] = {
            k: [] for k in ("feature", "decision", "left", "right", "cat_offset", "cat_nwords")
        }
        floats: dict[str, list[float]] = {"threshold": [], "leaf_value": []}
        node_start, leaf_start = [0], [0]
        words: list[int] = []
        blocks = ("Tree=" + body).split("\nTree=") if body else []
        for block in blocks:
            block = block.split("end of trees", 1)[0]
            kv = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            if kv.get("is_linear", "0") != "0":
                raise PredictorFormatError("is_linear", "linear trees are not supported")
            num_leaves = int(kv["num_leaves"])
            leaves = _floats(kv["leaf_value"])
            feats = _ints(kv.get("split_feature", ""))
            thr = _floats(kv.get("threshold", ""))
            dec = _ints(kv.get("decision_type", ""))
            lc = _ints(kv.get("left_child", ""))
            rc = _ints(kv.get("right_child", ""))
            if len(leaves) != num_leaves or len(feats) != num_leaves - 1:
                raise PredictorFormatError("tree", "leaf and split counts disagree", num_leaves)
            cat_bounds = _ints(kv.get("cat_boundaries", ""))
            cat_thr = _ints(kv.get("cat_threshold", ""))
            cat_off: list[int] = []
            cat_n: list[int] = []
            for i, d in enumerate(dec):
                if d & 1:
                    idx = int(thr[i])
                    lo, hi = cat_bounds[idx], cat_bounds[idx + 1]
                    cat_off.append(len(words))
                    cat_n.append(hi - lo)
                    words.extend(cat_thr[lo:hi])
                else:
                    cat_off.append(0)
                    cat_n.append(0)
            ints["feature"] += feats
            ints["decision"] += dec
            ints["left"] += lc
            ints["right"] += rc
            ints["cat_offset"] += cat_off
            ints["cat_nwords"] += cat_n
            floats["threshold"] += thr
            floats["leaf_value"] += leaves
            node_start.append(node_start[-1] + len(feats))
            leaf_start.append(leaf_start[-1] + len(leaves))
        arrays: dict[str, npt.NDArray[np.generic]] = {
            "feature": np.asarray(ints["feature"], dtype=np.int32),
            "threshold": np.asarray(floats["threshold"], dtype=np.float64),
            "decision": np.asarray(ints["decision"], dtype=np.uint8),
            "left": np.asarray(ints["left"], dtype=np.int32),
            "right": np.asarray(ints["right"], dtype=np.int32),
            "cat_offset": np.asarray(ints["cat_offset"], dtype=np.int32),
            "cat_nwords": np.asarray(ints["cat_nwords"], dtype=np.int32),
            "cat_words": np.asarray(words, dtype=np.uint32),
            "leaf_value": np.asarray(floats["leaf_value"], dtype=np.float64),
            "node_start": np.asarray(node_start, dtype=np.int32),
            "leaf_start": np.asarray(leaf_start, dtype=np.int32),
            "base": np.zeros(0) if base is None else np.asarray(base, dtype=np.float64),
        }
        return cls.from_arrays(objective, n_features, arrays, base_feature)
