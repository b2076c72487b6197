"""Training data for the predictors: prompts, models, judged accuracy, output lengths.

A :class:`TrainingSet` holds one row per (prompt, model) evaluation. Two readers
fill it:

* :func:`read_jsonl`: the general format, one JSON object per line::

      {"prompt": "...", "model": "Qwen/Qwen3-8B", "accuracy": 0.8, "output_tokens": 312}

  ``accuracy`` (a judge score in [0, 1]), ``output_tokens`` (completion tokens)
  and ``prompt_tokens`` (the server's count, used to fit each model's
  characters-per-token prior) are each optional, but a row needs one of the
  first two. Models must belong to the pool given alongside.
* :func:`read_alpaca_eval`: the AlpacaEval tables in ``alpaca_eval/`` of the data
  folder (``docs/data.md``; CC BY-NC 4.0: for evaluation only; nothing derived from them ships). The
  accuracy of a model on a prompt is its AlpacaEval 2.0 weighted preference over
  the GPT-4-1106 baseline minus one (in [0, 1]); output tokens are approximated
  as characters / 4 (the tables carry no token counts).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import orjson

from bearsdk.predictors.errors import PredictorError
from bearsdk.predictors.pool import FUSECHAT3_POOL, ModelSpec

__all__ = [
    "ALPACA_CHARS_PER_TOKEN",
    "ALPACA_EXCLUDED",
    "ALPACA_PREFERENCES",
    "TrainingSet",
    "read_alpaca_eval",
    "read_jsonl",
]

ALPACA_PREFERENCES: Final = "preference_weighted_alpaca_eval_gpt4_turbo_vs_gpt4_1106_preview.csv"
ALPACA_LENGTHS: Final = "output_length_chars.csv"
ALPACA_CHARS_PER_TOKEN: Final = 4.0
ALPACA_EXCLUDED: Final = ("NullModel", "gpt4_gamed", "gpt4_1106_preview")
"""Left out of ``pool="all"``: adversarial entries and the judge's own baseline."""


