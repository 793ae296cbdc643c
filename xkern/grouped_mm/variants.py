"""Every kernel variant the grouped GEMM's plans can choose, as (launch, pointer types), for `xkern.compile_check`
(and torch's access analysis in tests/triton_op_access.py)."""

from __future__ import annotations

from xkern.grouped_mm.plans import (
    MAX_GEMM_EXPERTS,
    dw_tile,
    plan_grouped_mm,
    plan_grouped_mm_dw,
    plan_grouped_mm_dw_split,
)
from xkern.launch import FLOATS, POINTER_TYPES, Launch


def compile_variants() -> list[tuple[Launch, dict]]:
    """Every (kernel, constexprs) the plans choose, at the extremes of what varies with the shapes: each dtype,
    both weight layouts (forward: N contiguous; dx: K contiguous), ALIGN 16 and 1, the inner dim on both sides of
    DEEP_INNER (the rows kernel's stages), BLOCK_E at its least and most (the plans' ALIGN 2-8 and BLOCK_E
    512-2048 are the same code with other constants). The variants' too: the rows kernel on the persistent grid
    ("persistent"), the dw kernel on the narrow tile ("dw_narrow") and the persistent grid ("dw_persistent"), the
    split dw's two kernels ("dw_split") at both ALIGNs, the fewest and most experts, and a chunk doubled for its
    partials' memory."""
    variants = []
    for dtype in FLOATS:
        ptr = POINTER_TYPES[dtype]
        for n_inner, n_cols in ((256, 512), (255, 511), (8192, 512)):  # ALIGN 16, 1; past DEEP_INNER
            for experts in (1, MAX_GEMM_EXPERTS):
                for strides in ((n_inner * n_cols, n_cols, 1), (n_inner * n_cols, 1, n_inner)):
                    for persistent in (False, True):
                        plan = plan_grouped_mm(8192, n_inner, n_cols, experts, dtype, n_inner, strides, None,
                                               persistent)
                        variants.append((plan, {"X": ptr, "W": ptr, "OFFS": "*i32", "Y": ptr}))
            for narrow, persistent in ((False, False), (True, False), (False, True)):
                dw = plan_grouped_mm_dw(8192, n_inner, n_cols, 8, dtype, n_inner, n_cols, dw_tile(dtype, narrow),
                                        persistent)
                variants.append((dw, {"X": ptr, "DY": ptr, "OFFS": "*i32", "DW": ptr}))
            for n_slots, experts in ((16384, 8), (16384, MAX_GEMM_EXPERTS), (2**20, 8)):
                split = plan_grouped_mm_dw_split(n_slots, n_inner, n_cols, experts, dtype, n_inner, n_cols)
                partial = {"X": ptr, "DY": ptr, "OFFS": "*i32", "PARTIAL": "*fp32"}
                variants += [(split.chunks, partial), (split.split, {**partial, "DW": ptr})]
    return variants
