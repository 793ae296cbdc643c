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
    """Every family at every block width (group sizes 1 to past the widest tiles, groups of 8 included) in bf16;
    every dtype pair at the head width and a wide group; sigmoid in bf16."""
    widths = [(1 << k, 1 << k) for k in range(15)] + [(MAX_BWD_BLOCK + 8, MAX_BWD_BLOCK + 8),
                                                     (MAX_FWD_BLOCK + 8, MAX_FWD_BLOCK + 8), (8192, 1024), (300, 100)]
    cases = [("bfloat16", "bfloat16", n, g, family, "silu") for n, g in widths for family in FAMILIES]
    cases += [(x, w, n, n, family, "silu") for x in FLOATS for w in FLOATS for family in FAMILIES
              for n in (128, MAX_FWD_BLOCK + 8)]
    cases += [("bfloat16", "bfloat16", n, n, family, "sigmoid") for family in FAMILIES for n in (128, 4096,
                                                                                              MAX_FWD_BLOCK + 8)]
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
