"""Gated RMSNorm for JAX: `gated_rms_norm`, a `jax.custom_jvp` function usable under every transformation, the
same kernels and recipes as the torch front end (bit for bit its results). Math and rounding:
`xkern/gated_rms_norm/kernels.py`.

Under `jax.jit` each kernel call partitions itself over the leading dims (tokens, heads: any mesh axes):
every device runs the single-device kernels on its rows, y, dx and dz keep x's sharding and are bitwise one
device's; dw is each device's fixed-order fp32 sum, all-reduced in fp32 over the row axes, then rounded once
to w's dtype. A sharded last dim (the norm's width) is gathered first.

vmap: the forward takes the batch axis as more rows (a batched weight: one call per example), the backward
one call per example (one dw each). Differentiable to any order, forward and reverse (jvp, grad, vjp, jacrev,
hessian, vmap of grad: docs/transformations.md), reverse mode on the backward kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_api._launch import check_array, execute, map_batched, vary_like
from jax_api._linear import linear
from jax_api.sharding import dim_axes, factor_names, named_sharding, partitioned, per_shard
from xkern.gated_rms_norm import check_gated_rms_norm, gated_rms_norm_bwd_recipe, gated_rms_norm_fwd_recipe
from xkern.launch import check_float


def _rows(x):
    n_cols = x.shape[-1]
    return math.prod(x.shape[:-1]), n_cols


def _fwd(x, z, w, options):
    eps, group_size, norm_before_gate, activation, rounding = options
    n_rows, n_cols = _rows(x)
    recipe = gated_rms_norm_fwd_recipe(n_rows, n_cols, group_size, eps, x.dtype.name, w.dtype.name,
                                       norm_before_gate=norm_before_gate, activation=activation, rounding=rounding)
    (y,) = execute(recipe, x=x.reshape(n_rows, n_cols), z=z.reshape(n_rows, n_cols), w=w)
    return y.reshape(x.shape)


def _bwd(dy, x, z, w, options, dw_dtype=None):
    eps, group_size, norm_before_gate, activation, rounding = options
    n_rows, n_cols = _rows(x)
    recipe = gated_rms_norm_bwd_recipe(n_rows, n_cols, group_size, eps, x.dtype.name, w.dtype.name,
                                       norm_before_gate=norm_before_gate, activation=activation, rounding=rounding,
                                       dw_dtype=None if dw_dtype is None else jnp.dtype(dw_dtype).name)
    flat = (n_rows, n_cols)
    dx, dz, dw = execute(recipe, x=x.reshape(flat), z=z.reshape(flat), w=w, dy=dy.reshape(flat))
    return dx.reshape(x.shape), dz.reshape(x.shape), dw.reshape(w.shape)


@functools.cache
def _fwd_op(options, ndim: int):
    """The forward, partitioned over x's leading dims under jit."""
    rows = " ".join(factor_names(ndim - 1))

    def partition(mesh, arg_shapes, result_shape):
        dims = dim_axes(arg_shapes[0])
        dims[-1] = ()  # a row (or group) is normalised on one device
        x_sharding = named_sharding(mesh, dims)
        return (mesh, per_shard(lambda x, z, w: _fwd(x, z, w, options)), x_sharding,
                (x_sharding, x_sharding, named_sharding(mesh, [()])))

    run = partitioned(lambda x, z, w: _fwd(x, z, w, options), partition, f"{rows} n, {rows} n, n -> {rows} n")

    @jax.custom_batching.custom_vmap
    def op(x, z, w):
        return run(x, z, w)

    @op.def_vmap
    def _(axis_size, in_batched, x, z, w):
        if in_batched[2]:  # a weight per example: one call each
            return map_batched(op, axis_size, in_batched, x, z, w), True
        x, z = (a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip((x, z), in_batched))
        return _fwd_op(options, ndim + 1)(x, z, w), True  # the batch axis: more rows

    return op


@functools.cache
def _bwd_op(options, ndim: int):
    """The joint backward, partitioned like the forward; dw summed in fp32 over the row axes."""
    rows = " ".join(factor_names(ndim - 1))

    def partition(mesh, arg_shapes, result_shape):
        dims = dim_axes(arg_shapes[1])
        dims[-1] = ()
        row_axes = tuple(a for d in dims[:-1] for a in d)
        x_sharding = named_sharding(mesh, dims)

        def fn(dy, x, z, w):
            dx, dz, dw = _bwd(dy, x, z, w, options, jnp.float32)
            if row_axes:  # one fp32 all-reduce of the devices' dw, then w's dtype once
                dw = jax.lax.psum(dw, row_axes)
            return dx, dz, dw.astype(w.dtype)

        w_sharding = named_sharding(mesh, [()])
        return (mesh, per_shard(fn), (x_sharding, x_sharding, w_sharding),
                (x_sharding, x_sharding, x_sharding, w_sharding))

    rule = f"{rows} n, {rows} n, {rows} n, n -> {rows} n, {rows} n, n"
    run = partitioned(lambda dy, x, z, w: _bwd(dy, x, z, w, options), partition, rule)

    @jax.custom_batching.custom_vmap
    def op(dy, x, z, w):
        return tuple(run(dy, x, z, w))

    @op.def_vmap
    def _(axis_size, in_batched, dy, x, z, w):  # one dw per example: one call each
        return map_batched(op, axis_size, in_batched, dy, x, z, w), (True, True, True)

    return op


