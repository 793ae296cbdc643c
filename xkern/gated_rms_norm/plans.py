"""Gated RMSNorm's launch plans: which kernel, grid, warps and constexprs a shape takes.

Fixed rules from shapes and element sizes (no autotuning), one sentence per regime:
- forward, groups up to MAX_FWD_BLOCK wide: tiles of whole groups, FWD_TILE_ELEMS elements (several rows of
  a narrow group: 16 x 128 for the head width of Qwen3-Next), 16 elements per thread per stream, a program a
  tile (the kernel's PERSISTENT schedule, a program per several tiles, is a candidate of the benchmark's sweep);
- forward, wider groups: one program per (row, group), summing over column chunks, then re-reading the group;
- backward, narrow groups (BWD_NARROW_TILES: the head width 128): persistent tiles of several rows, each
  program loading its next tile before this tile's math, keeping its dw terms per row position in registers;
- backward, other groups up to MAX_BWD_BLOCK wide: persistent tiles of whole groups (BWD_TILE_ELEMS elements),
  8 elements per thread per stream, BWD_WARPS_PER_SM warps per SM in all (every program resident), each
  keeping its dw slice in registers;
- backward, wider groups: per (row, group) statistics in column chunks, then a column split (program per
  column block and row set) keeping its dw slice in registers;
- dw: RMSNorm's fixed-order reduction of the per-program partial rows.
These are first rules, not yet swept on a GPU: `python -m benchmarks.gated_rms_norm --sweep` times the head
width's candidates (the plans' `tile=`), the rules' among them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from xkern.device import properties
from xkern.gated_rms_norm.kernels import (
    _gated_rms_norm_bwd_cols_kernel,
    _gated_rms_norm_bwd_kernel,
    _gated_rms_norm_bwd_stats_kernel,
    _gated_rms_norm_fwd_chunked_kernel,
    _gated_rms_norm_fwd_kernel,
)
from xkern.launch import Launch, cdiv, check_row_count, next_pow2, row_align
from xkern.rms_norm.plans import plan_dw_reduce

MAX_FWD_BLOCK = 16384   # widest group the forward holds in registers (x and the gate: 2 streams)
FWD_CHUNK = 4096        # column chunk of the wider forward
FWD_TILE_ELEMS = 2048   # elements of a forward tile of narrow groups
MAX_BWD_BLOCK = 8192    # widest group the backward's tile holds (x, z, dy, w and their fp32 temporaries)
BWD_TILE_ELEMS = 1024   # elements of a backward tile of groups narrower than 1024 (16 x 64, 4 x 256)
# The backward's tiles at 8 elements per thread per stream take 80-115 registers (ptxas, sm_90; 16 take
# 153-164): 16 warps of them fit an SM's 64K registers, so the persistent grid is 16 warps per SM, all
# resident at once (no second wave). 8192 wide: 16 warps at 16 elements per thread (128 registers, the most
# 512 threads may hold), one program per SM.
BWD_WARPS_PER_SM = 16


class BwdTile(NamedTuple):
    """The persistent backward's schedule: `block_m` rows a block, `num_warps`, `per_sm` programs per SM (all
    resident at once), the kernel's PREFETCH, STAGES and DW_TILE (kernels.py says what each does)."""

    block_m: int
    num_warps: int
    per_sm: int
    prefetch: bool = False
    stages: int = 1
    dw_tile: bool = False


# Narrow groups by BLOCK_N. At the head width 128: the tile above (8 x 128, 4 warps, 4 per SM), each program
# loading its next block's x, z and dy into registers before this block's math, so that loads stay in flight
# while it computes (RMSNorm's narrow schedule), and summing its dw terms across rows once, at the end, not
# each block (no barrier a block). Every family and dtype keeps every program resident: at most 128 registers
# (ptxas, sm_90; the test), 4 x 4 x 128 x 32 = 64K. The benchmark's sweep times the candidates.
BWD_NARROW_TILES = {128: BwdTile(8, 4, 4, prefetch=True, dw_tile=True)}
STATS_CHUNK = 4096      # column chunk of the wide backward's statistics pass
COLS_TILE = (4, 1024, 4)  # the wide backward's column split: BLOCK_M, BLOCK_N, num_warps
COLS_PROGRAMS_PER_SM = 4

ACTIVATIONS = ("silu", "sigmoid")


def _fixed(n_cols: int, group_size: int, row_strides: tuple[int, ...], eps: float, norm_before_gate: bool,
           activation: str, rounding: str) -> dict:
    return {"EPS": float(eps), "ROW_ALIGN": row_align(group_size, n_cols, *row_strides),
            "ONE_COL": group_size == 1, "GATE_FIRST": not norm_before_gate, "SIGMOID": activation == "sigmoid",
            "FP32_W": rounding == "fp32"}


