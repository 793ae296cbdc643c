"""RMSNorm's launch plans: which kernel, grid, warps and constexprs a shape takes.

Fixed offline from timed candidates (no runtime autotuning: it would break determinism and torch/JAX
parity). Inputs are shapes and the element size only; docs/design.md states the rules, docs/benchmarks.md
the measurements behind them.
"""

from __future__ import annotations

import dataclasses

from xkern.device import properties
from xkern.launch import Launch, cdiv, check_row_count, next_pow2, row_align
from xkern.rms_norm.kernels import (
    GEMMA,
    LLAMA,
    NO_WEIGHT,
    OLMO2,
    _dw_reduce_kernel,
    _rms_norm_bwd_cols_kernel,
    _rms_norm_bwd_kernel,
    _rms_norm_bwd_row_kernel,
    _rms_norm_bwd_split_kernel,
    _rms_norm_bwd_stats_kernel,
    _rms_norm_fwd_chunked_kernel,
    _rms_norm_fwd_kernel,
    _rms_norm_fwd_row_kernel,
)

MAX_FWD_BLOCK = 65536  # widest row the forward's row kernel takes (32 warps x 64 elements per thread); half
                       # that for 4-byte x, w or y (at 65536 those spill)
MAX_BWD_BLOCK = 16384  # widest row the backward takes in one block (wider: SPLIT blocks, or a column split)
CHUNK = 16384          # column chunk of the chunked forward (two in flight per program)
COLS_STATS_CHUNK = 8192  # column chunk of the backward's row statistics pass
# Column-split backward tile: (BLOCK_M, BLOCK_N, num_warps, programs per SM)
BWD_COLS_TILE = (4, 1024, 4, 4)
FWD_TILE_BELOW = 768     # the forward takes rows narrower than this in tiles of several rows
FWD_TILE_ELEMS = 2048    # a forward tile's elements (BLOCK_M x BLOCK_N) from 128 wide, 2 warps
# Row-kernel widths that read x twice (RELOAD): faster there on the H200; at 16384 and up to 2048 holding
# the row is as fast (numbers:).
_FWD_RELOAD = {4096, 8192, 32768, 65536}
REDUCE_BLOCK_N, REDUCE_BLOCK_P = 16, 512

