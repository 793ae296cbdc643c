"""SPMD partitioning of the jax_api ops under `jax.jit`: sharded inputs stay sharded.

Every kernel call of the ops goes through a `jax.experimental.custom_partitioning` function with a Shardy
`sharding_rule` (propagation) and a `partition` callback (what each device runs). On one device, and
inside `shard_map` (where the arrays already are per-shard), the plain single-device function runs.

RMSNorm, x [..., N] with any leading dims sharded over any mesh axes (every variant, with or without a
weight; the width-sharded kernels compute the Llama math with a weight, the others gather a sharded width):
- rows sharded (leading dims): each device runs the single-device kernels on its rows; y and dx keep x's
  sharding and are bitwise the single-device ones. dw: each device's fixed-order fp32 sum of its rows,
  all-reduced (psum) in fp32 over the axes that shard the rows, then rounded once to w's dtype. One device
  sums the same fp32 partial rows in another fixed order, so dw differs from it by fp32 reassociation only
  (deterministic for a given mesh).
- width sharded (N over mesh axes, tensor parallel): each device sums its columns of each row (fp32), one
  psum of those [rows] sums (one fp32 per row forward, two backward) over the hidden axes, then each device
  normalises its columns (the width-sharded kernels at the end of xkern/rms_norm.py). x is never gathered;
  w and dw are sharded like N. Results are within the fp32 contract of one device's (row sums reassociated).
Gathers (permute_rows, unpermute_rows), x [rows, H]: H sharded is local. The indices are global, so
sharded source rows are all-gathered over their axes first (rows x H/shards per device); permute_rows'
output is sharded like its indices, unpermute_rows' output rows are replicated. The index ops
(inverse_permutation, generate_permute_indices) run replicated: their inputs are all-gathered (integers).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_api._launch import _varying, call, host_custom_call, vary_like
from xkern.rms_norm import plan_rms_norm_bwd_width_sharded, plan_rms_norm_fwd_width_sharded


def _dims(arg) -> list[tuple[str, ...]]:
    """The mesh axes sharding each dim of `arg` (a ShapeDtypeStruct with a sharding), () where none."""
    sharding = arg.sharding
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    out = []
    for i in range(len(arg.shape)):
        entry = spec[i] if i < len(spec) else None
        if entry is None or entry is P.UNCONSTRAINED:
            out.append(())
        else:
            out.append((entry,) if isinstance(entry, str) else tuple(entry))
    return out


def _named(mesh, dims) -> NamedSharding:
    return NamedSharding(mesh, P(*[d if d else None for d in dims]))


def _local(fn):
    """`fn` as a per-shard function: its CPU launches become custom calls (see jax_api/_host_call.py)."""

    @functools.wraps(fn)
    def run(*args):
        with host_custom_call():
            return fn(*args)

    return run


def _partitioned(body, partition, rule: str, **factors):
    op = custom_partitioning(body)
    op.def_partition(partition=partition, sharding_rule=rule, **factors)

    def apply(*args):
        if any(_varying(a) for a in args):  # inside shard_map: already one shard
            return body(*args)
        return op(*args)

    return apply


def _factors(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# RMSNorm


@functools.cache
def rms_norm_fwd(body, eps: float, ndim: int, width_ok: bool = True, weighted: bool = True):
    """`body(x, w, eps)` (the single-device forward, x of rank `ndim`) partitioned. Without `width_ok` (the
    variants the width-sharded kernels do not compute) a sharded hidden dim is gathered first. Without
    `weighted`, the op takes x alone (`body(x, None, eps)`)."""
    rows = " ".join(_factors(ndim - 1))

    def partition(mesh, arg_shapes, result_shape):
        dims = _dims(arg_shapes[0])
        if not width_ok:
            dims[-1] = ()
        hidden = dims[-1]
        x_sharding = _named(mesh, dims)
        if not weighted:
            return mesh, _local(lambda x: body(x, None, eps)), x_sharding, (x_sharding,)
        if hidden:
            fn = functools.partial(_fwd_width_sharded, hidden, arg_shapes[0].shape[-1], eps)
        else:
            fn = lambda x, w: body(x, w, eps)  # noqa: E731
        return mesh, _local(fn), x_sharding, (x_sharding, _named(mesh, [hidden]))

    if not weighted:
        return _partitioned(lambda x: body(x, None, eps), partition, f"{rows} n -> {rows} n")
    return _partitioned(lambda x, w: body(x, w, eps), partition, f"{rows} n, n -> {rows} n")


@functools.cache
def rms_norm_bwd(body, eps: float, ndim: int, n_batch_dims: int, width_ok: bool = True, weighted: bool = True):
    """`body(dy, x, w, eps, n_batch_dims, dw_dtype)` (the single-device backward: dx, and dw with x's
    leading `n_batch_dims` dims, those of vmap) partitioned; `width_ok` as in `rms_norm_fwd`. Without
    `weighted`: (dy, x) -> dx."""
    batch, rows = _factors(n_batch_dims, "b"), _factors(ndim - 1 - n_batch_dims)
    lead = " ".join(batch + rows)

    def dx_only(dy, x):
        return body(dy, x, None, eps, n_batch_dims)[0]

    def partition(mesh, arg_shapes, result_shape):
        dims = _dims(arg_shapes[1])
        if not width_ok:
            dims[-1] = ()
        hidden = dims[-1]
        row_axes = tuple(a for d in dims[n_batch_dims:-1] for a in d)
        x_sharding = _named(mesh, dims)
        if not weighted:
            return mesh, _local(dx_only), x_sharding, (x_sharding, x_sharding)
        n_total = arg_shapes[1].shape[-1]

        def fn(dy, x, w):
            if hidden:
                dx, dw = _bwd_width_sharded(hidden, n_total, eps, n_batch_dims, dy, x, w)
            else:
                dx, dw = body(dy, x, w, eps, n_batch_dims, jnp.float32)
            if row_axes:  # the rows' dw of every device: one fp32 all-reduce, then w's dtype once
                dw = jax.lax.psum(dw, row_axes)
            return dx, dw.astype(w.dtype)

        dw_sharding = _named(mesh, dims[:n_batch_dims] + [hidden])
        return mesh, _local(fn), (x_sharding, dw_sharding), (x_sharding, x_sharding, _named(mesh, [hidden]))

    if not weighted:
        return _partitioned(dx_only, partition, f"{lead} n, {lead} n -> {lead} n")
    rule = f"{lead} n, {lead} n, n -> {lead} n, {' '.join(batch)} n"
    return _partitioned(lambda dy, x, w: body(dy, x, w, eps, n_batch_dims), partition, rule)


def _fwd_width_sharded(hidden, n_total: int, eps: float, x, w):
    """One shard's columns of the forward: local row sums, psum over `hidden`, local normalisation."""
    n_cols = x.shape[-1]
    out_dtype = jnp.promote_types(x.dtype, w.dtype)
    if x.size == 0:
        return jnp.zeros(x.shape, out_dtype)
    x2 = x.reshape(-1, n_cols)
    n_rows = x2.shape[0]
    sums, norm = plan_rms_norm_fwd_width_sharded(n_rows, n_cols, eps)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, n_total=n_total, x_row_stride=n_cols, y_row_stride=n_cols)
    (sum_sq,) = call(sums, [x2], [jax.ShapeDtypeStruct((n_rows,), jnp.float32)], **scalars)
    sum_sq = jax.lax.psum(vary_like(sum_sq, x), hidden)
    (y,) = call(norm, [x2, w, sum_sq], [jax.ShapeDtypeStruct(x2.shape, out_dtype)], **scalars)
    return y.reshape(x.shape)