def _warps(elems: int) -> int:
    # 16 elements per thread per stream, 1 to 32 warps
    return max(1, min(32, elems // 512))


def plan_gated_rms_norm_fwd(n_rows: int, n_cols: int, group_size: int, eps: float,
                            row_strides: tuple[int, ...] = (), norm_before_gate: bool = True,
                            activation: str = "silu", rounding: str = "llama",
                            tile: tuple[int, int, int] | None = None) -> Launch:
    """The forward's launch for x [n_rows, n_cols] in groups of `group_size` columns; `row_strides`: x's, z's
    and y's (default contiguous). `tile`: (BLOCK_M, num_warps, programs per SM: 0 for a program a tile) for
    groups up to MAX_FWD_BLOCK wide (default: FWD_TILE_ELEMS elements, 16 a thread, a program a tile; the
    benchmark's sweep passes candidates, persistent ones among them)."""
    check_row_count("x", n_rows)
    check_row_count("x", n_cols, "columns")
    fixed = _fixed(n_cols, group_size, row_strides, eps, norm_before_gate, activation, rounding)
    n_groups = n_cols // group_size
    if group_size > MAX_FWD_BLOCK:
        return Launch(_gated_rms_norm_fwd_chunked_kernel, (n_rows, n_groups), 8, {**fixed, "BLOCK_N": FWD_CHUNK})
    block_n = next_pow2(group_size)
    elems = max(block_n, FWD_TILE_ELEMS)
    block_m, num_warps, per_sm = tile or (elems // block_n, _warps(elems), 0)
    block_m = max(1, min(block_m, next_pow2(n_rows)))
    programs = cdiv(n_rows, block_m)
    if per_sm:
        programs = max(1, min(programs, properties().num_sms * per_sm // n_groups))
    return Launch(_gated_rms_norm_fwd_kernel, (programs, n_groups), num_warps,
                  {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n, "PERSISTENT": per_sm > 0})


@dataclasses.dataclass(frozen=True)
class GatedBwdPlan:
    """The backward's launches, in order. `stats` (groups wider than MAX_BWD_BLOCK): x, z, w, dy -> STATS
    [n_rows * n_groups, 2] fp32, which `bwd` takes as a fifth input. `bwd`: -> dx, dz and the dw partials
    [n_partials, n_cols] fp32. `reduce`: partials -> dw [1, n_cols]."""

    stats: Launch | None
    bwd: Launch
    reduce: Launch
    n_partials: int


def bwd_tile(block_n: int) -> BwdTile:
    """The persistent backward's schedule for groups of `block_n` (a power of two up to MAX_BWD_BLOCK) columns."""
    if block_n in BWD_NARROW_TILES:
        return BWD_NARROW_TILES[block_n]
    elems = max(block_n, BWD_TILE_ELEMS)
    num_warps = min(BWD_WARPS_PER_SM, max(1, elems // 256))
    return BwdTile(elems // block_n, num_warps, BWD_WARPS_PER_SM // num_warps)


def plan_gated_rms_norm_bwd(n_rows: int, n_cols: int, group_size: int, eps: float,
                            row_strides: tuple[int, ...] = (), norm_before_gate: bool = True,
                            activation: str = "silu", rounding: str = "llama",
                            tile: BwdTile | None = None) -> GatedBwdPlan:
    """The joint backward and the dw reduction; `row_strides`: x's, z's, dy's and dx's (default contiguous).
    `tile`: the persistent backward's schedule for groups up to MAX_BWD_BLOCK wide (default `bwd_tile`, the
    rule; the benchmark's sweep passes candidates)."""
    check_row_count("x", n_rows)
    check_row_count("x", n_cols, "columns")
    fixed = _fixed(n_cols, group_size, row_strides, eps, norm_before_gate, activation, rounding)
    n_groups = n_cols // group_size
    stats = None
    if group_size > MAX_BWD_BLOCK:
        stats = Launch(_gated_rms_norm_bwd_stats_kernel, (n_rows, n_groups), 8, {**fixed, "BLOCK_N": STATS_CHUNK})
        block_m, block_n, num_warps = COLS_TILE
        col_blocks = cdiv(group_size, block_n)
        programs = COLS_PROGRAMS_PER_SM * properties().num_sms
        parts = max(2, min(cdiv(n_rows, block_m), programs // (col_blocks * n_groups)))
        cols = {k: v for k, v in fixed.items() if k != "EPS"}
        bwd = Launch(_gated_rms_norm_bwd_cols_kernel, (col_blocks, parts, n_groups), num_warps,
                     {**cols, "BLOCK_M": block_m, "BLOCK_N": block_n})
    else:
        block_n = next_pow2(group_size)
        tile = BwdTile(*(tile or bwd_tile(block_n)))
        block_m = max(1, min(tile.block_m, next_pow2(n_rows)))
        # at least 2 partials (a spare program stores zeros): jax-triton would fold an n_partials of 1 into
        # the reduction's binary, and torch's would not
        parts = max(2, min(cdiv(n_rows, block_m), properties().num_sms * tile.per_sm // n_groups))
        bwd = Launch(_gated_rms_norm_bwd_kernel, (parts, n_groups), tile.num_warps,
                     {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n, "PREFETCH": tile.prefetch,
                      "STAGES": tile.stages, "DW_TILE": tile.dw_tile})
    return GatedBwdPlan(stats, bwd, plan_dw_reduce(parts, n_cols), parts)
