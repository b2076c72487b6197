"""``bearsdk demo``: job count from the idle cores, reruns of lagging runs, flags, Ctrl-C."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
from collections.abc import Generator, Sequence
from pathlib import Path

import anyio
import pytest

from bearsdk.cli import demo, main
from bearsdk.cli.demo_jobs import (
    MAX_ARRIVAL_LAG_S,
    MAX_RERUNS,
    busy_cores,
    default_jobs,
    rerun_plan,
)
from bearsdk.evaluation import RunSummary

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _sigint_restored() -> Generator[None, None, None]:
    # An interrupted command ignores further Ctrl-Cs; in this process that would
    # outlive the test and be inherited by the demo subprocesses below.
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize(
    ("cpus", "busy", "runs", "jobs"),
    [
        (2, 0.0, 27, 2),  # a quiet 2-core machine: one run per core
        (2, 0.2, 27, 2),  # a little noise still leaves both cores idle
        (2, 0.8, 27, 1),  # one core mostly taken: one run
        (2, 2.0, 27, 1),  # fully busy: still one run
        (2, 7.5, 27, 1),  # load above the core count
        (16, 3.6, 100, 12),
        (8, 0.0, 3, 3),  # never more workers than runs
        (4, math.nan, 9, 1),  # no measurement: the safe choice
        (4, -1.0, 9, 4),
    ],
)
def test_default_jobs_from_the_idle_cores(cpus: int, busy: float, runs: int, jobs: int) -> None:
    assert default_jobs(cpus, busy, runs) == jobs


STAT_0 = """\
cpu  300 0 100 600 0 0 0 0 0 0
cpu0 100 0 0 100 0 0 0 0 0 0
cpu1 100 0 50 250 0 0 0 0 0 0
cpu2 100 0 50 250 0 0 0 0 0 0
intr 12345
"""
STAT_1 = """\
cpu  500 0 100 900 0 0 0 0 0 0
cpu0 200 0 0 100 0 0 0 0 0 0
cpu1 150 0 50 400 0 0 0 0 0 0
cpu2 150 0 50 400 0 0 0 0 0 0
intr 12399
"""


def test_busy_cores_counts_only_the_usable_cpus() -> None:
    # cpu0 fully busy, cpu1 and cpu2 a quarter busy (50 of 200 ticks).
    assert busy_cores(STAT_0, STAT_1, [0, 1, 2]) == pytest.approx(1.5)
    assert busy_cores(STAT_0, STAT_1, [1]) == pytest.approx(0.25)
    assert busy_cores(STAT_0, STAT_1, [0, 7]) == pytest.approx(1.0)  # cpu7 not listed: idle
    assert busy_cores(STAT_0, STAT_0, [0, 1]) == 0.0  # no time elapsed


def test_rerun_plan_reruns_the_late_runs_with_fewer_workers() -> None:
    ok, late = MAX_ARRIVAL_LAG_S / 2, MAX_ARRIVAL_LAG_S * 4
    assert rerun_plan([ok, late, ok, math.nan], 4, 0) == ([1, 3], 2)
    assert rerun_plan([late, late, late], 3, 0) == ([0, 1, 2], 1)
    assert rerun_plan([late], 1, 1) == ([0], 1)  # already alone: once more, alone
    assert rerun_plan([ok, MAX_ARRIVAL_LAG_S], 2, 0) == ([], 0)  # at the limit is fine
    assert rerun_plan([late], 2, MAX_RERUNS) == ([], 0)  # bounded


def _summary(policy: str, rate: float, otu: float, lag: float) -> RunSummary:
    return RunSummary(
        policy=policy,
        rate=rate,
        n=6,
        on_time_utility=otu,
        attainment=1.0,
        mean_utility=otu,
        mean_accuracy=0.8,
        mean_cost=1.0,
        composition={"qwen3-8b-h100-0": 1.0},
        ttft_p50_s=0.05,
        ttft_p99_s=0.1,
        ttft_mape=0.1,
        failed=0,
        arrival_lag_p99_s=lag,
        wall_s=1.0,
    )


def test_lagging_runs_are_rerun_then_marked_unreliable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    late = MAX_ARRIVAL_LAG_S * 3
    # Per (policy, attempt): the lag its run reports. bear lags once then is fine;
    # round-robin lags every time (the machine stays busy).
    lags = {"bear": [late, 0.0], "round-robin": [late * 2, late, late * 1.5]}
    calls: list[tuple[list[str], int]] = []

    def execute(
        jobs: Sequence[tuple[int, demo._Job]], workers: int
    ) -> Generator[tuple[int, RunSummary], None, None]:
        calls.append(([j.policy for _, j in jobs], workers))
        for i, job in jobs:
            lag = lags[job.policy].pop(0)
            yield i, _summary(job.policy, job.rate, 0.5 if job.policy == "bear" else 0.4, lag)

    monkeypatch.setattr(demo, "_execute", execute)
    argv = ["demo", "--rates", "6", "--policies", "bear,round-robin", "--no-plot"]
    assert main([*argv, "--jobs", "2"]) == 0
    assert calls == [
        (["bear", "round-robin"], 2),
        (["bear", "round-robin"], 1),
        (["round-robin"], 1),
    ]
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = {ln[2:].split()[0]: ln for ln in lines if ln[2:].startswith(("bear ", "round"))}
    assert rows["bear"].startswith(" *")  # rerun on time: reliable, and the best
    assert rows["round-robin"].startswith("! ")  # still late after every rerun
    assert "unreliable: 1 run(s)" in out
    # The least late of its runs is kept.
    assert f"p99 up to {late * 1e3:.0f} ms" in out


def test_ctrl_c_keeps_the_finished_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def execute(
        jobs: Sequence[tuple[int, demo._Job]], workers: int
    ) -> Generator[tuple[int, RunSummary], None, None]:
        i, job = jobs[0]
        yield i, _summary(job.policy, job.rate, 0.5, 0.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_execute", execute)
    argv = ["demo", "--rates", "6", "--policies", "bear,round-robin", "--no-plot", "--jobs", "1"]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert "interrupted: 1 of 2 run(s) finished" in captured.out
    assert any(ln.startswith(" *bear") for ln in captured.out.splitlines())
    assert captured.err.strip() == "bearsdk demo: interrupted"


@pytest.mark.parametrize(
    "args",
    [
        ["--duration", "0"],
        ["--duration", "-1"],
        ["--duration", "nan"],
        ["--duration", "1e300"],
        ["--rates", "0"],
        ["--rates", "4,inf"],
        ["--slowdown", "0"],
        ["--slowdown", "-3"],
        ["--lam", "nan"],
        ["--lam", "-1"],
        ["--jobs", "0"],
        ["--jobs", "-2"],
        ["--jobs", "two"],
        ["--seed", "-1"],
    ],
)
def test_nonsense_flags_are_one_line_errors(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert args[0] in err
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_unwritable_plot_fails_before_running(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "nope" / "x.svg" if where == "missing-folder" else tmp_path
    assert main(["demo", "--rates", "6", "--policies", "bear", "--plot", str(plot)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    assert captured.err.count("\n") == 1
    assert "--plot" in captured.err
    assert str(plot) in captured.err


async def test_cancelled_pool_and_router_propagate_and_close() -> None:
    """Ctrl-C under ``asyncio.run`` cancels the main task: the cancellation must
    leave both ``async with`` blocks (not be taken for the pool's own) and close
    the router's session."""
    from bearsdk.emulator import EnginePool
    from bearsdk.router import AsyncRouter
    from bearsdk.selectors import make_selector

    after: list[str] = []
    ready = anyio.Event()
    routers: list[AsyncRouter] = []

    async def body() -> None:
        async with EnginePool.of("qwen3-0.6b-h100") as pool:
            router = AsyncRouter(pool.instance_configs(), make_selector("round-robin"))
            routers.append(router)
            async with router:
                ready.set()
                await anyio.sleep(60)
            after.append("router block")
        after.append("pool block")

    task = asyncio.ensure_future(body())
    with anyio.fail_after(30):
        await ready.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []
    assert routers[0]._session is None  # closed and dropped, not leaked


@pytest.mark.parametrize(("jobs", "to_group"), [(1, False), (2, False), (2, True)])
def test_ctrl_c_ends_the_demo_cleanly(jobs: int, to_group: bool) -> None:
    """SIGINT to the parent (``kill -INT``) or to its process group (a terminal's
    Ctrl-C): exit 130 at once, one line, no traceback, no unclosed session."""
    cmd = [sys.executable, "-m", "bearsdk", "demo", "--rates", "4", "--policies"]
    cmd += ["bear,round-robin", "--duration", "60", "--no-plot", "--jobs", str(jobs)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as p:
        try:
            assert p.stdout is not None
            first = p.stdout.readline()  # printed once the runs are starting
            assert first.startswith("bearsdk demo:"), first
            if to_group:
                os.killpg(p.pid, signal.SIGINT)
            else:
                p.send_signal(signal.SIGINT)
            # Generous for a loaded machine; by hand on a quiet one it is ~0.3 s.
            out, err = p.communicate(timeout=20)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()  # (and its pipes closed, whatever failed)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    assert "Unclosed" not in err
    assert err.strip() == "bearsdk demo: interrupted"
    assert "interrupted: 0 of 2 run(s) finished" in out
