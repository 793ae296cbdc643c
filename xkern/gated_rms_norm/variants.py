"""Every kernel variant gated RMSNorm's plans can choose, as (launch, pointer types), for `xkern.compile_check`."""

from __future__ import annotations

from xkern.gated_rms_norm.plans import MAX_BWD_BLOCK, MAX_FWD_BLOCK
from xkern.gated_rms_norm.recipes import (
    FAMILIES,
    gated_rms_norm_bwd_recipe,
    gated_rms_norm_fwd_recipe,
    out_dtype_name,
)
from xkern.launch import FLOATS, POINTER_TYPES


def compile_variants():
    """Every block width (group sizes 1 to past the widest tiles, 8 groups of 1024, 3 of 100) for Qwen3-Next's
    family in bf16; the other families at each kernel; every dtype pair, for one family of each rounding, at
    the head width and past the widest tiles (the chunked forward, the column-split backward); sigmoid."""
    widths = [(1 << k, 1 << k) for k in range(15)] + [(MAX_BWD_BLOCK + 8, MAX_BWD_BLOCK + 8),
                                                     (MAX_FWD_BLOCK + 8, MAX_FWD_BLOCK + 8), (8192, 1024), (300, 100)]
    cases = [("bfloat16", "bfloat16", n, g, "norm-llama-then-gate", "silu") for n, g in widths]
    cases += [("bfloat16", "bfloat16", n, g, family, "silu") for n, g in widths[:1] + widths[7:8] + widths[-4:]
              for family in FAMILIES if family != "norm-llama-then-gate"]
    cases += [(x, w, n, n, family, "silu") for x in FLOATS for w in FLOATS
              for family in ("norm-llama-then-gate", "gate-then-fp32-group-norm") for n in (128, MAX_FWD_BLOCK + 8)]
    cases += [("bfloat16", "bfloat16", n, n, "norm-fp32-then-gate", "sigmoid") for n in (128, MAX_FWD_BLOCK + 8)]
    for x_dtype, w_dtype, n_cols, group_size, family, activation in cases:
        norm_before_gate, _, rounding = FAMILIES[family]
        options = dict(norm_before_gate=norm_before_gate, activation=activation, rounding=rounding)
        y_dtype = out_dtype_name(x_dtype, w_dtype, norm_before_gate, rounding)
        ptrs = {"X": POINTER_TYPES[x_dtype], "Z": POINTER_TYPES[x_dtype], "W": POINTER_TYPES[w_dtype],
                "Y": POINTER_TYPES[y_dtype], "DY": POINTER_TYPES[y_dtype], "DX": POINTER_TYPES[x_dtype],
                "DZ": POINTER_TYPES[x_dtype], "DW_PARTIAL": "*fp32", "DW": POINTER_TYPES[w_dtype], "STATS": "*fp32"}
        fwd = gated_rms_norm_fwd_recipe(100_000, n_cols, group_size, 1e-6, x_dtype, w_dtype, **options)
        bwd = gated_rms_norm_bwd_recipe(100_000, n_cols, group_size, 1e-6, x_dtype, w_dtype, **options)
        for step in fwd.steps + bwd.steps:
            if step.launch is not None:
                yield step.launch, ptrs
