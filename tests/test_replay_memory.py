"""The replay survives hostile sizes and failing allocations (issue 19, defects 1, 3 and 5).

A replay may be called directly, with values no snapshot validator has seen:
every size is bounded before it reaches an allocation or 64-bit arithmetic,
both implementations refuse the same inputs with the same ``ValueError``, and
an allocation that fails raises ``MemoryError`` and leaves the replayer usable.
The malloc-failure checks run in a subprocess under an address-space limit, so
a crash there fails the test instead of killing pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import attrs
import numpy as np
import pytest

from bearsdk.replay import implementations
from bearsdk.replay.types import MAX_TOKENS
from bearsdk.schedulers import get_scheduler

COEFFS = (0.003, 2e-5, 5e-8, 1e-10)
IMPLS = sorted(implementations())
needs_compiled = pytest.mark.skipif("cython" not in IMPLS, reason="compiled replay not built")


def _replayer(impl: str, **over: object):  # type: ignore[no-untyped-def]
    pol = get_scheduler("vllm-v1").bind({"async_scheduling": True, "block_size": 16})
    # attrs.evolve skips the spec's own bounds: the replay must hold on its own.
    return implementations()[impl](attrs.evolve(pol, **over))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [0, 4097, 2**27, 2**61, 10**18, 2**63 - 1])
def test_absurd_block_sizes_are_refused_before_any_allocation(impl: str, block_size: int) -> None:
    # 8 * 2**61 wraps to 0 in size_t: the compiled loop once allocated that and
    # wrote past it (heap corruption, abort); 2**27 took 3 GB and seconds.
    want = rf"block_size must be in \[1, 4096\] \(got {block_size}\)"
    with pytest.raises(ValueError, match=want):
        _replayer(impl, block_size=block_size)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("field", "value"),
    [("token_budget", 2**62), ("max_seqs", 0), ("num_blocks", 2**63), ("max_model_len", -1)],
)
def test_absurd_policy_sizes_are_refused(impl: str, field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be in .* \(got {value}\)"):
        _replayer(impl, **{field: value})


def _running(placeholders: int, prompt: int = 10) -> np.ndarray:
    # A decode whose placeholders are counted in computed_tokens, as the contract says.
    row = [0, prompt, prompt + placeholders - 1, 0, -1, 3, placeholders]
    return np.array([row], dtype=np.int64)


@needs_compiled
@pytest.mark.parametrize("placeholders", [2**31, 2**31 + 7, 2**32 + 1, 2**39])
def test_placeholders_beyond_int32_are_not_truncated(placeholders: int) -> None:
    # The compiled loop kept placeholders in an int32: 2**31 wrapped negative
    # and the twins answered 0.008 s and 214 s for the same snapshot.
    out = {}
    for impl in IMPLS:
        rp = _replayer(impl)
        res = rp.replay(rp.prepare(_running(placeholders)), 5, 2, COEFFS, record=True)
        out[impl] = (res.first_token_batch, res.stop_reason, res.batches, res.ttft_s)
    assert out["cython"] == out["python"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("col", "value", "name"),
    [
        (6, MAX_TOKENS + 1, "placeholders"),
        (1, 2**62, "prompt_tokens"),
        (3, -5, "output_tokens"),
        (5, 2**63 - 1, "output_len"),
        (0, 7, "state"),
    ],
)
def test_table_counts_out_of_range_are_refused_alike(
    impl: str, col: int, value: int, name: str
) -> None:
    table = np.array([[0, 10, 9, 1, -1, 3, 1]], dtype=np.int64)
    table[0, col] = value
    rp = _replayer(impl)
    with pytest.raises(ValueError, match=rf"row 0: {name} must be in .*\(got {value}\)"):
        rp.prepare(table)


@pytest.mark.parametrize("impl", IMPLS)
def test_more_computed_than_tokens_is_refused(impl: str) -> None:
    rp = _replayer(impl)
    with pytest.raises(ValueError, match=r"row 0: computed_tokens must be <= .* \(got 12 > 11\)"):
        rp.prepare(np.array([[0, 10, 12, 1, -1, 3, 0]], dtype=np.int64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("prompt_tokens", 0),
        ("prompt_tokens", 2**63),
        ("output_len", 2**64),
        ("max_tokens", 2**41),
        ("max_batches", 2**70),
    ],
)
def test_new_request_sizes_out_of_range_are_refused_alike(impl: str, arg: str, value: int) -> None:
    rp = _replayer(impl)
    prep = rp.prepare(_running(1))
    kwargs: dict[str, object] = {
        "prompt_tokens": 5,
        "output_len": 2,
        "max_tokens": -1,
        "max_batches": 100,
    }
    kwargs[arg] = value
    with pytest.raises(ValueError, match=rf"{arg} must be .* \(got {value}\)"):
        rp.replay(prep, coeffs=COEFFS, **kwargs)  # type: ignore[arg-type]


_UNDER_LIMIT = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from bearsdk.replay import implementations
    from bearsdk.schedulers import get_scheduler

    def vm_bytes():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    pol = get_scheduler("vllm-v1").bind(
        {"async_scheduling": False, "block_size": 16, "max_num_seqs": 1}
    )
    rp = implementations()["cython"](pol)
    small = np.array([[0, 20, 24, 5, -1, 40, 0]], dtype=np.int64)
    coeffs = (0.003, 2e-5, 5e-8, 1e-10)
    want = rp.replay(rp.prepare(small), 8, 4, coeffs, record=True)

    # A snapshot of many waiting requests: its table and prepared state fit,
    # the replay's own buffers (several times larger) do not.
    n = 1_500_000
    big = np.zeros((n, 7), dtype=np.int64)
    big[:, 0] = 1
    big[:, 1] = 10
    big[:, 4] = -1
    big[:, 5] = 3
    prep = rp.prepare(big)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (64 << 20), resource.RLIM_INFINITY))
    try:
        rp.ttft(prep, 8, 4, coeffs)
    except MemoryError:
        print("ensure: MemoryError")
    else:
        print("ensure: no error")
    # The replayer still works on what fits (it once kept the old capacity
    # with NULL buffers and crashed here).
    again = rp.replay(rp.prepare(small), 8, 4, coeffs, record=True)
    print("after ensure:", "same" if again == want else f"different {again} {want}")

    # The batch log grows inside the nogil loop: one decode with 4M tokens to go
    # holds the only seat, so the new request waits behind ~4M recorded batches.
    long_run = np.array([[0, 20, 20, 1, -1, 4_000_000, 0]], dtype=np.int64)
    try:
        rp.replay(rp.prepare(long_run), 8, 4, coeffs, record=True, max_batches=5_000_000)
    except MemoryError:
        print("log: MemoryError")
    else:
        print("log: no error")
    again = rp.replay(rp.prepare(small), 8, 4, coeffs, record=True)
    print("after log:", "same" if again == want else f"different {again} {want}")
    """
)


@needs_compiled
def test_allocation_failures_raise_memory_error_and_keep_the_replayer_usable() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMIT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"
    assert proc.stdout.split("\n")[:4] == [
        "ensure: MemoryError",
        "after ensure: same",
        "log: MemoryError",
        "after log: same",
    ], proc.stdout + proc.stderr[-2000:]
