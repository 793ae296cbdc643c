"""RMSNorm for JAX: `rms_norm`, a `jax.custom_jvp` function usable under every transformation (jit, jvp, grad,
hessian, vmap, scan, checkpoint, shard_map, sharded jit, export): forward mode through a jnp tangent, reverse
mode through the backward kernel (docs/design.md, "JAX autodiff").

vmap: the kernel calls are `custom_vmap` functions, so a vmapped forward is just more rows, and a
vmapped backward launches once with a batch grid axis that keeps one dw per example. A batched weight
falls back to `lax.map` over the batch. Math and rounding: see `xkern/rms_norm/kernels.py`. Under `jax.jit` the
kernel calls partition themselves (jax_api/sharding.py); inside `jax.shard_map` with the hidden dim split,
`rms_norm_tp` (at the end) names the axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_api import sharding
from jax_api._launch import check_array, execute, map_batched, vary_like, varying
from jax_api._linear import linear
from xkern.launch import check_float
from xkern.rms_norm import check_rms_norm, rms_norm_bwd_recipe, rms_norm_fwd_recipe


# `variant` is check_rms_norm's ("none" without a weight: `weight` is then None, and the recipe reads x alone).
def _fwd(x, weight, eps, variant="llama"):
    n_cols = x.shape[-1]
    n_rows = x.size // n_cols if n_cols else math.prod(x.shape[:-1])
    recipe = rms_norm_fwd_recipe(n_rows, n_cols, eps, x.dtype.name, None if weight is None else weight.dtype.name,
                                 variant=variant)
    (y,) = execute(recipe, x=x.reshape(n_rows, n_cols), w=weight)
    return y.reshape(x.shape)


def _bwd(dy, x, weight, eps, n_batch_dims, dw_dtype=None, variant="llama"):
    """dx and dw (None without a weight); dw keeps the leading `n_batch_dims` axes of x (one dw per vmapped
    example), in `dw_dtype` (default: weight's)."""
    n_cols = x.shape[-1]
    batch_shape = x.shape[:n_batch_dims]
    n_batch = math.prod(batch_shape)
    n_rows = math.prod(x.shape[n_batch_dims:-1])
    recipe = rms_norm_bwd_recipe(n_rows, n_cols, eps, x.dtype.name, None if weight is None else weight.dtype.name,
                                 n_batch=n_batch, dw_dtype=None if dw_dtype is None else jnp.dtype(dw_dtype).name,
                                 variant=variant)
    flat = (n_batch * n_rows, n_cols)
    dx, dw = execute(recipe, x=x.reshape(flat), w=weight, dy=dy.reshape(flat))
    return dx.reshape(x.shape), None if weight is None else dw.reshape(batch_shape + weight.shape)


@functools.cache
def _fwd_op(eps: float, variant: str):
    # Partitioned under jit (jax_api/sharding.py).
    body = functools.partial(_fwd, variant=variant)

    @jax.custom_batching.custom_vmap
    def op(x, weight):
        if weight is None:
            return sharding.rms_norm_fwd(body, eps, x.ndim, variant, weighted=False)(x)
        return sharding.rms_norm_fwd(body, eps, x.ndim, variant)(x, weight)

    @op.def_vmap
    def _(axis_size, in_batched, x, weight):
        x_batched, w_batched = in_batched
        if w_batched:
            return map_batched(op, axis_size, in_batched, x, weight), True
        return op(x, weight), True  # batch axis 0 of x: more rows

    return op


@functools.cache
def _bwd_op(eps: float, variant: str, n_batch_dims: int):
    body = functools.partial(_bwd, variant=variant)

    @jax.custom_batching.custom_vmap
    def op(dy, x, weight):
        if weight is None:
            return sharding.rms_norm_bwd(body, eps, x.ndim, n_batch_dims, variant,
                                         weighted=False)(dy, x), None
        partitioned = sharding.rms_norm_bwd(body, eps, x.ndim, n_batch_dims, variant)
        return tuple(partitioned(dy, x, weight))

    @op.def_vmap
    def _(axis_size, in_batched, dy, x, weight):
        if in_batched[2]:
            return map_batched(op, axis_size, in_batched, dy, x, weight), (True, True)
        dy, x = (a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip((dy, x), in_batched))
        return _bwd_op(eps, variant, n_batch_dims + 1)(dy, x, weight), (True, None if weight is None else True)

    return op


# Autodiff (docs/design.md): a custom_jvp whose primal is the forward kernel and whose tangent is `linear` in
# the tangents: a jnp expression of the linearized math, transposed by the backward kernel (jax.grad runs it,
# never the jnp transpose). The backward kernel is itself a custom_jvp (a jnp tangent), so every order works.


def norm_math(x, weight, eps: float, variant: str, out_dtype, normed_dtype=None):
    """The forward in jnp, fp32 statistics, rounded where the kernels round (`normed` to `normed_dtype`,
    default x's, for Llama's; the output to `out_dtype`): what the tangents and second derivatives follow."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return normed.astype(out_dtype)
    w32 = weight.astype(jnp.float32)
    if variant == "llama":
        return (w32 * normed.astype(normed_dtype or x.dtype).astype(jnp.float32)).astype(out_dtype)
    if variant == "gemma":
        return (normed * (1 + w32)).astype(out_dtype)
    return (w32 * normed).astype(out_dtype)


def with_weight(fn, weighted: bool):
    """fn(x, w, ...) as a function of the flat arrays (x, w) or (x,) (a call without a weight)."""
    return fn if weighted else (lambda x, *rest: fn(x, None, *rest))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, variant):
    return vary_like(_fwd_op(eps, variant)(x, weight), x)


@_rms_norm.defjvp
def _rms_norm_jvp(eps, variant, primals, tangents):
    x, weight = primals
    y = _rms_norm(x, weight, eps, variant)
    n = 1 if weight is None else 2
    math = with_weight(lambda a, b: norm_math(a, b, eps, variant, y.dtype), n == 2)

    def tangent(*args):  # residuals (x, w), tangents (tx, tw): linear in the tangents
        return [jax.jvp(math, args[:n], args[n:])[1]]

    def transpose(*args):  # residuals (x, w), cotangent dy: the backward kernel
        grads = _backward(args[n], args[0], None if n == 1 else args[1], eps, variant)
        return list(grads[:n])

    (t,) = linear(tangent, transpose, primals[:n], tangents[:n])
    return y, t


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _backward(dy, x, weight, eps, variant):
    """(dx, dw) from the backward kernel; dw None without a weight."""
    dx, dw = _bwd_op(eps, variant, 0)(dy, x, weight)
    return vary_like(dx, x), None if weight is None else vary_like(dw, weight)


@_backward.defjvp
def _backward_jvp(eps, variant, primals, tangents):
    dy, x, weight = primals
    out = _backward(dy, x, weight, eps, variant)

    def math(dy, x, *w):  # the backward as jnp: the vjp of norm_math
        pullback = jax.vjp(with_weight(lambda a, b: norm_math(a, b, eps, variant, dy.dtype), bool(w)), x, *w)[1]
        return pullback(dy)

    n = 2 if weight is None else 3
    t = jax.jvp(math, primals[:n], tangents[:n])[1]
    return out, (t[0], None if weight is None else t[1])


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float = 1e-6, *, variant: str = "llama") -> jax.Array:
    """Hugging Face Llama RMSNorm over the last axis: `w * (x.f32 * rsqrt(mean(x.f32**2) + eps)).astype(
    x.dtype)`, fp32 statistics; differentiable in `x` and `weight` to any order, forward and reverse.

    x: [..., N], float16 / bfloat16 / float32, any N >= 0. weight: [N], float16 / bfloat16 / float32; the
    output dtype is their promotion (float32 when they differ), as in the torch front end. None: no weight,
    `normed.astype(x.dtype)`.
    variant: "llama" (above), "gemma" `(normed * (1 + w.f32)).astype(x.dtype)`, "olmo2"
    `(w * normed).astype(x.dtype)` (output dtype x's), with normed = x.f32 * rsqrt(mean(x.f32**2) + eps).
    """
    check_array("x", x)
    if weight is not None:
        check_array("weight", weight)
    eps = check_float("eps", eps)  # a float before any cache (xkern.launch.check_int says why)
    _, variant = check_rms_norm(x.dtype.name, tuple(x.shape), None if weight is None else weight.dtype.name,
                                None if weight is None else tuple(weight.shape), eps, variant)
    # Inside shard_map a replicated weight is made varying like x, so its cotangent (one dw per shard) is
    # summed over the mesh axes by the transpose of that cast.
    weight = None if weight is None else vary_like(weight, x)
    return _rms_norm(x, weight, eps, variant)


# Inside shard_map the arrays are already per-shard, so a split hidden dim must be named:


def rms_norm_tp(x: jax.Array, weight: jax.Array, eps: float = 1e-6, *, axis_name) -> jax.Array:
    """`jax_api.rms_norm` inside `jax.shard_map` (check_vma=True) where x's last dim is split over the mesh
    axes `axis_name` (a name or a tuple): x [..., N/shards], weight [N/shards], this shard's columns. One
    psum of the [rows] sums over `axis_name`; x is never gathered. dw: this shard's columns, summed over
    the other axes x varies over (fp32 psum, then w's dtype). Under `jax.jit` without shard_map, plain
    `jax_api.rms_norm` does this by itself for an x whose last dim is sharded."""
    if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in (x, weight)):
        rms_norm(x, weight, eps)  # raises the TypeError naming the argument
    # rms_norm's argument checks, on shapes only (nothing runs)
    jax.eval_shape(lambda a, b: rms_norm(a, b, eps), *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, weight)))
    axes = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
    return _rms_norm_tp(axes, float(eps), x, weight)


def _tp_total(axes, x) -> int:
    return x.shape[-1] * math.prod(jax.lax.axis_size(a) for a in axes)


def _tp_math(axes, eps: float, out_dtype, x, weight):
    """norm_math over a width split across `axes`: the row sums psum'd (what the tangents follow)."""
    x32 = x.astype(jnp.float32)
    sum_sq = jax.lax.psum(jnp.sum(x32 * x32, axis=-1, keepdims=True), axes)
    normed = x32 * jax.lax.rsqrt(sum_sq / _tp_total(axes, x) + eps)
    return (weight.astype(jnp.float32) * normed.astype(x.dtype).astype(jnp.float32)).astype(out_dtype)


# Autodiff as rms_norm's: a custom_jvp whose tangent is `linear`, transposed by the width-sharded backward kernels.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _rms_norm_tp(axes, eps, x, weight):
    return vary_like(sharding.fwd_width_sharded(axes, _tp_total(axes, x), eps, x, weight), x)


@_rms_norm_tp.defjvp
def _rms_norm_tp_jvp(axes, eps, primals, tangents):
    y = _rms_norm_tp(axes, eps, *primals)
    norm = functools.partial(_tp_math, axes, eps, y.dtype)
    (t,) = linear(lambda x, w, tx, tw: [jax.jvp(norm, (x, w), (tx, tw))[1]],
                  lambda x, w, dy: list(_tp_backward(axes, eps, dy, x, w)), primals, tangents)
    return y, t


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _tp_backward(axes, eps, dy, x, weight):
    dx, dw = sharding.bwd_width_sharded(axes, _tp_total(axes, x), eps, 0, dy, x, weight)
    row_axes = tuple(sorted(varying(x) - varying(weight) - set(axes)))
    dw = jax.lax.psum(vary_like(dw, x), row_axes) if row_axes else vary_like(dw, weight)
    return vary_like(dx, x), dw.astype(weight.dtype)


@_tp_backward.defjvp
def _tp_backward_jvp(axes, eps, primals, tangents):
    dy, x, weight = primals
    out = _tp_backward(axes, eps, dy, x, weight)
    norm = functools.partial(_tp_math, axes, eps, dy.dtype)
    return out, jax.jvp(lambda dy, x, w: jax.vjp(norm, x, w)[1](dy), primals, tangents)[1]
