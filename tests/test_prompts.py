"""Prompts tokenized as vLLM tokenizes them (issue 16, item 1).

``tests/data/chat_ids_vllm.jsonl.gz`` holds the ids vLLM 0.33 computed
(``tests/oracle/chat_ids_vllm.py``: vLLM's tokenizer loader and chat-template
path) for generated multi-turn sessions over ``tests/data/chatml-bpe``, a real
``tokenizer.json`` with a chat template; the router's tokenizer must give the
same ids turn after turn, tokenizing only the segments (texts between special
tokens) it has not seen.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from bearsdk.emulator.chat_tokenizer import stand_in_chat_tokenizer
from bearsdk.emulator.text import Tokenizer
from bearsdk.prompts.template import ChatTemplate, ChatTemplateError
from bearsdk.prompts.tokenizer import (
    ChatTokenizer,
    TokenizerError,
    load_chat_tokenizer,
)
from bearsdk.replay.blocks import chain_keys

DATA = Path(__file__).resolve().parent / "data"
MODEL = DATA / "chatml-bpe"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cases() -> list[dict[str, Any]]:
    with gzip.open(DATA / "chat_ids_vllm.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_chat_and_completion_ids_are_vllms_turn_after_turn() -> None:
    tok = load_chat_tokenizer(MODEL)
    assert tok.split_at_specials
    turns = 0
    for case in _cases():
        for msgs, want in zip(case["turns"], case["ids"], strict=True):
            got = tok.encode_chat(msgs)
            assert got.ids == want, (case["session"], len(msgs))
            assert got.chain(16) == tuple(chain_keys(want, 16))
            turns += 1
        assert tok.encode_prompt(case["prompt"]).ids == case["prompt_ids"]
    assert turns > 800
    # Later turns went on from their predecessors' ids instead of starting over.
    assert tok.reused > tok.tokenized * 0.5


def test_a_next_turn_and_a_shared_system_prompt_tokenize_only_what_is_new() -> None:
    tok = load_chat_tokenizer(MODEL)
    system = {"role": "system", "content": "you are an agent who fixes code " * 40}
    msgs: list[dict[str, Any]] = [system, {"role": "user", "content": "find the bug"}]
    first = tok.encode_chat(msgs)
    before = tok.tokenized
    msgs += [{"role": "assistant", "content": "the bug is in file " * 9}]
    msgs += [{"role": "user", "content": "fix it"}]
    second = tok.encode_chat(msgs)
    # Only the two new messages were tokenized; the rest came from the cache.
    new = tok.tokenized - before
    assert 0 < new < 60
    assert second.reused + new + second.ids.count(1) + second.ids.count(2) == len(second)
    assert second.ids[: len(first) - 3] == first.ids[: len(first) - 3]
    want = tok.tokenizer.encode(tok.template.render(msgs), add_special_tokens=False).ids
    assert second.ids == want
    # Another session behind the same system prompt: its tokens are not tokenized again.
    before = tok.tokenized
    other = tok.encode_chat([system, {"role": "user", "content": "write a test"}])
    assert tok.tokenized - before <= 10  # "user\nwrite a test"
    assert other.reused > 300


def test_an_edited_history_is_tokenized_again_where_it_changed() -> None:
    tok = load_chat_tokenizer(MODEL)
    msgs = [{"role": "user", "content": "one two three " * 20}]
    tok.encode_chat(msgs)
    edited = [{"role": "user", "content": "one two four " * 20}, {"role": "user", "content": "x"}]
    got = tok.encode_chat(edited)
    assert got.reused < 12  # the separator and the assistant header
    want = tok.tokenizer.encode(tok.template.render(edited), add_special_tokens=False).ids
    assert got.ids == want


def test_the_segment_cache_is_bounded() -> None:
    tok = load_chat_tokenizer(MODEL, cache_tokens=2_000)
    rng = random.Random(0)
    for s in range(50):
        words = " ".join(rng.choice(["agent", "tool", "call", "the"]) for _ in range(200))
        tok.encode_chat([{"role": "user", "content": f"{s} {words}"}])
        assert tok._held <= 2_000
    assert 0 < len(tok._segments) < 50


def test_a_tokenizer_that_merges_across_special_tokens_never_reuses_segments() -> None:
    from hf_model_dir import SPECIALS, corpus
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    # SentencePiece-style (Llama 2, Mistral): a space marker prepended to the
    # first segment only, so a text's tail tokenized alone is not its tokens
    # in the whole.
    hf = HfTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", *SPECIALS], show_progress=False
    )
    hf.train_from_iterator(corpus(500), trainer)
    specials = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
    odd = ChatTokenizer(hf, load_chat_tokenizer(MODEL).template, specials)
    assert not odd.split_at_specials
    msgs = [{"role": "user", "content": "a b c"}]
    odd.encode_chat(msgs)
    assert odd.encode_chat([*msgs, {"role": "user", "content": "d"}]).reused == 0


def test_template_renders_as_transformers_does() -> None:
    t = ChatTemplate.from_string(
        "{% for m in messages %}{{ m.content | tojson }}{% if not loop.last %},{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}",
        {"eos_token": "<E>"},
    )
    # tojson without HTML escaping (transformers' filter), loop controls, special tokens.
    assert t.render([{"role": "user", "content": "<b>é</b>"}]) == '"<b>é</b>"<E>'
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert t.render([{"role": "user", "content": parts}], add_generation_prompt=False) == '"a\\nb"'


def test_developer_messages_become_one_system_message_as_vllm_does() -> None:
    t = ChatTemplate.from_string(
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    )
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "developer", "content": "D"},
    ]
    assert t.render(msgs) == "[system:S\n\nD][user:U]"
    knows = ChatTemplate.from_string("{% if m == 'developer' %}{% endif %}{{ messages[0].role }}")
    assert knows.render([{"role": "developer", "content": "D"}]) == "developer"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "robot", "content": "x"}], "unknown role robot"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\].content\[0\]"),
        (["not a message"], r"messages\[0\] must be an object"),
    ],
)
def test_messages_a_template_refuses_raise_a_named_error(messages: Any, match: str) -> None:
    tok = load_chat_tokenizer(MODEL)
    with pytest.raises(ChatTemplateError, match=match):
        tok.encode_chat(messages)


def test_broken_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot be loaded"):
        load_chat_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((MODEL / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: must be an object"):
        load_chat_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}')
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_tokenizer(tmp_path)
    # Named templates: vLLM takes "default"; chat_template.jinja wins over the config.
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "tool_use", "template": "T"}, '
        '{"name": "default", "template": "D"}], "eos_token": {"content": "<|im_end|>"}}'
    )
    tok = load_chat_tokenizer(tmp_path)
    assert tok.template is not None
    assert tok.template.render([]) == "D"
    assert tok.template.special_tokens == {"eos_token": "<|im_end|>"}
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_tokenizer(tmp_path).template.render([]) == "J"  # type: ignore[union-attr]
    # A bare tokenizer.json: completions only.
    bare = load_chat_tokenizer(tmp_path / "tokenizer.json")
    assert bare.template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.encode_chat([{"role": "user", "content": "x"}])


def test_the_emulators_tokenizer_as_the_router_loads_it_gives_the_engines_ids() -> None:
    engine = Tokenizer()
    tok = stand_in_chat_tokenizer(engine)
    assert tok.split_at_specials
    rng = random.Random(3)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 30}]
    for turn in range(6):
        msgs.append(
            {"role": "user", "content": f"step {turn}: " + "look at x.py " * rng.randint(1, 40)}
        )
        got = tok.encode_chat(msgs)
        assert got.ids == engine.encode_chat(engine.render_chat(msgs))
        assert (got.reused > 0) == (turn > 0)
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": "ok"}] * 2})
    assert tok.encode_prompt("plain <|im_end|> text").ids == engine.encode("plain <|im_end|> text")
