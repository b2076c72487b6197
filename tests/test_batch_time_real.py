"""Eq. 12's dense part on Vidur's measured dense costs, and the shipped profiles.

Needs ``../shared/data/vidur_profiling`` (or ``$BEARSDK_SHARED_DATA``); skipped
cleanly without it. The profiles themselves are always loadable.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from bearsdk.cli import main
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.dense import MLP_CSV, dense_curves, fit_dense, shared_data_dir
from bearsdk.estimators.profiles import (
    PROFILE_SPECS,
    derive_profile,
    get_profile,
    load_profile,
    profile_names,
)

DATA = shared_data_dir()
needs_data = pytest.mark.skipif(
    DATA is None or not (DATA / MLP_CSV).is_file(),
    reason="shared Vidur profiling data not found (set BEARSDK_SHARED_DATA)",
)


@pytest.fixture(scope="module")
def curves() -> dict[tuple[str, str, int], object]:
    assert DATA is not None
    return dense_curves(DATA / MLP_CSV)  # type: ignore[return-value]


@needs_data
@pytest.mark.parametrize(
    "key",
    [
        ("h100", "meta-llama/Llama-2-70b-hf", 1),
        ("h100", "codellama/CodeLlama-34b-Instruct-hf", 2),
        ("h100", "Qwen/Qwen-72B", 1),
    ],
)
def test_dense_floor_cuts_mape_on_real_data(curves: dict, key: tuple[str, str, int]) -> None:  # type: ignore[type-arg]
    c = curves[key]
    line = fit_dense(c.tokens, c.seconds)
    floor = fit_dense(c.tokens, c.seconds, floor=True)
    assert line.mape < 0.08  # eq. 12's straight line is already decent overall...
    assert floor.mape < line.mape - 0.008  # ...the floor is better...
    assert floor.mape_small < 0.6 * line.mape_small  # ...above all on small (decode) batches
    assert 30 <= floor.tau <= 200


@needs_data
def test_dense_curve_is_embedding_plus_layers_times_ops(curves: dict) -> None:  # type: ignore[type-arg]
    c = curves[("h100", "meta-llama/Llama-2-7b-hf", 1)]
    # Row "1 token": emb 0.002 + 32 x (0.004+0.038+0.004+0.016+0.004+0.064+0.006+0.038+0.001) ms.
    assert c.tokens[0] == 1
    assert c.seconds[0] == pytest.approx((0.002 + 32 * 0.175) / 1e3, rel=0.05)
    assert c.layers == 32
    assert c.hidden == 4096
    assert c.gated_mlp


# The eq. 12 fit is an exact NNLS solve: reproducible to rounding on any machine.
# The dense floor's knee comes from a golden-section search over an objective that
# is flat to ~1e-12 near its minimum, so which side wins a comparison there depends
# on how the machine's BLAS sums; the knee is determined to ~sqrt(eps), and the
# coefficients fitted at it follow. CI machines differ from this one in exactly that.
FLOOR_REL = 1e-5


def _assert_same_document(got: Any, want: Any, where: str = "") -> None:
    """Same keys and strings exactly; numbers to the floor search's precision."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert sorted(got) == sorted(want), where
        for key in want:
            _assert_same_document(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, float):
        assert isinstance(got, float), where
        assert got == pytest.approx(want, rel=FLOOR_REL), where
    else:
        assert got == want, where


@needs_data
def test_shipped_profiles_are_what_the_derivation_gives(curves: dict) -> None:  # type: ignore[type-arg]
    assert DATA is not None
    for spec in PROFILE_SPECS:
        derived = derive_profile(spec, DATA, curves=curves)  # type: ignore[arg-type]
        shipped = get_profile(spec.name)
        for got, want in zip(
            shipped.model.extended_coeffs, derived.model.extended_coeffs, strict=True
        ):
            assert got == pytest.approx(want, rel=1e-9), spec.name
        for got, want in zip(
            shipped.dense_floor_model.extended_coeffs,
            derived.dense_floor_model.extended_coeffs,
            strict=True,
        ):
            assert got == pytest.approx(want, rel=FLOOR_REL), spec.name
        assert shipped.theta_pre == pytest.approx(derived.theta_pre, rel=1e-9)


@needs_data
def test_cli_vidur_dense_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--vidur-dense"]) == 0
    out = capsys.readouterr().out
    assert "| H100 | Llama-2-7b-hf | 1 |" in out


@needs_data
def test_cli_derive_profiles_reproduces_the_shipped_file(tmp_path: Path) -> None:
    out = tmp_path / "profiles.toml"
    assert main(["calibrate", "--derive-profiles", str(out)]) == 0
    shipped = Path(__file__).resolve().parents[1] / "bearsdk" / "estimators" / "profiles.toml"
    with out.open("rb") as f:
        derived = tomllib.load(f)
    with shipped.open("rb") as f:
        _assert_same_document(derived, tomllib.load(f))


def test_named_profiles_load() -> None:
    names = profile_names()
    for name in ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100", "llama-2-7b-h100"):
        assert name in names
        m = load_profile(name)
        assert isinstance(m, BatchTimeModel)
        assert not m.has_dense_floor
        assert min(m.coeffs) > 0
        assert load_profile(name, dense_floor=True).dense_floor_tokens >= 0
        p = get_profile(name)
        assert set(p.derivation) >= {"b0", "b1", "b2", "b3", "theta_pre"}
        assert math.isfinite(p.theta_pre)
        assert p.theta_pre > 0
    # Bigger models on the same GPU are slower per token and per context token.
    small, big = load_profile("qwen3-0.6b-h100"), load_profile("qwen3-8b-h100")
    assert big.b1 > small.b1
    assert big.b2 > small.b2
    assert big.b3 > small.b3
    with pytest.raises(KeyError, match="qwen3-8b-h100"):
        load_profile("no-such-profile")
