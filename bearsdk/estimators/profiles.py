"""Named default batch-time profiles, and how every coefficient in them is derived.

``profiles.toml`` (next to this module) holds one table per profile: the eq. 12
coefficients, the richer dense-term variant, ``theta_pre``, and the inputs of the
derivation. :func:`load_profile` returns a profile's
:class:`~bearsdk.estimators.batch_time.BatchTimeModel`; :func:`get_profile` the
whole record.

Derivation (:func:`derive_profile`; the numbers in the TOML are its output, and a
test re-derives them from the shared data):

* ``b0``, ``b1`` (dense): a robust relative fit of ``b0 + b1 * tokens`` (and of
  ``b0 + b1 * max(tokens, tau)`` for the richer variant) to Vidur's measured
  per-forward dense cost (``dense.py``) of the model on the GPU at the TP degree.
  A model Vidur did not profile (the Qwen3 family) takes the curve of the
  closest profiled model on the same GPU and TP, scaled by the ratio of dense
  parameters per forward (FLOPs and weight bytes both scale with it).
* Tensor parallelism: each layer does two all-reduces of ``tokens * hidden * 2``
  bytes; Vidur's measured all-reduce line ``a + b * bytes`` adds ``2 L a`` to
  ``b0`` and ``4 L b hidden`` to ``b1``.
* ``b0`` also gets the LM-head weight read (``vocab * hidden * 2 / tp`` bytes at
  the attention bandwidth efficiency) and a fixed engine step overhead.
* ``b2`` (decode attention, per key a decode reads: its context and itself, the
  profiles' ``decode_keys = "attended"``): the KV bytes one context token
  holds on one GPU (``2 * L * ceil(kv_heads / tp) * head_dim * 2``) over the HBM
  bandwidth times ``ATTN_BW_EFFICIENCY``.
* ``b3`` (prefill attention, per query-key pair): ``4 * head_dim * heads / tp * L``
  FLOPs (QK^T and PV) over the bf16 peak times ``ATTN_FLOPS_EFFICIENCY``.
* ``theta_pre``: the throughput the model implies for back-to-back fresh 2048-token
  prefill chunks (:func:`~bearsdk.estimators.prefill.nominal_theta_pre`).

The attention efficiencies are assumptions (Vidur's attention timings are not in
the shared data); calibrate online (:class:`~bearsdk.estimators.batch_time.OnlineBatchTime`)
or with ``bearsdk calibrate`` for real numbers.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np

from bearsdk.estimators.batch_time import DECODE_KEYS, BatchTimeModel
from bearsdk.estimators.dense import (
    MLP_CSV,
    NETWORK_CSV,
    DenseCurve,
    allreduce_line,
    dense_curves,
    fit_dense,
)
from bearsdk.estimators.prefill import nominal_theta_pre

__all__ = [
    "ATTN_BW_EFFICIENCY",
    "ATTN_FLOPS_EFFICIENCY",
    "ENGINE_OVERHEAD_S",
    "GPUS",
    "PROFILE_SPECS",
    "Architecture",
    "BatchTimeProfile",
    "Gpu",
    "ProfileSpec",
    "derive_profile",
    "get_profile",
    "load_profile",
    "profile_names",
    "render_profiles_toml",
]

PROFILES_TOML: Final = Path(__file__).with_name("profiles.toml")
ATTN_BW_EFFICIENCY: Final = 0.6
"""Fraction of HBM bandwidth paged decode attention achieves (assumed)."""
ATTN_FLOPS_EFFICIENCY: Final = 0.4
"""Fraction of bf16 peak FLOPs flash prefill attention achieves (assumed)."""
ENGINE_OVERHEAD_S: Final = 1.0e-3
"""Fixed per-step engine overhead: scheduling, sampling, output processing (assumed)."""
CHUNK_TOKENS: Final = 2048


@attrs.frozen
class Gpu:
    """Datasheet numbers of one GPU type (SXM parts).

    Attributes:
        name: ``h100`` or ``a100``.
        hbm_bytes_per_s: HBM bandwidth.
        bf16_flops: Dense bf16 tensor-core peak.
        network_device: Vidur's name for its NVLink node (all-reduce timings).
    """

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    network_device: str


GPUS: Final = {
    "h100": Gpu("h100", 3.35e12, 989.4e12, "h100_dgx"),
    "a100": Gpu("a100", 2.039e12, 312e12, "a100_dgx"),
}


@attrs.frozen
class Architecture:
    """What the derivation needs of a decoder-only transformer.

    Attributes:
        layers: Decoder layers.
        hidden: Hidden size.
        heads: Query heads.
        kv_heads: Key/value heads.
        head_dim: Dimension per head.
        intermediate: MLP intermediate size.
        vocab: Vocabulary size.
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
    def dense_params_per_layer(self) -> int:
        """Weights of the QKV/O projections and the MLP of one layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attn + mlp

    @property
    def dense_params(self) -> int:
        """Dense weights touched per token in one forward (excluding embedding and LM head)."""
        return self.layers * self.dense_params_per_layer

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV-cache bytes one context token holds on one GPU (bf16)."""
        return 2 * self.layers * math.ceil(self.kv_heads / tp) * self.head_dim * 2

    def attention_flops_per_pair(self, tp: int) -> float:
        """FLOPs per query-key pair on one GPU (QK^T and PV, all layers)."""
        return 4.0 * self.head_dim * self.heads / tp * self.layers

    @classmethod
    def of_curve(cls, c: DenseCurve) -> Architecture:
        """The architecture Vidur's profile describes."""
        return cls(
            c.layers,
            c.hidden,
            c.heads,
            c.kv_heads,
            c.hidden // c.heads,
            c.intermediate,
            c.vocab,
            c.gated_mlp,
        )


