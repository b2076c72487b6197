"""The examples run end to end against emulated engines (their quick settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=EXAMPLES,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_chat_service_answers_streamed_and_whole_requests() -> None:
    out = run("chat_service.py", "--self-test")
    assert out.count("-> HTTP 200") == 3
    assert "bad JSON -> HTTP 400" in out


def test_agent_steps_carry_their_targets() -> None:
    out = run("agent.py", "--agents", "3", "--spread", "0.2", "--slowdown", "1")
    assert "3 agents, 12 model calls" in out
    for step, target in (("plan", "0.30s"), ("act", "1.50s"), ("summarise", "0.40s")):
        line = next(ln for ln in out.splitlines() if ln.startswith(step))
        assert target in line


def test_batch_eval_replays_a_trace() -> None:
    from bearsdk.estimators.dense import shared_data_dir

    if shared_data_dir() is None:
        pytest.skip("the shared data (Azure trace) is not on this machine")
    out = run("batch_eval.py", "--requests", "20", "--policies", "bear,round-robin")
    assert "trace azure-conv: 20 requests" in out
    assert out.count("OnTimeUtility") >= 3  # one progress line per policy, and the header
