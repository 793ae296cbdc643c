"""SPMD partitioning of the jax_api ops under `jax.jit` and explicit meshes: sharded inputs stay sharded.

Every kernel call of the ops goes through `partitioned`: a `jax.experimental.custom_partitioning` function with
a Shardy `sharding_rule` (propagation) and a `partition` callback (what each device runs). Under a mesh with
Explicit axes (sharding in types: `jax.make_mesh`'s default), the same callback's per-shard function runs in a
`jax.shard_map` and the results are typed as the rule's factors give them (`explicit`), eager and under jit.
On one device, and inside `shard_map` (where the arrays already are per-shard), the plain function runs.

RMSNorm, x [..., N] with any leading dims sharded over any mesh axes (every variant, with or without a
weight; the width-sharded kernels compute the Llama math with a weight, the others gather a sharded width):
- rows sharded (leading dims): each device runs the single-device kernels on its rows; y and dx keep x's
  sharding and are bitwise the single-device ones. dw: each device's fixed-order fp32 sum of its rows,
  all-reduced (psum) in fp32 over the axes that shard the rows, then rounded once to w's dtype. One device
  sums the same fp32 partial rows in another fixed order, so dw differs from it by fp32 reassociation only
  (deterministic for a given mesh).
- width sharded (N over mesh axes, tensor parallel): each device sums its columns of each row (fp32), one
  psum of those [rows] sums (one fp32 per row forward, two backward) over the hidden axes, then each device
  normalises its columns (the width-sharded kernels, xkern/rms_norm/width_sharded.py). x is never gathered;
  w and dw are sharded like N. Results are within the fp32 contract of one device's (row sums reassociated).
Gathers and combines (permute_rows, unpermute_rows, with and without top_k and probs), rows [n, H]: a sharded
H is local. The indices are global, so a device all-gathers the rows it reads (rows x H/shards) and, to
find its rows' slots, the indices (integers); it then computes its share of the output: a permute's slots
sharded like the indices; a combine's tokens like probs (without probs: like x in a permute's backward,
else like the output's users); a plain unpermute's rows like x in a permute's backward, else like the
output's users. The weighted combine's backward runs on the slots, all-gathering dout's rows and probs;
dprobs takes one FP32 all-reduce of [T, top_k] over the slot and hidden axes (each copy is one device's
term; with H sharded, the devices' column sums). Results are bitwise one device's, but for dprobs with a
sharded H (within the FP32 contract). The index ops read all-gathered indices or counts:
inverse_permutation's rows split like its output's users, generate_permute_indices runs replicated.
The grouped GEMM (grouped_mm) [S, K] x [E, K, N], Megatron's rules from w's sharding (never gathered): each
device computes its rows (x's row sharding, the offsets counted from its first row) on its output columns (w's
sharding of them); a sharded contracted dim (row parallel, or dy @ w.T under a column-parallel w) gives FP32
partial products and one FP32 psum; sharded experts give each device its experts' rows (one psum, exact) and
their weight gradient (the offsets carry w's expert sharding to it, `expert_offsets`); the weight gradient is
each device's (K, N) block over all the rows. Bitwise one device's but for a split contracted dim (the FP32
contract).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_api._launch import call, host_custom_call, vary_like, varying
from xkern.rms_norm import out_dtype_name, plan_rms_norm_bwd_width_sharded, plan_rms_norm_fwd_width_sharded


def dim_axes(arg) -> list[tuple[str, ...]]:
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


def named_sharding(mesh, dims) -> NamedSharding:
    return NamedSharding(mesh, P(*[d if d else None for d in dims]))


def per_shard(fn):
    """`fn` as a per-shard function: its CPU launches become custom calls (see jax_api/_host_call.py)."""

    @functools.wraps(fn)
    def run(*args):
        with host_custom_call():
            return fn(*args)

    return run


def partitioned(body, partition, rule: str, **factors):
    """`body` partitioned by `partition` (custom_partitioning's callback) under jit, with the Shardy `rule`;
    under an explicit mesh the same callback's per-shard function runs in a shard_map (`explicit`)."""
    op = custom_partitioning(lambda *args: body(*args))  # positional only: body may be a partial with keywords
    op.def_partition(partition=partition, sharding_rule=rule, **factors)

    def apply(*args):
        if any(varying(a) for a in args):  # inside shard_map: already one shard
            return body(*args)
        mesh = explicit_mesh(args)
        if mesh is not None:
            return explicit(mesh, body, partition, rule, args)
        return op(*args)

    return apply


# ---------------------------------------------------------------------------------------------------
# Explicit meshes (sharding in types)
#
# Under a mesh with Explicit axes (jax.make_mesh's default) the sharding is part of each array's type and
# jit does not propagate it: an op's result type comes from its inputs' types. custom_partitioning has no
# say there (its outputs would be typed replicated), so the op runs as a shard_map over the explicit axes
# with the same per-shard function and specs the partition callback chooses under jit. The result then
# gets the type the rule's factors give it, as a jnp expression's would: an output dim sharded like the
# input dims of its factor (`rule_specs`); where the callback computed it otherwise (a hidden dim gathered
# for a variant without width-sharded kernels), a reshard makes it so (a local slice, no collective).


def explicit_mesh(args):
    """The mesh of the first argument whose type names a mesh with Explicit axes, else None."""
    for a in args:
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def rows_like(x):
    """x's first column [rows, 1], split like x's rows. Under an explicit mesh zeros typed so (their values
    are not read; slicing a split hidden dim is refused there)."""
    mesh = explicit_mesh([x])
    if mesh is None:
        return x[:, :1]
    with _mesh_context(mesh, [x]):
        return jnp.zeros((x.shape[0], 1), x.dtype, out_sharding=P(_type_spec(x)[0], None))


def explicit(mesh, body, partition, rule: str, args):
    """`body(*args)` on an explicit mesh: the partition callback's per-shard function in a shard_map."""
    with _mesh_context(mesh, args):
        return _explicit(mesh, body, partition, rule, args)


def _mesh_context(mesh, args):
    """The arguments' mesh as the context mesh where none is set (typed arrays used outside `jax.set_mesh`):
    a concrete array's own mesh, else (tracing) the abstract one."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    if not any(isinstance(a, jax.core.Tracer) for a in args):
        for a in args:
            sharding = getattr(a, "sharding", None)
            if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
                with contextlib.suppress(ValueError):  # refused inside jit (constants traced there)
                    return jax.set_mesh(sharding.mesh)
    return jax.sharding.use_abstract_mesh(mesh)


def _explicit(mesh, body, partition, rule: str, args):
    axes = frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
    arg_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, _type_spec(a))) for a in args]
    result = jax.eval_shape(body, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    result = jax.tree.map(lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype), result)
    _, fn, out_shardings, arg_shardings = partition(mesh, arg_shapes, result)
    in_specs = tuple(s.spec for s in arg_shardings)
    out_specs = jax.tree.map(lambda s: s.spec, out_shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    args = [jax.sharding.reshard(a, spec) for a, spec in zip(args, in_specs)]
    out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes,
                        check_vma=False)(*args)
    single = not isinstance(out, (tuple, list))
    outs = [out] if single else list(out)
    wanted = rule_specs(rule, [_type_spec(a) for a in arg_shapes], [o.ndim for o in outs])
    outs = [o if _same(_type_spec(o), spec) else jax.sharding.reshard(o, spec) for o, spec in zip(outs, wanted)]
    return outs[0] if single else type(out)(outs)


def _type_spec(a) -> P:
    sharding = a.sharding if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a).sharding
    spec = tuple(sharding.spec) if sharding is not None else ()
    return P(*spec, *([None] * (len(a.shape) - len(spec))))


def _same(a: P, b: P) -> bool:
    norm = lambda s: [(e,) if isinstance(e, str) else tuple(e or ()) for e in s]  # noqa: E731
    return norm(a) == norm(b)


def rule_specs(rule: str, in_specs, out_ranks) -> list[P]:
    """The output specs a Shardy-style `rule` ("s k, e k n, e -> s n") gives: each output dim sharded over
    the mesh axes of the first input dim of its factor, less axes an earlier dim of that output took."""
    ins, outs = (part.split(",") for part in rule.split("->"))
    axes_of = {}
    for factors, spec in zip(ins, in_specs):
        for f, entry in zip(factors.split(), spec):
            if entry is not None and f not in axes_of:
                axes_of[f] = (entry,) if isinstance(entry, str) else tuple(entry)
    specs = []
    for factors, rank in zip(outs, out_ranks):
        taken, dims = set(), []
        for f in factors.split()[:rank]:
            mine = tuple(a for a in axes_of.get(f, ()) if a not in taken)
            taken.update(mine)
            dims.append(mine[0] if len(mine) == 1 else (mine or None))
        specs.append(P(*dims))
    return specs


def factor_names(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# RMSNorm


@functools.cache
def rms_norm_fwd(body, eps: float, ndim: int, variant: str = "llama", weighted: bool = True):
    """`body(x, w, eps)` (the single-device forward, x of rank `ndim`) partitioned; a sharded hidden dim by
    the width-sharded kernels of `variant` (check_variant's). Without `weighted`, the op takes x alone
    (`body(x, None, eps)`)."""
    rows = " ".join(factor_names(ndim - 1))

    def partition(mesh, arg_shapes, result_shape):
        dims = dim_axes(arg_shapes[0])
        hidden = dims[-1]
        x_sharding = named_sharding(mesh, dims)
        n_total = arg_shapes[0].shape[-1]
        if not weighted:
            fn = (lambda x: fwd_width_sharded(hidden, n_total, eps, x, None, variant)) if hidden else \
                (lambda x: body(x, None, eps))
            return mesh, per_shard(fn), x_sharding, (x_sharding,)
        if hidden:
            fn = functools.partial(fwd_width_sharded, hidden, n_total, eps, variant=variant)
        else:
            fn = lambda x, w: body(x, w, eps)  # noqa: E731
        return mesh, per_shard(fn), x_sharding, (x_sharding, named_sharding(mesh, [hidden]))

    if not weighted:
        return partitioned(lambda x: body(x, None, eps), partition, f"{rows} n -> {rows} n")
    return partitioned(lambda x, w: body(x, w, eps), partition, f"{rows} n, n -> {rows} n")


@functools.cache
def rms_norm_bwd(body, eps: float, ndim: int, n_batch_dims: int, variant: str = "llama", weighted: bool = True):
    """`body(dy, x, w, eps, n_batch_dims, dw_dtype)` (the single-device backward: dx, and dw with x's
    leading `n_batch_dims` dims, those of vmap) partitioned; `variant` as in `rms_norm_fwd`. Without
    `weighted`: (dy, x) -> dx."""
    batch, rows = factor_names(n_batch_dims, "b"), factor_names(ndim - 1 - n_batch_dims)
    lead = " ".join(batch + rows)

    def dx_only(dy, x):
        return body(dy, x, None, eps, n_batch_dims)[0]

    def partition(mesh, arg_shapes, result_shape):
        dims = dim_axes(arg_shapes[1])
        hidden = dims[-1]
        row_axes = tuple(a for d in dims[n_batch_dims:-1] for a in d)
        x_sharding = named_sharding(mesh, dims)
        n_total = arg_shapes[1].shape[-1]
        if not weighted:
            fn = (lambda dy, x: bwd_width_sharded(hidden, n_total, eps, n_batch_dims, dy, x, None, variant)[0]) \
                if hidden else dx_only
            return mesh, per_shard(fn), x_sharding, (x_sharding, x_sharding)

        def fn(dy, x, w):
            if hidden:
                dx, dw = bwd_width_sharded(hidden, n_total, eps, n_batch_dims, dy, x, w, variant)
            else:
                dx, dw = body(dy, x, w, eps, n_batch_dims, jnp.float32)
            if row_axes:  # the rows' dw of every device: one fp32 all-reduce, then w's dtype once
                dw = jax.lax.psum(dw, row_axes)
            return dx, dw.astype(w.dtype)

        dw_sharding = named_sharding(mesh, dims[:n_batch_dims] + [hidden])
        return mesh, per_shard(fn), (x_sharding, dw_sharding), (x_sharding, x_sharding, named_sharding(mesh, [hidden]))

    if not weighted:
        return partitioned(dx_only, partition, f"{lead} n, {lead} n -> {lead} n")
    rule = f"{lead} n, {lead} n, n -> {lead} n, {' '.join(batch)} n"
    return partitioned(lambda dy, x, w: body(dy, x, w, eps, n_batch_dims), partition, rule)


def fwd_width_sharded(hidden, n_total: int, eps: float, x, w, variant: str = "llama"):
    """One shard's columns of the forward: local row sums, psum over `hidden`, local normalisation. w None:
    no weight (`variant` "none"; x is bound in its place, not read)."""
    n_cols = x.shape[-1]
    variant = "none" if w is None else variant
    out_dtype = jnp.dtype(out_dtype_name(x.dtype.name, None if w is None else w.dtype.name, variant))
    if x.size == 0:
        return jnp.zeros(x.shape, out_dtype)
    x2 = x.reshape(-1, n_cols)
    n_rows = x2.shape[0]
    sums, norm = plan_rms_norm_fwd_width_sharded(n_rows, n_cols, eps, variant=variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, n_total=n_total, x_row_stride=n_cols, y_row_stride=n_cols)
    (sum_sq,) = call(sums, [x2], [jax.ShapeDtypeStruct((n_rows,), jnp.float32)], **scalars)
    sum_sq = jax.lax.psum(vary_like(sum_sq, x), hidden)
    (y,) = call(norm, [x2, x2 if w is None else w, sum_sq], [jax.ShapeDtypeStruct(x2.shape, out_dtype)], **scalars)
    return y.reshape(x.shape)


def bwd_width_sharded(hidden, n_total: int, eps: float, n_batch_dims: int, dy, x, w, variant: str = "llama"):
    """One shard's columns of the backward: dx [x's shape] and the fp32 dw of its rows [batch..., N/shards]
    (None without a weight: `variant` "none")."""
    n_cols = x.shape[-1]
    batch_shape = x.shape[:n_batch_dims]
    n_batch = math.prod(batch_shape)
    variant = "none" if w is None else variant
    no_dw = None if w is None else jnp.zeros(batch_shape + (n_cols,), jnp.float32)
    if x.size == 0:
        return jnp.zeros_like(x), no_dw
    n_rows = x.size // n_cols // n_batch
    plan = plan_rms_norm_bwd_width_sharded(n_rows, n_cols, eps, n_batch=n_batch, variant=variant)
    scalars = dict(n_rows=n_batch * n_rows, n_cols=n_cols, n_total=n_total, x_row_stride=n_cols,
                   dy_row_stride=n_cols, dx_row_stride=n_cols)
    x2 = x.reshape(-1, n_cols)
    inputs = [x2, x2 if w is None else w, dy.reshape(-1, n_cols)]
    stats_type = jax.ShapeDtypeStruct((n_batch * n_rows, 2), jnp.float32)
    (sums,) = call(plan.sums, inputs, [stats_type], **scalars)
    sums = jax.lax.psum(vary_like(sums, x), hidden)
    (stats,) = call(plan.finish, [sums], [stats_type], **scalars)
    partial_rows = 1 if plan.reduce is None else n_batch * plan.n_partials  # (not written without a weight)
    dx, partial = call(plan.bwd, inputs + [stats],
                       [jax.ShapeDtypeStruct(inputs[0].shape, x.dtype),
                        jax.ShapeDtypeStruct((partial_rows, n_cols), jnp.float32)],
                       **{**scalars, "n_rows": n_rows})
    if plan.reduce is None:
        return dx.reshape(x.shape), None
    (dw,) = call(plan.reduce, [partial], [jax.ShapeDtypeStruct((n_batch, n_cols), jnp.float32)],
                 n_partials=plan.n_partials, n_cols=n_cols)
    return dx.reshape(x.shape), dw.reshape(batch_shape + (n_cols,))


# ---------------------------------------------------------------------------------------------------
# Gathers and index ops


@functools.cache
def gather_rows(body):
    """out = body(x, idx): out [slots, H], slot i reading the row of x [rows, H] that idx[i] names (global
    numbers: permute_rows' rows, or with top_k its routed copies). Each device gathers its slots (idx's
    sharding) on its columns (x's hidden sharding); sharded rows of x are all-gathered first."""

    def partition(mesh, arg_shapes, result_shape):
        hidden = dim_axes(arg_shapes[0])[1]
        slots = _without(dim_axes(arg_shapes[1])[0], hidden)
        return (mesh, per_shard(body), named_sharding(mesh, [slots, hidden]),
                (named_sharding(mesh, [(), hidden]), named_sharding(mesh, [slots])))

    return partitioned(body, partition, "r h, s -> s h", need_replication_factors=("r",))


@functools.cache
def combine_rows(body, num_rows: int, top_k: int):
    """out = body(y, idx, num_rows, probs): out [num_rows // top_k, H], token t summing (weighted by probs [T,
    top_k], or by 1 where body ignores probs) the rows of y [slots, H] that hold its copies t * top_k + j, idx
    [slots] naming global copies. Each device computes its tokens (probs' row sharding) on its columns (y's
    hidden sharding): y's rows and idx are all-gathered, idx renumbered from the device's first copy
    (`_renumbered`); bitwise one device's result."""

    def partition(mesh, arg_shapes, result_shape):
        hidden = dim_axes(arg_shapes[0])[1]
        tokens = _split_rows(mesh, arg_shapes[2], result_shape, hidden)
        local_rows = num_rows // _size(mesh, tokens)

        def fn(y, idx, probs):
            return body(y, _renumbered(idx, tokens, local_rows), local_rows, probs)

        return (mesh, per_shard(fn), named_sharding(mesh, [tokens, hidden]),
                (named_sharding(mesh, [(), hidden]), named_sharding(mesh, [()]), named_sharding(mesh, [tokens, ()])))

    return partitioned(lambda y, idx, probs: body(y, idx, num_rows, probs), partition, "s h, s, t k -> t h",
                       need_replication_factors=("s", "k"))


@functools.cache
def inverse_rows(body, num_rows: int):
    """inv = body(idx, num_rows, like): inv [num_rows], inv[r] the slot s with idx[s] = r (-1 where none), like
    [num_rows, 1] an array whose values are not read. Each device computes its rows (like's row sharding):
    idx is all-gathered and renumbered from the device's first row (`_renumbered`)."""

    def partition(mesh, arg_shapes, result_shape):
        rows = _split_rows(mesh, arg_shapes[1], result_shape, ())
        local_rows = num_rows // _size(mesh, rows)

        def fn(idx, like):
            return body(_renumbered(idx, rows, local_rows), local_rows, like)

        return (mesh, per_shard(fn), named_sharding(mesh, [rows]),
                (named_sharding(mesh, [()]), named_sharding(mesh, [rows, ()])))

    return partitioned(lambda idx, like: body(idx, num_rows, like), partition, "s, r k -> r",
                       need_replication_factors=("s", "k"))


@functools.cache
def combine_grads(body):
    """(dy, dprobs) = body(dout, y, idx, probs[, dprobs_dtype]): the weighted combine's backward, slot s holding
    copy r = idx[s] of token t: dy[s] = p[r] * dout[t], dprobs[r] = <y[s], dout[t]>. Each device runs its slots
    (idx's sharding) on its columns (y's hidden sharding); dout's rows and probs are all-gathered. A device
    writes dprobs for the copies its slots hold (zeros elsewhere), each a partial sum over its columns, in
    FP32: one FP32 psum of dprobs [T, top_k] over the slot and hidden axes, then probs' dtype once. With only
    slots sharded each copy has one nonzero term (bitwise one device's); a sharded hidden dim reassociates
    the sum over columns."""

    def partition(mesh, arg_shapes, result_shape):
        hidden = dim_axes(arg_shapes[1])[1]
        slots = _without(dim_axes(arg_shapes[2])[0], hidden)

        def fn(dout, y, idx, probs):
            if not slots + hidden:
                return body(dout, y, idx, probs)
            dy, dprobs = body(dout, y, idx, probs, jnp.float32)
            return dy, jax.lax.psum(dprobs, slots + hidden).astype(probs.dtype)

        rows, full = named_sharding(mesh, [slots, hidden]), named_sharding(mesh, [(), ()])
        return (mesh, per_shard(fn), (rows, full),
                (named_sharding(mesh, [(), hidden]), rows, named_sharding(mesh, [slots]), full))

    return partitioned(lambda dout, y, idx, probs: body(dout, y, idx, probs), partition,
                       "t h, s h, s, t k -> s h, t k", need_replication_factors=("t", "k"))


@functools.cache
def replicated(body, n_in: int, ranks: tuple[int, ...], out_ranks: tuple[int, ...]):
    """`body` run whole on every device (small integer ops): inputs all-gathered, outputs replicated."""
    names = iter(f"i{k}" for k in range(100))
    ins = [" ".join(next(names) for _ in range(r)) for r in ranks]
    outs = [" ".join(next(names) for _ in range(r)) for r in out_ranks]
    used = [f for group in ins + outs for f in group.split()]

    def partition(mesh, arg_shapes, result_shape):
        rep = NamedSharding(mesh, P())
        return mesh, per_shard(body), jax.tree.map(lambda _: rep, result_shape), (rep,) * n_in

    return partitioned(body, partition, f"{', '.join(ins)} -> {', '.join(outs)}",
                       need_replication_factors=tuple(used))


# ---------------------------------------------------------------------------------------------------
# The grouped GEMM


@functools.cache
def grouped_rows(body, transposed: bool):
    """out = body(a, w, offs[, out_dtype]): the grouped GEMM's rows kernel, a [S, K] @ w[e] [K, N] -> [S, N]
    (transposed: a [S, N] @ w[e].T -> [S, K], the x gradient), offs [E] the global cumulative ends of the
    experts' rows, the result in `out_dtype` (default a's). Megatron's rules, from w's sharding:
    - output columns (w's N, transposed its K) sharded: each device computes its columns, no communication;
    - the contracted dim sharded (row parallel): each device multiplies its slice of a and w into an FP32
      partial product, then one FP32 psum over those axes, rounded once to a's dtype;
    - experts sharded: each device computes the rows of its experts (`_expert_rows`), zeros elsewhere, then
      one psum over the expert axes (each row has one nonzero term: exact).
    Rows split like a's (its offsets counted from its first row, `_local_offsets`). The weight is never
    gathered: offs (int32 [E]) is. Bitwise one device's result, but for a sharded contracted dim (the sum
    over K reassociated: within the FP32 contract)."""
    c_dim, o_dim = (2, 1) if transposed else (1, 2)  # w's contracted and output dims

    def partition(mesh, arg_shapes, result_shape):
        a_dims, w_dims = dim_axes(arg_shapes[0]), dim_axes(arg_shapes[1])
        w_shape = arg_shapes[1].shape
        experts = _even(mesh, w_dims[0], w_shape[0])
        inner = _even(mesh, _without(w_dims[c_dim] or a_dims[1], experts), w_shape[c_dim])
        cols = _even(mesh, _without(w_dims[o_dim], experts + inner), w_shape[o_dim])
        rows = _split_rows(mesh, arg_shapes[0], result_shape, experts + inner + cols)
        n_slots = result_shape.shape[0]
        local_rows = n_slots // _size(mesh, rows)

        def fn(a, w, offs):
            if not (experts or inner):
                return body(a, w, _local_offsets(offs, rows, local_rows))
            out_dtype = jnp.float32 if inner else a.dtype  # row parallel: FP32 partial products
            if experts:
                y = _expert_rows(body, a, w, offs, experts, rows, local_rows, n_slots, out_dtype)
            else:
                y = body(a, w, _local_offsets(offs, rows, local_rows), out_dtype)
            return jax.lax.psum(y, experts + inner).astype(a.dtype)

        w_spec = [experts, (), ()]
        w_spec[c_dim], w_spec[o_dim] = inner, cols
        return (mesh, per_shard(fn), named_sharding(mesh, [rows, cols]),
                (named_sharding(mesh, [rows, inner]), named_sharding(mesh, w_spec), named_sharding(mesh, [()])))

    rule = "s n, e k n, e -> s k" if transposed else "s k, e k n, e -> s n"
    return partitioned(lambda a, w, offs: body(a, w, offs), partition, rule)


@functools.cache
def grouped_dw(body):
    """dw = body(x, dy, offs): dw[e] = x_e.T @ dy_e, [E, K, N]. Each device computes its (K, N) block (x's K
    sharding, dy's N sharding) of its experts (offs' sharding, which `expert_offsets` gives w's; or the
    result's) over all the rows: sharded rows are all-gathered (activations, never the weight), so each
    element is still one program's FP32 sum in one order (bitwise one device's), and dw is sharded like w."""

    def partition(mesh, arg_shapes, result_shape):
        out_dims = dim_axes(result_shape)
        n_experts, n_inner, n_cols = result_shape.shape
        experts = _even(mesh, dim_axes(arg_shapes[2])[0] or out_dims[0], n_experts)
        k = _even(mesh, _without(dim_axes(arg_shapes[0])[1] or out_dims[1], experts), n_inner)
        n = _even(mesh, _without(dim_axes(arg_shapes[1])[1] or out_dims[2], experts + k), n_cols)
        n_slots = arg_shapes[0].shape[0]

        def fn(x, dy, offs):
            if not experts:
                return body(x, dy, offs)
            local, shift = _expert_block(offs, experts, n_experts // _size(mesh, experts), (), n_slots, n_slots)
            return body(jnp.roll(x, -shift, 0), jnp.roll(dy, -shift, 0), local)

        return (mesh, per_shard(fn), named_sharding(mesh, [experts, k, n]),
                (named_sharding(mesh, [(), k]), named_sharding(mesh, [(), n]), named_sharding(mesh, [()])))

    return partitioned(body, partition, "s k, s n, e -> e k n", need_replication_factors=("s",))


@functools.cache
def _offsets_like():
    """offs [E] returned sharded like w [E, K, N]'s experts (values unchanged); under vmap, offs as it is."""

    def partition(mesh, arg_shapes, result_shape):
        experts = _even(mesh, dim_axes(arg_shapes[1])[0], arg_shapes[1].shape[0])
        return (mesh, per_shard(lambda offs, w: offs), named_sharding(mesh, [experts]),
                (named_sharding(mesh, [experts]), named_sharding(mesh, dim_axes(arg_shapes[1]))))

    like = partitioned(lambda offs, w: offs, partition, "e, e k n -> e")

    @jax.custom_batching.custom_vmap
    def op(offs, w):
        return like(offs, w)

    op.def_vmap(lambda axis_size, in_batched, offs, w: (offs, in_batched[0]))
    return op


def expert_offsets(offs, w):
    """grouped_mm's offsets, sharded like w's experts under sharded jit (an explicit mesh's types, or the
    partitioner's choice): the weight gradient then reads which experts are this device's from them."""
    mesh = explicit_mesh([w])
    if mesh is not None:
        spec = _type_spec(w)[0]
        if _same(_type_spec(offs)[:1], P(spec)):
            return offs
        with _mesh_context(mesh, [w, offs]):
            return jax.sharding.reshard(offs, P(spec))
    if varying(w) or varying(offs) or jax.device_count() == 1:  # a shard already, or nothing to split
        return offs
    return _offsets_like()(offs, jax.lax.stop_gradient(w))  # w only lends its sharding


def _expert_rows(body, a, w, offs, experts, rows, local_rows: int, n_slots: int, out_dtype):
    """The rows of this device's experts (w [E / shards, ...], its block of them), zeros elsewhere: a rolled up
    so that their first row is row 0 (the kernel's first expert starts there), multiplied, and rolled back."""
    local, shift = _expert_block(offs, experts, w.shape[0], rows, local_rows, n_slots)
    return jnp.roll(body(jnp.roll(a, -shift, 0), w, local, out_dtype), shift, 0)


def _expert_block(offs, experts, n_local: int, rows, local_rows: int, n_slots: int):
    """(the cumulative ends of this device's experts counted from their first row, that row), both within this
    device's rows (`rows` axes, `local_rows` each; offsets clamped as the kernel clamps them)."""
    offs = jnp.clip(offs, 0, n_slots)
    first = jax.lax.axis_index(experts) * n_local
    ends = jax.lax.dynamic_slice_in_dim(offs, first, n_local)
    start = jnp.where(first > 0, offs[jnp.maximum(first - 1, 0)], 0)
    row0 = jax.lax.axis_index(rows) * local_rows if rows else 0
    start = jnp.clip(start - row0, 0, local_rows).astype(offs.dtype)
    ends = jnp.clip(ends - row0, 0, local_rows).astype(offs.dtype)
    return ends - start, start


def _even(mesh, axes, size: int) -> tuple[str, ...]:
    """`axes` where they split `size` evenly, else () (the dim then stays whole)."""
    return axes if size % _size(mesh, axes) == 0 else ()


def _local_offsets(offs, axes, local_rows: int):
    """Global cumulative ends counted from this device's first row, clipped to [0, local_rows]: an expert before
    the device's rows ends at 0, one after them at local_rows, so the kernel's blocks are the device's part of
    each expert and its rows past the last offset stay the zero tail."""
    return jnp.clip(_renumbered(offs, axes, local_rows), 0, local_rows) if axes else offs


def _without(axes, taken) -> tuple[str, ...]:
    return tuple(a for a in axes if a not in taken)


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _split_rows(mesh, like, result, taken) -> tuple[str, ...]:
    """The mesh axes splitting the output rows: like's rows' (else the result's), less `taken`, where they split
    the rows evenly (each device's first row is then its index over them times rows / shards)."""
    axes = _without(dim_axes(like)[0] or dim_axes(result)[0], taken)
    return axes if result.shape[0] % _size(mesh, axes) == 0 else ()


def _renumbered(idx, axes, local_rows: int):
    """idx (global row numbers) counted from this device's first row: a row of another device falls outside
    [0, local_rows), where the kernels skip it as they skip an out-of-range entry on one device."""
    if not axes:
        return idx
    return idx - (jax.lax.axis_index(axes) * local_rows).astype(idx.dtype)
