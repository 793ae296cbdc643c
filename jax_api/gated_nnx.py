"""Flax NNX: `GatedRMSNorm`, the hybrid models' gated norm as a module computing through
`jax_api.gated_rms_norm`. Its parameter is `weight` [num_features] (ones), the name of Hugging Face's gated
norm classes and of MaxText's `Qwen3NextRMSNormGated`, so a converted checkpoint's array loads unchanged.

Needs flax (`pip install -e ".[flax]"`); `import jax_api` does not import this module.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_api.gated_rms_norm import gated_rms_norm


class GatedRMSNorm(nnx.Module):
    """`y = gated_rms_norm(hidden_states, gate, weight, eps, ...)` (jax_api.gated_rms_norm: the math, the
    families' settings), bit for bit the torch model's norm.

    Args:
      num_features: the width N of hidden_states' last axis.
      eps: added to the mean square.
      group_size: norm over groups of this many columns (Mamba2's `ngroups`: N // ngroups); None: the row.
      norm_before_gate: True for Qwen3-Next / Kimi Linear (gate after the norm), False for Mamba2 / Nemotron-H.
      activation: "silu" or "sigmoid" (Kimi Linear).
      rounding: "llama" (`w * normed.astype(x.dtype)`) or "fp32" (`w.f32 * normed`).
      param_dtype: the weight's dtype.
      rngs: unused (the weight starts at ones); taken for the usual NNX constructor.

    Example: `GatedRMSNorm(128, 1e-6)(o, z)` with o and z [tokens, 32, 128] (Qwen3-Next's linear attention).
    """

    def __init__(self, num_features: int, eps: float = 1e-6, *, group_size: int | None = None,
                 norm_before_gate: bool = True, activation: str = "silu", rounding: str = "llama",
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.num_features, self.eps, self.group_size = num_features, eps, group_size
        self.norm_before_gate, self.activation, self.rounding = norm_before_gate, activation, rounding
        self.weight = nnx.Param(jnp.ones((num_features,), param_dtype))

    def __call__(self, hidden_states, gate):
        return gated_rms_norm(hidden_states, gate, self.weight[...], self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate, activation=self.activation,
                              rounding=self.rounding)
