"""`linear(fun, fun_t, res, lin)`: a function linear in `lin`, with its transpose given: how every jax_api op
gets forward mode, reverse mode on the backward kernels, and derivatives of any order (docs/design.md).

`fun(*res, *lin)` is linear in `lin` (the residuals `res` enter in any way); `fun_t(*res, *cts)` is its
transpose (one cotangent per output in, one per `lin` out). A primitive holds both, traced to jaxprs:
- jvp: in `lin`, the primitive itself on the tangents; in `res`, the jvp of `fun` (so `fun` must be
  differentiable in `res`: jnp, or ops that are themselves `linear` or custom_jvp);
- transpose: the same primitive with `fun` and `fun_t` swapped, so `jax.grad` runs `fun_t` (the backward
  kernels) and never transposes `fun`;
- vmap: both functions vmapped (a kernel op's custom_vmap rule then decides the launches), `lin` and the
  cotangents batched alike;
- jit, remat, scan, shard_map, export: the primitive lowers to `fun`'s jaxpr inline.
`jax.custom_derivatives.linear_call` is the same idea, but has no vmap rule and no derivative in its residuals
(second order through it fails), hence this primitive.
"""

from __future__ import annotations

import jax
from jax._src import api_util, core
from jax._src import linear_util as lu
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

linear_p = core.Primitive("xkern_linear")
linear_p.multiple_results = True


def _trace(fn, avals) -> core.ClosedJaxpr:
    flat = lambda *args: list(fn(*args))  # noqa: E731
    wrapped = lu.wrap_init(flat, debug_info=api_util.debug_info("xkern linear", fn, tuple(avals), {}))
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(avals))
    if any(isinstance(c, core.Tracer) for c in consts):
        raise TypeError("linear: fun and fun_t must take every array they use as an argument (res or lin)")
    return core.ClosedJaxpr(jaxpr, consts)


def linear(fun, fun_t, res: tuple, lin: tuple) -> list:
    """`fun(*res, *lin)` as a list of arrays; see the module docstring. `res` may hold integer arrays."""
    res, lin = tuple(res), tuple(lin)
    callee = _trace(fun, [core.typeof(a) for a in res + lin])
    transpose = _trace(fun_t, [core.typeof(a) for a in res] + list(callee.out_avals))
    return linear_p.bind(*res, *lin, callee=callee, transpose=transpose, num_res=len(res))


def _impl(*args, callee, transpose, num_res):
    return core.eval_jaxpr(callee.jaxpr, callee.consts, *args)


def _abstract_eval(*args, callee, transpose, num_res):
    return callee.out_avals


def _nonzero(t) -> bool:
    return type(t) is not ad.Zero and core.typeof(t).dtype != jax.dtypes.float0


def _jvp(primals, tangents, *, callee, transpose, num_res):
    params = dict(callee=callee, transpose=transpose, num_res=num_res)
    res, lin_dot = primals[:num_res], tangents[num_res:]
    out = linear_p.bind(*primals, **params)
    if any(_nonzero(t) for t in lin_dot):
        out_dot = linear_p.bind(*res, *(ad.instantiate_zeros(t) for t in lin_dot), **params)
    else:
        out_dot = [ad.Zero(a.to_tangent_aval()) for a in callee.out_avals]
    nonzero = [_nonzero(t) for t in tangents[:num_res]]
    if any(nonzero):  # the derivative in the residuals, `lin` held: fun's own jvp
        jvp, out_nz = ad.jvp_jaxpr(callee, nonzero + [False] * (len(primals) - num_res), False)
        outs = core.eval_jaxpr(jvp.jaxpr, jvp.consts, *primals,
                               *(t for t, nz in zip(tangents, nonzero) if nz))
        extra = iter(outs[len(out):])
        out_dot = [ad.add_tangents(t, next(extra)) if nz else t for t, nz in zip(out_dot, out_nz)]
    return out, out_dot


def _transpose(cts, *args, callee, transpose, num_res):
    res, lin = args[:num_res], args[num_res:]
    if any(ad.is_undefined_primal(r) for r in res):
        raise NotImplementedError("linear: transposed in a residual (fun is linear in lin only)")
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * len(args)
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    outs = linear_p.bind(*res, *cts, callee=transpose, transpose=callee, num_res=num_res)
    return [None] * num_res + [o if ad.is_undefined_primal(a) else None for o, a in zip(outs, lin)]


def _batch(axis_data, args, dims, *, callee, transpose, num_res):
    if all(d is None for d in dims):
        return linear_p.bind(*args, callee=callee, transpose=transpose, num_res=num_res), [None] * len(
            callee.out_avals)
    size = axis_data.size
    # lin and the cotangents always batched (so the transpose's outputs match lin's), residuals as they come
    args = [batching.bdim_at_front(a, d, size) if d is not None or i >= num_res else a
            for i, (a, d) in enumerate(zip(args, dims))]
    res_axes = [None if d is None else 0 for d in dims[:num_res]]
    n_lin, n_out = len(args) - num_res, len(callee.out_avals)
    avals = [core.typeof(a) for a in args]
    new_callee = _trace(jax.vmap(core.jaxpr_as_fun(callee), in_axes=(*res_axes, *[0] * n_lin)), avals)
    new_transpose = _trace(jax.vmap(core.jaxpr_as_fun(transpose), in_axes=(*res_axes, *[0] * n_out)),
                           avals[:num_res] + list(new_callee.out_avals))
    outs = linear_p.bind(*args, callee=new_callee, transpose=new_transpose, num_res=num_res)
    return outs, [0] * len(outs)


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[linear_p] = _jvp
ad.primitive_transposes[linear_p] = _transpose
batching.fancy_primitive_batchers[linear_p] = _batch
mlir.register_lowering(linear_p, mlir.lower_fun(_impl, multiple_results=True))


def bilinear_jvp(op, transpose, n_first: int, n_diff: int):
    """A custom_jvp rule for `op(*args)`, linear in args[:n_first] and in args[n_first:n_diff] separately (the
    rest: integer operands): the tangent op(t1, a2) + op(a1, t2), `linear` in the tangents, transposed by
    `transpose(*args, *cts)` (the cotangents flat; one result per differentiable argument). `op` is the
    custom_jvp function itself, so the tangent is differentiable again."""

    def rule(primals, tangents):
        out = op(*primals)
        n = len(primals)

        def tangent(*args):
            p, t = args[:n], args[n:]
            one = op(*t[:n_first], *p[n_first:])
            two = op(*p[:n_first], *t[n_first:], *p[n_diff:])
            return jax.tree.leaves(jax.tree.map(jax.numpy.add, one, two))

        t_out = linear(tangent, lambda *args: list(transpose(*args)), primals, tangents[:n_diff])
        return out, jax.tree.unflatten(jax.tree.structure(out), t_out)

    return rule
