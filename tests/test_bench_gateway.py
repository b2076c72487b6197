"""``bearsdk bench gateway --quick``: every scenario runs and reports its counts.

Only the report's shape and the correctness counts are checked (no stream lost,
no failed request, exit 0 after SIGTERM); never a time, which depends on the
machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bearsdk.bench.gateway import QUICK, SCENARIOS


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bearsdk", "bench", "gateway", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.once  # (what it times is the gateway, whichever twins it runs)
def test_quick_run_reports_every_scenario() -> None:
    res = _bench("--quick", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert set(SCENARIOS) <= set(report)
    assert report["machine"]["cpu_count"] >= 1
    assert report["sizes"]["streams"] == QUICK.streams
    assert isinstance(report["problems"], list)
    assert isinstance(report["notes"], list)

    lat = report["latency"]
    assert lat["requests"] == int(QUICK.rate * QUICK.seconds)
    assert lat["errors"] == 0, lat
    for what in ("first", "last"):
        assert set(lat[what]) >= {"direct_p50_ms", "gateway_p99_ms", "added_p50_ms"}
    assert set(lat["generator_late_ms"]) == {"p50", "p99", "max"}
    assert {"generator", "engines", "gateway"} <= set(lat["cpu_cores"])

    sc = report["scaling"]
    assert [r["workers"] for r in sc["runs"]] == list(range(1, QUICK.workers_max + 1))
    assert all(r["errors"] == 0 and r["rps"] > 0 for r in sc["runs"]), sc
    assert sc["ratio"] is not None
    assert sc["cpu_count"] == report["machine"]["cpu_count"]

    st = report["streams"]
    assert len(st["waves"]) == QUICK.waves
    for w in st["waves"]:
        assert (w["ok"], w["lost"]) == (QUICK.streams, 0), w
        assert w["rss_peak_kib"] > 0

    rl = report["reload"]
    assert (rl["ok"], rl["failed"]) == (QUICK.inflight, 0), rl
    assert rl["new_key"] == {"ok": 20}
    assert rl["new_key_instances"] == ["b"]
    assert rl["old_key"] == {"HTTP 401": 20}

    term = report["sigterm"]
    assert term["failed"] == 0, term
    assert term["ok"] + term["clean_error"] == QUICK.inflight
    assert term["exit_status"] == 0


def test_too_few_requests_is_one_line_and_exit_2() -> None:
    res = _bench("--scenario", "latency", "--rate", "1", "--seconds", "1")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "bearsdk bench gateway: error: the latency test needs at least 2 requests, one per "
        "path: --rate 1 x --seconds 1 gives 1"
    ]
