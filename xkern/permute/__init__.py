"""Padded expert row gather for MoE: the core both front ends execute.

Contract (torchtitan's `generate_permute_indices`): `counts[r * E + e]` tokens of local expert `e` come
from rank `r` (E = experts_per_rank); they arrive rank-major, so the source row of the k-th of them is
    row_start[r, e] + k,   row_start[r, e] = sum of counts before index r * E + e.
Each expert gets a block of the padded, expert-major buffer:
    m_sizes[e]   = roundup(max(sum_r counts[r, e], alignment), alignment)      (int32)
    m_offsets[e] = m_sizes[0] + ... + m_sizes[e]                               (int32, inclusive)
and inside its block, starting at m_offsets[e] - m_sizes[e], rows are ordered by rank, then by arrival.
`permuted_indices[s]` (int32, s < max_len) is the source row of slot s, or -1 at padding and past the last
block; rows whose slot would be >= max_len are dropped.

- `kernels`: the row kernels (the gathers, the token-major dispatch, the combines and the combine's backward);
- `index_kernels`: the index kernels (the inverse permutation, generate_permute_indices, topk_permute_indices);
- `plans`: the launch plans, fixed rules from shapes and element sizes (both front ends launch the same binaries);
- `recipes`: the argument rules, the launch recipes the front ends run, and the host-side checks of validate=True;
- `variants`: every launch the plans can choose, for `xkern.compile_check`.

The plans' tuning constants live in `plans` (read, and patch in a probe, there); the few exported here are
limits the contract states.
"""

from xkern.permute.plans import (
    MAX_ROUTE_EXPERTS,
    MAX_UNROLL_K,
    ONE_LAUNCH_SLOTS,
    ROUTE_CHUNK,
    one_launch,
    plan_combine,
    plan_combine_bwd,
    plan_combine_bwd_token,
    plan_gather_rows,
    plan_gather_token_rows,
    plan_generate_indices,
    plan_inverse,
    plan_route_indices,
    plan_scatter_inverse,
    plan_scatter_token_rows,
)
from xkern.permute.recipes import (
    INDEX_DTYPES,
    check_counts,
    check_expert_ids,
    check_gather_sizes,
    check_index,
    check_layout,
    check_permutation,
    check_probs,
    check_route,
    check_rows,
    check_top_k,
    check_unpermute,
    combine_bwd_recipe,
    generate_recipe,
    inverse_recipe,
    layout_ints,
    permute_recipe,
    route_ints,
    route_recipe,
    unpermute_recipe,
)
from xkern.permute.variants import compile_variants

__all__ = [
    "INDEX_DTYPES",
    "MAX_ROUTE_EXPERTS",
    "MAX_UNROLL_K",
    "ONE_LAUNCH_SLOTS",
    "ROUTE_CHUNK",
    "check_counts",
    "check_expert_ids",
    "check_gather_sizes",
    "check_index",
    "check_layout",
    "check_permutation",
    "check_probs",
    "check_route",
    "check_rows",
    "check_top_k",
    "check_unpermute",
    "combine_bwd_recipe",
    "compile_variants",
    "generate_recipe",
    "inverse_recipe",
    "layout_ints",
    "one_launch",
    "permute_recipe",
    "plan_combine",
    "plan_combine_bwd",
    "plan_combine_bwd_token",
    "plan_gather_rows",
    "plan_gather_token_rows",
    "plan_generate_indices",
    "plan_inverse",
    "plan_route_indices",
    "plan_scatter_inverse",
    "plan_scatter_token_rows",
    "route_ints",
    "route_recipe",
    "unpermute_recipe",
]
