"""The plain-text fast path of byte-level BPE tokenizers (``bearsdk.prompts.pretok``).

Both twins must cut text exactly as the ``tokenizers`` library cuts it for each
family (GPT-2's, Llama 3's and Qwen2's expressions), give the library's ids,
decline (``None``) every text they are not exact on, and keep a bounded table.
The library itself is the oracle: tokenizers trained here on each family's
pre-tokenizer, texts generated so that contractions, digit runs, whitespace
runs before words and newlines (the expressions' backtracking) are hit often.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from bearsdk._twins import available
from bearsdk.prompts import _pretok_py
from bearsdk.prompts.pretok import (
    FastPath,
    _gpt2_byte_chars,
    family_of,
    fast_path,
    piece_bpe,
)
from bearsdk.prompts.template import ChatTemplate
from bearsdk.prompts.tokenizer import ChatTokenizer

FAMILIES = tuple(_pretok_py.FAMILIES)
TWINS: dict[str, Any] = {"python": _pretok_py}
if (_c := available("bearsdk.prompts._pretok_c")) is not None:
    TWINS["cython"] = _c

# Characters the expressions treat differently, with the contraction letters
# in both cases; the last ones are outside what the fast path accepts.
SAFE = (
    "aAbsStTrReEvVmMlLdDxZ 0123456789'''\t\n\r.,!?-_()<>\"#@~ \n   "
    "\xe9\xc9\xfc\xff\xc0\u2013\u2014\u2018\u2019\u201c\u201d\u2022\u2026"
)
UNSAFE = "\x0b\x0c\x00\x1f\x7f\x85\xa0\xd7\xf7\u20ac\u2028\u0301\u017f"
ENCODABLE_UNSAFE = UNSAFE  # what the library itself takes
UNSAFE += "\ud800"  # a lone surrogate: the library refuses it, the fast path declines it


def _pre_tokenizer(family: str) -> Any:
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    expr = _pretok_py.FAMILIES[family][0]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(expr), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _trained(family: str, seed: int = 0) -> Any:
    rng = random.Random(seed)
    words = ["the", "agent", "tool", "call", "def", "return", "I'm", "don't", "we'll", "x1"]
    corpus = [
        " ".join(rng.choice(words + list(SAFE)) for _ in range(rng.randint(3, 30)))
        for _ in range(800)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizers_by_family() -> dict[str, Any]:
    return {f: _trained(f) for f in FAMILIES}


_U2B = {c: b for b, c in _gpt2_byte_chars().items()}


def _library_pieces(family: str, text: str) -> list[str]:
    pieces = _pre_tokenizer(family).pre_tokenize_str(text)
    return [bytes(_U2B[c] for c in p).decode() for p, _ in pieces]


texts = st.text(alphabet=SAFE, max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=texts)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("twin", sorted(TWINS))
def test_pieces_are_the_librarys(twin: str, family: str, text: str) -> None:
    enc = TWINS[twin].PieceEncoder(family, lambda p: [])
    assert enc.pieces(text) == _library_pieces(family, text)


@settings(max_examples=200, deadline=None)
@given(text=texts)
@pytest.mark.parametrize("family", FAMILIES)
def test_ids_are_the_librarys_in_both_twins(
    tokenizers_by_family: dict[str, Any], family: str, text: str
) -> None:
    tok = tokenizers_by_family[family]
    want = tok.encode(text, add_special_tokens=False).ids
    assert fast_path(tok) is not None
    for twin in TWINS:
        enc = TWINS[twin].PieceEncoder(family, piece_bpe(tok.model), 7)
        # Twice: the second time from the table (7 pieces at most: it starts over).
        assert enc.encode(text) == want
        assert enc.encode(text) == want
        assert enc.kept <= 7


@settings(max_examples=200, deadline=None)
@given(
    head=texts,
    bad=st.text(alphabet=UNSAFE, min_size=1, max_size=3),
    tail=texts,
)
@pytest.mark.parametrize("twin", sorted(TWINS))
def test_text_it_is_not_exact_on_is_declined(twin: str, head: str, bad: str, tail: str) -> None:
    calls: list[str] = []
    enc = TWINS[twin].PieceEncoder("llama3", lambda p: calls.append(p) or [1])
    assert enc.pieces(head + bad + tail) is None
    assert enc.encode(head + bad + tail) is None
    assert calls == []


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_bad_arguments_are_named(twin: str) -> None:
    mod = TWINS[twin]
    with pytest.raises(ValueError, match=r"family must be one of .* \(got 'bert'\)"):
        mod.PieceEncoder("bert", lambda p: [])
    for bad in (0, -1, 1.5, 1 << 30):
        with pytest.raises(ValueError, match=rf"max_pieces must be an int in 1\.\.\d+ \(got {bad}"):
            mod.PieceEncoder("gpt2", lambda p: [], bad)
    enc = mod.PieceEncoder("gpt2", lambda p: [-1])
    with pytest.raises(TypeError, match=r"text must be a str \(got bytes\)"):
        enc.encode(b"abc")
    with pytest.raises(ValueError, match=r"token id must be in 0\.\.2147483647 \(got -1\)"):
        enc.encode("abc")


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_long_pieces_are_not_kept(twin: str) -> None:
    calls: list[str] = []
    enc = TWINS[twin].PieceEncoder("gpt2", lambda p: calls.append(p) or [len(p)], 100)
    long = "a" * (_pretok_py.MAX_PIECE_BYTES + 1)
    assert enc.encode(long + " b\n" + long) == [len(long), 2, 1, len(long)]
    assert enc.encode(" b\n") == [2, 1]
    assert calls == [long, " b", "\n", long]
    assert enc.kept == 2


def test_family_is_recognised_from_the_whole_configuration(
    tokenizers_by_family: dict[str, Any],
) -> None:
    import orjson

    for family, tok in tokenizers_by_family.items():
        config = orjson.loads(tok.to_str())
        assert family_of(config) == family
        for change in (
            {"normalizer": {"type": "Lowercase"}},
            {"truncation": {"max_length": 8}},
            {"padding": {"length": 8}},
            {"model": {**config["model"], "dropout": 0.1}},
            {"model": {**config["model"], "type": "WordPiece"}},
        ):
            assert family_of({**config, **change}) is None, change
        assert family_of({**config, "normalizer": {"type": "NFC"}}) == family
        for form in ("NFD", "NFKC", "NFKD"):  # they change accented letters or the ellipsis
            assert family_of({**config, "normalizer": {"type": form}}) is None
    llama = orjson.loads(tokenizers_by_family["llama3"].to_str())
    split = llama["pre_tokenizer"]["pretokenizers"][0]
    for change in (
        {"pattern": {"Regex": split["pattern"]["Regex"].replace("{1,3}", "{1,2}")}},
        {"behavior": "Removed"},
        {"invert": True},
    ):
        pre = {
            **llama["pre_tokenizer"],
            "pretokenizers": [{**split, **change}, llama["pre_tokenizer"]["pretokenizers"][1]],
        }
        assert family_of({**llama, "pre_tokenizer": pre}) is None, change
    gpt2 = orjson.loads(tokenizers_by_family["gpt2"].to_str())
    assert (
        family_of({**gpt2, "pre_tokenizer": {**gpt2["pre_tokenizer"], "add_prefix_space": True}})
        is None
    )


def test_a_test_double_gets_no_fast_path() -> None:
    assert fast_path(object()) is None


@pytest.fixture(scope="module")
def chat_tokenizers() -> dict[str, Any]:
    out = {f: _trained(f, seed=1) for f in FAMILIES}
    for tok in out.values():
        tok.add_tokens(["<tool>"])  # an added token that is not special
    return out


_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@settings(max_examples=60, deadline=None)
@given(
    contents=st.lists(
        st.text(alphabet=SAFE + "é€\x0b", max_size=30)
        | st.sampled_from(["see <tool> here", "a <|im_end|> b", "plain words only"]),
        min_size=1,
        max_size=5,
    )
)
@pytest.mark.parametrize("family", FAMILIES)
def test_chat_ids_with_the_fast_path_are_the_librarys(
    chat_tokenizers: dict[str, Any], family: str, contents: list[str]
) -> None:
    tok = chat_tokenizers[family]
    specials = frozenset(tok.token_to_id(s) for s in ("<|im_start|>", "<|im_end|>"))
    template = ChatTemplate.from_string(_CHATML)
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)
    ]
    want = tok.encode(template.render(msgs), add_special_tokens=False).ids
    for cache in (0, 10_000):
        fast = ChatTokenizer(tok, template, specials, cache)
        assert isinstance(fast._fast, FastPath)
        assert "<tool>" in fast._fast.added
        slow = ChatTokenizer(tok, template, specials, cache, fast_pieces=0)
        assert slow._fast is None
        assert fast.encode_chat(msgs).ids == want
        assert slow.encode_chat(msgs).ids == want
        assert fast.encode_chat(msgs).ids == want


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(
        st.text(alphabet=SAFE, max_size=12)
        | st.text(alphabet=ENCODABLE_UNSAFE + " a", min_size=1, max_size=3),
        max_size=6,
    )
)
@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_stretch_it_is_not_exact_on_goes_to_the_library(
    tokenizers_by_family: dict[str, Any], family: str, parts: list[str]
) -> None:
    tok = tokenizers_by_family[family]
    text = "".join(parts)
    want = tok.encode(text, add_special_tokens=False).ids
    fp = fast_path(tok)
    assert fp is not None
    head, middle, tail = fp.cut(text)
    assert (
        head + (tok.encode(middle, add_special_tokens=False).ids if middle else []) + tail == want
    )
    if fp.encoder.pieces(text) is not None:
        assert middle == ""
    elif middle:
        # The middle holds every character the fast path declines, and no more
        # than the stretch between the spaces around them.
        assert fp.encoder.pieces(text.replace(middle, "", 1)) is not None
        assert middle == text or middle[0] == " " or text.startswith(middle)


def test_a_bad_table_size_is_named(tokenizers_by_family: dict[str, Any]) -> None:
    from bearsdk.prompts.tokenizer import TokenizerError

    tok = tokenizers_by_family["gpt2"]
    for bad in (-1, 1.5, "x", 1 << 30):
        with pytest.raises(TokenizerError, match=r"fast_pieces must be an int in 0\.\.\d+ \(got "):
            ChatTokenizer(tok, None, frozenset(), 0, fast_pieces=bad)  # type: ignore[arg-type]
