#!/usr/bin/env python3
"""Replay vLLM's token-by-token cases (``tpot_cases.py``) and compare every token's batch.

For each case both replay twins run from the snapshot with ``next_tokens``
(default 32: the new request's first 33 tokens, or all of them when it has
fewer) and must put every token in the batch vLLM 0.33 computed it in; the
pure twin, run by hand, must also form vLLM's batches up to the last token
(each request's tokens and the context they start from). The token times are
the eq. 12 sums over those batches, equal across the twins within 1e-9 s.

    python tests/oracle/tpot_check.py /tmp/tpot_cases.jsonl [--next-tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bearsdk.replay.requests import NEW_REQUEST_ID  # noqa: E402
from oracle.apc_replay import load, replays  # noqa: E402


def check(case: dict[str, Any], next_tokens: int) -> str | None:
    """The first difference between vLLM's token batches and each twin's, or ``None``."""
    new = case["new"]
    want = case["token_batches"][: 1 + next_tokens]
    ref = None
    for impl, res in replays(case, next_tokens=next_tokens):
        got = list(res.token_batches)
        if got != want:
            for i, (w, g) in enumerate(zip(want, got, strict=False)):
                if w != g:
                    return f"{impl}: token {i + 1} in batch {g}, vllm {w}"
            return f"{impl}: {len(got)} tokens, vllm {len(want)}"
        assert res.batches is not None
        toks = [b.tokens_by_request for b in res.batches]
        if impl == "python":
            # The pure twin names each request's tokens: vLLM's batches, one by one.
            vb = case["vllm_batches"][: want[-1]]
            ours = [dict(t or ()) for t in toks]
            renamed = [
                {(NEW_REQUEST_ID if r == new["id"] else r): v[0] for r, v in b.items()} for b in vb
            ]
            if renamed != ours:
                j = next(i for i, (a, b) in enumerate(zip(renamed, ours, strict=False)) if a != b)
                return f"python: batch {j + 1} vllm={renamed[j]} bearsdk={ours[j]}"
        if ref is None:
            ref = res
        elif any(
            abs(a - b) > 1e-9 for a, b in zip(res.token_times_s, ref.token_times_s, strict=True)
        ):
            return f"{impl}: token times differ from the pure twin's by more than 1e-9 s"
    return None


def main(argv: list[str] | None = None) -> int:
    """Check every case; print a per-config tally (and write it as JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases")
    ap.add_argument("--next-tokens", type=int, default=32)
    ap.add_argument("--json", help="write the tally here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--write-sample", metavar="OUT.jsonl.gz", help="keep a sample for CI")
    ap.add_argument("--per-config", type=int, default=6, help="sample cases per config")
    a = ap.parse_args(argv)
    total: Counter[str] = Counter()
    ok: Counter[str] = Counter()
    gaps = preempted = 0
    failures = []
    for case in load(a.cases):
        cfg = case["name"].split("@", 1)[1].split("#", 1)[0]
        kind = "async" if case["config"]["use_async"] else "sync"
        total[cfg] += 1
        total[kind] += 1
        tb = case["token_batches"][: 1 + a.next_tokens]
        gaps += sum(b - a_ > 1 for a_, b in itertools.pairwise(tb))
        preempted += any(b - a_ > 1 for a_, b in itertools.pairwise(tb))
        err = check(case, a.next_tokens)
        if err is None:
            ok[cfg] += 1
            ok[kind] += 1
        else:
            failures.append((case["name"], err))
            if not a.quiet:
                print(f"MISMATCH {case['name']}: {err}")
    n = sum(v for k, v in total.items() if k in ("sync", "async"))
    good = ok["sync"] + ok["async"]
    report = {
        "cases": n,
        "matched": good,
        "next_tokens": a.next_tokens,
        "cases_with_a_token_gap": preempted,
        "token_gaps": gaps,
        "by_config": {k: [ok[k], v] for k, v in sorted(total.items())},
        "failures": failures[:20],
    }
    for k, v in sorted(total.items()):
        print(f"{k:18s} {ok[k]:5d}/{v:<5d}")
    print(f"all: {good}/{n} cases, every token's batch; {preempted} cases with a gap in the tokens")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.write_sample and good == n:
        write_sample(load(a.cases), a.write_sample, a.per_config, a.next_tokens)
    return 0 if good == n else 1


def _gapped(case: dict[str, Any], next_tokens: int) -> bool:
    tb = case["token_batches"][: 1 + next_tokens]
    return any(b - a > 1 for a, b in itertools.pairwise(tb))


def write_sample(cases: list[dict[str, Any]], out: str, per_config: int, next_tokens: int) -> None:
    """Per config: the cases whose tokens have a gap (a preemption) first, then the longest."""
    by: dict[str, list[dict[str, Any]]] = {}
    for c in cases:
        by.setdefault(c["name"].split("@", 1)[1].split("#", 1)[0], []).append(c)
    kept = 0
    with gzip.open(out, "wt") as f:
        for group in by.values():
            group.sort(key=lambda c: (not _gapped(c, next_tokens), -len(c["token_batches"])))
            for c in group[:per_config]:
                f.write(json.dumps(c, separators=(",", ":")) + "\n")
                kept += 1
    print(f"kept {kept} cases in {out}")


if __name__ == "__main__":
    raise SystemExit(main())
