"""Prompt features (appendix A.4): hashed tokens projected by PCA, plus prompt statistics.

A :class:`FeaturePipeline` turns a prompt into the model-independent part of the
predictors' input. Everything is computed from the prompt text alone, in one pass
(compiled by default, see :mod:`bearsdk.predictors._impl`):

* signed feature hashing of the prompt's tokens into ``hash_dim`` (512) buckets,
  normalised by the token count, projected onto ``n_components`` (16) PCA
  components fitted on training prompts;
* token, character, sentence and line counts, average characters per token,
  punctuation and number fractions, question marks;
* length-constraint indicators (``"in 3 sentences"``, ``"under 100 words"``,
  ``"5 tips"``) with the constraint's number, brevity and detail cues;
* task-type indicators (list, summarize, explain, code, creative writing, ...).

Tokens here come from a fixed built-in pre-tokenizer, not from any model's
tokenizer, so the features are the same for every model of a pool; per-model
token counts (for cost) come from :mod:`bearsdk.predictors.tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors import _impl
from bearsdk.predictors import _lexicon as lx
from bearsdk.predictors.errors import PredictorError, PredictorFormatError

__all__ = ["DEFAULT_HASH_DIM", "DEFAULT_N_COMPONENTS", "FEATURE_VERSION", "FeaturePipeline"]

DEFAULT_HASH_DIM: Final = 512
DEFAULT_N_COMPONENTS: Final = 16
FEATURE_VERSION: Final = lx.FEATURE_VERSION


def _check_prompt(prompt: object, field: str = "prompt") -> str:
    if not isinstance(prompt, str):
        raise PredictorError(field, "must be a str", type(prompt).__name__)
    return prompt


@attrs.frozen(eq=False, repr=False)
class FeaturePipeline:
    """The fitted prompt-feature transform (hashing, PCA, statistics).

    Build one with :meth:`fit`; it travels inside every saved predictor.

    Attributes:
        components: ``int32[hash_dim, n_components]``: the PCA components scaled
            by ``2**24`` and rounded (an exact integer projection keeps the compiled
            and the pure-Python features bit-identical).
        offset: ``float64[n_components]``: the training mean projected onto the
            components (subtracted, so components are centred).
        version: Feature-definition version (:data:`FEATURE_VERSION`).
    """

    components: npt.NDArray[np.int32] = attrs.field()
    offset: npt.NDArray[np.float64] = attrs.field()
    version: int = FEATURE_VERSION
    _extractor: _impl.FeatureExtractor = attrs.field(init=False, repr=False)

    @components.validator
    def _check_components(self, _: object, value: npt.NDArray[np.int32]) -> None:
        if value.dtype != np.int32 or value.ndim != 2:
            raise PredictorFormatError("components", "must be a 2-d int32 array", str(value.dtype))
        dim = value.shape[0]
        if dim < 2 or dim & (dim - 1) or value.shape[1] < 1:
            raise PredictorFormatError(
                "components", "must have a power-of-two number of rows", value.shape
            )

    @offset.validator
    def _check_offset(self, _: object, value: npt.NDArray[np.float64]) -> None:
        if value.dtype != np.float64 or value.shape != (self.components.shape[1],):
            raise PredictorFormatError(
                "offset", f"must be float64[{self.components.shape[1]}]", value.shape
            )
        if not np.isfinite(value).all():
            raise PredictorFormatError("offset", "must be finite")

    def __attrs_post_init__(self) -> None:
        if self.version != FEATURE_VERSION:
            raise PredictorFormatError(
                "feature_version",
                f"is not the one this bearsdk computes ({FEATURE_VERSION}); "
                "retrain the predictor with `bearsdk train`",
                self.version,
            )
        object.__setattr__(self, "_extractor", _impl.FeatureExtractor(self.components, self.offset))

    def __repr__(self) -> str:
        return (
            f"FeaturePipeline(hash_dim={self.hash_dim}, n_components={self.n_components}, "
            f"version={self.version}, implementation={_impl.IMPLEMENTATION!r})"
        )

    @property
    def extractor(self) -> _impl.FeatureExtractor:
        """The extractor of the selected implementation (for the fused prediction call)."""
        return self._extractor

    @property
    def hash_dim(self) -> int:
        """Number of hashing buckets."""
        return int(self.components.shape[0])

    @property
    def n_components(self) -> int:
        """Number of PCA components."""
        return int(self.components.shape[1])

    @property
    def n_features(self) -> int:
        """Length of the prompt feature vector."""
        return self.n_components + len(lx.SCALAR_FEATURES) + len(lx.TASK_FEATURES)

    @property
    def names(self) -> tuple[str, ...]:
        """Feature names, in vector order."""
        return lx.prompt_feature_names(self.n_components)

    @classmethod
    def fit(
        cls,
        prompts: Sequence[str],
        *,
        hash_dim: int = DEFAULT_HASH_DIM,
        n_components: int = DEFAULT_N_COMPONENTS,
    ) -> FeaturePipeline:
        """Fit the PCA projection on training prompts.

        Args:
            prompts: Training prompts (at least two).
            hash_dim: Hashing buckets, a power of two.
            n_components: PCA components kept (at most ``hash_dim``).

        Raises:
            PredictorError: Too few prompts or bad dimensions.
        """
        if hash_dim < 2 or hash_dim & (hash_dim - 1):
            raise PredictorError("hash_dim", "must be a power of two >= 2", hash_dim)
        if not 1 <= n_components <= hash_dim:
            raise PredictorError("n_components", f"must be in [1, {hash_dim}]", n_components)
        if len(prompts) < 2:
            raise PredictorError("prompts", "need at least two to fit the PCA", len(prompts))
        hashed = np.zeros((len(prompts), hash_dim), dtype=np.float64)
        for i, p in enumerate(prompts):
            counts, n = _impl.hash_counts(_check_prompt(p, f"prompts[{i}]"), hash_dim)
            if n:
                hashed[i] = counts / n
        mean = hashed.mean(axis=0)
        _, _, vt = np.linalg.svd(hashed - mean, full_matrices=False)
        comps = np.zeros((hash_dim, n_components), dtype=np.float64)
        k = min(n_components, vt.shape[0])
        comps[:, :k] = vt[:k].T
        # SVD signs are arbitrary; fix them so a refit reproduces the file.
        pivot = np.argmax(np.abs(comps), axis=0)
        signs = np.where(comps[pivot, np.arange(n_components)] < 0, -1.0, 1.0)
        scaled = np.rint(comps * signs * float(1 << lx.PCA_SCALE_BITS)).astype(np.int32)
        offset = (mean @ scaled.astype(np.float64)) / float(1 << lx.PCA_SCALE_BITS)
        return cls(scaled, offset)

    def transform(self, prompt: str) -> npt.NDArray[np.float64]:
        """Return the feature vector of one prompt (``float64[n_features]``)."""
        out = np.empty(self.n_features, dtype=np.float64)
        self._extractor.transform_into(_check_prompt(prompt), out)
        return out

    def transform_into(self, prompt: str, out: npt.NDArray[np.float64]) -> None:
        """Write the features of ``prompt`` into ``out[:n_features]`` (unchecked: hot path)."""
        self._extractor.transform_into(prompt, out)

    def transform_many(self, prompts: Sequence[str]) -> npt.NDArray[np.float64]:
        """Return the feature vectors of many prompts (``float64[len(prompts), n_features]``)."""
        out = np.empty((len(prompts), self.n_features), dtype=np.float64)
        for i, p in enumerate(prompts):
            self._extractor.transform_into(_check_prompt(p, f"prompts[{i}]"), out[i])
        return out
