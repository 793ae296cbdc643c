"""RMSNorm with Hugging Face Llama rounding: kernels and launch plans.

Forward:  y = w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype), output dtype = promote(x, w).
Backward, joint: dx and dw in one pass over x and dy (12289-16384 wide re-reads each row from L2; wider rows
take a statistics pass first); rstd is recomputed from x, never stored:
    n  = x * rstd                      (fp32)
    g  = (dy * w).to(x.dtype)          (eager rounds here: the backward of `.to(x.dtype)`)
    dx = rstd * (g - n * mean(g * n))  rounded once to x.dtype
    dw = sum_rows (dy * n.to(x.dtype)).to(dy.dtype), in fp32: one partial row per program, then summed
         over programs in a fixed order by `_dw_reduce_kernel` (deterministic, no atomics).

Variants (constexpr VARIANT, see _scale below; the plans' shapes do not depend on it): GEMMA
`y = (normed * (1 + w)).to(x.dtype)`, OLMO2 `y = (w * normed).to(x.dtype)`, NO_WEIGHT `y = normed.to(x.dtype)`,
with normed = x * rstd in fp32. Their backward: g = dy * (1 + w), dy * w, dy, in fp32 (not rounded); dw
terms: OLMO2 `(dy * n).to(w.dtype)`, GEMMA `dy * n` (fp32), NO_WEIGHT none (no partials, no reduction).

Rows are addressed as `X + row * row_stride + col`, row offsets in int64, so any input whose last dim is
contiguous and whose leading dims collapse to one stride is read in place.

One binary for both front ends: Triton's torch launcher would mark integer arguments divisible by 16, and
jax-triton 0.3.1 marks none (it passes floats as fp64, too). The two would compile different code (2-byte
instead of 16-byte accesses on the JAX side; other layouts, hence other FP32 sum orders). So the integer
arguments are not specialized (`do_not_specialize`); the plan states what it knows instead: ROW_ALIGN, the
power of two dividing the width and every row stride, applied as `n // ROW_ALIGN * ROW_ALIGN` so the
compiler sees it; and EPS is a compile-time constant (one binary per eps value, which a model fixes).
jax-triton also folds any integer argument equal to 1 into its binary; only n_cols enters the arithmetic
(a folded `mean * 1` lets the compiler fuse `x * x + EPS` into one FMA), so the plan states ONE_COL and
every binary folds a width of 1 alike.

Schedules: every kernel handles a BLOCK_M x BLOCK_N tile. Narrow rows (BLOCK_N <= 256, e.g. Qwen3's q/k
norms at 128) get many rows per tile; wide rows get BLOCK_M = 1 (the forward's `_rms_norm_fwd_row_kernel`;
the backward's `_rms_norm_bwd_row_kernel` from 12289 to 16384, which forms mean(g * n) as rstd * mean(g * x)).
Widths a power-of-two block fits badly are held as SPLIT blocks (a tuple, unrolled; `split_row`): the
forward's row kernel and `_rms_norm_bwd_split_kernel` (e.g. 5120 = 5 x 1024, 12288 = 3 x 4096).
Rows wider than the largest register block: the forward loops over column chunks (`_rms_norm_fwd_chunked_kernel`); the
backward computes the row statistics first (`_rms_norm_bwd_stats_kernel`), then splits the rows by columns
(`_rms_norm_bwd_cols_kernel`). Every width works.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import triton
import triton.language as tl

from xkern.launch import (
    FLOATS,
    ITEMSIZE,
    NUM_SMS,
    Buffer,
    Launch,
    Recipe,
    Step,
    cdiv,
    check_row_count,
    next_pow2,
    promote,
    row_align,
)


@triton.jit
def _inv(n_cols):
    # 1 / n_cols, once per program; means are sums times it (a division per row cost a fifth of the
    # narrow-row backward's speed on the H200).
    return tl.math.div_rn(1.0, n_cols * 1.0)


# Norm math variants (the constexpr VARIANT of every kernel): what multiplies `normed = x * rstd` (fp32) and
# where eager PyTorch rounds. LLAMA `w * normed.to(x.dtype)`; GEMMA `(normed * (1 + w.float())).to(x.dtype)`;
# OLMO2 `(w * normed).to(x.dtype)`; NO_WEIGHT `normed.to(x.dtype)` (W is not read, DW_PARTIAL not written).
LLAMA, GEMMA, OLMO2, NO_WEIGHT = 0, 1, 2, 3


@triton.jit
def _scale(w, VARIANT: tl.constexpr):
    # what multiplies normed outside LLAMA's rounding: GEMMA 1 + w, OLMO2 w, NO_WEIGHT 1
    if VARIANT == 1:  # GEMMA
        s = 1.0 + w
    elif VARIANT == 2:  # OLMO2
        s = w
    else:
        s = 1.0
    return s


@triton.jit
def _scaled(normed, w, X_TY: tl.constexpr, VARIANT: tl.constexpr):
    # y in fp32, before its one rounding to Y's dtype
    if VARIANT == 0:  # LLAMA
        y = w * normed.to(X_TY).to(tl.float32)
    else:
        y = normed * _scale(w, VARIANT)
    return y


@triton.jit
def _grad_normed(dy, w, X_TY: tl.constexpr, VARIANT: tl.constexpr):
    # g = dL/d(normed) in fp32, rounded where eager autograd rounds it: LLAMA's `dy * w` is formed in dy's
    # dtype and taken to x.dtype (the backward of `.to(x.dtype)`); the others stay fp32.
    if VARIANT == 0:  # LLAMA
        g = (dy * w).to(X_TY).to(tl.float32)
    else:
        g = dy * _scale(w, VARIANT)
    return g


@triton.jit
def _dw_terms(dy, n, X_TY: tl.constexpr, W_TY: tl.constexpr, DY_TY: tl.constexpr, VARIANT: tl.constexpr):
    # One row's terms of dw (summed over rows in fp32), rounded as eager rounds them: LLAMA `dy * n.to(x.dtype)`
    # in dy's dtype; OLMO2 `dy * n` taken to w's dtype (the backward of the promoted `w * n`); GEMMA none
    # (dw = sum(dy * n) in fp32, then to w's dtype).
    if VARIANT == 0:  # LLAMA
        t = (dy * n.to(X_TY).to(tl.float32)).to(DY_TY).to(tl.float32)
    elif VARIANT == 2:  # OLMO2
        t = (dy * n).to(W_TY).to(tl.float32)
    else:
        t = dy * n
    return t


# Fused residual add (`add_rms_norm`): every forward kernel below is one body (`_rms_norm_fwd_*`, inlined)
# behind two entry points, the plain one and `_add_rms_norm_fwd_*` (HAS_RESIDUAL: reads x and the residual,
# writes s = (x.f32 + r.f32) rounded once to RES_OUT's dtype, normalises s). Likewise the backward's with
# HAS_DRES (adds the gradient of residual_out to the norm's dx, rounded to DX's dtype first, as eager's
# autograd sums the two) and X_TY (the dtype the forward rounded `normed` to: x's, which is not the dtype of
# the saved residual_out with an FP32 residual stream). Separate entry points rather than pointer arguments
# that are None when off: jax-triton binds arrays by position, and the plain kernels keep their parameter
# lists, hence their binaries (compile_check --sass hashes unchanged).


# dtype codes of the fused backward's X_DTYPE (the dtype `normed` was rounded to): an int, not a tl.dtype, so
# that the launch's constexprs stay plain numbers for every launcher (Inductor writes them into its code)
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}


@triton.jit
def _residual_sum(x, r, RES_TY: tl.constexpr):
    # s = x + r as eager adds (fp32, one rounding to the residual stream's dtype)
    return (x + r.to(tl.float32)).to(RES_TY)


@triton.jit
def _rms_norm_fwd_tile(
    X, R, W,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride,
    Y, RES_OUT,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # alignment from the plan, visible to the compiler; a width of 1 folded in, as jax-triton folds it
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_row_stride = r_row_stride // ROW_ALIGN * ROW_ALIGN
        s = _residual_sum(x, tl.load(R + rows * r_row_stride + cols[None, :], mask=mask, other=0.0),
                          RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + rows * y_row_stride + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) * _inv(n_cols) + EPS)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = _scaled(x * rstd[:, None], w[None, :], X.dtype.element_ty, VARIANT)
    tl.store(Y + rows * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "y_row_stride"])
def _rms_norm_fwd_kernel(
    X, W,
    n_rows, n_cols, x_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_fwd_tile(X, X, W, n_rows, n_cols, x_row_stride, x_row_stride, y_row_stride, Y, Y,
                       EPS, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, VARIANT, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "r_row_stride", "y_row_stride"])
def _add_rms_norm_fwd_kernel(
    X, R, W,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride,
    Y, RES_OUT,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_fwd_tile(X, R, W, n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride, Y, RES_OUT,
                       EPS, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, VARIANT, True)


@triton.jit
def _rms_norm_fwd_row(
    X, R, W,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride,
    Y, RES_OUT,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    RELOAD: tl.constexpr, VARIANT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    # One row per program, in SPLIT blocks of BLOCK_N held as a tuple (unrolled): a width such as 5120 =
    # 5 x 1024 then fills every lane, where one power-of-two block of 8192 would leave 37.5 % of them masked
    # and their registers unused. RELOAD: read x a second time for the scaling, from L2 (the first read asks
    # L2 to keep it, the second to drop it; the different policies also keep the compiler from merging the
    # two loads) instead of holding the fp32 row across the reduction. Fewer registers, more rows in flight:
    # at 32768 wide, 32 registers and two programs per SM instead of 52 and one. With a residual, RELOAD
    # reads x and r again and adds them again: reading back residual_out, which other threads of this
    # program wrote, would race.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * x_row_stride
    y_row = Y + row * y_row_stride
    if HAS_RESIDUAL:
        r_row = R + row * (r_row_stride // ROW_ALIGN * ROW_ALIGN)
        res_row = RES_OUT + row * y_row_stride
    xs = ()
    sum_sq = tl.zeros([BLOCK_N], tl.float32)
    for i in tl.static_range(SPLIT):
        cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
        if RELOAD:
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            if RELOAD:
                r = tl.load(r_row + cols, mask=cols < n_cols, other=0.0, eviction_policy="evict_last")
            else:
                r = tl.load(r_row + cols, mask=cols < n_cols, other=0.0)
            s = _residual_sum(x, r, RES_OUT.dtype.element_ty)
            tl.store(res_row + cols, s, mask=cols < n_cols)
            x = s.to(tl.float32)
        sum_sq += x * x
        xs = xs + (x,)
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) * _inv(n_cols) + EPS)
    for i in tl.static_range(SPLIT):
        cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        if RELOAD:
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
                x = _residual_sum(x, r, RES_OUT.dtype.element_ty).to(tl.float32)
        else:
            x = xs[i]
        w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = _scaled(x * rstd, w, X.dtype.element_ty, VARIANT)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "y_row_stride"])
def _rms_norm_fwd_row_kernel(
    X, W,
    n_rows, n_cols, x_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    RELOAD: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_fwd_row(X, X, W, n_rows, n_cols, x_row_stride, x_row_stride, y_row_stride, Y, Y,
                      EPS, ROW_ALIGN, ONE_COL, BLOCK_N, SPLIT, RELOAD, VARIANT, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "r_row_stride", "y_row_stride"])
def _add_rms_norm_fwd_row_kernel(
    X, R, W,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride,
    Y, RES_OUT,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    RELOAD: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_fwd_row(X, R, W, n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride, Y, RES_OUT,
                      EPS, ROW_ALIGN, ONE_COL, BLOCK_N, SPLIT, RELOAD, VARIANT, True)


@triton.jit
def _rms_norm_fwd_chunked(
    X, R, W,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride,
    Y, RES_OUT,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    r_row_stride = r_row_stride // ROW_ALIGN * ROW_ALIGN
    # Rows too wide for registers: pass 1 sums x**2 in chunks, pass 2 re-reads the row from L2. Persistent
    # (grid-stride over rows) so that the rows in flight, hence pass 2's reads, fit in L2. Both passes issue
    # the next chunk's loads before this chunk's math (register double buffering: 0.64 -> 0.71 of the copy
    # ceiling at 1024x65536 on the H200, a width the row kernel now takes at 0.85). With a residual, pass 1
    # writes residual_out and pass 2 adds x and r again (residual_out, written by other threads, would race).
    inv_n = _inv(n_cols)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        x_row = X + row * x_row_stride
        y_row = Y + row * y_row_stride
        r_row = R + row * r_row_stride
        sum_sq = tl.zeros([BLOCK_N], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        x_next = tl.load(x_row + cols, mask=cols < n_cols, other=0.0)
        if HAS_RESIDUAL:
            r_next = tl.load(r_row + cols, mask=cols < n_cols, other=0.0)
        for chunk in range(1, n_chunks + 1):
            x = x_next.to(tl.float32)
            if HAS_RESIDUAL:
                s = _residual_sum(x, r_next, RES_OUT.dtype.element_ty)
                tl.store(RES_OUT + row * y_row_stride + cols, s, mask=cols < n_cols)
                x = s.to(tl.float32)
            cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
            x_next = tl.load(x_row + cols, mask=cols < n_cols, other=0.0)
            if HAS_RESIDUAL:
                r_next = tl.load(r_row + cols, mask=cols < n_cols, other=0.0)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) * inv_n + EPS)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x_next = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r_next = tl.load(r_row + cols, mask=mask, other=0.0)
        w_next = tl.load(W + cols, mask=mask, other=0.0)
        for chunk in range(1, n_chunks + 1):
            x = x_next.to(tl.float32)
            if HAS_RESIDUAL:
                x = _residual_sum(x, r_next, RES_OUT.dtype.element_ty).to(tl.float32)
            w = w_next.to(tl.float32)
            cur_cols, cur_mask = cols, mask
            cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x_next = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r_next = tl.load(r_row + cols, mask=mask, other=0.0)
            w_next = tl.load(W + cols, mask=mask, other=0.0)
            y = _scaled(x * rstd, w, X.dtype.element_ty, VARIANT)
            tl.store(y_row + cur_cols, y.to(Y.dtype.element_ty), mask=cur_mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "y_row_stride"])
def _rms_norm_fwd_chunked_kernel(
    X, W,
    n_rows, n_cols, x_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_fwd_chunked(X, X, W, n_rows, n_cols, x_row_stride, x_row_stride, y_row_stride, Y, Y,
                          EPS, ROW_ALIGN, ONE_COL, BLOCK_N, VARIANT, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "r_row_stride", "y_row_stride"])
def _add_rms_norm_fwd_chunked_kernel(
    X, R, W,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride,
    Y, RES_OUT,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_fwd_chunked(X, R, W, n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride, Y, RES_OUT,
                          EPS, ROW_ALIGN, ONE_COL, BLOCK_N, VARIANT, True)


@triton.jit
def _bwd_tile_start(n_cols, x_row_stride, dy_row_stride, dx_row_stride, ROW_ALIGN: tl.constexpr,
                    ONE_COL: tl.constexpr):
    # The tile kernels' common start: widths and strides at their alignment, this program's place in the
    # persistent grid and its batch (jax.vmap's per-example problems). No pointers in or out: torch's
    # wrap_triton access analysis counts a pointer passed through a call as written (then X and DY look
    # mutated under torch.compile).
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    return n_cols, x_row_stride, dy_row_stride, dx_row_stride, tl.program_id(0), tl.num_programs(0), \
        tl.program_id(1).to(tl.int64)


@triton.jit
def _with_dres(dx, dres, DX_TY: tl.constexpr):
    # d(residual_out) in total: the norm's dx rounded to residual_out's dtype (the norm's input's), plus the
    # gradient residual_out got directly; the sum rounded once by the caller's store
    return dx.to(DX_TY).to(tl.float32) + dres.to(tl.float32)


@triton.jit
def _rms_norm_bwd_tile(
    X, W, DY, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, VARIANT: tl.constexpr,
    X_TY: tl.constexpr, HAS_DRES: tl.constexpr,
):
    # Persistent: program p takes tiles p, p + P, ... and keeps its dw partial in registers. With PREFETCH
    # the next tile's loads are issued before this tile's math (register double buffering) to hide DRAM
    # latency; the widest rows have no registers for it.
    n_cols, x_row_stride, dy_row_stride, dx_row_stride, pid, num_programs, batch = _bwd_tile_start(
        n_cols, x_row_stride, dy_row_stride, dx_row_stride, ROW_ALIGN, ONE_COL)
    X += batch * n_rows * x_row_stride
    DY += batch * n_rows * dy_row_stride
    DX += batch * n_rows * dx_row_stride
    if HAS_DRES:
        dres_row_stride = dres_row_stride // ROW_ALIGN * ROW_ALIGN
        DRES += batch * n_rows * dres_row_stride
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    inv_n = _inv(n_cols)
    if PREFETCH:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x_next = tl.load(X + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
        dy_next = tl.load(DY + rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
        if HAS_DRES:
            dres_next = tl.load(DRES + rows.to(tl.int64)[:, None] * dres_row_stride + cols[None, :], mask=mask,
                                other=0.0)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), num_programs):
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            cur_rows, cur_mask = rows, mask
            rows = (tile + num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            x_next = tl.load(X + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
            dy_next = tl.load(DY + rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
            if HAS_DRES:
                dres = dres_next
                dres_next = tl.load(DRES + rows.to(tl.int64)[:, None] * dres_row_stride + cols[None, :], mask=mask,
                                    other=0.0)
        else:
            cur_rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            cur_mask = (cur_rows < n_rows)[:, None] & col_mask[None, :]
            x = tl.load(X + cur_rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=cur_mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(DY + cur_rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :], mask=cur_mask,
                         other=0.0).to(tl.float32)
        # A row past the end (x = 0) with EPS == 0 has rstd = inf, hence n = nan: zero its rstd (one select
        # per row, not per element) so that it adds 0 to dw.
        rstd = tl.where(cur_rows < n_rows, tl.rsqrt(tl.sum(x * x, axis=1) * inv_n + EPS), 0.0)[:, None]
        n = x * rstd
        g = _grad_normed(dy, w[None, :], X_TY, VARIANT)
        dw_acc += tl.sum(_dw_terms(dy, n, X_TY, W.dtype.element_ty, DY.dtype.element_ty, VARIANT), axis=0)
        mean_gn = (tl.sum(g * n, axis=1) * inv_n)[:, None]
        dx = rstd * (g - n * mean_gn)
        if HAS_DRES:
            if not PREFETCH:
                dres = tl.load(DRES + cur_rows.to(tl.int64)[:, None] * dres_row_stride + cols[None, :],
                               mask=cur_mask, other=0.0)
            dx = _with_dres(dx, dres, DX.dtype.element_ty)
        out = cur_rows.to(tl.int64)[:, None] * dx_row_stride + cols[None, :]
        tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=cur_mask)
    if VARIANT != 3:  # NO_WEIGHT: no dw
        tl.store(DW_PARTIAL + (batch * num_programs + pid) * n_cols + cols, dw_acc, mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dx_row_stride"])
def _rms_norm_bwd_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_bwd_tile(X, W, DY, DY, n_rows, n_cols, x_row_stride, dy_row_stride, dy_row_stride, dx_row_stride,
                       DX, DW_PARTIAL, EPS, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, PREFETCH, VARIANT,
                       X.dtype.element_ty, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dres_row_stride",
                               "dx_row_stride"])
def _add_rms_norm_bwd_kernel(
    X, W, DY, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, VARIANT: tl.constexpr,
    X_DTYPE: tl.constexpr, HAS_DRES: tl.constexpr,
):
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == 0 else (tl.bfloat16 if X_DTYPE == 1 else tl.float32)
    _rms_norm_bwd_tile(X, W, DY, DRES, n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride,
                       dx_row_stride, DX, DW_PARTIAL, EPS, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, PREFETCH, VARIANT,
                       x_ty, HAS_DRES)


@triton.jit
def _load_tile(ptr, rows, row_stride, n_rows, n_cols, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    # rows x (SPLIT blocks of BLOCK_N columns), as a tuple of SPLIT tiles in the input dtype
    out = ()
    for i in tl.static_range(SPLIT):
        cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        out = out + (tl.load(ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :], mask=mask, other=0.0),)
    return out


@triton.jit
def _rms_norm_bwd_split(
    X, W, DY, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, VARIANT: tl.constexpr,
    X_TY: tl.constexpr, HAS_DRES: tl.constexpr,
):
    # _rms_norm_bwd_kernel with each row in SPLIT blocks of BLOCK_N columns (tuples, unrolled), as in the
    # forward's row kernel: no lanes idle at widths such as 3 x 1024. A kernel of its own: with one block this
    # form compiles to a slower schedule for the many-row narrow tiles (bf16 128 wide: 111 -> 134 us per
    # backward on the H200), so powers of two keep the plain tile kernel.
    n_cols, x_row_stride, dy_row_stride, dx_row_stride, pid, num_programs, batch = _bwd_tile_start(
        n_cols, x_row_stride, dy_row_stride, dx_row_stride, ROW_ALIGN, ONE_COL)
    X += batch * n_rows * x_row_stride
    DY += batch * n_rows * dy_row_stride
    DX += batch * n_rows * dx_row_stride
    if HAS_DRES:
        dres_row_stride = dres_row_stride // ROW_ALIGN * ROW_ALIGN
        DRES += batch * n_rows * dres_row_stride
    ws = ()
    dw_acc = ()
    for i in tl.static_range(SPLIT):
        cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
        ws = ws + (tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :],)
        dw_acc = dw_acc + (tl.zeros([BLOCK_N], tl.float32),)
    inv_n = _inv(n_cols)
    if PREFETCH:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        x_next = _load_tile(X, rows, x_row_stride, n_rows, n_cols, BLOCK_N, SPLIT)
        dy_next = _load_tile(DY, rows, dy_row_stride, n_rows, n_cols, BLOCK_N, SPLIT)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), num_programs):
        if PREFETCH:
            xs, dys, cur_rows = x_next, dy_next, rows
            rows = (tile + num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
            x_next = _load_tile(X, rows, x_row_stride, n_rows, n_cols, BLOCK_N, SPLIT)
            dy_next = _load_tile(DY, rows, dy_row_stride, n_rows, n_cols, BLOCK_N, SPLIT)
        else:
            cur_rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            xs = _load_tile(X, cur_rows, x_row_stride, n_rows, n_cols, BLOCK_N, SPLIT)
            dys = _load_tile(DY, cur_rows, dy_row_stride, n_rows, n_cols, BLOCK_N, SPLIT)
        sum_sq = tl.zeros([BLOCK_M], tl.float32)
        for i in tl.static_range(SPLIT):
            x = xs[i].to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        # A row past the end (x = 0) with EPS == 0 has rstd = inf, hence n = nan: zero its rstd (one select
        # per row, not per element) so that it adds 0 to dw.
        rstd = tl.where(cur_rows < n_rows, tl.rsqrt(sum_sq * inv_n + EPS), 0.0)[:, None]
        sum_gn = tl.zeros([BLOCK_M], tl.float32)
        new_dw = ()
        for i in tl.static_range(SPLIT):
            dy = dys[i].to(tl.float32)
            n = xs[i].to(tl.float32) * rstd
            g = _grad_normed(dy, ws[i], X_TY, VARIANT)
            sum_gn += tl.sum(g * n, axis=1)
            terms = _dw_terms(dy, n, X_TY, W.dtype.element_ty, DY.dtype.element_ty, VARIANT)
            new_dw = new_dw + (dw_acc[i] + tl.sum(terms, axis=0),)
        dw_acc = new_dw
        mean_gn = (sum_gn * inv_n)[:, None]
        for i in tl.static_range(SPLIT):
            cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (cur_rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            n = xs[i].to(tl.float32) * rstd
            g = _grad_normed(dys[i].to(tl.float32), ws[i], X_TY, VARIANT)
            dx = rstd * (g - n * mean_gn)
            if HAS_DRES:
                dres = tl.load(DRES + cur_rows.to(tl.int64)[:, None] * dres_row_stride + cols[None, :], mask=mask,
                               other=0.0)
                dx = _with_dres(dx, dres, DX.dtype.element_ty)
            out = cur_rows.to(tl.int64)[:, None] * dx_row_stride + cols[None, :]
            tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=mask)
    if VARIANT != 3:  # NO_WEIGHT: no dw
        for i in tl.static_range(SPLIT):
            cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(DW_PARTIAL + (batch * num_programs + pid) * n_cols + cols, dw_acc[i], mask=cols < n_cols)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dx_row_stride"])
def _rms_norm_bwd_split_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_bwd_split(X, W, DY, DY, n_rows, n_cols, x_row_stride, dy_row_stride, dy_row_stride, dx_row_stride,
                        DX, DW_PARTIAL, EPS, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, SPLIT, PREFETCH, VARIANT,
                        X.dtype.element_ty, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dres_row_stride",
                               "dx_row_stride"])
def _add_rms_norm_bwd_split_kernel(
    X, W, DY, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, VARIANT: tl.constexpr,
    X_DTYPE: tl.constexpr, HAS_DRES: tl.constexpr,
):
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == 0 else (tl.bfloat16 if X_DTYPE == 1 else tl.float32)
    _rms_norm_bwd_split(X, W, DY, DRES, n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride,
                        dx_row_stride, DX, DW_PARTIAL, EPS, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, SPLIT, PREFETCH,
                        VARIANT, x_ty, HAS_DRES)


@triton.jit
def _row_block(X, DY, W, w_held, row, x_row_stride, dy_row_stride, cols, n_cols, HOLD_W: tl.constexpr,
               EVICT: tl.constexpr, VARIANT: tl.constexpr, X_TY: tl.constexpr):
    # Columns `cols` of a row of x and dy in fp32, and g = dL/d(normed); w held by the caller or re-read
    # (asked to stay in L2)
    mask = cols < n_cols
    x_ptrs, dy_ptrs = X + row * x_row_stride + cols, DY + row * dy_row_stride + cols
    x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    w = w_held if HOLD_W else tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return x, dy, _grad_normed(dy, w, X_TY, VARIANT)


@triton.jit
def _rms_norm_bwd_row(
    X, W, DY, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HOLD_W: tl.constexpr, VARIANT: tl.constexpr, X_TY: tl.constexpr, HAS_DRES: tl.constexpr,
):
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    # Persistent over rows, one row at a time in SPLIT blocks of BLOCK_N (a tuple, unrolled), read twice (as
    # the forward's RELOAD): both row sums from the first read (mean(g * n) = rstd * mean(g * x), g = (dy * w)
    # rounded needing no rstd; evict_last keeps the row in L2), dx and dw from the second (evict_first). Only
    # w and the dw partial stay in registers across rows (w not even that without HOLD_W: re-read from
    # L1/L2), so more programs fit per SM than with the tile kernels' held rows. A 1-D block: fewer
    # registers than a 1-row tile. The residual_out gradient (HAS_DRES) is read once, in the second pass.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    # The batch enters the row index: offsetting the base pointers instead compiles to a schedule with
    # fewer loads in flight (101 registers instead of 127; 0.58 instead of 0.73 of the copy at 16384).
    batch = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    ws = ()
    dw_acc = ()
    for i in tl.static_range(SPLIT):
        cols = offs + i * BLOCK_N
        if HOLD_W:
            ws = ws + (tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32),)
        dw_acc = dw_acc + (tl.zeros([BLOCK_N], tl.float32),)
    inv_n = _inv(n_cols)
    for row in range(pid, n_rows, num_programs):
        row = tl.cast(row, tl.int64) + batch * n_rows
        for i in tl.static_range(SPLIT):
            x, dy, g = _row_block(X, DY, W, ws[i] if HOLD_W else None, row, x_row_stride, dy_row_stride,
                                  offs + i * BLOCK_N, n_cols, HOLD_W, "evict_last", VARIANT, X_TY)
            if i == 0:
                sum_sq = x * x
            else:
                sum_sq += x * x
            if i == SPLIT - 1:  # (this order keeps SPLIT = 1 the binary measured before SPLIT existed)
                rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) * inv_n + EPS)
            if i == 0:
                sum_gx = g * x
            else:
                sum_gx += g * x
        mean_gn = tl.sum(sum_gx, axis=0) * rstd * inv_n
        new_dw = ()
        for i in tl.static_range(SPLIT):
            cols = offs + i * BLOCK_N
            x, dy, g = _row_block(X, DY, W, ws[i] if HOLD_W else None, row, x_row_stride, dy_row_stride, cols,
                                  n_cols, HOLD_W, "evict_first", VARIANT, X_TY)
            n = x * rstd
            new_dw = new_dw + (dw_acc[i] + _dw_terms(dy, n, X_TY, W.dtype.element_ty,
                                                     DY.dtype.element_ty, VARIANT),)
            dx = rstd * (g - n * mean_gn)
            if HAS_DRES:
                dres = tl.load(DRES + row * (dres_row_stride // ROW_ALIGN * ROW_ALIGN) + cols, mask=cols < n_cols,
                               other=0.0, eviction_policy="evict_first")
                dx = _with_dres(dx, dres, DX.dtype.element_ty)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=cols < n_cols)
        dw_acc = new_dw
    if VARIANT != 3:  # NO_WEIGHT: no dw
        for i in tl.static_range(SPLIT):
            cols = offs + i * BLOCK_N
            tl.store(DW_PARTIAL + (batch * num_programs + pid) * n_cols + cols, dw_acc[i], mask=cols < n_cols)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dx_row_stride"])
def _rms_norm_bwd_row_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HOLD_W: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_bwd_row(X, W, DY, DY, n_rows, n_cols, x_row_stride, dy_row_stride, dy_row_stride, dx_row_stride,
                      DX, DW_PARTIAL, EPS, ROW_ALIGN, ONE_COL, BLOCK_N, SPLIT, HOLD_W, VARIANT,
                      X.dtype.element_ty, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dres_row_stride",
                               "dx_row_stride"])
def _add_rms_norm_bwd_row_kernel(
    X, W, DY, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HOLD_W: tl.constexpr, VARIANT: tl.constexpr, X_DTYPE: tl.constexpr, HAS_DRES: tl.constexpr,
):
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == 0 else (tl.bfloat16 if X_DTYPE == 1 else tl.float32)
    _rms_norm_bwd_row(X, W, DY, DRES, n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
                      DX, DW_PARTIAL, EPS, ROW_ALIGN, ONE_COL, BLOCK_N, SPLIT, HOLD_W, VARIANT, x_ty, HAS_DRES)


@triton.jit
def _rms_norm_bwd_stats(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride,
    STATS,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
    X_TY: tl.constexpr,
):
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    # Rows too wide for registers, step 1: rstd and mean(g * n) of each row, in column chunks.
    row = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    x_row = X + (batch * n_rows + row) * x_row_stride
    dy_row = DY + (batch * n_rows + row) * dy_row_stride
    sum_sq = tl.zeros([BLOCK_N], tl.float32)
    sum_gx = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        sum_sq += x * x
        sum_gx += _grad_normed(dy, w, X_TY, VARIANT) * x
    inv_n = _inv(n_cols)
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) * inv_n + EPS)
    stats = STATS + (batch * n_rows + row) * 2
    tl.store(stats, rstd)
    tl.store(stats + 1, tl.sum(sum_gx, axis=0) * rstd * inv_n)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride"])
def _rms_norm_bwd_stats_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride,
    STATS,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
):
    _rms_norm_bwd_stats(X, W, DY, n_rows, n_cols, x_row_stride, dy_row_stride, STATS, EPS, ROW_ALIGN, ONE_COL,
                        BLOCK_N, VARIANT, X.dtype.element_ty)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride"])
def _add_rms_norm_bwd_stats_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride,
    STATS,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_N: tl.constexpr, VARIANT: tl.constexpr,
    X_DTYPE: tl.constexpr,
):
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == 0 else (tl.bfloat16 if X_DTYPE == 1 else tl.float32)
    # the residual_out gradient enters dx only (the cols kernel): the statistics are the norm's, with
    # `normed` rounded to x's dtype (X_TY) where X holds residual_out
    _rms_norm_bwd_stats(X, W, DY, n_rows, n_cols, x_row_stride, dy_row_stride, STATS, EPS, ROW_ALIGN, ONE_COL,
                        BLOCK_N, VARIANT, x_ty)


@triton.jit
def _rms_norm_bwd_cols(
    X, W, DY, STATS, DRES,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr, X_TY: tl.constexpr, HAS_DRES: tl.constexpr,
):
    n_cols = 1 if ONE_COL else n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    # Step 2, split by columns: program (c, g) owns column block c of row tiles g, g + G, ... so its dw
    # partial stays in registers; x and dy are read a second time (10 bytes per element instead of 6).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    batch = tl.program_id(2).to(tl.int64)
    X += batch * n_rows * x_row_stride
    DY += batch * n_rows * dy_row_stride
    DX += batch * n_rows * dx_row_stride
    STATS += batch * n_rows * 2
    if HAS_DRES:
        dres_row_stride = dres_row_stride // ROW_ALIGN * ROW_ALIGN
        DRES += batch * n_rows * dres_row_stride
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    for tile in range(group, tl.cdiv(n_rows, BLOCK_M), n_groups):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        rstd = tl.load(STATS + rows * 2, mask=row_mask, other=0.0)[:, None]
        mean_gn = tl.load(STATS + rows * 2 + 1, mask=row_mask, other=0.0)[:, None]
        x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        n = x * rstd
        g = _grad_normed(dy, w[None, :], X_TY, VARIANT)
        dx = rstd * (g - n * mean_gn)
        if HAS_DRES:
            dres = tl.load(DRES + rows[:, None] * dres_row_stride + cols[None, :], mask=mask, other=0.0)
            dx = _with_dres(dx, dres, DX.dtype.element_ty)
        tl.store(DX + rows[:, None] * dx_row_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(_dw_terms(dy, n, X_TY, W.dtype.element_ty, DY.dtype.element_ty, VARIANT),
                         axis=0)
    if VARIANT != 3:  # NO_WEIGHT: no dw
        tl.store(DW_PARTIAL + ((batch * n_groups + group) * n_cols + cols), dw_acc, mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dx_row_stride"])
def _rms_norm_bwd_cols_kernel(
    X, W, DY, STATS,
    n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr,
):
    _rms_norm_bwd_cols(X, W, DY, STATS, DY, n_rows, n_cols, x_row_stride, dy_row_stride, dy_row_stride,
                       dx_row_stride, DX, DW_PARTIAL, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, VARIANT,
                       X.dtype.element_ty, False)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dres_row_stride",
                               "dx_row_stride"])
def _add_rms_norm_bwd_cols_kernel(
    X, W, DY, DRES, STATS,
    n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    ROW_ALIGN: tl.constexpr, ONE_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARIANT: tl.constexpr, X_DTYPE: tl.constexpr, HAS_DRES: tl.constexpr,
):
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == 0 else (tl.bfloat16 if X_DTYPE == 1 else tl.float32)
    _rms_norm_bwd_cols(X, W, DY, STATS, DRES, n_rows, n_cols, x_row_stride, dy_row_stride, dres_row_stride,
                       dx_row_stride, DX, DW_PARTIAL, ROW_ALIGN, ONE_COL, BLOCK_M, BLOCK_N, VARIANT, x_ty, HAS_DRES)


@triton.jit(do_not_specialize=["n_partials", "n_cols"])
def _dw_reduce_kernel(
    DW_PARTIAL,
    n_partials, n_cols,
    DW,
    ROW_ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    # Fixed summation order over the partial rows: the same bits on every run and front end.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    batch = tl.program_id(1).to(tl.int64)
    DW_PARTIAL += batch * n_partials * n_cols
    DW += batch * n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(DW_PARTIAL + parts.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


# ---------------------------------------------------------------------------------------------------
# Launch plans. Fixed offline from benchmarks/ (no runtime autotuning: it would break determinism and
# torch/JAX parity). Inputs are shapes and the element size only.

MAX_FWD_BLOCK = 65536  # widest row the forward's row kernel takes (32 warps x 64 elements per thread); half
                       # that for 4-byte x, w or y (at 65536 those spill)
MAX_BWD_BLOCK = 16384  # widest row the backward takes in one block (wider: statistics, then a column split)
CHUNK = 16384          # column chunk of the chunked forward (two in flight per program)
FWD_CHUNKED_PROGRAMS = NUM_SMS  # persistent: the rows in flight (and pass 2's re-reads) fit in L2
COLS_STATS_CHUNK = 8192  # column chunk of the backward's row statistics pass
# Column-split backward tile: (BLOCK_M, BLOCK_N, num_warps, programs)
_BWD_COLS_TILE = (4, 1024, 4, 4 * NUM_SMS)
FWD_TILE_BELOW = 768     # the forward takes rows narrower than this in tiles of several rows
FWD_TILE_ELEMS = 2048    # a forward tile's elements (BLOCK_M x BLOCK_N) from 128 wide, 2 warps
# Row-kernel widths that read x twice (RELOAD): faster there on the H200; at 16384 and up to 2048 holding
# the row is as fast (numbers: docs/benchmarks.md, entry 7).
_FWD_RELOAD = {4096, 8192, 32768, 65536}
REDUCE_BLOCK_N, REDUCE_BLOCK_P = 16, 512

# Backward tiles of narrow rows by BLOCK_N: (BLOCK_M, num_warps, programs per SM, PREFETCH): many rows per
# tile. Up to 64 and at 256, one-warp tiles of 1024 elements, 16 per SM (the most that fit at once: 20 or 24
# per SM time 1.2x slower, a partial second wave); at 128, 2-warp tiles of 4096, 4 per SM (one-warp tiles
# there were no faster). From 512: one row per tile, 8192 elements per SM, 8 elements per thread up to
# 8 warps (16 per thread beyond), prefetching (rule: `_bwd_tile`; sweeps: docs/benchmarks.md, entries 10, 18).
_BWD_NARROW_TILES = {64: (16, 1, 16, True), 128: (32, 2, 4, True), 256: (4, 1, 16, True)}
# Row backward (rows read twice): the BLOCK_N it takes, one 16-warp program per SM. Only there is it the
# fastest: narrower, the prefetching tile wins; at 32768 it spills (docs/benchmarks.md, entry 8).
BWD_ROW_BLOCK = 16384
BWD_SPLIT_MAX = 3 * 4096  # 8193-12288: three blocks of 4096 instead (plan_rms_norm_bwd)


def _bwd_tile(block_n: int) -> tuple[int, int, int, bool]:
    if block_n <= 256:
        return _BWD_NARROW_TILES[max(block_n, 64)]
    num_warps = min(8, block_n // 256) if block_n <= 4096 else block_n // 512
    return 1, num_warps, max(1, 8192 // block_n), True


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


VARIANTS = {"llama": LLAMA, "gemma": GEMMA, "olmo2": OLMO2}  # the front ends' `variant=` names


def check_variant(variant, has_weight: bool) -> str:
    """The kernel variant of a call: `variant` ("llama", "gemma" or "olmo2"), or "none" without a weight
    (every variant then computes `normed.to(x.dtype)`). Raises TypeError/ValueError naming `variant`."""
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a str, one of {sorted(VARIANTS)}, got {type(variant).__name__}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    return variant if has_weight else "none"


def out_dtype_name(x_dtype: str, w_dtype: str | None, variant: str) -> str:
    """Output dtype (a name: "bfloat16", ...) of `variant` from check_variant: x's, except LLAMA with a weight
    of another dtype (float32), where eager promotion makes it float32."""
    return "float32" if variant == "llama" and w_dtype != x_dtype else x_dtype


def _variant_code(variant: str) -> int:
    return NO_WEIGHT if variant == "none" else VARIANTS[variant]


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
        return Launch(_rms_norm_fwd_chunked_kernel, (min(n_rows, FWD_CHUNKED_PROGRAMS),), 32,
                      {**fixed, "BLOCK_N": CHUNK})
    block_n = next_pow2(n_cols)
    if n_cols >= FWD_TILE_BELOW:
        # A row per program. Other widths: SPLIT blocks of up to 4096 (split_row), 8 elements per thread per
        # block, at most 40 in all (more spill; the power-of-two block then, as at 24576). Three blocks read x
        # twice (0.4-3 % faster at 1536-12288); at four or more the second pass was level or slower
        # (docs/benchmarks.md, entry 19).
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
    "none": w is not read (pass any pointer, x say), no partials are written and there is no `reduce`."""

    stats: Launch | None
    bwd: Launch
    reduce: Launch | None  # None for variant "none" (no weight, no dw; DW_PARTIAL is not written)
    n_partials: int