@attrs.frozen
class ProfileSpec:
    """The inputs of one profile's derivation.

    Attributes:
        name: Profile name.
        description: One line for humans.
        gpu: GPU type.
        tp: Tensor-parallel degree.
        reference: Vidur model whose measured dense curve is used.
        arch: The model's architecture; ``None``: the reference's own (measured profile).
    """

    name: str
    description: str
    gpu: str
    tp: int
    reference: str
    arch: Architecture | None = None


_QWEN3_VOCAB: Final = 151936
PROFILE_SPECS: Final = (
    ProfileSpec(
        "qwen3-0.6b-h100",
        "Qwen3-0.6B bf16 on 1x H100 (dense cost transferred from phi-2)",
        "h100",
        1,
        "microsoft/phi-2",
        Architecture(28, 1024, 16, 8, 128, 3072, _QWEN3_VOCAB),
    ),
    ProfileSpec(
        "qwen3-8b-h100",
        "Qwen3-8B bf16 on 1x H100 (dense cost transferred from Llama-2-7B)",
        "h100",
        1,
        "meta-llama/Llama-2-7b-hf",
        Architecture(36, 4096, 32, 8, 128, 12288, _QWEN3_VOCAB),
    ),
    ProfileSpec(
        "qwen3-32b-2xh100",
        "Qwen3-32B bf16 on 2x H100, TP 2 (dense cost transferred from CodeLlama-34B)",
        "h100",
        2,
        "codellama/CodeLlama-34b-Instruct-hf",
        Architecture(64, 5120, 64, 8, 128, 25600, _QWEN3_VOCAB),
    ),
    ProfileSpec(
        "llama-2-7b-h100", "Llama-2-7B on 1x H100 (measured)", "h100", 1, "meta-llama/Llama-2-7b-hf"
    ),
    ProfileSpec("phi-2-h100", "phi-2 on 1x H100 (measured)", "h100", 1, "microsoft/phi-2"),
    ProfileSpec(
        "internlm-20b-h100",
        "InternLM-20B on 1x H100 (measured)",
        "h100",
        1,
        "internlm/internlm-20b",
    ),
    ProfileSpec(
        "codellama-34b-2xh100",
        "CodeLlama-34B on 2x H100, TP 2 (measured)",
        "h100",
        2,
        "codellama/CodeLlama-34b-Instruct-hf",
    ),
    ProfileSpec(
        "llama-2-70b-4xh100",
        "Llama-2-70B on 4x H100, TP 4 (measured)",
        "h100",
        4,
        "meta-llama/Llama-2-70b-hf",
    ),
    ProfileSpec(
        "qwen-72b-4xh100", "Qwen-72B on 4x H100, TP 4 (measured)", "h100", 4, "Qwen/Qwen-72B"
    ),
    ProfileSpec(
        "llama-3-8b-a100",
        "Llama-3-8B on 1x A100 (measured)",
        "a100",
        1,
        "meta-llama/Meta-Llama-3-8B",
    ),
    ProfileSpec(
        "llama-3-70b-4xa100",
        "Llama-3-70B on 4x A100, TP 4 (measured)",
        "a100",
        4,
        "meta-llama/Meta-Llama-3-70B",
    ),
)


