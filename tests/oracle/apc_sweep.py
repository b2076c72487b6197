#!/usr/bin/env python3
"""Record many prefix-caching cases from vLLM 0.33's real scheduler in one process.

Each case is a seeded workload (``apc_workloads``) run under one engine config
(``apc_drive.Driver``); the JSON-lines output holds, per case, the config, the
workload and vLLM's step trace, so that ``apc_live.py --cases`` (under
bearsdk's virtualenv) can replay every case through bearsdk without vllm.
Runs under the vllm-oracle's virtualenv.

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/apc_sweep.py --seeds 4 --out /tmp/apc.jsonl \\
        [--mooncake ../shared/data/mooncake/conversation_trace.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import apc_drive  # noqa: E402
import apc_workloads  # noqa: E402

# Engine configs: roomy and scarce KV (evictions, preemptions), async,
# long_prefill_token_threshold, a watermark, chunked prefill off, APC off.
CONFIGS: dict[str, dict[str, Any]] = {
    "roomy": {"num_blocks": 2000},
    "scarce": {"num_blocks": 120},
    "scarce-async": {"num_blocks": 120, "use_async": True},
    "tight-async": {"num_blocks": 100, "use_async": True, "max_num_seqs": 6},
    "lpt": {"num_blocks": 160, "long_prefill_token_threshold": 64},
    "lpt-async-wm": {
        "num_blocks": 200,
        "long_prefill_token_threshold": 96,
        "use_async": True,
        "watermark": 0.05,
    },
    "bs32": {"num_blocks": 70, "block_size": 32, "max_num_batched_tokens": 1024},
    "no-chunk": {"num_blocks": 300, "no_chunked_prefill": True, "max_num_batched_tokens": 4096},
    "apc-off-scarce": {"num_blocks": 120, "prefix_caching": False},
    "apc-off-async": {"num_blocks": 150, "prefix_caching": False, "use_async": True},
}


def workloads(seeds: int, mooncake: str | None) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(name, workload)`` for every generator and seed."""
    out = []
    for kind, seed in itertools.product(sorted(apc_workloads.GENERATORS), range(seeds)):
        out.append((f"{kind}/{seed}", apc_workloads.GENERATORS[kind](seed=1000 + seed)))
    if mooncake:
        for seed in range(seeds):
            # Prompts stay within the scarcest pool (70 blocks of 32), or vLLM
            # would wait for them forever.
            w = apc_workloads.mooncake(mooncake, seed=2000 + seed, num_requests=40, max_prompt=1500)
            out.append((f"mooncake/{seed}", w))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every workload under every config; write one JSON line per case."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--mooncake", help="Mooncake JSONL with hash_ids")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    names = a.configs.split(",")
    t0 = time.monotonic()
    n = skipped = 0
    with open(a.out, "w") as f:
        for wname, w in workloads(a.seeds, a.mooncake):
            for cname in names:
                cfg = CONFIGS[cname]
                try:
                    res = apc_drive.Driver(cfg, w).run()
                except (RuntimeError, ValueError) as e:
                    # vLLM itself never finishes it (a prompt larger than the
                    # pool waits forever): nothing to compare.
                    print(f"skip {wname}@{cname}: {e}", flush=True)
                    skipped += 1
                    continue
                for rec in res["trace"]:
                    # Only what the comparison reads: keeps the file small.
                    for k in ("kv_usage", "running", "waiting", "total"):
                        rec.pop(k, None)
                case = {"name": f"{wname}@{cname}", "workload": w, **res}
                f.write(json.dumps(case) + "\n")
                n += 1
    print(f"{n} cases ({skipped} skipped) in {time.monotonic() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