def plan_rms_norm_bwd(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                      n_batch: int = 1, variant: str = "llama") -> BwdPlan:
    """The joint backward and the dw reduction for `n_batch` independent problems of `n_rows` rows each
    (n_batch > 1 only under jax.vmap: per-example dw). `row_strides`: the x, dy and dx row strides
    (default: contiguous); `variant` from check_variant (the math only, as in the forward)."""
    check_row_count("x", n_rows)  # the tile kernels number rows (and the next tile's) in int32
    check_row_count("x", n_cols, "columns")  # and the column-split kernels columns
    block_n = next_pow2(n_cols)
    fixed = {"ROW_ALIGN": row_align(n_cols, *row_strides), "ONE_COL": n_cols == 1, "VARIANT": _variant_code(variant)}
    stats = None
    if n_cols > MAX_BWD_BLOCK:
        stats = Launch(_rms_norm_bwd_stats_kernel, (n_rows, n_batch), 8,
                       {**fixed, "EPS": float(eps), "BLOCK_N": COLS_STATS_CHUNK})
        block_m, block_n, num_warps, programs = _BWD_COLS_TILE
        col_blocks = cdiv(n_cols, block_n)
        groups = max(2, min(cdiv(n_rows, block_m), programs // col_blocks))
        bwd = Launch(_rms_norm_bwd_cols_kernel, (col_blocks, groups, n_batch), num_warps,
                     {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n})
    elif n_cols > BWD_SPLIT_MAX:  # up to BWD_ROW_BLOCK
        groups = max(2, min(n_rows, NUM_SMS))
        bwd = Launch(_rms_norm_bwd_row_kernel, (groups, n_batch), 16,
                     {**fixed, "EPS": float(eps), "BLOCK_N": block_n, "SPLIT": 1, "HOLD_W": True})
    else:
        block_m, num_warps, programs_per_sm, prefetch = _bwd_tile(block_n)
        split = 1
        # Widths a power-of-two block would leave more than 1/8 masked, in SPLIT blocks where that measured
        # faster (docs/benchmarks.md, entry 13): 65-111 (80 = 5 x 16, 96 = 3 x 32; split_row, up to 5) in
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
        block_m = max(1, min(block_m, next_pow2(n_rows)))
        groups = max(2, min(cdiv(n_rows, block_m), NUM_SMS * programs_per_sm))
        tile = {**fixed, "EPS": float(eps), "BLOCK_M": block_m, "BLOCK_N": block_n, "PREFETCH": prefetch}
        bwd = (Launch(_rms_norm_bwd_split_kernel, (groups, n_batch), num_warps, {**tile, "SPLIT": split}) if split > 1
               else Launch(_rms_norm_bwd_kernel, (groups, n_batch), num_warps, tile))
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


# ---------------------------------------------------------------------------------------------------
# The op's contract, shared by both front ends: argument rules, then the launch recipes.


def check_rms_norm(x_dtype: str, x_shape: tuple[int, ...], w_dtype: str | None, w_shape: tuple[int, ...] | None,
                   eps, variant="llama") -> tuple[str, str]:
    """Validate an `rms_norm(x, weight, eps, variant=)` call from dtype names and shapes (w None: no weight);
    returns the output dtype (`out_dtype_name`) and the kernel variant (`check_variant`)."""
    variant = check_variant(variant, w_dtype is not None)
    if x_dtype not in FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x_dtype}")
    if w_dtype is not None and w_dtype not in FLOATS:
        raise TypeError(f"weight must be float16, bfloat16 or float32, got {w_dtype}")
    if len(x_shape) == 0:
        raise ValueError("x must have at least one dimension [..., N], got a scalar")
    if w_shape is not None and tuple(w_shape) != (x_shape[-1],):
        raise ValueError(f"weight must have shape [{x_shape[-1]}] (x's last dim), got {list(w_shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not 0 <= eps < math.inf:
        raise ValueError(f"eps must be >= 0 and finite, got {eps}")
    return out_dtype_name(x_dtype, w_dtype, variant), variant


@functools.lru_cache(maxsize=4096, typed=True)
def rms_norm_fwd_recipe(n_rows: int, n_cols: int, eps: float, x_dtype: str, w_dtype: str | None,
                        x_row_stride: int | None = None, variant: str = "llama") -> Recipe:
    """Inputs x [n_rows, n_cols] (rows `x_row_stride` apart, default contiguous) and w [n_cols]
    (contiguous; w_dtype None: no weight, variant "none", x is bound in its place and never read as w);
    result y [n_rows, n_cols] contiguous."""
    y_dtype = out_dtype_name(x_dtype, w_dtype, variant)
    y = Buffer("y", (n_rows, n_cols), y_dtype)
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (y,)),), ("y",))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    itemsize = max(ITEMSIZE[d] for d in (x_dtype, w_dtype or x_dtype, y_dtype))
    plan = plan_rms_norm_fwd(n_rows, n_cols, eps, (x_row_stride, n_cols), itemsize, variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=x_row_stride, y_row_stride=n_cols)
    return Recipe((Step(plan, ("x", "x" if w_dtype is None else "w"), (y,), scalars),), ("y",))