# Backward tiles of narrow rows by BLOCK_N: (BLOCK_M, num_warps, programs per SM, PREFETCH): many rows per
# tile. Up to 64 and at 256, one-warp tiles of 1024 elements, 16 per SM (the most that fit at once: 20 or 24
# per SM time 1.2x slower, a partial second wave); at 128, 2-warp tiles of 4096, 4 per SM (one-warp tiles
# there were no faster). From 512: one row per tile, 8192 elements per SM, 8 elements per thread up to
# 8 warps (16 per thread beyond), prefetching (rule: `_bwd_tile`; sweeps: docs/benchmarks.md, entries 10, 18).
_BWD_NARROW_TILES = {64: (16, 1, 16, True), 128: (32, 2, 4, True), 256: (4, 1, 16, True)}
# Row backward (rows read twice): the widest BLOCK_N it takes as one block (12289-16384), one 16-warp program
# per SM (docs/design.md, the rationale). Narrower, the prefetching tile wins but at 513-576 and 4480-5120
# (BWD_ROW_9X64, BWD_ROW_5X1024: the row in 9 blocks of 64, or 5 of 1024); wider, it takes SPLIT blocks
# (BWD_WIDE_ROW_MAX).
BWD_ROW_BLOCK = 16384
BWD_SPLIT_MAX = 3 * 4096  # 8193-12288: three blocks of 4096 instead (plan_rms_norm_bwd)
# 16385 and wider: the row kernel again, in blocks of 2048 (to 9 x 2048) or 4096, 16 warps (32 for 4-byte rows),
# one program per SM, w held up to 20480 (wider, its registers spill); the second read of each row comes from
# L2, where the column split reads x and dy twice from DRAM: 1.2-1.4x the column split's speed at 16896-28672,
# 1.03x at 32768 (H100). Up to these widths by the rows' element size and the
# streams read: at 32768 the fused add's third stream and fp32 rows were slower than the column split (fp32
# from 24576), their dw partials spilling more; the fused add's fp32 residual stream was not timed.
BWD_WIDE_ROW_MAX = {(2, 2): 32768, (2, 3): 7 * 4096, (4, 2): 9 * 2048, (4, 3): MAX_BWD_BLOCK}
BWD_WIDE_HOLD_W = 20480
# Widths where the prefetching tile's power-of-two block leaves many lanes masked, with two streams (4480-5120:
# 2-byte rows only): the row kernel in SPLIT blocks instead, as (BLOCK_N, SPLIT, num_warps, programs per SM).
# 4480-5120 (1024 x 5, split_row): 4 warps, 3 per SM, 5-7 % faster than the 8192-element tile, which leaves
# 3/8 masked; fp32 rows and the fused add's three streams were 10 % slower so (H100).
# 513-576 (64 x 9): one warp, 16 per SM, 3-8 % faster than the 1024-element tile, which leaves up to 7/16
# masked, and 7 % faster with 4-byte rows; the fused add's three streams were 29 % slower so (H100).
BWD_ROW_5X1024 = (1024, 5, 4, 3)
BWD_ROW_9X64 = (64, 9, 1, 16)
# The fused add's backward with residual_out's gradient reads a third [n_rows, n_cols] stream: up to this
# width, where RMSNorm's plan takes one row a tile (and three blocks of 1024 from 2049), it takes two, twice
# the bytes in flight per SM: 4-8 % less time at 512-2048 and 14-18 % at 2560-3072 on the H100, where
# RMSNorm's own backward (two streams) took 2-3 % more with two (docs/design.md, the rationale).
BWD_TWO_ROW_MAX = 3072
# A weighted backward of at most BWD_ONE_PROGRAM_TILES tiles holding at most BWD_ONE_PROGRAM_MAX elements in
# all (16 x 4096, 256 x 64) runs as one program, which then writes dw itself (rounded to dw's dtype) instead
# of fp32 partials for a reduce launch: one launch fewer, about 7 us of host time on the H100 where host time
# is all such a call costs (the program's tiles run one after another: few, so the device keeps up).
BWD_ONE_PROGRAM_MAX = 65536
BWD_ONE_PROGRAM_TILES = 16


