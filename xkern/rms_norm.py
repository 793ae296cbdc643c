"""RMSNorm with Hugging Face Llama rounding: kernels and launch plans.

Forward:  y = w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype), output dtype = promote(x, w).
Backward, one joint pass that reads x and dy once (rstd is recomputed from x, never stored):
    n  = x * rstd                      (fp32)
    g  = (dy * w).to(x.dtype)          (eager rounds here: the backward of `.to(x.dtype)`)
    dx = rstd * (g - n * mean(g * n))  rounded once to x.dtype
    dw = sum_rows (dy * n.to(x.dtype)).to(dy.dtype), in fp32: one partial row per program, then summed
         over programs in a fixed order by `_dw_reduce_kernel` (deterministic, no atomics).

Rows are addressed as `X + row * row_stride + col`, row offsets in int64, so any input whose last dim is
contiguous and whose leading dims collapse to one stride is read in place.

One binary for both front ends: Triton's torch launcher would mark integer arguments divisible by 16, and
jax-triton 0.3.1 marks none (it passes floats as fp64, too). The two would compile different code (2-byte
instead of 16-byte accesses on the JAX side; other layouts, hence other FP32 sum orders). So the integer
arguments are not specialized (`do_not_specialize`); the plan states what it knows instead: ROW_ALIGN, the
power of two dividing the width and every row stride, applied as `n // ROW_ALIGN * ROW_ALIGN` so the
compiler sees it; and EPS is a compile-time constant (one binary per eps value, which a model fixes).

Schedules: every kernel handles a BLOCK_M x BLOCK_N tile. Narrow rows (N <= 128, Qwen3 q/k norms) get
many rows per tile; wide rows get BLOCK_M = 1 (a row kernel). Rows wider than the largest register
block go to the `*_chunked` kernels, which loop over column chunks: every width works.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xkern.launch import NUM_SMS, Launch, cdiv, next_pow2, row_align


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "y_row_stride"])
def _rms_norm_fwd_kernel(
    X, W,
    n_rows, n_cols, x_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN  # alignment from the plan, visible to the compiler
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + EPS)
    normed = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = w[None, :] * normed
    tl.store(Y + rows * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "y_row_stride"])
def _rms_norm_fwd_chunked_kernel(
    X, W,
    n_rows, n_cols, x_row_stride, y_row_stride,
    Y,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * x_row_stride
    y_row = Y + row * y_row_stride
    sum_sq = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + EPS)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dx_row_stride"])
def _rms_norm_bwd_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    # Persistent: program p takes tiles p, p + P, ... and keeps its dw partial in registers. The next
    # tile's loads are issued before this tile's math (register double buffering) to hide DRAM latency.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    batch = tl.program_id(1).to(tl.int64)
    X += batch * n_rows * x_row_stride
    DY += batch * n_rows * dy_row_stride
    DX += batch * n_rows * dx_row_stride
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x_next = tl.load(X + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), num_programs):
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        cur_rows, cur_mask = rows, mask
        rows = (tile + num_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x_next = tl.load(X + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
        dy_next = tl.load(DY + rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + EPS)[:, None]
        n = x * rstd
        n_lp = n.to(X.dtype.element_ty).to(tl.float32)
        g = (dy * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        # where(): a masked row with EPS == 0 has rstd = inf and n = nan; keep it out of dw.
        dw_acc += tl.sum(tl.where(cur_mask, (dy * n_lp).to(DY.dtype.element_ty).to(tl.float32), 0.0), axis=0)
        mean_gn = tl.sum(g * n, axis=1)[:, None] / n_cols
        dx = rstd * (g - n * mean_gn)
        out = cur_rows.to(tl.int64)[:, None] * dx_row_stride + cols[None, :]
        tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=cur_mask)
    tl.store(DW_PARTIAL + (batch * num_programs + pid) * n_cols + cols, dw_acc, mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "x_row_stride", "dy_row_stride", "dx_row_stride"])
def _rms_norm_bwd_chunked_kernel(
    X, W, DY,
    n_rows, n_cols, x_row_stride, dy_row_stride, dx_row_stride,
    DX, DW_PARTIAL,
    EPS: tl.constexpr, ROW_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    x_row_stride = x_row_stride // ROW_ALIGN * ROW_ALIGN
    dy_row_stride = dy_row_stride // ROW_ALIGN * ROW_ALIGN
    dx_row_stride = dx_row_stride // ROW_ALIGN * ROW_ALIGN
    # Rows too wide for registers: pass 1 gathers the two row sums, pass 2 (re-reading the row, mostly
    # from L2) writes dx and adds into this program's own dw partial row in memory.
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    X += batch * n_rows * x_row_stride
    DY += batch * n_rows * dy_row_stride
    DX += batch * n_rows * dx_row_stride
    dw_row = DW_PARTIAL + (batch * tl.num_programs(0) + pid) * n_cols
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        tl.store(dw_row + cols, tl.zeros([BLOCK_N], tl.float32), mask=cols < n_cols)
    for row in range(pid.to(tl.int64), n_rows, tl.num_programs(0)):  # int64 row: offsets past 2**31
        x_row = X + row * x_row_stride
        dy_row = DY + row * dy_row_stride
        sum_sq = tl.zeros([BLOCK_N], tl.float32)
        sum_gx = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            g = (dy * w).to(X.dtype.element_ty).to(tl.float32)
            sum_sq += x * x
            sum_gx += g * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + EPS)
        mean_gn = tl.sum(sum_gx, axis=0) * rstd / n_cols
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            n = x * rstd
            g = (dy * w).to(X.dtype.element_ty).to(tl.float32)
            dx = rstd * (g - n * mean_gn)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
            n_lp = n.to(X.dtype.element_ty).to(tl.float32)
            dw = tl.load(dw_row + cols, mask=mask, other=0.0)
            tl.store(dw_row + cols, dw + (dy * n_lp).to(DY.dtype.element_ty).to(tl.float32), mask=mask)


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

MAX_FWD_BLOCK = 32768  # widest row the forward holds in registers (32 warps x 32 fp32 per thread)
MAX_BWD_BLOCK = 16384  # the backward holds x, dy, the next tile's x and dy, and the dw partial
CHUNK = 8192           # column chunk of the *_chunked kernels

# Backward tiles by BLOCK_N: (BLOCK_M, num_warps, programs per SM). From benchmarks/tune_rms_norm.py
# on an H200 (bf16, 2026-12-02): small tiles with few warps and several programs per SM for narrow
# rows; one row and many warps for wide rows.
_BWD_TILES = {64: (64, 2, 4), 128: (32, 2, 4), 256: (64, 8, 1), 512: (8, 8, 2), 1024: (4, 8, 2),
              2048: (2, 8, 2), 4096: (4, 16, 1), 8192: (1, 16, 1), 16384: (1, 32, 1)}


def plan_rms_norm_fwd(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = ()) -> Launch:
    """Forward launch; `row_strides` are the x and y row strides (default: contiguous, = n_cols)."""
    fixed = {"EPS": float(eps), "ROW_ALIGN": row_align(n_cols, *row_strides)}
    if n_cols > MAX_FWD_BLOCK:
        return Launch(_rms_norm_fwd_chunked_kernel, (n_rows,), 16, {**fixed, "BLOCK_N": CHUNK})
    block_n = next_pow2(n_cols)
    if block_n <= 256:  # narrow rows: 1024-element tiles of many rows
        block_m, num_warps = 1024 // block_n, (4 if block_n == 128 else 2)
    else:  # a row per program, 16 elements per thread
        block_m, num_warps = 1, max(1, min(32, block_n // 512))
    block_m = max(1, min(block_m, next_pow2(n_rows)))
    return Launch(_rms_norm_fwd_kernel, (cdiv(n_rows, block_m),), num_warps,
                  {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n})


def plan_rms_norm_bwd(n_rows: int, n_cols: int, eps: float, row_strides: tuple[int, ...] = (),
                      n_batch: int = 1) -> tuple[Launch, Launch]:
    """The joint backward and the dw reduction for `n_batch` independent problems of `n_rows` rows each
    (n_batch > 1 only under jax.vmap: per-example dw). Partials are [n_batch, bwd.grid[0], n_cols] fp32.
    `row_strides`: the x, dy and dx row strides (default: contiguous)."""
    block_n = next_pow2(n_cols)
    fixed = {"EPS": float(eps), "ROW_ALIGN": row_align(n_cols, *row_strides)}
    if n_cols > MAX_BWD_BLOCK:
        grid = max(1, min(n_rows, NUM_SMS))
        bwd = Launch(_rms_norm_bwd_chunked_kernel, (grid, n_batch), 16, {**fixed, "BLOCK_N": CHUNK})
    else:
        block_m, num_warps, programs_per_sm = _BWD_TILES[max(block_n, 64)]
        block_m = max(1, min(block_m, next_pow2(n_rows)))
        grid = max(1, min(cdiv(n_rows, block_m), NUM_SMS * programs_per_sm))
        bwd = Launch(_rms_norm_bwd_kernel, (grid, n_batch), num_warps,
                     {**fixed, "BLOCK_M": block_m, "BLOCK_N": block_n})
    block_n = min(block_n, 128)
    reduce = Launch(_dw_reduce_kernel, (cdiv(n_cols, block_n), n_batch), 4,
                    {"ROW_ALIGN": row_align(n_cols), "BLOCK_P": 32, "BLOCK_N": block_n})
    return bwd, reduce


def compile_variants():
    """Every (launch, signature) the plans can choose, for the sm_90 compile check (xkern/compile_check.py)."""
    pointer = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
    dtype_pairs = [("bfloat16", "bfloat16")]
    widths = [1 << k for k in range(17)] + [MAX_FWD_BLOCK + 1]  # every BLOCK_N and both chunked kernels
    widths += [3, 300, 2052, 5000]  # every ROW_ALIGN
    cases = [(x, w, n, r) for x, w in dtype_pairs for n in widths for r in (1, 100_000)]
    pairs = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("bfloat16", "float32"),
             ("float16", "float32")]
    cases += [(x, w, n, 100_000) for x, w in pairs for n in (128, 4096, MAX_BWD_BLOCK + 1, MAX_FWD_BLOCK + 1)]
    for x_dtype, w_dtype, n_cols, n_rows in cases:
        y_dtype = x_dtype if x_dtype == w_dtype else "float32"
        ptrs = {"X": pointer[x_dtype], "W": pointer[w_dtype], "Y": pointer[y_dtype], "DY": pointer[y_dtype],
                "DX": pointer[x_dtype], "DW_PARTIAL": "*fp32", "DW": pointer[w_dtype]}
        bwd, reduce = plan_rms_norm_bwd(n_rows, n_cols, 1e-6)
        for launch in (plan_rms_norm_fwd(n_rows, n_cols, 1e-6), bwd, reduce):
            yield launch, ptrs
