"""RMSNorm for JAX: `rms_norm`, a `jax.custom_vjp` function usable under jit, grad, vjp and vmap.

vmap: the kernel calls are `custom_vmap` functions, so a vmapped forward is just more rows, and a
vmapped backward launches once with a batch grid axis that keeps one dw per example. A batched weight
falls back to `lax.map` over the batch. Math and rounding: see `xkern/rms_norm.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_api._launch import call, map_batched, vary_like
from xkern.rms_norm import check_variant, out_dtype_name, plan_rms_norm_bwd, plan_rms_norm_fwd

_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32)


def _out_dtype(x, weight, variant):
    return jnp.dtype(out_dtype_name(x.dtype.name, None if weight is None else weight.dtype.name, variant))


# `variant` is check_variant's ("none" without a weight; `weight` is then None and x stands in for it).
def _fwd(x, weight, eps, variant):
    n_cols = x.shape[-1]
    out = jax.ShapeDtypeStruct(x.shape, _out_dtype(x, weight, variant))
    if x.size == 0:
        return jnp.zeros(out.shape, out.dtype)
    x2 = x.reshape(-1, n_cols)
    w = x2 if weight is None else weight
    plan = plan_rms_norm_fwd(x2.shape[0], n_cols, eps, (), max(x.dtype.itemsize, w.dtype.itemsize), variant)
    (y,) = call(plan, [x2, w], [jax.ShapeDtypeStruct(x2.shape, out.dtype)], n_rows=x2.shape[0],
                n_cols=n_cols, x_row_stride=n_cols, y_row_stride=n_cols)
    return y.reshape(x.shape)


def _bwd(dy, x, weight, eps, variant, n_batch_dims):
    """dx and dw (None without a weight); dw keeps the leading `n_batch_dims` axes of x (one dw per vmapped
    example)."""
    n_cols = x.shape[-1]
    batch_shape = x.shape[:n_batch_dims]
    n_batch = math.prod(batch_shape)
    if x.size == 0:
        return jnp.zeros_like(x), None if weight is None else jnp.zeros(batch_shape + weight.shape, weight.dtype)
    n_rows = x.size // n_cols // n_batch
    plan = plan_rms_norm_bwd(n_rows, n_cols, eps, n_batch=n_batch, variant=variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=n_cols, dy_row_stride=n_cols, dx_row_stride=n_cols)
    x2 = x.reshape(-1, n_cols)
    inputs = [x2, x2 if weight is None else weight, dy.reshape(-1, n_cols)]
    if plan.stats is not None:
        inputs += call(plan.stats, inputs, [jax.ShapeDtypeStruct((n_batch * n_rows, 2), jnp.float32)], **scalars)
    dx, partial = call(plan.bwd, inputs,
                       [jax.ShapeDtypeStruct(inputs[0].shape, x.dtype),
                        jax.ShapeDtypeStruct((n_batch * plan.n_partials, n_cols), jnp.float32)], **scalars)
    if plan.reduce is None:
        return dx.reshape(x.shape), None
    (dw,) = call(plan.reduce, [partial], [jax.ShapeDtypeStruct((n_batch, n_cols), weight.dtype)],
                 n_partials=plan.n_partials, n_cols=n_cols)
    return dx.reshape(x.shape), dw.reshape(batch_shape + weight.shape)


@functools.cache
def _fwd_op(eps: float, variant: str):
    @jax.custom_batching.custom_vmap
    def op(x, weight):
        return _fwd(x, weight, eps, variant)

    @op.def_vmap
    def _(axis_size, in_batched, x, weight):
        x_batched, w_batched = in_batched
        if w_batched:
            return map_batched(op, axis_size, in_batched, x, weight), True
        return op(x, weight), True  # batch axis 0 of x: more rows

    return op


@functools.cache
def _bwd_op(eps: float, variant: str, n_batch_dims: int):
    @jax.custom_batching.custom_vmap
    def op(dy, x, weight):
        return _bwd(dy, x, weight, eps, variant, n_batch_dims)

    @op.def_vmap
    def _(axis_size, in_batched, dy, x, weight):
        if in_batched[2]:
            return map_batched(op, axis_size, in_batched, dy, x, weight), (True, True)
        dy, x = (a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip((dy, x), in_batched))
        return _bwd_op(eps, variant, n_batch_dims + 1)(dy, x, weight), (True, None if weight is None else True)

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, variant):
    return vary_like(_fwd_op(eps, variant)(x, weight), x)


def _rms_norm_fwd(x, weight, eps, variant):
    return _rms_norm(x, weight, eps, variant), (x, weight)


def _rms_norm_bwd(eps, variant, residuals, dy):
    x, weight = residuals
    dx, dw = _bwd_op(eps, variant, 0)(dy, x, weight)
    return vary_like(dx, x), None if weight is None else vary_like(dw, weight)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float = 1e-6, *, variant: str = "llama") -> jax.Array:
    """Hugging Face Llama RMSNorm over the last axis: `w * (x.f32 * rsqrt(mean(x.f32**2) + eps)).astype(
    x.dtype)`, fp32 statistics; differentiable in `x` and `weight` (jax.custom_vjp).

    x: [..., N], float16 / bfloat16 / float32, any N >= 1. weight: [N], x's dtype or float32; the output
    dtype is x's when they match, else float32 (PyTorch's promotion, as the torch front end). None: no
    weight, `normed.astype(x.dtype)`.
    variant: "llama" (above), "gemma" `(normed * (1 + w.f32)).astype(x.dtype)`, "olmo2"
    `(w * normed).astype(x.dtype)` (output dtype x's), with normed = x.f32 * rsqrt(mean(x.f32**2) + eps).
    """
    variant = check_variant(variant, weight is not None)
    for name, a in (("x", x), ("weight", weight)):
        if (a is not None or name == "x") and (not hasattr(a, "dtype") or not hasattr(a, "shape")):
            raise TypeError(f"{name} must be a jax array, got {type(a).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight is not None and weight.dtype not in (x.dtype, jnp.float32):
        raise TypeError(f"weight must have x's dtype ({x.dtype}) or float32, got {weight.dtype}")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension [..., N], got a scalar")
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    # Inside shard_map a replicated weight is made varying like x, so its cotangent (one dw per shard) is
    # summed over the mesh axes by the transpose of that cast.
    weight = None if weight is None else vary_like(weight, x)
    return _rms_norm(x, weight, float(eps), variant)
