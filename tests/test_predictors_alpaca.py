"""Held-out quality on real data: AlpacaEval prompts, judge preferences and output lengths.

The data (shared/data/alpaca_eval, CC BY-NC 4.0, AlpacaEval by Li et al. 2023) is
read in place and never copied into the repository; without it these tests skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bearsdk.predictors import (
    FUSECHAT3_POOL,
    FUSECHAT_LLAMA_POOL,
    PredictorError,
    TrainConfig,
    read_alpaca_eval,
)
from bearsdk.predictors.evaluate import cross_validate, spearman

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared"))
ALPACA = SHARED / "data" / "alpaca_eval"

needs_alpaca = pytest.mark.skipif(
    not (ALPACA / "prompts.csv").is_file(),
    reason=f"AlpacaEval data not found at {ALPACA} (set BEARSDK_SHARED to the shared folder)",
)


@needs_alpaca
def test_reads_the_fusechat_pool() -> None:
    data = read_alpaca_eval(ALPACA)
    assert len(data.prompts) == 805
    assert data.n_rows == 3 * 805
    assert [m.name for m in data.pool] == [m.name for m in FUSECHAT3_POOL]
    assert ((data.accuracy >= 0) & (data.accuracy <= 1)).all()
    means = [data.accuracy[data.model_index == j].mean() for j in range(3)]
    assert means[0] < means[1] < means[2]  # Llama 1B < Qwen 7B < Gemma 9B
    assert set(data.groups) == {"helpful_base", "koala", "oasst", "selfinstruct", "vicuna"}
    with pytest.raises(PredictorError, match=r"pool model is not in .*\(got 'no-such-model'\)"):
        read_alpaca_eval(ALPACA, [FUSECHAT_LLAMA_POOL[0].__class__("no-such-model")])


@needs_alpaca
def test_held_out_predictions_beat_the_per_model_mean() -> None:
    data = read_alpaca_eval(ALPACA)
    report = cross_validate(data, TrainConfig(quantiles=(0.9,)), folds=3)
    pred, base = report.predictor, report.baseline
    assert report.n_prompts == 805
    assert pred.accuracy_mae < base.accuracy_mae
    assert pred.length_mae < 0.95 * base.length_mae
    assert pred.length_mape < base.length_mape
    for key in ("length_mae", "accuracy_mae"):
        mean, se = report.differences[key]
        assert mean < -2 * se, key  # significant, not luck of the split
    assert 0.7 < pred.length_p90_coverage < 0.97
    # Qwen-7B and Gemma-9B trade places by kind of prompt: the relative head ranks
    # held-out prompts better than the per-model means.
    assert pred.spearman > base.spearman
    assert pred.top1 > base.top1
    assert pred.picked_accuracy > base.picked_accuracy
    mean, se = report.differences["spearman"]
    assert mean > se
    assert report.relative_folds == 3


@needs_alpaca
def test_a_pool_ordered_by_size_keeps_the_means_order() -> None:
    # FuseChat Llama 1B/3B/8B: no prompt feature predicts where the order flips,
    # so the relative head is left out rather than fitted to noise.
    from bearsdk.predictors import train_predictor

    data = read_alpaca_eval(ALPACA, FUSECHAT_LLAMA_POOL)
    pred = train_predictor(data, TrainConfig(n_estimators=20, quantiles=()))
    assert pred.relative is None
    assert pred.info["relative_head"]["fitted"] is False


def test_spearman_handles_ties() -> None:
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, a) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert spearman(a, np.array([1.0, 1.0, 2.0, 2.0])) == pytest.approx(0.894427191)
    assert np.isnan(spearman(a, np.ones(4)))
