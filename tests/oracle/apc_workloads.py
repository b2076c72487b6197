"""Seeded token-id workloads for checking prefix caching against vLLM's scheduler.

Pure Python (no vllm import), so the same workloads can be built on either side
of the differential harness. Every generator returns a list of request dicts:

``id``
    Request id (unique within the workload).
``arrival_step``
    Engine step (count of non-empty batches) at which the request is added, or
    ``None`` when it depends on another request.
``after`` / ``think_steps``
    For a dependent request: the id of the request whose finish releases it,
    and how many steps after that finish it arrives (the driver resolves it to
    ``finish_step + 1 + think_steps``).
``prompt``
    Prompt token ids (shared prefixes are literally shared ids).
``output_ids``
    The tokens the fake model samples, in order; a multi-turn session's next
    prompt contains them, so the driver must emit exactly these.
``output_len``
    ``len(output_ids)``.

Token ids stay inside the tiny oracle model's vocabulary (``[10, 1000)``) and
avoid the dummy id 7 and the special ids 0-2.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

LOW, HIGH = 10, 1000
MOONCAKE_BLOCK = 512  # tokens behind one Mooncake hash id


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


def _req(
    rid: str,
    prompt: list[int],
    output_ids: list[int],
    arrival_step: int | None = None,
    after: str | None = None,
    think_steps: int = 0,
) -> dict[str, Any]:
    return {
        "id": rid,
        "arrival_step": arrival_step,
        "after": after,
        "think_steps": think_steps,
        "prompt": prompt,
        "output_ids": output_ids,
        "output_len": len(output_ids),
    }


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def agent_sessions(
    seed: int = 0,
    num_sessions: int = 4,
    turns: tuple[int, int] = (2, 5),
    first_prompt: tuple[int, int] = (64, 400),
    user_text: tuple[int, int] = (8, 120),
    output_len: tuple[int, int] = (2, 40),
    think_steps: tuple[int, int] = (0, 6),
    arrival_spread: int = 20,
    max_prompt: int = 3000,
) -> list[dict[str, Any]]:
    """Multi-turn agent sessions that resend the whole conversation.

    Turn k+1's prompt is turn k's prompt, then turn k's output tokens, then new
    user text; it arrives ``think_steps`` steps after turn k finishes. A
    session stops early once its prompt would exceed ``max_prompt``.

    Args:
        seed: RNG seed; equal seeds give equal workloads.
        num_sessions: Number of independent sessions.
        turns: Inclusive range of turns per session.
        first_prompt: Inclusive range of the first prompt's length.
        user_text: Inclusive range of each later turn's new user tokens.
        output_len: Inclusive range of tokens generated per turn.
        think_steps: Inclusive range of steps between a finish and the next turn.
        arrival_spread: First turns arrive uniformly in ``[0, arrival_spread]``.
        max_prompt: Cap on a turn's prompt length.

    Returns:
        The request dicts (first turns have an ``arrival_step``).
    """
    rng = random.Random(f"agent-{seed}")
    reqs = []
    for s in range(num_sessions):
        prompt = _tokens(rng, rng.randint(*first_prompt))
        prev = None
        for t in range(rng.randint(*turns)):
            if prev is not None:
                extra = prev["output_ids"] + _tokens(rng, rng.randint(*user_text))
                if len(prev["prompt"]) + len(extra) > max_prompt:
                    break
                prompt = prev["prompt"] + extra
            out = _tokens(rng, rng.randint(*output_len))
            rid = f"s{s}t{t}"
            if prev is None:
                r = _req(rid, prompt, out, arrival_step=rng.randint(0, arrival_spread))
            else:
                r = _req(rid, prompt, out, after=prev["id"], think_steps=rng.randint(*think_steps))
            reqs.append(r)
            prev = r
    return reqs


def shared_system_prompts(
    seed: int = 0,
    num_system: int = 3,
    system_len: tuple[int, int] = (300, 1500),
    num_requests: int = 40,
    zipf_s: float = 1.2,
    user_len: tuple[int, int] = (5, 200),
    output_len: tuple[int, int] = (1, 30),
    steps: int = 60,
) -> list[dict[str, Any]]:
    """A few long system prompts in front of many users' messages.

    Which system prompt a request uses is Zipf-distributed, so one prompt is
    hot and the others are evicted and refilled under KV pressure.

    Args:
        seed: RNG seed.
        num_system: Number of distinct system prompts.
        system_len: Inclusive range of a system prompt's length.
        num_requests: Number of requests.
        zipf_s: Zipf exponent of system-prompt popularity.
        user_len: Inclusive range of the per-user suffix length.
        output_len: Inclusive range of generated tokens.
        steps: Arrivals are uniform over ``[0, steps]``.

    Returns:
        The request dicts, sorted by arrival step.
    """
    rng = random.Random(f"system-{seed}")
    systems = [_tokens(rng, rng.randint(*system_len)) for _ in range(num_system)]
    weights = _zipf_weights(num_system, zipf_s)
    reqs = []
    for i in range(num_requests):
        sysp = rng.choices(systems, weights)[0]
        prompt = sysp + _tokens(rng, rng.randint(*user_len))
        out = _tokens(rng, rng.randint(*output_len))
        reqs.append(_req(f"u{i}", prompt, out, arrival_step=rng.randint(0, steps)))
    reqs.sort(key=lambda r: r["arrival_step"])
    return reqs


def few_shot_bursts(
    seed: int = 0,
    num_bursts: int = 3,
    burst_size: tuple[int, int] = (4, 12),
    num_shots: int = 4,
    shot_len: tuple[int, int] = (40, 200),
    question_len: tuple[int, int] = (5, 60),
    output_len: tuple[int, int] = (1, 16),
    burst_gap: int = 25,
) -> list[dict[str, Any]]:
    """Bursts of requests arriving together that share a few-shot prefix.

    Each burst draws its shots from a common pool, so bursts share some but
    not all of their prefix (the shot order matters for the hash chain).

    Args:
        seed: RNG seed.
        num_bursts: Number of bursts.
        burst_size: Inclusive range of requests per burst.
        num_shots: Shots in each burst's prefix.
        shot_len: Inclusive range of a shot's length.
        question_len: Inclusive range of each request's own question.
        output_len: Inclusive range of generated tokens.
        burst_gap: Steps between burst starts.

    Returns:
        The request dicts, burst by burst.
    """
    rng = random.Random(f"fewshot-{seed}")
    pool = [_tokens(rng, rng.randint(*shot_len)) for _ in range(num_shots * 2)]
    reqs = []
    for b in range(num_bursts):
        # Keep the first shot fixed so every burst shares at least one block.
        shots = [pool[0], *rng.sample(pool[1:], num_shots - 1)]
        prefix = [t for shot in shots for t in shot]
        start = b * burst_gap
        for j in range(rng.randint(*burst_size)):
            prompt = prefix + _tokens(rng, rng.randint(*question_len))
            out = _tokens(rng, rng.randint(*output_len))
            reqs.append(_req(f"b{b}q{j}", prompt, out, arrival_step=start + rng.randint(0, 1)))
    return reqs


def mooncake_hash_block(hash_id: int, tokens_per_hash: int, seed: int = 0) -> list[int]:
    """The token ids that stand for one Mooncake hash id.

    Args:
        hash_id: The trace's block hash id.
        tokens_per_hash: Tokens per hash id after scaling down from 512.
        seed: Mixes into every block so different seeds give disjoint ids.

    Returns:
        A fixed list of ``tokens_per_hash`` token ids.
    """
    return _tokens(random.Random(f"mooncake-{seed}-{hash_id}"), tokens_per_hash)


def mooncake(
    trace: str | Path,
    seed: int = 0,
    start: int = 0,
    num_requests: int = 60,
    tokens_per_hash: int = 32,
    ms_per_step: float = 200.0,
    output_scale: float = 0.05,
    max_output: int = 40,
    max_prompt: int = 3000,
) -> list[dict[str, Any]]:
    """Requests from a Mooncake trace, its hash ids turned into token blocks.

    Each hash id covers 512 tokens in the trace; here it becomes a fixed block
    of ``tokens_per_hash`` ids, so a shared hash id is a shared block. The last
    hash id of a request covers only the remainder of ``input_length``; its
    block is cut in proportion. Prompts longer than ``max_prompt`` are cut at
    a hash boundary.

    Args:
        trace: Path to a Mooncake JSONL trace.
        seed: Varies the token ids behind the hash ids and the output ids.
        start: First trace line used.
        num_requests: Number of consecutive trace lines used.
        tokens_per_hash: Tokens standing for one 512-token hash block.
        ms_per_step: Trace milliseconds per engine step (arrival times).
        output_scale: Scale applied to ``output_length``.
        max_output: Cap on generated tokens.
        max_prompt: Cap on prompt length.

    Returns:
        The request dicts in trace order.
    """
    rng = random.Random(f"mooncake-out-{seed}")
    reqs = []
    with open(trace) as f:
        lines = f.readlines()[start : start + num_requests]
    t0 = None
    for i, line in enumerate(lines):
        row = json.loads(line)
        t0 = row["timestamp"] if t0 is None else t0
        ids = row["hash_ids"]
        prompt: list[int] = []
        for k, h in enumerate(ids):
            block = mooncake_hash_block(h, tokens_per_hash, seed)
            if k == len(ids) - 1:
                tail = row["input_length"] - MOONCAKE_BLOCK * (len(ids) - 1)
                n = max(1, min(tokens_per_hash, -(-tail * tokens_per_hash // MOONCAKE_BLOCK)))
                block = block[:n]
            if len(prompt) + len(block) > max_prompt:
                break
            prompt += block
        n_out = max(1, min(max_output, round(row["output_length"] * output_scale)))
        step = int((row["timestamp"] - t0) / ms_per_step)
        reqs.append(_req(f"m{start + i}", prompt, _tokens(rng, n_out), arrival_step=step))
    return reqs


GENERATORS = {
    "agent": agent_sessions,
    "system": shared_system_prompts,
    "fewshot": few_shot_bursts,
}


def main(argv: list[str] | None = None) -> int:
    """Write one workload as JSON (the format apc_drive.py --workload reads)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=[*GENERATORS, "mooncake"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="Mooncake JSONL (kind mooncake)")
    ap.add_argument("--tokens-per-hash", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--out", help="output file (default stdout)")
    a = ap.parse_args(argv)
    if a.kind == "mooncake":
        if not a.trace:
            ap.error("mooncake needs --trace")
        w = mooncake(
            a.trace, seed=a.seed, num_requests=a.num_requests, tokens_per_hash=a.tokens_per_hash
        )
    else:
        w = GENERATORS[a.kind](seed=a.seed)
    text = json.dumps(w)
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
