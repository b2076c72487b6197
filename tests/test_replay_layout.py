"""Where the replay's pieces live (issue 18): live scheduler, twin, compile step."""

from __future__ import annotations

import subprocess
import sys

import bearsdk
import bearsdk.replay as replay
import bearsdk.schedulers as schedulers
from bearsdk.replay import _replay_py, compile, scheduler
from bearsdk.schedulers import compiler


def test_the_live_scheduler_is_an_ordinary_module() -> None:
    assert replay.SchedulerCore is scheduler.SchedulerCore
    assert replay.ScheduledBatch is scheduler.ScheduledBatch
    assert replay.StepOutput is scheduler.StepOutput


def test_the_twin_holds_only_what_is_twinned() -> None:
    assert set(_replay_py.__all__) == {"IMPLEMENTATION", "Prepared", "Replayer"}
    for cls in (scheduler.SchedulerCore, scheduler.ScheduledBatch, scheduler.StepOutput):
        assert cls.__module__ == "bearsdk.replay.scheduler"


def test_compile_policy_is_re_exported_from_the_schedulers_package() -> None:
    assert schedulers.compile_policy is compile.compile_policy
    assert compiler.compile_policy is compile.compile_policy
    assert schedulers.compile_scheduler is compile.compile_policy
    assert bearsdk.bind_scheduler is schedulers.bind_scheduler
    pol = schedulers.policy("vllm-v1")
    assert compile.compile_policy(pol) is schedulers.compile_policy(pol)


def test_reading_specs_does_not_load_the_replay() -> None:
    code = (
        "import sys, bearsdk.schedulers as s\n"
        "s.policy('vllm-v1')\n"
        "print(sorted(m for m in sys.modules if m.startswith('bearsdk.replay')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
