"""The experts' grouped GEMM over the padded expert-major layout in JAX: `grouped_mm`, under jit, grad of any
order, vmap and sharded jit. Contract and kernels: `xkern/grouped_mm/`.

Three bilinear custom_jvp functions whose tangents are transposed by each other (jax_api/_linear.py): the
forward F(x, w) = x_e @ w_e, the x gradient DX(g, w) = g_e @ w_e.T (the forward's kernel reading w transposed)
and the weight gradient DW(a, b)[e] = a_e.T @ b_e. F's cotangents are DX(g, w) and DW(x, g); DX's are F(h, w)
and DW(h, g); DW's are DX(b, H) and F(a, H). So forward mode, jax.grad on the kernels and every order. The
offsets are an integer input: their tangent is float0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_api import sharding
from jax_api._launch import check_array, concrete, execute, map_batched, vary_like
from jax_api._linear import bilinear_jvp
from xkern import grouped_mm as contract


def _rows_kernel(a, w, offs, out_dtype=None):
    (n_slots, n_inner), (n_experts, _, n_cols) = a.shape, w.shape
    strides = (n_inner * n_cols, n_cols, 1)
    recipe = contract.grouped_mm_recipe(n_slots, n_inner, n_cols, n_experts, a.dtype.name, n_inner, strides)
    return execute(_output_dtype(recipe, out_dtype), x=a, w=w, offs=offs)[0]


def _dx_kernel(g, w, offs, out_dtype=None):
    (n_slots, n_cols), (n_experts, n_inner, _) = g.shape, w.shape
    strides = (n_inner * n_cols, n_cols, 1)
    recipe = contract.grouped_mm_dx_recipe(n_slots, n_inner, n_cols, n_experts, g.dtype.name, n_cols, strides)
    return execute(_output_dtype(recipe, out_dtype), dy=g, w=w, offs=offs)[0]


def _output_dtype(recipe, dtype):
    """The rows kernel's recipe with its result in `dtype` (None: as planned): a row-parallel shard's FP32
    partial product (jax_api/sharding.py), the kernel's FP32 accumulator stored unrounded."""
    if dtype is None:
        return recipe
    (step,) = recipe.steps
    (out,) = step.outputs
    step = dataclasses.replace(step, outputs=(dataclasses.replace(out, dtype=jnp.dtype(dtype).name),))
    return dataclasses.replace(recipe, steps=(step,))


def _dw_kernel(a, b, offs):
    (n_slots, n_inner), n_cols = a.shape, b.shape[1]
    recipe = contract.grouped_mm_dw_recipe(n_slots, n_inner, n_cols, offs.shape[0], a.dtype.name, n_inner, n_cols)
    return execute(recipe, x=a, dy=b, offs=offs)[0]


@functools.cache
def _op(form: str):
    """The kernel call of one form ("fwd", "dx", "dw"), partitioned under sharded jit; under vmap one call per
    example (the experts' blocks are per example)."""
    kernel = (sharding.grouped_dw(_dw_kernel) if form == "dw" else
              sharding.grouped_rows(_dx_kernel if form == "dx" else _rows_kernel, form == "dx"))

    @jax.custom_batching.custom_vmap
    def op(a, b, offs):
        return kernel(a, b, offs)

    op.def_vmap(lambda axis_size, in_batched, *args: (map_batched(op, axis_size, in_batched, *args), True))
    return op


@jax.custom_jvp
def _fwd(x, w, offs):
    return vary_like(_op("fwd")(x, w, offs), x)


@jax.custom_jvp
def _dx(g, w, offs):
    return vary_like(_op("dx")(g, w, offs), g)


@jax.custom_jvp
def _dw(a, b, offs):
    return vary_like(_op("dw")(a, b, offs), a)


