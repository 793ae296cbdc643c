"""RMSNorm with Hugging Face Llama rounding: the kernels (`@triton.jit`), fused residual add included.

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

import triton
import triton.language as tl


@triton.jit
def _inv(n_cols):
    # 1 / n_cols, once per program; means are sums times it (a division per row cost a fifth of the
    # narrow-row backward's speed on the H200).
    return tl.math.div_rn(1.0, n_cols * 1.0)


@triton.jit
def _rsqrt(v, TY: tl.constexpr):
    # rsqrt of the statistic of rows normalized in dtype TY. FP32 rows: 1 / sqrt, each correctly rounded (two
    # roundings, as eager computes it on the CPU), where the GPU's approximate rsqrt (eager's there too) errs
    # by up to 2 ULP: an FP32 output keeps that error. 16-bit rows: the approximate rsqrt, as eager on the GPU
    # (its error vanishes in the rounding of `normed` to 16 bits, and this keeps Hugging Face's bits). A
    # per-row cost, as is `_inv`'s division.
    if TY == tl.float32:
        return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.sqrt_rn(v))
    return tl.rsqrt(v)


# Norm math variants (the constexpr VARIANT of every kernel): what multiplies `normed = x * rstd` (fp32) and
# where eager PyTorch rounds. LLAMA `w * normed.to(x.dtype)`; GEMMA `(normed * (1 + w.float())).to(x.dtype)`;
# OLMO2 `(w * normed).to(x.dtype)`; NO_WEIGHT `normed.to(x.dtype)` (W is not read, DW_PARTIAL not written).
# tl.constexpr so that kernels can read them; a launch's VARIANT is the plain int (`.value`: Inductor writes
# constexprs into its code).
LLAMA: tl.constexpr = tl.constexpr(0)
GEMMA: tl.constexpr = tl.constexpr(1)
OLMO2: tl.constexpr = tl.constexpr(2)
NO_WEIGHT: tl.constexpr = tl.constexpr(3)


@triton.jit
def _scale(w, VARIANT: tl.constexpr):
    # what multiplies normed outside LLAMA's rounding: GEMMA 1 + w, OLMO2 w, NO_WEIGHT 1
    if VARIANT == GEMMA:
        s = 1.0 + w
    elif VARIANT == OLMO2:
        s = w
    else:
        s = 1.0
    return s


@triton.jit
def _scaled(normed, w, X_TY: tl.constexpr, VARIANT: tl.constexpr):
    # y in fp32, before its one rounding to Y's dtype
    if VARIANT == LLAMA:
        y = w * normed.to(X_TY).to(tl.float32)
    else:
        y = normed * _scale(w, VARIANT)
    return y


@triton.jit
def _grad_normed(dy, w, X_TY: tl.constexpr, VARIANT: tl.constexpr):
    # g = dL/d(normed) in fp32, rounded where eager autograd rounds it: LLAMA's `dy * w` is formed in dy's
    # dtype and taken to x.dtype (the backward of `.to(x.dtype)`); the others stay fp32.
    if VARIANT == LLAMA:
        g = (dy * w).to(X_TY).to(tl.float32)
    else:
        g = dy * _scale(w, VARIANT)
    return g


@triton.jit
def _dw_terms(dy, n, X_TY: tl.constexpr, W_TY: tl.constexpr, DY_TY: tl.constexpr, VARIANT: tl.constexpr):
    # One row's terms of dw (summed over rows in fp32), rounded as eager rounds them: LLAMA `dy * n.to(x.dtype)`
    # in dy's dtype; OLMO2 `dy * n` taken to w's dtype (the backward of the promoted `w * n`); GEMMA none
    # (dw = sum(dy * n) in fp32, then to w's dtype).
    if VARIANT == LLAMA:
        t = (dy * n.to(X_TY).to(tl.float32)).to(DY_TY).to(tl.float32)
    elif VARIANT == OLMO2:
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
X_FP16: tl.constexpr = tl.constexpr(0)
X_BF16: tl.constexpr = tl.constexpr(1)
X_FP32: tl.constexpr = tl.constexpr(2)
DTYPE_CODES = {"float16": X_FP16.value, "bfloat16": X_BF16.value, "float32": X_FP32.value}


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
    rstd = _rsqrt(tl.sum(x * x, axis=1) * _inv(n_cols) + EPS,
                  RES_OUT.dtype.element_ty if HAS_RESIDUAL else X.dtype.element_ty)
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
    rstd = _rsqrt(tl.sum(sum_sq, axis=0) * _inv(n_cols) + EPS,
                  RES_OUT.dtype.element_ty if HAS_RESIDUAL else X.dtype.element_ty)
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
        rstd = _rsqrt(tl.sum(sum_sq, axis=0) * inv_n + EPS,
                      RES_OUT.dtype.element_ty if HAS_RESIDUAL else X.dtype.element_ty)
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
        rstd = tl.where(cur_rows < n_rows, _rsqrt(tl.sum(x * x, axis=1) * inv_n + EPS, X.dtype.element_ty),
                        0.0)[:, None]
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
    if VARIANT != NO_WEIGHT:  # no dw
        # (one program, `BwdPlan.dw_direct`: DW_PARTIAL is dw itself, and the store rounds to its dtype)
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
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == X_FP16 else (tl.bfloat16 if X_DTYPE == X_BF16 else tl.float32)
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
        rstd = tl.where(cur_rows < n_rows, _rsqrt(sum_sq * inv_n + EPS, X.dtype.element_ty), 0.0)[:, None]
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
    if VARIANT != NO_WEIGHT:  # no dw (one program: dw itself, as in _rms_norm_bwd_tile)
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
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == X_FP16 else (tl.bfloat16 if X_DTYPE == X_BF16 else tl.float32)
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
                rstd = _rsqrt(tl.sum(sum_sq, axis=0) * inv_n + EPS, X.dtype.element_ty)
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
    if VARIANT != NO_WEIGHT:  # no dw
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
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == X_FP16 else (tl.bfloat16 if X_DTYPE == X_BF16 else tl.float32)
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
    rstd = _rsqrt(tl.sum(sum_sq, axis=0) * inv_n + EPS, X.dtype.element_ty)
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
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == X_FP16 else (tl.bfloat16 if X_DTYPE == X_BF16 else tl.float32)
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
    if VARIANT != NO_WEIGHT:  # no dw
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
    x_ty: tl.constexpr = tl.float16 if X_DTYPE == X_FP16 else (tl.bfloat16 if X_DTYPE == X_BF16 else tl.float32)
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


# The fused entry point of each plain kernel (the same body): `xkern.add_rms_norm` launches RMSNorm's plans
# through these.
FUSED = {
    _rms_norm_fwd_kernel: _add_rms_norm_fwd_kernel,
    _rms_norm_fwd_row_kernel: _add_rms_norm_fwd_row_kernel,
    _rms_norm_fwd_chunked_kernel: _add_rms_norm_fwd_chunked_kernel,
    _rms_norm_bwd_kernel: _add_rms_norm_bwd_kernel,
    _rms_norm_bwd_split_kernel: _add_rms_norm_bwd_split_kernel,
    _rms_norm_bwd_row_kernel: _add_rms_norm_bwd_row_kernel,
    _rms_norm_bwd_stats_kernel: _add_rms_norm_bwd_stats_kernel,
    _rms_norm_bwd_cols_kernel: _add_rms_norm_bwd_cols_kernel,
}
