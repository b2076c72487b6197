"""The plugin on vLLM 0.33's real scheduler (marker ``vllm``; not in the default run).

    .venv/bin/python -m pytest -m vllm tests/vllm_plugin

``driver.py`` runs under the vllm-oracle interpreter (found like
``tests/oracle/vllm_diff.py`` finds it: ``BEARSDK_VLLM_ORACLE`` or the default
locations; skipped cleanly when absent or without vLLM). It builds
``bearsdk.vllm.BearScheduler`` the way vLLM's engine core builds
``--scheduler-cls``, drives the oracle's 13 workloads (first 300 requests
each) with fabricated model outputs, and records every document the plugin
publishes. Here bearsdk checks them: each is a valid ``bear.snapshot/1``, one
per ``schedule()`` call, equal to the oracle's own capture, and its replay
predicts vLLM's first-token batch exactly, sync and async.

The main run re-reads every request at every capture (``--audit all``) and
counts every counter the shadow copy had wrong: none may be. Two more runs
publish the shadow alone (``--audit 0``) and use the pure-Python capture; both
must publish the very same documents.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from oracle.compare import replay_case
from oracle.vllm_diff import oracle_python

from bearsdk.estimators.batch_time import read_batches
from bearsdk.snapshot import decode_snapshot

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
CONFIGS = [f"c{i:02d}" for i in range(1, 14)]
TWIN_CONFIGS = ["c02", "c03"]  # preemptions, sync and async: rerun with the Python capture
SHADOW_CONFIGS = ["c02", "c03", "c07", "c12"]  # rerun publishing the shadow counters alone
REQUESTS = 300
TARGETS = 25
TIMEOUT_S = 900


def _has_vllm(py: Path) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(py), "-c", probe], check=False).returncode == 0


def _drive(py: Path, out: Path, configs: list[str], targets: int, *extra: str, **env: str) -> None:
    cmd = [
        str(py),
        str(HERE / "driver.py"),
        "--configs",
        ",".join(configs),
        "--requests",
        str(REQUESTS),
        "--targets",
        str(targets),
        "--out",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, check=True, timeout=TIMEOUT_S, env={**os.environ, **env}, stdout=sys.stderr)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = oracle_python(None)
    if py is None:
        pytest.skip("vllm-oracle environment not found (../shared/tools/vllm-oracle/setup.sh)")
    if not _has_vllm(py):
        pytest.skip(f"vllm is not importable by {py}")
    out = tmp_path_factory.mktemp("vllm-plugin")
    _drive(py, out, CONFIGS, TARGETS, "--transports", "--audit", "all")
    _drive(py, out / "python", TWIN_CONFIGS, 5, BEARSDK_PUBLISH_IMPL="python")
    _drive(py, out / "shadow", SHADOW_CONFIGS, 5, "--audit", "0")
    return out


def _summary(run_dir: Path, name: str) -> dict[str, Any]:
    return dict(json.loads((run_dir / f"{name}.summary.json").read_text()))


def _cases(run_dir: Path, name: str) -> Iterator[dict[str, Any]]:
    with open(run_dir / f"{name}.cases.jsonl") as f:
        for line in f:
            yield json.loads(line)


def _rows(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (
            r["id"],
            r["state"],
            r["prompt_tokens"],
            r["computed_tokens"],
            r["output_tokens"],
            r.get("max_tokens"),
            r.get("placeholders", 0),
        )
        for r in doc["requests"]
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_loads_through_scheduler_cls(run_dir: Path, name: str) -> None:
    s = _summary(run_dir, name)
    want = "BearAsyncScheduler" if s["async_scheduling"] else "BearSyncScheduler"
    assert s["scheduler_class"] == want
    assert s["implementation"] == "cython"
    assert s["shadow"]


@pytest.mark.parametrize("name", CONFIGS)
def test_publishes_every_step(run_dir: Path, name: str) -> None:
    s = _summary(run_dir, name)
    assert s["failures"] == 0, s["last_error"]
    assert s["mismatches"] == 0, "the shadow counters disagreed with vLLM's"
    assert s["capture_misses"] == 0, "a schedule() call without exactly one document"
    assert s["documents"] == s["captures"] >= s["schedule_calls"] > 0
    seqs = []
    epochs = set()
    with open(run_dir / f"{name}.docs.ndjson", "rb") as f:
        for line in f:
            snap = decode_snapshot(line)  # every document is a valid bear.snapshot/1
            seqs.append(snap.seq)
            epochs.add(snap.epoch)
            assert snap.kv is not None
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(epochs) == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_published_snapshot_is_the_oracles(run_dir: Path, name: str) -> None:
    n = 0
    for case in _cases(run_dir, name):
        pub, ref = case["published"], case["reference"]
        assert _rows(pub) == _rows(ref), case["case_id"]
        assert pub["kv"] == ref["kv"], case["case_id"]
        # Only the target and arrivals of the same step after it were cut off.
        assert case["tail"][0] == case["new"]["id"], case["case_id"]
        n += 1
    assert n == TARGETS


@pytest.mark.parametrize("name", CONFIGS)
def test_replay_of_published_snapshot_predicts_first_token(
    run_dir: Path, name: str, impl: str
) -> None:
    bad = []
    for case in _cases(run_dir, name):
        pub = case["published"]
        # ignore_eos workloads: every request runs to max_tokens, what a perfect
        # output-length predictor would say; the plugin never publishes output_len.
        assert all("output_len" not in r for r in pub["requests"])
        snap = {**pub, "requests": [{**r, "output_len": r["max_tokens"]} for r in pub["requests"]]}
        res = replay_case(
            {
                "case_id": case["case_id"],
                "config": case["config"],
                "snapshot": snap,
                "new": case["new"],
            },
            impl,
        )
        if res.first_token_batch != case["isolated_first_token_batch"]:
            bad.append((case["case_id"], res.first_token_batch, case["isolated_first_token_batch"]))
    assert not bad, f"replay != vLLM (case, replay, vLLM): {bad[:5]}"


@pytest.mark.parametrize("name", CONFIGS)
def test_batch_records_match_vllm(run_dir: Path, name: str) -> None:
    s = _summary(run_dir, name)
    assert s["batch_mismatches"] == 0, s["batch_mismatch_examples"]
    assert s["batch_records"] == s["batch_truth"] > 0
    assert s["batch_durations_positive"]


def _docs(path: Path, name: str) -> list[dict[str, Any]]:
    out = []
    with open(path / f"{name}.docs.ndjson") as f:
        for line in f:
            d = json.loads(line)
            d.pop("time")
            d.pop("epoch")
            out.append(d)
    return out


@pytest.mark.parametrize("name", TWIN_CONFIGS)
def test_python_capture_publishes_the_same_documents(run_dir: Path, name: str) -> None:
    s = _summary(run_dir / "python", name)
    assert s["implementation"] == "python"
    assert not s["shadow"]
    assert _docs(run_dir / "python", name) == _docs(run_dir, name)


@pytest.mark.parametrize("name", SHADOW_CONFIGS)
def test_shadow_alone_publishes_the_same_documents(run_dir: Path, name: str) -> None:
    s = _summary(run_dir / "shadow", name)
    assert s["shadow"]
    assert s["failures"] == 0, s["last_error"]
    assert _docs(run_dir / "shadow", name) == _docs(run_dir, name)


def test_transports_while_vllm_runs(run_dir: Path) -> None:
    t = json.loads((run_dir / "transports.json").read_text())
    stats = t["stats"]
    assert stats["threaded"]
    assert stats["failures"] == 0, stats["last_error"]
    assert t["shm_doc"] == t["http_doc"]
    assert t["shm_doc"]["seq"] == t["final_seq"] == stats["captures"]
    assert t["shm_doc"]["requests"] == []  # the idle engine's last capture
    lines = t["snapshot_lines"]
    docs = [decode_snapshot(x) for x in lines if x]
    assert docs[0].seq == 0
    assert docs[-1].seq == t["final_seq"]
    assert all(a.seq < b.seq for a, b in itertools.pairwise(docs))
    assert "" in lines  # heartbeats while idle
    batches = read_batches(t["batch_lines"])
    assert len(batches) == stats["batches"] > 0
    assert t["segment_removed"]
    assert t["streams_ended"]
