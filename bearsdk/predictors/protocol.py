"""What the router needs of a predictor, and a table-driven one.

:class:`~bearsdk.predictors.Predictor` is the real thing (features and trained
heads). Anything with the same three members routes just as well:
:class:`StagedPredictor` hands out predictions computed beforehand, which is
what a simulator, a benchmark or a replay of logged predictions wants.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from bearsdk.predictors.predictor import PoolPrediction

__all__ = ["PoolPredictor", "StagedPredictor"]


@runtime_checkable
class PoolPredictor(Protocol):
    """Predicts accuracy, output length and cost of a prompt for every model of a pool."""

    @property
    def models(self) -> tuple[str, ...]:
        """Model names, in the order of every prediction's arrays."""
        ...

    def predict(self, prompt: str, *, quantiles: bool = ...) -> PoolPrediction:
        """The predictions for ``prompt``, one entry per model."""
        ...

    def observe_usage(self, model: str, prompt: str, prompt_tokens: int) -> None:
        """Learn from an engine's count of ``prompt``'s tokens (may do nothing)."""
        ...


class StagedPredictor:
    """Answers every ``predict`` with the prediction staged last.

    Stage the request's prediction, then route it::

        feed = StagedPredictor(models)
        core = RouterCore(pool, BEAR(), predictor=feed)
        feed.stage(predictions[i])
        decision = core.decide(text)

    Usage reports teach it nothing: staged predictions are final.

    Args:
        models: The pool's model names, in the predictions' order.
    """

    def __init__(self, models: tuple[str, ...]) -> None:
        self._models = tuple(models)
        self._next: PoolPrediction | None = None

    @property
    def models(self) -> tuple[str, ...]:
        """Model names, in the order of every prediction's arrays."""
        return self._models

    def stage(self, prediction: PoolPrediction) -> None:
        """Make ``prediction`` the answer to the next ``predict`` calls."""
        self._next = prediction

    def predict(self, prompt: str, *, quantiles: bool = False) -> PoolPrediction:
        """The staged prediction (whatever ``prompt`` says).

        Raises:
            RuntimeError: Nothing was staged.
        """
        if self._next is None:
            raise RuntimeError("StagedPredictor: no prediction staged")
        return self._next

    def observe_usage(self, model: str, prompt: str, prompt_tokens: int) -> None:
        """Does nothing: staged predictions are final."""
        return None
