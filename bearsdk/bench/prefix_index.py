"""``bearsdk bench prefix-index``: what knowing the cache costs per request.

The router's cost of prefix-aware routing, per request: tokenize the prompt as
the engines do (:class:`~bearsdk.prompts.tokenizer.ChatTokenizer`), hash it into
its block chain (:func:`~bearsdk.kvevents.index.chain_keys`) and look the chain
up in every instance's prefix index (:class:`~bearsdk.kvevents.index.PrefixIndex`).
Measured on an ~8k-token chat prompt against 8 instances whose indexes each hold
``--blocks`` blocks (some of the prompt's prefix among them, a different share
on each), four ways:

* ``tokenize+hash+lookup``: a new conversation, tokenized in full: with the
  plain-text fast path (:mod:`bearsdk.prompts.pretok`) whose piece table
  earlier prompts filled (the steady state), with that table empty, and with
  the ``tokenizers`` library alone;
* ``next turn``: the conversation's next turn, the previous turn's ids reused;
* ``hash+lookup``: the caller gave the ids (``prompt_token_ids``);
* ``lookup``: the chain already hashed.

The last two run with both twins (compiled and pure Python). Memory is each
index's own accounting per cached block. ``--tokenizer DIR`` takes a model
directory (``tokenizer.json`` and chat template); the default is a byte-level
BPE trained here with the ``tokenizers`` library on generated text, with a
ChatML template (real tokenizer code, a small vocabulary).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from bearsdk.bench import time_call
from bearsdk.cli import positive_int

__all__ = ["register", "run"]

_TEXT = (
    "the of and to in is that for it as was with be by on not this are or from at which "
    "but have an they you were there been one all we their has would when if so no will "
    "can more about def return self import class print value error file list agent tool "
    "call result search query answer please find fix bug test code python function args"
)
_WORDS = tuple(_TEXT.split())

_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _trained_tokenizer(seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from bearsdk.prompts.template import ChatTemplate
    from bearsdk.prompts.tokenizer import ChatTokenizer

    rng = random.Random(seed)
    corpus = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 40))) + rng.choice(".?\n")
        for _ in range(5000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    ids = frozenset(i for s in specials if (i := tok.token_to_id(s)) is not None)
    template = ChatTemplate.from_string(_CHATML)
    return lambda cache, fast=True: ChatTokenizer(
        tok, template, ids, cache, fast_pieces=fast_max(fast)
    )


def fast_max(fast: bool) -> int:
    """``fast_pieces`` for a benchmark tokenizer with or without the fast path."""
    from bearsdk.prompts.pretok import DEFAULT_MAX_PIECES

    return DEFAULT_MAX_PIECES if fast else 0


def _conversation(tok: Any, tokens: int, rng: random.Random) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a coding agent."}]
    while True:
        text = " ".join(rng.choice(_WORDS) for _ in range(400))
        msgs.append({"role": "user" if len(msgs) % 2 else "assistant", "content": text})
        if len(tok(0).encode_chat(msgs)) >= tokens:
            return msgs


def run(
    tokenizer: str | None = None,
    tokens: int = 8192,
    instances: int = 8,
    blocks: int = 50_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Time the four ways (module docstring); return medians and p99s in microseconds."""
    from bearsdk._twins import available
    from bearsdk.kvevents import _index_py
    from bearsdk.kvevents.index import IMPLEMENTATION

    rng = random.Random(seed)
    if tokenizer is None:
        make = _trained_tokenizer(seed)
        source = "byte-level BPE, 8k vocabulary, trained here"
    else:
        from bearsdk.prompts.tokenizer import load_chat_tokenizer

        path = Path(tokenizer)
        load_chat_tokenizer(path)  # fail early, with the file named

        def make(cache: int, fast: bool = True) -> Any:
            return load_chat_tokenizer(path, cache_tokens=cache, fast_pieces=fast_max(fast))

        source = str(path.name)
    msgs = _conversation(make, tokens, rng)
    full = make(0)
    prompt = full.encode_chat(msgs)
    bs = 16
    keys = prompt.chain(bs)
    compiled = available("bearsdk.kvevents._index_c")
    impls: dict[str, Any] = {"python": _index_py}
    if compiled is not None:
        impls["cython"] = compiled

    def fill(mod: Any) -> list[Any]:
        out = []
        r = random.Random(seed + 1)
        for i in range(instances):
            idx = mod.PrefixCore(bs, 1 << 30)
            share = keys[: len(keys) * i // max(1, instances - 1)]
            idx.stored([r.randrange(1 << 62) for _ in share], share)
            idx.stored(
                [r.randrange(1 << 62) for _ in range(blocks - len(share))],
                [r.randrange(1 << 63) for _ in range(blocks - len(share))],
            )
            out.append(idx)
        return out

    indexes = {name: fill(mod) for name, mod in impls.items()}
    selected = indexes["cython" if IMPLEMENTATION == "cython" else "python"]
    hits = [ix.hit_blocks(keys) for ix in selected]

    def lookup_all(ixs: list[Any], chain: list[int]) -> int:
        return sum(ix.hit_blocks(chain) for ix in ixs)

    def fresh(tok: Any = full) -> None:
        lookup_all(selected, tok.encode_chat(msgs).chain(bs))

    library = make(0, False)
    fast = full._fast
    cold_pieces = 0
    if fast is not None:
        from bearsdk.prompts.pretok import piece_bpe

        bpe = piece_bpe(full.tokenizer.model)
        warm = fast.encoder

        def fresh_cold() -> None:
            # An empty piece table: every piece of the prompt is new to it.
            fast.encoder = type(warm)(warm.family, bpe, warm.max_pieces)
            fresh()

        fresh_cold()
        cold_pieces = fast.encoder.kept

    session = make(4_000_000)
    prev = msgs[:-1]
    session.encode_chat(prev)

    def next_turn() -> None:
        lookup_all(selected, session.encode_chat(msgs).chain(bs))

    report: dict[str, Any] = {
        "tokenizer": source,
        "prompt_tokens": len(prompt),
        "blocks_per_index": blocks,
        "instances": instances,
        "hit_blocks": hits,
        "implementation": IMPLEMENTATION,
        "fast_path": None if fast is None else fast.family,
        "tokenize_hash_lookup_us": time_call(fresh, batch=5, rounds=100, warmup=2).as_dict(),
        "tokenize_hash_lookup_cold_us": None
        if fast is None
        else time_call(fresh_cold, batch=5, rounds=100, warmup=2).as_dict(),
        "distinct_pieces": cold_pieces,
        "tokenize_hash_lookup_library_us": time_call(
            lambda: fresh(library), batch=5, rounds=40, warmup=1
        ).as_dict(),
        "next_turn_us": time_call(next_turn, batch=5, rounds=100, warmup=2).as_dict(),
        "hash_lookup_us": {},
        "lookup_us": {},
        "bytes_per_block": {},
    }
    ids = prompt.ids
    for name, mod in impls.items():
        ixs = indexes[name]

        def hashed(ixs: list[Any] = ixs, chain: Any = mod.chain_keys) -> None:
            lookup_all(ixs, chain(ids, bs))

        def looked_up(ixs: list[Any] = ixs) -> None:
            lookup_all(ixs, keys)

        report["hash_lookup_us"][name] = time_call(hashed, batch=10, rounds=100).as_dict()
        report["lookup_us"][name] = time_call(looked_up, batch=20, rounds=100).as_dict()
        report["bytes_per_block"][name] = round(
            statistics.fmean(ix.memory_bytes / ix.blocks for ix in ixs), 1
        )
    return report


async def _approximate(sessions: int, turns: int, seed: int) -> dict[str, Any]:
    import anyio

    from bearsdk.emulator import EngineConfig, EnginePool
    from bearsdk.router import AsyncRouter, InstanceConfig
    from bearsdk.selectors import BEAR

    # A pool small enough that sessions evict each other's blocks.
    params = {"enable_prefix_caching": True, "num_gpu_blocks": 3000, "max_model_len": 16384}
    cfgs = [
        EngineConfig(
            profile="qwen3-8b-h100",
            params=params,
            instance=f"e{i}",
            seed=seed + i,
            enable_prompt_tokens_details=True,
        )
        for i in range(2)
    ]
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(_WORDS) for _ in range(600)) for _ in range(3)]
    rows: list[tuple[int, int, int]] = []
    async with EnginePool(cfgs) as pool:
        confs = [
            InstanceConfig(name=e.instance, url=e.url, model=e.model_name, profile=e.config.profile)
            for e in pool
        ]
        async with AsyncRouter(confs, BEAR(), dispatch_prefixes=True) as router:

            async def session(k: int) -> None:
                r = random.Random(seed * 1000 + k)
                msgs = [{"role": "system", "content": systems[k % len(systems)]}]
                await anyio.sleep(r.uniform(0, 1.0))
                for _ in range(turns):
                    words = " ".join(r.choice(_WORDS) for _ in range(r.randint(50, 400)))
                    msgs.append({"role": "user", "content": words})
                    resp = await router.chat(msgs, max_tokens=r.randint(20, 120), ttft_target=5.0)
                    c = resp.decision.candidates[resp.decision.index]
                    usage = resp["usage"]
                    true = usage["prompt_tokens_details"]["cached_tokens"]
                    if c.cache_source == "dispatches":
                        rows.append((c.cached_tokens, true, usage["prompt_tokens"]))
                    msgs.append(
                        {"role": "assistant", "content": resp["choices"][0]["message"]["content"]}
                    )
                    await anyio.sleep(r.expovariate(2.0))

            async with anyio.create_task_group() as tg:
                for k in range(sessions):
                    tg.start_soon(session, k)
    err = sorted(abs(a - t) for a, t, _ in rows)
    return {
        "requests": len(rows),
        "median_abs_error_tokens": statistics.median(err) if err else None,
        "p90_abs_error_tokens": err[int(0.9 * (len(err) - 1))] if err else None,
        "mean_abs_error_pct_of_prompt": round(
            100 * statistics.fmean(abs(a - t) / p for a, t, p in rows), 2
        )
        if rows
        else None,
        "true_cached_pct_of_prompt": round(100 * statistics.fmean(t / p for _, t, p in rows), 2)
        if rows
        else None,
        "hit_or_miss_agree_pct": round(
            100 * statistics.fmean((a > 0) == (t > 0) for a, t, _ in rows), 1
        )
        if rows
        else None,
    }


