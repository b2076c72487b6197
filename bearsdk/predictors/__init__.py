"""Accuracy, output-length and cost predictors (paper section 3, eq. 4; appendix A.4).

For every prompt and every model of a pool, predict the judged accuracy, the
output length and hence the cost, from features of the prompt alone::

    from bearsdk.predictors import Predictor

    pred = Predictor.load_default()          # shipped placeholder: Qwen3 pool, synthetic data
    p = pred.predict("Summarize this report in 3 sentences: ...")
    best = p.best(lam=100.0, feasible=ttft_ok)  # argmax accuracy - lam * cost_usd

Train real predictors on your own evaluations with ``bearsdk train`` (or
:func:`train_predictor`), save and load them with :meth:`Predictor.save` /
:meth:`Predictor.load`, and score them on held-out prompts with
:func:`~bearsdk.predictors.evaluate.cross_validate` (``bearsdk bench predictors``).

:data:`IMPLEMENTATION` says whether the compiled hot paths (``"cython"``) or the
pure-Python twins (``"python"``, with ``BEARSDK_NO_EXTENSIONS=1``) are in use.
"""

from bearsdk.predictors._impl import IMPLEMENTATION
from bearsdk.predictors.dataset import TrainingSet, read_alpaca_eval, read_jsonl
from bearsdk.predictors.errors import PredictorError, PredictorFormatError
from bearsdk.predictors.features import FEATURE_VERSION, FeaturePipeline
from bearsdk.predictors.pool import (
    FUSECHAT3_POOL,
    FUSECHAT_LLAMA_POOL,
    POOLS,
    QWEN3_POOL,
    ModelSpec,
    load_pool,
)
from bearsdk.predictors.predictor import PoolPrediction, Predictor
from bearsdk.predictors.relative import RelativeAccuracy
from bearsdk.predictors.serialize import FORMAT_VERSION
from bearsdk.predictors.tokens import PromptTokenCounter, TokenizerLike, load_tokenizer
from bearsdk.predictors.training import TrainConfig, train_predictor

__all__ = [
    "FEATURE_VERSION",
    "FORMAT_VERSION",
    "FUSECHAT3_POOL",
    "FUSECHAT_LLAMA_POOL",
    "IMPLEMENTATION",
    "POOLS",
    "QWEN3_POOL",
    "FeaturePipeline",
    "ModelSpec",
    "PoolPrediction",
    "Predictor",
    "PredictorError",
    "PredictorFormatError",
    "PromptTokenCounter",
    "RelativeAccuracy",
    "TokenizerLike",
    "TrainConfig",
    "TrainingSet",
    "load_pool",
    "load_tokenizer",
    "read_alpaca_eval",
    "read_jsonl",
    "train_predictor",
]
