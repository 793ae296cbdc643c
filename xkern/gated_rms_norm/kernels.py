"""Gated RMSNorm (the hybrid models' norm of the linear-attention output): the kernels (`@triton.jit`).

x = hidden_states, z = the gate (x's shape and dtype), w [N]; the norm runs over each row, or over each of
its groups of `group_size` columns; a = act(z.float()) with act silu or sigmoid. Constexprs:
  GATE_FIRST  h = x.float() * a, normed = h * rstd(h) (Mamba2's form); else h = x.float(), the gate after
  FP32_W      p = w.float() * normed (fp32); else Llama's rounding p = w * normed.to(x.dtype), formed in
              promote(w, x) (rounded to x's dtype when w has it, as eager multiplies two bf16 tensors)
  y = (p * a).to(x.dtype) with the gate after; p.to(y.dtype) with it first (y: promote(w, x) for Llama's
  rounding, as Mamba2 returns `w * normed.to(dtype)` unconverted; x's dtype for FP32_W).
The forward's activation is torch's CUDA formula: silu `z / (1 + exp(-z))`, sigmoid `1 / (1 + exp(-z))`, with
the correctly rounded division and libdevice's expf (the CUDA math library's, which torch's kernels call);
Triton's interpreter has no libdevice, so on CPU `tl.exp` (numpy's) stands in for it. The backward's (judged
within tolerance) takes Triton's fast exp and division (`_bwd_act`).

Backward, joint (dx, dz and dw from one read of x, z, dy; rstd recomputed), eager autograd's rounding:
  gate after:  dp = dy * a (rounded to promote(w, x) with Llama's rounding), da = dy * p
  gate first:  dp = dy
  g = dL/d(normed): Llama `(dp * w).to(x.dtype)`, FP32_W `dp * w`; dw terms: Llama `(dp * normed.to(x.dtype))`
  rounded to promote(w, x), FP32_W `dp * normed` (fp32); dh = rstd * (g - n * mean(g * n)) per group;
  gate first: dx = dh * a, da = dh * x; else dx = dh. dz = act'(z) da: silu `da * s * (1 + z * (1 - s))`,
  sigmoid `da * (1 - s) * s`, s = sigmoid(z). dw: per-program fp32 partial rows, summed over programs in a
  fixed order by RMSNorm's `_dw_reduce_kernel` (no atomics).

Layout: row r, group g at `X + r * row_stride + g * group_size + col` (row offsets int64): a head-major view
whose heads are the rows is read in place. Programs are (row block, group): each program's groups share one
weight slice, so its dw partial is one [group_size] slice of an [n_cols] row.

One binary for both front ends, as RMSNorm's kernels (xkern/rms_norm/kernels.py says why): integer arguments
not specialized, ROW_ALIGN and ONE_COL (a group of one column) stated by the plan, EPS a constexpr.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from xkern.launch import INTERPRET

# libdevice's expf on the GPU (torch's own exp there); the interpreter cannot run libdevice
_LIBDEVICE_EXP: tl.constexpr = tl.constexpr(not INTERPRET)


@triton.jit
def _exp(v):
    if _LIBDEVICE_EXP:
        e = libdevice.exp(v)
    else:
        e = tl.exp(v)
    return e


@triton.jit
def _act(z, SIGMOID: tl.constexpr):
    # torch's CUDA kernels: silu x / (1 + exp(-x)), sigmoid 1 / (1 + exp(-x)), IEEE division
    if SIGMOID:
        a = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + _exp(-z))
    else:
        a = tl.math.div_rn(z, 1.0 + _exp(-z))
    return a


@triton.jit
def _bwd_act(z, SIGMOID: tl.constexpr):
    # The backward's (a, s = sigmoid(z)) from one fast exp and one approximate division: its results are
    # judged within tolerance, not bit for bit, and the forward's exact forms would cost two libdevice exps
    # and three IEEE divisions an element, more than the element's bytes take to move.
    s = 1.0 / (1.0 + tl.exp(-z))
    if SIGMOID:
        a = s
    else:
        a = z * s
    return a, s


@triton.jit
def _act_grad(z, da, s, SIGMOID: tl.constexpr):
    # torch's silu_backward `dy * s * (1 + x * (1 - s))`; sigmoid_backward `dy * (1 - y) * y`
    if SIGMOID:
        dz = da * (1.0 - s) * s
    else:
        dz = da * s * (1.0 + z * (1.0 - s))
    return dz


@triton.jit
def _inv(n):
    return tl.math.div_rn(1.0, n * 1.0)


@triton.jit
def _weighted(n, w, X_TY: tl.constexpr, W_TY: tl.constexpr, FP32_W: tl.constexpr):
    # p = w * normed as eager forms it (fp32 value): FP32_W in fp32; else w * normed.to(x.dtype), rounded to
    # promote(w, x) = x's dtype where w has it (fp32 otherwise, no rounding)
    if FP32_W:
        p = w * n
    else:
        p = w * n.to(X_TY).to(tl.float32)
        if W_TY == X_TY:
            p = p.to(X_TY).to(tl.float32)
    return p


@triton.jit
def _grads(n, w, dp, X_TY: tl.constexpr, W_TY: tl.constexpr, FP32_W: tl.constexpr):
    # (g = dL/d(normed), the dw terms) from dp = dL/dp, eager autograd's rounding
    if FP32_W:
        g = dp * w
        t = dp * n
    else:
        g = (dp * w).to(X_TY).to(tl.float32)
        t = dp * n.to(X_TY).to(tl.float32)
        if W_TY == X_TY:
            t = t.to(X_TY).to(tl.float32)
    return g, t


@triton.jit
def _normed_grads(x, a, dy, w, rstd, GATE_FIRST: tl.constexpr, FP32_W: tl.constexpr, X_TY: tl.constexpr,
                  W_TY: tl.constexpr):
    # From x, a = act(z), dy and w (fp32) and rstd: (n = normed, g = dL/dn, the dw terms, dL/da with the
    # gate after: dy * p). dp = dL/dp: dy with the gate first, else dy * a, rounded to promote(w, x).
    n = (x * a if GATE_FIRST else x) * rstd
    if GATE_FIRST:
        dp = dy
        da = dy
    else:
        da = dy * _weighted(n, w, X_TY, W_TY, FP32_W)
        dp = dy * a
        if not FP32_W:
            if W_TY == X_TY:
                dp = dp.to(X_TY).to(tl.float32)
    g, t = _grads(n, w, dp, X_TY, W_TY, FP32_W)
    return n, g, t, da


@triton.jit
def _input_grads(x, z, a, s, n, g, rstd, mean_gn, da, GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr):
    # (dx, dz) in fp32 from dh = dL/dh = rstd * (g - n * mean(g * n)), h = x * a (gate first) or x
    dh = rstd * (g - n * mean_gn)
    if GATE_FIRST:
        dx = dh * a
        da = dh * x
    else:
        dx = dh
    return dx, _act_grad(z, da, s, SIGMOID)


@triton.jit
def _tile_rows(rows, n_rows, col_mask):
    # (int64 row indices [BLOCK_M, 1], the tile's mask). No pointers in or out: torch's access analysis
    # counts a pointer passed through a call as written (then X looks mutated under torch.compile).
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return rows.to(tl.int64)[:, None], mask


@triton.jit
def _act_rstd(x, z, group_size, EPS: tl.constexpr, GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr):
    # (h, rstd [BLOCK_M, 1], a = act(z)) of a tile of whole groups from x and z (fp32)
    a = _act(z, SIGMOID)
    h = x * a if GATE_FIRST else x
    return h, tl.rsqrt(tl.sum(h * h, axis=1) * _inv(group_size) + EPS)[:, None], a


@triton.jit
def _gated_y(n, a, w, GATE_FIRST: tl.constexpr, FP32_W: tl.constexpr, X_TY: tl.constexpr, W_TY: tl.constexpr):
    # y (fp32) from normed, a and w
    y = _weighted(n, w, X_TY, W_TY, FP32_W)
    if not GATE_FIRST:
        y = y * a
    return y


@triton.jit(do_not_specialize=["n_rows", "group_size", "x_row_stride", "z_row_stride", "y_row_stride"])
def _gated_rms_norm_fwd_kernel(
    X, Z, W,
    n_rows, group_size, x_row_stride, z_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr, GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr,
    FP32_W: tl.constexpr,
):
    # One tile of BLOCK_M rows of group program_id(1) a program; PERSISTENT: program p takes tiles p, p + P, ...,
    # loading the next tile's x and z before this tile's math, as the backward's PREFETCH.
    # alignment from the plan, visible to the compiler; a group of 1 folded in, as jax-triton folds it
    group_size = 1 if ONE_COL else group_size // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    z_row_stride = z_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < group_size
    gcols = (tl.program_id(1) * group_size + cols)[None, :]
    x_ty: tl.constexpr = X.dtype.element_ty
    w_ty: tl.constexpr = W.dtype.element_ty
    if PERSISTENT:
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        w = tl.load(W + gcols, mask=col_mask[None, :], other=0.0).to(tl.float32)
        r64, mask = _tile_rows(pid * BLOCK_M + tl.arange(0, BLOCK_M), n_rows, col_mask)
        x_next = tl.load(X + r64 * x_row_stride + gcols, mask=mask, other=0.0)
        z_next = tl.load(Z + r64 * z_row_stride + gcols, mask=mask, other=0.0)
        for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), num_programs):
            cur_r64, cur_mask = r64, mask
            x = x_next.to(tl.float32)
            z = z_next.to(tl.float32)
            r64, mask = _tile_rows((tile + num_programs) * BLOCK_M + tl.arange(0, BLOCK_M), n_rows, col_mask)
            x_next = tl.load(X + r64 * x_row_stride + gcols, mask=mask, other=0.0)
            z_next = tl.load(Z + r64 * z_row_stride + gcols, mask=mask, other=0.0)
            h, rstd, a = _act_rstd(x, z, group_size, EPS, GATE_FIRST, SIGMOID)
            y = _gated_y(h * rstd, a, w, GATE_FIRST, FP32_W, x_ty, w_ty)
            tl.store(Y + cur_r64 * y_row_stride + gcols, y.to(Y.dtype.element_ty), mask=cur_mask)
    else:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows * x_row_stride + gcols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + rows * z_row_stride + gcols, mask=mask, other=0.0).to(tl.float32)
        h, rstd, a = _act_rstd(x, z, group_size, EPS, GATE_FIRST, SIGMOID)
        w = tl.load(W + gcols, mask=col_mask[None, :], other=0.0).to(tl.float32)
        y = _gated_y(h * rstd, a, w, GATE_FIRST, FP32_W, x_ty, w_ty)
        tl.store(Y + rows * y_row_stride + gcols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _group_rstd(x_row, z_row, group_size, EPS: tl.constexpr, BLOCK_N: tl.constexpr, GATE_FIRST: tl.constexpr,
                SIGMOID: tl.constexpr):
    # rstd of one group too wide for registers: h**2 summed over column chunks, which L2 is asked to keep
    # for the caller's second pass
    sum_sq = tl.zeros([BLOCK_N], tl.float32)
    for c in range(0, group_size, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        mask = cols < group_size
        h = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if GATE_FIRST:
            z = tl.load(z_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            h = h * _act(z, SIGMOID)
        sum_sq += h * h
    return tl.rsqrt(tl.sum(sum_sq, axis=0) * _inv(group_size) + EPS)


@triton.jit(do_not_specialize=["n_rows", "group_size", "x_row_stride", "z_row_stride", "y_row_stride"])
def _gated_rms_norm_fwd_chunked_kernel(
    X, Z, W,
    n_rows, group_size, x_row_stride, z_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr,
    GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr, FP32_W: tl.constexpr,
):
    # Groups wider than a register block: program (row, group) sums h**2 over column chunks, then reads the
    # group again (from L2) for the output.
    group_size = 1 if ONE_COL else group_size // ROW_ALIGN * ROW_ALIGN
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * group_size
    x_row = X + row * (x_row_stride // ROW_ALIGN * ROW_ALIGN) + start
    z_row = Z + row * (z_row_stride // ROW_ALIGN * ROW_ALIGN) + start
    y_row = Y + row * (y_row_stride // ROW_ALIGN * ROW_ALIGN) + start
    rstd = _group_rstd(x_row, z_row, group_size, EPS, BLOCK_N, GATE_FIRST, SIGMOID)
    for c in range(0, group_size, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        mask = cols < group_size
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        a = _act(tl.load(z_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32), SIGMOID)
        h = x * a if GATE_FIRST else x
        w = tl.load(W + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = _weighted(h * rstd, w, X.dtype.element_ty, W.dtype.element_ty, FP32_W)
        if not GATE_FIRST:
            y = y * a
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "group_size", "x_row_stride", "z_row_stride", "dy_row_stride",
                               "dx_row_stride"])
def _gated_rms_norm_bwd_kernel(
    X, Z, W, DY,
    n_rows, group_size, x_row_stride, z_row_stride, dy_row_stride, dx_row_stride,
    DX, DZ, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, DW_TILE: tl.constexpr,
    GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr, FP32_W: tl.constexpr,
):
    # Persistent over row blocks of one group (program_id(1)): program p takes blocks p, p + P, ... and keeps
    # its dw slice in registers; dx and dz are written with dx's row stride (both contiguous). With PREFETCH
    # the next block's x, z and dy are loaded before this block's math (register double buffering): each
    # program keeps a block's loads in flight while it computes, which hides DRAM latency with few programs.
    # STAGES > 1: Triton's pipelining of the loop instead (cp.async, STAGES - 1 blocks ahead). DW_TILE: the dw
    # terms summed per (row of the block, column) over the blocks, and over the rows once at the end: no sum
    # across warps (shared memory, a barrier) a block; a fixed order still, another than row sums a block.
    group_size = 1 if ONE_COL else group_size // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    z_row_stride = z_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    group = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < group_size
    gcols = (group * group_size + cols)[None, :]
    w = tl.load(W + gcols, mask=col_mask[None, :], other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N] if DW_TILE else [BLOCK_N], tl.float32)
    inv_n = _inv(group_size)
    x_ty: tl.constexpr = X.dtype.element_ty
    w_ty: tl.constexpr = W.dtype.element_ty
    if PREFETCH:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        r64, mask = _tile_rows(rows, n_rows, col_mask)
        x_next = tl.load(X + r64 * x_row_stride + gcols, mask=mask, other=0.0)
        z_next = tl.load(Z + r64 * z_row_stride + gcols, mask=mask, other=0.0)
        dy_next = tl.load(DY + r64 * dy_row_stride + gcols, mask=mask, other=0.0)
    for tile in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), num_programs, num_stages=STAGES):
        if PREFETCH:
            cur_rows, cur_r64, cur_mask = rows, r64, mask
            x = x_next.to(tl.float32)
            z = z_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            rows = (tile + num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
            r64, mask = _tile_rows(rows, n_rows, col_mask)
            x_next = tl.load(X + r64 * x_row_stride + gcols, mask=mask, other=0.0)
            z_next = tl.load(Z + r64 * z_row_stride + gcols, mask=mask, other=0.0)
            dy_next = tl.load(DY + r64 * dy_row_stride + gcols, mask=mask, other=0.0)
        else:
            cur_rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            cur_r64, cur_mask = _tile_rows(cur_rows, n_rows, col_mask)
            x = tl.load(X + cur_r64 * x_row_stride + gcols, mask=cur_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + cur_r64 * z_row_stride + gcols, mask=cur_mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + cur_r64 * dy_row_stride + gcols, mask=cur_mask, other=0.0).to(tl.float32)
        row_mask = cur_rows < n_rows
        a, s = _bwd_act(z, SIGMOID)
        h = x * a if GATE_FIRST else x
        # a row past the end has rstd 0 (not inf with EPS == 0): it adds nothing to dw
        rstd = tl.where(row_mask, tl.rsqrt(tl.sum(h * h, axis=1) * inv_n + EPS), 0.0)[:, None]
        n, g, t, da = _normed_grads(x, a, dy, w, rstd, GATE_FIRST, FP32_W, x_ty, w_ty)
        mean_gn = (tl.sum(g * n, axis=1) * inv_n)[:, None]
        dx, dz = _input_grads(x, z, a, s, n, g, rstd, mean_gn, da, GATE_FIRST, SIGMOID)
        if DW_TILE:
            dw_acc += t
        else:
            dw_acc += tl.sum(t, axis=0)
        tl.store(DX + cur_r64 * dx_row_stride + gcols, dx.to(DX.dtype.element_ty), mask=cur_mask)
        tl.store(DZ + cur_r64 * dx_row_stride + gcols, dz.to(DZ.dtype.element_ty), mask=cur_mask)
    if DW_TILE:
        dw_acc = tl.sum(dw_acc, axis=0)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * tl.num_programs(1) * group_size + group * group_size + cols, dw_acc,
             mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "group_size", "x_row_stride", "z_row_stride", "dy_row_stride"])
def _gated_rms_norm_bwd_stats_kernel(
    X, Z, W, DY,
    n_rows, group_size, x_row_stride, z_row_stride, dy_row_stride,
    STATS,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr,
    GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr, FP32_W: tl.constexpr,
):
    # Groups wider than a register block, step 1: rstd and mean(g * n) of program (row, group), in column
    # chunks (g needs rstd under Llama's rounding: two passes).
    group_size = 1 if ONE_COL else group_size // ROW_ALIGN * ROW_ALIGN
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * group_size
    x_row = X + row * (x_row_stride // ROW_ALIGN * ROW_ALIGN) + start
    z_row = Z + row * (z_row_stride // ROW_ALIGN * ROW_ALIGN) + start
    dy_row = DY + row * (dy_row_stride // ROW_ALIGN * ROW_ALIGN) + start
    inv_n = _inv(group_size)
    rstd = _group_rstd(x_row, z_row, group_size, EPS, BLOCK_N, GATE_FIRST, SIGMOID)
    sum_gn = tl.zeros([BLOCK_N], tl.float32)
    for c in range(0, group_size, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        mask = cols < group_size
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        a = _act(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), SIGMOID)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + start + cols, mask=mask, other=0.0).to(tl.float32)
        n, g, _, _ = _normed_grads(x, a, dy, w, rstd, GATE_FIRST, FP32_W, X.dtype.element_ty, W.dtype.element_ty)
        sum_gn += g * n
    stats = STATS + (row * tl.num_programs(1) + tl.program_id(1)) * 2
    tl.store(stats, rstd)
    tl.store(stats + 1, tl.sum(sum_gn, axis=0) * inv_n)


@triton.jit(do_not_specialize=["n_rows", "group_size", "x_row_stride", "z_row_stride", "dy_row_stride",
                               "dx_row_stride"])
def _gated_rms_norm_bwd_cols_kernel(
    X, Z, W, DY, STATS,
    n_rows, group_size, x_row_stride, z_row_stride, dy_row_stride, dx_row_stride,
    DX, DZ, DW_PARTIAL,
    ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GATE_FIRST: tl.constexpr, SIGMOID: tl.constexpr, FP32_W: tl.constexpr,
):
    # Step 2, split by columns: program (c, p, g) owns column block c of group g for row blocks p, p + P, ...,
    # so its dw slice stays in registers; x, z and dy are read a second time.
    group_size = 1 if ONE_COL else group_size // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    z_row_stride = z_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < group_size
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    group = tl.program_id(2)
    n_groups = tl.num_programs(2)
    gcols = (group * group_size + cols)[None, :]
    w = tl.load(W + gcols, mask=col_mask[None, :], other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    x_ty: tl.constexpr = X.dtype.element_ty
    w_ty: tl.constexpr = W.dtype.element_ty
    for tile in range(part, tl.cdiv(n_rows, BLOCK_M), n_parts):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        r64 = rows.to(tl.int64)
        stats = STATS + (r64 * n_groups + group) * 2
        rstd = tl.load(stats, mask=row_mask, other=0.0)[:, None]
        mean_gn = tl.load(stats + 1, mask=row_mask, other=0.0)[:, None]
        r64 = r64[:, None]
        x = tl.load(X + r64 * x_row_stride + gcols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + r64 * z_row_stride + gcols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * dy_row_stride + gcols, mask=mask, other=0.0).to(tl.float32)
        a, s = _bwd_act(z, SIGMOID)
        n, g, t, da = _normed_grads(x, a, dy, w, rstd, GATE_FIRST, FP32_W, x_ty, w_ty)
        dw_acc += tl.sum(t, axis=0)
        dx, dz = _input_grads(x, z, a, s, n, g, rstd, mean_gn, da, GATE_FIRST, SIGMOID)
        tl.store(DX + r64 * dx_row_stride + gcols, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DZ + r64 * dx_row_stride + gcols, dz.to(DZ.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + part.to(tl.int64) * n_groups * group_size + group * group_size + cols, dw_acc,
             mask=col_mask)
