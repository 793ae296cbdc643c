"""The grouped GEMM's contract, shared by both front ends: the argument rules, the launch recipes (the plans'
launches with their named inputs, the buffers they allocate and the runtime scalars), and the host-side check
of validate=True."""

from __future__ import annotations

import functools

import numpy as np

from xkern.grouped_mm.plans import (
    MAX_GEMM_EXPERTS,
    GemmTile,
    dw_tile,
    plan_grouped_mm,
    plan_grouped_mm_dw,
    plan_grouped_mm_dw_split,
    variant,
    weight_layout,
)
from xkern.launch import FLOATS, INT32_MAX, Buffer, Recipe, Step, check_row_count


def check_grouped_mm(x_dtype: str, x_shape: tuple[int, ...], w_dtype: str, w_shape: tuple[int, ...],
                     offs_dtype: str, offs_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """grouped_mm's arguments: x [S, K] float16/bfloat16/float32, w [E, K, N] of x's dtype, m_offsets [E]
    int32. Returns (S, K, N, E)."""
    if len(x_shape) != 2:
        raise ValueError(f"x must be 2-D [slots, K], got shape {list(x_shape)}")
    if len(w_shape) != 3:
        raise ValueError(f"w must be 3-D [experts, K, N], got shape {list(w_shape)}")
    if len(offs_shape) != 1:
        raise ValueError(f"m_offsets must be 1-D [experts], got shape {list(offs_shape)}")
    if x_dtype not in FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x_dtype}")
    if w_dtype != x_dtype:
        raise TypeError(f"w must have x's dtype {x_dtype}, got {w_dtype}")
    if offs_dtype != "int32":
        raise TypeError(f"m_offsets must be int32 (cumulative ends of the experts' rows), got {offs_dtype}")
    (n_slots, n_inner), (n_experts, w_inner, n_cols) = x_shape, w_shape
    if w_inner != n_inner:
        raise ValueError(f"w must be [experts, K, N] with K = x.shape[1] = {n_inner}, got shape {list(w_shape)}")
    if offs_shape[0] != n_experts:
        raise ValueError(f"m_offsets must have one entry per expert (w.shape[0] = {n_experts}), got {offs_shape[0]}")
    if not 1 <= n_experts <= MAX_GEMM_EXPERTS:
        raise ValueError(f"w must have 1 to {MAX_GEMM_EXPERTS} experts (the offsets are one vector of the "
                         f"kernel), got {n_experts}")
    check_row_count("x", n_slots, "slots")
    if n_inner * n_cols > INT32_MAX:
        raise ValueError(f"w's experts must have at most {INT32_MAX} elements each (K * N, indexed in int32), "
                         f"got {n_inner} x {n_cols}")
    return n_slots, n_inner, n_cols, n_experts


def check_grouped_mm_dx(dy_dtype: str, dy_shape: tuple[int, ...], w_dtype: str, w_shape: tuple[int, ...],
                        offs_dtype: str, offs_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The x gradient's arguments: dy [S, N], w [E, K, N] (the forward's), m_offsets [E]. Returns (S, K, N, E)."""
    if len(dy_shape) != 2:
        raise ValueError(f"dy must be 2-D [slots, N], got shape {list(dy_shape)}")
    if len(w_shape) == 3 and w_shape[2] != dy_shape[1]:
        raise ValueError(f"w must be [experts, K, N] with N = dy.shape[1] = {dy_shape[1]}, got shape {list(w_shape)}")
    w_t = tuple(w_shape) if len(w_shape) != 3 else (w_shape[0], w_shape[2], w_shape[1])
    n_slots, n_cols, n_inner, n_experts = check_grouped_mm(dy_dtype, dy_shape, w_dtype, w_t, offs_dtype, offs_shape)
    return n_slots, n_inner, n_cols, n_experts


def check_grouped_mm_dw(x_dtype: str, x_shape: tuple[int, ...], dy_dtype: str, dy_shape: tuple[int, ...],
                        offs_dtype: str, offs_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The w gradient's arguments: x [S, K], dy [S, N] of x's dtype, m_offsets [E]. Returns (S, K, N, E)."""
    if len(dy_shape) != 2 or len(x_shape) == 2 and dy_shape[0] != x_shape[0]:
        raise ValueError(f"dy must be 2-D [slots, N] with x's {x_shape[0] if x_shape else 0} slots, got shape "
                         f"{list(dy_shape)}")
    if dy_dtype != x_dtype:
        raise TypeError(f"dy must have x's dtype {x_dtype}, got {dy_dtype}")
    n_experts = offs_shape[0] if len(offs_shape) == 1 else 1
    w_shape = (n_experts, x_shape[1] if len(x_shape) == 2 else 0, dy_shape[1])
    return check_grouped_mm(x_dtype, x_shape, dy_dtype, w_shape, offs_dtype, offs_shape)


def check_offsets(offsets: np.ndarray, n_slots: int) -> None:
    """validate=True: m_offsets non-decreasing, in [0, n_slots] (one host sync)."""
    ends = np.asarray(offsets).astype(np.int64).reshape(-1)
    bad = np.flatnonzero(ends < 0)
    if bad.size:
        raise ValueError(f"m_offsets[{int(bad[0])}] = {int(ends[bad[0]])} is negative")
    down = np.flatnonzero(ends[1:] < ends[:-1])
    if down.size:
        e = int(down[0]) + 1
        raise ValueError(f"m_offsets must be non-decreasing (cumulative ends): m_offsets[{e}] = {int(ends[e])} < "
                         f"m_offsets[{e - 1}] = {int(ends[e - 1])}")
    if ends.size and ends[-1] > n_slots:
        raise ValueError(f"m_offsets[-1] = {int(ends[-1])} is past x's {n_slots} rows")


