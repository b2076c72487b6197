#!/usr/bin/env python3
"""Run an APC workload through bearsdk's live scheduler and compare it with vLLM's.

``apc_drive.py`` (under the vllm-oracle's virtualenv) records what vLLM 0.33's
real scheduler does with a workload of real token ids; this script (under
bearsdk's) runs the same workload through
:class:`~bearsdk.replay.scheduler.SchedulerCore` with the ``vllm-v1`` spec and
prefix caching on, with the same engine loop, and compares the two step by
step: the tokens scheduled per request, the prefix hit of every admission, the
preemptions and the free-block count.

    $ORACLE_PY tests/oracle/apc_drive.py --gen agent --seed 3 --num-blocks 120 \\
        --json-out /tmp/o.json
    python tests/oracle/apc_live.py /tmp/o.json      # exit 1 on the first difference
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

try:
    from oracle import apc_drive
except ImportError:  # run as a script: this folder, not tests/, is on the path
    import apc_drive  # type: ignore[no-redef]

from bearsdk.replay.scheduler import SchedulerCore
from bearsdk.schedulers import bind_scheduler


def vllm_v1_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The vllm-v1 spec's parameters for an apc_drive engine config."""
    return {
        "max_num_batched_tokens": cfg["max_num_batched_tokens"],
        "max_num_seqs": cfg["max_num_seqs"],
        "max_model_len": cfg["max_model_len"],
        "block_size": cfg["block_size"],
        "num_gpu_blocks": cfg["num_blocks"],
        "long_prefill_token_threshold": cfg["long_prefill_token_threshold"],
        "watermark": cfg["watermark"],
        "enable_chunked_prefill": not cfg["no_chunked_prefill"],
        "async_scheduling": cfg["use_async"],
        "enable_prefix_caching": cfg["prefix_caching"],
    }


def core_for(cfg: dict[str, Any]) -> SchedulerCore:
    """The vllm-v1 scheduler bound to an apc_drive engine config."""
    return SchedulerCore(bind_scheduler("vllm-v1", vllm_v1_params(cfg)))


class LiveDriver:
    """apc_drive.Driver's engine loop around bearsdk's scheduler."""

    def __init__(self, cfg: dict[str, Any], workload: list[dict[str, Any]]) -> None:
        self.cfg = cfg
        self.core = core_for(cfg)
        self.depth = 2 if cfg["use_async"] else 1
        self.spec = {r["id"]: r for r in workload}
        self.order = {r["id"]: i for i, r in enumerate(workload)}
        self.timed = sorted(
            (r["arrival_step"], i, r["id"])
            for i, r in enumerate(workload)
            if r.get("after") is None
        )
        self.dependents: dict[str, list[str]] = {}
        for r in workload:
            if r.get("after") is not None:
                self.dependents.setdefault(r["after"], []).append(r["id"])
        self.trace: list[dict[str, Any]] = []
        self.first_token: dict[str, int] = {}
        self.queue: list[tuple[Any, dict[str, Any]]] = []
        self.step = 0
        self.preempted: set[str] = set()

    def _arrive(self) -> None:
        while self.timed and self.timed[0][0] <= self.step:
            _, _, rid = self.timed.pop(0)
            r = self.spec[rid]
            self.core.add_request(
                rid,
                len(r["prompt"]),
                r["output_len"],
                max_tokens=r["output_len"],
                token_ids=list(r["prompt"]) + list(r["output_ids"]),
            )

    def _process(self) -> None:
        batch, rec = self.queue.pop(0)
        out = self.core.process(batch)
        for rid in out.tokens:
            if rid not in self.first_token:
                self.first_token[rid] = rec["step"]
        for rid in out.finished:
            for dep in self.dependents.get(rid, []):
                at = rec["step"] + 1 + int(self.spec[dep].get("think_steps", 0))
                self.timed.append((at, self.order[dep], dep))
            self.timed.sort()

    def run(self, max_calls: int = 200_000) -> dict[str, Any]:
        core = self.core
        calls = 0
        while self.timed or core.has_work() or self.queue:
            calls += 1
            if calls > max_calls:
                raise RuntimeError("max_calls reached")
            self._arrive()
            if core.has_work():
                waiting = {r.rid: r.rid in self.preempted for r in core.waiting}
                b = core.schedule()
                self.preempted.update(b.preempted)
                sched = b.tokens
                admitted = {
                    r.rid: {"computed": r.computed - n, "resumed": waiting[r.rid]}
                    for r, n in b.sched.items()
                    if r.rid in waiting
                }
                rec = {
                    "step": self.step,
                    "sched": sched,
                    "admitted": admitted,
                    "preempted": sorted(b.preempted),
                    "num_free": core.free,
                }
                self.queue.append((b, rec))
                if sched:
                    self.trace.append(rec)
                    self.step += 1
                if len(self.queue) < self.depth and (sched or core.has_work()):
                    continue
            elif not self.queue:
                if self.timed:
                    self.step = max(self.step, self.timed[0][0])
                continue
            self._process()
        return {"trace": self.trace, "first_token_step": self.first_token}


