"""The grouped GEMM's launch plans: fixed tiles per dtype (no autotuning), fitted to the GPU's shared memory;
`tile` overrides them (for timing candidate tiles)."""

from __future__ import annotations

import os
from typing import NamedTuple

from xkern.device import properties
from xkern.grouped_mm.kernels import (
    _grouped_dw_chunks_kernel,
    _grouped_dw_kernel,
    _grouped_dw_persistent_kernel,
    _grouped_dw_split_kernel,
    _grouped_rows_kernel,
    _grouped_rows_persistent_kernel,
)
from xkern.launch import ITEMSIZE, Launch, cdiv, next_pow2, row_align


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
# flight (192 KiB of shared memory) up to an inner dim of DEEP_INNER, 3 past it, dw 3; fewer where the GPU's
# shared memory holds fewer (`fit`). Timed on an
# H100 (2026-12-06), the MoE benchmark's six GEMMs: at Qwen3-MoE 481-568 TFLOP/s where 128 x 128 x 64 on 3
# stages ran 423-501 (torch._grouped_mm, CUTLASS: 520-637); at DeepSeek-V3 the forward and dx 452-474 against
# torch's 433-478, 4 stages losing 19 % at the up projection's 7168-deep forward and 3 % at the down
# projection's dx (7168), level or up to 8 % faster at inner dims of 768-4096. fp32 (IEEE FMAs, no tensor
# cores): 64 x 64 x 32 on 4 warps.
ROWS_TILES = {2: GemmTile(128, 256, 64, 8, 4), 4: GemmTile(64, 64, 32, 4, 2)}
DW_TILES = {2: GemmTile(128, 256, 64, 8, 3), 4: GemmTile(64, 64, 32, 4, 2)}
DEEP_INNER = 4096  # 16-bit rows kernel: 3 stages past this inner dim


def rows_tile(dtype: str, n_inner: int) -> GemmTile:
    """The rows kernel's tile for `dtype` and the inner (contracted) dim, fitted to this GPU (`fit`)."""
    tile = ROWS_TILES[ITEMSIZE[dtype]]
    tile = tile._replace(num_stages=3) if ITEMSIZE[dtype] == 2 and n_inner > DEEP_INNER else tile
    return fit(tile, ITEMSIZE[dtype])


# Variant "dw_narrow", 16-bit: 128 x 128 dw tiles on one warpgroup, 3 stages (98 KiB of shared memory, at most 255
# registers a thread): two programs fit an SM, one's epilogue beside the other's loads, where an expert's few rows
# (DeepSeek-V3's 256 on average) make each program's loop short.
DW_NARROW_TILES = {2: GemmTile(128, 128, 64, 4, 3)}


def dw_tile(dtype: str, narrow: bool = False) -> GemmTile:
    """The dw kernel's tile for `dtype` (`narrow`: variant "dw_narrow"'s, where it has one), fitted to this GPU
    (`fit`)."""
    tiles = DW_NARROW_TILES if narrow and ITEMSIZE[dtype] in DW_NARROW_TILES else DW_TILES
    return fit(tiles[ITEMSIZE[dtype]], ITEMSIZE[dtype])


def pipeline_bytes(tile: GemmTile, itemsize: int, arch: int) -> int:
    """Shared memory a kernel of `tile` takes on `arch`, an upper bound: a (block_m x block_k) and a (block_k x
    block_n) operand tile per buffer, plus 2 KiB (barriers, static shared memory). Triton 3.6 keeps num_stages
    buffers where the tensor cores read operands from shared memory while the next loads land (wgmma on
    sm_90, tcgen05 on sm_100) and num_stages - 1 where they read registers (mma.sync: sm_80-89, sm_120).
    Compiled, the rows kernel's 128 x 256 x 64 bf16 tile took 196,608 B at 4 stages on sm_90 and sm_100,
    147,456 on sm_80, sm_86 and sm_120; its dw kernel no more than the rows kernel's."""
    buffers = tile.num_stages if 90 <= arch < 120 else tile.num_stages - 1
    return buffers * (tile.block_m + tile.block_n) * tile.block_k * itemsize + 2048