@functools.lru_cache(maxsize=4096, typed=True)
def rms_norm_bwd_recipe(n_rows: int, n_cols: int, eps: float, x_dtype: str, w_dtype: str | None,
                        x_row_stride: int | None = None, dy_row_stride: int | None = None,
                        n_batch: int = 1, dw_dtype: str | None = None, variant: str = "llama") -> Recipe:
    """Inputs x and dy [n_batch * n_rows, n_cols] (rows `*_row_stride` apart, default contiguous; dy of the
    forward's output dtype) and w [n_cols] (w_dtype None: no weight, as in the forward); results dx
    [n_batch * n_rows, n_cols] contiguous and dw [n_batch, n_cols] (one per problem: n_batch > 1 only under
    jax.vmap) in `dw_dtype` (default w's; float32 where shards' dw are summed before one rounding). Without
    a weight dw is [n_batch, 0]."""
    dw_dtype = dw_dtype or w_dtype or x_dtype
    dx = Buffer("dx", (n_batch * n_rows, n_cols), x_dtype)
    dw_cols = 0 if w_dtype is None else n_cols
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (dx, Buffer("dw", (n_batch, dw_cols), dw_dtype, fill=0))),), ("dx", "dw"))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    dy_row_stride = n_cols if dy_row_stride is None else dy_row_stride
    plan = plan_rms_norm_bwd(n_rows, n_cols, eps, (x_row_stride, dy_row_stride, n_cols), n_batch, variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=x_row_stride, dy_row_stride=dy_row_stride,
                   dx_row_stride=n_cols)
    return _bwd_recipe(plan, plan.stats, plan.bwd, ("x", "x" if w_dtype is None else "w", "dy"), (), dx, scalars,
                       n_batch, n_rows, n_cols, dw_dtype)