def _bwd_width_sharded(hidden, n_total: int, eps: float, n_batch_dims: int, dy, x, w):
    """One shard's columns of the backward: dx [x's shape] and the fp32 dw of its rows [batch..., N/shards]."""
    n_cols = x.shape[-1]
    batch_shape = x.shape[:n_batch_dims]
    n_batch = math.prod(batch_shape)
    if x.size == 0:
        return jnp.zeros_like(x), jnp.zeros(batch_shape + (n_cols,), jnp.float32)
    n_rows = x.size // n_cols // n_batch
    plan = plan_rms_norm_bwd_width_sharded(n_rows, n_cols, eps, n_batch=n_batch)
    scalars = dict(n_rows=n_batch * n_rows, n_cols=n_cols, n_total=n_total, x_row_stride=n_cols,
                   dy_row_stride=n_cols, dx_row_stride=n_cols)
    inputs = [x.reshape(-1, n_cols), w, dy.reshape(-1, n_cols)]
    stats_type = jax.ShapeDtypeStruct((n_batch * n_rows, 2), jnp.float32)
    (sums,) = call(plan.sums, inputs, [stats_type], **scalars)
    sums = jax.lax.psum(vary_like(sums, x), hidden)
    (stats,) = call(plan.finish, [sums], [stats_type], **scalars)
    dx, partial = call(plan.bwd, inputs + [stats],
                       [jax.ShapeDtypeStruct(inputs[0].shape, x.dtype),
                        jax.ShapeDtypeStruct((n_batch * plan.n_partials, n_cols), jnp.float32)],
                       **{**scalars, "n_rows": n_rows})
    (dw,) = call(plan.reduce, [partial], [jax.ShapeDtypeStruct((n_batch, n_cols), jnp.float32)],
                 n_partials=plan.n_partials, n_cols=n_cols)
    return dx.reshape(x.shape), dw.reshape(batch_shape + (n_cols,))


