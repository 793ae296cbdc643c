"""Grouped GEMM over the padded expert-major layout of MoE (`permute_rows`' output): kernels, plans, rules.

Contract: x [S, K] (S slots), w [E, K, N], m_offsets [E] int32, the cumulative ENDS of the experts' blocks
(non-decreasing, m_offsets[-1] <= S; expert e's rows are slots [m_offsets[e-1], m_offsets[e]), m_offsets[-1]
= 0). The layout of torch._grouped_mm's `offs` and of jax.lax.ragged_dot's group sizes (their cumsum).
    y[r] = x[r] @ w[e]  for r in expert e's block (FP32 accumulation, rounded once to x's dtype),
    y[r] = 0            for r >= m_offsets[-1]   (every element of y is written).
Gradients: dx = the same kernel on dy with w read transposed (strides, no copy): dx[r] = dy[r] @ w[e].T;
dw[e] = x_e.T @ dy_e (FP32 over the expert's rows, rounded once; zeros for an expert with no rows). No
atomics: every output element is summed by one program in one order, so results are bitwise run to run.
fp32 inputs multiply in IEEE FP32 (`input_precision="ieee"`: no TF32); 16-bit inputs use the tensor cores.

Kernels:
  _grouped_rows_kernel  y (and dx): programs over (row tile, column tile). Row tiles never straddle experts:
                        expert e has cdiv(size_e, BLOCK_M) tiles, numbered expert after expert; then come the
                        tiles of the zero tail past m_offsets[-1]. The grid has cdiv(S, BLOCK_M) + E row tiles
                        (each expert adds at most one partial tile, and the tail at most the one it shares):
                        a program finds its expert from the E offsets (a BLOCK_E vector: sizes, tiles per
                        expert, their cumsum, a count), and programs past the tail's tiles exit. Programs are
                        ordered in bands of GROUP_M row tiles, the row tile fastest, so neighbours read the
                        same weight tile (and the band's rows) from L2.
  _grouped_dw_kernel    dw: one program per (expert, K tile, N tile), looping over the expert's rows
                        BLOCK_R at a time: acc += x_tile.T @ dy_tile.
Offsets past 2**31 (row * stride, expert * expert stride) are formed in int64; inside one expert's weight
and one tile, int32 (`check_grouped_mm` bounds an expert's weight to int32 elements).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import triton
import triton.language as tl

from xkern.launch import (
    FLOATS,
    INT32_MAX,
    ITEMSIZE,
    POINTER_TYPES,
    Buffer,
    Launch,
    Recipe,
    Step,
    cdiv,
    check_row_count,
    next_pow2,
    row_align,
)

# ---------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands: exact FP32 products and sums (no TF32)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["n_slots", "n_inner", "n_cols", "n_experts", "x_row_stride", "w_expert_stride",
                               "w_stride"])
def _grouped_rows_kernel(
    X, W, OFFS,
    n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride, w_stride,
    Y,
    ALIGN: tl.constexpr, W_N_CONTIGUOUS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # The plan's alignment made visible (16-byte accesses without specializing the integers): ALIGN divides
    # the widths and the strides.
    n_inner = n_inner // ALIGN * ALIGN
    n_cols = n_cols // ALIGN * ALIGN
    x_row_stride = x_row_stride // ALIGN * ALIGN
    w_expert_stride = w_expert_stride // ALIGN * ALIGN
    w_stride = w_stride // ALIGN * ALIGN
    # Program -> (row tile, column tile): bands of GROUP_M row tiles, row tile fastest inside a band.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_slots, BLOCK_M) + n_experts
    col_tiles = tl.cdiv(n_cols, BLOCK_N)
    band = GROUP_M * col_tiles
    first = pid // band * GROUP_M
    height = tl.minimum(n_tiles - first, GROUP_M)
    tile = first + pid % band % height
    col = pid % band // height
    # The expert of `tile`: each expert's tiles, their running sum, how many experts end at or before it.
    # Offsets are clamped to [0, n_slots] and sizes to >= 0, so unchecked offsets never write out of bounds.
    e = tl.arange(0, BLOCK_E)
    e_mask = e < n_experts
    ends = tl.minimum(tl.maximum(tl.load(OFFS + e, mask=e_mask, other=0), 0), n_slots)
    starts = tl.minimum(tl.maximum(tl.load(OFFS + e - 1, mask=e_mask & (e > 0), other=0), 0), n_slots)
    sizes = tl.where(e_mask, tl.maximum(ends - starts, 0), 0)
    tiles = tl.cdiv(sizes, BLOCK_M)
    ends_tiles = tl.cumsum(tiles, axis=0)
    expert = tl.sum((ends_tiles <= tile).to(tl.int32), axis=0)
    mine = e == expert
    in_expert = expert < n_experts  # else a tile of the zero tail past the last offset: no products
    last = tl.sum(tl.where(e == n_experts - 1, ends, 0), axis=0)
    row_end = tl.where(in_expert, tl.sum(tl.where(mine, ends, 0), axis=0), n_slots)
    row0 = tl.where(in_expert, tl.sum(tl.where(mine, starts + (tile - ends_tiles + tiles) * BLOCK_M, 0), axis=0),
                    last + (tile - tl.sum(tiles, axis=0)) * BLOCK_M)
    k_end = tl.where(in_expert, n_inner, 0)
    if row0 < row_end:
        rows = tl.arange(0, BLOCK_M)
        row_mask = rows < row_end - row0
        cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = (X + row0.to(tl.int64) * x_row_stride) + (rows[:, None] * x_row_stride + ks[None, :])
        w_base = W + expert.to(tl.int64) * w_expert_stride
        if W_N_CONTIGUOUS:
            b_ptrs = w_base + ks[:, None] * w_stride + cols[None, :]
            b_step = BLOCK_K * w_stride
        else:
            b_ptrs = w_base + ks[:, None] + cols[None, :] * w_stride
            b_step = BLOCK_K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, k_end, BLOCK_K):
            k_mask = ks < n_inner - k
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = _dot(a, b, acc, IEEE)
            a_ptrs += BLOCK_K
            b_ptrs += b_step
        y_ptrs = (Y + row0.to(tl.int64) * n_cols) + (rows[:, None] * n_cols + cols[None, :])
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["n_slots", "n_inner", "n_cols", "n_experts", "x_row_stride", "dy_row_stride"])
def _grouped_dw_kernel(
    X, DY, OFFS,
    n_slots, n_inner, n_cols, n_experts, x_row_stride, dy_row_stride,
    DW,
    ALIGN: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    n_inner = n_inner // ALIGN * ALIGN
    n_cols = n_cols // ALIGN * ALIGN
    x_row_stride = x_row_stride // ALIGN * ALIGN
    dy_row_stride = dy_row_stride // ALIGN * ALIGN
    # Program -> (expert, K tile, N tile), the N tile fastest: neighbours share the expert's x rows.
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(n_cols, BLOCK_N)
    per_expert = tl.cdiv(n_inner, BLOCK_K) * col_tiles
    expert = pid // per_expert
    ktile = pid % per_expert // col_tiles
    col = pid % col_tiles
    end = tl.minimum(tl.maximum(tl.load(OFFS + expert), 0), n_slots)
    start = tl.load(OFFS + tl.maximum(expert - 1, 0))
    start = tl.where(expert > 0, tl.minimum(tl.maximum(start, 0), n_slots), 0)
    ks = ktile * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < n_inner
    col_mask = cols < n_cols
    rows = tl.arange(0, BLOCK_R)
    x_ptrs = (X + start.to(tl.int64) * x_row_stride) + (rows[:, None] * x_row_stride + ks[None, :])
    dy_ptrs = (DY + start.to(tl.int64) * dy_row_stride) + (rows[:, None] * dy_row_stride + cols[None, :])
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for r in range(start, end, BLOCK_R):
        row_mask = rows < end - r
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(dy_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(tl.trans(a), b, acc, IEEE)
        x_ptrs += BLOCK_R * x_row_stride
        dy_ptrs += BLOCK_R * dy_row_stride
    dw_ptrs = (DW + expert.to(tl.int64) * n_inner * n_cols) + (ks[:, None] * n_cols + cols[None, :])
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------------------------------
# Launch plans: fixed tiles per dtype (no autotuning); `tile` overrides them (tools/gemm_probe.py sweeps it).


class GemmTile(NamedTuple):
    """A GEMM launch's tile. The rows kernel: BLOCK_M rows x BLOCK_N columns of y, BLOCK_K of the inner
    dimension per step, bands of `group_m` row tiles. The dw kernel: block_m rows (K) x block_n columns (N)
    of dw[e], block_k slots per step (`group_m` unused)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# 16-bit: 128 x 256 tiles, 64 deep, 8 warps (two warpgroups of wgmma on sm_90); the rows kernel 4 stages in
