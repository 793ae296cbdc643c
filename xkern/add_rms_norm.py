"""Fused residual add + RMSNorm (`add_rms_norm`): its argument rules and launch recipes, RMSNorm's plans launched
through the fused entry points of the RMSNorm kernels (`xkern/rms_norm/kernels.py`, "Fused residual add").
  residual_out = (x.f32 + residual.f32) rounded once to residual_dtype (default promote(x, residual));
  y = rms_norm(residual_out, w, eps, variant) with `normed` rounded to x's dtype (not residual_out's) and
      y in out_dtype_name(x, w): with equal dtypes bit for bit rms_norm(x + residual), the eager layer.
Backward (eager autograd's rounding points): the norm's dx, rounded to residual_out's dtype, plus the
gradient of residual_out (if any), rounded once to residual_out's dtype: d(sum). The front ends return it
as dx and dresidual, each converted to its input's dtype (no conversion, one buffer, when they match).
"""

from __future__ import annotations

import dataclasses
import functools

from xkern.launch import FLOATS, ITEMSIZE, POINTER_TYPES, Buffer, Launch, Recipe, Step, promote
from xkern.rms_norm import (
    MAX_FWD_BLOCK,
    check_rms_norm,
    out_dtype_name,
    plan_rms_norm_bwd,
    plan_rms_norm_fwd,
    rms_norm_bwd_recipe,
)
from xkern.rms_norm.kernels import DTYPE_CODES, FUSED
from xkern.rms_norm.recipes import bwd_recipe


def _fused(launch: Launch, **constexprs) -> Launch:
    """`launch` (a plan's) through the fused entry point of its kernel body: same grid, warps, constexprs."""
    return dataclasses.replace(launch, kernel=FUSED[launch.kernel], constexprs={**launch.constexprs, **constexprs})


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
    itemsize = max(ITEMSIZE[d] for d in (res_dtype, out_dtype_name(x_dtype, w_dtype, variant)))  # x's and dy's
    plan = plan_rms_norm_bwd(n_rows, n_cols, eps, (res_row_stride, dy_row_stride, dres_row_stride, n_cols),
                             n_batch, variant, streams=3 if has_dres else 2, itemsize=itemsize)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=res_row_stride, dy_row_stride=dy_row_stride,
                   dres_row_stride=dres_row_stride, dx_row_stride=n_cols)
    code = DTYPE_CODES[x_dtype]
    stats = None if plan.stats is None else _fused(plan.stats, X_DTYPE=code)
    bwd = _fused(plan.bwd, X_DTYPE=code, HAS_DRES=has_dres)
    # without dres, dy is bound in its place (not read)
    return bwd_recipe(plan, stats, bwd, ("x", "x" if w_dtype is None else "w", "dy"),
                      ("dres" if has_dres else "dy",), dx, scalars, n_batch, n_rows, n_cols, dw_dtype)


def add_width_sharded_ok(variant: str, x_dtype: str, res_dtype: str) -> bool:
    """Whether a sharded width of `add_rms_norm` stays sharded (check_variant's variant, dtype names): each
    shard adds its columns, then the width-sharded kernels normalise them, which round `normed` to their
    input's dtype, so residual_out must be in x's. The Llama math with a weight (the plain norm's width-sharded
    path takes every variant; the fused one's others gather the width)."""
    return variant == "llama" and x_dtype == res_dtype


def compile_variants():
    """Every (launch, signature) the recipes can choose, for the sm_90 compile check (xkern/compile_check.py)."""
    pointer = POINTER_TYPES
    # The fused residual add (add_rms_norm): each kernel at every BLOCK_N its plan takes, plus the split
    # widths, for equal 16-bit dtypes and for an fp32 residual stream (x bf16, residual and residual_out fp32;
    # its backward rounds `normed` to bf16 while reading fp32), with and without residual_out's gradient.
    fused_widths = [1 << k for k in range(4, 17)] + [80, 576, 3072, 5120, 7168, 12288, 18432, 20000, 28672, 28673,
                                                     MAX_FWD_BLOCK + 1]
    for x_dtype, r_dtype in (("bfloat16", "bfloat16"), ("bfloat16", "float32")):
        res_dtype = promote(x_dtype, r_dtype)
        for n_cols in fused_widths:
            fwd = add_rms_norm_fwd_recipe(100_000, n_cols, 1e-6, x_dtype, r_dtype, x_dtype, res_dtype)
            ptrs = {"X": pointer[x_dtype], "R": pointer[r_dtype], "W": pointer[x_dtype], "Y": pointer[x_dtype],
                    "RES_OUT": pointer[res_dtype]}
            yield from ((step.launch, ptrs) for step in fwd.steps if step.launch is not None)
            ptrs = {"X": pointer[res_dtype], "W": pointer[x_dtype], "DY": pointer[x_dtype], "DRES": pointer[res_dtype],
                    "DX": pointer[res_dtype], "DW_PARTIAL": "*fp32", "DW": pointer[x_dtype], "STATS": "*fp32"}
            # 16 rows: a backward of one program, writing dw (w's dtype) itself (BwdPlan.dw_direct)
            direct = {**ptrs, "DW_PARTIAL": pointer[x_dtype]}
            for has_dres in (True, False) if x_dtype != res_dtype else (True,):
                for n_rows in (16, 100_000):
                    bwd = add_rms_norm_bwd_recipe(n_rows, n_cols, 1e-6, x_dtype, x_dtype, res_dtype, has_dres)
                    yield from ((step.launch, direct if len(bwd.steps) == 1 else ptrs) for step in bwd.steps
                                if step.launch is not None)
