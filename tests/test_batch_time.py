"""Eq. 12 batch-time model: evaluation, robust fitting, online recalibration, JSONL, CLI."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import orjson
import pytest

from bearsdk.cli import main
from bearsdk.estimators.batch_time import (
    BatchDataError,
    BatchObservation,
    BatchTimeModel,
    OnlineBatchTime,
    batch_arrays,
    fit_batch_time,
    mape,
    prefill_attention_of,
    read_batches,
    write_batches,
)
from bearsdk.estimators.prefill import calibrate_theta_pre
from bearsdk.replay.types import BatchRecord

TRUE = BatchTimeModel(0.004, 2.0e-5, 4.0e-8, 1.0e-9)


def compositions(n: int, seed: int) -> list[tuple[int, int, int, int]]:
    """Mixed batches: decode-only, prefill-only and chunked mixes, short and long contexts."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kind = rng.integers(3)
        dec = int(rng.integers(1, 256)) if kind != 1 else 0
        ctx = dec * int(rng.integers(10, 6000))
        pre = int(rng.integers(1, 2048)) if kind != 0 else 0
        patt = prefill_attention_of(pre, int(rng.integers(0, 8000))) if pre else 0
        out.append((pre, dec, ctx, patt))
    return out


def observe(
    model: BatchTimeModel,
    comps: list[tuple[int, int, int, int]],
    noise: float = 0.0,
    seed: int = 0,
    outliers: float = 0.0,
) -> list[BatchObservation]:
    rng = np.random.default_rng(seed)
    obs = []
    for c in comps:
        t = model.batch_time(*c) * (1 + noise * rng.standard_normal())
        if rng.random() < outliers:
            t *= float(rng.uniform(3, 8))  # a CPU / kernel hiccup
        obs.append(BatchObservation(*c, max(t, 1e-6)))
    return obs


def assert_close(model: BatchTimeModel, expected: BatchTimeModel, rel: float) -> None:
    for got, want in zip(model.extended_coeffs, expected.extended_coeffs, strict=True):
        assert got == pytest.approx(want, rel=rel, abs=1e-15), (model, expected)


# ---------------------------------------------------------------- model


def test_eq12_terms_and_replay_record() -> None:
    m = BatchTimeModel(0.004, 2e-5, 4e-8, 1e-10)
    # Ten decodes at contexts summing to 5000 attend 5010 keys (docs/batch-time.md).
    assert m.batch_time(100, 10, 5000, 5050) == pytest.approx(
        0.004 + 110 * 2e-5 + 5010 * 4e-8 + 5050e-10
    )
    before = BatchTimeModel(0.004, 2e-5, 4e-8, 1e-10, decode_keys="before")
    assert before.batch_time(100, 10, 5000, 5050) == pytest.approx(
        0.004 + 110 * 2e-5 + 5000 * 4e-8 + 5050e-10
    )
    rec = BatchRecord(3, 100, 10, 5000, 5050, 1, 0, duration_s=0.0)
    assert m.time_of(rec) == m.batch_time(100, 10, 5000, 5050)
    assert m.coeffs == (0.004, 2e-5, 4e-8, 1e-10)
    assert not m.has_dense_floor


def test_dense_floor_prices_small_batches_flat() -> None:
    m = BatchTimeModel(0.001, 1e-5, 0, 0, dense_floor_tokens=128)
    assert m.batch_time(0, 1, 0, 0) == m.batch_time(0, 128, 0, 0) == pytest.approx(0.001 + 128e-5)
    assert m.batch_time(500, 0, 0, 0) == pytest.approx(0.001 + 500e-5)
    assert m.coeffs == (0.001, 1e-5, 0.0, 0.0)  # the replay's four coefficients are unchanged
    assert m.extended_coeffs[-1] == 128
    f = np.array([[0, 1, 0, 0], [500, 0, 0, 0]], dtype=float)
    assert m.predict(f).tolist() == pytest.approx(
        [m.batch_time(0, 1, 0, 0), m.batch_time(500, 0, 0, 0)]
    )


@pytest.mark.parametrize("field", ["b0", "b1", "b2", "b3", "dense_floor_tokens"])
@pytest.mark.parametrize("value", [-1e-9, math.nan, math.inf])
def test_model_rejects_bad_coefficients(field: str, value: float) -> None:
    kwargs = {"b0": 0.0, "b1": 0.0, "b2": 0.0, "b3": 0.0, field: value}
    with pytest.raises(ValueError, match=field):
        BatchTimeModel(**kwargs)


