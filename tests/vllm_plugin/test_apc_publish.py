"""The plugin with prefix caching on, on vLLM 0.33's real scheduler (marker ``vllm``).

    .venv/bin/python -m pytest -m vllm tests/vllm_plugin/test_apc_publish.py

``apc_publish.py`` runs under the vllm-oracle interpreter (skipped cleanly when
it is absent): the seeded shared-prefix workloads of ``tests/oracle/apc_workloads.py``
under every prefix-caching engine configuration of ``tests/oracle/apc_sweep.py``
(roomy and scarce KV with evictions and preemptions, async scheduling, a
prefill threshold, a watermark, block size 32, chunked prefill off), through
``BearSyncScheduler`` / ``BearAsyncScheduler``. Here bearsdk checks what the
plugin published: every document validates and carries ``kv.prefix_cache``;
as a replay input it equals ``apc_cases.export()`` (the oracle's from-scratch
walk of vLLM's pool) of the same state, at every step; the plugin's tracker
equals one rebuilt from scratch after every ``schedule()`` and
``update_from_output()``; and the published snapshots at random steps replay
(bearsdk's pure twin, with the pool) to the batches vLLM then formed, to the
new request's first token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from oracle.apc_replay import check
from oracle.vllm_diff import oracle_python

from bearsdk.snapshot import decode_snapshot, snapshot_from_dict

from ._apc_canon import canonical

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 900


def _has_vllm(py: Path) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(py), "-c", probe], check=False).returncode == 0


def _run(py: Path, out: Path, *args: str, **env: str) -> None:
    cmd = [str(py), str(HERE / "apc_publish.py"), *args, "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=TIMEOUT_S, env={**os.environ, **env}, stdout=sys.stderr)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = oracle_python(None)
    if py is None:
        pytest.skip("vllm-oracle environment not found (../shared/tools/vllm-oracle/setup.sh)")
    if not _has_vllm(py):
        pytest.skip(f"vllm is not importable by {py}")
    out = tmp_path_factory.mktemp("apc-publish")
    _run(py, out, "steps", "--seeds", "2")
    _run(py, out / "threaded", "steps", "--seeds", "1", BEARSDK_PUBLISH_THREAD="1")
    _run(py, out / "python", "steps", "--seeds", "1", BEARSDK_PUBLISH_IMPL="python")
    _run(py, out, "cases", "--seeds", "1", "--per-run", "3")
    return out


def _steps(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "steps.json").read_text()))


@pytest.mark.parametrize("variant", [".", "threaded", "python"])
def test_every_document_is_the_oracles_state(run_dir: Path, variant: str) -> None:
    s = _steps(run_dir / variant)
    assert s["failures"] == 0
    assert s["skipped"] == 0
    assert not s["invalid"], s["invalid"]
    assert s["with_extension"] == s["documents"] > 0
    assert not s["diffs"], s["diffs"]
    # Every schedule() of the inline runs was compared; a publisher thread
    # coalesces (it formats the latest capture), so it publishes fewer.
    if variant == "threaded":
        assert s["compared"] >= 0.25 * s["steps"]
    else:
        assert s["compared"] == s["steps"]
    assert s["threaded"] == (variant == "threaded")


def test_tracker_equals_a_walk_of_the_pool(run_dir: Path) -> None:
    s = _steps(run_dir)
    assert not s["tracker_diffs"], s["tracker_diffs"]
    assert s["tracker_checks"] == 2 * s["steps"]
    assert s["rebuilds"] == 0, "an observed change failed to apply"
    # The workloads reached the paths that matter.
    assert s["evicting_runs"] > 0
    assert s["preempting_runs"] > 0
    assert s["duplicate_steps"] > 0


def _cases(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "cases.jsonl") as f:
        return [json.loads(line) for line in f]


def test_published_snapshot_is_the_oracles_at_random_steps(run_dir: Path) -> None:
    cases = _cases(run_dir)
    assert len(cases) >= 60
    for case in cases:
        assert case["failures"] == 0, case["name"]
        pub = case["published"]
        decode_snapshot(json.dumps(pub).encode())
        assert canonical(pub) == canonical(case["reference"]), case["name"]


def test_published_snapshot_replays_to_vllms_batches(run_dir: Path) -> None:
    bad = []
    asyncs = 0
    for case in _cases(run_dir):
        pub = case["published"]
        lengths = case["output_len"]
        snap = {**pub, "requests": [{**r, "output_len": lengths[r["id"]]} for r in pub["requests"]]}
        assert snapshot_from_dict(snap).prefix_cache is not None
        diff = check({**case, "snapshot": snap})
        if diff is not None:
            bad.append((case["name"], diff))
        asyncs += bool(case["config"]["use_async"])
    assert not bad, bad[:5]
    assert asyncs > 0