def _bwd_recipe(plan: BwdPlan, stats: Launch | None, bwd: Launch, inputs: tuple[str, ...], extra: tuple[str, ...],
                dx: Buffer, scalars: dict, n_batch: int, n_rows: int, n_cols: int, dw_dtype: str) -> Recipe:
    """The backward's steps: [stats on `inputs`,] `bwd` on `inputs + extra` [+ stats], the dw reduction."""
    steps = []
    if stats is not None:
        steps.append(Step(stats, inputs, (Buffer("stats", (n_batch * n_rows, 2), "float32"),), scalars))
    inputs = inputs + extra + (("stats",) if stats is not None else ())
    if plan.reduce is None:  # no weight: the kernel writes no dw partials
        steps.append(Step(bwd, inputs, (dx, Buffer("partial", (1,), "float32")), scalars))
        steps.append(Step(None, (), (Buffer("dw", (n_batch, 0), dw_dtype),)))
        return Recipe(tuple(steps), ("dx", "dw"))
    partial = Buffer("partial", (n_batch * plan.n_partials, n_cols), "float32")
    steps.append(Step(bwd, inputs, (dx, partial), scalars))
    steps.append(Step(plan.reduce, ("partial",), (Buffer("dw", (n_batch, n_cols), dw_dtype),),
                      dict(n_partials=plan.n_partials, n_cols=n_cols)))
    return Recipe(tuple(steps), ("dx", "dw"))