@attrs.frozen
class BatchTimeProfile:
    """A named default profile.

    Attributes:
        name: Profile name.
        description: One line for humans.
        model: Eq. 12 coefficients (the default).
        dense_floor_model: The richer dense-term variant.
        theta_pre: Nominal prefill throughput, tokens/s.
        source: ``measured`` (Vidur profiled this model) or ``transferred``.
        derivation: How each coefficient was obtained, by coefficient name.
        inputs: The derivation's inputs (architecture, GPU, fit errors).
    """

    name: str
    description: str
    model: BatchTimeModel
    dense_floor_model: BatchTimeModel
    theta_pre: float
    source: str
    derivation: Mapping[str, str]
    inputs: Mapping[str, Any]


def _dense_curve_for(
    spec: ProfileSpec, curves: Mapping[tuple[str, str, int], DenseCurve]
) -> tuple[DenseCurve, Architecture, float]:
    key = (spec.gpu, spec.reference, spec.tp)
    if key not in curves:
        raise ValueError(f"profile {spec.name!r}: no Vidur dense curve for {key}")
    ref = curves[key]
    ref_arch = Architecture.of_curve(ref)
    arch = spec.arch or ref_arch
    return ref, arch, arch.dense_params / ref_arch.dense_params


def derive_profile(
    spec: ProfileSpec,
    data_dir: Path,
    *,
    curves: Mapping[tuple[str, str, int], DenseCurve] | None = None,
) -> BatchTimeProfile:
    """Derive one profile from the shared Vidur data and datasheet numbers.

    Args:
        spec: What to derive.
        data_dir: The shared data directory (holding ``vidur_profiling/``).
        curves: Pre-read dense curves (saves re-reading the CSV per profile).
    """
    if curves is None:
        curves = dense_curves(data_dir / MLP_CSV)
    gpu = GPUS[spec.gpu]
    ref, arch, scale = _dense_curve_for(spec, curves)
    keep = ref.tokens <= 4096
    tokens, seconds = ref.tokens[keep], ref.seconds[keep] * scale
    lin = fit_dense(tokens, seconds)
    flo = fit_dense(tokens, seconds, floor=True)
    comm0 = comm1 = 0.0
    if spec.tp > 1:
        a, b = allreduce_line(data_dir / NETWORK_CSV, gpu.network_device, spec.tp)
        comm0 = 2 * arch.layers * a
        comm1 = 2 * arch.layers * b * arch.hidden * 2
    lm_head = arch.vocab * arch.hidden * 2 / spec.tp / (gpu.hbm_bytes_per_s * ATTN_BW_EFFICIENCY)
    fixed = comm0 + lm_head + ENGINE_OVERHEAD_S
    b2 = arch.kv_bytes_per_token(spec.tp) / (gpu.hbm_bytes_per_s * ATTN_BW_EFFICIENCY)
    b3 = arch.attention_flops_per_pair(spec.tp) / (gpu.bf16_flops * ATTN_FLOPS_EFFICIENCY)
    model = BatchTimeModel(lin.b0 + fixed, lin.b1 + comm1, b2, b3)
    floor_model = BatchTimeModel(flo.b0 + fixed, flo.b1 + comm1, b2, b3, dense_floor_tokens=flo.tau)
    measured = spec.arch is None
    src = f"Vidur {spec.gpu} {spec.reference} TP{spec.tp}"
    dense_how = (
        f"robust relative fit to {src} dense cost (1-4096 tokens)"
        if measured
        else f"robust relative fit to {src} dense cost x {scale:.4f} (dense-parameter ratio)"
    )
    derivation = {
        "b0": (
            f"dense intercept {lin.b0:.4g} s ({dense_how}) + LM-head read {lm_head:.3g} s "
            f"+ engine step {ENGINE_OVERHEAD_S:g} s"
            + (f" + 2L all-reduce latency {comm0:.3g} s" if spec.tp > 1 else "")
        ),
        "b1": f"dense slope {lin.b1:.4g} s/token ({dense_how})"
        + (f" + 4L*hidden all-reduce bytes/token cost {comm1:.3g} s" if spec.tp > 1 else ""),
        "b2": (
            f"KV bytes/token/GPU {arch.kv_bytes_per_token(spec.tp)} / "
            f"({gpu.hbm_bytes_per_s:.4g} B/s x {ATTN_BW_EFFICIENCY})"
        ),
        "b3": (
            f"attention FLOPs/pair/GPU {arch.attention_flops_per_pair(spec.tp):.6g} / "
            f"({gpu.bf16_flops:.4g} FLOP/s x {ATTN_FLOPS_EFFICIENCY})"
        ),
        "dense_floor_tokens": f"knee of the max-form fit b0 + b1*max(tokens, tau) ({dense_how})",
        "theta_pre": f"{CHUNK_TOKENS} / eq. 12 time of one fresh {CHUNK_TOKENS}-token chunk",
    }
    inputs: dict[str, Any] = {
        "gpu": spec.gpu,
        "tp": spec.tp,
        "reference": spec.reference,
        "dense_scale": scale,
        "dense_mape": lin.mape,
        "dense_floor_mape": flo.mape,
        **{f"arch_{k}": v for k, v in attrs.asdict(arch).items()},
    }
    return BatchTimeProfile(
        name=spec.name,
        description=spec.description,
        model=model,
        dense_floor_model=floor_model,
        theta_pre=nominal_theta_pre(model, CHUNK_TOKENS),
        source="measured" if measured else "transferred",
        derivation=derivation,
        inputs=inputs,
    )


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, float):
        return repr(float(v))
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def render_profiles_toml(profiles: list[BatchTimeProfile]) -> str:
    """Render profiles as the ``profiles.toml`` text (the file is this function's output)."""
    lines = [
        "# Named default batch-time profiles (eq. 12). Generated by",
        "# bearsdk.estimators.profiles.render_profiles_toml from the shared Vidur data:",
        "# `bearsdk calibrate --derive-profiles bearsdk/estimators/profiles.toml`.",
        "# Units: seconds, tokens, tokens/s. See docs/batch-time.md for the derivation.",
        "",
    ]
    for p in profiles:
        lines.append(f'[profiles."{p.name}"]')
        lines.append(f"description = {_toml_value(p.description)}")
        lines.append(f"source = {_toml_value(p.source)}")
        for k, v in p.model.to_dict().items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append(f"theta_pre = {_toml_value(p.theta_pre)}")
        lines.append("")
        lines.append(f'[profiles."{p.name}".dense_floor]')
        for k, v in p.dense_floor_model.to_dict().items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
        lines.append(f'[profiles."{p.name}".derivation]')
        for k, text in p.derivation.items():
            lines.append(f"{k} = {_toml_value(text)}")
        lines.append("")
        lines.append(f'[profiles."{p.name}".inputs]')
        for k, v in p.inputs.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


