"""Prompt features: the compiled and pure-Python extractors agree bit for bit and mean it."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.predictors import PredictorError, _impl
from bearsdk.predictors import _lexicon as lx
from bearsdk.predictors.features import FeaturePipeline

BACKENDS = _impl.implementations()
needs_compiled = pytest.mark.skipif("cython" not in BACKENDS, reason="built without extensions")

rng = np.random.default_rng(3)
COMPONENTS = rng.integers(-(2**24), 2**24, size=(512, 16)).astype(np.int32)
OFFSET = rng.normal(size=16)
K = 16


def features(backend: _impl.Backend, text: str) -> npt.NDArray[np.float64]:
    fx = backend.feature_extractor(COMPONENTS, OFFSET)
    out = np.full(fx.n_features, np.nan)
    fx.transform_into(text, out)
    return out


def scalar(vec: npt.NDArray[np.float64], name: str) -> float:
    names = lx.prompt_feature_names(K)
    return float(vec[names.index(name)])


EDGE_CASES = [
    "",
    " ",
    "\n\n\t ",
    "a",
    "?",
    "Hello, world! How are you?",
    "Write a story in 3 sentences. Under 100-word summary? Give me five tips...",
    "Ünïcödé ÄB_c 12 345 ١٢ words\n\nsecond line!  ok.",
    "日本語のテキスト。これは\uff1f 5 points",
    "x" * 5000,
    "9" * 40 + " words",
    "e.g. this... and that!!! Then? done",
    "snake_case_identifier = compute(x) { return 42; }",
    "emoji 🙂🙂 and mixed CASE Summarize LIST",
    "\U0001d518\U0001d52b\U0001d526 \ufb01 \u00df \u0130stanbul",
]


@needs_compiled
@pytest.mark.parametrize("text", EDGE_CASES)
def test_compiled_features_equal_python_on_edge_cases(text: str) -> None:
    py = features(BACKENDS["python"], text)
    c = features(BACKENDS["cython"], text)
    assert not np.isnan(py).any()
    assert py.tobytes() == c.tobytes()


VOCAB = [w for w, *_ in lx.lexicon_entries()] + [
    "3",
    "100",
    "-",
    ".",
    "?",
    "!",
    "in",
    "under",
    "The",
    "Ünï",
    "\n",
    "_",
    "١٢",
    "x1",
    "007",
]


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_compiled_features_equal_python_on_random_text(text: str) -> None:
    assert (
        features(BACKENDS["python"], text).tobytes() == features(BACKENDS["cython"], text).tobytes()
    )


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(VOCAB), max_size=60), st.sampled_from([" ", "", "  ", "\n"]))
def test_compiled_features_equal_python_on_keyword_soup(words: list[str], sep: str) -> None:
    text = sep.join(words)
    assert (
        features(BACKENDS["python"], text).tobytes() == features(BACKENDS["cython"], text).tobytes()
    )


@needs_compiled
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_hash_counts_and_token_hash_agree(text: str) -> None:
    py, c = BACKENDS["python"], BACKENDS["cython"]
    for dim in (512, 64):
        (pc, pn), (cc, cn) = py.hash_counts(text, dim), c.hash_counts(text, dim)
        assert np.array_equal(pc, cc)
        assert pn == cn >= np.abs(pc).sum()
    token = text.lower()
    assert py.token_hash(token) == c.token_hash(token)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> _impl.Backend:
    return BACKENDS[request.param]


def test_counts_tokens_sentences_and_questions(backend: _impl.Backend) -> None:
    v = features(backend, "Hello, world! How are you?")
    # Hello , world ! How are you ?
    assert scalar(v, "n_tokens") == 8
    assert scalar(v, "n_chars") == 26
    assert scalar(v, "n_sentences") == 2
    assert scalar(v, "n_questions") == 1
    assert scalar(v, "frac_punct") == 3 / 8
    assert scalar(v, "avg_chars_per_token") == 26 / 8
    assert scalar(v, "n_lines") == 1
    assert scalar(features(backend, "one.\ntwo\nthree"), "n_lines") == 3
    assert scalar(features(backend, "e.g. this... and that!!! Then? done"), "n_sentences") == 5


@pytest.mark.parametrize(
    ("text", "feature", "value"),
    [
        ("Answer in 3 sentences.", "limit_sentences", 3),
        ("Keep it under 100 words", "limit_words", 100),
        ("a 50-word summary", "limit_words", 50),
        ("Give me five tips for sleep", "limit_items", 5),
        ("Write two paragraphs", "limit_paragraphs", 2),
        ("list 10 bullet points", "limit_items", 10),
    ],
)
def test_length_constraints(backend: _impl.Backend, text: str, feature: str, value: int) -> None:
    v = features(backend, text)
    assert scalar(v, feature) == 1.0
    assert scalar(v, "limit_value") == value
    others = {"limit_words", "limit_sentences", "limit_paragraphs", "limit_items"} - {feature}
    assert all(scalar(v, o) == 0.0 for o in others)


@pytest.mark.parametrize(
    "text", ["I ate 3 apples", "words matter 3", "3 - - words", "in sentences"]
)
def test_numbers_without_a_unit_are_no_constraint(backend: _impl.Backend, text: str) -> None:
    v = features(backend, text)
    assert scalar(v, "limit_value") == 0
    assert scalar(v, "limit_words") == scalar(v, "limit_sentences") == 0


def test_task_and_style_indicators(backend: _impl.Backend) -> None:
    v = features(backend, "SUMMARIZE the report briefly, then write Python code")
    assert scalar(v, "task_summarize") == 1.0
    assert scalar(v, "task_code") == 1.0
    assert scalar(v, "task_creative") == 1.0
    assert scalar(v, "brevity") == 1.0
    assert scalar(v, "task_list") == 0.0
    assert scalar(v, "detail") == 0.0
    assert scalar(features(backend, "Explain in detail why"), "detail") == 1.0
    # Keywords match whole tokens only.
    assert scalar(features(backend, "summarized listing codes"), "task_summarize") == 0.0


def test_empty_prompt(backend: _impl.Backend) -> None:
    v = features(backend, "")
    assert np.array_equal(v[:K], 0.0 - OFFSET)
    assert not v[K:].any()


def test_hashed_part_is_normalised_by_token_count(backend: _impl.Backend) -> None:
    text = "Compare the rivers of Europe, and list three facts."
    once, twice = features(backend, text), features(backend, text + " " + text)
    assert np.array_equal(once[:K], twice[:K])
    assert scalar(twice, "n_tokens") == 2 * scalar(once, "n_tokens")
    assert not np.array_equal(once[:K], features(backend, "Write a poem about cats.")[:K])


def test_pipeline_fit_is_deterministic_and_centred() -> None:
    prompts = [f"Prompt {i}: explain topic {i % 7} and list {i % 5} facts." for i in range(60)]
    a = FeaturePipeline.fit(prompts)
    b = FeaturePipeline.fit(prompts)
    assert np.array_equal(a.components, b.components)
    assert np.array_equal(a.offset, b.offset)
    assert a.components.shape == (512, 16)
    x = a.transform_many(prompts)
    assert x.shape == (60, a.n_features)
    assert np.abs(x[:, :16].mean(axis=0)).max() < 1e-6
    assert len(a.names) == a.n_features
    assert np.array_equal(a.transform(prompts[3]), x[3])


def test_pipeline_rejects_bad_input() -> None:
    with pytest.raises(PredictorError, match="prompts need at least two"):
        FeaturePipeline.fit(["only one"])
    with pytest.raises(PredictorError, match=r"hash_dim must be a power of two.*\(got 500\)"):
        FeaturePipeline.fit(["a", "b"], hash_dim=500)
    with pytest.raises(PredictorError, match=r"prompts\[1\] must be a str"):
        FeaturePipeline.fit(["a", 3])  # type: ignore[list-item]
    pipe = FeaturePipeline.fit(["a b", "c d"], n_components=2)
    with pytest.raises(PredictorError, match=r"prompt must be a str \(got 'bytes'\)"):
        pipe.transform(b"bytes")  # type: ignore[arg-type]
