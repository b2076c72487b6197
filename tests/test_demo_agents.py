"""``bearsdk demo --workload agents``: sessions run closed-loop through the router on the cache."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
pytest.importorskip("jinja2")

from bearsdk.cli.demo_agents import AgentRun, agents_table, run_agents


def test_an_agents_run_routes_turns_onto_their_cached_prefix() -> None:
    (run,) = run_agents(
        [2.0], routers=("BEAR + cache",), duration_s=1.5, slowdown=3.0, progress=False
    )
    assert run.router == "BEAR + cache"
    assert run.failed == 0
    assert run.turns >= 5
    # Every session's later turns resend their history: most of it was cached
    # where the router sent them (the first turns' system prompts aside).
    assert run.cached > 0.5
    table = agents_table([run], 3.0)
    assert "| 2 | BEAR + cache |" in table


def test_the_table_has_one_row_per_run() -> None:
    runs = [
        AgentRun("BEAR", 2.0, 10, 0.8, 0.3, 0.9, 0.7, 0),
        AgentRun("BEAR + cache", 2.0, 10, 1.0, 0.1, 0.2, 0.9, 0),
    ]
    rows = [line for line in agents_table(runs, 10.0).splitlines() if line.startswith("| 2 |")]
    assert rows == [
        "| 2 | BEAR | 10 | 80.0 % | 300 ms | 900 ms | 70.0 % |",
        "| 2 | BEAR + cache | 10 | 100.0 % | 100 ms | 200 ms | 90.0 % |",
    ]
