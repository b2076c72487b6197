"""The relative-accuracy head: reorders the pool per prompt where the data supports it."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bearsdk.predictors import (
    ModelSpec,
    Predictor,
    PredictorError,
    PredictorFormatError,
    RelativeAccuracy,
    TrainConfig,
    TrainingSet,
    _impl,
    train_predictor,
)
from bearsdk.predictors.relative import MIN_PROMPTS, fit_relative_accuracy
from bearsdk.predictors.serialize import encode_predictor

POOL = (
    ModelSpec("coder", 7.0, 32768, 0.07, 0.28),
    ModelSpec("writer", 9.0, 8192, 0.09, 0.32),
    ModelSpec("small", 1.0, 32768, 0.05, 0.2),
)
CODE = ["Write Python code that parses {w}.", "Fix this function that sorts {w}: def f(x): pass"]
PROSE = ["Write a warm story about {w}.", "Describe a summer afternoon among {w}."]
WORDS = ["rivers", "lists", "files", "gardens", "stars", "ledgers", "trains", "songs"]
CONFIG = TrainConfig(n_estimators=40, quantiles=())


def planted(n_prompts: int = 300, seed: int = 0, signal: float = 0.12) -> TrainingSet:
    """'coder' beats 'writer' on code prompts and loses on prose by ``signal``; noise is larger."""
    rng = np.random.default_rng(seed)
    prompts, is_code = [], []
    for i in range(n_prompts):
        code = i % 2 == 0
        body = (CODE if code else PROSE)[(i // 2) % 2].format(w=WORDS[i % len(WORDS)])
        filler = " ".join(rng.choice(WORDS, size=int(rng.integers(0, 20))))
        prompts.append(f"{body} {filler} #{i}")
        is_code.append(code)
    k = len(POOL)
    pi = np.repeat(np.arange(n_prompts), k)
    mi = np.tile(np.arange(k), n_prompts)
    sign = np.where(np.array(is_code)[pi], 1.0, -1.0)
    level = np.array([0.6, 0.6, 0.3])[mi]
    shift = np.where(mi == 0, signal * sign, np.where(mi == 1, -signal * sign, 0.0))
    difficulty = 0.15 * rng.standard_normal(n_prompts)[pi]
    acc = np.clip(level + shift + difficulty + 0.15 * rng.standard_normal(pi.shape[0]), 0, 1)
    out = np.full(pi.shape[0], 200.0)
    return TrainingSet(
        tuple(prompts), POOL, pi, mi, acc, out, np.full(pi.shape[0], np.nan), source="planted"
    )


@pytest.fixture(scope="module")
def pred() -> Predictor:
    return train_predictor(planted(), CONFIG)


def test_head_learns_which_model_suits_a_prompt(pred: Predictor) -> None:
    assert pred.relative is not None
    assert pred.info["relative_head"]["fitted"] is True
    assert pred.relative.loo_spearman_gain > 0
    code = pred.predict("Write Python code that parses invoices.").accuracy
    prose = pred.predict("Write a warm story about the sea.").accuracy
    assert code[0] > code[1]
    assert prose[1] > prose[0]
    assert code[2] < min(code[:2])
    assert prose[2] < min(prose[:2])
    # The correction reorders the pool; it does not move a prompt's mean.
    assert np.allclose(pred.relative.weights.sum(axis=1), 0.0, atol=1e-12)
    assert pred.relative.intercept.sum() == pytest.approx(0.0, abs=1e-12)


def test_held_out_prompts_are_ranked_better_than_by_the_means(pred: Predictor) -> None:
    test = planted(n_prompts=200, seed=1)
    x = pred.feature_rows(test.prompts, test.prompt_index, test.model_index)
    got = pred.predict_rows(x)["accuracy"].reshape(-1, len(POOL))
    truth = test.accuracy.reshape(-1, len(POOL))
    picked = truth[np.arange(truth.shape[0]), got.argmax(axis=1)].mean()
    by_mean = truth[:, 0].mean()  # the first model's mean ties the second's: same either way
    assert picked > by_mean + 0.05
    without = train_predictor(
        planted(), TrainConfig(n_estimators=40, quantiles=(), relative_head=False)
    )
    assert without.relative is None
    assert "relative_head" not in without.info
    plain = without.predict_rows(x)["accuracy"].reshape(-1, len(POOL))
    # The trees alone catch a signal this strong too; the head must not undo them.
    assert picked >= truth[np.arange(truth.shape[0]), plain.argmax(axis=1)].mean() - 0.005


def test_no_signal_leaves_the_head_out() -> None:
    data = planted(signal=0.0, seed=3)
    head, record = fit_relative_accuracy(
        train_predictor(
            data, TrainConfig(n_estimators=5, quantiles=(), relative_head=False)
        ).pipeline.transform_many(data.prompts),
        data.accuracy.reshape(-1, len(POOL)),
    )
    assert head is None
    assert record["fitted"] is False
    assert "significantly better" in record["reason"]
    few, record = fit_relative_accuracy(
        np.ones((MIN_PROMPTS - 1, 4)), np.zeros((MIN_PROMPTS - 1, 3))
    )
    assert few is None
    assert f"fewer than {MIN_PROMPTS}" in record["reason"]
    one, record = fit_relative_accuracy(np.ones((100, 4)), np.zeros((100, 1)))
    assert one is None
    assert record["reason"] == "one model"


def test_prompts_missing_a_model_are_left_out() -> None:
    data = planted()
    scores = data.accuracy.reshape(-1, len(POOL)).copy()
    x = np.random.default_rng(0).standard_normal((scores.shape[0], 5))
    scores[:7, 1] = np.nan
    _, record = fit_relative_accuracy(x, scores)
    assert record["n_prompts"] == scores.shape[0] - 7


def test_fused_path_equals_rows_and_round_trips(pred: Predictor, tmp_path: Path) -> None:
    for prompt in ("Write Python code that parses logs.", "Describe a garden.", "", "Ünï?"):
        p = pred.predict(prompt)
        rows = pred.predict_rows(pred.feature_rows([prompt]))
        assert np.array_equal(p.accuracy, rows["accuracy"])
        assert ((p.accuracy >= 0) & (p.accuracy <= 1)).all()
    back = Predictor.load(pred.save(tmp_path))
    assert back.relative is not None
    assert pred.relative is not None
    assert back.relative.weights.tobytes() == pred.relative.weights.tobytes()
    assert back.relative.intercept.tobytes() == pred.relative.intercept.tobytes()
    assert back.relative.info() == pred.relative.info()
    for prompt in ("Write Python code.", "A story, please."):
        assert back.predict(prompt).accuracy.tobytes() == pred.predict(prompt).accuracy.tobytes()
    assert encode_predictor(back) == encode_predictor(pred)


def _rewrite(data: bytes, name: str, body: bytes | None) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            content = body if info.filename == name else src.read(info.filename)
            if content is not None:
                dst.writestr(info, content)
    return buf.getvalue()


def test_a_bad_relative_head_gives_a_clear_error(pred: Predictor, tmp_path: Path) -> None:
    good = encode_predictor(pred)
    meta = json.loads(zipfile.ZipFile(io.BytesIO(good)).read("meta.json"))
    wrong = io.BytesIO()
    np.save(wrong, np.zeros((3, 2)))
    nan = io.BytesIO()
    np.save(nan, np.full(len(POOL), np.nan))
    cases = [
        (_rewrite(good, "relative/weights.npy", None), "relative/weights.npy is missing"),
        (_rewrite(good, "relative/weights.npy", wrong.getvalue()), "relative needs weights"),
        (
            _rewrite(good, "relative/intercept.npy", nan.getvalue()),
            "relative.intercept must be finite",
        ),
        (
            _rewrite(
                good,
                "meta.json",
                orjson.dumps({**meta, "relative": {**meta["relative"], "penalty": "x"}}),
            ),
            r"relative.penalty must be a number \(got 'x'\)",
        ),
        (
            _rewrite(good, "meta.json", orjson.dumps({**meta, "relative": [1]})),
            "relative must be a JSON object or null",
        ),
    ]
    for i, (blob, message) in enumerate(cases):
        target = tmp_path / f"bad{i}.bearpred"
        target.write_bytes(blob)
        with pytest.raises(PredictorFormatError, match=message) as info:
            Predictor.load(target)
        assert str(target) in str(info.value)


def test_rows_must_name_pool_models(pred: Predictor) -> None:
    x = pred.feature_rows(["Write code."])
    x[0, pred.pipeline.n_features] = 7
    with pytest.raises(
        PredictorError, match=r"model_id column: row 0: model id 7.0 is not one of 0\.\.2"
    ):
        pred.predict_rows(x)
    with pytest.raises(PredictorFormatError, match="relative must map"):
        Predictor(
            pred.pipeline,
            pred.pool[:2],
            pred.heads,
            relative=RelativeAccuracy(np.zeros((pred.pipeline.n_features, 3)), np.zeros(3)),
        )


def test_cli_trains_the_head_and_can_leave_it_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bearsdk.cli import main

    data = planted()
    src = tmp_path / "evals.jsonl"
    with src.open("wb") as fh:
        for p, m, a in zip(data.prompt_index, data.model_index, data.accuracy, strict=True):
            row = {
                "prompt": data.prompts[p],
                "model": POOL[m].name,
                "accuracy": float(a),
                "output_tokens": 200,
            }
            fh.write(orjson.dumps(row) + b"\n")
    pool = tmp_path / "pool.json"
    pool.write_bytes(orjson.dumps([m.to_dict() for m in POOL]))
    base = ["train", "--data", str(src), "--pool", str(pool), "--n-estimators", "10"]
    assert main([*base, "--out", str(tmp_path / "with"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["relative_head"]["fitted"] is True
    assert Predictor.load(tmp_path / "with").relative is not None
    assert main([*base, "--out", str(tmp_path / "without"), "--no-relative"]) == 0
    assert "relative-accuracy head: not fitted (disabled)" in capsys.readouterr().out
    assert Predictor.load(tmp_path / "without").relative is None


_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


@st.composite
def _linear_case(draw: st.DrawFn) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    k = draw(st.integers(1, 6))
    p = draw(st.integers(0, 40))
    n = draw(st.integers(1, 9))
    x = np.array(draw(st.lists(_finite, min_size=n * (p + 1), max_size=n * (p + 1))))
    x = x.reshape(n, p + 1)
    x[:, p] = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    w = np.array(draw(st.lists(_finite, min_size=k * p, max_size=k * p))).reshape(k, p)
    b = np.array(draw(st.lists(_finite, min_size=k, max_size=k)))
    start = np.array(draw(st.lists(st.floats(-2, 3), min_size=n, max_size=n)))
    return x, p, w, b, start


@pytest.mark.skipif("cython" not in _impl.implementations(), reason="built without extensions")
@given(_linear_case())
def test_compiled_and_python_linear_terms_agree_bit_for_bit(
    case: tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    x, p, w, b, start = case
    outs = {}
    for name, impl in _impl.implementations().items():
        out = start.copy()
        impl.add_linear(x, p, p, w, b, out, 0.0, 1.0)
        outs[name] = out
    assert outs["python"].tobytes() == outs["cython"].tobytes()
    m = x[:, p].astype(int)
    ref = np.clip(start + ((x[:, :p] * w[m]).sum(axis=1) + b[m]), 0.0, 1.0)
    assert np.allclose(outs["python"], ref, rtol=1e-9, atol=1e-6 * (1 + np.abs(x).max()) ** 2)


@given(
    st.integers(0, 2**32 - 1),
    st.integers(2, 5),
    st.integers(MIN_PROMPTS, 160),
    st.floats(0.0, 0.3),
)
def test_a_fitted_head_never_moves_a_prompts_mean(seed: int, k: int, n: int, signal: float) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6))
    effect = signal * np.outer(x[:, 0], rng.standard_normal(k))
    scores = np.clip(rng.uniform(0.2, 0.8, k) + effect + 0.2 * rng.standard_normal((n, k)), 0, 1)
    head, record = fit_relative_accuracy(x, scores)
    assert record["n_prompts"] == n
    if head is None:
        assert record["fitted"] is False
        return
    assert head.weights.shape == (6, k)
    assert np.allclose(head.weights.sum(axis=1), 0.0, atol=1e-12)
    assert abs(head.intercept.sum()) < 1e-12
    assert head.penalty >= n  # never weaker than the grid's floor
    assert head.loo_spearman_gain > 0


def test_linear_term_rejects_bad_rows() -> None:
    for name, impl in _impl.implementations().items():
        bad = np.zeros((2, 3))
        bad[1, 2] = 1.5
        with pytest.raises(ValueError, match=r"row 1: model id 1.5 is not one of 0\.\.1"):
            impl.add_linear(bad, 2, 2, np.zeros((2, 2)), np.zeros(2), np.zeros(2), 0.0, 1.0)
        with pytest.raises(ValueError, match="p and model_col"):
            impl.add_linear(bad, 5, 2, np.zeros((2, 2)), np.zeros(2), np.zeros(2), 0.0, 1.0)
        assert name in ("python", "cython")
