"""Fused residual add + RMSNorm for JAX: `add_rms_norm`, a `jax.custom_jvp` function (every transformation, as
`rms_norm`).

The same recipes and kernels as the torch front end (`xkern/add_rms_norm.py`), hence the
same bits. vmap: the kernel calls are `custom_vmap` functions, a vmapped forward is more rows and a vmapped
backward one launch with a batch grid axis (one dw per example); a batched weight maps over the batch.
JAX hands the backward a zero cotangent for an unused residual_out, so the backward always reads it.
Under jit, sharded rows stay sharded (`jax.experimental.custom_partitioning`, as rms_norm's rows case in
jax_api/sharding.py: each device runs the kernels on its rows, dw summed in fp32 over the row axes, then
rounded once). A sharded hidden dim (tensor parallel) stays sharded where the width-sharded kernels compute
the math (Llama's, with a weight, residual_out in x's dtype): each device adds its columns (FP32, one
rounding: the fused kernel's sum bit for bit), then runs rms_norm's width-sharded kernels on them (one psum
of the row sums); backward, d(sum) is their dx plus d(residual_out), added in FP32 and rounded once more
(within the contract, as the width-sharded rms_norm is). Other cases gather the width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_api._launch import check_array, execute, map_batched, vary_like
from jax_api._linear import linear
from jax_api.rms_norm import norm_math, with_weight
from jax_api.sharding import (
    bwd_width_sharded,
    dim_axes,
    factor_names,
    fwd_width_sharded,
    named_sharding,
    partitioned,
    per_shard,
)
from xkern.add_rms_norm import (
    add_rms_norm_bwd_recipe,
    add_rms_norm_fwd_recipe,
    add_width_sharded_ok,
    check_add_rms_norm,
)


def _fwd(x, residual, weight, eps, variant, res_dtype):
    n_cols = x.shape[-1]
    n_rows = math.prod(x.shape[:-1])
    recipe = add_rms_norm_fwd_recipe(n_rows, n_cols, eps, x.dtype.name, residual.dtype.name,
                                     None if weight is None else weight.dtype.name, res_dtype, variant=variant)
    y, res = execute(recipe, x=x.reshape(n_rows, n_cols), r=residual.reshape(n_rows, n_cols), w=weight)
    return y.reshape(x.shape), res.reshape(x.shape)


def _bwd(dy, dres, res, weight, eps, variant, x_dtype, n_batch_dims, dw_dtype=None):
    """d(sum) in residual_out's dtype and dw (None without a weight), one per vmapped example, in `dw_dtype`
    (default weight's)."""
    n_cols = res.shape[-1]
    batch_shape = res.shape[:n_batch_dims]
    n_batch = math.prod(batch_shape)
    n_rows = math.prod(res.shape[n_batch_dims:-1])
    recipe = add_rms_norm_bwd_recipe(n_rows, n_cols, eps, x_dtype, None if weight is None else weight.dtype.name,
                                     res.dtype.name, True, n_batch=n_batch, variant=variant,
                                     dw_dtype=None if dw_dtype is None else jnp.dtype(dw_dtype).name)
    flat = (n_batch * n_rows, n_cols)
    dsum, dw = execute(recipe, x=res.reshape(flat), w=weight, dy=dy.reshape(flat), dres=dres.reshape(flat))
    return dsum.reshape(res.shape), None if weight is None else dw.reshape(batch_shape + weight.shape)


def _fwd_width(hidden, n_total: int, eps: float, res_dtype: str, x, r, w):
    """One shard's columns: the sum (FP32, rounded once, as the fused kernel), then the width-sharded norm."""
    s = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(res_dtype)
    return fwd_width_sharded(hidden, n_total, eps, s, w), s


@functools.cache
def _fwd_sharded(eps: float, variant: str, res_dtype: str, ndim: int, weighted: bool):
    """_fwd partitioned by rows (x and residual alike) and, where `add_width_sharded_ok`, by the hidden dim."""
    rows = " ".join(factor_names(ndim - 1))
    body = (lambda x, r, w: _fwd(x, r, w, eps, variant, res_dtype)) if weighted else \
        (lambda x, r: _fwd(x, r, None, eps, variant, res_dtype))

    def partition(mesh, arg_shapes, result_shape):
        dims = dim_axes(arg_shapes[0])
        hidden = dims[-1] if add_width_sharded_ok(variant, jnp.dtype(arg_shapes[0].dtype).name, res_dtype) else ()
        dims[-1] = hidden
        xs = named_sharding(mesh, dims)
        fn = functools.partial(_fwd_width, hidden, arg_shapes[0].shape[-1], eps, res_dtype) if hidden else body
        return mesh, per_shard(fn), (xs, xs), (xs, xs) + ((named_sharding(mesh, [hidden]),) if weighted else ())

    w_rule = ", n" if weighted else ""
    return partitioned(body, partition, f"{rows} n, {rows} n{w_rule} -> {rows} n, {rows} n")


@functools.cache
def _bwd_sharded(eps: float, variant: str, x_dtype: str, ndim: int, n_batch_dims: int, weighted: bool):
    """_bwd partitioned by rows: dw of each device's rows in fp32, psum over the row axes, w's dtype once."""
    batch, rows = factor_names(n_batch_dims, "b"), factor_names(ndim - 1 - n_batch_dims)
    lead = " ".join(batch + rows)

    def body(dy, dres, res, w=None, dw_dtype=None):
        return _bwd(dy, dres, res, w, eps, variant, x_dtype, n_batch_dims, dw_dtype)

    def dsum_only(dy, dres, res):
        return body(dy, dres, res)[0]

    def partition(mesh, arg_shapes, result_shape):
        dims = dim_axes(arg_shapes[2])
        hidden = dims[-1] if add_width_sharded_ok(variant, x_dtype, jnp.dtype(arg_shapes[2].dtype).name) else ()
        dims[-1] = hidden
        row_axes = tuple(a for d in dims[n_batch_dims:-1] for a in d)
        xs = named_sharding(mesh, dims)
        if not weighted:
            return mesh, per_shard(dsum_only), xs, (xs, xs, xs)
        n_total = arg_shapes[2].shape[-1]

        def fn(dy, dres, res, w):
            if hidden:  # the width-sharded norm's dx, plus d(residual_out): FP32, rounded once more
                dx, dw = bwd_width_sharded(hidden, n_total, eps, n_batch_dims, dy, res, w)
                dsum = (dx.astype(jnp.float32) + dres.astype(jnp.float32)).astype(res.dtype)
            else:
                dsum, dw = body(dy, dres, res, w, jnp.float32)
            if row_axes:
                dw = jax.lax.psum(dw, row_axes)
            return dsum, dw.astype(w.dtype)

        return (mesh, per_shard(fn), (xs, named_sharding(mesh, dims[:n_batch_dims] + [hidden])),
                (xs, xs, xs, named_sharding(mesh, [hidden])))

    if not weighted:
        return partitioned(dsum_only, partition, f"{lead} n, {lead} n, {lead} n -> {lead} n")
    return partitioned(lambda dy, dres, res, w: body(dy, dres, res, w), partition,
                        f"{lead} n, {lead} n, {lead} n, n -> {lead} n, {' '.join(batch)} n")


def _broadcast(axis_size, in_batched, *args):
    return [a if b or a is None else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]


@functools.cache
def _fwd_op(eps: float, variant: str, res_dtype: str):
    @jax.custom_batching.custom_vmap
    def op(x, residual, weight):
        if weight is None:
            return _fwd_sharded(eps, variant, res_dtype, x.ndim, False)(x, residual)
        return _fwd_sharded(eps, variant, res_dtype, x.ndim, True)(x, residual, weight)

    @op.def_vmap
    def _(axis_size, in_batched, x, residual, weight):
        if in_batched[2]:
            return map_batched(op, axis_size, in_batched, x, residual, weight), (True, True)
        x, residual = _broadcast(axis_size, in_batched[:2], x, residual)
        return op(x, residual, weight), (True, True)  # batch axis 0: more rows

    return op


@functools.cache
def _bwd_op(eps: float, variant: str, x_dtype: str, n_batch_dims: int):
    @jax.custom_batching.custom_vmap
    def op(dy, dres, res, weight):
        if weight is None:
            return _bwd_sharded(eps, variant, x_dtype, res.ndim, n_batch_dims, False)(dy, dres, res), None
        return tuple(_bwd_sharded(eps, variant, x_dtype, res.ndim, n_batch_dims, True)(dy, dres, res, weight))

    @op.def_vmap
    def _(axis_size, in_batched, dy, dres, res, weight):
        if in_batched[3]:
            return map_batched(op, axis_size, in_batched, dy, dres, res, weight), (True, True)
        dy, dres, res = _broadcast(axis_size, in_batched[:3], dy, dres, res)
        return _bwd_op(eps, variant, x_dtype, n_batch_dims + 1)(dy, dres, res, weight), \
            (True, None if weight is None else True)

    return op


# Autodiff as rms_norm's (jax_api/rms_norm.py): a custom_jvp whose tangent is `linear`, transposed by the
# backward kernel, which is itself a custom_jvp with a jnp tangent.


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _add_rms_norm(x, residual, weight, eps, variant, res_dtype):
    y, res = _fwd_op(eps, variant, res_dtype)(x, residual, weight)
    return vary_like(y, x), vary_like(res, x)


@_add_rms_norm.defjvp
def _add_rms_norm_jvp(eps, variant, res_dtype, primals, tangents):
    x, residual, weight = primals
    y, s = _add_rms_norm(x, residual, weight, eps, variant, res_dtype)
    weighted = weight is not None
    x_dtype, r_dtype, y_dtype = x.dtype, residual.dtype, y.dtype
    math = with_weight(lambda a, b: norm_math(a, b, eps, variant, y_dtype, x_dtype), weighted)

    def tangent(s, *args):  # residuals (sum, w), tangents (tx, tr, tw)
        w, (tx, tr, *tw) = args[:weighted], args[weighted:]
        ts = (tx.astype(jnp.float32) + tr.astype(jnp.float32)).astype(res_dtype)
        return [jax.jvp(math, (s, *w), (ts, *tw))[1], ts]

    def transpose(s, *args):  # residuals (sum, w), cotangents (dy, dres)
        w, (dy, dres) = args[:weighted], args[weighted:]
        dsum, dw = _add_backward(dy, dres, s, w[0] if weighted else None, eps, variant, x_dtype.name)
        dr = dsum.astype(r_dtype)
        return [dsum.astype(x_dtype), dr] + ([dw] if weighted else [])

    ty, ts = linear(tangent, transpose, (s, weight) if weighted else (s,), tangents[:2 + weighted])
    return (y, s), (ty, ts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _add_backward(dy, dres, res, weight, eps, variant, x_dtype):
    """(d(sum) in residual_out's dtype, dw) from the backward kernel; dw None without a weight."""
    dsum, dw = _bwd_op(eps, variant, x_dtype, 0)(dy, dres.astype(res.dtype), res, weight)
    return vary_like(dsum, res), None if weight is None else vary_like(dw, weight)


@_add_backward.defjvp
def _add_backward_jvp(eps, variant, x_dtype, primals, tangents):
    dy, dres, res, weight = primals
    out = _add_backward(dy, dres, res, weight, eps, variant, x_dtype)

    def math(dy, dres, res, *w):  # the norm's vjp, plus d(residual_out): FP32, rounded once
        norm = with_weight(lambda a, b: norm_math(a, b, eps, variant, dy.dtype, x_dtype), bool(w))
        dsum, *dw = jax.vjp(norm, res, *w)[1](dy)
        return ((dsum.astype(jnp.float32) + dres.astype(jnp.float32)).astype(res.dtype), *dw)

    n = 3 if weight is None else 4
    t = jax.jvp(math, primals[:n], tangents[:n])[1]
    return out, (t[0], None if weight is None else t[1])


def add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None, eps: float = 1e-6, *,
                 variant: str = "llama", residual_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Fused residual add + RMSNorm: `(y, residual_out)`, residual_out = (x.f32 + residual.f32) rounded once to
    `residual_dtype` (default: the promotion of x's and residual's dtypes), y = rms_norm(residual_out, weight,
    eps, variant=variant) with `normed` rounded to x's dtype; the torch front end's contract and bits.
    Differentiable in x, residual and weight (one d(residual_out) gradient, converted to each input's dtype)."""
    check_array("x", x)
    check_array("residual", residual)
    if weight is not None:
        check_array("weight", weight)
    if residual_dtype is not None:
        try:
            residual_dtype = jnp.dtype(residual_dtype).name
        except TypeError as e:
            raise TypeError(f"residual_dtype must be a dtype or None, got {residual_dtype!r}") from e
    _, res_dtype, variant = check_add_rms_norm(
        x.dtype.name, tuple(x.shape), residual.dtype.name, tuple(residual.shape),
        None if weight is None else weight.dtype.name, None if weight is None else tuple(weight.shape), eps, variant,
        residual_dtype)
    weight = None if weight is None else vary_like(weight, x)
    return _add_rms_norm(x, residual, weight, float(eps), variant, res_dtype)
