"""Shared-memory stress: a writer process at 10k snapshots/s; readers never accept a torn copy."""

from __future__ import annotations

from bearsdk.bench.snapshots import stress, stress_payload
from bearsdk.io import shm
from bearsdk.snapshot import decode_snapshot


def test_stress_payloads_are_valid_and_distinct() -> None:
    a, b = stress_payload(41), stress_payload(42)
    assert a != b
    assert len(a) != len(b)
    assert decode_snapshot(a).seq == 41


def test_readers_never_accept_a_torn_snapshot() -> None:
    report = stress(seconds=1.5, rate=10_000.0)
    assert report["writer"]["writes"] > 1000
    readers = report["readers"]
    for name in shm.implementations():
        r = readers[name]
        assert r["accepted"] > 0, r
        assert r["bad"] == 0, r  # every accepted payload equals the one written under its seq
