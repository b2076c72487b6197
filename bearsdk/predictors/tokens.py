"""Prompt token counts per model: a local tokenizer where given, else a learned estimate.

Cost (appendix A.4) multiplies *each model's* prompt token count by its input
price, and BEA replays a request with its prompt tokens, so a count is needed per
model and per request, fast. :class:`PromptTokenCounter` gives it:

* with a user-supplied tokenizer for a model (any object with
  ``encode(text).ids``, e.g. ``tokenizers.Tokenizer.from_file("tokenizer.json")``
  from the optional ``tokenizers`` package, see :func:`load_tokenizer`), the
  tokenizer's count plus the chat-template overhead, learned from usage reports
  as their mean excess over the tokenizer's count;
* otherwise ``overhead + chars / chars_per_token``, both learned per model online
  from the ``usage.prompt_tokens`` that responses report (:meth:`observe`): a
  decayed least-squares fit, regularised towards the model's prior ratio, so a
  few reports already help and drift is followed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors.errors import PredictorError

__all__ = ["PromptTokenCounter", "TokenizerLike", "load_tokenizer"]

_KCHARS = 1000.0  # the fit works in thousands of characters to stay well-conditioned


@runtime_checkable
class TokenizerLike(Protocol):
    """What :class:`PromptTokenCounter` needs of a tokenizer: ``encode(text).ids``."""

    def encode(self, sequence: str, /, *args: Any, **kwargs: Any) -> Any:
        """Tokenise ``sequence``; the result has an ``ids`` sequence."""
        ...


def load_tokenizer(path: str | Path) -> TokenizerLike:
    """Load a Hugging Face ``tokenizer.json`` with the optional ``tokenizers`` package.

    Raises:
        PredictorError: ``tokenizers`` is not installed, or the file cannot be loaded.
    """
    try:
        from tokenizers import Tokenizer  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise PredictorError(
            "tokenizer",
            "needs the optional 'tokenizers' package: pip install 'bearsdk[tokenizers]'",
            str(path),
        ) from exc
    try:
        tok: TokenizerLike = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise PredictorError("tokenizer", f"cannot be loaded: {exc}", str(path)) from exc
    return tok


@attrs.define
class _Fit:
    # Decayed sums of weights, x (kchars or tokenizer tokens), y, x*x, x*y.
    s0: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    n: int = 0


@attrs.define
class PromptTokenCounter:
    """Per-model prompt token counts for one pool (see the module docstring).

    Args:
        models: The pool's model names, in pool order.
        chars_per_token: Prior characters per token of each model.
        tokenizers: Local tokenizers by model name (optional).
        decay: Weight kept by past usage reports at each new one (memory of
            about ``1 / (1 - decay)`` reports).
        prior_weight: Weight of the prior, in reports.
    """

    models: tuple[str, ...]
    chars_per_token: tuple[float, ...]
    tokenizers: dict[str, TokenizerLike] = attrs.field(factory=dict)
    decay: float = 0.995
    prior_weight: float = 1.0
    _index: dict[str, int] = attrs.field(init=False)
    _fits: list[_Fit] = attrs.field(init=False)
    _overhead: npt.NDArray[np.float64] = attrs.field(init=False)
    _slope: npt.NDArray[np.float64] = attrs.field(init=False)
    _tok_models: tuple[int, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if len(self.chars_per_token) != len(self.models):
            raise PredictorError(
                "chars_per_token",
                f"needs one ratio per model ({len(self.models)})",
                len(self.chars_per_token),
            )
        if not 0.0 < self.decay <= 1.0:
            raise PredictorError("decay", "must be in (0, 1]", self.decay)
        if not self.prior_weight > 0.0:
            raise PredictorError("prior_weight", "must be > 0", self.prior_weight)
        self._index = {m: i for i, m in enumerate(self.models)}
        for name in self.tokenizers:
            self._model(name, "tokenizers")
        self._fits = [_Fit() for _ in self.models]
        self._overhead = np.zeros(len(self.models))
        self._slope = np.array([_KCHARS / r for r in self.chars_per_token])
        self._tok_models = tuple(self._index[m] for m in self.tokenizers)
        for i in self._tok_models:
            self._slope[i] = 1.0

    def _model(self, model: str, field: str = "model") -> int:
        try:
            return self._index[model]
        except KeyError:
            raise PredictorError(field, f"is not in the pool {list(self.models)}", model) from None

    def set_tokenizer(self, model: str, tokenizer: TokenizerLike | None) -> None:
        """Count ``model``'s prompts with ``tokenizer`` from now on (``None``: estimate again).

        The learned fit restarts: its ``x`` changes from characters to tokens.
        """
        i = self._model(model)
        if tokenizer is None:
            self.tokenizers.pop(model, None)
        else:
            if not isinstance(tokenizer, TokenizerLike):
                raise PredictorError(
                    "tokenizer", "must have an encode() method", type(tokenizer).__name__
                )
            self.tokenizers[model] = tokenizer
        self._fits[i] = _Fit()
        self._overhead[i] = 0.0
        self._slope[i] = 1.0 if tokenizer is not None else _KCHARS / self.chars_per_token[i]
        self._tok_models = tuple(self._index[m] for m in self.tokenizers)

    def counts(self, prompt: str) -> npt.NDArray[np.float64]:
        """Return the prompt token count of ``prompt`` for every model, in pool order."""
        x = len(prompt) / _KCHARS
        if not self._tok_models:
            # (Scalar arithmetic on a pool's few models beats numpy's per-call cost;
            # round() rounds half to even, as np.rint does.)
            return np.array(
                [
                    max(float(round(o + s * x)), 0.0)
                    for o, s in zip(self._overhead.tolist(), self._slope.tolist(), strict=True)
                ]
            )
        est = self._overhead + self._slope * x
        for i in self._tok_models:
            n = len(self.tokenizers[self.models[i]].encode(prompt).ids)
            est[i] = self._overhead[i] + self._slope[i] * n
        np.rint(est, out=est)
        return np.maximum(est, 0.0, out=est)

    def count(self, model: str, prompt: str) -> int:
        """Return the prompt token count of ``prompt`` for one model."""
        return int(self.counts(prompt)[self._model(model)])

    def observe(self, model: str, prompt: str | int, prompt_tokens: int) -> None:
        """Learn from a usage report: ``model`` counted ``prompt_tokens`` for ``prompt``.

        Args:
            model: The model that served the request.
            prompt: The prompt text, or (without a tokenizer) its length in characters.
            prompt_tokens: ``usage.prompt_tokens`` of the response.

        Raises:
            PredictorError: Unknown model or a bad count.
        """
        i = self._model(model)
        if (
            isinstance(prompt_tokens, bool)
            or not isinstance(prompt_tokens, int)
            or prompt_tokens < 0
        ):
            raise PredictorError("prompt_tokens", "must be an int >= 0", prompt_tokens)
        tok = self.tokenizers.get(model)
        if tok is not None:
            if not isinstance(prompt, str):
                raise PredictorError(
                    "prompt", f"must be the text: {model!r} has a tokenizer", prompt
                )
            x = float(len(tok.encode(prompt).ids))
        elif isinstance(prompt, str):
            x = len(prompt) / _KCHARS
        elif isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
            x = prompt / _KCHARS
        else:
            raise PredictorError("prompt", "must be a str or a character count >= 0", prompt)
        f = self._fits[i]
        d = self.decay
        y = float(prompt_tokens)
        f.s0 = f.s0 * d + 1.0
        f.sx = f.sx * d + x
        f.sy = f.sy * d + y
        f.sxx = f.sxx * d + x * x
        f.sxy = f.sxy * d + x * y
        f.n += 1
        self._refit(i, tok is not None)

    def _refit(self, i: int, tokenized: bool) -> None:
        f = self._fits[i]
        lam = self.prior_weight
        if tokenized:
            # The model's own tokenizer counts the text exactly; what it misses is
            # the chat template, a constant: the (prior-shrunk) mean difference.
            self._overhead[i] = (f.sy - f.sx) / (f.s0 + lam)
            self._slope[i] = 1.0
            return
        # Ridge towards (overhead 0, prior slope), each prior worth `prior_weight`
        # reports (the slope's at 1,000 characters), so one report cannot swing it
        # and reports of a single length still give a sensible split.
        b0 = _KCHARS / self.chars_per_token[i]
        a11 = f.s0 + lam
        a12 = f.sx
        a22 = f.sxx + lam
        r1 = f.sy
        r2 = f.sxy + lam * b0
        det = a11 * a22 - a12 * a12
        a = (r1 * a22 - a12 * r2) / det
        b = (a11 * r2 - a12 * r1) / det
        if b <= 0.0:  # nonsense reports (tokens shrinking with length): keep the prior slope
            b = b0
            a = (r1 - a12 * b) / a11
        self._overhead[i] = a
        self._slope[i] = b

    def estimate(self, model: str) -> tuple[float, float]:
        """Return the current ``(overhead tokens, chars per token)`` of ``model``.

        With a tokenizer the second number is 1: counts are the tokenizer's plus
        the overhead.
        """
        i = self._model(model)
        if model in self.tokenizers:
            return float(self._overhead[i]), 1.0
        return float(self._overhead[i]), _KCHARS / float(self._slope[i])

    def reports(self, model: str) -> int:
        """Return how many usage reports ``model`` has had."""
        return self._fits[self._model(model)].n

    def extended(self, models: Sequence[str], chars_per_token: float = 4.0) -> PromptTokenCounter:
        """Return a counter for this pool plus ``models``, keeping what was learned so far.

        Raises:
            PredictorError: A model is already in the pool or named twice.
        """
        new = tuple(models)
        if len(set(new)) != len(new) or set(new) & set(self.models):
            raise PredictorError("models", f"must be new to the pool {list(self.models)}", new)
        out = PromptTokenCounter(
            self.models + new,
            self.chars_per_token + (float(chars_per_token),) * len(new),
            dict(self.tokenizers),
            self.decay,
            self.prior_weight,
        )
        k = len(self.models)
        out._fits[:k] = [attrs.evolve(f) for f in self._fits]
        out._overhead[:k] = self._overhead
        out._slope[:k] = self._slope
        return out

    @classmethod
    def for_pool(
        cls,
        models: Sequence[str],
        chars_per_token: Sequence[float],
        tokenizers: Mapping[str, TokenizerLike] | None = None,
    ) -> PromptTokenCounter:
        """Build a counter (convenience for sequences)."""
        return cls(tuple(models), tuple(chars_per_token), dict(tokenizers or {}))
