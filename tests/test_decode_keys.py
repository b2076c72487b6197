"""What a decode's context counts in eq. 12's ``b2`` term (``BatchTimeModel.decode_keys``).

The replay twins against Vidur are ``test_vidur_cases.py``; here the model, the
fits, the speed evidence, the pool file and the CLI carry the convention.
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import numpy as np
import orjson
import pytest

from bearsdk.cli import main
from bearsdk.estimators.batch_time import (
    DECODE_KEYS,
    BatchObservation,
    BatchTimeModel,
    OnlineBatchTime,
    batch_arrays,
    fit_batch_time,
    write_batches,
)
from bearsdk.estimators.profiles import get_profile
from bearsdk.router.config import ConfigError, instance_from_dict
from bearsdk.state.speed import SpeedTracker

ATTENDED = BatchTimeModel(4e-3, 2.2e-5, 7.3e-8, 1.5e-10)
BEFORE = attrs.evolve(ATTENDED, decode_keys="before")


def _batches(model: BatchTimeModel, n: int, seed: int) -> list[BatchObservation]:
    """Mixed and decode-only batches timed exactly by ``model``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        dec = rng.randint(1, 128)
        pre = rng.choice((0, 0, rng.randint(1, 2048)))
        dctx = sum(rng.randint(10, 8000) for _ in range(dec))
        c = rng.randint(0, 4000)
        patt = pre * c + pre * (pre + 1) // 2 if pre else 0
        out.append(BatchObservation(pre, dec, dctx, patt, model.batch_time(pre, dec, dctx, patt)))
    return out


def test_the_default_prices_each_decodes_own_key() -> None:
    assert DECODE_KEYS[0] == "attended" == ATTENDED.decode_keys
    assert ATTENDED.self_keys == 1
    assert BEFORE.self_keys == 0
    got = ATTENDED.batch_time(300, 40, 90_000, 45_150)
    assert got - BEFORE.batch_time(300, 40, 90_000, 45_150) == pytest.approx(40 * 7.3e-8)
    assert ATTENDED.decode_units(40, 90_000) == 90_040
    assert BEFORE.decode_units(40, 90_000) == 90_000
    f, _ = batch_arrays(_batches(ATTENDED, 20, seed=1))
    want = [ATTENDED.batch_time(*map(int, row)) for row in f]
    assert ATTENDED.predict(f).tolist() == pytest.approx(want, rel=1e-12)


def test_replay_coeffs_name_the_convention_only_when_needed() -> None:
    assert ATTENDED.replay_coeffs == (4e-3, 2.2e-5, 7.3e-8, 1.5e-10, 0.0, 1.0)
    assert BEFORE.replay_coeffs == BEFORE.coeffs
    floor = attrs.evolve(BEFORE, dense_floor_tokens=64.0)
    assert floor.replay_coeffs == floor.extended_coeffs
    assert "decode_keys" not in ATTENDED.to_dict()
    assert BEFORE.to_dict()["decode_keys"] == "before"
    assert BatchTimeModel(**BEFORE.to_dict()) == BEFORE


@pytest.mark.parametrize("bad", ["after", "", "Attended", None])
def test_an_unknown_convention_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="decode_keys must be one of 'attended', 'before'"):
        BatchTimeModel(1e-3, 1e-5, 1e-8, 1e-10, decode_keys=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("truth", [ATTENDED, BEFORE], ids=lambda m: m.decode_keys)
def test_the_fit_recovers_coefficients_under_its_convention(truth: BatchTimeModel) -> None:
    obs = _batches(truth, 300, seed=7)
    fit = fit_batch_time(obs, loss="squared", decode_keys=truth.decode_keys)
    assert fit.model.decode_keys == truth.decode_keys
    for a, b in zip(fit.model.coeffs, truth.coeffs, strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    assert fit.mape < 1e-9
    other = "before" if truth.self_keys else "attended"
    # Read under the other convention, b2 * D moves into b1: close, not exact.
    assert fit_batch_time(obs, loss="squared", decode_keys=other).mape > 1e-6


def test_the_fit_refuses_an_unknown_convention() -> None:
    with pytest.raises(ValueError, match="decode_keys"):
        fit_batch_time(_batches(ATTENDED, 10, seed=2), decode_keys="both")


@pytest.mark.parametrize("truth", [ATTENDED, BEFORE], ids=lambda m: m.decode_keys)
def test_the_online_fit_keeps_its_initial_convention(truth: BatchTimeModel) -> None:
    start = attrs.evolve(truth, b0=truth.b0 * 2, b2=truth.b2 * 3)
    online = OnlineBatchTime(start, forgetting=1.0, prior_weight=0.1, regularization=1e-6)
    for o in _batches(truth, 400, seed=3):
        assert online.observe_batch(o)
    assert online.model.decode_keys == truth.decode_keys
    f, y = batch_arrays(_batches(truth, 50, seed=4))
    assert np.max(np.abs(online.model.predict(f) - y) / y) < 1e-3


def test_speed_keeps_the_convention_of_its_base() -> None:
    tracker = SpeedTracker(BEFORE)
    assert tracker.model.decode_keys == "before"
    assert SpeedTracker(ATTENDED).model == ATTENDED


def test_profiles_price_the_keys_attended() -> None:
    p = get_profile("qwen3-8b-h100")
    assert p.model.decode_keys == p.dense_floor_model.decode_keys == "attended"


def _pool(bt: object) -> dict[str, object]:
    return {"name": "a", "url": "http://127.0.0.1:1", "model": "m", "batch_time": bt}


def test_a_pool_file_takes_the_table_calibrate_prints() -> None:
    cfg = instance_from_dict(_pool(BEFORE.to_dict()))
    assert cfg.batch_time == BEFORE
    assert instance_from_dict(_pool(list(ATTENDED.coeffs))).batch_time == ATTENDED


@pytest.mark.parametrize(
    ("bt", "message"),
    [
        ({"b0": 1, "b1": 1, "b2": 1}, "batch_time.b3 is required"),
        ({"b0": 1, "b1": 1, "b2": 1, "b3": 1, "keys": 1}, "batch_time.keys is not a known field"),
        (
            {"b0": 1, "b1": 1, "b2": 1, "b3": 1, "decode_keys": "after"},
            "batch_time.decode_keys must be one of 'attended', 'before' \\(got 'after'\\)",
        ),
        ({"b0": -1, "b1": 1, "b2": 1, "b3": 1}, "batch_time.b0 must be a finite number >= 0"),
        ("1,2,3,4", "batch_time must be \\[b0, b1, b2, b3\\] or a table"),
        ([1, 2, 3], "batch_time must be \\[b0, b1, b2, b3\\] or a table"),
    ],
)
def test_a_bad_batch_time_is_refused_naming_the_field(bt: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"instance 'a': {message}"):
        instance_from_dict(_pool(bt))


def test_calibrate_fits_and_prints_the_convention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "batches.jsonl"
    write_batches(path, _batches(BEFORE, 200, seed=5))
    assert main(["calibrate", "--batches", str(path), "--json", "--decode-keys", "before"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["coefficients"]["decode_keys"] == "before"
    assert out["mape"] < 1e-6
    assert main(["calibrate", "--batches", str(path)]) == 0
    text = capsys.readouterr().out
    assert "(attended: its context and itself per decode)" in text