# flight (192 KiB of shared memory) up to an inner dim of DEEP_INNER, 3 past it, dw 3. tools.gemm_probe on an
# H100 (2026-12-06), the MoE benchmark's six GEMMs: at Qwen3-MoE 481-568 TFLOP/s where 128 x 128 x 64 on 3
# stages ran 423-501 (torch._grouped_mm, CUTLASS: 520-637); at DeepSeek-V3 the forward and dx 452-474 against
# torch's 433-478, 4 stages losing 19 % at the up projection's 7168-deep forward and 3 % at the down
# projection's dx (7168), level or up to 8 % faster at inner dims of 768-4096. fp32 (IEEE FMAs, no tensor
# cores): 64 x 64 x 32 on 4 warps.
ROWS_TILES = {2: GemmTile(128, 256, 64, 8, 4), 4: GemmTile(64, 64, 32, 4, 2)}
DW_TILES = {2: GemmTile(128, 256, 64, 8, 3), 4: GemmTile(64, 64, 32, 4, 2)}
DEEP_INNER = 4096  # 16-bit rows kernel: 3 stages past this inner dim


def rows_tile(dtype: str, n_inner: int) -> GemmTile:
    """The rows kernel's tile for `dtype` and the inner (contracted) dim."""
    tile = ROWS_TILES[ITEMSIZE[dtype]]
    return tile._replace(num_stages=3) if ITEMSIZE[dtype] == 2 and n_inner > DEEP_INNER else tile


