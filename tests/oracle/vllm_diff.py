#!/usr/bin/env python3
"""Differential harness: bearsdk's replay against vLLM 0.33's real V1 scheduler.

Generates replay cases with ../shared/tools/vllm-oracle/gen_cases.py (vLLM's own
Scheduler / AsyncScheduler driven on CPU, in the oracle's virtual environment),
replays every case with each bearsdk implementation, and reports, per
configuration, how often the first-token batch and the per-batch token counts
equal vLLM's. vLLM is never imported here: it runs in its own interpreter.

    python tests/oracle/vllm_diff.py                 # all 13 configurations
    python tests/oracle/vllm_diff.py --configs c02,c07 --json report.json

Build the oracle environment once with ../shared/tools/vllm-oracle/setup.sh
(or point --oracle-python / BEARSDK_VLLM_ORACLE at its python).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))

from bearsdk.replay import implementations  # noqa: E402
from oracle.compare import Tally, compare  # noqa: E402

ORACLE_DIR = (
    Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared")) / "tools" / "vllm-oracle"
)
ALL = [f"c{i:02d}" for i in range(1, 14)]


def oracle_python(explicit: str | None) -> Path | None:
    for cand in (
        explicit,
        os.environ.get("BEARSDK_VLLM_ORACLE"),
        ORACLE_DIR / ".venv-vllm-oracle" / "bin" / "python",
        REPO.parent / ".venv-vllm-oracle" / "bin" / "python",
    ):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


def generate(py: Path, configs: list[str], out: Path) -> None:
    """Run gen_cases.py for the configurations whose cases are not cached yet."""
    todo = [
        c
        for c in configs
        if not (out / f"{c}.jsonl").is_file() or not (out / "debug" / f"{c}.debug.jsonl").is_file()
    ]
    if not todo:
        return
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    cmd = [
        str(py),
        str(ORACLE_DIR / "gen_cases.py"),
        "--configs",
        ",".join(todo),
        "--out-dir",
        str(out),
        "--debug-dir",
        str(out / "debug"),
    ]
    print(f"generating cases with vLLM for {','.join(todo)} ...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ORACLE_DIR)


def run(configs: list[str], out: Path, impls: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {"configs": {}, "implementations": impls}
    for name in configs:
        dbg = {}
        with open(out / "debug" / f"{name}.debug.jsonl") as f:
            for line in f:
                d = json.loads(line)
                dbg[d["case_id"]] = d["batches"]
        tally: dict[str, Tally] = {}
        mode = None
        with open(out / f"{name}.jsonl") as f:
            for line in f:
                case = json.loads(line)
                mode = "async" if case["config"]["async_scheduling"] else "sync"
                compare(case, dbg.get(case["case_id"]), impls, tally)
        report["configs"][name] = {
            "scheduling": mode,
            **{
                impl: {
                    "cases": t.cases,
                    "first_token_exact": t.first_token_exact,
                    "batches_exact": t.batches_exact,
                    "per_request_exact": t.per_request_exact if impl == "python" else None,
                    "failures": t.failures[:20],
                }
                for impl, t in tally.items()
            },
        }
    return report


def totals(report: dict[str, Any], impl: str, mode: str | None = None) -> tuple[int, int, int]:
    n = ft = bt = 0
    for c in report["configs"].values():
        if mode and c["scheduling"] != mode:
            continue
        n += c[impl]["cases"]
        ft += c[impl]["first_token_exact"]
        bt += c[impl]["batches_exact"]
    return n, ft, bt


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--configs", default="all", help="comma list of c01..c13, or 'all'")
    ap.add_argument(
        "--cases-dir",
        default=str(
            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            / "bearsdk"
            / "vllm-oracle-cases"
        ),
    )
    ap.add_argument("--oracle-python", help="python of the vllm-oracle environment")
    ap.add_argument("--json", metavar="FILE", help="write the report here")
    a = ap.parse_args()
    configs = ALL if a.configs == "all" else a.configs.split(",")
    out = Path(a.cases_dir)
    out.mkdir(parents=True, exist_ok=True)
    py = oracle_python(a.oracle_python)
    missing = [c for c in configs if not (out / f"{c}.jsonl").is_file()]
    if missing and py is None:
        print(
            "vllm-oracle environment not found: build it with "
            f"{ORACLE_DIR / 'setup.sh'} or pass --oracle-python",
            file=sys.stderr,
        )
        return 2
    if py is not None:
        generate(py, configs, out)
    impls = sorted(implementations())
    t0 = time.perf_counter()
    report = run(configs, out, impls)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(
        f"{'config':7} {'mode':6} {'cases':>6} "
        + " ".join(f"{impl + ' first':>14} {impl + ' batches':>16}" for impl in impls)
        + f" {'per-request (python)':>21}"
    )
    for name, c in report["configs"].items():
        row = f"{name:7} {c['scheduling']:6} {c[impls[0]]['cases']:>6} "
        for impl in impls:
            r = c[impl]
            first = 100 * r["first_token_exact"] / r["cases"]
            batches = 100 * r["batches_exact"] / r["cases"]
            row += f" {first:>13.1f}% {batches:>15.1f}%"
        if "python" in c:
            r = c["python"]
            row += f" {100 * r['per_request_exact'] / r['cases']:>20.1f}%"
        print(row)
    ok = True
    for impl in impls:
        for mode in ("sync", "async"):
            n, ft, bt = totals(report, impl, mode)
            if n:
                print(
                    f"{impl:7} {mode:6}: first-token batch exact {ft}/{n}, batches exact {bt}/{n}"
                )
            ok = ok and ft == n and bt == n
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
