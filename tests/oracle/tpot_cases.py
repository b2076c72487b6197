#!/usr/bin/env python3
"""Token-by-token cases from vLLM 0.33's real scheduler: the batch of each output token.

Ground truth for the replay's TPOT (issue 21): each case runs a seeded
workload through vLLM's scheduler (``apc_drive.Driver``) up to a random step,
exports the scheduler's state there as a ``bear.snapshot/1`` document (with
``kv.prefix_cache`` when prefix caching is on), adds a new request, stops every
later arrival, and runs on until the new request finishes. It records the
1-based batch index, counted from the snapshot as the replay counts it, of
every token vLLM samples for the new request (in async mode the batch that
computes the token, as for the first token), and vLLM's batches up to its
last token. ``tpot_check.py`` (bearsdk's environment) replays each case with
``next_tokens`` and compares. Runs under the vllm-oracle's virtualenv.

Workloads: the prefix-caching generators (agent sessions, shared system
prompts, few-shot bursts) and plain random prompts; engine configs: those of
``apc_sweep.CONFIGS`` (roomy, scarce KV with preemptions, async, a long-prefill
threshold, a watermark, block size 32, chunked prefill off, APC off) and
three starved pools in which the new request is preempted past its first
token and recomputes.

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/tpot_cases.py --seeds 3 --per-run 4 \\
        --out /tmp/tpot_cases.jsonl
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import apc_cases  # noqa: E402
import apc_sweep  # noqa: E402
import apc_workloads  # noqa: E402

# Beyond apc_sweep's: KV so scarce that the newest request (the new one, past
# its first token) is the preemption victim, sync and async.
CONFIGS: dict[str, dict[str, Any]] = {
    **apc_sweep.CONFIGS,
    "starved": {"num_blocks": 64},
    "starved-async": {"num_blocks": 64, "use_async": True},
    "starved-apc-off": {"num_blocks": 64, "prefix_caching": False, "use_async": True},
}


def plain(seed: int, n: int = 24) -> list[dict[str, Any]]:
    """Unrelated prompts (no shared prefix) with long outputs, arriving over 30 steps."""
    rng = random.Random(f"plain-{seed}")
    return [
        apc_workloads._req(
            f"p{i}",
            apc_workloads._tokens(rng, rng.randint(16, 700)),
            apc_workloads._tokens(rng, rng.randint(1, 90)),
            arrival_step=rng.randint(0, 30),
        )
        for i in range(n)
    ]


def workloads(seeds: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(name, workload)``: every prefix-caching generator and the plain one, per seed."""
    out = apc_sweep.workloads(seeds, None)
    for seed in range(seeds):
        out.append((f"plain/{seed}", plain(3000 + seed)))
    return out


def _new_request(
    rng: random.Random, src: dict[str, Any], cfg: dict[str, Any], j: int
) -> dict[str, Any]:
    """A cut of a workload prompt plus new tokens, and an answer of 1 to 120 tokens."""
    cut = min(rng.randint(1, len(src["prompt"])), 1200)
    tail = apc_workloads._tokens(rng, rng.choice([1, 16, 40, 200]))
    out = rng.choice([1, 2, 8, 33, 40, 64, 120])
    return {
        "id": f"new{j}",
        "arrival_step": 0,
        "prompt": src["prompt"][:cut] + tail,
        "output_ids": apc_workloads._tokens(rng, out),
        "output_len": out,
    }


def main(argv: list[str] | None = None) -> int:
    """Write cases as JSON lines: every workload x config, several snapshots each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--per-run", type=int, default=4, help="cases per workload and config")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    configs = {c: CONFIGS[c] for c in a.configs.split(",")}
    n, skipped = apc_cases.write_cases(
        a.out, workloads(a.seeds), configs, a.per_run, _new_request, salt="tpot:", follow=True
    )
    print(f"{n} cases ({skipped} skipped) in {time.monotonic() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