def _bwd_tile(block_n: int) -> tuple[int, int, int, bool]:
    if block_n <= 256:
        return _BWD_NARROW_TILES[max(block_n, 64)]
    num_warps = min(8, block_n // 256) if block_n <= 4096 else block_n // 512
    return 1, num_warps, max(1, 8192 // block_n), True


def bwd_masked_row(n_cols: int, itemsize: int) -> tuple[int, int, int, int] | None:
    """The row kernel's blocks, warps and programs per SM at the widths BWD_ROW_9X64 (any rows) and BWD_ROW_5X1024
    (2-byte rows) take with two streams, else None."""
    if 512 < n_cols <= BWD_ROW_9X64[0] * BWD_ROW_9X64[1]:
        return BWD_ROW_9X64
    return BWD_ROW_5X1024 if itemsize <= 2 and split_row(n_cols, 4096) == BWD_ROW_5X1024[:2] else None


def split_row(n_cols: int, max_block: int, min_block: int = 256, max_split: int = 8) -> tuple[int, int]:
    """(BLOCK_N, SPLIT): a row in SPLIT power-of-two blocks, the largest block <= max_block that leaves at
    most 1/8 of them masked (5120 -> 5 x 1024, 12288 -> 3 x 4096, 896 -> 1 x 1024); (next_pow2, 1) where
    none does within `max_split` blocks of at least `min_block`, or n_cols is a power of two."""
    block = min(next_pow2(n_cols), max_block) if n_cols & (n_cols - 1) else 0
    while block >= min_block:
        split = cdiv(n_cols, block)
        if split > max_split:
            break
        if (split * block - n_cols) * 8 <= split * block:
            return block, split
        block //= 2
    return next_pow2(n_cols), 1


# the front ends' `variant=` names and their VARIANT codes (plain ints, as every launch's constexprs are)
VARIANTS = {"llama": LLAMA.value, "gemma": GEMMA.value, "olmo2": OLMO2.value}


def _variant_code(variant: str) -> int:
    return NO_WEIGHT.value if variant == "none" else VARIANTS[variant]


def plan_rms_norm_fwd(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                      itemsize: int = 2, variant: str = "llama") -> Launch:
    """Forward launch; `row_strides` are the x and y row strides (default: contiguous, = n_cols);
    `itemsize` the largest element size of x, w and y in bytes; `variant` from check_variant (the math only:
    the launch shape does not depend on it)."""
    check_row_count("x", n_rows)  # the tile kernel numbers rows in int32
    check_row_count("x", n_cols, "columns")
    fixed = {"EPS": float(eps), "ROW_ALIGN": row_align(n_cols, *row_strides), "ONE_COL": n_cols == 1,
             "VARIANT": _variant_code(variant)}
    if n_cols > (MAX_FWD_BLOCK if itemsize <= 2 else MAX_FWD_BLOCK // 2):
        # persistent, one program per SM: the rows in flight (and pass 2's re-reads) fit in L2
        return Launch(_rms_norm_fwd_chunked_kernel, (min(n_rows, properties().num_sms),), 32,
                      {**fixed, "BLOCK_N": CHUNK})
    block_n = next_pow2(n_cols)
    if n_cols >= FWD_TILE_BELOW:
        # A row per program. Other widths: SPLIT blocks of up to 4096 (split_row), 8 elements per thread per
        # block, at most 40 in all (more spill; the power-of-two block then, as at 24576). Three blocks read x
        # twice (0.4-3 % faster at 1536-12288); at four or more the second pass was level or slower
        # (docs/design.md, the rationale).
        block, split = split_row(n_cols, 4096)
        num_warps = max(2, block // 256)
        if split > 1 and split * block // (32 * num_warps) <= 40:
            return Launch(_rms_norm_fwd_row_kernel, (n_rows,), num_warps,
                          {**fixed, "BLOCK_N": block, "SPLIT": split, "RELOAD": split == 3})
        # powers of two: 16 elements per thread up to 16384, then 32 warps
        return Launch(_rms_norm_fwd_row_kernel, (n_rows,), min(32, block_n // 512),
                      {**fixed, "BLOCK_N": block_n, "SPLIT": 1, "RELOAD": block_n in _FWD_RELOAD})
    # Narrower rows: tiles of several rows, so that 2-warp programs keep enough bytes in flight per SM
    # within its 32-program limit (docs/benchmarks.md, entries 9 and 10).
    if block_n <= 64:  # 1024-element tiles, 1 warp at 64
        block_m, num_warps = 1024 // block_n, 1 if block_n == 64 else 2
    else:
        block_m, num_warps = FWD_TILE_ELEMS // block_n, 2
    block_m = max(1, min(block_m, next_pow2(n_rows)))
    return Launch(_rms_norm_fwd_kernel, (cdiv(n_rows, block_m),), num_warps,
                  {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n})


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """The backward's launches, in order. `stats` (rows wider than MAX_BWD_BLOCK only): x, w, dy -> STATS
    [n_batch * n_rows, 2] fp32, which `bwd` then takes as a fourth input. `bwd`: x, w, dy[, stats] -> dx and
    dw partials [n_batch, n_partials, n_cols] fp32. `reduce`: partials -> dw [n_batch, n_cols]. Variant
    "none": w is not read (pass any pointer, x say), no partials are written and there is no `reduce`.
    `dw_direct` (one program, BWD_ONE_PROGRAM_MAX): `bwd` writes dw [n_batch, n_cols] itself, in the dtype of
    the buffer bound as DW_PARTIAL, and there is no `reduce`."""

    stats: Launch | None
    bwd: Launch
    reduce: Launch | None  # None for variant "none" (no weight, no dw; DW_PARTIAL is not written) and dw_direct
    n_partials: int
    dw_direct: bool = False


def max_bwd_row(itemsize: int = 2, streams: int = 2) -> int:
    """The widest row the backward reads a row at a time (wider: a statistics pass, then a column split),
    for rows of `itemsize`-byte elements (the largest of those read twice) and `streams` row streams read."""
    return BWD_WIDE_ROW_MAX[(2 if itemsize <= 2 else 4, 2 if streams <= 2 else 3)]


def bwd_cols_tile() -> tuple[int, int, int, int]:
    """The column split's (BLOCK_M, BLOCK_N, num_warps, programs): BWD_COLS_TILE's programs per SM on this GPU."""
    block_m, block_n, num_warps, per_sm = BWD_COLS_TILE
    return block_m, block_n, num_warps, per_sm * properties().num_sms

def plan_rms_norm_bwd(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                      n_batch: int = 1, variant: str = "llama", *, streams: int = 2, itemsize: int = 2,
                      cols_tile: tuple[int, int, int, int] | None = None) -> BwdPlan:
    """The joint backward and the dw reduction for `n_batch` independent problems of `n_rows` rows each
    (n_batch > 1 only under jax.vmap: per-example dw). `row_strides`: the x, dy and dx row strides
    (default: contiguous); `variant` from check_variant (the math only, as in the forward); `streams`: the
    [n_rows, n_cols] inputs the kernel reads (x and dy; 3 for the fused add's dres); `itemsize`: the largest
    element size of x and dy in bytes; `cols_tile`: the column split's (BLOCK_M, BLOCK_N, num_warps, programs)
    for rows wider than `max_bwd_row` (default `bwd_cols_tile()`, the rule; a caller may pass
    candidates). Grids of up to a few programs per SM: the SM count from `xkern.device.properties()`."""
    check_row_count("x", n_rows)  # the tile kernels number rows (and the next tile's) in int32
    check_row_count("x", n_cols, "columns")  # and the column-split kernels columns
    block_n = next_pow2(n_cols)
    fixed = {"ROW_ALIGN": row_align(n_cols, *row_strides), "ONE_COL": n_cols == 1, "VARIANT": _variant_code(variant)}
    stats = None
    num_sms = properties().num_sms
    row = {**fixed, "EPS": float(eps)}
    if n_cols > max_bwd_row(itemsize, streams):
        stats = Launch(_rms_norm_bwd_stats_kernel, (n_rows, n_batch), 8, {**row, "BLOCK_N": COLS_STATS_CHUNK})
        block_m, block_n, num_warps, programs = cols_tile or bwd_cols_tile()
        col_blocks = cdiv(n_cols, block_n)
        groups = max(2, min(cdiv(n_rows, block_m), programs // col_blocks))
        bwd = Launch(_rms_norm_bwd_cols_kernel, (col_blocks, groups, n_batch), num_warps,
                     {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n})
    elif n_cols > MAX_BWD_BLOCK:  # up to max_bwd_row: SPLIT blocks (BWD_WIDE_ROW_MAX)
        block = 2048 if n_cols <= 9 * 2048 else 4096
        split = cdiv(n_cols, block)
        groups = max(2, min(n_rows, num_sms))
        bwd = Launch(_rms_norm_bwd_row_kernel, (groups, n_batch), 16 if itemsize <= 2 else 32,
                     {**row, "BLOCK_N": block, "SPLIT": split, "HOLD_W": block * split <= BWD_WIDE_HOLD_W})
    elif n_cols > BWD_SPLIT_MAX:  # up to BWD_ROW_BLOCK
        groups = max(2, min(n_rows, num_sms))
        bwd = Launch(_rms_norm_bwd_row_kernel, (groups, n_batch), 16,
                     {**row, "BLOCK_N": block_n, "SPLIT": 1, "HOLD_W": True})
    elif streams <= 2 and (rule := bwd_masked_row(n_cols, itemsize)):
        block, split, num_warps, per_sm = rule
        groups = max(2, min(n_rows, num_sms * per_sm))
        bwd = Launch(_rms_norm_bwd_row_kernel, (groups, n_batch), num_warps,
                     {**row, "BLOCK_N": block, "SPLIT": split, "HOLD_W": True})
    else:
        block_m, num_warps, programs_per_sm, prefetch = _bwd_tile(block_n)
        split = 1
        # Widths a power-of-two block would leave more than 1/8 masked, in SPLIT blocks where that measured
        # faster (docs/design.md, the rationale): 65-111 (80 = 5 x 16, 96 = 3 x 32; split_row, up to 5) in
        # 16-row tiles, 2 warps, 8 programs per SM (at 48 the 64 block won); 2049-3072 in 3 blocks of 1024,
        # 4 warps, 4 per SM; 8193-12288 in blocks of 4096, 16 warps, one per SM (the row kernel would leave a
        # quarter to half of its lanes idle). 3073-8191: the power-of-two block measured as fast as any split.
        if (block_n - n_cols) * 8 > block_n:
            if 64 < n_cols < 128:
                block, split = split_row(n_cols, 64, min_block=16, max_split=5)
                if split > 1:
                    block_n, block_m, num_warps, programs_per_sm = block, 16, 2, 8
            elif 2048 < n_cols <= 3072:
                block_n, split, num_warps, programs_per_sm = 1024, cdiv(n_cols, 1024), 4, 4
            elif 8192 < n_cols <= BWD_SPLIT_MAX:
                block_n, split, num_warps, programs_per_sm = 4096, cdiv(n_cols, 4096), 16, 1
        if streams > 2 and block_m == 1 and n_cols <= BWD_TWO_ROW_MAX:
            block_m = 2
        block_m = max(1, min(block_m, next_pow2(n_rows)))
        tiles = cdiv(n_rows, block_m)
        # one program over every tile where they are few and small: it writes dw itself (BWD_ONE_PROGRAM_MAX)
        one = variant != "none" and tiles <= BWD_ONE_PROGRAM_TILES and \
            tiles * block_m * block_n * split <= BWD_ONE_PROGRAM_MAX
        groups = 1 if one else max(2, min(tiles, num_sms * programs_per_sm))
        tile = {**row, "BLOCK_M": block_m, "BLOCK_N": block_n, "PREFETCH": prefetch}
        bwd = (Launch(_rms_norm_bwd_split_kernel, (groups, n_batch), num_warps, {**tile, "SPLIT": split}) if split > 1
               else Launch(_rms_norm_bwd_kernel, (groups, n_batch), num_warps, tile))
        if one:
            return BwdPlan(stats, bwd, None, 1, dw_direct=True)
    # At least 2 partials (a spare program stores zeros): jax-triton would fold an n_partials of 1 into the
    # reduction's binary, and torch's would not.
    reduce = None if variant == "none" else plan_dw_reduce(groups, n_cols, n_batch)
    return BwdPlan(stats, bwd, reduce, groups)


def plan_dw_reduce(n_partials: int, n_cols: int, n_batch: int = 1) -> Launch:
    """Column blocks of 16 (64 bytes), each program summing up to 512 partials per step with up to 32
    warps: many programs, few dependent loads (the reduction is latency-bound, not bandwidth-bound; at
    2112 partials x 256 columns this took the backward from 36.0 to 33.1 us on the H200)."""
    block_n = min(next_pow2(n_cols), REDUCE_BLOCK_N)
    block_p = min(next_pow2(n_partials), REDUCE_BLOCK_P)
    num_warps = max(1, min(32, block_p * block_n // 256))
    return Launch(_dw_reduce_kernel, (cdiv(n_cols, block_n), n_batch), num_warps,
                  {"ROW_ALIGN": row_align(n_cols), "BLOCK_P": block_p, "BLOCK_N": block_n})