def _zeros(name: str, shape: tuple[int, ...], dtype: str) -> Recipe:
    return Recipe((Step(None, (), (Buffer(name, shape, dtype, fill=0),)),), (name,))


@functools.lru_cache(maxsize=1024, typed=True)
def _rows_recipe(rows: str, out: str, n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str,
                 row_stride: int, w_strides: tuple[int, int, int], tile: GemmTile | None, persistent: bool) -> Recipe:
    if n_slots * n_cols == 0 or n_inner == 0:  # nothing to multiply: zeros (or nothing)
        return _zeros(out, (n_slots, n_cols), dtype)
    layout = weight_layout(n_inner, n_cols, w_strides)
    if layout is None:
        raise ValueError(f"w's strides {list(w_strides)} have neither matrix dim contiguous: pass a contiguous w")
    plan = plan_grouped_mm(n_slots, n_inner, n_cols, n_experts, dtype, row_stride, w_strides, tile, persistent)
    w_expert_stride, w_stride, _ = layout
    scalars = dict(n_slots=n_slots, n_inner=n_inner, n_cols=n_cols, n_experts=n_experts, x_row_stride=row_stride,
                   w_expert_stride=w_expert_stride, w_stride=w_stride)
    return Recipe((Step(plan, (rows, "w", "offs"), (Buffer(out, (n_slots, n_cols), dtype),), scalars),), (out,))


def grouped_mm_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                      w_strides: tuple[int, int, int], tile: GemmTile | None = None) -> Recipe:
    """The forward. Inputs x [n_slots, n_inner] (rows `x_row_stride` apart, last dim contiguous), w [n_experts,
    n_inner, n_cols] (element strides `w_strides`: contiguous is (K * N, N, 1)), offs [n_experts] int32; result y
    [n_slots, n_cols] in `dtype`. The plans' variant (`variant()`) chooses the launch."""
    return _rows_recipe("x", "y", n_slots, n_inner, n_cols, n_experts, dtype, x_row_stride, w_strides, tile,
                        variant() == "persistent")


def grouped_mm_dx_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, dy_row_stride: int,
                         w_strides: tuple[int, int, int], tile: GemmTile | None = None) -> Recipe:
    """The gradient of x: the forward's rows kernel on dy with w read transposed (its K and N strides swapped,
    no copy). Inputs dy [n_slots, n_cols] (rows `dy_row_stride` apart), w [n_experts, n_inner, n_cols] as in
    the forward (`w_strides` its own strides), offs; result dx [n_slots, n_inner] in `dtype`."""
    se, sk, sn = w_strides
    return _rows_recipe("dy", "dx", n_slots, n_cols, n_inner, n_experts, dtype, dy_row_stride, (se, sn, sk), tile,
                        variant() == "persistent")


def grouped_mm_dw_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                         dy_row_stride: int, tile: GemmTile | None = None) -> Recipe:
    """The gradient of w. Inputs x [n_slots, n_inner], dy [n_slots, n_cols] (rows `*_row_stride` apart, last dim
    contiguous), offs; result dw [n_experts, n_inner, n_cols] (contiguous) in `dtype`: x_e.T @ dy_e, zeros for
    an expert without rows. The plans' variant (`variant()`) chooses the launches."""
    name = variant()
    if tile is None and name == "dw_narrow":
        tile = dw_tile(dtype, narrow=True)
    return _dw_recipe(n_slots, n_inner, n_cols, n_experts, dtype, x_row_stride, dy_row_stride, tile,
                      name == "dw_split", name == "dw_persistent")


@functools.lru_cache(maxsize=1024, typed=True)
def _dw_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
               dy_row_stride: int, tile: GemmTile | None, split: bool, persistent: bool) -> Recipe:
    shape = (n_experts, n_inner, n_cols)
    if n_experts * n_inner * n_cols == 0 or n_slots == 0:
        return _zeros("dw", shape, dtype)
    scalars = dict(n_slots=n_slots, n_inner=n_inner, n_cols=n_cols, n_experts=n_experts, x_row_stride=x_row_stride,
                   dy_row_stride=dy_row_stride)
    dw = Buffer("dw", shape, dtype)
    plan = split and plan_grouped_mm_dw_split(n_slots, n_inner, n_cols, n_experts, dtype, x_row_stride,
                                              dy_row_stride, tile)
    if plan:
        partial = Buffer("partial", (plan.n_partials, n_inner, n_cols), "float32")
        return Recipe((Step(plan.chunks, ("x", "dy", "offs"), (partial,), scalars),
                       Step(plan.split, ("x", "dy", "offs", "partial"), (dw,), scalars)), ("dw",))
    plan = plan_grouped_mm_dw(n_slots, n_inner, n_cols, n_experts, dtype, x_row_stride, dy_row_stride, tile,
                              persistent)
    return Recipe((Step(plan, ("x", "dy", "offs"), (dw,), scalars),), ("dw",))