def gated_math(x, z, w, eps, group_size=None, norm_before_gate=True, activation="silu", rounding="llama"):
    """The Hugging Face expression in jax.numpy, rounded where the kernels round (fp32 statistics): what the
    forward-mode tangents follow, and the jnp peer of the benchmark."""
    zf = z.astype(jnp.float32)
    a = jax.nn.sigmoid(zf) if activation == "sigmoid" else zf * jax.nn.sigmoid(zf)
    h = x.astype(jnp.float32) if norm_before_gate else x.astype(jnp.float32) * a
    size = group_size or h.shape[-1]
    hg = h.reshape(*h.shape[:-1], h.shape[-1] // size, size)
    n = (hg * jax.lax.rsqrt(jnp.mean(hg * hg, axis=-1, keepdims=True) + eps)).reshape(h.shape)
    p = w * n.astype(x.dtype) if rounding == "llama" else w.astype(jnp.float32) * n
    if norm_before_gate:
        return (p * a).astype(x.dtype)
    return p if rounding == "llama" else p.astype(x.dtype)


# Autodiff (docs/design.md, as jax_api/rms_norm.py): a custom_jvp whose primal is the forward kernel and whose
# tangent is `linear` in the tangents: the jvp of `gated_math`, transposed by the joint backward kernel (jax.grad
# runs it, never a jnp transpose). The backward is itself a custom_jvp (a jnp tangent), so every order works.
@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _gated(x, z, w, options):
    return vary_like(_fwd_op(options, x.ndim)(x, z, w), x)


@_gated.defjvp
def _gated_jvp(options, primals, tangents):
    y = _gated(*primals, options)
    math = lambda x, z, w: gated_math(x, z, w, *options)  # noqa: E731
    (t,) = linear(lambda x, z, w, tx, tz, tw: [jax.jvp(math, (x, z, w), (tx, tz, tw))[1]],
                  lambda x, z, w, dy: list(_backward(dy, x, z, w, options)), primals, tangents)
    return y, t


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _backward(dy, x, z, w, options):
    """(dx, dz, dw) from the joint backward kernel."""
    dx, dz, dw = _bwd_op(options, x.ndim)(dy, x, z, w)
    return vary_like(dx, x), vary_like(dz, z), vary_like(dw, w)


@_backward.defjvp
def _backward_jvp(options, primals, tangents):
    out = _backward(*primals, options)

    def math(dy, x, z, w):  # the backward as jnp: the vjp of gated_math
        return jax.vjp(lambda a, b, c: gated_math(a, b, c, *options), x, z, w)[1](dy)

    return out, jax.jvp(math, primals, tangents)[1]


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float = 1e-6, *,
                   group_size: int | None = None, norm_before_gate: bool = True, activation: str = "silu",
                   rounding: str = "llama") -> jax.Array:
    """Gated RMSNorm of the hybrid models (Qwen3-Next, Kimi Linear, Mamba2, Nemotron-H, Falcon-H1, ...),
    bit for bit the torch front end's `gated_rms_norm`; differentiable in x, gate and weight.

    Args:
      x: [..., N], float16 / bfloat16 / float32.
      gate: x's shape and dtype.
      weight: [N].
      eps: added to the mean square.
      group_size: the norm runs over groups of this many columns (dividing N); None: the whole row.
      norm_before_gate: True `y = (p * act(gate.f32)).astype(x.dtype)`, p = w * normed; False: normed of
        `x.f32 * act(gate.f32)`, y = p.
      activation: "silu" or "sigmoid".
      rounding: "llama" p = w * normed.astype(x.dtype) (in promote(w, x)); "fp32" p = w.f32 * normed.

    Example: `gated_rms_norm(o, z, w, 1e-6)` (Qwen3-Next's linear attention output, o and z [T, 32, 128]).
    """
    for name, a in (("x", x), ("gate", gate), ("weight", weight)):
        check_array(name, a)
    eps = check_float("eps", eps)
    _, group_size = check_gated_rms_norm(x.dtype.name, tuple(x.shape), gate.dtype.name, tuple(gate.shape),
                                         weight.dtype.name, tuple(weight.shape), eps, group_size, norm_before_gate,
                                         activation, rounding)
    return _gated(x, gate, vary_like(weight, x), (eps, group_size, norm_before_gate, activation, rounding))