# ---------------------------------------------------------------------------------------------------
# Fused residual add + RMSNorm (`add_rms_norm`): the same plans, launched through the fused entry points.
#   residual_out = (x.f32 + residual.f32) rounded once to residual_dtype (default promote(x, residual));
#   y = rms_norm(residual_out, w, eps, variant) with `normed` rounded to x's dtype (not residual_out's) and
#       y in out_dtype_name(x, w): with equal dtypes bit for bit rms_norm(x + residual), the eager layer.
# Backward (eager autograd's rounding points): the norm's dx, rounded to residual_out's dtype, plus the
# gradient of residual_out (if any), rounded once to residual_out's dtype: d(sum). The front ends return it
# as dx and dresidual, each converted to its input's dtype (no conversion, one buffer, when they match).

_FUSED = {
    _rms_norm_fwd_kernel: _add_rms_norm_fwd_kernel,
    _rms_norm_fwd_row_kernel: _add_rms_norm_fwd_row_kernel,
    _rms_norm_fwd_chunked_kernel: _add_rms_norm_fwd_chunked_kernel,
    _rms_norm_bwd_kernel: _add_rms_norm_bwd_kernel,
    _rms_norm_bwd_split_kernel: _add_rms_norm_bwd_split_kernel,
    _rms_norm_bwd_row_kernel: _add_rms_norm_bwd_row_kernel,
    _rms_norm_bwd_stats_kernel: _add_rms_norm_bwd_stats_kernel,
    _rms_norm_bwd_cols_kernel: _add_rms_norm_bwd_cols_kernel,
}


