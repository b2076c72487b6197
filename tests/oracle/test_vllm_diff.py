"""Full differential run against vLLM (marker `oracle`; not in the default run).

python -m pytest -m oracle tests/oracle
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bearsdk.replay import implementations
from oracle import vllm_diff

pytestmark = pytest.mark.oracle


def test_replay_equals_vllm_on_every_case() -> None:
    py = vllm_diff.oracle_python(None)
    cache = Path(tempfile.gettempdir()) / "bearsdk-vllm-oracle-cases"
    cache.mkdir(exist_ok=True)
    if py is None and not all((cache / f"{c}.jsonl").is_file() for c in vllm_diff.ALL):
        pytest.skip("vllm-oracle environment not found (../shared/tools/vllm-oracle/setup.sh)")
    if py is not None:
        vllm_diff.generate(py, vllm_diff.ALL, cache)
    impls = sorted(implementations())
    report = vllm_diff.run(vllm_diff.ALL, cache, impls)
    for impl in impls:
        for mode in ("sync", "async"):
            n, first, batches = vllm_diff.totals(report, impl, mode)
            assert n > 0
            assert first == n, f"{impl} {mode}: first-token batch exact {first}/{n}"
            assert batches == n, f"{impl} {mode}: batches exact {batches}/{n}"
