"""``bearsdk bench tpot``: BEA's TPOT against an emulated engine (a short run)."""

from __future__ import annotations

import pytest

from bearsdk.bench import tpot

pytestmark = pytest.mark.slow


def test_a_short_run_scores_tpot_and_times_the_replay() -> None:
    report = tpot.run(requests=30, rate=6.0, next_tokens=32, seed=3)
    rows = report.pop("_rows")
    policy, bt = report.pop("_model")
    assert report["scored"] == len(rows) >= 25
    assert report["first_token_batch_exact_pct"] >= 90.0
    # The replay itself: generous bounds, the emulator runs in real time on a shared machine.
    assert report["probes"] == 30 // tpot.PROBE_EVERY
    probes = report["mape_pct_probes"]
    assert probes is not None
    assert probes["oracle"] < 10.0
    assert 0.0 < report["tpot_ms"]["median"] < 100.0
    cost = tpot.cost(rows[:5], policy, bt, 32)
    assert cost["with_tpot"]["median_us"] > 0.0
    assert cost["ratio_median"] >= 1.0
