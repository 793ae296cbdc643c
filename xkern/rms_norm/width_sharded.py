"""Width-sharded RMSNorm (tensor parallel over the hidden dim): each shard holds a column slice of x, w
and dy. A shard sums its slice of each row (`_rms_norm_fwd_sums_kernel`, `_rms_norm_bwd_sums_kernel`),
the front end all-reduces those [rows] sums over the hidden-dim shards, and each shard then finishes
its slice locally with the statistics of the whole row: the forward in `_rms_norm_fwd_rstd_kernel`,
the backward in `_rms_norm_bwd_finish_kernel` (the sums -> rstd, mean(g * n)) followed by the column
split `_rms_norm_bwd_cols_kernel` (kernels.py) on the local slice. x is never gathered. Rounding: the same
math as one device; only the fp32 order of each row sum differs (per shard, then across shards). Every
variant (VARIANT, as the one-device kernels'): Llama, Gemma, OLMo-2, and no weight (W bound to x, not read; no
dw).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from xkern.launch import Launch, cdiv, next_pow2, row_align
from xkern.rms_norm.kernels import NO_WEIGHT, _grad_normed, _inv, _rms_norm_bwd_cols_kernel, _scaled
from xkern.rms_norm.plans import _variant_code, bwd_cols_tile, plan_dw_reduce


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride"])
def _rms_norm_fwd_sums_kernel(
    X,
    n_rows, n_cols, x_row_stride,
    SUM_SQ,
    ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    # sum(x**2) over this shard's columns, in fp32, BLOCK_M rows per program, column chunks of BLOCK_N.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    offsets = rows.to(tl.int64)[:, None] * x_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + offsets + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(SUM_SQ + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "n_total", "x_row_stride", "y_row_stride"])
def _rms_norm_fwd_rstd_kernel(
    X, W, SUM_SQ,
    n_rows, n_cols, n_total, x_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    # The forward of this shard's columns, given sum(x**2) over the whole row (n_total columns).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    sum_sq = tl.load(SUM_SQ + rows, mask=row_mask, other=0.0)
    rstd = tl.rsqrt(sum_sq * _inv(n_total) + EPS)
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    normed = x * rstd[:, None]
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = _scaled(normed, w[None, :], X.dtype.element_ty, VARIANT)
    tl.store(Y + rows * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride"])
def _rms_norm_bwd_sums_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride,
    SUMS,
    ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    # sum(x**2) and sum(g * x), g = (dy * w) rounded to x's dtype, over this shard's columns: SUMS [rows, 2].
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    sum_sq = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sum_gx = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        sum_sq += x * x
        sum_gx += _grad_normed(dy, w[None, :], X.dtype.element_ty, VARIANT) * x
    tl.store(SUMS + rows * 2, tl.sum(sum_sq, axis=1), mask=row_mask)
    tl.store(SUMS + rows * 2 + 1, tl.sum(sum_gx, axis=1), mask=row_mask)


@triton.jit(do_not_specialize=["n_rows", "n_total"])
def _rms_norm_bwd_finish_kernel(
    SUMS,
    n_rows, n_total,
    STATS,
    EPS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # Whole-row sums [rows, 2] -> the statistics `_rms_norm_bwd_cols_kernel` takes: rstd, mean(g * n).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = rows < n_rows
    inv_n = _inv(n_total)
    sum_sq = tl.load(SUMS + rows * 2, mask=mask, other=1.0)
    sum_gx = tl.load(SUMS + rows * 2 + 1, mask=mask, other=0.0)
    rstd = tl.rsqrt(sum_sq * inv_n + EPS)
    tl.store(STATS + rows * 2, rstd, mask=mask)
    tl.store(STATS + rows * 2 + 1, sum_gx * rstd * inv_n, mask=mask)


SUMS_TILE = 2048  # elements per program of the width-sharded kernels (BLOCK_M x BLOCK_N), 4 warps


def _sums_tile(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_n = min(next_pow2(n_cols), SUMS_TILE)
    return max(1, min(next_pow2(n_rows), SUMS_TILE // block_n)), block_n


def width_sharded_ok(variant: str) -> bool:
    """Whether the width-sharded kernels compute `variant` (check_variant's: "none" without a weight): every
    variant."""
    return variant in ("llama", "gemma", "olmo2", "none")


def plan_rms_norm_fwd_width_sharded(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                                    variant: str = "llama") -> tuple[Launch, Launch]:
    """The forward of one shard of a width-sharded RMSNorm: (sums, norm). `sums`: x -> SUM_SQ [n_rows]
    fp32 over the shard's `n_cols` columns; the caller all-reduces it over the shards; `norm`: x, w,
    SUM_SQ -> y, with the runtime scalar `n_total` (the whole width); `variant` check_variant's (W bound to x
    for "none")."""
    align = row_align(n_cols, *row_strides)
    block_m, block_n = _sums_tile(n_rows, n_cols)
    sums = Launch(_rms_norm_fwd_sums_kernel, (cdiv(n_rows, block_m),), 4,
                  {"ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_N": block_n})
    norm = Launch(_rms_norm_fwd_rstd_kernel, (cdiv(n_rows, block_m), cdiv(n_cols, block_n)), 4,
                  {"EPS": float(eps), "ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_N": block_n,
                   "VARIANT": _variant_code(variant)})
    return sums, norm


@dataclasses.dataclass(frozen=True)
class WidthShardedBwdPlan:
    """One shard's backward of a width-sharded RMSNorm, in order. `sums`: x, w, dy -> SUMS [n_batch *
    n_rows, 2] fp32 (the caller all-reduces it over the shards); `finish`: SUMS -> STATS (runtime scalar
    `n_total`, the whole width); `bwd`, `reduce`, `n_partials` as in BwdPlan (the column split; no `reduce`
    without a weight)."""

    sums: Launch
    finish: Launch
    bwd: Launch
    reduce: Launch | None
    n_partials: int


def plan_rms_norm_bwd_width_sharded(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                                    n_batch: int = 1, variant: str = "llama") -> WidthShardedBwdPlan:
    """As `plan_rms_norm_bwd`, for one shard's `n_cols` columns of a width-sharded RMSNorm."""
    code = _variant_code(variant)
    align = row_align(n_cols, *row_strides)
    block_m, block_n = _sums_tile(n_batch * n_rows, n_cols)
    sums = Launch(_rms_norm_bwd_sums_kernel, (cdiv(n_batch * n_rows, block_m),), 4,
                  {"ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_N": block_n, "VARIANT": code})
    finish_m = min(next_pow2(n_batch * n_rows), 1024)
    finish = Launch(_rms_norm_bwd_finish_kernel, (cdiv(n_batch * n_rows, finish_m),), 4,
                    {"EPS": float(eps), "BLOCK_M": finish_m})
    block_m, block_n, num_warps, programs = bwd_cols_tile()
    block_n = min(block_n, max(16, next_pow2(n_cols)))
    col_blocks = cdiv(n_cols, block_n)
    groups = max(2, min(cdiv(n_rows, block_m), programs // col_blocks))
    bwd = Launch(_rms_norm_bwd_cols_kernel, (col_blocks, groups, n_batch), num_warps,
                 {"ROW_ALIGN": align, "ONE_COL": n_cols == 1, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "VARIANT": code})
    reduce = None if code == NO_WEIGHT.value else plan_dw_reduce(groups, n_cols, n_batch)
    return WidthShardedBwdPlan(sums, finish, bwd, reduce, groups)
