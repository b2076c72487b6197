"""Derive the emulator's shipped table (``_derived.py``) from the public data sets, in place.

Run with the data folder (``docs/data.md``: ``--data-dir`` or ``$BEARSDK_DATA``)::

    python -m bearsdk.emulator.derive            # rewrite bearsdk/emulator/_derived.py
    python -m bearsdk.emulator.derive --check    # exit 1 if the shipped table is stale

The package never reads these data at run time and ships none of it: only a
few numbers per profile, each one computed here.

* **Dense cost** (``dense_knots_s``): Vidur's measured per-forward dense cost
  (``vidur_profiling/mlp_linear_ops_median_ms.csv``, read by
  :func:`bearsdk.estimators.dense.dense_curves`) of the profile's reference model on
  its GPU and TP degree, sampled at 13 power-of-two token counts (1-4096) and made
  non-decreasing. A Qwen3 model, which Vidur did not profile, takes the curve of
  the reference model named in :data:`bearsdk.estimators.profiles.PROFILE_SPECS`,
  scaled by the ratio of dense parameters (the same transfer the batch-time
  profiles use; the emulator's *functional form* differs, see ``timing.py``).
* **All-reduce** (``allreduce``): Vidur's all-reduce line ``a + b * bytes``
  (``network_collectives_median_ms.csv``) for TP > 1.
* **Output lengths** (``LENGTHS``): per prompt category, a log-normal regression
  ``log(tokens) = a + b * log(prompt_tokens) + sd * z`` fitted to AlpacaEval's
  per-prompt output lengths (characters / 4) of five reference models pooled, plus
  a per-profile offset (that model's mean residual). Raw completion prompts fall
  back to fits on the Azure 2023 code and conversation traces (generated vs
  context tokens). AlpacaEval's data are CC BY-NC: only these fitted summaries are
  shipped, never the table.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

__all__ = ["DERIVED_PY", "derive_table", "main", "render_table"]

DERIVED_PY: Final = Path(__file__).with_name("_derived.py")
KNOT_TOKENS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Emulator profile -> (batch-time profile spec reused for the dense transfer,
# served model name, AlpacaEval column of the closest model for output lengths).
EMULATOR_PROFILES: Final = {
    "qwen3-0.6b-h100": ("qwen3-0.6b-h100", "Qwen/Qwen3-0.6B", "Qwen1.5-1.8B-Chat"),
    "qwen3-8b-h100": ("qwen3-8b-h100", "Qwen/Qwen3-8B", "Qwen1.5-7B-Chat"),
    "qwen3-32b-2xh100": ("qwen3-32b-2xh100", "Qwen/Qwen3-32B", "Qwen2-72B-Instruct"),
    "llama-3-8b-a100": (
        "llama-3-8b-a100",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "Meta-Llama-3-8B-Instruct",
    ),
    "llama-3-70b-4xa100": (
        "llama-3-70b-4xa100",
        "meta-llama/Meta-Llama-3-70B-Instruct",
        "Meta-Llama-3-70B-Instruct",
    ),
}
# Model context lengths (the models' configs; vLLM's default max_model_len).
MAX_MODEL_LEN: Final = {
    "qwen3-0.6b-h100": 40960,
    "qwen3-8b-h100": 40960,
    "qwen3-32b-2xh100": 40960,
    "llama-3-8b-a100": 8192,
    "llama-3-70b-4xa100": 8192,
}
TOKENS_PER_WORD: Final = 1.3
CHARS_PER_TOKEN: Final = 4.0


def _short_description(spec: Any) -> str:
    gpus = f"{spec.tp}x {spec.gpu.upper()}" if spec.tp > 1 else f"1x {spec.gpu.upper()}"
    how = "transferred" if spec.arch is not None else "measured"
    ref = spec.reference.rsplit("/", 1)[-1]
    return f"{spec.name.rsplit('-', 1)[0]} on {gpus} (dense cost {how}: {ref})"


def _dense_knots(spec: Any, curves: Mapping[Any, Any]) -> tuple[list[float], dict[str, Any]]:
    from bearsdk.estimators.profiles import Architecture

    ref = curves[(spec.gpu, spec.reference, spec.tp)]
    ref_arch = Architecture.of_curve(ref)
    arch = spec.arch or ref_arch
    scale = arch.dense_params / ref_arch.dense_params
    knots = np.interp(np.array(KNOT_TOKENS, dtype=float), ref.tokens, ref.seconds) * scale
    knots = np.maximum.accumulate(knots)
    arch_d = {
        "layers": arch.layers,
        "hidden": arch.hidden,
        "heads": arch.heads,
        "kv_heads": arch.kv_heads,
        "head_dim": arch.head_dim,
        "intermediate": arch.intermediate,
        "vocab": arch.vocab,
        "gated_mlp": arch.gated_mlp,
    }
    return [float(f"{k:.6g}") for k in knots], {"arch": arch_d, "dense_scale": round(scale, 6)}


def _lstsq_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    a = np.vstack([np.ones_like(x), x]).T
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    sd = float(np.std(y - a @ coef))
    return float(coef[0]), float(coef[1]), sd


def _fit_lengths(data: Path) -> dict[str, Any]:
    from bearsdk.emulator.text import INSTRUCTION_CATEGORIES, classify_instruction

    with open(data / "alpaca_eval" / "prompts.csv", newline="", encoding="utf-8") as fh:
        prompts = list(csv.DictReader(fh))
    with open(data / "alpaca_eval" / "output_length_chars.csv", newline="", encoding="utf-8") as fh:
        lengths = list(csv.DictReader(fh))
    columns = [col for _, _, col in EMULATOR_PROFILES.values()]
    cats = [classify_instruction(p["instruction"]) for p in prompts]
    xs: dict[str, list[float]] = {c: [] for c in INSTRUCTION_CATEGORIES}
    ys: dict[str, list[float]] = {c: [] for c in INSTRUCTION_CATEGORIES}
    owner: dict[str, list[str]] = {c: [] for c in INSTRUCTION_CATEGORIES}
    for p, row, cat in zip(prompts, lengths, cats, strict=True):
        ptoks = max(1.0, float(p["instruction_words"]) * TOKENS_PER_WORD)
        for col in columns:
            if row[col]:
                xs[cat].append(math.log(ptoks))
                ys[cat].append(math.log(max(float(row[col]), CHARS_PER_TOKEN) / CHARS_PER_TOKEN))
                owner[cat].append(col)
    categories: dict[str, list[float]] = {}
    resid_by_col: dict[str, list[float]] = {c: [] for c in columns}
    for cat in INSTRUCTION_CATEGORIES:
        x, y = np.array(xs[cat]), np.array(ys[cat])
        a, b, _ = _lstsq_line(x, y)
        # A handful of prompts cannot pin a slope: keep it in a plausible range.
        b = min(max(b, -0.5), 1.0)
        a = float(np.mean(y - b * x))
        r = y - (a + b * x)
        for col, ri in zip(owner[cat], r, strict=True):
            resid_by_col[col].append(float(ri))
        categories[cat] = [round(a, 4), round(b, 4), round(float(np.std(r)), 4), len(y)]
    offsets = {
        name: round(float(np.mean(resid_by_col[col])), 4)
        for name, (_, _, col) in EMULATOR_PROFILES.items()
    }
    azure = {}
    for kind in ("code", "conv"):
        path = data / "azure_llm_2023" / f"AzureLLMInferenceTrace_{kind}.csv"
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        x = np.log([max(int(r["ContextTokens"]), 1) for r in rows])
        y = np.log([max(int(r["GeneratedTokens"]), 1) for r in rows])
        a, b, sd = _lstsq_line(x, y)
        azure[f"azure-{kind}"] = [round(a, 4), round(b, 4), round(sd, 4), len(rows)]
    return {"categories": categories | azure, "model_offset": offsets}


def derive_table(data: Path) -> dict[str, Any]:
    """Compute the shipped table from the shared data directory ``data``."""
    from bearsdk.estimators.dense import MLP_CSV, NETWORK_CSV, allreduce_line, dense_curves
    from bearsdk.estimators.profiles import GPUS, PROFILE_SPECS

    specs = {s.name: s for s in PROFILE_SPECS}
    curves = dense_curves(data / MLP_CSV)
    profiles: dict[str, Any] = {}
    for name, (spec_name, model, _) in EMULATOR_PROFILES.items():
        spec = specs[spec_name]
        gpu = GPUS[spec.gpu]
        knots, extra = _dense_knots(spec, curves)
        ar = (0.0, 0.0)
        if spec.tp > 1:
            a, b = allreduce_line(data / NETWORK_CSV, gpu.network_device, spec.tp)
            ar = (float(f"{a:.6g}"), float(f"{b:.6g}"))
        profiles[name] = {
            "description": _short_description(spec),
            "model": model,
            "gpu": spec.gpu,
            "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
            "bf16_flops": gpu.bf16_flops,
            "tp": spec.tp,
            "max_model_len": MAX_MODEL_LEN[name],
            "dense_reference": f"Vidur {spec.gpu} {spec.reference} TP{spec.tp}",
            "dense_knots_s": knots,
            "allreduce": list(ar),
            **extra,
        }
    return {
        "KNOT_TOKENS": list(KNOT_TOKENS),
        "PROFILES": profiles,
        "LENGTHS": _fit_lengths(data),
    }


def render_table(table: Mapping[str, Any]) -> str:
    """Render the table as the text of ``_derived.py`` (JSON in a string: format-stable)."""
    body = orjson.dumps(table, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    return "\n".join(
        [
            '"""Numbers derived from the shared real data (generated; do not edit).',
            "",
            "Regenerate with ``python -m bearsdk.emulator.derive`` (see ``derive.py`` for",
            "how every number is computed). Units: seconds, tokens, bytes/s, FLOP/s.",
            '"""',
            "",
            "from typing import Final",
            "",
            'TABLE_JSON: Final = """',
            body,
            '"""',
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: rewrite (or ``--check``) ``_derived.py``."""
    from bearsdk.data import DataNotFoundError, data_dir

    ap = argparse.ArgumentParser(prog="python -m bearsdk.emulator.derive", description=__doc__)
    ap.add_argument(
        "--data",
        "--data-dir",
        dest="data",
        type=Path,
        help="data folder (default: $BEARSDK_DATA; see docs/data.md)",
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if _derived.py is stale")
    ap.add_argument("--out", type=Path, default=DERIVED_PY, help="file to write")
    args = ap.parse_args(argv)
    try:
        data = args.data
        for dataset in ("vidur-profiling", "azure-llm-2023", "alpaca-eval"):
            data = data_dir(data, dataset)
    except DataNotFoundError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    text = render_table(derive_table(Path(data)))
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: rerun python -m bearsdk.emulator.derive", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
