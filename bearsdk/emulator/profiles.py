"""Emulated model/GPU profiles: what an emulated engine serves and on what hardware.

A profile bundles the served model name, its architecture, the GPU and TP degree,
the measured dense-cost knots and all-reduce line (``_derived.py``, derived from
Vidur's profiling data by ``python -m bearsdk.emulator.derive``), the output-length
model, and the engine defaults ``vllm serve`` would pick on that hardware
(``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024 on 80 GB GPUs other than
A100, 2048/256 otherwise; the KV pool sized from GPU memory).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import Any, Final

import attrs
import orjson

from bearsdk.emulator._derived import TABLE_JSON
from bearsdk.emulator.text import OutputLengthModel

__all__ = [
    "GPU_MEMORY_BYTES",
    "Architecture",
    "EmulatorProfile",
    "get_profile",
    "profile_names",
]

GPU_MEMORY_BYTES: Final = {"h100": 80 * 2**30, "a100": 80 * 2**30}
"""HBM per GPU (80 GB parts)."""
GPU_MEMORY_UTILIZATION: Final = 0.92
"""vLLM 0.33's default ``gpu_memory_utilization``."""
ACTIVATION_RESERVE_BYTES: Final = 2 * 2**30
"""Peak activations and CUDA graphs, kept out of the KV pool (assumed)."""


@attrs.frozen
class Architecture:
    """Dimensions of a decoder-only transformer.

    Attributes:
        layers: Decoder layers. hidden: Hidden size. heads: Query heads.
        kv_heads: Key/value heads. head_dim: Per-head dimension.
        intermediate: MLP intermediate size. vocab: Vocabulary size.
        gated_mlp: Three MLP projections (gated) rather than two.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True

    @property
    def dense_params(self) -> int:
        """Weights touched per token in the decoder layers."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def weight_bytes(self) -> int:
        """bf16 weights: decoder layers, embedding and LM head."""
        return 2 * (self.dense_params + 2 * self.vocab * self.hidden)

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV-cache bytes of one token on one GPU (bf16 keys and values, all layers)."""
        return 2 * self.layers * math.ceil(self.kv_heads / tp) * self.head_dim * 2


@attrs.frozen
class EmulatorProfile:
    """A model served on a GPU configuration, as the emulator runs it.

    Attributes:
        name: Profile name (``qwen3-8b-h100``).
        description: One line for humans.
        model: Served model name (``Qwen/Qwen3-8B``), as ``/v1/models`` lists it.
        gpu: ``h100`` or ``a100``.
        tp: Tensor-parallel degree.
        arch: Model dimensions.
        hbm_bytes_per_s: HBM bandwidth per GPU.
        bf16_flops: Dense bf16 peak per GPU.
        max_model_len: Context length (prompt + output).
        knot_tokens: Token counts of the dense-cost knots.
        dense_knots_s: Measured per-forward dense cost at each knot, seconds.
        allreduce: ``(a, b)``: one all-reduce costs ``a + b * bytes`` seconds (TP > 1).
        dense_reference: Which Vidur curve the knots come from.
        lengths: The output-length model.
    """

    name: str
    description: str
    model: str
    gpu: str
    tp: int
    arch: Architecture
    hbm_bytes_per_s: float
    bf16_flops: float
    max_model_len: int
    knot_tokens: tuple[int, ...]
    dense_knots_s: tuple[float, ...]
    allreduce: tuple[float, float]
    dense_reference: str
    lengths: OutputLengthModel

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on one GPU."""
        return self.arch.kv_bytes_per_token(self.tp)

    def num_gpu_blocks(self, block_size: int = 16) -> int:
        """KV blocks that fit next to the weights, as vLLM would size its pool."""
        budget = GPU_MEMORY_BYTES[self.gpu] * GPU_MEMORY_UTILIZATION
        free = budget - self.arch.weight_bytes / self.tp - ACTIVATION_RESERVE_BYTES
        return max(0, int(free // (block_size * self.kv_bytes_per_token)))

    def engine_defaults(self, block_size: int = 16) -> dict[str, int]:
        """The vLLM flags ``vllm serve`` would default to on this hardware."""
        big = GPU_MEMORY_BYTES[self.gpu] >= 70 * 2**30 and self.gpu != "a100"
        return {
            "max_num_batched_tokens": 8192 if big else 2048,
            "max_num_seqs": 1024 if big else 256,
            "max_model_len": self.max_model_len,
            "block_size": block_size,
            "num_gpu_blocks": self.num_gpu_blocks(block_size),
        }


@cache
def _table() -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(TABLE_JSON)
    return doc


def _build(name: str, d: Mapping[str, Any], table: Mapping[str, Any]) -> EmulatorProfile:
    a = d["arch"]
    return EmulatorProfile(
        name=name,
        description=d["description"],
        model=d["model"],
        gpu=d["gpu"],
        tp=int(d["tp"]),
        arch=Architecture(
            a["layers"],
            a["hidden"],
            a["heads"],
            a["kv_heads"],
            a["head_dim"],
            a["intermediate"],
            a["vocab"],
            bool(a["gated_mlp"]),
        ),
        hbm_bytes_per_s=float(d["hbm_bytes_per_s"]),
        bf16_flops=float(d["bf16_flops"]),
        max_model_len=int(d["max_model_len"]),
        knot_tokens=tuple(int(t) for t in table["KNOT_TOKENS"]),
        dense_knots_s=tuple(float(s) for s in d["dense_knots_s"]),
        allreduce=(float(d["allreduce"][0]), float(d["allreduce"][1])),
        dense_reference=d["dense_reference"],
        lengths=OutputLengthModel.from_table(table["LENGTHS"], name),
    )


@cache
def _profiles() -> dict[str, EmulatorProfile]:
    t = _table()
    return {name: _build(name, d, t) for name, d in t["PROFILES"].items()}


def profile_names() -> tuple[str, ...]:
    """Names of the shipped emulator profiles."""
    return tuple(sorted(_profiles()))


def get_profile(name: str) -> EmulatorProfile:
    """The shipped profile ``name``.

    Raises:
        KeyError: Unknown name (the message lists the known ones).
    """
    profiles = _profiles()
    if name not in profiles:
        raise KeyError(f"unknown emulator profile {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[name]
