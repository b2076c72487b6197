"""Dense-layer costs measured by Vidur, and eq. 12's token-linear part fitted to them.

``vidur_profiling/mlp_linear_ops_median_ms.csv`` (public data, ``docs/data.md``) holds the median
per-layer time of every dense (non-attention) operator of several models on A100,
A40 and H100, at 1-4096 tokens (1-32768 for Llama-3) and tensor-parallel degrees
1-8. A forward pass's dense cost is the embedding lookup plus ``num_layers`` times
the per-layer operators (attention kernels and TP communication excluded).

:func:`dense_curves` builds those per-forward curves; :func:`fit_dense` fits
``b0 + b1 * tokens`` (eq. 12's dense part) or the richer
``b0 + b1 * max(tokens, tau)`` to one, and :func:`dense_mape_table` reports both
per model, GPU and TP degree (the table in ``docs/batch-time.md``). The data are
read in place (see :func:`shared_data_dir`), never copied into the repository.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Final

import attrs
import numpy as np

from bearsdk.estimators.batch_time import BatchTimeModel, FloatArray, fit_batch_time

__all__ = [
    "MLP_CSV",
    "NETWORK_CSV",
    "SMALL_BATCH_TOKENS",
    "VIDUR_LAYERS",
    "DenseCurve",
    "DenseFit",
    "DenseRow",
    "allreduce_line",
    "dense_curves",
    "dense_mape_table",
    "fit_dense",
    "shared_data_dir",
]

#: Decoder layers of each profiled model (Vidur's model configs).
VIDUR_LAYERS: Final = {
    "meta-llama/Llama-2-7b-hf": 32,
    "meta-llama/Llama-2-70b-hf": 80,
    "codellama/CodeLlama-34b-Instruct-hf": 48,
    "internlm/internlm-20b": 60,
    "Qwen/Qwen-72B": 80,
    "microsoft/phi-2": 32,
    "meta-llama/Meta-Llama-3-8B": 32,
    "meta-llama/Meta-Llama-3-70B": 80,
}
_LAYER_OPS: Final = (
    "input_layernorm_ms",
    "attn_pre_proj_ms",
    "attn_rope_ms",
    "attn_post_proj_ms",
    "post_attention_layernorm_ms",
    "mlp_up_proj_ms",
    "mlp_act_ms",
    "mlp_down_proj_ms",
    "add_ms",
)
MLP_CSV: Final = "vidur_profiling/mlp_linear_ops_median_ms.csv"
NETWORK_CSV: Final = "vidur_profiling/network_collectives_median_ms.csv"


def shared_data_dir() -> Path | None:
    """Where the public data live, or ``None`` when they are not on this machine.

    The folder :func:`bearsdk.data.find_data_dir` names: ``$BEARSDK_DATA``,
    ``$BEARSDK_SHARED_DATA``, ``$BEARSDK_SHARED/data``, else ``shared/data``
    next to the repository checkout.
    """
    from bearsdk.data import find_data_dir

    return find_data_dir()


@attrs.frozen(eq=False)
class DenseCurve:
    """Per-forward dense cost of one model on one GPU type at one TP degree.

    Attributes:
        device: ``a100``, ``a40`` or ``h100``.
        model: Hugging Face model id.
        tp: Tensor-parallel degree.
        layers: Decoder layers.
        hidden: Hidden size.
        heads: Attention heads.
        kv_heads: Key/value heads.
        intermediate: MLP intermediate size.
        vocab: Vocabulary size.
        gated_mlp: Whether the MLP is gated (three projections, not two).
        tokens: Token counts, ascending.
        seconds: Median per-forward dense time at each count (repeats: median).
    """

    device: str
    model: str
    tp: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    tokens: FloatArray
    seconds: FloatArray

    @property
    def key(self) -> str:
        """``device/model/tpN``."""
        return f"{self.device}/{self.model}/tp{self.tp}"


def dense_curves(csv_path: str | Path) -> dict[tuple[str, str, int], DenseCurve]:
    """Read Vidur's dense-operator profile into per-forward curves.

    The embedding lookup counts once per forward, every other operator once per
    layer; an empty cell (phi-2 has no post-attention layernorm) counts 0.

    Raises:
        ValueError: A model whose layer count is unknown, or a malformed row.
    """
    raw: dict[tuple[str, str, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    meta: dict[tuple[str, str, int], tuple[int, int, int, int, int, bool]] = {}
    with open(csv_path, newline="", encoding="utf-8") as fh:
        for lineno, row in enumerate(csv.DictReader(fh), start=2):
            model = row["model"]
            if model not in VIDUR_LAYERS:
                raise ValueError(f"{csv_path}:{lineno}: model {model!r} has no known layer count")
            try:
                key = (row["device"], model, int(row["num_tensor_parallel_workers"]))
                per_layer = sum(float(row[op] or 0.0) for op in _LAYER_OPS)
                ms = float(row["emb_ms"] or 0.0) + VIDUR_LAYERS[model] * per_layer
                raw[key][int(row["num_tokens"])].append(ms / 1e3)
                meta[key] = (
                    int(row["n_embd"]),
                    int(row["n_head"]),
                    int(row["n_kv_head"]),
                    int(row["n_expanded_embd"]),
                    int(row["vocab_size"]),
                    row["use_gated_mlp"].strip().lower() == "true",
                )
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{csv_path}:{lineno}: malformed row ({exc})") from None
    out = {}
    for key, by_tokens in raw.items():
        toks = sorted(by_tokens)
        hidden, heads, kv, inter, vocab, gated = meta[key]
        out[key] = DenseCurve(
            device=key[0],
            model=key[1],
            tp=key[2],
            layers=VIDUR_LAYERS[key[1]],
            hidden=hidden,
            heads=heads,
            kv_heads=kv,
            intermediate=inter,
            vocab=vocab,
            gated_mlp=gated,
            tokens=np.array(toks, dtype=np.float64),
            seconds=np.array([np.median(by_tokens[t]) for t in toks], dtype=np.float64),
        )
    return out


#: Batches up to this many tokens are "small" (decode-only batches live there).
SMALL_BATCH_TOKENS: Final = 256


@attrs.frozen
class DenseFit:
    """A dense-cost fit: ``b0 + b1 * max(tokens, tau)`` and its errors (fractions).

    Attributes:
        b0: Intercept, seconds.
        b1: Seconds per token.
        tau: Dense floor, tokens (0: eq. 12's straight line).
        mape: Mean absolute percentage error over the curve.
        max_ape: Largest absolute percentage error.
        mape_small: MAPE over batches of at most ``SMALL_BATCH_TOKENS`` tokens.
    """

    b0: float
    b1: float
    tau: float
    mape: float
    max_ape: float
    mape_small: float


def fit_dense(
    tokens: FloatArray, seconds: FloatArray, *, floor: bool = False, max_tokens: float | None = None
) -> DenseFit:
    """Fit eq. 12's dense part (``floor=False``) or the richer term to a dense-cost curve.

    Uses :func:`~bearsdk.estimators.batch_time.fit_batch_time` (robust relative
    NNLS) on prefill-only batches with no attention terms.
    """
    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if max_tokens is not None:
        keep = t <= max_tokens
        t, y = t[keep], y[keep]
    features = np.zeros((len(t), 4))
    features[:, 0] = t
    fit = fit_batch_time((features, y), dense_floor=floor)
    m = fit.model
    ape = np.abs(m.predict(features) - y) / y
    small = t <= SMALL_BATCH_TOKENS
    mape_small = float(np.mean(ape[small])) if np.any(small) else float("nan")
    return DenseFit(m.b0, m.b1, m.dense_floor_tokens, fit.mape, fit.max_ape, mape_small)


@attrs.frozen
class DenseRow:
    """One row of the dense-cost MAPE table."""

    device: str
    model: str
    tp: int
    points: int
    linear: DenseFit
    floor: DenseFit


def dense_mape_table(
    csv_path: str | Path, *, devices: tuple[str, ...] = ("h100", "a100"), max_tokens: float = 4096
) -> list[DenseRow]:
    """Fit both dense forms to every curve of ``devices``; one row per model/GPU/TP.

    Args:
        csv_path: Vidur's ``mlp_linear_ops_median_ms.csv``.
        devices: GPU types to include.
        max_tokens: Largest batch size fitted (Llama-3 curves go to 32768; the
            other models, and a replayed batch's token budget, stop at 4096).
    """
    rows = []
    for _, c in sorted(dense_curves(csv_path).items()):
        if c.device not in devices:
            continue
        lin = fit_dense(c.tokens, c.seconds, max_tokens=max_tokens)
        flo = fit_dense(c.tokens, c.seconds, floor=True, max_tokens=max_tokens)
        rows.append(
            DenseRow(c.device, c.model, c.tp, int(np.sum(c.tokens <= max_tokens)), lin, flo)
        )
    return rows


def allreduce_line(csv_path: str | Path, network_device: str, workers: int) -> tuple[float, float]:
    """Robust line ``seconds = a + b * bytes`` through Vidur's all-reduce timings.

    Args:
        csv_path: Vidur's ``network_collectives_median_ms.csv``.
        network_device: e.g. ``h100_dgx``.
        workers: Participating GPUs (all on one node).

    Returns:
        ``(a, b)``: latency per all-reduce (s) and seconds per byte.
    """
    sizes: list[float] = []
    times: list[float] = []
    with open(csv_path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if (
                row["network_device"] == network_device
                and row["collective"] == "all_reduce"
                and int(row["num_workers"]) == workers
                and int(row["devices_per_node"]) == workers
            ):
                sizes.append(float(row["size"]))
                times.append(float(row["median_ms"]) / 1e3)
    if not sizes:
        raise ValueError(f"no all_reduce timings for {network_device} with {workers} workers")
    features = np.zeros((len(sizes), 4))
    features[:, 0] = sizes
    m: BatchTimeModel = fit_batch_time((features, np.array(times)), huber_delta=0.2).model
    return m.b0, m.b1
