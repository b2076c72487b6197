#!/usr/bin/env python3
"""The plugin on vLLM's real scheduler with prefix caching on: what it publishes, step by step.

Runs under the vllm-oracle interpreter. ``tests/oracle/apc_drive.py``'s engine
loop drives the seeded token-id workloads of ``tests/oracle/apc_workloads.py``
through ``bearsdk.vllm.BearSyncScheduler`` / ``BearAsyncScheduler`` (the classes
``--scheduler-cls bearsdk.vllm.BearScheduler`` builds), publishing inline to a
recording transport. Two modes, both writing JSON under ``--out``:

``steps``
    At every ``schedule()`` call: the document the plugin published there, in
    the canonical form of :func:`canonical`, against ``apc_cases.export()`` of
    the same scheduler state taken just before the call (the oracle's
    from-scratch walk of the pool); and after every ``schedule()`` and
    ``update_from_output()``, the plugin's pool tracker against a tracker
    rebuilt from scratch (free queue, cached blocks and their order). Writes
    ``steps.json``: counts and the first differences.
``cases``
    ``apc_cases.one_case`` with the plugin: the published snapshot at a random
    step, with the new request (added right before that ``schedule()``) cut
    off, the oracle's export of the same state, and vLLM's batches up to the
    new request's first token. Writes ``cases.jsonl`` for
    ``tests/vllm_plugin/test_apc_publish.py`` to replay with bearsdk.

    "$BEARSDK_VLLM_ORACLE" tests/vllm_plugin/apc_publish.py steps --out /tmp/apc-pub
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _oracle_env import REPO, setup  # noqa: E402

setup()
sys.path.insert(0, str(REPO / "tests" / "oracle"))
os.environ["BEARSDK_PUBLISH_THREAD"] = os.environ.get("BEARSDK_PUBLISH_THREAD", "0")
os.environ.setdefault("BEARSDK_INSTANCE", "apc-publish-test")

import apc_cases  # noqa: E402
import apc_drive  # noqa: E402
import apc_sweep  # noqa: E402
from _apc_canon import canonical  # noqa: E402

from bearsdk.vllm import RecordingTransport, publisher_of  # noqa: E402
from bearsdk.vllm._prefix import PoolTracker  # noqa: E402
from bearsdk.vllm.scheduler import BearAsyncScheduler, BearSyncScheduler  # noqa: E402

# The oracle's drive.make_scheduler builds vLLM's Scheduler / AsyncScheduler by
# these names: the plugin's subclasses take their place, built with the same
# arguments vLLM's engine core passes a --scheduler-cls.
_drive = apc_drive._import_oracle(apc_drive.oracle_dir())
_drive.Scheduler = BearSyncScheduler
_drive.AsyncScheduler = BearAsyncScheduler

APC_CONFIGS = [c for c, cfg in apc_sweep.CONFIGS.items() if cfg.get("prefix_caching", True)]


def _tracker_diff(live: PoolTracker, sched: Any) -> str | None:
    mgr = sched.kv_cache_manager
    fresh = PoolTracker(mgr.block_pool, mgr.coordinator.single_type_managers[0], 1, install=False)
    if live.free_ids() != fresh.free_ids():
        a, b = live.free_ids(), fresh.free_ids()
        i = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        return f"free queue differs at {i}: tracked {a[i : i + 5]}, vLLM {b[i : i + 5]}"
    if sorted(live.cached_entries()) != sorted(fresh.cached_entries()):
        return "cached blocks differ"
    # Duplicates keep vLLM's first-cached-first order in slot order.
    order: dict[int, list[int]] = {}
    for b, k in live.cached_entries():
        order.setdefault(k, []).append(b)
    ref: dict[int, list[int]] = {}
    for b, k in fresh.cached_entries():
        ref.setdefault(k, []).append(b)
    if order != ref:
        return "duplicates' order differs"
    return None


class Run:
    """One workload under one config through the plugin, checking every step."""

    def __init__(self, cfg: dict[str, Any], workload: list[dict[str, Any]]) -> None:
        self.lengths = {r["id"]: r["output_len"] for r in workload}
        self.refs: dict[int, dict[str, Any]] = {}
        self.threaded = os.environ.get("BEARSDK_PUBLISH_THREAD") == "1"
        self.docs_at: list[int] = []
        self.d = apc_drive.Driver(
            cfg,
            workload,
            before_schedule=self._before,
            on_schedule=self._after_schedule,
            on_update=self._after_update,
        )
        pub = publisher_of(self.d.sched)
        assert pub is not None
        assert pub.prefix is not None, "the plugin did not export the pool"
        self.pub = pub
        self.rec = RecordingTransport(batches=False)
        pub.add_transport(self.rec)
        self.steps = 0
        self.diffs: list[str] = []
        self.tracker_diffs: list[str] = []
        self.tracker_checks = 0

    def _before(self, d: apc_drive.Driver) -> None:
        # The capture inside the coming schedule() takes the next seq.
        self.refs[int(self.pub.hooks.seq) + 1] = apc_cases.export(d.sched, self.lengths)
        self.docs_at.append(len(self.rec.documents))

    def _check_tracker(self, d: apc_drive.Driver) -> None:
        self.tracker_checks += 1
        diff = _tracker_diff(self.pub.prefix.tracker, d.sched)  # type: ignore[union-attr]
        if diff and len(self.tracker_diffs) < 5:
            self.tracker_diffs.append(f"call {d.calls}: {diff}")

    def _after_schedule(self, d: apc_drive.Driver, so: Any, rec: dict[str, Any]) -> None:
        self.steps += 1
        if not self.threaded and len(self.rec.documents) != self.docs_at[-1] + 1:
            self.diffs.append(f"call {d.calls}: not one document in one schedule()")
        self._check_tracker(d)

    def compare(self) -> int:
        """Compare every published document with the oracle's export of its state."""
        n = 0
        for doc in self.rec.documents:
            got = json.loads(doc)
            want = self.refs.get(got["seq"])
            if want is None:
                continue
            n += 1
            a, b = canonical(got), canonical(want)
            if a != b and len(self.diffs) < 5:
                self.diffs.append(f"seq {got['seq']}: published {a} != oracle {b}"[:3000])
        return n

    def _after_update(self, d: apc_drive.Driver, so: Any, rec: dict[str, Any]) -> None:
        self._check_tracker(d)


