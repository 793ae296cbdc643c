"""Argument rules of expert-parallel dispatch (torch_api.ep, jax_api.ep), shared by both front ends.

Static rules (shapes, dtypes, Python ints) run on every call. The rule on the values of topk_ids (every
id in [0, num_experts)) needs them on the host: torch reads their min and max with the counts it already
syncs on; JAX checks them only with `validate=True` (a host callback), and otherwise drops rows whose id
is out of range, as it drops rows past `capacity`.
"""

from __future__ import annotations

from xkern.launch import INT32_MAX, check_int, check_row_count


def check_dispatch(x_shape, ids_shape, ids_dtype: str, ids_is_integer: bool, num_experts, world: int,
                   alignment) -> tuple[int, int]:
    """(num_experts, alignment) as ints; TypeError/ValueError naming the argument that breaks a rule.

    x: [T, H]; topk_ids: [T, K] of an integer dtype (a float id would be truncated to another expert);
    num_experts >= 1 and a multiple of the group size `world`; alignment >= 1, and one aligned block per
    local expert must fit the int32 m_offsets."""
    num_experts = check_int("num_experts", num_experts, 1)
    alignment = check_int("alignment", alignment, 1)
    if not ids_is_integer:
        raise TypeError(f"topk_ids must have an integer dtype (expert ids), got {ids_dtype}")
    if len(x_shape) != 2:
        raise ValueError(f"x must be [T, H], got shape {list(x_shape)}")
    if len(ids_shape) != 2 or ids_shape[0] != x_shape[0]:
        raise ValueError(f"topk_ids must be [T, K] with x's T = {x_shape[0]}, got shape {list(ids_shape)}")
    check_row_count("topk_ids", ids_shape[0] * ids_shape[1], "(token, k) assignments")  # one row each
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the group size {world}")
    if num_experts // world * alignment > INT32_MAX:
        raise ValueError(f"alignment={alignment} is too large: one block per local expert, "
                         f"{num_experts // world} * {alignment} slots, must fit the int32 m_offsets")
    return num_experts, alignment


def check_topk_range(lo: int, hi: int, num_experts: int, where: str = "") -> None:
    """ValueError naming topk_ids unless its smallest id `lo` and largest `hi` are in [0, num_experts)
    (no ids at all: lo > hi). `where` ends the message (e.g. which rank's ids)."""
    if lo > hi:
        return
    if lo < 0:
        raise ValueError(f"topk_ids must be expert ids in [0, num_experts={num_experts}), got {lo}{where}")
    if hi >= num_experts:
        raise ValueError(f"topk_ids must be expert ids in [0, num_experts={num_experts}), got {hi}{where}")