def _admission(a: dict[str, Any]) -> dict[str, Any]:
    return {"computed": a["computed"], "resumed": a["resumed"]}


def compare(oracle: dict[str, Any], live: dict[str, Any]) -> str | None:
    """The first difference between two runs, or ``None``."""
    for o, b in zip(oracle["trace"], live["trace"], strict=False):
        o = {**o, "admitted": {k: _admission(v) for k, v in o["admitted"].items()}}
        for key in ("sched", "admitted", "preempted", "num_free"):
            if o[key] != b[key]:
                return f"step {o['step']}: {key} vllm={o[key]} bearsdk={b[key]}"
    if len(oracle["trace"]) != len(live["trace"]):
        return f"steps: vllm={len(oracle['trace'])} bearsdk={len(live['trace'])}"
    if oracle["first_token_step"] != live["first_token_step"]:
        return "first_token_step differs"
    return None


def check_case(case: dict[str, Any]) -> str | None:
    """Run one recorded case through bearsdk; the first difference or ``None``."""
    cfg = {**apc_drive.DEFAULTS, **case["config"]}
    return compare(case, LiveDriver(cfg, case["workload"]).run())


def write_fixture(cases: list[dict[str, Any]], out: str, per_kind: int) -> int:
    """Keep ``per_kind`` cases of each workload kind under each config, gzipped (for CI).

    Each workload is written once (a line ``{"workload": name, "requests": ...}``)
    and each case names its workload and keeps only what :func:`compare` reads.
    """
    kept: dict[str, int] = {}
    workloads: dict[str, list[dict[str, Any]]] = {}
    lines = []
    for case in cases:
        wname, cname = case["name"].rsplit("@", 1)
        slot = f"{wname.split('/')[0]}@{cname}"
        if kept.get(slot, 0) >= per_kind:
            continue
        kept[slot] = kept.get(slot, 0) + 1
        workloads.setdefault(wname, case["workload"])
        trace = [
            {
                "step": r["step"],
                "sched": r["sched"],
                "admitted": {k: _admission(v) for k, v in r["admitted"].items()},
                "preempted": r["preempted"],
                "num_free": r["num_free"],
            }
            for r in case["trace"]
        ]
        lines.append(
            {
                "name": case["name"],
                "workload": wname,
                "config": case["config"],
                "trace": trace,
                "first_token_step": case["first_token_step"],
            }
        )
    with gzip.open(out, "wt") as f:
        for wname, w in workloads.items():
            f.write(json.dumps({"workload": wname, "requests": w}, separators=(",", ":")) + "\n")
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return len(lines)


def read_fixture(path: str | Path) -> list[dict[str, Any]]:
    """The cases of a :func:`write_fixture` file, each with its workload."""
    workloads: dict[str, Any] = {}
    cases = []
    with gzip.open(path, "rt") as f:
        for line in f:
            d = json.loads(line)
            if "requests" in d:
                workloads[d["workload"]] = d["requests"]
            else:
                cases.append({**d, "workload": workloads[d["workload"]]})
    return cases


def main(argv: list[str] | None = None) -> int:
    """Compare recorded vLLM runs with bearsdk's; exit 1 if any differs."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="apc_sweep.py output (JSON lines) or one apc_drive --json-out")
    ap.add_argument("--workload", help="the workload of a single apc_drive result")
    ap.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    ap.add_argument("--write-fixture", metavar="OUT.jsonl.gz", help="also keep a sample for CI")
    ap.add_argument(
        "--per-kind", type=int, default=3, help="cases per workload kind and config in the sample"
    )
    a = ap.parse_args(argv)
    if a.result.endswith(".gz"):
        cases = read_fixture(a.result)
    elif a.workload:
        text = Path(a.result).read_text()
        cases = [{**json.loads(text), "name": a.result}]
        cases[0]["workload"] = json.loads(Path(a.workload).read_text())
    else:
        text = Path(a.result).read_text()
        cases = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_config: dict[str, list[int]] = {}
    bad = 0
    for case in cases:
        diff = check_case(case)
        tally = by_config.setdefault(case["name"].split("@")[-1], [0, 0])
        tally[0] += diff is None
        tally[1] += 1
        if diff:
            bad += 1
            print(f"DIFF {case['name']}: {diff}")
        elif not a.quiet:
            print(f"ok   {case['name']}: {len(case['trace'])} steps")
    for name, (ok, total) in sorted(by_config.items()):
        print(f"{name:16s} {ok}/{total}")
    print(f"{len(cases) - bad}/{len(cases)} cases identical step by step")
    if a.write_fixture and not bad:
        n = write_fixture(cases, a.write_fixture, a.per_kind)
        print(f"kept {n} cases in {a.write_fixture}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
