"""The grouped GEMM's kernels (the contract: `xkern.grouped_mm`; their plans: `plans.py`).

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

import triton
import triton.language as tl


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
    _rows_tile(tl.program_id(0), X, W, OFFS, n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride,
               w_stride, Y, W_N_CONTIGUOUS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M)


@triton.jit(do_not_specialize=["n_slots", "n_inner", "n_cols", "n_experts", "x_row_stride", "w_expert_stride",
                               "w_stride"])
def _grouped_rows_persistent_kernel(
    X, W, OFFS,
    n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride, w_stride,
    Y,
    ALIGN: tl.constexpr, W_N_CONTIGUOUS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The rows kernel on a persistent grid ("persistent"): each program takes the tiles of `_grouped_rows_kernel`'s
    programs pid, pid + grid, pid + 2 grid, ... in turn (neighbouring programs still on neighbouring tiles)."""
    n_inner = n_inner // ALIGN * ALIGN
    n_cols = n_cols // ALIGN * ALIGN
    x_row_stride = x_row_stride // ALIGN * ALIGN
    w_expert_stride = w_expert_stride // ALIGN * ALIGN
    w_stride = w_stride // ALIGN * ALIGN
    n_programs = (tl.cdiv(n_slots, BLOCK_M) + n_experts) * tl.cdiv(n_cols, BLOCK_N)
    for pid in range(tl.program_id(0), n_programs, tl.num_programs(0)):
        _rows_tile(pid, X, W, OFFS, n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride, w_stride, Y,
                   W_N_CONTIGUOUS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, GROUP_M)


@triton.jit
def _rows_tile(pid, X, W, OFFS, n_slots, n_inner, n_cols, n_experts, x_row_stride, w_expert_stride, w_stride, Y,
               W_N_CONTIGUOUS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):
    """One (row tile, column tile) of y: program number `pid` of the rows kernel's grid."""
    # Program -> (row tile, column tile): bands of GROUP_M row tiles, row tile fastest inside a band.
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


