"""Predictors end to end: training, prediction, cost, token counts, persistence, CLI."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import orjson
import pytest

from bearsdk.cli import main
from bearsdk.predictors import (
    QWEN3_POOL,
    ModelSpec,
    Predictor,
    PredictorError,
    PredictorFormatError,
    PromptTokenCounter,
    TrainConfig,
    TrainingSet,
    _features_py,
    _impl,
    read_jsonl,
    train_predictor,
)
from bearsdk.predictors.serialize import FILE_NAME, decode_predictor, encode_predictor

TASKS = {
    "summarize": "Summarize the following report about {w}. ",
    "story": "Write a story about {w}. ",
    "list": "List {n} facts about {w}. ",
    "code": "Write Python code that sorts {w}. ",
}
WORDS = [
    "rivers",
    "cities",
    "budgets",
    "engines",
    "forests",
    "planets",
    "markets",
    "bridges",
    "songs",
    "recipes",
]


def tiny_data(n_prompts: int = 160, seed: int = 0) -> TrainingSet:
    rng = np.random.default_rng(seed)
    prompts, kinds = [], []
    for i in range(n_prompts):
        kind = list(TASKS)[i % len(TASKS)]
        body = TASKS[kind].format(w=WORDS[i % len(WORDS)], n=3 + i % 4)
        filler = " ".join(rng.choice(WORDS, size=int(rng.integers(0, 60))))
        prompts.append(f"{body}{filler} #{i}")
        kinds.append(kind)
    pool = QWEN3_POOL
    pi = np.repeat(np.arange(n_prompts), len(pool))
    mi = np.tile(np.arange(len(pool)), n_prompts)
    base = {"summarize": 0.6, "story": 0.3, "list": 0.7, "code": 0.4}
    acc = np.array([base[kinds[p]] for p in pi]) + 0.15 * mi + 0.05 * rng.normal(size=pi.shape[0])
    length = np.array(
        [{"summarize": 150, "story": 700, "list": 120, "code": 300}[kinds[p]] for p in pi]
    )
    out = length * (1 + 0.1 * mi) * np.exp(0.1 * rng.normal(size=pi.shape[0]))
    return TrainingSet(
        tuple(prompts),
        pool,
        pi,
        mi,
        np.clip(acc, 0, 1),
        np.rint(out),
        np.full(pi.shape[0], np.nan),
        tuple(kinds),
        "tiny test data",
    )


CONFIG = TrainConfig(n_estimators=40, learning_rate=0.1, num_leaves=7, min_data_in_leaf=5)


@pytest.fixture(scope="module")
def data() -> TrainingSet:
    return tiny_data()


@pytest.fixture(scope="module")
def pred(data: TrainingSet) -> Predictor:
    return train_predictor(data, CONFIG)


def test_predictions_follow_the_training_signal(pred: Predictor) -> None:
    story = pred.predict("Write a story about dragons and a lost key.")
    summary = pred.predict("Summarize the following report about budgets and markets.")
    assert story.models == tuple(m.name for m in QWEN3_POOL)
    assert story.output_tokens.mean() > 2 * summary.output_tokens.mean()
    assert story.accuracy[2] > story.accuracy[0]
    for p in (story, summary):
        assert ((p.accuracy >= 0) & (p.accuracy <= 1)).all()
        assert (p.output_tokens >= 1).all()
        assert (p.output_quantiles[0.5] <= p.output_quantiles[0.9]).all()


def test_cost_is_prompt_and_output_tokens_times_prices(pred: Predictor) -> None:
    p = pred.predict("List 3 facts about rivers.", prompt_tokens=[10, 20, 30])
    in_price = np.array([m.input_price for m in QWEN3_POOL]) * 1e-6
    out_price = np.array([m.output_price for m in QWEN3_POOL]) * 1e-6
    assert np.array_equal(p.prompt_tokens, [10, 20, 30])
    assert np.array_equal(p.cost_usd, p.prompt_tokens * in_price + p.output_tokens * out_price)
    assert np.array_equal(pred.predict("x", prompt_tokens=7).prompt_tokens, [7, 7, 7])
    assert np.array_equal(p.utility(0.0), p.accuracy)
    assert p.best(1e9) == int(np.argmin(p.cost_usd))
    assert p.best(0.0, feasible=[True, False, False]) == 0
    with pytest.raises(PredictorError, match="feasible selects no model"):
        p.best(0.0, feasible=[False, False, False])
    with pytest.raises(PredictorError, match=r"prompt_tokens must be an int or 3 counts"):
        pred.predict("x", prompt_tokens=[1, 2])
    with pytest.raises(PredictorError, match=r"prompt must be a str \(got 'NoneType'\)"):
        pred.predict(None)  # type: ignore[arg-type]


def test_fused_path_equals_row_evaluation(pred: Predictor, data: TrainingSet) -> None:
    for prompt in (*data.prompts[:5], "", "Ünïcödé?"):
        p = pred.predict(prompt)
        rows = pred.predict_rows(pred.feature_rows([prompt]))
        assert np.array_equal(p.accuracy, rows["accuracy"])
        assert np.array_equal(p.output_tokens, rows["output_tokens"])
        assert np.array_equal(p.output_quantiles[0.9], rows["output_tokens_p90"])
        lean = pred.predict(prompt, quantiles=False)  # the router's path
        assert np.array_equal(lean.accuracy, p.accuracy)
        assert np.array_equal(lean.output_tokens, p.output_tokens)
        assert np.array_equal(lean.cost_usd, p.cost_usd)
        assert not lean.output_quantiles


def test_router_lists_are_the_predictions_to_the_bit(pred: Predictor, data: TrainingSet) -> None:
    def as_lists(p: Any) -> tuple[list[float], ...]:
        return tuple(a.tolist() for a in (p.accuracy, p.output_tokens, p.prompt_tokens, p.cost_usd))

    prompts = (*data.prompts[:5], "", "Ünïcödé?", "x" * 20_000)
    for prompt in prompts:
        assert pred.predict_lists(prompt) == as_lists(pred.predict(prompt, quantiles=False))
    # Counted by a tokenizer and learned from usage (on a copy: the fixture is
    # shared), and with prior-only models (predict's own path): the same numbers.
    own = attrs.evolve(pred, tokens=pred.tokens.extended([]))
    own.set_tokenizer(QWEN3_POOL[0].name, _WordTokenizer())
    own.observe_usage(QWEN3_POOL[1].name, "one two three", 17)
    for prompt in prompts:
        assert own.predict_lists(prompt) == as_lists(own.predict(prompt, quantiles=False))
    wide = pred.with_priors({"other/model": 0.5})
    got = wide.predict_lists("Write a haiku.")
    assert len(got[0]) == len(wide.models) == len(pred.models) + 1
    assert got == as_lists(wide.predict("Write a haiku.", quantiles=False))
    with pytest.raises(PredictorError, match=r"prompt must be a str \(got 'NoneType'\)"):
        pred.predict_lists(None)  # type: ignore[arg-type]


@pytest.mark.skipif("cython" not in _impl.implementations(), reason="built without extensions")
def test_compiled_and_python_pool_kernels_agree(pred: Predictor) -> None:
    be = _impl.implementations()
    fx = {
        n: b.feature_extractor(pred.pipeline.components, pred.pipeline.offset)
        for n, b in be.items()
    }
    outs = {}
    for name, b in be.items():
        forests = tuple(b.forest(**pred.heads[h].evaluator_args()) for h in pred.head_order)
        x = pred.feature_rows([""])
        out = np.empty((len(forests), x.shape[0]))
        b.predict_pool(
            fx[name],
            "Write a story in 3 sentences.",
            x,
            forests,
            np.array([0.0, 1, 1, 1]),
            np.array([1.0, np.inf, np.inf, np.inf]),
            out,
        )
        outs[name] = out
    assert outs["python"].tobytes() == outs["cython"].tobytes()
    assert _features_py.IMPLEMENTATION == "python"


def test_save_load_round_trips_exactly(pred: Predictor, tmp_path: Path) -> None:
    path = pred.save(tmp_path)
    assert path == tmp_path / FILE_NAME
    back = Predictor.load(tmp_path)
    assert back.pool == pred.pool
    assert back.quantiles == pred.quantiles
    assert back.info == pred.info
    assert np.array_equal(back.pipeline.components, pred.pipeline.components)
    assert back.pipeline.offset.tobytes() == pred.pipeline.offset.tobytes()
    for name, ens in pred.heads.items():
        for field, arr in ens.arrays().items():
            got = back.heads[name].arrays()[field]
            assert got.dtype == arr.dtype, (name, field)
            assert got.tobytes() == arr.tobytes(), (name, field)
    for prompt in ("Write a story.", "List 4 facts about songs.", ""):
        a, b = pred.predict(prompt), back.predict(prompt)
        assert a.accuracy.tobytes() == b.accuracy.tobytes()
        assert a.cost_usd.tobytes() == b.cost_usd.tobytes()
    assert encode_predictor(back) == path.read_bytes()  # deterministic bytes


def _rewrite(data: bytes, edit: dict[str, bytes | None]) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            body = edit.get(info.filename, src.read(info.filename))
            if body is not None:
                dst.writestr(info, body)
    return buf.getvalue()


def _meta(data: bytes, **changes: Any) -> bytes:
    meta = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("meta.json"))
    meta.update(changes)
    return _rewrite(data, {"meta.json": orjson.dumps(meta)})


def test_corrupt_and_foreign_files_give_clear_errors(pred: Predictor, tmp_path: Path) -> None:
    good = encode_predictor(pred)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    bad_array = io.BytesIO()
    np.save(bad_array, np.zeros(3, dtype=np.float32))
    cases = [
        (good[: len(good) // 3], "corrupt or truncated"),
        (bytes(flipped), "corrupt or truncated"),
        (b"not a zip file at all", "corrupt or truncated"),
        (_rewrite(good, {"meta.json": None}), "meta.json is missing: not a bearsdk predictor"),
        (_rewrite(good, {"meta.json": b"{nope"}), "corrupt or truncated"),
        (_meta(good, format="something.else"), "does not describe a 'bearsdk.predictor' file"),
        (
            _meta(good, format_version=999),
            r"format version 999, this bearsdk .* reads format version 2",
        ),
        (_meta(good, feature_version=7), "prompt features are version 7"),
        (
            _rewrite(good, {"heads/accuracy/leaf_value.npy": bad_array.getvalue()}),
            "leaf_value must be a 1-d float64",
        ),
        (_rewrite(good, {"heads/accuracy/left.npy": None}), "heads/accuracy/left.npy is missing"),
        (_meta(good, pool=[{"name": "m", "params_b": -1}]), "params_b must be finite and >= 0"),
    ]
    for i, (blob, message) in enumerate(cases):
        target = tmp_path / f"case{i}.bearpred"
        target.write_bytes(blob)
        with pytest.raises(PredictorFormatError, match=message) as info:
            Predictor.load(target)
        assert str(target) in str(info.value), info.value
    with pytest.raises(PredictorFormatError, match="cannot be read"):
        Predictor.load(tmp_path / "missing.bearpred")
    with pytest.raises(PredictorFormatError, match="retrain"):
        decode_predictor(_meta(good, format_version=1))  # before the relative head


def test_default_predictor_ships_and_predicts() -> None:
    from importlib.resources import files

    ref = files("bearsdk.predictors").joinpath("data", "default.bearpred")
    assert len(ref.read_bytes()) < 1024 * 1024
    pred = Predictor.load_default()
    assert pred.models == tuple(m.name for m in QWEN3_POOL)
    assert "placeholder" in pred.info
    report = (
        "Summarize the following government report.\n\n" + "The agency spent its budget. " * 400
    )
    prompts = [
        "Give three tips for staying healthy.",
        "[WP] A dragon opens a bakery. Write a story.",
        report,
    ]
    acc = np.stack([pred.predict(p).accuracy for p in prompts])
    assert (acc[:, 0] < acc[:, 2]).all()  # Table 2: 0.6B below 32B on every task
    story, summary = pred.predict(prompts[1]), pred.predict(prompts[2])
    assert story.output_tokens.mean() > 1.5 * summary.output_tokens.mean()  # trace lengths
    assert (summary.prompt_tokens > 1000).all()
    assert (summary.cost_usd > story.cost_usd).all()


def test_token_counter_learns_overhead_and_ratio() -> None:
    tc = PromptTokenCounter(("a", "b"), (4.0, 4.0))
    assert tc.count("a", "x" * 400) == 100
    for n in (100, 400, 1600, 3000, 800) * 20:
        tc.observe("a", "x" * n, round(12 + n / 3.0))
    overhead, ratio = tc.estimate("a")
    assert abs(overhead - 12) < 1.0
    assert abs(ratio - 3.0) < 0.05
    assert abs(tc.count("a", "x" * 2400) - 812) <= 2
    assert tc.count("b", "x" * 400) == 100  # other models keep their prior
    assert tc.reports("a") == 100
    assert tc.reports("b") == 0
    tc.observe("b", 400, 100)  # a character count works without a tokenizer
    with pytest.raises(PredictorError, match=r"model is not in the pool \['a', 'b'\] \(got 'c'\)"):
        tc.observe("c", "x", 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(PredictorError, match="prompt_tokens must be an int >= 0"):
            tc.observe("a", "x", bad)  # type: ignore[arg-type]


class _FakeEncoding:
    def __init__(self, n: int) -> None:
        self.ids = list(range(n))


class _WordTokenizer:
    def encode(self, sequence: str, *args: Any, **kwargs: Any) -> _FakeEncoding:
        return _FakeEncoding(len(sequence.split()))


def test_token_counter_uses_a_tokenizer(pred: Predictor) -> None:
    tc = PromptTokenCounter(("a", "b"), (4.0, 4.0), {"a": _WordTokenizer()})
    assert tc.count("a", "one two three") == 3
    for _ in range(50):
        tc.observe("a", "one two three four", 4 + 9)  # a 9-token chat template
    assert tc.count("a", "one two") == 11
    with pytest.raises(PredictorError, match="must be the text"):
        tc.observe("a", 10, 5)
    pred.set_tokenizer(QWEN3_POOL[0].name, _WordTokenizer())
    try:
        assert pred.predict("one two three four five").prompt_tokens[0] == 5
    finally:
        pred.set_tokenizer(QWEN3_POOL[0].name, None)


def test_bad_models_and_configs_are_named() -> None:
    with pytest.raises(
        PredictorError, match=r"model 'm': max_context must be a positive int \(got 0\)"
    ):
        ModelSpec("m", 1.0, 0)
    with pytest.raises(PredictorError, match=r"config.n_estimators must be an int >= 1 \(got 0\)"):
        TrainConfig(n_estimators=0)
    with pytest.raises(PredictorError, match=r"config.quantiles must be distinct levels"):
        TrainConfig(quantiles=(0.5, 1.5))


def _write_jsonl(path: Path, data: TrainingSet) -> None:
    lines = []
    for p, m, a, o in zip(
        data.prompt_index, data.model_index, data.accuracy, data.output_tokens, strict=True
    ):
        rec = {
            "prompt": data.prompts[p],
            "model": data.pool[m].name,
            "accuracy": float(a),
            "output_tokens": float(o),
        }
        lines.append(orjson.dumps(rec))
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_read_jsonl_names_bad_records(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"prompt": "hi", "model": "Qwen/Qwen3-8B", "accuracy": 0.5}\n\n'
        '{"prompt": "yo", "model": "Qwen/Qwen3-8B", "accuracy": 1.5}\n'
    )
    with pytest.raises(
        PredictorError, match=r"d.jsonl line 3: accuracy must be a number in \[0.0, 1.0\]"
    ):
        read_jsonl(f, QWEN3_POOL)
    f.write_text('{"prompt": "hi", "model": "gpt-9"}\n')
    with pytest.raises(PredictorError, match=r"line 1: model is not in the pool"):
        read_jsonl(f, QWEN3_POOL)


def test_cli_train_writes_a_loadable_predictor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_data(80, seed=1)
    src = tmp_path / "evals.jsonl"
    _write_jsonl(src, data)
    out = tmp_path / "model"
    argv = [
        "train",
        "--data",
        str(src),
        "--out",
        str(out),
        "--n-estimators",
        "20",
        "--quantiles",
        "none",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["file"] == str(out / FILE_NAME)
    assert summary["heads"] == {"accuracy": 20, "output_tokens": 20}
    assert summary["prompts"] == 80
    loaded = Predictor.load(out)
    assert loaded.info["source"] == "evals.jsonl"
    assert loaded.predict("Write a story about rivers.").output_quantiles == {}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    assert main(["train", "--data", str(bad), "--out", str(out)]) == 2
    assert "bad.jsonl line 1: prompt must be a str (got 3)" in capsys.readouterr().err


def test_bench_predictors_runs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "predictors", "--models", "2", "--tokens", "50", "--rounds", "2", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in res["speed"]["rows"]]
    assert any(n.startswith("features (50-token prompt") for n in names)
    assert all(r["median_us"] > 0 for r in res["speed"]["rows"])


def test_load_tokenizer_names_the_optional_extra(tmp_path: Path) -> None:
    from bearsdk.predictors import load_tokenizer

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(PredictorError, match=r"optional 'tokenizers' package"):
            load_tokenizer(tmp_path / "tokenizer.json")
    else:
        (tmp_path / "tokenizer.json").write_text("{not json")
        with pytest.raises(PredictorError, match="tokenizer cannot be loaded"):
            load_tokenizer(tmp_path / "tokenizer.json")
