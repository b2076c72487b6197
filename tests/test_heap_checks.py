"""The compiled modules never write past a block they allocated.

A write a few bytes past a ``malloc`` block corrupts the heap silently and
aborts a later ``free`` (inside vLLM's engine process, for the publisher), so
equal answers from both twins prove nothing about it. glibc's checking
allocator (``libc_malloc_debug.so`` with ``MALLOC_CHECK_=3``) aborts at the
``free`` of an overrun block instead: each test runs compiled code in a
subprocess under it. The publisher's formatters get the inputs that need the
most room (ids and names made of control characters, each escaped to six
bytes; integers at both ends of int64); the snapshot decoders, caches, both
replays (the block-level one with ``kv.prefix_cache``) and a router get the
fuzz bench's payloads, hostile and valid.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from bearsdk.replay import implementations as replays
from bearsdk.vllm import implementations

CHECKER = next(
    iter(
        sorted(
            glob.glob("/lib/*/libc_malloc_debug.so.0")
            + glob.glob("/usr/lib/*/libc_malloc_debug.so.0")
            + glob.glob("/lib64/libc_malloc_debug.so.0")
        )
    ),
    None,
)

PUBLISHER = r"""
import numpy as np
from bearsdk.vllm import _pub_c as c

class Req:
    def __init__(self, rid, computed):
        self.request_id = rid
        self.num_prompt_tokens = 2**31 - 1
        self.num_computed_tokens = computed
        self._output_token_ids = [7] * 3
        self.max_tokens = 2**31 - 1
        self.num_output_placeholders = 2
        self.is_prefill_chunk = False
        self.resumable = False

worst = ["\x01" * k for k in range(0, 200)] + ['"\\' * k for k in range(1, 100)]
for s in worst:
    c.id_fragment(s)
    c.json_head(s, s[::-1])
ints = np.array([-(2**63), 2**63 - 1, 0, -1] * 50, dtype=np.int64)
for k in range(len(ints) + 1):
    c.json_ints(ints[:k])
cap = c.Capture(worst[-1], worst[150], 16, 1000, True, False, False, 8, 200.0)
running = [Req(s + str(i), 2**31 - 1) for i, s in enumerate(worst[1:120])]
waiting = [Req(s + "w" + str(i), 0) for i, s in enumerate(worst[120:])]
for seq in range(3):
    cap.capture(running, (waiting,), 2**62, 1.7976931348623157e308, -5, 1e-300)
    cap.encode()
    bytes(cap.payload())
print("clean")
"""


FUZZ = r"""
from bearsdk.bench.fuzz import Harness, Tally, payload

h = Harness(twin_every=1)
t = Tally()
for i in range(300):
    h.check(payload(11, i), i, t)
assert t.escapes == 0 and t.other == 0 and t.lost_good == 0, t.examples
print("clean")
"""


def _under_checker(script: str) -> None:
    env = {**os.environ, "MALLOC_CHECK_": "3", "LD_PRELOAD": str(CHECKER)}
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    assert res.stdout.strip() == "clean", res.stdout


pytestmark = [
    pytest.mark.once,  # (compiled code, whichever twins the pass selects)
    pytest.mark.skipif(CHECKER is None, reason="no glibc checking allocator (libc_malloc_debug)"),
]


@pytest.mark.skipif("cython" not in implementations(), reason="compiled capture not built")
def test_the_publisher_formatters_stay_inside_their_blocks() -> None:
    _under_checker(PUBLISHER)


@pytest.mark.skipif("cython" not in replays(), reason="compiled replay not built")
def test_hostile_snapshots_stay_inside_their_blocks() -> None:
    _under_checker(FUZZ)
