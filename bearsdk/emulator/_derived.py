"""Numbers derived from the shared real data (generated; do not edit).

Regenerate with ``python -m bearsdk.emulator.derive`` (see ``derive.py`` for
how every number is computed). Units: seconds, tokens, bytes/s, FLOP/s.
"""

from typing import Final

TABLE_JSON: Final = """
{
  "KNOT_TOKENS": [
    1,
    2,
    4,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096
  ],
  "LENGTHS": {
    "categories": {
      "azure-code": [
        2.8078,
        -0.0028,
        0.8472,
        8819
      ],
      "azure-conv": [
        4.513,
        0.0763,
        0.8557,
        19366
      ],
      "code": [
        5.8522,
        -0.0049,
        0.9741,
        370
      ],
      "creative": [
        5.6313,
        0.0477,
        1.1199,
        185
      ],
      "list": [
        6.4051,
        -0.1064,
        0.8585,
        370
      ],
      "qa": [
        5.9589,
        -0.0184,
        0.972,
        2785
      ],
      "rewrite": [
        2.3406,
        0.6204,
        1.0471,
        80
      ],
      "short": [
        6.6468,
        -0.4568,
        1.7081,
        165
      ],
      "summarize": [
        6.528,
        -0.2417,
        0.7226,
        70
      ]
    },
    "model_offset": {
      "llama-3-70b-4xa100": 0.008,
      "llama-3-8b-a100": 0.0373,
      "qwen3-0.6b-h100": 0.2845,
      "qwen3-32b-2xh100": -0.1486,
      "qwen3-8b-h100": -0.1813
    }
  },
  "PROFILES": {
    "llama-3-70b-4xa100": {
      "allreduce": [
        0.000036135,
        9.33272e-12
      ],
      "arch": {
        "gated_mlp": true,
        "head_dim": 128,
        "heads": 64,
        "hidden": 8192,
        "intermediate": 28672,
        "kv_heads": 8,
        "layers": 80,
        "vocab": 128256
      },
      "bf16_flops": 312000000000000.0,
      "dense_knots_s": [
        0.024883,
        0.024884,
        0.025085,
        0.025768,
        0.026174,
        0.026246,
        0.026889,
        0.033534,
        0.050985,
        0.089972,
        0.186832,
        0.338593,
        0.653568
      ],
      "dense_reference": "Vidur a100 meta-llama/Meta-Llama-3-70B TP4",
      "dense_scale": 1.0,
      "description": "llama-3-70b on 4x A100 (dense cost measured: Meta-Llama-3-70B)",
      "gpu": "a100",
      "hbm_bytes_per_s": 2039000000000.0,
      "max_model_len": 8192,
      "model": "meta-llama/Meta-Llama-3-70B-Instruct",
      "tp": 4
    },
    "llama-3-8b-a100": {
      "allreduce": [
        0.0,
        0.0
      ],
      "arch": {
        "gated_mlp": true,
        "head_dim": 128,
        "heads": 32,
        "hidden": 4096,
        "intermediate": 14336,
        "kv_heads": 8,
        "layers": 32,
        "vocab": 128256
      },
      "bf16_flops": 312000000000000.0,
      "dense_knots_s": [
        0.009699,
        0.009796,
        0.009797,
        0.009992,
        0.010142,
        0.010917,
        0.011238,
        0.013193,
        0.019503,
        0.034667,
        0.075199,
        0.143802,
        0.273489
      ],
      "dense_reference": "Vidur a100 meta-llama/Meta-Llama-3-8B TP1",
      "dense_scale": 1.0,
      "description": "llama-3-8b on 1x A100 (dense cost measured: Meta-Llama-3-8B)",
      "gpu": "a100",
      "hbm_bytes_per_s": 2039000000000.0,
      "max_model_len": 8192,
      "model": "meta-llama/Meta-Llama-3-8B-Instruct",
      "tp": 1
    },
    "qwen3-0.6b-h100": {
      "allreduce": [
        0.0,
        0.0
      ],
      "arch": {
        "gated_mlp": true,
        "head_dim": 128,
        "heads": 16,
        "hidden": 1024,
        "intermediate": 3072,
        "kv_heads": 8,
        "layers": 28,
        "vocab": 151936
      },
      "bf16_flops": 989400000000000.0,
      "dense_knots_s": [
        0.00045955,
        0.000470925,
        0.0004711,
        0.000474425,
        0.000483525,
        0.000518525,
        0.0005439,
        0.000572075,
        0.000712425,
        0.00109953,
        0.00217893,
        0.00315385,
        0.00625678
      ],
      "dense_reference": "Vidur h100 microsoft/phi-2 TP1",
      "dense_scale": 0.175,
      "description": "qwen3-0.6b on 1x H100 (dense cost transferred: phi-2)",
      "gpu": "h100",
      "hbm_bytes_per_s": 3350000000000.0,
      "max_model_len": 40960,
      "model": "Qwen/Qwen3-0.6B",
      "tp": 1
    },
    "qwen3-32b-2xh100": {
      "allreduce": [
        0.0000216476,
        3.25531e-12
      ],
      "arch": {
        "gated_mlp": true,
        "head_dim": 128,
        "heads": 64,
        "hidden": 5120,
        "intermediate": 25600,
        "kv_heads": 8,
        "layers": 64,
        "vocab": 151936
      },
      "bf16_flops": 989400000000000.0,
      "dense_knots_s": [
        0.0120862,
        0.0122225,
        0.012291,
        0.0124742,
        0.0124742,
        0.0128096,
        0.0130369,
        0.0135583,
        0.0169232,
        0.0275318,
        0.0537765,
        0.099091,
        0.199717
      ],
      "dense_reference": "Vidur h100 codellama/CodeLlama-34b-Instruct-hf TP2",
      "dense_scale": 0.939394,
      "description": "qwen3-32b on 2x H100 (dense cost transferred: CodeLlama-34b-Instruct-hf)",
      "gpu": "h100",
      "hbm_bytes_per_s": 3350000000000.0,
      "max_model_len": 40960,
      "model": "Qwen/Qwen3-32B",
      "tp": 2
    },
    "qwen3-8b-h100": {
      "allreduce": [
        0.0,
        0.0
      ],
      "arch": {
        "gated_mlp": true,
        "head_dim": 128,
        "heads": 32,
        "hidden": 4096,
        "intermediate": 12288,
        "kv_heads": 8,
        "layers": 36,
        "vocab": 151936
      },
      "bf16_flops": 989400000000000.0,
      "dense_knots_s": [
        0.00600836,
        0.00600836,
        0.00600836,
        0.00600836,
        0.00622502,
        0.00622502,
        0.00628508,
        0.00683636,
        0.00982553,
        0.0128705,
        0.0225812,
        0.0434196,
        0.0893714
      ],
      "dense_reference": "Vidur h100 meta-llama/Llama-2-7b-hf TP1",
      "dense_scale": 1.072539,
      "description": "qwen3-8b on 1x H100 (dense cost transferred: Llama-2-7b-hf)",
      "gpu": "h100",
      "hbm_bytes_per_s": 3350000000000.0,
      "max_model_len": 40960,
      "model": "Qwen/Qwen3-8B",
      "tp": 1
    }
  }
}
"""