def test_prefill_attention_units() -> None:
    assert prefill_attention_of(4, 0) == 10  # 1+2+3+4
    assert prefill_attention_of(4, 100) == 410


# ---------------------------------------------------------------- fitting


@pytest.mark.parametrize("loss", ["huber", "squared"])
def test_fit_recovers_known_coefficients(loss: str) -> None:
    obs = observe(TRUE, compositions(400, seed=1))
    fit = fit_batch_time(obs, loss=loss)  # type: ignore[arg-type]
    assert_close(fit.model, TRUE, rel=1e-6)
    assert fit.mape < 1e-9
    assert fit.n == 400
    assert fit.n_downweighted == 0


def test_fit_recovers_the_dense_floor() -> None:
    true = BatchTimeModel(0.003, 2.0e-5, 4.0e-8, 1.0e-9, dense_floor_tokens=96)
    comps = compositions(400, seed=2) + [(0, d, d * 500, 0) for d in range(1, 200, 3)]
    fit = fit_batch_time(observe(true, comps), dense_floor=True)
    assert fit.model.dense_floor_tokens == pytest.approx(96, rel=1e-6)
    assert_close(fit.model, true, rel=1e-6)
    # A straight line cannot: the floor must actually pay off on such data.
    assert fit_batch_time(observe(true, comps)).mape > 10 * fit.mape + 1e-3


def test_fit_is_robust_to_outliers_and_reports_mape() -> None:
    comps = compositions(600, seed=3)
    obs = observe(TRUE, comps, noise=0.02, seed=4, outliers=0.2)
    robust = fit_batch_time(obs)
    plain = fit_batch_time(obs, loss="squared")
    err = max(abs(a / b - 1) for a, b in zip(robust.model.coeffs, TRUE.coeffs, strict=True))
    plain_err = max(abs(a / b - 1) for a, b in zip(plain.model.coeffs, TRUE.coeffs, strict=True))
    assert err < 0.03, robust.model
    assert plain_err > 2 * err  # one in five batches slowed 3-8x drags plain least squares
    assert robust.n_downweighted >= 110  # the ~120 hiccups (and some noise tails)
    assert robust.mape == pytest.approx(mape(robust.model, obs))
    assert 0.1 < robust.mape < 0.3
    assert robust.median_ape < 0.03


def test_fit_keeps_coefficients_non_negative() -> None:
    true = BatchTimeModel(0.004, 2e-5, 4e-8, 0.0)  # no prefill-attention cost at all
    obs = observe(true, compositions(300, seed=5), noise=0.05, seed=6)
    fit = fit_batch_time(obs, loss="squared")
    assert min(fit.model.coeffs) >= 0.0
    assert fit.model.b1 == pytest.approx(2e-5, rel=0.1)


def test_fit_flags_terms_the_data_cannot_determine() -> None:
    decode_only = [(0, d, d * (300 + 97 * (d % 13)), 0) for d in range(1, 100)]
    fit = fit_batch_time(observe(TRUE, decode_only))
    assert fit.unidentified == ("b3",)
    assert fit.model.b3 == 0.0
    assert fit.model.b2 == pytest.approx(TRUE.b2, rel=1e-6)


def test_fit_rejects_no_data_and_bad_options() -> None:
    with pytest.raises(BatchDataError, match="observations"):
        fit_batch_time([])
    obs = observe(TRUE, compositions(10, seed=7))
    with pytest.raises(BatchDataError, match="loss"):
        fit_batch_time(obs, loss="l1")  # type: ignore[arg-type]
    with pytest.raises(BatchDataError, match="huber_delta"):
        fit_batch_time(obs, huber_delta=0)
    f, y = batch_arrays(obs)
    y[3] = -1.0
    with pytest.raises(BatchDataError, match=r"durations\[3\]"):
        fit_batch_time((f, y))


# ---------------------------------------------------------------- observations and JSONL


