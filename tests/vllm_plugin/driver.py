#!/usr/bin/env python3
"""Drive vLLM's real scheduler, built through ``--scheduler-cls``, with the bearsdk plugin.

Runs under the vllm-oracle interpreter (``../shared/tools/vllm-oracle``), on a
CPU, with no model: the oracle's ``gen_cases.Driver`` feeds its Azure-trace
workloads into the scheduler step by step and fabricates model outputs, and
forks the live scheduler at each sampled arrival ("target") to find the batch
in which the target's first token is computed when nothing arrives after it.
Here the scheduler is ``bearsdk.vllm.BearScheduler``, constructed the way
vLLM's ``EngineCore`` constructs ``--scheduler-cls``, publishing inline to a
recording transport. Per configuration it writes, under ``--out``:

* ``NAME.cases.jsonl``: per target, the document the plugin published at the
  start of the ``schedule()`` that follows the target's arrival, with the
  target and later same-step arrivals cut off (``published``), the oracle's
  own snapshot taken just before the target arrived (``reference``), and the
  isolated first-token batch;
* ``NAME.docs.ndjson``: every document published;
* ``NAME.summary.json``: counters (schedule calls, documents, failures) and
  the check of every ``bear.batch/1`` record against terms recomputed here.

``--transports`` adds one run with the default threaded publisher, a
shared-memory segment and the HTTP side server, read while vLLM runs
(``transports.json``). ``tests/vllm_plugin/test_oracle.py`` runs this script
and checks its output with bearsdk's replay.

    "$BEARSDK_VLLM_ORACLE" tests/vllm_plugin/driver.py \\
        --configs c01,c03 --requests 300 --targets 20 --out /tmp/plugin-run
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _oracle_env import setup

setup()

import gen_cases as G  # noqa: E402

SCHEDULER_CLS = "bearsdk.vllm.BearScheduler"


def plugin_scheduler(cfg: dict[str, Any], model_dir: str) -> Any:
    """The scheduler vLLM's EngineCore would build for ``--scheduler-cls``."""
    V = G._import_vllm()
    model_config = V["ModelConfig"](
        model=model_dir,
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=cfg["max_model_len"],
    )
    scheduler_config = V["SchedulerConfig"](
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"],
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        enable_chunked_prefill=cfg["enable_chunked_prefill"],
        async_scheduling=cfg["async_scheduling"],
        watermark=cfg["watermark"],
        is_encoder_decoder=False,
        scheduler_cls=SCHEDULER_CLS,
    )
    cache_config = V["CacheConfig"](
        block_size=cfg["block_size"],
        enable_prefix_caching=bool(cfg.get("enable_prefix_caching", False)),
    )
    vllm_config = V["VllmConfig"](
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=V["DeviceConfig"](device="cuda"),
    )
    kv_cache_config = V["KVCacheConfig"](
        num_blocks=cfg["num_gpu_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[
            V["KVCacheGroupSpec"](
                ["layer"],
                V["FullAttentionSpec"](
                    block_size=cfg["block_size"],
                    num_kv_heads=1,
                    head_size=1,
                    dtype=V["torch"].float32,
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = cfg["num_gpu_blocks"]
    # vllm/v1/engine/core.py: resolve the class by qualified name, call it with keywords.
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=V["StructuredOutputManager"](vllm_config),
        include_finished_set=False,
        log_stats=True,
        block_size=cfg["block_size"],
        hash_block_size=cfg["block_size"],
    )


class PluginDriver(G.Driver):
    """The oracle's engine loop around the plugin scheduler, checking what it publishes."""

    def __init__(
        self,
        cfg: dict[str, Any],
        workload: list[list[int]],
        model_dir: str,
        targets: list[str],
        fork_isolated: bool = True,
    ) -> None:
        from bearsdk.vllm import RecordingTransport, publisher_of

        G.make_scheduler = plugin_scheduler
        super().__init__(cfg, workload, model_dir, targets=targets, fork_isolated=fork_isolated)
        pub = publisher_of(self.sched)
        assert pub is not None, "the plugin scheduler has no publisher"
        self.pub = pub
        self.rec = RecordingTransport(on_document=self._on_document, batches=True)
        pub.add_transport(self.rec)
        self.awaiting: list[str] = []
        self.published: dict[str, tuple[dict[str, Any], list[str]]] = {}
        self.schedule_calls = 0
        self.capture_misses = 0
        self.truth: dict[int, tuple[int, int, int, int, int]] = {}
        self.prefilled: dict[str, bool] = {}
        inner = self.sched.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            before = len(self.rec.documents)
            out = inner(*args, **kwargs)
            self.schedule_calls += 1
            if len(self.rec.documents) != before + 1:
                self.capture_misses += 1
            self._note_terms(out)
            return out

        self.sched.schedule = schedule

    def _note_terms(self, out: Any) -> None:
        # The replay's eq. 12 terms, recomputed from vLLM's own objects: a
        # scheduled token is a decode when its request had completed its
        # prompt (or recompute) in an earlier batch since it was (re)admitted.
        s = self.sched
        new = {r.req_id for r in out.scheduled_new_reqs}
        resumed = set(out.scheduled_cached_reqs.resumed_req_ids)
        for rid in out.preempted_req_ids:
            self.prefilled[rid] = False
        pre = dec = dctx = patt = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests[rid]
            c = req.num_computed_tokens - n
            if self.prefilled.get(rid, False) and rid not in new and rid not in resumed:
                dec += n
                dctx += c * n
            else:
                pre += n
                patt += n * c + n * (n + 1) // 2
            self.prefilled[rid] = not req.is_prefill_chunk
        if out.total_num_scheduled_tokens > 0:
            self.truth[self.pub.seq] = (len(out.num_scheduled_tokens), pre, dec, dctx, patt)

    def add_arrivals(self) -> None:
        before = set(self.snaps)
        super().add_arrivals()
        if self.child_target is None:
            self.awaiting.extend(rid for rid in self.snaps if rid not in before)

    def _on_document(self, payload: bytes) -> None:
        if not self.awaiting or self.child_target is not None:
            return
        doc = json.loads(payload)
        ids = [r["id"] for r in doc["requests"]]
        for rid in self.awaiting:
            cut = ids.index(rid)
            self.published[rid] = ({**doc, "requests": doc["requests"][:cut]}, ids[cut:])
        self.awaiting.clear()


def pick_targets(n: int, k: int, seed: int) -> list[str]:
    return [f"r{i}" for i in sorted(random.Random(seed).sample(range(n), min(k, n)))]


def run_config(name: str, requests: int, targets: int, out: Path, model_dir: str) -> None:
    cfg = G.CONFIGS[name]
    workload = G.make_workload(cfg, os.environ.get("BEARSDK_TRACE_DIR", G.DEFAULT_TRACE_DIR))
    workload = workload[:requests]
    tids = pick_targets(len(workload), targets, cfg["wl"]["seed"])
    t0 = time.time()
    d = PluginDriver(cfg, workload, model_dir, tids).run()
    elapsed = time.time() - t0
    ccfg = G.case_config(cfg)
    with open(out / f"{name}.cases.jsonl", "w") as f:
        for rid in tids:
            case = G._case(name, rid, d.snaps[rid], d, ccfg)
            case["reference"] = case.pop("snapshot")
            case["published"], case["tail"] = d.published[rid]
            f.write(json.dumps(case, separators=(",", ":")) + "\n")
    with open(out / f"{name}.docs.ndjson", "wb") as fb:
        for doc in d.rec.documents:
            fb.write(doc + b"\n")
    records = {b[0]: b for b in d.rec.batches}
    mismatch = []
    for seq, terms in d.truth.items():
        b = records.get(seq)
        if b is None or tuple(b[2:7]) != terms:
            mismatch.append({"seq": seq, "truth": terms, "published": b})
    stats = d.pub.stats()
    summary = {
        "config": name,
        "async_scheduling": cfg["async_scheduling"],
        "scheduler_class": type(d.sched).__name__,
        "schedule_calls": d.schedule_calls,
        "capture_misses": d.capture_misses,
        "documents": len(d.rec.documents),
        "captures": stats.captures,
        "failures": stats.failures,
        "last_error": stats.last_error,
        "implementation": stats.implementation,
        "shadow": stats.shadow,
        "mismatches": stats.mismatches,
        "batch_truth": len(d.truth),
        "batch_records": len(d.rec.batches),
        "batch_mismatches": len(mismatch),
        "batch_mismatch_examples": mismatch[:5],
        "batch_durations_positive": all(b[7] > 0 for b in d.rec.batches),
        "targets": len(tids),
        "elapsed_s": round(elapsed, 2),
    }
    (out / f"{name}.summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("config", "documents", "elapsed_s")}), flush=True)


def _stream(port: int, path: str, lines: list[bytes], ready: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    ready.set()
    try:
        while True:
            line = resp.readline()
            if not line:
                break
            lines.append(line.rstrip(b"\n"))
    except (OSError, http.client.HTTPException):
        pass
    finally:
        conn.close()


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def run_transports(out: Path, model_dir: str, requests: int) -> None:
    """The default (threaded) publisher with shm and HTTP, read while the scheduler runs."""
    from bearsdk.io.shm import ShmReader
    from bearsdk.vllm import publisher_of

    seg = Path(tempfile.mkdtemp(prefix="bear-shm-")) / "bear.transports-test"
    env = {
        "BEARSDK_INSTANCE": "transports-test",
        "BEARSDK_PUBLISH_THREAD": "1",
        "BEARSDK_PUBLISH_SHM": str(seg),
        "BEARSDK_PUBLISH_HTTP": "127.0.0.1:0",
        "BEARSDK_HEARTBEAT_S": "0.2",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = G.CONFIGS["c03"]
        workload = G.make_workload(cfg, G.DEFAULT_TRACE_DIR)[:requests]
        G.make_scheduler = plugin_scheduler
        d = G.Driver(cfg, workload, model_dir, targets=(), fork_isolated=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pub = publisher_of(d.sched)
    assert pub is not None
    server = next(t for t in pub.transports if t.name.startswith("http://"))
    port = int(server.port)
    snap_lines: list[bytes] = []
    batch_lines: list[bytes] = []
    threads = []
    for path, lines in (("/bear/snapshots", snap_lines), ("/bear/batches", batch_lines)):
        ready = threading.Event()
        th = threading.Thread(target=_stream, args=(port, path, lines, ready), daemon=True)
        th.start()
        ready.wait(10)
        threads.append(th)
    deadline = time.time() + 5
    while not server.wants_batches and time.time() < deadline:
        time.sleep(0.01)
    d.run()
    # The publisher thread formats the last capture (the idle state) shortly after.
    final_seq = pub.seq
    shm_doc = b""
    with ShmReader(seg) as reader:
        while time.time() < deadline + 10:
            res = reader.read()
            if res.status == "ok" and res.payload is not None:
                shm_doc = bytes(res.payload)
                if json.loads(shm_doc)["seq"] == final_seq:
                    break
            time.sleep(0.005)
    http_doc = _get(port, "/bear/snapshot")
    stats = json.loads(_get(port, "/bear/publisher"))
    time.sleep(0.5)  # a heartbeat or two on the idle streams
    d.sched.shutdown()
    for th in threads:
        th.join(10)
    result = {
        "final_seq": final_seq,
        "shm_doc": json.loads(shm_doc) if shm_doc else None,
        "http_doc": json.loads(http_doc),
        "stats": stats,
        "snapshot_lines": [x.decode() for x in snap_lines],
        "batch_lines": [x.decode() for x in batch_lines],
        "segment_removed": not seg.exists(),
        "streams_ended": not any(th.is_alive() for th in threads),
        "after_close": pub.stats().to_dict(),
    }
    (out / "transports.json").write_text(json.dumps(result))
    print(json.dumps({"transports": len(snap_lines), "batches": len(batch_lines)}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--configs", default="c01,c02,c03,c07", help="comma list of gen_cases configs")
    ap.add_argument("--requests", type=int, default=300, help="first N requests of each workload")
    ap.add_argument("--targets", type=int, default=25, help="sampled arrivals per config")
    ap.add_argument("--transports", action="store_true", help="also run the shm/HTTP check")
    ap.add_argument(
        "--audit",
        default="all",
        help="BEARSDK_PUBLISH_AUDIT: 'all' re-reads every request at every capture and "
        "counts what the shadow counters had wrong; 0 publishes the shadow alone",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["BEARSDK_PUBLISH_THREAD"] = "0"  # inline: every document, fork-safe
    os.environ["BEARSDK_PUBLISH_AUDIT"] = a.audit
    os.environ.setdefault("BEARSDK_INSTANCE", "vllm-plugin-test")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    G._import_vllm()
    model_dir = G.tiny_model_dir()
    for name in [c for c in a.configs.split(",") if c]:
        run_config(name, a.requests, a.targets, out, model_dir)
    if a.transports:
        run_transports(out, model_dir, min(a.requests, 200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
