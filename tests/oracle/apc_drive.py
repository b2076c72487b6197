#!/usr/bin/env python3
"""Drive vLLM 0.33's real V1 scheduler with real token ids (prefix caching).

Like the vllm-oracle's drive.py, but every request carries its own prompt token
ids and the ids its fake model samples (from apc_workloads.py or a JSON
workload file), so shared prefixes are real and automatic prefix caching (APC)
acts as in vLLM. Requests may depend on another request's finish (multi-turn
sessions). Runs under the oracle's virtualenv (it imports vllm); the oracle
tool folder is found from ``--oracle-dir``, ``$VLLM_ORACLE_DIR``, or
``$BEARSDK_SHARED/tools/vllm-oracle`` (default ``../shared`` next to the repo).

Per step it records the scheduled tokens per request, admissions with the
computed tokens they started from (their prefix-cache hit), first tokens,
finishes, preemptions, ``cached_tokens`` as vLLM reports it in usage, the
prefix-cache counters, and with ``--dump-blocks`` the block pool after the
step was scheduled and after its output was processed.

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/apc_drive.py --gen agent --seed 3 \
        --prefix-caching --num-blocks 120 --block-size 16 --async --json-out t.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import apc_workloads  # noqa: E402


def oracle_dir(explicit: str | None = None) -> Path:
    """Locate the shared vllm-oracle tool folder (holds drive.py, tinymodel/)."""
    if explicit:
        return Path(explicit)
    if os.environ.get("VLLM_ORACLE_DIR"):
        return Path(os.environ["VLLM_ORACLE_DIR"])
    shared = Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared"))
    return shared / "tools" / "vllm-oracle"


def _import_oracle(path: Path):
    sys.path.insert(0, str(path))
    import drive

    return drive


DEFAULTS = {
    "max_num_batched_tokens": 512,
    "max_num_seqs": 8,
    "max_model_len": 4096,
    "block_size": 16,
    "num_blocks": 1000,
    "long_prefill_token_threshold": 0,
    "watermark": 0.0,
    "prefix_caching": True,
    "no_chunked_prefill": False,
    "use_async": False,
}


PREFIX_STAT_FIELDS = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


class HashNames:
    """Short stable names ("h0", "h1", ...) for block hashes, in order seen."""

    def __init__(self) -> None:
        self._names: dict[bytes, str] = {}

    def __call__(self, h: Any) -> str | None:
        if h is None:
            return None
        key = bytes(h)
        if key not in self._names:
            self._names[key] = f"h{len(self._names)}"
        return self._names[key]


def check_fits(workload: list[dict[str, Any]], block_size: int, num_blocks: int, max_len: int):
    """Refuse a workload that vLLM could never finish with this pool.

    A request longer than the usable pool (``num_blocks - 1``: block 0 is the
    null block) preempts itself forever, and one longer than
    ``max_model_len`` is refused by vLLM's front end; either would make the
    engine loop spin until ``max_calls``.

    Raises:
        ValueError: Naming the first request that cannot fit.
    """
    for r in workload:
        total = len(r["prompt"]) + r["output_len"]
        # The last sampled token never gets KV.
        need = -(-(total - 1) // block_size)
        if need > num_blocks - 1 or total > max_len:
            raise ValueError(
                f"request {r['id']}: {total} tokens need {need} blocks "
                f"(pool {num_blocks - 1}, max_model_len {max_len})"
            )


class Driver:
    """One engine: vLLM's scheduler plus an emulated EngineCore loop.

    The loop mirrors drive.py (EngineCore.step / step_with_batch_queue): in
    async mode the next batch is scheduled before the previous one's output is
    processed (batch queue depth 2).

    Args:
        cfg: Engine parameters (keys of DEFAULTS).
        workload: Request dicts as produced by apc_workloads.
        dump_blocks: Record the block pool in every step record.
        oracle: Path of the vllm-oracle tool folder.
        on_schedule: Called as ``f(driver, scheduler_output, rec)`` right
            after each schedule() call (probes inspect the pool there).
        before_schedule: Called as ``f(driver)`` right before each
            schedule() call (after this step's arrivals were added).
        on_update: Called as ``f(driver, scheduler_output, rec)`` right after
            each update_from_output() call.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        workload: list[dict[str, Any]],
        dump_blocks: bool = False,
        oracle: str | None = None,
        on_schedule: Callable | None = None,
        before_schedule: Callable | None = None,
        on_update: Callable | None = None,
    ) -> None:
        drive = _import_oracle(oracle_dir(oracle))
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
        )

        self.cfg = {**DEFAULTS, **cfg}
        a = SimpleNamespace(**self.cfg)
        check_fits(workload, a.block_size, a.num_blocks, a.max_model_len)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(a.block_size, sha256) if a.prefix_caching else None
        self.sched = drive.make_scheduler(a)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.depth = 2 if a.use_async else 1
        self.dump_blocks = dump_blocks
        self.on_schedule = on_schedule
        self.before_schedule = before_schedule
        self.on_update = on_update
        self.names = HashNames()
        self.spec = {r["id"]: r for r in workload}
        self.timed = sorted(
            [
                (r["arrival_step"], i, r["id"])
                for i, r in enumerate(workload)
                if r.get("after") is None
            ],
        )
        self.dependents: dict[str, list[str]] = {}
        for r in workload:
            if r.get("after") is not None:
                self.dependents.setdefault(r["after"], []).append(r["id"])
        self.order = {r["id"]: i for i, r in enumerate(workload)}
        self.sampled: dict[str, int] = {}
        self.arrival: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.finish: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}
        self.admissions: dict[str, list[tuple[int, int]]] = {}
        self.trace: list[dict[str, Any]] = []
        # Summed over the run: each update only carries the counts recorded
        # since the previous one, and in async mode those belong to a later
        # schedule() than the step being processed.
        self.prefix_totals = dict.fromkeys(PREFIX_STAT_FIELDS, 0)
        self.queue: list = []
        self.step = 0
        self.calls = 0

    # --- requests -----------------------------------------------------------------

    def _make_request(self, rid: str):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        r = self.spec[rid]
        sp = SamplingParams(max_tokens=r["output_len"], ignore_eos=True)
        return Request(
            request_id=rid,
            prompt_token_ids=list(r["prompt"]),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def _arrive(self) -> None:
        while self.timed and self.timed[0][0] <= self.step:
            _, _, rid = self.timed.pop(0)
            self.arrival[rid] = self.step
            self.sched.add_request(self._make_request(rid))

    def _release(self, rid: str, step: int) -> None:
        for dep in self.dependents.get(rid, []):
            at = step + 1 + int(self.spec[dep].get("think_steps", 0))
            self.timed.append((at, self.order[dep], dep))
        self.timed.sort()

    def _fabricate(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens.keys())
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            # The j-th sampled token is the workload's j-th output id, so the
            # next turn's prompt (which contains them) shares these blocks.
            outs = self.spec[rid]["output_ids"]
            j = self.sampled.get(rid, 0)
            self.sampled[rid] = j + 1
            sampled.append([outs[min(j, len(outs) - 1)]])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    # --- block pool -------------------------------------------------------------

    def blocks_state(self) -> dict[str, Any]:
        """The block pool: residents' block ids, live/cached blocks, free queue."""
        mgr = self.sched.kv_cache_manager
        residents = {}
        chains = {}
        for req in list(self.sched.running) + list(self.sched.waiting):
            ids = mgr.get_block_ids(req.request_id)[0]
            if ids:
                residents[req.request_id] = list(ids)
            chains[req.request_id] = [self.names(h) for h in req.block_hashes]
        blocks = {}
        for b in self.pool.blocks:
            if b.is_null:
                continue
            h = self.names(b.block_hash)
            if h is not None or b.ref_cnt:
                blocks[b.block_id] = {"hash": h, "ref": b.ref_cnt}
        free = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        return {
            "residents": residents,
            "chains": chains,
            "blocks": blocks,
            "free_queue": free,
            "free_cached": [i for i in free if self.pool.blocks[i].block_hash is not None],
            "num_free": self.pool.get_num_free_blocks(),
        }

    # --- engine loop ------------------------------------------------------------

    def _process(self, entry) -> None:
        so, mro, rec = entry
        outs = self.sched.update_from_output(so, mro)
        for eco in outs.values():
            st = eco.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                p = st.prefix_cache_stats
                rec["prefix_cache"] = {k: getattr(p, k) for k in PREFIX_STAT_FIELDS}
                for k in PREFIX_STAT_FIELDS:
                    self.prefix_totals[k] += getattr(p, k)
            for o in eco.outputs:
                rid = o.request_id
                if o.prefill_stats is not None:
                    self.cached_tokens[rid] = o.prefill_stats.num_cached_tokens
                    rec["cached_tokens"][rid] = o.prefill_stats.num_cached_tokens
                if o.new_token_ids and rid not in self.first_token:
                    self.first_token[rid] = rec["step"]
                    rec["first_token"].append(rid)
                if o.finish_reason is not None:
                    self.finish[rid] = rec["step"]
                    rec["finished"].append(rid)
                    self._release(rid, rec["step"])
        if self.dump_blocks:
            rec["blocks_after_update"] = self.blocks_state()
        if self.on_update is not None:
            self.on_update(self, so, rec)

    def iterate(self) -> bool:
        """One pass of the engine loop; False once everything is done."""
        sched = self.sched
        if not (self.timed or sched.has_requests() or self.queue):
            return False
        self.calls += 1
        self._arrive()
        if sched.has_requests():
            before = {r.request_id: r.status.name for r in list(sched.waiting)}
            if self.before_schedule is not None:
                self.before_schedule(self)
            so = sched.schedule()
            n_run, n_wait = sched.get_request_counts()
            admitted = {}
            for rid, n in so.num_scheduled_tokens.items():
                if rid in before:
                    req = sched.requests[rid]
                    hit = req.num_computed_tokens - n
                    admitted[rid] = {
                        "computed": hit,
                        "resumed": before[rid] == "PREEMPTED",
                        "num_tokens": req.num_tokens,
                    }
                    self.admissions.setdefault(rid, []).append((self.step, hit))
            rec = {
                "step": self.step,
                "sched": dict(so.num_scheduled_tokens),
                "total": so.total_num_scheduled_tokens,
                "admitted": admitted,
                "preempted": sorted(so.preempted_req_ids),
                "running": n_run,
                "waiting": n_wait,
                "num_free": self.pool.get_num_free_blocks(),
                "kv_usage": round(sched.get_kv_cache_usage(), 4),
                "first_token": [],
                "finished": [],
                "cached_tokens": {},
            }
            if self.dump_blocks:
                rec["blocks_after_schedule"] = self.blocks_state()
            if self.on_schedule is not None:
                self.on_schedule(self, so, rec)
            mro = self._fabricate(so)
            self.queue.append((so, mro, rec))
            if so.total_num_scheduled_tokens > 0:
                self.trace.append(rec)
                self.step += 1
            if len(self.queue) < self.depth and (
                so.total_num_scheduled_tokens > 0 or sched.has_requests()
            ):
                return True
        elif not self.queue:
            # Idle engine: jump to the next arrival.
            self.step = max(self.step, self.timed[0][0]) if self.timed else self.step
            return True
        self._process(self.queue.pop(0))
        return True

    def run(self, max_calls: int = 200000) -> dict[str, Any]:
        """Run to completion; returns the JSON-able result."""
        while self.iterate():
            if self.calls > max_calls:
                raise RuntimeError("max_calls reached")
        return self.result()

    def result(self) -> dict[str, Any]:
        """Trace plus per-request summaries."""
        return {
            "config": self.cfg,
            "trace": self.trace,
            "arrival_step": self.arrival,
            "first_token_step": self.first_token,
            "finish_step": self.finish,
            "admissions": self.admissions,
            "cached_tokens": self.cached_tokens,
            "prefix_cache_totals": self.prefix_totals,
        }


def load_workload(a) -> list[dict[str, Any]]:
    """The workload named by the CLI (a JSON file or a generator)."""
    if a.workload:
        with open(a.workload) as f:
            w = json.load(f)
        # Also accept drive.py's [arrival, prompt_len, output_len] rows.
        if w and isinstance(w[0], list):
            rng = apc_workloads.random.Random(0)
            w = [
                apc_workloads._req(f"r{i}", apc_workloads._tokens(rng, p), [11] * o, arrival_step=t)
                for i, (t, p, o) in enumerate(w)
            ]
        return w
    if a.gen == "mooncake":
        shared = Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared"))
        trace = a.trace or shared / "data" / "mooncake" / "conversation_trace.jsonl"
        return apc_workloads.mooncake(
            trace, seed=a.seed, num_requests=a.num_requests, tokens_per_hash=a.tokens_per_hash
        )
    return apc_workloads.GENERATORS[a.gen](seed=a.seed)


def main(argv: list[str] | None = None) -> int:
    """CLI: run one workload and print or write its per-step trace."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", help="JSON list of request dicts (apc_workloads format)")
    ap.add_argument("--gen", choices=[*apc_workloads.GENERATORS, "mooncake"], default="agent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="Mooncake JSONL for --gen mooncake")
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--tokens-per-hash", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1000)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0)
    ap.add_argument("--watermark", type=float, default=0.0)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--no-chunked-prefill", action="store_true")
    ap.add_argument("--async", dest="use_async", action="store_true")
    ap.add_argument("--dump-blocks", action="store_true")
    ap.add_argument("--oracle-dir")
    ap.add_argument("--json-out")
    ap.add_argument("--show", type=int, default=10)
    a = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    cfg = {k: getattr(a, k) for k in DEFAULTS}
    d = Driver(cfg, load_workload(a), dump_blocks=a.dump_blocks, oracle=a.oracle_dir)
    res = d.run()
    print(json.dumps({k: v for k, v in cfg.items()}))
    for rec in res["trace"][: a.show]:
        print(
            f"step {rec['step']:3d} total={rec['total']:5d} admitted={rec['admitted']} "
            f"first={rec['first_token']} fin={rec['finished']} pre={rec['preempted']} "
            f"free={rec['num_free']}"
        )
    hits = sum(v for v in res["cached_tokens"].values())
    print(
        f"steps={len(res['trace'])} requests={len(res['first_token_step'])} "
        f"cached_tokens_sum={hits}"
    )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