@triton.jit
def _dw_sum(X, DY, start, end, ks, cols, k_mask, col_mask, x_row_stride, dy_row_stride, IEEE: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """x[start:end, ks].T @ dy[start:end, cols] in FP32, BLOCK_R rows at a time: `_grouped_dw_kernel`'s loop, for
    the split dw's kernels (that kernel keeps its own copy, so that its binary stays the one the GPU suite
    validated)."""
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
    return acc


@triton.jit
def _dw_program(pid, n_inner, n_cols, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program -> (item, its K tile's indices, its N tile's): the N tile fastest (neighbours share x rows)."""
    col_tiles = tl.cdiv(n_cols, BLOCK_N)
    per_item = tl.cdiv(n_inner, BLOCK_K) * col_tiles
    ks = pid % per_item // col_tiles * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid % col_tiles * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid // per_item, ks, cols


@triton.jit
def _aligned(n_inner, n_cols, a_row_stride, b_row_stride, ALIGN: tl.constexpr):
    """The dw kernels' widths and row strides with the plan's alignment made visible (`_grouped_rows_kernel`)."""
    return (n_inner // ALIGN * ALIGN, n_cols // ALIGN * ALIGN, a_row_stride // ALIGN * ALIGN,
            b_row_stride // ALIGN * ALIGN)


@triton.jit
def _split_chunks(OFFS, n_slots, n_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The experts split into chunks of CHUNK rows (those with more rows): a BLOCK_E vector each of their
    starts, ends, chunks (0 where not split) and the chunks' running sum; offsets clamped to [0, n_slots]."""
    e = tl.arange(0, BLOCK_E)
    e_mask = e < n_experts
    ends = tl.minimum(tl.maximum(tl.load(OFFS + e, mask=e_mask, other=0), 0), n_slots)
    starts = tl.minimum(tl.maximum(tl.load(OFFS + e - 1, mask=e_mask & (e > 0), other=0), 0), n_slots)
    sizes = tl.where(e_mask, tl.maximum(ends - starts, 0), 0)
    chunks = tl.where(sizes > CHUNK, tl.cdiv(sizes, CHUNK), 0)
    return starts, ends, chunks, tl.cumsum(chunks, axis=0)


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


# The split dw ("dw_split"): an expert of more than CHUNK rows is summed in chunks of CHUNK rows by more programs
# (its tiles alone would otherwise run long after the others' are done, under skewed routing), in two launches,
# each output element still summed in one fixed order: `_grouped_dw_chunks_kernel` writes each chunk's FP32 sums
# to a partial (chunk c of the split experts, numbered expert after expert, to PARTIAL[c]); then
# `_grouped_dw_split_kernel`, one program per (expert, K tile, N tile) as `_grouped_dw_kernel`, sums a split
# expert's partials in chunk order, or an unsplit expert's rows as `_grouped_dw_kernel` does. Split experts have
# more than CHUNK rows each, so their chunks number at most 2 * n_slots // CHUNK (the partials the plan makes);
# chunks past it (only offsets that are not non-decreasing make them) are neither written nor read.


@triton.jit(do_not_specialize=["n_slots", "n_inner", "n_cols", "n_experts", "x_row_stride", "dy_row_stride"])
def _grouped_dw_chunks_kernel(
    X, DY, OFFS,
    n_slots, n_inner, n_cols, n_experts, x_row_stride, dy_row_stride,
    PARTIAL,
    ALIGN: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    n_inner, n_cols, x_row_stride, dy_row_stride = _aligned(n_inner, n_cols, x_row_stride, dy_row_stride, ALIGN)
    # Program -> (chunk, K tile, N tile); the chunk's expert: how many split experts' chunks end at or before it
    chunk, ks, cols = _dw_program(tl.program_id(0), n_inner, n_cols, BLOCK_K, BLOCK_N)
    starts, ends, chunks, ends_chunks = _split_chunks(OFFS, n_slots, n_experts, CHUNK, BLOCK_E)
    expert = tl.sum((ends_chunks <= chunk).to(tl.int32), axis=0)
    if expert < n_experts:
        mine = tl.arange(0, BLOCK_E) == expert
        first = tl.sum(tl.where(mine, starts + (chunk - ends_chunks + chunks) * CHUNK, 0), axis=0)
        last = tl.minimum(first + CHUNK, tl.sum(tl.where(mine, ends, 0), axis=0))
        k_mask = ks < n_inner
        col_mask = cols < n_cols
        acc = _dw_sum(X, DY, first, last, ks, cols, k_mask, col_mask, x_row_stride, dy_row_stride, IEEE, BLOCK_K,
                      BLOCK_N, BLOCK_R)
        ptrs = (PARTIAL + chunk.to(tl.int64) * n_inner * n_cols) + (ks[:, None] * n_cols + cols[None, :])
        tl.store(ptrs, acc, mask=k_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["n_slots", "n_inner", "n_cols", "n_experts", "x_row_stride", "dy_row_stride"])
def _grouped_dw_split_kernel(
    X, DY, OFFS, PARTIAL,
    n_slots, n_inner, n_cols, n_experts, x_row_stride, dy_row_stride,
    DW,
    ALIGN: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    n_inner, n_cols, x_row_stride, dy_row_stride = _aligned(n_inner, n_cols, x_row_stride, dy_row_stride, ALIGN)
    expert, ks, cols = _dw_program(tl.program_id(0), n_inner, n_cols, BLOCK_K, BLOCK_N)
    starts, ends, chunks, ends_chunks = _split_chunks(OFFS, n_slots, n_experts, CHUNK, BLOCK_E)
    mine = tl.arange(0, BLOCK_E) == expert
    n_chunks = tl.sum(tl.where(mine, chunks, 0), axis=0)
    k_mask = ks < n_inner
    col_mask = cols < n_cols
    mask = k_mask[:, None] & col_mask[None, :]
    tile = ks[:, None] * n_cols + cols[None, :]
    if n_chunks > 0:  # the partials of its chunks, in chunk order
        first = tl.sum(tl.where(mine, ends_chunks - chunks, 0), axis=0)
        n_partials = 2 * n_slots // CHUNK
        acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
        partial_ptrs = (PARTIAL + first.to(tl.int64) * n_inner * n_cols) + tile
        for _ in range(first, tl.minimum(first + n_chunks, n_partials)):
            acc += tl.load(partial_ptrs, mask=mask, other=0.0)
            partial_ptrs += n_inner * n_cols
    else:
        start = tl.sum(tl.where(mine, starts, 0), axis=0)
        end = tl.sum(tl.where(mine, ends, 0), axis=0)
        acc = _dw_sum(X, DY, start, end, ks, cols, k_mask, col_mask, x_row_stride, dy_row_stride, IEEE, BLOCK_K,
                      BLOCK_N, BLOCK_R)
    tl.store((DW + expert.to(tl.int64) * n_inner * n_cols) + tile, acc.to(DW.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_slots", "n_inner", "n_cols", "n_experts", "x_row_stride", "dy_row_stride"])
def _grouped_dw_persistent_kernel(
    X, DY, OFFS,
    n_slots, n_inner, n_cols, n_experts, x_row_stride, dy_row_stride,
    DW,
    ALIGN: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """The dw kernel on a persistent grid ("dw_persistent"): each program takes `_grouped_dw_kernel`'s tiles pid,
    pid + grid, ... in turn, the tile loop and each tile's row loop flattened into one (Triton's `flatten`), so
    that one tile's last steps and store overlap the next tile's first loads where an expert has few rows."""
    n_inner, n_cols, x_row_stride, dy_row_stride = _aligned(n_inner, n_cols, x_row_stride, dy_row_stride, ALIGN)
    n_tiles = n_experts * tl.cdiv(n_inner, BLOCK_K) * tl.cdiv(n_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True):
        expert, ks, cols = _dw_program(tile, n_inner, n_cols, BLOCK_K, BLOCK_N)
        end = tl.minimum(tl.maximum(tl.load(OFFS + expert), 0), n_slots)
        start = tl.load(OFFS + tl.maximum(expert - 1, 0))
        start = tl.where(expert > 0, tl.minimum(tl.maximum(start, 0), n_slots), 0)
        k_mask = ks < n_inner
        col_mask = cols < n_cols
        acc = _dw_sum(X, DY, start, end, ks, cols, k_mask, col_mask, x_row_stride, dy_row_stride, IEEE, BLOCK_K,
                      BLOCK_N, BLOCK_R)
        dw_ptrs = (DW + expert.to(tl.int64) * n_inner * n_cols) + (ks[:, None] * n_cols + cols[None, :])
        tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])
