"""``bearsdk train``: train accuracy, output-length and cost predictors and save them.

Examples::

    bearsdk train --data evals.jsonl --pool qwen3 --out models/
    bearsdk train --data DATA/alpaca_eval --out models/fusechat/
    bearsdk train --synthetic --data-dir DATA --out bearsdk/predictors/data/default.bearpred

``--data`` is a JSON-lines file of evaluations (see
:mod:`bearsdk.predictors.dataset`) or an AlpacaEval folder (``prompts.csv`` and
the wide tables; CC BY-NC, so a predictor trained on it is for evaluation and
non-commercial use only). ``--synthetic`` regenerates the shipped default
predictor from the public traces (``DATA``: ``--data-dir`` or ``$BEARSDK_DATA``,
see ``docs/data.md``), deterministically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from bearsdk.cli import nonnegative_int, positive_float, positive_int, writable_dir

__all__ = ["register"]


def _quantiles(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected levels like 0.5,0.9 or 'none', got {text!r}"
        ) from None


def _leaves(text: str) -> int:
    n = positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2 (got {text!r})")
    return n


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train accuracy/output-length/cost predictors and save them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="evaluations: a JSON-lines file or an AlpacaEval folder")
    src.add_argument(
        "--synthetic", action="store_true", help="generate the default predictor's synthetic data"
    )
    p.add_argument("--out", required=True, help="output folder (or a .bearpred file path)")
    p.add_argument(
        "--pool",
        default=None,
        help="built-in pool (qwen3, fusechat3, fusechat-llama), a JSON file of models, or "
        "'all' for every AlpacaEval model (default: fusechat3 for AlpacaEval, else qwen3)",
    )
    p.add_argument(
        "--traces",
        "--data-dir",
        dest="traces",
        default=None,
        metavar="DIR",
        help="folder holding vidur_traces/ and azure_llm_2023/ (--synthetic; "
        "default: $BEARSDK_DATA, see docs/data.md)",
    )
    p.add_argument(
        "--prompts-per-task", type=positive_int, default=600, help="synthetic prompts per task"
    )
    p.add_argument(
        "--n-estimators", type=positive_int, default=None, help="boosting rounds per head"
    )
    p.add_argument("--learning-rate", type=positive_float, default=None)
    p.add_argument("--num-leaves", type=_leaves, default=None)
    p.add_argument(
        "--quantiles",
        type=_quantiles,
        default=None,
        help="length quantile heads, e.g. 0.5,0.9 or none",
    )
    p.add_argument("--seed", type=nonnegative_int, default=None)
    p.add_argument(
        "--no-relative",
        action="store_true",
        help="do not fit the relative-accuracy head (the pool's order then follows its means)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_run)


def _load(args: argparse.Namespace) -> tuple[object, str]:
    from bearsdk.predictors.dataset import read_alpaca_eval, read_jsonl
    from bearsdk.predictors.errors import PredictorError
    from bearsdk.predictors.pool import load_pool
    from bearsdk.predictors.synthetic import synthetic_training_set

    if args.synthetic:
        if args.pool not in (None, "qwen3"):
            raise PredictorError("--pool", "must be qwen3 with --synthetic", args.pool)
        from bearsdk.data import data_dir

        root = data_dir(data_dir(args.traces, "vidur-traces"), "azure-llm-2023")
        return synthetic_training_set(root, prompts_per_task=args.prompts_per_task), "synthetic"
    data = Path(args.data)
    if data.is_dir():
        if not (data / "prompts.csv").is_file():
            raise PredictorError(
                "--data", "is a folder without prompts.csv (not AlpacaEval)", str(data)
            )
        pool = args.pool or "fusechat3"
        return read_alpaca_eval(data, "all" if pool == "all" else load_pool(pool)), "alpaca_eval"
    return read_jsonl(data, load_pool(args.pool or "qwen3")), "jsonl"


def _run(args: argparse.Namespace) -> int:
    import attrs

    from bearsdk.predictors.serialize import FILE_NAME
    from bearsdk.predictors.training import TrainConfig, train_predictor

    out = Path(args.out)
    target = out if out.suffix == ".bearpred" else out / FILE_NAME
    # Before the training, not after it.
    writable_dir(str(target.parent), "--out")
    data, kind = _load(args)
    overrides: dict[str, Any] = {
        k: v
        for k, v in (
            ("n_estimators", args.n_estimators),
            ("learning_rate", args.learning_rate),
            ("num_leaves", args.num_leaves),
            ("quantiles", args.quantiles),
            ("seed", args.seed),
            ("relative_head", False if args.no_relative else None),
        )
        if v is not None
    }
    config = attrs.evolve(TrainConfig(), **overrides)
    info = {"trained_with": "bearsdk train", "data_kind": kind}
    if kind == "synthetic":
        info["placeholder"] = (
            "trained on synthetic data (paper Table 2 means, shared-trace lengths): "
            "retrain on real evaluations with `bearsdk train --data ...`"
        )
    if kind == "alpaca_eval":
        info["license"] = "derived from AlpacaEval data (CC BY-NC 4.0): non-commercial use only"
    pred = train_predictor(data, config, info=info)  # type: ignore[arg-type]
    written = pred.save(target)
    summary = {
        "file": str(written),
        "bytes": written.stat().st_size,
        "models": list(pred.models),
        "heads": {name: ens.n_trees for name, ens in sorted(pred.heads.items())},
        "prompts": pred.info["n_prompts"],
        "rows_accuracy": pred.info["n_rows_accuracy"],
        "rows_output_tokens": pred.info["n_rows_output_tokens"],
        "source": pred.info["source"],
        "relative_head": pred.info.get("relative_head", {"fitted": False}),
    }
    if args.json:
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(f"wrote {summary['file']} ({summary['bytes'] / 1024:.0f} KiB)")
        print(f"  models: {', '.join(pred.models)}")
        print(f"  heads:  {', '.join(f'{k} ({v} trees)' for k, v in summary['heads'].items())}")
        print(
            f"  data:   {summary['prompts']} prompts, {summary['rows_accuracy']} accuracy rows, "
            f"{summary['rows_output_tokens']} length rows ({summary['source']})"
        )
        rel = pred.relative
        if rel is not None:
            print(
                f"  relative-accuracy head: penalty {rel.penalty:g}, held-out Spearman "
                f"{rel.loo_spearman_gain:+.4f} over the means ({rel.n_prompts} prompts)"
            )
        else:
            reason = summary["relative_head"].get("reason", "disabled")
            print(f"  relative-accuracy head: not fitted ({reason})")
    return 0
