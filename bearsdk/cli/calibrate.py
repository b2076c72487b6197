"""``bearsdk calibrate``: fit eq. 12's batch-time coefficients, and the dense-cost tools.

* ``--batches FILE.jsonl``: fit observed batches (``bear.batch/1``), print the
  coefficients, MAPE and ``theta_pre``; ``--plot out.png`` draws predicted vs
  observed (the paper's figure 5; needs matplotlib: ``pip install 'bearsdk[plot]'``).
* ``--vidur-dense [CSV]``: MAPE of eq. 12's dense part and of the richer
  dense term on Vidur's measured dense costs (the table in ``docs/batch-time.md``).
* ``--derive-profiles OUT``: regenerate the shipped profiles from the shared data.
* ``--list-profiles``: the shipped profiles and their coefficients.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import orjson

from bearsdk.cli import positive_float, writable_file
from bearsdk.errors import BearError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``calibrate`` sub-command."""
    p = sub.add_parser(
        "calibrate",
        help="fit batch-time coefficients (eq. 12) to observed batches; dense-cost tools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--batches", metavar="FILE.jsonl", help="observed batches (bear.batch/1 JSONL)"
    )
    mode.add_argument(
        "--vidur-dense",
        metavar="CSV",
        nargs="?",
        const="",
        help="dense-cost MAPE table from Vidur's mlp_linear_ops_median_ms.csv "
        "(default: the one under --data-dir)",
    )
    mode.add_argument(
        "--derive-profiles", metavar="OUT.toml", help="write profiles derived from Vidur profiling"
    )
    mode.add_argument("--list-profiles", action="store_true", help="list the shipped profiles")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder holding vidur_profiling/ (default: $BEARSDK_DATA; see docs/data.md)",
    )
    p.add_argument("--plot", metavar="OUT.png", help="with --batches: plot predicted vs observed")
    p.add_argument(
        "--dense-floor",
        action="store_true",
        help="also fit the richer dense term b1*max(tokens, tau)",
    )
    p.add_argument(
        "--decode-keys",
        choices=("attended", "before"),
        default="attended",
        help="what b2 prices per decode: the keys it attends (its context and itself, "
        "default) or its context before the batch (docs/batch-time.md)",
    )
    p.add_argument(
        "--loss", choices=("huber", "squared"), default="huber", help="fit loss (default: huber)"
    )
    p.add_argument(
        "--huber-delta",
        type=positive_float,
        default=0.05,
        help="relative residual beyond which a batch is an outlier",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.plot and not args.batches:
        raise BearError("--plot needs --batches")
    # Outputs are checked before any work, so that a typo costs no fit.
    if args.plot:
        writable_file(args.plot, "--plot")
    if args.derive_profiles:
        writable_file(args.derive_profiles, "--derive-profiles")
    if args.batches:
        return _fit_batches(args)
    if args.vidur_dense is not None:
        return _vidur_dense(args)
    if args.derive_profiles:
        return _derive(args)
    return _list_profiles(args)


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    else:
        sys.stdout.write(text)


def _fit_batches(args: argparse.Namespace) -> int:
    from bearsdk.estimators.batch_time import batch_arrays, fit_batch_time, read_batches
    from bearsdk.estimators.prefill import calibrate_theta_pre

    try:
        obs = read_batches(args.batches)
    except OSError as exc:
        raise BearError(f"cannot read {args.batches}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1]
        raise BearError(f"{args.batches}: not UTF-8 text (byte {exc.start} is {bad!r})") from None
    if not obs:
        raise BearError(f"{args.batches}: no batches")
    fit = fit_batch_time(
        obs,
        dense_floor=args.dense_floor,
        loss=args.loss,
        huber_delta=args.huber_delta,
        decode_keys=args.decode_keys,
    )
    theta = None
    if any(o.prefill_tokens > 0 for o in obs):
        theta = calibrate_theta_pre(obs)
    m = fit.model
    out = {
        "coefficients": m.to_dict(),
        "mape": fit.mape,
        "median_ape": fit.median_ape,
        "max_ape": fit.max_ape,
        "batches": fit.n,
        "outliers": fit.n_downweighted,
        "theta_pre": theta,
        "unidentified": list(fit.unidentified),
    }
    lines = [
        f"batches     {fit.n} ({fit.n_downweighted} down-weighted as outliers, {args.loss} loss)",
        f"b0          {m.b0:.6g} s",
        f"b1          {m.b1:.6g} s/token",
        f"b2          {m.b2:.6g} s/context token ({m.decode_keys}: "
        f"{'its context and itself' if m.self_keys else 'its context'} per decode)",
        f"b3          {m.b3:.6g} s/prefill-attention unit",
    ]
    if m.has_dense_floor or args.dense_floor:
        lines.append(f"tau         {m.dense_floor_tokens:.6g} tokens (dense floor)")
    lines += [
        f"MAPE        {fit.mape * 100:.2f}%  "
        f"(median {fit.median_ape * 100:.2f}%, max {fit.max_ape * 100:.1f}%)",
        f"theta_pre   {theta:.6g} tokens/s"
        if theta is not None
        else "theta_pre   n/a (no prefill batches)",
    ]
    for name in fit.unidentified:
        lines.append(f"warning: {name} cannot be fitted (its term is 0 in every batch); set to 0")
    _emit(args, out, "\n".join(lines) + "\n")
    if args.plot:
        f, y = batch_arrays(obs)
        _plot(args.plot, y, m.predict(f), fit.mape)
    return 0


def _plot(path: str, observed: Any, predicted: Any, mape: float) -> None:
    try:
        # Imported by name: matplotlib is an optional extra without type stubs here.
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise BearError("--plot needs matplotlib: pip install 'bearsdk[plot]'") from None
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    obs_ms = observed * 1e3
    pred_ms = predicted * 1e3
    ax.scatter(obs_ms, pred_ms, s=6, alpha=0.5, linewidths=0)
    lo = float(min(obs_ms.min(), pred_ms.min()))
    hi = float(max(obs_ms.max(), pred_ms.max()))
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("observed batch time (ms)")
    ax.set_ylabel("predicted batch time (ms)")
    ax.set_title(f"eq. 12 batch time: MAPE {mape * 100:.1f}%")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=150)
    except OSError as exc:
        raise BearError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _data_dir(args: argparse.Namespace) -> Path:
    from bearsdk.data import data_dir

    return data_dir(args.data_dir, "vidur-profiling")


def _vidur_dense(args: argparse.Namespace) -> int:
    from bearsdk.estimators.dense import MLP_CSV, dense_mape_table

    path = Path(args.vidur_dense) if args.vidur_dense else _data_dir(args) / MLP_CSV
    if not path.is_file():
        raise BearError(f"no such file: {path}")
    try:
        rows = dense_mape_table(path)
    except ValueError as exc:
        raise BearError(str(exc)) from None
    except KeyError as exc:  # a CSV, but not Vidur's: a column is missing
        raise BearError(
            f"{path}: not Vidur's mlp_linear_ops_median_ms.csv (no column {exc.args[0]!r})"
        ) from None
    if not rows:
        raise BearError(f"{path}: no dense-cost rows (not Vidur's mlp_linear_ops_median_ms.csv?)")
    obj = {
        "rows": [
            {
                "device": r.device,
                "model": r.model,
                "tp": r.tp,
                "points": r.points,
                "linear": {
                    "b0": r.linear.b0,
                    "b1": r.linear.b1,
                    "mape": r.linear.mape,
                    "mape_small": r.linear.mape_small,
                },
                "floor": {
                    "b0": r.floor.b0,
                    "b1": r.floor.b1,
                    "tau": r.floor.tau,
                    "mape": r.floor.mape,
                    "mape_small": r.floor.mape_small,
                },
            }
            for r in rows
        ]
    }
    lines = [
        "| GPU | model | TP | b0 (ms) | b1 (us/token) | MAPE eq. 12 | MAPE <=256 tok "
        "| tau | MAPE floor | MAPE <=256 tok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.device.upper()} | {r.model.split('/')[-1]} | {r.tp} "
            f"| {r.linear.b0 * 1e3:.3f} | {r.linear.b1 * 1e6:.2f} "
            f"| {r.linear.mape * 100:.1f}% | {r.linear.mape_small * 100:.1f}% "
            f"| {r.floor.tau:.0f} | {r.floor.mape * 100:.1f}% | {r.floor.mape_small * 100:.1f}% |"
        )
    _emit(args, obj, "\n".join(lines) + "\n")
    return 0


def _derive(args: argparse.Namespace) -> int:
    from bearsdk.estimators.dense import MLP_CSV, dense_curves
    from bearsdk.estimators.profiles import PROFILE_SPECS, derive_profile, render_profiles_toml

    d = _data_dir(args)
    curves = dense_curves(d / MLP_CSV)
    profiles = [derive_profile(s, d, curves=curves) for s in PROFILE_SPECS]
    text = render_profiles_toml(profiles)
    try:
        Path(args.derive_profiles).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise BearError(f"cannot write {args.derive_profiles}: {exc.strerror or exc}") from None
    _emit(
        args,
        {"profiles": [p.name for p in profiles]},
        f"wrote {len(profiles)} profiles to {args.derive_profiles}\n",
    )
    return 0


def _list_profiles(args: argparse.Namespace) -> int:
    from bearsdk.estimators.profiles import get_profile, profile_names

    obj: dict[str, Any] = {}
    lines = []
    for name in profile_names():
        p = get_profile(name)
        obj[name] = {**p.model.to_dict(), "theta_pre": p.theta_pre, "source": p.source}
        b0, b1, b2, b3 = p.model.coeffs
        lines.append(
            f"{name:22s} b0={b0:.4g} b1={b1:.4g} b2={b2:.4g} b3={b3:.4g} "
            f"theta_pre={p.theta_pre:.4g} ({p.source})"
        )
    _emit(args, obj, "\n".join(lines) + "\n")
    return 0