MAX_GEMM_EXPERTS = 4096  # the offsets are one BLOCK_E vector of every rows program
MIN_BLOCK_E = 256        # experts' vector length at least this: one binary for up to 256 experts


def weight_layout(n_inner: int, n_cols: int, w_strides: tuple[int, int, int]) -> tuple[int, int, bool] | None:
    """(expert stride, the non-unit stride, whether N is the contiguous dim) of w [E, n_inner, n_cols] with
    element strides `w_strides`; None unless one of the two matrix dims is contiguous (the front end then
    copies). A dim of size 1 takes any stride."""
    se, sk, sn = w_strides
    if sn == 1 or n_cols == 1:
        return se, (sk if n_inner > 1 else n_cols), True
    if sk == 1 or n_inner == 1:
        return se, sn, False
    return None


def plan_grouped_mm(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                    w_strides: tuple[int, int, int], tile: GemmTile | None = None) -> Launch:
    """The rows kernel for y [n_slots, n_cols] = x [n_slots, n_inner] @ w[e] [n_inner, n_cols] (w with element
    strides `w_strides`, one matrix dim contiguous: `weight_layout`). Arrays (x, w, offs, y); scalars
    n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride, w_stride (`grouped_mm_recipe`)."""
    tile = tile or rows_tile(dtype, n_inner)
    w_expert_stride, w_stride, n_contiguous = weight_layout(n_inner, n_cols, w_strides)
    n_tiles = cdiv(n_slots, tile.block_m) + n_experts
    consts = {"ALIGN": row_align(n_inner, n_cols, x_row_stride, w_expert_stride, w_stride),
              "W_N_CONTIGUOUS": n_contiguous, "IEEE": dtype == "float32", "BLOCK_M": tile.block_m,
              "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
              "BLOCK_E": max(MIN_BLOCK_E, next_pow2(n_experts)), "GROUP_M": tile.group_m}
    return Launch(_grouped_rows_kernel, (n_tiles * cdiv(n_cols, tile.block_n),), tile.num_warps, consts,
                  tile.num_stages)


