#!/usr/bin/env python3
"""Single-resident replay cases from vLLM 0.33's real scheduler (issue 19, defect 4).

One request ``r0`` arrives at step 0 and the new request ``r1`` at step ``t``;
the case is the snapshot just before ``r1`` arrives, and vLLM's isolated
first-token batch and batches from then on (gen_cases.py's Driver, with a
fork per case). Run it in the oracle's virtual environment:

    HF_HUB_OFFLINE=1 $ORACLE_PYTHON tests/oracle/gen_single_resident.py out.jsonl

tests/data/vllm_single_resident_cases.jsonl.gz holds its output, less the cases
whose resident finished before ``r1`` arrived (empty snapshots).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
ORACLE_DIR = (
    Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared")) / "tools" / "vllm-oracle"
)


def main(out_path: str) -> None:
    sys.path.insert(0, str(ORACLE_DIR))
    import gen_cases as g  # the oracle's own module, in its own interpreter

    model_dir = g.tiny_model_dir()
    n = 0
    grid = itertools.product((False, True), (0, 4), (6, 64), (1, 2), (1, 4), (8, 64))
    with open(out_path, "w") as out:
        for asy, lptt, nb, seqs, bs, budget in grid:
            cfg = {
                "max_num_batched_tokens": budget,
                "max_num_seqs": seqs,
                "max_model_len": 64,
                "block_size": bs,
                "num_gpu_blocks": nb,
                "long_prefill_token_threshold": lptt,
                "watermark": 0.0,
                "enable_chunked_prefill": True,
                "async_scheduling": asy,
            }
            name = f"a{int(asy)}l{lptt}n{nb}s{seqs}b{bs}t{budget}"
            for p0, o0, t, p1 in itertools.product((1, 3, 9), (1, 2, 5), (1, 2, 3, 5), (1, 4)):
                if bs == 1 and nb == 6 and p0 + o0 > 4:
                    continue  # r0 alone would not fit the pool
                workload = [[0, p0, o0], [t, p1, 2]]
                d = g.Driver(cfg, workload, model_dir, targets=["r1"], debug=True).run()
                rec = d.snaps["r1"]
                case = g._case(name, "r1", rec, d, g.case_config(cfg))
                case["case_id"] = f"{name}-p{p0}o{o0}t{t}n{p1}"
                case["vllm_batches"] = rec["isolated"]["batches"]
                out.write(json.dumps(case, separators=(",", ":")) + "\n")
                n += 1
    print(f"{n} cases", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