def _fused(launch: Launch, **constexprs) -> Launch:
    """`launch` (a plan's) through the fused entry point of its kernel body: same grid, warps, constexprs."""
    return dataclasses.replace(launch, kernel=_FUSED[launch.kernel], constexprs={**launch.constexprs, **constexprs})


def check_add_rms_norm(x_dtype: str, x_shape: tuple[int, ...], r_dtype: str, r_shape: tuple[int, ...],
                       w_dtype: str | None, w_shape: tuple[int, ...] | None, eps, variant="llama",
                       residual_dtype: str | None = None) -> tuple[str, str, str]:
    """Validate an `add_rms_norm(x, residual, weight, eps, variant=, residual_dtype=)` call from dtype names and
    shapes; returns y's dtype, residual_out's dtype and the kernel variant."""
    y_dtype, variant = check_rms_norm(x_dtype, x_shape, w_dtype, w_shape, eps, variant)
    if r_dtype not in FLOATS:
        raise TypeError(f"residual must be float16, bfloat16 or float32, got {r_dtype}")
    if tuple(r_shape) != tuple(x_shape):
        raise ValueError(f"residual must have x's shape {list(x_shape)}, got {list(r_shape)}")
    if residual_dtype is None:
        residual_dtype = promote(x_dtype, r_dtype)
    elif residual_dtype not in FLOATS:
        raise TypeError(f"residual_dtype must be float16, bfloat16 or float32, got {residual_dtype}")
    return y_dtype, residual_dtype, variant