def fit(tile: GemmTile, itemsize: int) -> GemmTile:
    """`tile` with as many of its pipeline stages as this GPU's shared memory holds (at least 2), then, if
    still too large, half as many columns (BLOCK_N) until it fits. On the H100 and H200 every tile fits as
    it is; on a 99 KiB part (sm_86, sm_89, sm_120) the rows kernel's 4 stages become 3."""
    props = properties()
    while tile.num_stages > 2 and pipeline_bytes(tile, itemsize, props.arch) > props.max_shared_mem:
        tile = tile._replace(num_stages=tile.num_stages - 1)
    while tile.block_n > 16 and pipeline_bytes(tile, itemsize, props.arch) > props.max_shared_mem:
        tile = tile._replace(block_n=tile.block_n // 2)
    return tile


# Kernel variants, for timing a candidate against the plans' default in one process: the name -> the forms
# ("fwd", "dx", "dw") whose launches it changes. The plans choose `variant()`: XKERN_GROUPED_MM_VARIANT at
# import, `set_variant` after (both front ends read it when they make a recipe: a jitted JAX function keeps
# the recipe it was traced with). Every variant computes the same contract; a variant's bits may differ
# from the default's (another order of the FP32 sums), never between the front ends.
VARIANTS = {"default": (), "dw_split": ("dw",), "dw_narrow": ("dw",), "dw_persistent": ("dw",),
            "persistent": ("fwd", "dx")}
_variant = [os.environ.get("XKERN_GROUPED_MM_VARIANT", "default")]


def set_variant(name: str) -> None:
    """Make the plans choose variant `name` (`VARIANTS`) from now on."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {name!r}")
    _variant[0] = name


def variant() -> str:
    """The variant the plans choose now (`VARIANTS`; read on every eager torch call: one list lookup)."""
    return _variant[0]


if _variant[0] not in VARIANTS:
    raise ValueError(f"XKERN_GROUPED_MM_VARIANT must be one of {', '.join(VARIANTS)}, got {_variant[0]!r}")


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
                    w_strides: tuple[int, int, int], tile: GemmTile | None = None, persistent: bool = False) -> Launch:
    """The rows kernel for y [n_slots, n_cols] = x [n_slots, n_inner] @ w[e] [n_inner, n_cols] (w with element
    strides `w_strides`, one matrix dim contiguous: `weight_layout`). Arrays (x, w, offs, y); scalars
    n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride, w_stride (`grouped_mm_recipe`).
    `persistent` (variant "persistent"): the same tiles, one program per SM each taking tiles in turn."""
    tile = tile or rows_tile(dtype, n_inner)
    w_expert_stride, w_stride, n_contiguous = weight_layout(n_inner, n_cols, w_strides)
    n_tiles = cdiv(n_slots, tile.block_m) + n_experts
    consts = {"ALIGN": row_align(n_inner, n_cols, x_row_stride, w_expert_stride, w_stride),
              "W_N_CONTIGUOUS": n_contiguous, "IEEE": dtype == "float32", "BLOCK_M": tile.block_m,
              "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
              "BLOCK_E": max(MIN_BLOCK_E, next_pow2(n_experts)), "GROUP_M": tile.group_m}
    programs = n_tiles * cdiv(n_cols, tile.block_n)
    if persistent:
        return Launch(_grouped_rows_persistent_kernel, (min(programs, properties().num_sms),), tile.num_warps, consts,
                      tile.num_stages)
    return Launch(_grouped_rows_kernel, (programs,), tile.num_warps, consts, tile.num_stages)


def plan_grouped_mm_dw(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str, x_row_stride: int,
                       dy_row_stride: int, tile: GemmTile | None = None, persistent: bool = False) -> Launch:
    """The dw kernel for dw [n_experts, n_inner, n_cols] from x [n_slots, n_inner] and dy [n_slots, n_cols].
    Arrays (x, dy, offs, dw); scalars n_slots, n_inner, n_cols, n_experts, x_row_stride, dy_row_stride.
    `persistent` (variant "dw_persistent"): the same tiles, one program per SM taking them in turn."""
    tile = tile or dw_tile(dtype)
    consts = {"ALIGN": row_align(n_inner, n_cols, x_row_stride, dy_row_stride), "IEEE": dtype == "float32",
              "BLOCK_K": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_R": tile.block_k}
    grid = n_experts * cdiv(n_inner, tile.block_m) * cdiv(n_cols, tile.block_n)
    if persistent:
        return Launch(_grouped_dw_persistent_kernel, (min(grid, properties().num_sms),), tile.num_warps, consts,
                      tile.num_stages)
    return Launch(_grouped_dw_kernel, (grid,), tile.num_warps, consts, tile.num_stages)


# The split dw ("dw_split"): an expert of more than DW_SPLIT_ROWS rows is summed in chunks of that many rows, each
# chunk's FP32 sums kept in a partial of dw's shape (at most 2 * n_slots / chunk of them). Where that many
# partials would take more than DW_SPLIT_BYTES, the chunks double until they fit (the DeepSeek-V3 size's gate/up
# projection, 117 MB a partial: 16384-row chunks, more than any expert has at 8192 tokens; Qwen3-MoE's, 13 MB:
# 4096 rows).
DW_SPLIT_ROWS = 4096
DW_SPLIT_BYTES = 2**30


class DwSplit(NamedTuple):
    """The split dw's two launches: `chunks` (x, dy, offs) -> partial [n_partials, n_inner, n_cols] FP32, then
    `split` (x, dy, offs, partial) -> dw; the same scalars as the dw kernel's."""

    chunks: Launch
    split: Launch
    n_partials: int


def dw_split_rows(n_slots: int, n_inner: int, n_cols: int, block_r: int) -> int:
    """Rows per chunk of the split dw: DW_SPLIT_ROWS (a multiple of `block_r`), doubled until the partials fit
    DW_SPLIT_BYTES."""
    chunk = cdiv(DW_SPLIT_ROWS, block_r) * block_r
    while 2 * n_slots // chunk * n_inner * n_cols * 4 > DW_SPLIT_BYTES:
        chunk *= 2
    return chunk


def plan_grouped_mm_dw_split(n_slots: int, n_inner: int, n_cols: int, n_experts: int, dtype: str,
                             x_row_stride: int, dy_row_stride: int, tile: GemmTile | None = None) -> DwSplit | None:
    """The split dw (`DwSplit`) with the dw kernel's tile, or None where no expert can have more rows than a
    chunk (n_slots at most one chunk): then the dw kernel is the plan."""
    tile = tile or dw_tile(dtype)
    chunk = dw_split_rows(n_slots, n_inner, n_cols, tile.block_k)
    if n_slots <= chunk:
        return None
    consts = {"ALIGN": row_align(n_inner, n_cols, x_row_stride, dy_row_stride), "IEEE": dtype == "float32",
              "BLOCK_K": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_R": tile.block_k, "CHUNK": chunk,
              "BLOCK_E": max(MIN_BLOCK_E, next_pow2(n_experts))}
    tiles = cdiv(n_inner, tile.block_m) * cdiv(n_cols, tile.block_n)
    n_partials = 2 * n_slots // chunk
    return DwSplit(Launch(_grouped_dw_chunks_kernel, (n_partials * tiles,), tile.num_warps, consts, tile.num_stages),
                   Launch(_grouped_dw_split_kernel, (n_experts * tiles,), tile.num_warps, consts, tile.num_stages),
                   n_partials)
