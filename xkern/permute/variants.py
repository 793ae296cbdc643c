"""Every kernel variant the permute ops' plans can choose, as (launch, pointer types), for `xkern.compile_check`
(and torch's access analysis in tests/triton_op_access.py)."""

from __future__ import annotations

from xkern.launch import POINTER_TYPES, Launch
from xkern.permute.plans import (
    MAX_ROUTE_EXPERTS,
    MAX_UNROLL_K,
    ONE_LAUNCH_SLOTS,
    plan_combine,
    plan_combine_bwd,
    plan_gather_rows,
    plan_gather_token_rows,
    plan_generate_indices,
    plan_inverse,
    plan_route_indices,
)
from xkern.permute.recipes import combine_bwd_recipe, permute_recipe


def compile_variants() -> list[tuple[Launch, dict]]:
    """Every (kernel, constexprs) the plans can choose, with a triton 3.6 `ASTSource` signature
    (constexpr parameters are listed as "constexpr"; their values are `launch.constexprs`):
    `triton.compile(ASTSource(l.kernel, sig, l.constexprs), target=..., options={"num_warps": l.num_warps})`.
    The generate-indices kernels are listed for a few expert/rank counts (their constexprs depend on them)."""
    variants = []
    ptr = {2: ("*bf16", "*fp16"), 4: ("*fp32",)}
    for elem_size, dtypes in ptr.items():
        seen = set()
        for log_cols in range(0, 16):
            plan = plan_gather_rows(1024, 1 << log_cols, elem_size)
            key = tuple(plan.constexprs.values())
            if key in seen:
                continue
            seen.add(key)
            verified = plan_gather_rows(1024, 1 << log_cols, elem_size, through_scatter=True)
            search = plan_gather_rows(1024, 1 << log_cols, elem_size, search=True)
            for dtype in dtypes:
                for index in ("*i32", "*i64"):
                    sig = {"SRC": dtype, "IDX": index, "OUT": dtype, "n_rows": "i32", "n_cols": "i32",
                           "n_src_rows": "i32", "src_row_stride": "i64", "BLOCK_M": "constexpr",
                           "BLOCK_H": "constexpr"}
                    variants.append((plan, sig))
                    variants.append((verified, {**sig, "SLOT_OF": index}))
                    variants.append((search, {**sig, "BLOCK_S": "constexpr"}))
    dtype_of = {ptr: name for name, ptr in POINTER_TYPES.items()}
    for elem_size, dtypes in ptr.items():  # the top_k forms: the narrowest, a middle and the chunked tiles
        for n_cols in (1, 16, 128, 1000, 7168):
            token = plan_gather_token_rows(1024, n_cols, elem_size, n_cols)
            bwd = plan_combine_bwd(1024, n_cols, elem_size, n_cols, n_cols)
            # the copies' loop unrolled (top_k 1 and 8: the narrowest and widest unroll) or not (top_k 9)
            top_ks = (1, MAX_UNROLL_K, MAX_UNROLL_K + 1) if n_cols in (1, 128, 7168) else (MAX_UNROLL_K,)
            for dtype in dtypes:
                for index in ("*i32", "*i64"):
                    rows = {"IDX": index, "n_cols": "i32", "src_row_stride": "i64"}
                    variants.append((token, {"SRC": dtype, "OUT": dtype, **rows}))
                    for probs in (None, "*fp32", "*bf16"):
                        for top_k in top_ks:
                            combine = plan_combine(1024, n_cols, elem_size, n_cols, probs is not None, top_k)
                            variants.append((combine, {"SRC": dtype, "OUT": dtype, "SLOT_OF": index,
                                                       "PROBS": probs or index, **rows}))
                        # dprobs in probs' dtype; and in fp32 for 16-bit probs (jax_api's combine backward with
                        # the hidden dim sharded sums the shards' dprobs in fp32 before rounding once)
                        for dprobs in {probs: None, "*fp32": None} if probs else ():
                            ptrs = {"DOUT": dtype, "Y": dtype, "DY": dtype, "IDX": index, "PROBS": probs,
                                    "DPROBS": dprobs}
                            variants.append((bwd, ptrs))
                            if n_cols in (1, 128, 7168):
                                for top_k in (2, MAX_UNROLL_K):
                                    steps = combine_bwd_recipe(1024, n_cols, 1024, dtype_of[dtype], n_cols, n_cols,
                                                               top_k, dtype_of[probs], token_major=True).steps
                                    variants.append((steps[-1].launch, {**ptrs, "SLOT_OF": index}))
                    if n_cols in (1, 128, 7168):
                        for top_k in (2, MAX_UNROLL_K):
                            steps = permute_recipe(1024, n_cols, 1024, dtype_of[dtype], n_cols, top_k,
                                                   token_major=True).steps
                            variants.append((steps[-1].launch, {"SRC": dtype, "SLOT_OF": index, "OUT": dtype, **rows}))
    for index in ("*i32", "*i64"):
        scatter, verify = plan_inverse(ONE_LAUNCH_SLOTS + 1, 4096)
        (search,) = plan_inverse(ONE_LAUNCH_SLOTS, 4096)
        variants.append((scatter, {"IDX": index, "SLOT_OF": index, "n_slots": "i32", "n_rows": "i32",
                                   "BLOCK": "constexpr"}))
        variants.append((verify, {"IDX": index, "SLOT_OF": index, "INV": index, "n_slots": "i32", "n_rows": "i32",
                                  "BLOCK": "constexpr"}))
        variants.append((search, {"IDX": index, "INV": index, "n_slots": "i32", "n_rows": "i32",
                                  "BLOCK": "constexpr", "BLOCK_S": "constexpr"}))
    tables = {"M_SIZES": "*i32", "M_OFFSETS": "*i32", "ROW_START": "*i32", "RANK_BEGIN": "*i32"}
    for experts, ranks in ((1, 1), (8, 1), (4, 64), (32, 8), (256, 1)):
        sizes, fill = plan_generate_indices(experts, ranks, 65536)
        for max_len in (1, 100, ONE_LAUNCH_SLOTS):
            (one,) = plan_generate_indices(experts, ranks, max_len)
            for counts in ("*i32", "*i64"):
                variants.append((one, {"COUNTS": counts, **tables, "OUT": "*i32", "n_experts": "i32",
                                       "n_ranks": "i32", "alignment": "i32", "max_len": "i32",
                                       "BLOCK_E": "constexpr", "BLOCK_S": "constexpr", "STEPS_E": "constexpr",
                                       "STEPS_R": "constexpr"}))
        for counts in ("*i32", "*i64"):
            variants.append((sizes, {"COUNTS": counts, "M_SIZES": "*i32", "M_OFFSETS": "*i32",
                                     "ROW_START": "*i32", "RANK_BEGIN": "*i32", "n_experts": "i32",
                                     "n_ranks": "i32", "alignment": "i32", "BLOCK_E": "constexpr"}))
            variants.append((fill, {"COUNTS": counts, "M_SIZES": "*i32", "M_OFFSETS": "*i32",
                                    "ROW_START": "*i32", "RANK_BEGIN": "*i32", "OUT": "*i32", "max_len": "i32",
                                    "n_experts": "i32", "n_ranks": "i32", "BLOCK_S": "constexpr",
                                    "STEPS_E": "constexpr", "STEPS_R": "constexpr"}))
    for experts in (1, 8, 128, 256, 1000, MAX_ROUTE_EXPERTS):
        count, tables, fill = plan_route_indices(65536, experts, 65536 + 16 * experts)
        for ids in ("*i32", "*i64"):
            variants.append((count, {"IDS": ids, "n_copies": "i32", "n_experts": "i32", "COUNTS": "*i32",
                                     "RANK": "*i32", "CHUNK": "constexpr", "SUB": "constexpr", "BLOCK_E": "constexpr"}))
            variants.append((fill, {"IDS": ids, "RANK": "*i32", "BASE": "*i32", "M_SIZES": "*i32",
                                    "M_OFFSETS": "*i32", "TOTALS": "*i32", "n_copies": "i32", "n_chunks": "i32",
                                    "n_experts": "i32", "max_len": "i32", "OUT": "*i32", "CHUNK": "constexpr",
                                    "BLOCK_S": "constexpr"}))
        variants.append((tables, {"COUNTS": "*i32", "n_chunks": "i32", "n_experts": "i32", "alignment": "i32",
                                  "M_SIZES": "*i32", "M_OFFSETS": "*i32", "TOTALS": "*i32", "BASE": "*i32",
                                  "ROWS": "constexpr", "BLOCK_E": "constexpr"}))
    return variants
