"""``bearsdk bench predictors``: speed of the predictors and, with data, their held-out quality.

Speed (always): prompt feature extraction for a 1,000-token prompt (target
<= 50 us compiled), all heads for one prompt across an 8-model pool (target
<= 100 us), and the end-to-end :meth:`~bearsdk.predictors.Predictor.predict`
(features, heads, token counts, cost) for the 8-model pool and for the shipped
3-model default. The 8-model predictor is trained at start-up on generated
prompts with the default settings (200 trees per head, accuracy, mean length
and p50/p90 length heads, and the relative-accuracy head), so its ensembles
have the shipped size.

Quality (``--alpaca-dir``): k-fold cross-validation on AlpacaEval prompts for a
pool (default: FuseChat-3.0 Llama-3.2-1B / Qwen-2.5-7B / Gemma-2-9B) against the per-model-mean
baseline (see :mod:`bearsdk.predictors.evaluate`). The data is read in place and
is CC BY-NC 4.0 (AlpacaEval, Li et al. 2023): evaluation only.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from functools import partial
from typing import Any

import numpy as np
import orjson

from bearsdk.bench import Timing, time_call
from bearsdk.cli import positive_int
from bearsdk.errors import BearError

__all__ = ["register"]

FEATURE_TARGET_US = 50.0
POOL_TARGET_US = 100.0


def register(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bsub.add_parser(
        "predictors",
        help="feature extraction, pool inference speed; held-out quality with --alpaca-dir",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--models", type=positive_int, default=8, help="pool size of the speed benchmark"
    )
    p.add_argument(
        "--tokens", type=positive_int, default=1000, help="prompt length (pre-tokenizer tokens)"
    )
    p.add_argument("--rounds", type=positive_int, default=500, help="timing rounds (compiled)")
    p.add_argument("--alpaca-dir", default=None, help="AlpacaEval folder: also measure quality")
    p.add_argument("--pool", default="fusechat3", help="quality pool: a built-in name or 'all'")
    p.add_argument("--folds", type=_folds, default=5)
    p.add_argument("--skip-speed", action="store_true", help="quality only")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=_run)


_WORDS_TEXT = (
    "the model answers questions about rivers cities history science music and code "
    "while users ask for summaries lists explanations stories and short replies in many "
    "languages "
)
_WORDS = tuple(_WORDS_TEXT.split())


def bench_prompt(n_tokens: int) -> str:
    """Return a deterministic English-like prompt of exactly ``n_tokens`` pre-tokenizer tokens."""
    rng = np.random.default_rng(7)
    out: list[str] = []
    count = 0
    while count < n_tokens:
        k = min(int(rng.integers(6, 16)), n_tokens - count)
        if k <= 1:
            out.append(_WORDS[int(rng.integers(0, len(_WORDS)))])
            count += 1
            continue
        words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), size=k - 1)]
        out.append(" ".join(words).capitalize() + ".")
        count += k
    return " ".join(out)


def _bench_predictor(n_models: int) -> Any:
    """Train a predictor for an ``n_models`` pool on generated data (default settings)."""
    from bearsdk.predictors.dataset import TrainingSet
    from bearsdk.predictors.pool import ModelSpec
    from bearsdk.predictors.training import train_predictor

    rng = np.random.default_rng(11)
    sizes = np.geomspace(0.5, 70.0, n_models)
    pool = tuple(
        ModelSpec(f"bench-{i}", float(s), 32768, 0.05 * s**0.5, 0.2 * s**0.5)
        for i, s in enumerate(sizes)
    )
    n_prompts = 400
    prompts = tuple(
        bench_prompt(int(rng.integers(5, 400)))[int(rng.integers(0, 50)) :] + f" #{i}"
        for i in range(n_prompts)
    )
    lengths = np.array([len(p) for p in prompts], dtype=np.float64)
    pi = np.repeat(np.arange(n_prompts), n_models)
    mi = np.tile(np.arange(n_models), n_prompts)
    skill = np.log(sizes)[mi] / np.log(70.0)
    hard = (lengths[pi] / lengths.max()) * 0.5
    # Even-numbered models do relatively better on long prompts, so the predictor
    # also has a relative-accuracy head, as one trained on real judgements would.
    affinity = 0.2 * (lengths[pi] / lengths.max() - 0.5) * np.where(mi % 2 == 0, 1.0, -1.0)
    noise = 0.2 * rng.standard_normal(pi.shape[0])
    acc = np.clip(0.3 + 0.5 * skill - hard + affinity + noise, 0.0, 1.0)
    out = np.maximum(
        1.0,
        np.rint(200.0 + 0.3 * lengths[pi] * (1 + skill) + 80 * rng.standard_normal(pi.shape[0])),
    )
    data = TrainingSet(
        prompts, pool, pi, mi, acc, out, np.full(pi.shape[0], np.nan), source="bench"
    )
    return train_predictor(data)


def _row(name: str, impl: str, t: Timing, target: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "impl": impl, **t.as_dict()}
    if target is not None:
        row["target_us"] = target
        row["meets_target"] = t.median_us <= target
    return row


def _speed(args: argparse.Namespace) -> dict[str, Any]:
    from bearsdk.predictors import _impl
    from bearsdk.predictors.predictor import Predictor

    prompt = bench_prompt(args.tokens)
    t0 = time.perf_counter()
    pred = _bench_predictor(args.models)
    train_s = time.perf_counter() - t0
    default = Predictor.load_default()
    rows = []
    impls = _impl.implementations()
    for name, be in impls.items():
        compiled = name == "cython"
        rounds = args.rounds if compiled else max(10, args.rounds // 20)
        batch = 20 if compiled else 2
        fx = be.feature_extractor(pred.pipeline.components, pred.pipeline.offset)
        feats = np.empty(fx.n_features)
        rows.append(
            _row(
                f"features ({args.tokens}-token prompt, {len(prompt)} chars)",
                name,
                time_call(partial(fx.transform_into, prompt, feats), batch=batch, rounds=rounds),
                FEATURE_TARGET_US if compiled else None,
            )
        )
        x = pred.feature_rows([prompt])
        forests = tuple(be.forest(**pred.heads[h].evaluator_args()) for h in pred.head_order)
        outs = np.empty((len(forests), x.shape[0]))
        shared = pred.pipeline.n_features  # every row holds the same prompt features

        def heads(
            forests: tuple[Any, ...] = forests,
            outs: np.ndarray = outs,
            x: np.ndarray = x,
            shared: int = shared,
        ) -> None:
            for h, f in enumerate(forests):
                f.predict_into(x, outs[h], shared)

        rows.append(
            _row(
                f"heads only ({len(forests)} heads x {args.models} models)",
                name,
                time_call(heads, batch=batch, rounds=rounds),
                POOL_TARGET_US if compiled else None,
            )
        )
    # End-to-end through the public API, with the implementation the package selected.
    compiled = _impl.IMPLEMENTATION == "cython"
    batch = 20 if compiled else 2
    rounds = args.rounds if compiled else max(10, args.rounds // 20)
    import attrs

    without = attrs.evolve(pred, relative=None)
    for label, p in (
        (f"{args.models} models, {len(pred.heads)} heads", pred),
        (f"{args.models} models, no relative head", without),
        (f"shipped default, {len(default.pool)} models", default),
    ):
        rows.append(
            _row(
                f"predict() end to end ({label})",
                _impl.IMPLEMENTATION,
                time_call(partial(p.predict, prompt), batch=batch, rounds=rounds),
                POOL_TARGET_US if compiled and p is pred else None,
            )
        )
    trees = {h: e.n_trees for h, e in pred.heads.items()}
    leaves = {h: int(e.leaf_value.shape[0]) for h, e in pred.heads.items()}
    return {
        "rows": rows,
        "predictor": {
            "models": args.models,
            "trees": trees,
            "leaves": leaves,
            "train_s": round(train_s, 2),
            "relative_head": pred.relative is not None,
        },
        "machine": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
        },
    }


def _folds(text: str) -> int:
    n = positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2 (got {text!r})")
    return n


def _quality(args: argparse.Namespace) -> dict[str, Any]:
    from bearsdk.predictors.dataset import read_alpaca_eval
    from bearsdk.predictors.evaluate import cross_validate
    from bearsdk.predictors.pool import load_pool

    if not os.path.isdir(args.alpaca_dir):
        raise BearError(f"--alpaca-dir {args.alpaca_dir!r} is not a folder")
    pool = "all" if args.pool == "all" else load_pool(args.pool)
    data = read_alpaca_eval(args.alpaca_dir, pool)
    t0 = time.perf_counter()
    report = cross_validate(data, folds=args.folds)
    out = report.as_dict()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["attribution"] = (
        "AlpacaEval (Li et al., 2023, github.com/tatsu-lab/alpaca_eval), data CC BY-NC 4.0"
    )
    return out


def _print_speed(res: dict[str, Any]) -> None:
    print(f"{'benchmark':<56} {'impl':<7} {'median us':>10} {'p99 us':>10} {'target':>8}")
    for r in res["rows"]:
        target = f"<= {r['target_us']:.0f}" if "target_us" in r else ""
        mark = "" if "meets_target" not in r else ("  ok" if r["meets_target"] else "  MISSED")
        print(
            f"{r['name']:<56} {r['impl']:<7} {r['median_us']:>10.2f} {r['p99_us']:>10.2f} "
            f"{target:>8}{mark}"
        )
    p = res["predictor"]
    print(
        f"(bench predictor: {p['models']} models, trees per head {p['trees']}, "
        f"relative-accuracy head {'yes' if p['relative_head'] else 'no'}, "
        f"trained in {p['train_s']} s)"
    )


def _print_quality(q: dict[str, Any]) -> None:
    print(
        f"held-out quality: {q['n_prompts']} prompts, {q['folds']}-fold CV, "
        f"pool: {', '.join(q['models'])}"
    )
    print(f"{'metric':<28} {'predictor':>10} {'baseline':>10} {'diff (SE)':>20}")
    diffs = q["differences"]
    for key in (
        "accuracy_mae",
        "spearman",
        "top1",
        "picked_accuracy",
        "length_mae",
        "length_mape",
        "length_median_ape",
        "length_p90_coverage",
    ):
        a, b = q["predictor"][key], q["baseline"][key]
        d = diffs.get(key)
        ds = f"{d[0]:+.4f} ({d[1]:.4f})" if d else ""
        print(f"{key:<28} {a:>10.4f} {b:>10.4f} {ds:>20}")
    print(f"oracle accuracy (best model per prompt): {q['oracle_accuracy']:.4f}")
    print(f"relative-accuracy head kept on {q['relative_folds']} of {q['folds']} folds")
    print(f"data: {q['attribution']}")


def _run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {}
    if not args.skip_speed:
        result["speed"] = _speed(args)
    if args.alpaca_dir:
        result["quality"] = _quality(args)
    if args.json:
        sys.stdout.write(
            orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
            + "\n"
        )
        return 0
    if "speed" in result:
        _print_speed(result["speed"])
    if "quality" in result:
        if "speed" in result:
            print()
        _print_quality(result["quality"])
    return 0