@functools.lru_cache(maxsize=4096, typed=True)
def add_rms_norm_fwd_recipe(n_rows: int, n_cols: int, eps: float, x_dtype: str, r_dtype: str, w_dtype: str | None,
                            res_dtype: str, x_row_stride: int | None = None, r_row_stride: int | None = None,
                            variant: str = "llama") -> Recipe:
    """Inputs x and r (the residual) [n_rows, n_cols] (rows `*_row_stride` apart, default contiguous) and w
    [n_cols] (w_dtype None: no weight, x bound in its place); results y [n_rows, n_cols] (out_dtype_name) and
    residual_out [n_rows, n_cols] in `res_dtype`, both contiguous. The plan is rms_norm's, with the bytes of
    the residual and residual_out in its element size."""
    y = Buffer("y", (n_rows, n_cols), out_dtype_name(x_dtype, w_dtype, variant))
    res = Buffer("residual_out", (n_rows, n_cols), res_dtype)
    if n_rows * n_cols == 0:
        return Recipe((Step(None, (), (y, res)),), ("y", "residual_out"))
    x_row_stride = n_cols if x_row_stride is None else x_row_stride
    r_row_stride = n_cols if r_row_stride is None else r_row_stride
    itemsize = max(ITEMSIZE[d] for d in (x_dtype, r_dtype, w_dtype or x_dtype, y.dtype, res_dtype))
    plan = plan_rms_norm_fwd(n_rows, n_cols, eps, (x_row_stride, r_row_stride, n_cols), itemsize, variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=x_row_stride, r_row_stride=r_row_stride,
                   y_row_stride=n_cols)
    return Recipe((Step(_fused(plan), ("x", "r", "x" if w_dtype is None else "w"), (y, res), scalars),),
                  ("y", "residual_out"))


@functools.lru_cache(maxsize=4096, typed=True)
def add_rms_norm_bwd_recipe(n_rows: int, n_cols: int, eps: float, x_dtype: str, w_dtype: str | None,
                            res_dtype: str, has_dres: bool, res_row_stride: int | None = None,
                            dy_row_stride: int | None = None, dres_row_stride: int | None = None,
                            n_batch: int = 1, dw_dtype: str | None = None, variant: str = "llama") -> Recipe:
    """The backward of add_rms_norm. Inputs "x": residual_out (the norm's input, saved by the forward, in
    `res_dtype`), "w", "dy" (y's dtype) and, with `has_dres`, "dres" (residual_out's gradient, res_dtype), all
    as in rms_norm_bwd_recipe; `x_dtype` is the forward's x's. Results "dx": d(sum) [n_batch * n_rows,
    n_cols] in res_dtype, and "dw". Without dres and with x in residual_out's dtype this is
    rms_norm_bwd_recipe itself (the same launches)."""
    if not has_dres and x_dtype == res_dtype:
        return rms_norm_bwd_recipe(n_rows, n_cols, eps, res_dtype, w_dtype, res_row_stride, dy_row_stride, n_batch,
                                   dw_dtype, variant)
    dw_dtype = dw_dtype or w_dtype or res_dtype
    dx = Buffer("dx", (n_batch * n_rows, n_cols), res_dtype)
    if n_rows * n_cols == 0:
        dw = Buffer("dw", (n_batch, 0 if w_dtype is None else n_cols), dw_dtype, fill=0)
        return Recipe((Step(None, (), (dx, dw)),), ("dx", "dw"))
    res_row_stride = n_cols if res_row_stride is None else res_row_stride
    dy_row_stride = n_cols if dy_row_stride is None else dy_row_stride
    dres_row_stride = n_cols if dres_row_stride is None else dres_row_stride
    plan = plan_rms_norm_bwd(n_rows, n_cols, eps, (res_row_stride, dy_row_stride, dres_row_stride, n_cols),
                             n_batch, variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=res_row_stride, dy_row_stride=dy_row_stride,
                   dres_row_stride=dres_row_stride, dx_row_stride=n_cols)
    code = DTYPE_CODES[x_dtype]
    stats = None if plan.stats is None else _fused(plan.stats, X_DTYPE=code)
    bwd = _fused(plan.bwd, X_DTYPE=code, HAS_DRES=has_dres)
    # without dres, dy is bound in its place (not read)
    return _bwd_recipe(plan, stats, bwd, ("x", "x" if w_dtype is None else "w", "dy"),
                       ("dres" if has_dres else "dy",), dx, scalars, n_batch, n_rows, n_cols, dw_dtype)


