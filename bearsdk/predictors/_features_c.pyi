# Type stub of the compiled module built from cext/_features_c.pyx; the
# contract is that of bearsdk/predictors/_features_py.py and _forest_py.py.
from typing import Final

import numpy as np
import numpy.typing as npt

IMPLEMENTATION: Final[str]

def token_hash(token: str) -> int: ...
def hash_counts(text: str, dim: int) -> tuple[npt.NDArray[np.int64], int]: ...

class FeatureExtractor:
    implementation: Final[str]
    dim: int
    n_components: int
    n_features: int
    def __init__(
        self, components: npt.NDArray[np.int32], offset: npt.NDArray[np.float64]
    ) -> None: ...
    def transform_into(self, text: str, out: npt.NDArray[np.float64]) -> None: ...

class Forest:
    implementation: Final[str]
    n_trees: int
    n_features: int
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
    ) -> None: ...
    def predict_into(
        self, x: npt.NDArray[np.float64], out: npt.NDArray[np.float64], shared: int = 0
    ) -> None: ...

def predict_pool(
    fx: FeatureExtractor,
    text: str,
    x: npt.NDArray[np.float64],
    forests: tuple[Forest, ...],
    lo: npt.NDArray[np.float64],
    hi: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
) -> None: ...
def add_linear(
    x: npt.NDArray[np.float64],
    p: int,
    model_col: int,
    weights: npt.NDArray[np.float64],
    intercept: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
    lo: float,
    hi: float,
) -> None: ...