def plan_grouped_mm_dw(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                       dy_row_stride: int, tile: GemmTile | None = None) -> Launch:
    """The dw kernel for dw [n_experts, n_inner, n_cols] from x [n_slots, n_inner] and dy [n_slots, n_cols].
    Arrays (x, dy, offs, dw); scalars n_slots, n_inner, n_cols, n_experts, x_row_stride, dy_row_stride."""
    tile = tile or DW_TILES[ITEMSIZE[dtype]]
    consts = {"ALIGN": row_align(n_inner, n_cols, x_row_stride, dy_row_stride), "IEEE": dtype == "float32",
              "BLOCK_K": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_R": tile.block_k}
    grid = n_experts * cdiv(n_inner, tile.block_m) * cdiv(n_cols, tile.block_n)
    return Launch(_grouped_dw_kernel, (grid,), tile.num_warps, consts, tile.num_stages)


def compile_variants() -> list[tuple[Launch, dict]]:
    """Every (kernel, constexprs) the plans choose, at the extremes of what varies with the shapes: each dtype,
    both weight layouts (forward: N contiguous; dx: K contiguous), ALIGN 16 and 1, the inner dim on both sides of
    DEEP_INNER (the rows kernel's stages), BLOCK_E at its least and most (the plans' ALIGN 2-8 and BLOCK_E
    512-2048 are the same code with other constants)."""
    variants = []
    for dtype in FLOATS:
        ptr = POINTER_TYPES[dtype]
        for n_inner, n_cols in ((256, 512), (255, 511), (8192, 512)):  # ALIGN 16, 1; past DEEP_INNER
            for experts in (1, MAX_GEMM_EXPERTS):
                for strides in ((n_inner * n_cols, n_cols, 1), (n_inner * n_cols, 1, n_inner)):
                    plan = plan_grouped_mm(8192, n_inner, n_cols, experts, dtype, n_inner, strides)
                    variants.append((plan, {"X": ptr, "W": ptr, "OFFS": "*i32", "Y": ptr}))
            dw = plan_grouped_mm_dw(8192, n_inner, n_cols, 8, dtype, n_inner, n_cols)
            variants.append((dw, {"X": ptr, "DY": ptr, "OFFS": "*i32", "DW": ptr}))
    return variants


# ---------------------------------------------------------------------------------------------------
# The op's contract, shared by both front ends: argument rules, then the launch recipes.


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


def _rows_recipe(rows: str, out: str, n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str,
                 row_stride: int, w_strides: tuple[int, int, int], tile: GemmTile | None) -> Recipe:
    if n_slots * n_cols == 0 or n_inner == 0:  # nothing to multiply: zeros (or nothing)
        return _zeros(out, (n_slots, n_cols), dtype)
    layout = weight_layout(n_inner, n_cols, w_strides)
    if layout is None:
        raise ValueError(f"w's strides {list(w_strides)} have neither matrix dim contiguous: pass a contiguous w")
    plan = plan_grouped_mm(n_slots, n_inner, n_cols, n_experts, dtype, row_stride, w_strides, tile)
    w_expert_stride, w_stride, _ = layout
    scalars = dict(n_slots=n_slots, n_inner=n_inner, n_cols=n_cols, n_experts=n_experts, x_row_stride=row_stride,
                   w_expert_stride=w_expert_stride, w_stride=w_stride)
    return Recipe((Step(plan, (rows, "w", "offs"), (Buffer(out, (n_slots, n_cols), dtype),), scalars),), (out,))


@functools.lru_cache(maxsize=1024, typed=True)
def grouped_mm_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                      w_strides: tuple[int, int, int], tile: GemmTile | None = None) -> Recipe:
    """The forward. Inputs x [n_slots, n_inner] (rows `x_row_stride` apart, last dim contiguous), w [n_experts,
    n_inner, n_cols] (element strides `w_strides`: contiguous is (K * N, N, 1)), offs [n_experts] int32; result y
    [n_slots, n_cols] in `dtype`."""
    return _rows_recipe("x", "y", n_slots, n_inner, n_cols, n_experts, dtype, x_row_stride, w_strides, tile)


@functools.lru_cache(maxsize=1024, typed=True)
def grouped_mm_dx_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, dy_row_stride: int,
                         w_strides: tuple[int, int, int], tile: GemmTile | None = None) -> Recipe:
    """The gradient of x: the forward's rows kernel on dy with w read transposed (its K and N strides swapped,
    no copy). Inputs dy [n_slots, n_cols] (rows `dy_row_stride` apart), w [n_experts, n_inner, n_cols] as in
    the forward (`w_strides` its own strides), offs; result dx [n_slots, n_inner] in `dtype`."""
    se, sk, sn = w_strides
    return _rows_recipe("dy", "dx", n_slots, n_cols, n_inner, n_experts, dtype, dy_row_stride, (se, sn, sk), tile)


@functools.lru_cache(maxsize=1024, typed=True)
def grouped_mm_dw_recipe(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                         dy_row_stride: int, tile: GemmTile | None = None) -> Recipe:
    """The gradient of w. Inputs x [n_slots, n_inner], dy [n_slots, n_cols] (rows `*_row_stride` apart, last dim
    contiguous), offs; result dw [n_experts, n_inner, n_cols] (contiguous) in `dtype`: x_e.T @ dy_e, zeros for
    an expert without rows."""
    shape = (n_experts, n_inner, n_cols)
    if n_experts * n_inner * n_cols == 0 or n_slots == 0:
        return _zeros("dw", shape, dtype)
    plan = plan_grouped_mm_dw(n_slots, n_inner, n_cols, n_experts, dtype, x_row_stride, dy_row_stride, tile)
    scalars = dict(n_slots=n_slots, n_inner=n_inner, n_cols=n_cols, n_experts=n_experts, x_row_stride=x_row_stride,
                   dy_row_stride=dy_row_stride)
    return Recipe((Step(plan, ("x", "dy", "offs"), (Buffer("dw", shape, dtype),), scalars),), ("dw",))
