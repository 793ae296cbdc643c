"""Every kernel variant RMSNorm's plans can choose, as (launch, pointer types), for `xkern.compile_check`
(and torch's access analysis in tests/triton_op_access.py)."""

from __future__ import annotations

from xkern.launch import FLOATS, ITEMSIZE, POINTER_TYPES
from xkern.rms_norm.plans import MAX_BWD_BLOCK, MAX_FWD_BLOCK, max_bwd_row, plan_rms_norm_bwd, plan_rms_norm_fwd
from xkern.rms_norm.recipes import out_dtype_name
from xkern.rms_norm.width_sharded import plan_rms_norm_bwd_width_sharded, plan_rms_norm_fwd_width_sharded


def compile_variants():
    """Every (launch, signature) the plans can choose, one device and width-sharded, for the sm_90 compile check
    (xkern/compile_check.py); the fused residual add's are `xkern.add_rms_norm.compile_variants`."""
    pointer = POINTER_TYPES
    dtype_pairs = [("bfloat16", "bfloat16")]
    widths = [1 << k for k in range(17)] + [MAX_FWD_BLOCK + 1]  # every BLOCK_N and both chunked kernels
    widths += [3, 300, 640, 2052, 5000]  # every ROW_ALIGN; 640: the forward's tile at BLOCK_N 1024
    widths += [80, 96, 576, 768, 2560, 5120, 7168, 9000, 12288, 18432]  # rows in SPLIT blocks (split_row, BWD_ROW_9X64)
    widths += [4608, 16896, 20480, 24576, 28672, max_bwd_row() + 1]  # the backward's wide row kernel, either side
    # 1 and 16 rows: a backward of one program, writing dw itself (BwdPlan.dw_direct) at its own BLOCK_M
    cases = [(x, w, n, r) for x, w in dtype_pairs for n in widths for r in (1, 16, 100_000)]
    pairs = [(x, w) for x in FLOATS for w in FLOATS]
    cases += [(x, w, n, 100_000) for x, w in pairs for n in (128, 576, 4096, 5120, MAX_BWD_BLOCK + 1, 20480,
                                                              MAX_FWD_BLOCK // 2 + 1, MAX_FWD_BLOCK + 1)]
    cases += [(x, w, n, 16) for x, w in pairs for n in (128, 4096)]  # one backward program: dw in w's dtype
    cases = [(*case, "llama") for case in cases]
    # The other variants: every kernel (each BLOCK_N once) and every dtype pair, each with its own rounding
    # points; "none" reads x only (W bound to x).
    variant_widths = [1 << k for k in range(17)] + [MAX_FWD_BLOCK + 1]
    for variant in ("gemma", "olmo2", "none"):
        cases += [("bfloat16", "bfloat16", n, 100_000, variant) for n in variant_widths]
        cases += [(x, w, n, 100_000, variant) for x, w in pairs if variant != "none" or x == w
                  for n in (128, 4096, MAX_BWD_BLOCK + 1, MAX_FWD_BLOCK // 2 + 1)]
        cases += [("bfloat16", "bfloat16", n, 16, variant) for n in (128, 4096)]
    for x_dtype, w_dtype, n_cols, n_rows, variant in cases:
        y_dtype = out_dtype_name(x_dtype, w_dtype, variant)
        ptrs = {"X": pointer[x_dtype], "W": pointer[w_dtype], "Y": pointer[y_dtype], "DY": pointer[y_dtype],
                "DX": pointer[x_dtype], "DW_PARTIAL": "*fp32", "DW": pointer[w_dtype]}
        ptrs["STATS"] = "*fp32"
        bwd = plan_rms_norm_bwd(n_rows, n_cols, 1e-6, variant=variant,
                                itemsize=max(ITEMSIZE[x_dtype], ITEMSIZE[y_dtype]))  # as rms_norm_bwd_recipe
        itemsize = max(ITEMSIZE[d] for d in (x_dtype, w_dtype, y_dtype))
        for launch in (plan_rms_norm_fwd(n_rows, n_cols, 1e-6, (), itemsize, variant), bwd.stats, bwd.bwd,
                       bwd.reduce):
            if launch is not None:
                yield launch, ptrs
        if bwd.dw_direct:  # dw in w's dtype, or fp32 (dw_dtype: shards' dw summed before one rounding)
            yield bwd.bwd, {**ptrs, "DW_PARTIAL": pointer[w_dtype]}
        if n_rows == 100_000 and n_cols in (1, 3, 300, 2052, 4096, 16384):  # the width-sharded kernels (a shard)
            ptrs = {**ptrs, "SUM_SQ": "*fp32", "SUMS": "*fp32"}
            sharded = plan_rms_norm_bwd_width_sharded(n_rows, n_cols, 1e-6, variant=variant)
            for launch in (*plan_rms_norm_fwd_width_sharded(n_rows, n_cols, 1e-6, variant=variant), sharded.sums,
                           sharded.finish, sharded.bwd, sharded.reduce):
                if launch is not None:
                    yield launch, ptrs
