#!/usr/bin/env python3
"""bearsdk's KV-event index fed by vLLM 0.33's own block pool, checked against it.

Runs the prefix-caching workloads of ``apc_workloads`` through vLLM's real
scheduler (``apc_drive.Driver``) with KV cache events on; after every step the
events vLLM queued (``kv_cache_manager.take_events()``, exactly what its
publisher sends) are encoded by vLLM's own msgspec structs, decoded by
``bearsdk.kvevents.wire`` and applied to a ``PrefixIndex``. Then, for every
request vLLM holds, the index's answer for the request's token ids must be
vLLM's own: the hashes of its leading blocks in vLLM's cache, named as the
bearsdk vLLM publisher names them (last 8 bytes). Runs under the vllm-oracle's
virtualenv, with this repository (and its ``.venv``'s packages) on the path.

    HF_HUB_OFFLINE=1 $ORACLE_PY tests/oracle/kvevents_vllm.py [--seeds 3]

vLLM 0.33 publishes a block hash as an int by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the hash's last 8 bytes) and as
bytes with ``=0``; the publisher names a block by the same last 8 bytes, so
either form maps (run it both ways). With asynchronous scheduling a check can
run before the events of a step just scheduled are published (vLLM publishes
after its outputs): a few lag.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
# bearsdk's own dependencies the oracle lacks (attrs, ...), after the oracle's.
sys.path.extend(glob.glob(str(REPO / ".venv" / "lib" / "python3*" / "site-packages")))

import apc_drive  # noqa: E402
import apc_sweep  # noqa: E402
import msgspec  # noqa: E402
from vllm.distributed.kv_events import KVEventBatch  # noqa: E402

from bearsdk.kvevents.index import PrefixIndex, hash_key  # noqa: E402
from bearsdk.kvevents.wire import decode_batch  # noqa: E402
from bearsdk.replay.blocks import chain_keys  # noqa: E402


def run(cfg: dict[str, Any], workload: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Drive one workload; ``(checks, agreeing, events)``."""

    d = apc_drive.Driver(cfg, workload)
    mgr = d.sched.kv_cache_manager
    pool = mgr.block_pool
    pool.enable_kv_cache_events = True
    mgr.enable_kv_cache_events = True
    sent: list[KVEventBatch] = []

    class Collect:
        """Stands for vLLM's ZmqEventPublisher: the batches update_from_output sends."""

        def publish(self, batch: KVEventBatch) -> None:
            sent.append(batch)

    d.sched.kv_event_publisher = Collect()
    bs = d.cfg["block_size"]
    idx = PrefixIndex(bs, 10 * d.cfg["num_blocks"])
    enc = msgspec.msgpack.Encoder()
    checks = agree = n_events = 0
    while d.iterate():
        for batch in sent:
            n_events += len(batch.events)
            idx.apply(decode_batch(enc.encode(batch)))
        sent.clear()
        cached = pool.cached_block_hash_to_block._cache
        for req in list(d.sched.requests.values()):
            hashes = list(req.block_hashes)
            n = 0
            while n < len(hashes) and any(
                bytes(k)[: len(bytes(hashes[n]))] == bytes(hashes[n])
                for k in _keys_for(cached, hashes[n])
            ):
                n += 1
            want = [hash_key(bytes(h)) for h in hashes[:n]]
            got = idx.engine_keys(chain_keys(list(req.all_token_ids), bs))
            checks += 1
            agree += got == want
    return checks, agree, n_events


def _keys_for(cached: dict[Any, Any], h: Any) -> list[Any]:
    # The map is keyed by the hash with its group id appended: group 0 here.
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    k = make_block_hash_with_group_id(h, 0)
    return [k] if k in cached else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args(argv)
    total = ok = events = 0
    for wname, w in apc_sweep.workloads(a.seeds, None):
        for cname in ("scarce", "scarce-async", "roomy", "bs32"):
            try:
                c, g, e = run(apc_sweep.CONFIGS[cname], w)
            except (RuntimeError, ValueError) as exc:
                print(f"{wname}@{cname}: skipped ({exc})")
                continue
            total, ok, events = total + c, ok + g, events + e
            print(f"{wname}@{cname}: {g}/{c} lookups agree ({e} events)", flush=True)
    print(f"all: {ok}/{total} lookups agree, {events} events")
    return 0 if ok == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
