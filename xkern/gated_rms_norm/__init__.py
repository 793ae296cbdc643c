"""Gated RMSNorm, the norm of the hybrid linear-attention models (Qwen3-Next / Qwen3.5, Kimi Linear, Mamba2 /
Nemotron-H / Granite 4 / Zamba2 / Bamba, Falcon-H1): the core both front ends execute. The math, the rounding
points and the kernels' schedules: `kernels.py`'s docstring.

- `kernels`: the `@triton.jit` kernels (the dw reduction is RMSNorm's);
- `plans`: the launch plans, fixed rules from shapes;
- `recipes`: the argument rules, the Hugging Face families and the launch recipes the front ends run;
- `variants`: every launch the plans can choose, for `xkern.compile_check`.
"""

from xkern.gated_rms_norm.plans import (
    ACTIVATIONS,
    MAX_BWD_BLOCK,
    MAX_FWD_BLOCK,
    GatedBwdPlan,
    plan_gated_rms_norm_bwd,
    plan_gated_rms_norm_fwd,
)
from xkern.gated_rms_norm.recipes import (
    FAMILIES,
    ROUNDINGS,
    check_gated_rms_norm,
    gated_rms_norm_bwd_recipe,
    gated_rms_norm_fwd_recipe,
    out_dtype_name,
)
from xkern.gated_rms_norm.variants import compile_variants

__all__ = [
    "ACTIVATIONS",
    "FAMILIES",
    "MAX_BWD_BLOCK",
    "MAX_FWD_BLOCK",
    "ROUNDINGS",
    "GatedBwdPlan",
    "check_gated_rms_norm",
    "compile_variants",
    "gated_rms_norm_bwd_recipe",
    "gated_rms_norm_fwd_recipe",
    "out_dtype_name",
    "plan_gated_rms_norm_bwd",
    "plan_gated_rms_norm_fwd",
]