# Each is bilinear: its tangent is two calls of itself, transposed by the other two (jax_api/_linear.py).
_fwd.defjvp(bilinear_jvp(_fwd, lambda x, w, offs, g: (_dx(g, w, offs), _dw(x, g, offs)), 1, 2))
_dx.defjvp(bilinear_jvp(_dx, lambda g, w, offs, h: (_fwd(h, w, offs), _dw(h, g, offs)), 1, 2))
_dw.defjvp(bilinear_jvp(_dw, lambda a, b, offs, big_h: (_dx(b, big_h, offs), _fwd(a, big_h, offs)), 1, 2))


def grouped_mm(x, w, m_offsets, validate: bool = False):
    """The experts' GEMMs over the padded expert-major layout: y [S, N] in x's dtype, `y[r] = x[r] @ w[e]` for
    the rows of expert e (slots m_offsets[e-1] to m_offsets[e], from 0 for e = 0), zero rows from
    m_offsets[-1] on. FP32 accumulation, rounded once; fp32 inputs multiply in IEEE FP32 (no TF32). The same
    kernels and bits as `torch_api.grouped_mm`.

    x: [S, K] float16/bfloat16/float32. w: [E, K, N] of x's dtype (jax.lax.ragged_dot's layout). m_offsets: [E]
    int32, the cumulative ends of the experts' blocks (the cumsum of ragged_dot's group sizes; the m_offsets of
    `topk_permute_indices` and `generate_permute_indices`), non-decreasing and at most S: `validate=True`
    (concrete offsets) checks that; unchecked offsets are clamped to [0, S]. Differentiable in x and w, to any
    order: dx[r] = dy[r] @ w[e].T (zero rows past the last offset), dw[e] = x_e.T @ dy_e (zeros for an expert
    without rows), each summed in FP32 by one program (the same bits run to run). Sharded jit: each device
    computes its rows on its columns of the output; a split K (row parallel) psums FP32 partial products once;
    split experts compute their own rows and weight gradient; the weight is never gathered (docs/sharding.md)."""
    for name, a in (("x", x), ("w", w), ("m_offsets", m_offsets)):
        check_array(name, a)
    contract.check_grouped_mm(x.dtype.name, tuple(x.shape), w.dtype.name, tuple(w.shape), m_offsets.dtype.name,
                              tuple(m_offsets.shape))
    if validate:
        contract.check_offsets(concrete("m_offsets", m_offsets), x.shape[0])
    # Inside shard_map a replicated weight is made varying like x (its gradient: the psum of the shards')
    return _fwd(vary_like(x, w), vary_like(w, x), sharding.expert_offsets(m_offsets, w))


def _check_form(check, names, a, b, m_offsets) -> None:
    for name, arr in zip(names, (a, b, m_offsets), strict=True):
        check_array(name, arr)
    check(a.dtype.name, tuple(a.shape), b.dtype.name, tuple(b.shape), m_offsets.dtype.name, tuple(m_offsets.shape))


def grouped_mm_dx(dy, w, m_offsets):
    """`grouped_mm`'s x gradient on its own (the kernel its vjp runs): dx [S, K], dx[r] = dy[r] @ w[e].T for
    the rows of expert e, zero rows past m_offsets[-1]. dy [S, N]; w and m_offsets as `grouped_mm`'s."""
    _check_form(contract.check_grouped_mm_dx, ("dy", "w", "m_offsets"), dy, w, m_offsets)
    return _dx(vary_like(dy, w), vary_like(w, dy), sharding.expert_offsets(m_offsets, w))


def grouped_mm_dw(x, dy, m_offsets):
    """`grouped_mm`'s weight gradient on its own (the kernel its vjp runs): dw [E, K, N], dw[e] = x_e.T @ dy_e,
    zeros for an expert without rows. x [S, K], dy [S, N] of x's dtype; m_offsets as `grouped_mm`'s."""
    _check_form(contract.check_grouped_mm_dw, ("x", "dy", "m_offsets"), x, dy, m_offsets)
    return _dw(vary_like(x, dy), vary_like(dy, x), m_offsets)