def test_observation_validation_names_the_field() -> None:
    with pytest.raises(BatchDataError, match="decode_context"):
        BatchObservation(1, 1, -5, 1, 0.01)
    with pytest.raises(BatchDataError, match="duration_s"):
        BatchObservation(1, 1, 5, 1, math.nan)
    with pytest.raises(BatchDataError, match="prefill_tokens \\+ decode_tokens"):
        BatchObservation(0, 0, 0, 0, 0.01)


def test_jsonl_aggregate_and_per_request_forms(tmp_path: Path) -> None:
    lines = [
        {
            "prefill_tokens": 100,
            "decode_tokens": 2,
            "decode_context": 700,
            "prefill_attention": 5050,
            "duration_s": 0.02,
            "time": 12.5,
            "instance": "a",
        },
        {
            "schema": "bear.batch/1",
            "requests": [
                {"prefill": 100, "context": 0},
                {"decode": 1, "context": 300},
                {"decode": 1, "context": 400},
            ],
            "duration_s": 0.02,
        },
        {"decode_tokens": 1, "decode_context": 9, "duration_s": 0.005},
    ]
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n\n")
    obs = read_batches(path)
    assert obs[0] == obs[1] == BatchObservation(100, 2, 700, 5050, 0.02)
    assert obs[2] == BatchObservation(0, 1, 9, 0, 0.005)
    out = tmp_path / "round.jsonl"
    write_batches(out, obs)
    assert read_batches(out) == obs


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "line 2: line is not valid JSON"),
        ('{"prefill_tokens": 10}', "line 2: duration_s is required"),
        (
            '{"prefill_tokens": -3, "duration_s": 1}',
            "line 2: prefill_tokens must be an integer >= 0",
        ),
        ('{"prefill_tokens": 1.5, "duration_s": 1}', "line 2: prefill_tokens"),
        (
            '{"prefill_tokens": 3, "duration_s": "x"}',
            "line 2: duration_s must be a finite number > 0",
        ),
        ('{"prefill_tokens": 3, "duration_s": 0}', "line 2: duration_s"),
        (
            '{"requests": [{"prefill": 3, "decode": 1}], "duration_s": 1}',
            r"line 2: requests\[0\] must have",
        ),
        (
            '{"requests": [{"decode": 2, "context": 1}], "duration_s": 1}',
            r"line 2: requests\[0\].decode",
        ),
        ('{"requests": [{"prefill": 3, "ctx": 1}], "duration_s": 1}', r"line 2: requests\[0\].ctx"),
        ('{"requests": [], "duration_s": 1}', "line 2: prefill_tokens \\+ decode_tokens"),
        ('{"schema": "bear.batch/9", "prefill_tokens": 3, "duration_s": 1}', "line 2: schema"),
        ("[1, 2]", "line 2: line must be a JSON object"),
    ],
)
def test_malformed_line_is_an_error_naming_the_line(line: str, match: str) -> None:
    good = '{"prefill_tokens": 3, "duration_s": 0.01}'
    with pytest.raises(BatchDataError, match=match) as info:
        read_batches([good, line])
    assert info.value.line == 2


def test_theta_pre_is_prefill_tokens_over_prefill_batch_time() -> None:
    obs = [
        BatchObservation(1000, 0, 0, 500500, 0.1),
        BatchObservation(500, 20, 2000, 125250, 0.1),
        BatchObservation(0, 64, 64000, 0, 0.5),  # decode-only: not counted
    ]
    assert calibrate_theta_pre(obs) == pytest.approx(1500 / 0.2)
    with pytest.raises(BatchDataError, match="prefill"):
        calibrate_theta_pre(obs[2:])


# ---------------------------------------------------------------- online


def drive(
    online: OnlineBatchTime,
    model: BatchTimeModel,
    comps: list[tuple[int, int, int, int]],
    noise: float,
    seed: int,
) -> None:
    for o in observe(model, comps, noise=noise, seed=seed):
        assert online.observe(
            o.prefill_tokens, o.decode_tokens, o.decode_context, o.prefill_attention, o.duration_s
        )


def test_online_converges_after_a_step_change() -> None:
    before = BatchTimeModel(0.004, 2.0e-5, 4.0e-8, 1.0e-9)
    after = BatchTimeModel(0.006, 3.0e-5, 5.0e-8, 1.5e-9)  # thermal throttling, a neighbour...
    online = OnlineBatchTime(BatchTimeModel(0.002, 1e-5, 8e-8, 5e-10))  # a rough profile
    drive(online, before, compositions(1500, seed=8), noise=0.0, seed=0)
    assert_close(online.model, before, rel=0.01)
    drive(online, after, compositions(1500, seed=9), noise=0.0, seed=0)
    assert_close(online.model, after, rel=0.01)
    assert online.rejected == {}