@cache
def _load_all() -> dict[str, BatchTimeProfile]:
    with open(PROFILES_TOML, "rb") as fh:
        doc = tomllib.load(fh)
    out = {}
    for name, t in doc.get("profiles", {}).items():
        try:
            model = BatchTimeModel(
                t["b0"], t["b1"], t["b2"], t["b3"], decode_keys=t.get("decode_keys", DECODE_KEYS[0])
            )
            fl = t["dense_floor"]
            floor_model = BatchTimeModel(
                fl["b0"],
                fl["b1"],
                fl["b2"],
                fl["b3"],
                dense_floor_tokens=fl.get("dense_floor_tokens", 0.0),
                decode_keys=fl.get("decode_keys", DECODE_KEYS[0]),
            )
            out[name] = BatchTimeProfile(
                name=name,
                description=t["description"],
                model=model,
                dense_floor_model=floor_model,
                theta_pre=float(t["theta_pre"]),
                source=t["source"],
                derivation=dict(t.get("derivation", {})),
                inputs=dict(t.get("inputs", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{PROFILES_TOML}: profile {name!r} is malformed ({exc})") from None
    return out


def profile_names() -> tuple[str, ...]:
    """Names of the shipped profiles."""
    return tuple(sorted(_load_all()))


def get_profile(name: str) -> BatchTimeProfile:
    """The full record of a shipped profile.

    Raises:
        KeyError: Unknown name (the message lists the known ones).
    """
    profiles = _load_all()
    if name not in profiles:
        raise KeyError(f"unknown batch-time profile {name!r}; known: {', '.join(sorted(profiles))}")
    return profiles[name]


def load_profile(name: str, *, dense_floor: bool = False) -> BatchTimeModel:
    """A shipped profile's batch-time model.

    Args:
        name: Profile name (see :func:`profile_names`).
        dense_floor: Return the richer dense-term variant instead of eq. 12.
    """
    p = get_profile(name)
    return p.dense_floor_model if dense_floor else p.model
