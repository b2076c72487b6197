"""A small real Hugging Face tokenizer directory for the prompt tests.

A byte-level BPE trained here with the ``tokenizers`` library on generated
text, ChatML special tokens, and a Qwen-style chat template in
``tokenizer_config.json``: the files and formats a model repository ships,
without downloading one (no network in CI).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}"
    "{%- if message.role not in ['user', 'assistant', 'system', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message.role) }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "about",
    "def",
    "return",
    "self",
    "import",
    "class",
    "print",
    "value",
    "error",
    "file",
    "list",
    "agent",
    "tool",
    "call",
    "result",
    "search",
    "query",
    "answer",
    "please",
    "find",
    "fix",
    "bug",
    "test",
    "code",
    "python",
]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!\n", ":\n  ", ""]))
    return out


def make_model_dir(path: Path, *, vocab_size: int = 2000) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(3000), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "chat_template": CHATML,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 32768,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