def steps_mode(a: argparse.Namespace) -> int:
    """Every step of every workload kind x seed x APC config."""
    from bearsdk.snapshot import decode_snapshot

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"runs": 0, "steps": 0, "documents": 0, "tracker_checks": 0}
    summary.update({"diffs": [], "tracker_diffs": [], "invalid": [], "failures": 0, "skipped": 0})
    summary["with_extension"] = summary["compared"] = summary["rebuilds"] = 0
    summary["superseded"] = 0
    summary["threaded"] = os.environ.get("BEARSDK_PUBLISH_THREAD") == "1"
    summary["evicting_runs"] = summary["preempting_runs"] = summary["duplicate_steps"] = 0
    t0 = time.monotonic()
    for wname, w in apc_sweep.workloads(a.seeds, None):
        for cname in a.configs.split(","):
            try:
                run = Run(apc_sweep.CONFIGS[cname], w)
                run.d.run()
            except (RuntimeError, ValueError) as e:
                print(f"skip {wname}@{cname}: {e}", file=sys.stderr)
                summary["skipped"] += 1
                continue
            name = f"{wname}@{cname}"
            run.pub.close()
            summary["compared"] += run.compare()
            summary["rebuilds"] += run.pub.prefix.tracker.rebuilds  # type: ignore[union-attr]
            summary["runs"] += 1
            summary["superseded"] += run.pub.prefix.superseded  # type: ignore[union-attr]
            summary["steps"] += run.steps
            summary["tracker_checks"] += run.tracker_checks
            summary["documents"] += len(run.rec.documents)
            summary["failures"] += run.pub.stats().failures
            if any(rec["preempted"] for rec in run.d.trace):
                summary["preempting_runs"] += 1
            if run.pub.prefix.tracker.removed:  # type: ignore[union-attr]
                summary["evicting_runs"] += 1
            for r in run.refs.values():
                pc = r["kv"]["prefix_cache"]
                cached = pc["keys"][: pc["cached"]]
                summary["duplicate_steps"] += len(set(cached)) < len(cached)
            summary["diffs"] += [f"{name} {x}" for x in run.diffs][:3]
            summary["tracker_diffs"] += [f"{name} {x}" for x in run.tracker_diffs][:3]
            for doc in run.rec.documents:
                try:
                    snap = decode_snapshot(doc)
                except Exception as e:
                    summary["invalid"].append(f"{name}: {e}"[:500])
                    continue
                summary["with_extension"] += snap.prefix_cache is not None
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (out / "steps.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
    return 0


def one_case(
    cfg: dict[str, Any], workload: list[dict[str, Any]], at: int, new: dict[str, Any]
) -> dict[str, Any] | None:
    """``apc_cases.one_case`` through the plugin: published and oracle snapshots at ``at``."""
    lengths = {r["id"]: r["output_len"] for r in workload}
    lengths[new["id"]] = new["output_len"]
    got: dict[str, Any] = {}
    rec = RecordingTransport(batches=False)

    def before(d: apc_drive.Driver) -> None:
        if got or d.step < at:
            return
        got["reference"] = apc_cases.export(d.sched, lengths)
        got["step"] = d.step
        got["doc_at"] = len(rec.documents)
        d.timed.clear()
        d.dependents.clear()
        d.spec[new["id"]] = new
        d.order[new["id"]] = len(d.order)
        req = d._make_request(new["id"])
        d.sched.add_request(req)
        got["prefix_keys"] = [apc_cases.key_of(h) for h in req.block_hashes]

    def contexts(d: apc_drive.Driver, so: Any, r: dict[str, Any]) -> None:
        r["ctx"] = {
            rid: d.sched.requests[rid].num_computed_tokens - n
            for rid, n in so.num_scheduled_tokens.items()
        }

    d = apc_drive.Driver(cfg, workload, before_schedule=before, on_schedule=contexts)
    pub = publisher_of(d.sched)
    assert pub is not None
    assert pub.prefix is not None
    pub.add_transport(rec)
    while d.iterate():
        if new["id"] in d.first_token or d.calls > 200_000:
            break
    if not got or new["id"] not in d.first_token:
        return None
    doc = json.loads(rec.documents[got["doc_at"]])
    tail = doc["requests"][-1]
    assert tail["id"] == new["id"], tail
    doc["requests"] = doc["requests"][:-1]
    k0 = got["step"]
    batches = [
        {rid: [n, r["ctx"][rid]] for rid, n in r["sched"].items()}
        for r in d.trace
        if k0 <= r["step"] <= d.first_token[new["id"]]
    ]
    return {
        "config": d.cfg,
        "published": doc,
        "reference": got["reference"],
        "output_len": lengths,
        "new": {
            "id": new["id"],
            "prompt_tokens": len(new["prompt"]),
            "output_len": new["output_len"],
            "max_tokens": new["output_len"],
            "prefix_keys": got["prefix_keys"],
        },
        "vllm_batches": batches,
        "failures": pub.stats().failures,
    }


def cases_mode(a: argparse.Namespace) -> int:
    """Random cases per workload kind x seed x APC config (``apc_cases.main``'s draw)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = skipped = 0
    with open(out / "cases.jsonl", "w") as f:
        for wname, w in apc_sweep.workloads(a.seeds, None):
            for cname in a.configs.split(","):
                cfg = apc_sweep.CONFIGS[cname]
                try:
                    steps = len(apc_drive.Driver(cfg, w).run()["trace"])
                except (RuntimeError, ValueError):
                    skipped += 1
                    continue
                rng = random.Random(f"{wname}@{cname}")
                bs = {**apc_drive.DEFAULTS, **cfg}["block_size"]
                for j in range(a.per_run):
                    src = rng.choice(w)
                    cut = rng.choice([len(src["prompt"]), rng.randint(1, len(src["prompt"]))])
                    cut = min(cut, 1500)
                    tail = [rng.randrange(10, 1000) for _ in range(rng.choice([1, bs, 40, 200]))]
                    olen = rng.randint(1, 8)
                    new = {
                        "id": f"new{j}",
                        "arrival_step": 0,
                        "prompt": src["prompt"][:cut] + tail,
                        "output_ids": [rng.randrange(10, 1000) for _ in range(olen)],
                        "output_len": olen,
                    }
                    at = rng.randint(0, max(0, int(steps * 0.8)))
                    try:
                        case = one_case(cfg, w, at, new)
                    except (RuntimeError, ValueError):
                        case = None
                    if case is None:
                        skipped += 1
                        continue
                    case["name"] = f"{wname}@{cname}#{j}"
                    f.write(json.dumps(case) + "\n")
                    n += 1
    print(f"{n} cases ({skipped} skipped) -> {out / 'cases.jsonl'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``steps`` or ``cases``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["steps", "cases"])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--per-run", type=int, default=3)
    ap.add_argument("--configs", default=",".join(APC_CONFIGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return steps_mode(a) if a.mode == "steps" else cases_mode(a)


if __name__ == "__main__":
    raise SystemExit(main())