def approximate(sessions: int = 12, turns: int = 5, seed: int = 0) -> dict[str, Any]:
    """How close the router's dispatch-based estimate of each request's cached
    prefix comes to the engine's own count (``usage.prompt_tokens_details``).

    Multi-turn sessions over three shared system prompts run through
    :class:`~bearsdk.AsyncRouter` (``dispatch_prefixes=True``, no tokenizer, no
    KV events) against two emulated prefix-caching engines with a pool small
    enough to evict; for each request, the chosen candidate's estimate is set
    against the tokens the engine found cached.
    """
    import anyio

    return anyio.run(_approximate, sessions, turns, seed)


def _main(args: argparse.Namespace) -> int:
    if args.approximate:
        a = approximate(seed=args.seed)
        if args.json:
            print(json.dumps(a, indent=2))
            return 0
        print(
            f"approximate cached prefix (the router's own dispatches, character blocks) against "
            f"the engines' counts, {a['requests']} requests: median |error| "
            f"{a['median_abs_error_tokens']} tokens, p90 {a['p90_abs_error_tokens']}, "
            f"mean {a['mean_abs_error_pct_of_prompt']} % of the prompt (truly cached: "
            f"{a['true_cached_pct_of_prompt']} %); hit/miss agree on {a['hit_or_miss_agree_pct']} %"
        )
        return 0
    from bearsdk.prompts.pretok import IMPLEMENTATION as PRETOK

    r = run(args.tokenizer, args.tokens, args.instances, args.blocks, args.seed)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"prefix-aware routing cost per request: a {r['prompt_tokens']}-token chat prompt, "
        f"{r['instances']} instances x {r['blocks_per_index']} cached blocks, "
        f"tokenizer: {r['tokenizer']}, index: {r['implementation']}, fast path: "
        f"{'none (not a family it is exact for)' if r['fast_path'] is None else r['fast_path']}"
        f" ({PRETOK})"
    )

    def line(label: str, t: dict[str, float]) -> None:
        print(f"  {label:34s} p50 {t['median_us']:9.1f} us   p99 {t['p99_us']:9.1f} us")

    fp = r["fast_path"]
    line(
        f"tokenize + hash + look up{'' if fp is None else ' (fast path)'}",
        r["tokenize_hash_lookup_us"],
    )
    if fp is not None:
        line(
            f"  ... piece table empty ({r['distinct_pieces']} pieces)",
            r["tokenize_hash_lookup_cold_us"],
        )
    line("  ... tokenizers library alone", r["tokenize_hash_lookup_library_us"])
    line("next turn (previous turn reused)", r["next_turn_us"])
    for name in r["hash_lookup_us"]:
        line(f"hash + look up ({name})", r["hash_lookup_us"][name])
    for name in r["lookup_us"]:
        line(f"look up only ({name})", r["lookup_us"][name])
    mem = ", ".join(f"{k} {v} B" for k, v in r["bytes_per_block"].items())
    print(f"  index memory per cached block: {mem}")
    sys.stdout.flush()
    return 0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``prefix-index`` benchmark."""
    p = bsub.add_parser(
        "prefix-index",
        help="cost of tokenizing, hashing and looking up a prompt in every instance's index",
    )
    p.add_argument("--tokenizer", default=None, help="model directory (default: one trained here)")
    p.add_argument("--tokens", type=positive_int, default=8192, help="prompt tokens (at least)")
    p.add_argument("--instances", type=positive_int, default=8, help="instances")
    p.add_argument("--blocks", type=positive_int, default=50_000, help="cached blocks per index")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--json", action="store_true", help="JSON report")
    p.add_argument(
        "--approximate",
        action="store_true",
        help="instead: the dispatch-based estimate's error against emulated engines",
    )
    p.set_defaults(func=_main)