@attrs.frozen(eq=False)
class TrainingSet:
    """(prompt, model) evaluations for training and evaluating predictors.

    Attributes:
        prompts: The distinct prompts.
        pool: The models, in the order their categorical ids follow.
        prompt_index: ``int64[R]`` prompt of each row.
        model_index: ``int64[R]`` model of each row (index into ``pool``).
        accuracy: ``float64[R]`` judge score in [0, 1], NaN where unknown.
        output_tokens: ``float64[R]`` completion tokens, NaN where unknown.
        prompt_tokens: ``float64[R]`` the server's prompt token count, NaN where unknown.
        groups: Per-prompt label (task or dataset), informational.
        source: Where the data came from (recorded in trained predictors).
    """

    prompts: tuple[str, ...]
    pool: tuple[ModelSpec, ...]
    prompt_index: npt.NDArray[np.int64]
    model_index: npt.NDArray[np.int64]
    accuracy: npt.NDArray[np.float64]
    output_tokens: npt.NDArray[np.float64]
    prompt_tokens: npt.NDArray[np.float64]
    groups: tuple[str, ...] = ()
    source: str = ""

    def __attrs_post_init__(self) -> None:
        n = self.prompt_index.shape[0]
        for name in ("model_index", "accuracy", "output_tokens", "prompt_tokens"):
            if getattr(self, name).shape != (n,):
                raise PredictorError(
                    name, f"must have one entry per row ({n})", getattr(self, name).shape
                )
        if n == 0:
            raise PredictorError("records", "are empty")
        if self.groups and len(self.groups) != len(self.prompts):
            raise PredictorError("groups", "must have one label per prompt", len(self.groups))

    @property
    def n_rows(self) -> int:
        """Number of (prompt, model) rows."""
        return int(self.prompt_index.shape[0])

    def select_prompts(self, prompt_ids: Sequence[int] | npt.NDArray[np.integer]) -> TrainingSet:
        """Return the rows of the given prompts only (prompts renumbered in the given order)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        remap = np.full(len(self.prompts), -1, dtype=np.int64)
        remap[ids] = np.arange(ids.shape[0])
        keep = remap[self.prompt_index] >= 0
        return TrainingSet(
            prompts=tuple(self.prompts[i] for i in ids),
            pool=self.pool,
            prompt_index=remap[self.prompt_index[keep]],
            model_index=self.model_index[keep],
            accuracy=self.accuracy[keep],
            output_tokens=self.output_tokens[keep],
            prompt_tokens=self.prompt_tokens[keep],
            groups=tuple(self.groups[i] for i in ids) if self.groups else (),
            source=self.source,
        )


def _number(value: object, field: str, lo: float, hi: float) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise PredictorError(field, f"must be a number in [{lo}, {hi}] or null", value)
    return float(value)


def read_jsonl(path: str | Path, pool: Sequence[ModelSpec]) -> TrainingSet:
    """Read training rows from a JSON-lines file (format in the module docstring).

    Raises:
        PredictorError: Naming the line and field of the first bad record.
    """
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise PredictorError("data", f"cannot be read: {exc.strerror}", str(path)) from exc
    models = {m.name: i for i, m in enumerate(pool)}
    prompt_ids: dict[str, int] = {}
    rows: list[tuple[int, int, float, float, float]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {lineno}"
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise PredictorError(where, f"is not valid JSON: {exc}") from exc
        if not isinstance(rec, dict):
            raise PredictorError(where, "must be a JSON object", type(rec).__name__)
        prompt = rec.get("prompt")
        if not isinstance(prompt, str):
            raise PredictorError(f"{where}: prompt", "must be a str", prompt)
        model = rec.get("model")
        if model not in models:
            raise PredictorError(f"{where}: model", f"is not in the pool {list(models)}", model)
        acc = _number(rec.get("accuracy"), f"{where}: accuracy", 0.0, 1.0)
        out = _number(rec.get("output_tokens"), f"{where}: output_tokens", 0.0, 1e9)
        ptok = _number(rec.get("prompt_tokens"), f"{where}: prompt_tokens", 0.0, 1e9)
        if math.isnan(acc) and math.isnan(out):
            raise PredictorError(where, "needs accuracy or output_tokens")
        pid = prompt_ids.setdefault(prompt, len(prompt_ids))
        rows.append((pid, models[model], acc, out, ptok))
    if not rows:
        raise PredictorError("data", "has no records", str(path))
    arr = np.asarray(rows, dtype=np.float64)
    return TrainingSet(
        prompts=tuple(prompt_ids),
        pool=tuple(pool),
        prompt_index=arr[:, 0].astype(np.int64),
        model_index=arr[:, 1].astype(np.int64),
        accuracy=arr[:, 2].copy(),
        output_tokens=arr[:, 3].copy(),
        prompt_tokens=arr[:, 4].copy(),
        source=path.name,
    )


def _read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except OSError as exc:
        raise PredictorError(
            "alpaca_dir", f"{path.name} cannot be read: {exc.strerror}", str(path)
        ) from exc
    if not rows:
        raise PredictorError("alpaca_dir", f"{path.name} is empty", str(path))
    return rows[0], rows[1:]


def _column(header: list[str], rows: list[list[str]], name: str, table: str) -> list[float]:
    try:
        j = header.index(name)
    except ValueError:
        raise PredictorError("pool", f"model is not in {table}", name) from None
    return [float(r[j]) if r[j] else math.nan for r in rows]


def alpaca_models(alpaca_dir: str | Path) -> list[str]:
    """Return the models with AlpacaEval 2.0 preferences, less :data:`ALPACA_EXCLUDED`."""
    header, _ = _read_table(Path(alpaca_dir) / ALPACA_PREFERENCES)
    return [m for m in header[1:] if m not in ALPACA_EXCLUDED]


def read_alpaca_eval(
    alpaca_dir: str | Path, pool: Sequence[ModelSpec] | str = FUSECHAT3_POOL
) -> TrainingSet:
    """Read the AlpacaEval tables (see the module docstring) for a pool of its models.

    Args:
        alpaca_dir: The folder with ``prompts.csv`` and the wide tables.
        pool: Models to read (names as in the tables), or ``"all"`` for every
            model with preferences except :data:`ALPACA_EXCLUDED` (their sizes
            are then unknown).

    Raises:
        PredictorError: A file is missing or a model is not in the tables.
    """
    root = Path(alpaca_dir)
    if isinstance(pool, str):
        if pool != "all":
            raise PredictorError("pool", "must be a list of models or 'all'", pool)
        pool = tuple(ModelSpec(name) for name in alpaca_models(root))
    p_header, p_rows = _read_table(root / "prompts.csv")
    col = {name: j for j, name in enumerate(p_header)}
    try:
        prompts = tuple(r[col["instruction"]] for r in p_rows)
        groups = tuple(r[col["dataset"]] for r in p_rows)
        order = [int(r[col["prompt_idx"]]) for r in p_rows]
    except KeyError as exc:
        raise PredictorError("alpaca_dir", f"prompts.csv lacks column {exc}", str(root)) from None
    if order != list(range(len(prompts))):
        raise PredictorError("alpaca_dir", "prompts.csv must list prompt_idx 0..n-1 in order")
    a_header, a_rows = _read_table(root / ALPACA_PREFERENCES)
    l_header, l_rows = _read_table(root / ALPACA_LENGTHS)
    if len(a_rows) != len(prompts) or len(l_rows) != len(prompts):
        raise PredictorError("alpaca_dir", "tables and prompts.csv disagree on the prompt count")
    n = len(prompts)
    pi, mi, acc, out = [], [], [], []
    for m, spec in enumerate(pool):
        pref = np.asarray(_column(a_header, a_rows, spec.name, ALPACA_PREFERENCES))
        chars = np.asarray(_column(l_header, l_rows, spec.name, ALPACA_LENGTHS))
        pi.append(np.arange(n))
        mi.append(np.full(n, m))
        acc.append(np.clip(pref - 1.0, 0.0, 1.0))
        out.append(chars / ALPACA_CHARS_PER_TOKEN)
    accuracy = np.concatenate(acc)
    output = np.concatenate(out)
    keep = ~(np.isnan(accuracy) & np.isnan(output))
    return TrainingSet(
        prompts=prompts,
        pool=tuple(pool),
        prompt_index=np.concatenate(pi)[keep].astype(np.int64),
        model_index=np.concatenate(mi)[keep].astype(np.int64),
        accuracy=accuracy[keep],
        output_tokens=output[keep],
        prompt_tokens=np.full(int(keep.sum()), np.nan),
        groups=groups,
        source="alpaca_eval (AlpacaEval 2.0 weighted preferences vs gpt4_1106_preview)",
    )
