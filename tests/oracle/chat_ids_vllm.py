#!/usr/bin/env python3
"""Token ids of chat requests as vLLM 0.33 computes them, for the router's tokenizer to match.

Run with the vllm-oracle's environment (it has vLLM 0.33 and the transformers
it pins): loads ``tests/data/chatml-bpe`` (a real ``tokenizer.json`` and
``tokenizer_config.json`` with a chat template) through vLLM's own tokenizer
loader, renders generated conversations with vLLM's ``safe_apply_chat_template``
path (transformers' ``apply_chat_template``, developer-role conversion
included) and tokenizes them without added special tokens, as vLLM's chat
endpoint does; completion prompts with them. Writes one JSON line per case:

    python tests/oracle/chat_ids_vllm.py OUT.jsonl.gz [--cases 300]

``tests/test_prompts.py`` checks :class:`bearsdk.prompts.tokenizer.ChatTokenizer`
against the committed sample (``tests/data/chat_ids_vllm.jsonl.gz``), turn after
turn of each session (so that reusing a turn's ids is checked too).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "data" / "chatml-bpe"
sys.path.insert(0, str(HERE.parent))

from hf_model_dir import WORDS  # noqa: E402


def _text(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 60))]
    extra = ["\n", "\n\n", "  ", "é", "—", "<b>&</b>", '{"k": 1}', "\t", "42", "<|im_end|>"]
    for _ in range(rng.randint(0, 4)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(extra))
    return " ".join(words)


def sessions(n: int, seed: int) -> list[list[dict]]:
    """Per session: its turns, each the whole conversation up to a user message."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs: list[dict] = []
        if rng.random() < 0.7:
            msgs.append({"role": "system", "content": _text(rng)})
        turns = []
        for _ in range(rng.randint(1, 5)):
            content: object = _text(rng)
            if rng.random() < 0.2:
                content = [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
            role = "developer" if rng.random() < 0.05 else "user"
            msgs.append({"role": role, "content": content})
            turns.append([dict(m) for m in msgs])
            msgs.append({"role": "assistant", "content": _text(rng)})
        out.append(turns)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(MODEL))

    class _Config:
        # What safe_apply_chat_template reads of a ModelConfig for a text model.
        def __getattr__(self, name: str) -> object:
            return None

    rows = 0
    with gzip.open(args.out, "wt") as f:
        for s, turns in enumerate(sessions(args.cases, args.seed)):
            ids = []
            for msgs in turns:
                conv = []
                for m in msgs:
                    c = m["content"]
                    if isinstance(c, list):  # vLLM's string content format
                        c = "\n".join(p["text"] for p in c)
                    conv.append({"role": m["role"], "content": c})
                text = safe_apply_chat_template(
                    _Config(), tok, conv, tokenize=False, add_generation_prompt=True
                )
                ids.append(tok.encode(text, add_special_tokens=False))
            prompt = _text(random.Random(s))
            f.write(
                json.dumps(
                    {
                        "session": s,
                        "turns": turns,
                        "ids": ids,
                        "prompt": prompt,
                        "prompt_ids": tok.encode(prompt, add_special_tokens=True),
                    }
                )
                + "\n"
            )
            rows += 1
    print(f"{rows} sessions written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
