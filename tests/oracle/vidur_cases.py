#!/usr/bin/env python3
"""Replay cases from Vidur's own replica schedulers, timed with exact batch times.

Ground truth for the decode-context convention of the time model (issue 17,
item 6). Vidur (microsoft/vidur) prices a decode's attention by
``request.num_processed_tokens``, which counts the token being fed: in vLLM's
terms, the context computed before the batch plus the decode token's own key
(``BatchTimeModel(decode_keys="attended")``).

Each case runs a seeded random workload through Vidur's ``VLLMReplicaScheduler``
or ``SarathiReplicaScheduler`` (the classes themselves, imported from a
checkout of Vidur; one pipeline stage), with every batch timed by eq. 12 in
Vidur's own terms: ``b0 + b1 * max(tokens, tau) + b2 * sum(num_processed_tokens
of its decodes) + b3 * sum(t*c + t*(t+1)/2 of its prefill chunks)``. At a random
batch boundary it exports the scheduler's state as a ``bear.snapshot/1``
document, adds a new request, stops every later arrival, and runs on until
Vidur completes the new request's prefill (its first token). It records
Vidur's batches from the snapshot to there (in eq. 12's aggregates, the decode
context counted before the batch, as bearsdk's records count it) and the TTFT:
the sum of their times.

``tests/test_vidur_cases.py`` replays a committed sample on both twins. Only
Vidur's scheduler and entity modules are imported (the rest of Vidur and its
dependencies are stood in for); run it with bearsdk's environment::

    git clone https://github.com/microsoft/vidur VIDUR
    python tests/oracle/vidur_cases.py --vidur VIDUR --cases 400 \\
        --out tests/data/vidur_cases.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import random
import sys
import types
from pathlib import Path
from typing import Any

import orjson

SCHEDULERS = {"vidur-vllm": "vllm", "vidur-sarathi": "sarathi"}
# Coefficients of a mid-size GPU (s, s/token, s/context token, s/attention unit);
# b2 is large enough that the convention is seen, as it is on real GPUs (73 ns
# per context token for Qwen3-8B on an H100).
COEFFS = (4.0e-3, 2.2e-5, 7.3e-8, 1.5e-9, 0.0)


def load_vidur(root: Path) -> dict[str, type]:
    """Vidur's two replica schedulers and its Request, from a checkout at ``root``.

    The package's ``__init__`` modules pull in its simulator, configs and
    plotting stack; the scheduler modules need only the entity and logger
    modules, so everything else is stood in for by empty modules.
    """
    pkg = root / "vidur"
    if not (pkg / "scheduler" / "replica_scheduler" / "vllm_replica_scheduler.py").is_file():
        raise SystemExit(f"--vidur: {root} is not a checkout of microsoft/vidur")

    def stub(name: str, path: Path | None = None, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        if path is not None:
            mod.__path__ = [str(path)]
        for k, v in attrs.items():
            setattr(mod, k, v)
        sys.modules[name] = mod
        return mod

    sys.path.insert(0, str(root))
    stub("vidur", pkg)
    ents = stub("vidur.entities", pkg / "entities")
    stub(
        "vidur.config",
        BaseReplicaSchedulerConfig=object,
        BaseRequestGeneratorConfig=object,
        ReplicaConfig=object,
    )
    stub("vidur.execution_time_predictor", BaseExecutionTimePredictor=object)
    stub("vidur.scheduler", pkg / "scheduler")
    stub("vidur.scheduler.replica_scheduler", pkg / "scheduler" / "replica_scheduler")
    stub("vidur.scheduler.replica_stage_scheduler", ReplicaStageScheduler=object)
    stub("vidur.scheduler.utils", pkg / "scheduler" / "utils")
    stub("vidur.scheduler.utils.memory_planner", MemoryPlanner=object)
    request = importlib.import_module("vidur.entities.request")
    batch = importlib.import_module("vidur.entities.batch")
    ents.Request = request.Request
    ents.Batch = batch.Batch
    ents.Replica = object
    rs = "vidur.scheduler.replica_scheduler."
    vllm = importlib.import_module(rs + "vllm_replica_scheduler")
    sarathi = importlib.import_module(rs + "sarathi_replica_scheduler")
    return {
        "vllm": vllm.VLLMReplicaScheduler,
        "sarathi": sarathi.SarathiReplicaScheduler,
        "Request": request.Request,
        "Batch": batch.Batch,
    }


def make_scheduler(cls: type, cfg: types.SimpleNamespace) -> Any:
    """A replica scheduler with one pipeline stage, set up as its ``__init__`` does
    (which needs Vidur's memory planner and configs only to size the pool)."""
    s = cls.__new__(cls)
    s._config = cfg
    s._replica_id = 0
    s._num_stages = 1
    s._max_batch_size = cfg.batch_size_cap
    s._request_queue = []
    s._num_allocated_blocks = 0
    s._allocation_map = {}
    s._preempted_requests = []
    s._num_running_batches = 0
    s._max_micro_batch_size = cfg.batch_size_cap
    s._watermark_blocks = int(cfg.watermark_blocks_fraction * cfg.num_blocks)
    return s


def batch_time(batch: Any, c: tuple[float, ...]) -> tuple[float, list[int]]:
    """Eq. 12 in Vidur's terms, and the batch's aggregates as bearsdk records them."""
    pre = dec = dctx_before = patt = attended = 0
    for r, n in zip(batch.requests, batch.num_tokens, strict=True):
        p = r.num_processed_tokens
        if r.is_prefill_complete:
            dec += n
            attended += p  # Vidur's decode KV size
            dctx_before += p - 1  # what vLLM has computed before the batch
        else:
            pre += n
            patt += n * p + n * (n + 1) // 2
    t = c[0] + c[1] * max(pre + dec, c[4]) + c[2] * attended + c[3] * patt
    return t, [len(batch.requests), pre, dec, dctx_before, patt]


class Run:
    """One seeded workload on one Vidur scheduler, event by event (one stage)."""

    def __init__(self, v: dict[str, type], kind: str, cfg: types.SimpleNamespace) -> None:
        self.v = v
        self.s = make_scheduler(v[kind], cfg)
        self.t = 0.0
        self.orig: dict[int, tuple[int, int]] = {}  # id -> (prompt, outputs wanted)
        self.prefill: dict[int, int] = {}  # id -> the longest prefill it has had
        self._cut = False

    def add(self, arrived_at: float, prompt: int, outputs: int) -> Any:
        r = self.v["Request"](arrived_at, prompt, outputs)
        self.orig[r.id] = (prompt, outputs)
        self.s.add_request(r)
        return r

    def step(self) -> tuple[Any, float, list[int]] | None:
        """Schedule and run one batch to its end; ``None`` if nothing is scheduled."""
        batches = self.s.on_schedule()
        if not batches:
            return None
        (b,) = batches
        b.on_schedule(self.t)
        dt, agg = batch_time(b, COEFFS)
        self.t += dt
        b.on_batch_end(self.t)
        self.s.on_batch_end(b)
        for r in self.requests():
            was = self.prefill.get(r.id, 0)
            self._cut = self._cut or r.num_prefill_tokens < was
            self.prefill[r.id] = max(was, r.num_prefill_tokens)
        return b, dt, agg

    def restarts(self) -> int:
        """Preemptions so far (``Request.restart``), over every request."""
        return sum(r._num_restarts for r in self.requests())

    def truncated(self) -> bool:
        """Whether a restart cut a request's prefill: Vidur restarts a request
        part-way through its prefill (or its recompute) with only the tokens it
        has processed as its new prompt, the rest to be generated again. No vLLM
        engine loses tokens so (a preempted request keeps its prompt and its
        outputs), so the run is not one bearsdk's specs model."""
        return self._cut

    def requests(self) -> list[Any]:
        s = self.s
        return list(s._request_queue) + list(s._preempted_requests)

    def row(self, r: Any, running: bool) -> dict[str, Any]:
        prompt, wanted = self.orig[r.id]
        p = r.num_processed_tokens
        if running and r.is_prefill_complete:
            computed, outputs = p - 1, p - prompt
        else:
            # Waiting, or part-way through its (re)prefill: a restart made its
            # outputs part of the prefill (Request.restart).
            computed, outputs = (p if running else 0), r.num_prefill_tokens - prompt
        return {
            "id": f"r{r.id}",
            "state": "running" if running else "waiting",
            "prompt_tokens": prompt,
            "computed_tokens": computed,
            "output_tokens": outputs,
            "output_len": wanted,
        }

    def snapshot(self) -> dict[str, Any]:
        s = self.s
        held = set(s._allocation_map)
        running = [r for r in s._preempted_requests if r.id in held]
        assert len(running) == len(held), "a request holds blocks outside the running list"
        return {
            "schema": "bear.snapshot/1",
            "instance": "vidur",
            "seq": 1,
            "time": 1000.0,
            "kv": {
                "block_size": s._config.block_size,
                "num_blocks": s._config.num_blocks,
                "free_blocks": s._config.num_blocks - s._num_allocated_blocks,
            },
            "requests": [self.row(r, True) for r in running]
            + [self.row(r, False) for r in s._request_queue],
        }


def draw_config(rng: random.Random, kind: str) -> tuple[types.SimpleNamespace, dict[str, Any]]:
    bs = rng.choice((4, 16))
    cap = rng.choice((8, 32, 128))
    scarce = rng.random() < 0.4
    num_blocks = rng.randint(40, 160) if scarce else rng.randint(2_000, 8_000)
    wm = rng.choice((0.0, 0.01, 0.05))
    params: dict[str, Any] = {
        "block_size": bs,
        "num_blocks": num_blocks,
        "batch_size_cap": cap,
        "watermark_blocks_fraction": wm,
        "max_model_len": 1 << 16,
    }
    if kind == "sarathi":
        params["chunk_size"] = rng.choice((64, 256, 512))
        # (bearsdk's spec refuses more sequences than tokens in a batch)
        cap = params["batch_size_cap"] = min(cap, params["chunk_size"])
    else:
        # Prefill-only batches are padded (sequences x longest prompt): every
        # request, restarted with its outputs, fits one (prompts <= 900 tokens,
        # outputs <= 300). Vidur caps nothing by length; bearsdk caps by
        # max_model_len, which is then never reached.
        params["max_tokens_in_batch"] = params["max_model_len"] = rng.choice((2048, 4096))
    cfg = types.SimpleNamespace(
        block_size=bs,
        num_blocks=num_blocks,
        batch_size_cap=cap,
        watermark_blocks_fraction=wm,
        chunk_size=params.get("chunk_size", 0),
        max_tokens_in_batch=params.get("max_tokens_in_batch", 0),
    )
    return cfg, params


def one_case(
    v: dict[str, type], spec: str, seed: int, max_batches: int = 20_000
) -> dict[str, Any] | None:
    """A case, or ``None`` when the drawn run cannot host one: Vidur does not
    complete the new request's prefill within ``max_batches``, or a restart cut
    a prompt (:meth:`Run.truncated`)."""
    rng = random.Random(seed)
    kind = SCHEDULERS[spec]
    cfg, params = draw_config(rng, kind)
    run = Run(v, kind, cfg)
    most = cfg.num_blocks * cfg.block_size // 3  # a request the pool can always take
    cap_len = max(2, min(most, 1_500)) if kind == "sarathi" else max(2, min(most, 900))
    n = rng.randint(3, 60)
    rate = rng.choice((5.0, 20.0, 80.0))
    t = 0.0
    arrivals = []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append((t, rng.randint(1, cap_len), rng.randint(1, 300)))
    stop_after = rng.randint(0, 4 * n)
    steps = 0
    while True:
        while arrivals and arrivals[0][0] <= run.t:
            run.add(*arrivals.pop(0))
        if steps >= stop_after:
            break
        if run.step() is None:
            if not arrivals:
                break
            run.t = arrivals[0][0]
            continue
        steps += 1
    if run.truncated():
        return None
    snap = run.snapshot()
    new_prompt, new_out = rng.randint(1, cap_len), rng.randint(1, 50)
    start = run.t
    before = run.restarts()
    new = run.add(start, new_prompt, new_out)
    batches = []
    for _ in range(max_batches):
        got = run.step()
        if got is None or run.truncated():
            return None
        batches.append(got[2])
        if new.is_prefill_complete:
            return {
                "scheduler": spec,
                "params": params,
                "seed": seed,
                "snapshot": snap,
                "new": {"prompt_tokens": new_prompt, "output_len": new_out},
                "coeffs": list(COEFFS),
                "vidur_batches": batches,
                "vidur_ttft_s": run.t - start,
                "restarts": run.restarts() - before,
            }
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vidur", type=Path, required=True, help="a checkout of microsoft/vidur")
    ap.add_argument("--cases", type=int, default=400, help="cases per scheduler")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batches", type=int, default=20_000, help="longest window kept (batches)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL (.gz to compress)")
    args = ap.parse_args(argv)
    v = load_vidur(args.vidur)
    out: list[bytes] = []
    skipped: dict[str, int] = {}
    for spec in SCHEDULERS:
        seed, got = args.seed * 1_000_000, 0
        while got < args.cases:
            case = one_case(v, spec, seed, args.max_batches)
            seed += 1
            if case is not None:
                out.append(orjson.dumps(case))
                got += 1
        skipped[spec] = seed - args.seed * 1_000_000 - got
    data = b"\n".join(out) + b"\n"
    if args.out.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    args.out.write_bytes(data)
    print(f"{len(out)} cases -> {args.out}; runs left out (cut prefills, no first token):")
    for spec, n in skipped.items():
        print(f"  {spec}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
