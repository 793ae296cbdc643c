"""RMSNorm with Hugging Face Llama rounding (Gemma, OLMo2 and weightless variants beside it): the core both
front ends execute. The math, the rounding points and the kernels' schedules: `kernels.py`'s docstring.

- `kernels`: the `@triton.jit` kernels, the fused residual add's entry points included;
- `plans`: the launch plans, fixed rules from shapes and element sizes;
- `recipes`: the argument rules and the launch recipes the front ends run;
- `width_sharded`: the form for a hidden dim sharded over devices (its kernels, plans and rule);
- `variants`: every launch the plans can choose, for `xkern.compile_check`.

The fused residual add's rules and recipes are `xkern.add_rms_norm`.
"""

from xkern.rms_norm.plans import (
    MAX_BWD_BLOCK,
    MAX_FWD_BLOCK,
    VARIANTS,
    BwdPlan,
    max_bwd_row,
    plan_dw_reduce,
    plan_rms_norm_bwd,
    plan_rms_norm_fwd,
    split_row,
)
from xkern.rms_norm.recipes import (
    check_rms_norm,
    check_variant,
    out_dtype_name,
    rms_norm_bwd_recipe,
    rms_norm_fwd_recipe,
)
from xkern.rms_norm.variants import compile_variants
from xkern.rms_norm.width_sharded import (
    WidthShardedBwdPlan,
    plan_rms_norm_bwd_width_sharded,
    plan_rms_norm_fwd_width_sharded,
    width_sharded_ok,
)

__all__ = [
    "MAX_BWD_BLOCK",
    "MAX_FWD_BLOCK",
    "VARIANTS",
    "BwdPlan",
    "WidthShardedBwdPlan",
    "check_rms_norm",
    "check_variant",
    "compile_variants",
    "max_bwd_row",
    "out_dtype_name",
    "plan_dw_reduce",
    "plan_rms_norm_bwd",
    "plan_rms_norm_bwd_width_sharded",
    "plan_rms_norm_fwd",
    "plan_rms_norm_fwd_width_sharded",
    "rms_norm_bwd_recipe",
    "rms_norm_fwd_recipe",
    "split_row",
    "width_sharded_ok",
]
