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


def test_agent_steps_carry_their_targets_and_follow_their_cache() -> None:
    out = run("agent.py", "--agents", "3", "--spread", "0.2", "--slowdown", "1", "--explain", "2")
    assert "3 agents, 12 model calls" in out
    header = out.splitlines()[-4]
    assert "cached" in header
    assert "on cache" in header
    for step, target in (("plan", "0.30s"), ("act", "1.50s"), ("summarise", "0.40s")):
        line = next(ln for ln in out.splitlines() if ln.startswith(step))
        assert target in line
        # Every step resends the conversation: the instance chosen held some of it
        # (the shared system prompt at least, once a first agent has been served).
        cached = int(line.split()[5])
        assert cached > 0 if step != "plan" else cached >= 0
    # The first decisions, in full: each candidate with the tokens it held.
    assert out.count("cached ") >= 2 * 3


def test_batch_eval_replays_a_trace() -> None:
    from bearsdk.estimators.dense import shared_data_dir

    if shared_data_dir() is None:
        pytest.skip("the shared data (Azure trace) is not on this machine")
    out = run("batch_eval.py", "--requests", "20", "--policies", "bear,round-robin")
    assert "trace azure-conv: 20 requests" in out
    assert out.count("OnTimeUtility") >= 3  # one progress line per policy, and the header


@pytest.mark.parametrize("script", ["agent.py", "batch_eval.py", "chat_service.py"])
@pytest.mark.parametrize(
    ("line", "names"),
    [
        ('profle = "qwen3-8b-h100"', ("profle is not a known field; did you mean 'profile'?",)),
        ('url = "ftp://10.0.0.5:8000"', ("url must start with http", "'ftp://10.0.0.5:8000'")),
        ('profile = "qwen3-8b-h10"', ("profile", "'qwen3-8b-h10'")),
        ("scheduler_params = { max_num_seqs = -1 }", ("max_num_seqs", "-1")),
    ],
)
def test_a_typo_in_a_pool_file_is_one_line(
    tmp_path: Path, script: str, line: str, names: tuple[str, ...]
) -> None:
    pool = tmp_path / "pool.toml"
    fields = {"name": '"a"', "url": '"http://127.0.0.1:9"', "model": '"Qwen/Qwen3-8B"'}
    key = line.split(" =")[0]
    fields.pop(key, None)
    body = "".join(f"{k} = {v}\n" for k, v in fields.items())
    if key != "profile" and key != "profle":
        body += 'profile = "qwen3-8b-h100"\n'
    pool.write_text(f"[[instances]]\n{body}{line}\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--pool", str(pool)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}: error: pool file {pool}: instance 'a': ")
    for name in names:
        assert name in lines[0]