def test_online_tracks_with_noise_and_hiccups() -> None:
    online = OnlineBatchTime(TRUE)
    obs = observe(TRUE, compositions(2000, seed=10), noise=0.02, seed=11, outliers=0.03)
    for o in obs:
        online.observe_batch(o)
    got = online.model
    assert max(abs(a / b - 1) for a, b in zip(got.coeffs, TRUE.coeffs, strict=True)) < 0.05
    assert online.downweighted > 40
    assert online.accepted + sum(online.rejected.values()) == len(obs)


def test_online_rejects_bad_observations_with_counted_reasons() -> None:
    online = OnlineBatchTime(TRUE)
    drive(online, TRUE, compositions(100, seed=12), noise=0.0, seed=0)
    before = online.model
    bad = [
        (10, 1, 100, 55, math.nan),
        (10, 1, 100, 55, math.inf),
        (10, 1, 100, 55, -0.01),
        (10, 1, 100, 55, 0.0),
        (10, 1, 100, 55, 1e6),
        (-10, 1, 100, 55, 0.01),
        (0, 0, 0, 0, 0.01),
        (100, 10, 5000, 5050, 100 * TRUE.batch_time(100, 10, 5000, 5050)),  # absurd
        (100, 10, 5000, 5050, TRUE.batch_time(100, 10, 5000, 5050) / 100),
    ]
    for b in bad:
        assert not online.observe(*b)
    assert online.rejected == {
        "non-finite": 2,
        "non-positive-duration": 2,
        "too-long": 1,
        "negative-composition": 1,
        "empty-batch": 1,
        "absurd": 2,
    }
    assert online.model == before  # nothing was folded in
    assert online.accepted == 100


def test_online_accepts_a_replay_batch_record() -> None:
    online = OnlineBatchTime(TRUE)
    rec = BatchRecord(2, 10, 1, 50, 55, 1, 0, duration_s=0.0)
    assert online.observe_batch(rec, duration_s=TRUE.time_of(rec))
    assert online.accepted == 1


def test_online_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="forgetting"):
        OnlineBatchTime(TRUE, forgetting=1.5)
    with pytest.raises(ValueError, match="absurd_ratio"):
        OnlineBatchTime(TRUE, absurd_ratio=1.0)


# ---------------------------------------------------------------- CLI


def write(path: Path, obs: list[BatchObservation]) -> None:
    write_batches(path, obs)


def test_cli_recovers_coefficients(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "batches.jsonl"
    write(path, observe(TRUE, compositions(300, seed=13)))
    assert main(["calibrate", "--batches", str(path), "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    got = BatchTimeModel(**out["coefficients"])
    assert_close(got, TRUE, rel=0.01)
    assert out["mape"] < 1e-6
    assert out["batches"] == 300
    assert out["theta_pre"] > 0


def test_cli_reports_mape_on_noisy_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "batches.jsonl"
    write(path, observe(TRUE, compositions(300, seed=14), noise=0.04, seed=15, outliers=0.02))
    assert main(["calibrate", "--batches", str(path)]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("MAPE"))
    assert 2.0 < float(line.split()[1].rstrip("%")) < 20.0
    assert "down-weighted as outliers" in text


def test_cli_malformed_line_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "batches.jsonl"
    path.write_text(
        '{"prefill_tokens": 3, "duration_s": 0.01}\n{"prefill_tokens": 3, "duration_s": -2}\n'
    )
    assert main(["calibrate", "--batches", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2: duration_s must be a finite number > 0 (got -2)" in err


def test_cli_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--batches", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "batches.jsonl"
    write(path, observe(TRUE, compositions(50, seed=16), noise=0.03, seed=17))
    png = tmp_path / "fig5.png"
    status = main(["calibrate", "--batches", str(path), "--plot", str(png)])
    if importlib.util.find_spec("matplotlib") is None:
        assert status == 2
        assert "pip install 'bearsdk[plot]'" in capsys.readouterr().err
    else:
        assert status == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_lists_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--list-profiles", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert {"qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100"} <= set(out)