# Width-sharded RMSNorm (tensor parallel over the hidden dim): each shard holds a column slice of x, w
# and dy. A shard sums its slice of each row (`_rms_norm_fwd_sums_kernel`, `_rms_norm_bwd_sums_kernel`),
# the front end all-reduces those [rows] sums over the hidden-dim shards, and each shard then finishes
# its slice locally with the statistics of the whole row: the forward in `_rms_norm_fwd_rstd_kernel`,
# the backward in `_rms_norm_bwd_finish_kernel` (the sums -> rstd, mean(g * n)) followed by the column
# split `_rms_norm_bwd_cols_kernel` above on the local slice. x is never gathered. Rounding: the same
# math as one device; only the fp32 order of each row sum differs (per shard, then across shards).


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
    y = _scaled(normed, w[None, :], X.dtype.element_ty, 0)  # 0: LLAMA
    tl.store(Y + rows * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride"])
def _rms_norm_bwd_sums_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride,
    SUMS,
    ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
        sum_gx += _grad_normed(dy, w[None, :], X.dtype.element_ty, 0) * x  # 0: LLAMA
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
    """Whether the width-sharded kernels compute `variant` (check_variant's: "none" without a weight). They
    compute the Llama math with a weight; a sharded width of any other variant is gathered first."""
    return variant == "llama"


def add_width_sharded_ok(variant: str, x_dtype: str, res_dtype: str) -> bool:
    """Whether a sharded width of `add_rms_norm` stays sharded (check_variant's variant, dtype names): each
    shard adds its columns, then the width-sharded kernels normalise them, which round `normed` to their
    input's dtype, so residual_out must be in x's."""
    return width_sharded_ok(variant) and x_dtype == res_dtype


def plan_rms_norm_fwd_width_sharded(n_rows: int, n_cols: int, eps: float,
                                    row_strides: tuple[int, ...] = ()) -> tuple[Launch, Launch]:
    """The forward of one shard of a width-sharded RMSNorm: (sums, norm). `sums`: x -> SUM_SQ [n_rows]
    fp32 over the shard's `n_cols` columns; the caller all-reduces it over the shards; `norm`: x, w,
    SUM_SQ -> y, with the runtime scalar `n_total` (the whole width)."""
    align = row_align(n_cols, *row_strides)
    block_m, block_n = _sums_tile(n_rows, n_cols)
    sums = Launch(_rms_norm_fwd_sums_kernel, (cdiv(n_rows, block_m),), 4,
                  {"ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_N": block_n})
    norm = Launch(_rms_norm_fwd_rstd_kernel, (cdiv(n_rows, block_m), cdiv(n_cols, block_n)), 4,
                  {"EPS": float(eps), "ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_N": block_n})
    return sums, norm


@dataclasses.dataclass(frozen=True)
class WidthShardedBwdPlan:
    """One shard's backward of a width-sharded RMSNorm, in order. `sums`: x, w, dy -> SUMS [n_batch *
    n_rows, 2] fp32 (the caller all-reduces it over the shards); `finish`: SUMS -> STATS (runtime scalar
    `n_total`, the whole width); `bwd`, `reduce`, `n_partials` as in BwdPlan (the column split)."""

    sums: Launch
    finish: Launch
    bwd: Launch
    reduce: Launch
    n_partials: int


def plan_rms_norm_bwd_width_sharded(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                                    n_batch: int = 1) -> WidthShardedBwdPlan:
    """As `plan_rms_norm_bwd`, for one shard's `n_cols` columns of a width-sharded RMSNorm."""
    align = row_align(n_cols, *row_strides)
    block_m, block_n = _sums_tile(n_batch * n_rows, n_cols)
    sums = Launch(_rms_norm_bwd_sums_kernel, (cdiv(n_batch * n_rows, block_m),), 4,
                  {"ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_N": block_n})
    finish_m = min(next_pow2(n_batch * n_rows), 1024)
    finish = Launch(_rms_norm_bwd_finish_kernel, (cdiv(n_batch * n_rows, finish_m),), 4,
                    {"EPS": float(eps), "BLOCK_M": finish_m})
    block_m, block_n, num_warps, programs = _BWD_COLS_TILE
    block_n = min(block_n, max(16, next_pow2(n_cols)))
    col_blocks = cdiv(n_cols, block_n)
    groups = max(2, min(cdiv(n_rows, block_m), programs // col_blocks))
    bwd = Launch(_rms_norm_bwd_cols_kernel, (col_blocks, groups, n_batch), num_warps,
                 {"ROW_ALIGN": align, "ONE_COL": n_cols == 1, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "VARIANT": LLAMA})  # the width-sharded path computes the Llama math only
    return WidthShardedBwdPlan(sums, finish, bwd, plan_dw_reduce(groups, n_cols, n_batch), groups)


def compile_variants():
    """Every (launch, signature) the plans can choose, for the sm_90 compile check (xkern/compile_check.py)."""
    pointer = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
    dtype_pairs = [("bfloat16", "bfloat16")]
    widths = [1 << k for k in range(17)] + [MAX_FWD_BLOCK + 1]  # every BLOCK_N and both chunked kernels
    widths += [3, 300, 640, 2052, 5000]  # every ROW_ALIGN; 640: the forward's tile at BLOCK_N 1024
    widths += [80, 96, 768, 2560, 5120, 7168, 9000, 12288, 18432]  # rows in SPLIT blocks (split_row)
    cases = [(x, w, n, r) for x, w in dtype_pairs for n in widths for r in (1, 100_000)]
    pairs = [(x, w) for x in FLOATS for w in FLOATS]
    cases += [(x, w, n, 100_000) for x, w in pairs for n in (128, 4096, MAX_BWD_BLOCK + 1, MAX_FWD_BLOCK // 2 + 1,
                                                              MAX_FWD_BLOCK + 1)]
    cases = [(*case, "llama") for case in cases]
    # The other variants: every kernel (each BLOCK_N once) and every dtype pair, each with its own rounding
    # points; "none" reads x only (W bound to x).
    variant_widths = [1 << k for k in range(17)] + [MAX_FWD_BLOCK + 1]
    for variant in ("gemma", "olmo2", "none"):
        cases += [("bfloat16", "bfloat16", n, 100_000, variant) for n in variant_widths]
        cases += [(x, w, n, 100_000, variant) for x, w in pairs if variant != "none" or x == w
                  for n in (128, 4096, MAX_BWD_BLOCK + 1, MAX_FWD_BLOCK // 2 + 1)]
    for x_dtype, w_dtype, n_cols, n_rows, variant in cases:
        y_dtype = out_dtype_name(x_dtype, w_dtype, variant)
        ptrs = {"X": pointer[x_dtype], "W": pointer[w_dtype], "Y": pointer[y_dtype], "DY": pointer[y_dtype],
                "DX": pointer[x_dtype], "DW_PARTIAL": "*fp32", "DW": pointer[w_dtype]}
        ptrs["STATS"] = "*fp32"
        bwd = plan_rms_norm_bwd(n_rows, n_cols, 1e-6, variant=variant)
        itemsize = max(ITEMSIZE[d] for d in (x_dtype, w_dtype, y_dtype))
        for launch in (plan_rms_norm_fwd(n_rows, n_cols, 1e-6, (), itemsize, variant), bwd.stats, bwd.bwd,
                       bwd.reduce):
            if launch is not None:
                yield launch, ptrs
        if n_rows == 100_000 and n_cols in (1, 3, 300, 2052, 4096, 16384):  # the width-sharded kernels (a shard)
            ptrs = {**ptrs, "SUM_SQ": "*fp32", "SUMS": "*fp32"}
            sharded = plan_rms_norm_bwd_width_sharded(n_rows, n_cols, 1e-6)
            for launch in (*plan_rms_norm_fwd_width_sharded(n_rows, n_cols, 1e-6), sharded.sums, sharded.finish,
                           sharded.bwd, sharded.reduce):
                yield launch, ptrs
    # The fused residual add (add_rms_norm): each kernel at every BLOCK_N its plan takes, plus the split
    # widths, for equal 16-bit dtypes and for an fp32 residual stream (x bf16, residual and residual_out fp32;
    # its backward rounds `normed` to bf16 while reading fp32), with and without residual_out's gradient.
    fused_widths = [1 << k for k in range(4, 17)] + [80, 3072, 5120, 7168, 12288, 20000, MAX_FWD_BLOCK + 1]
    for x_dtype, r_dtype in (("bfloat16", "bfloat16"), ("bfloat16", "float32")):
        res_dtype = promote(x_dtype, r_dtype)
        for n_cols in fused_widths:
            fwd = add_rms_norm_fwd_recipe(100_000, n_cols, 1e-6, x_dtype, r_dtype, x_dtype, res_dtype)
            ptrs = {"X": pointer[x_dtype], "R": pointer[r_dtype], "W": pointer[x_dtype], "Y": pointer[x_dtype],
                    "RES_OUT": pointer[res_dtype]}
            yield from ((step.launch, ptrs) for step in fwd.steps if step.launch is not None)
            ptrs = {"X": pointer[res_dtype], "W": pointer[x_dtype], "DY": pointer[x_dtype], "DRES": pointer[res_dtype],
                    "DX": pointer[res_dtype], "DW_PARTIAL": "*fp32", "DW": pointer[x_dtype], "STATS": "*fp32"}
            for has_dres in (True, False) if x_dtype != res_dtype else (True,):
                bwd = add_rms_norm_bwd_recipe(100_000, n_cols, 1e-6, x_dtype, x_dtype, res_dtype, has_dres)
                yield from ((step.launch, ptrs) for step in bwd.steps if step.launch is not None)
