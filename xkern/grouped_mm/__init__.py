"""Grouped GEMM over the padded expert-major layout of MoE (`permute_rows`' output): the core both front ends
execute.

Contract: x [S, K] (S slots), w [E, K, N], m_offsets [E] int32, the cumulative ENDS of the experts' blocks
(non-decreasing, m_offsets[-1] <= S; expert e's rows are slots [m_offsets[e-1], m_offsets[e]), m_offsets[-1]
= 0). The layout of torch._grouped_mm's `offs` and of jax.lax.ragged_dot's group sizes (their cumsum).
    y[r] = x[r] @ w[e]  for r in expert e's block (FP32 accumulation, rounded once to x's dtype),
    y[r] = 0            for r >= m_offsets[-1]   (every element of y is written).
Gradients: dx = the same kernel on dy with w read transposed (strides, no copy): dx[r] = dy[r] @ w[e].T;
dw[e] = x_e.T @ dy_e (FP32 over the expert's rows, rounded once; zeros for an expert with no rows). No
atomics: every output element is summed by one program in one order, so results are bitwise run to run.
fp32 inputs multiply in IEEE FP32 (`input_precision="ieee"`: no TF32); 16-bit inputs use the tensor cores.

- `kernels`: the rows kernel (y and dx) and the dw kernel;
- `plans`: the launch plans, fixed tiles per dtype fitted to the GPU's shared memory;
- `recipes`: the argument rules, the launch recipes the front ends run, and the host-side check of validate=True;
- `variants`: every launch the plans can choose, for `xkern.compile_check`.
"""

from xkern.grouped_mm.plans import (
    DEEP_INNER,
    DW_TILES,
    MAX_GEMM_EXPERTS,
    MIN_BLOCK_E,
    ROWS_TILES,
    VARIANTS,
    GemmTile,
    dw_tile,
    fit,
    pipeline_bytes,
    plan_grouped_mm,
    plan_grouped_mm_dw,
    rows_tile,
    set_variant,
    variant,
    weight_layout,
)
from xkern.grouped_mm.recipes import (
    check_grouped_mm,
    check_grouped_mm_dw,
    check_grouped_mm_dx,
    check_offsets,
    grouped_mm_dw_recipe,
    grouped_mm_dx_recipe,
    grouped_mm_recipe,
)
from xkern.grouped_mm.variants import compile_variants

__all__ = [
    "DEEP_INNER",
    "DW_TILES",
    "MAX_GEMM_EXPERTS",
    "MIN_BLOCK_E",
    "ROWS_TILES",
    "VARIANTS",
    "GemmTile",
    "check_grouped_mm",
    "check_grouped_mm_dw",
    "check_grouped_mm_dx",
    "check_offsets",
    "compile_variants",
    "dw_tile",
    "fit",
    "grouped_mm_dw_recipe",
    "grouped_mm_dx_recipe",
    "grouped_mm_recipe",
    "pipeline_bytes",
    "plan_grouped_mm",
    "plan_grouped_mm_dw",
    "rows_tile",
    "set_variant",
    "variant",
    "weight_layout",
]
