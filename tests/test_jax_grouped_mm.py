"""`jax_api.grouped_mm` under jit, grad of any order and vmap: the same bits as `torch_api.grouped_mm`, the
FP64 oracle, and a dense masked expression's derivatives (CPU: Triton's interpreter). Sharded jit:
tests/test_sharding.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import same_bits, to_torch

import jax_api
import torch_api
from xkern import reference as R

OFFSETS = np.array([9, 9, 23, 30], np.int32)  # an empty expert; slots 30..39 the zero tail
S, K, N = 40, 24, 20


def _operands(dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((S, K)).astype(dtype)
    w = (rng.standard_normal((len(OFFSETS), K, N)) / K ** 0.5).astype(dtype)
    dy = rng.standard_normal((S, N)).astype(dtype)
    return x, w, dy


def _step(x, w, offs, dy):
    y, vjp = jax.vjp(lambda x, w: jax_api.grouped_mm(x, w, offs), x, w)
    return (y, *vjp(dy))


def test_matches_torch_bitwise_and_the_oracle():
    x, w, dy = _operands(R.BF16)
    y, dx, dw = jax.jit(_step)(*(jnp.asarray(a) for a in (x, w, OFFSETS, dy)))
    tx, tw = (to_torch(a).requires_grad_() for a in (x, w))
    ty = torch_api.grouped_mm(tx, tw, to_torch(OFFSETS))
    ty.backward(to_torch(dy))
    assert same_bits(y, ty) and same_bits(dx, tx.grad) and same_bits(dw, tw.grad)

    x, w, dy = _operands(np.float32, 1)
    got = jax.jit(_step)(*(jnp.asarray(a) for a in (x, w, OFFSETS, dy)))
    want = (R.grouped_mm(x, w, OFFSETS), *R.grouped_mm_bwd(x, w, dy, OFFSETS))
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=name)
    assert not np.asarray(got[0])[OFFSETS[-1]:].any() and not np.asarray(got[1])[OFFSETS[-1]:].any()


def _dense(x, w, offs):
    """The same GEMMs as a sum of masked dense products (differentiable by jax to any order)."""
    rows = jnp.arange(x.shape[0])[:, None]
    starts = jnp.concatenate([jnp.zeros(1, offs.dtype), offs[:-1]])
    prod = [jnp.matmul(x, w[e], precision=jax.lax.Precision.HIGHEST) for e in range(w.shape[0])]  # no TF32
    return sum(jnp.where((rows >= starts[e]) & (rows < offs[e]), p, 0.0) for e, p in enumerate(prod))


def test_second_order_matches_dense_expression():
    x, w, _ = (jnp.asarray(a) for a in _operands(np.float32, 2))
    offs = jnp.asarray(OFFSETS)

    def hess_like(mm):
        inner = jax.grad(lambda x, w: jnp.sum(jnp.sin(mm(x, w, offs))), argnums=(0, 1))
        return jax.grad(lambda x, w: sum(jnp.sum(g ** 2) for g in inner(x, w)), argnums=(0, 1))(x, w)

    for got, want in zip(hess_like(jax_api.grouped_mm), hess_like(_dense), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


def test_vmap_runs_each_example():
    x, w, _ = _operands(np.float32, 3)
    xs = jnp.stack([jnp.asarray(x), 2 * jnp.asarray(x)])
    got = jax.jit(jax.vmap(lambda a: jax_api.grouped_mm(a, jnp.asarray(w), jnp.asarray(OFFSETS))))(xs)
    for i in range(2):
        assert same_bits(got[i], jax_api.grouped_mm(xs[i], jnp.asarray(w), jnp.asarray(OFFSETS)))


def test_errors_name_the_argument():
    x, w, _ = (jnp.asarray(a) for a in _operands(np.float32))
    offs = jnp.asarray(OFFSETS)
    with pytest.raises(TypeError, match="x must be a jax array"):
        jax_api.grouped_mm([1.0], w, offs)
    with pytest.raises(ValueError, match="w must be 3-D"):
        jax_api.grouped_mm(x, w[0], offs)
    with pytest.raises(TypeError, match="m_offsets must be int32"):
        jax_api.grouped_mm(x, w, offs.astype(jnp.int64) if jax.config.jax_enable_x64 else offs.astype(jnp.float32))
    with pytest.raises(ValueError, match="non-decreasing"):
        jax_api.grouped_mm(x, w, jnp.asarray([9, 5, 23, 30], jnp.int32), validate=True)
    with pytest.raises(ValueError, match="concrete m_offsets"):
        jax.jit(lambda o: jax_api.grouped_mm(x, w, o, validate=True))(offs)