# Inside shard_map the arrays are already per-shard, so a split hidden dim must be named:


def rms_norm_tp(x: jax.Array, weight: jax.Array, eps: float = 1e-6, *, axis_name) -> jax.Array:
    """`jax_api.rms_norm` inside `jax.shard_map` (check_vma=True) where x's last dim is split over the mesh
    axes `axis_name` (a name or a tuple): x [..., N/shards], weight [N/shards], this shard's columns. One
    psum of the [rows] sums over `axis_name`; x is never gathered. dw: this shard's columns, summed over
    the other axes x varies over (fp32 psum, then w's dtype). Under `jax.jit` without shard_map, plain
    `jax_api.rms_norm` does this by itself for an x whose last dim is sharded."""
    from jax_api.rms_norm import rms_norm

    if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in (x, weight)):
        rms_norm(x, weight, eps)  # raises the TypeError naming the argument
    # rms_norm's argument checks, on shapes only (nothing runs)
    jax.eval_shape(lambda a, b: rms_norm(a, b, eps), *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, weight)))
    axes = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(axes, tuple) or not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
    return _rms_norm_tp(axes, float(eps), x, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rms_norm_tp(axes, eps, x, weight):
    n_total = x.shape[-1] * math.prod(jax.lax.axis_size(a) for a in axes)
    return vary_like(_fwd_width_sharded(axes, n_total, eps, x, weight), x)


def _rms_norm_tp_fwd(axes, eps, x, weight):
    return _rms_norm_tp(axes, eps, x, weight), (x, weight)


def _rms_norm_tp_bwd(axes, eps, residuals, dy):
    x, weight = residuals
    n_total = x.shape[-1] * math.prod(jax.lax.axis_size(a) for a in axes)
    dx, dw = _bwd_width_sharded(axes, n_total, eps, 0, dy, x, weight)
    row_axes = tuple(sorted(_varying(x) - _varying(weight) - set(axes)))
    dw = jax.lax.psum(vary_like(dw, x), row_axes) if row_axes else vary_like(dw, weight)
    return vary_like(dx, x), dw.astype(weight.dtype)


_rms_norm_tp.defvjp(_rms_norm_tp_fwd, _rms_norm_tp_bwd)


# ---------------------------------------------------------------------------------------------------
# Gathers and index ops


@functools.cache
def gather_rows(body):
    """out = body(x, idx): out[i] = x[idx[i]], x [rows, H], idx [slots] (global row numbers)."""

    def partition(mesh, arg_shapes, result_shape):
        hidden = _dims(arg_shapes[0])[1]
        slots = tuple(a for a in _dims(arg_shapes[1])[0] if a not in hidden)
        out_sharding = _named(mesh, [slots, hidden])
        return (mesh, _local(lambda x, idx: body(x, idx, idx.shape[0])), out_sharding,
                (_named(mesh, [(), hidden]), _named(mesh, [slots])))

    op = _partitioned(lambda x, idx: body(x, idx, idx.shape[0]), partition, "r h, s -> s h",
                      need_replication_factors=("r",))
    return op


@functools.cache
def replicated(body, n_in: int, ranks: tuple[int, ...], out_ranks: tuple[int, ...]):
    """`body` run whole on every device (small integer ops): inputs all-gathered, outputs replicated."""
    names = iter(f"i{k}" for k in range(100))
    ins = [" ".join(next(names) for _ in range(r)) for r in ranks]
    outs = [" ".join(next(names) for _ in range(r)) for r in out_ranks]
    used = [f for group in ins + outs for f in group.split()]

    def partition(mesh, arg_shapes, result_shape):
        rep = NamedSharding(mesh, P())
        return mesh, _local(body), jax.tree.map(lambda _: rep, result_shape), (rep,) * n_in

    return _partitioned(body, partition, f"{', '.join(ins)} -> {', '.join(outs)}",
                        need_replication_factors=tuple(used))
