"""GPU-only: large shapes, row offsets past 2**31 elements, both front ends bitwise equal on the GPU.

Collected only where a GPU is present (conftest.py); on CPU the interpreter would take hours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import same_bits, to_numpy

import jax_api
import torch_api
from xkern import reference as R

EPS = 1e-6


def _run_both(x, w, dy):
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    ty = torch_api.rms_norm(tx, tw, EPS)
    ty.backward(dy)
    jx, jw, jdy = (jnp.asarray(to_numpy(a)) for a in (x, w, dy))
    jy, vjp = jax.vjp(jax.jit(lambda x, w: jax_api.rms_norm(x, w, EPS)), jx, jw)
    jdx, jdw = vjp(jdy)
    return (ty, tx.grad, tw.grad), (jy, jdx, jdw)


@pytest.mark.parametrize("shape", [(262144, 128), (32768, 128), (262144, 64), (65536, 256), (8192, 2048),
                                   (4097, 4096), (1000, 8192), (333, 16384), (257, 32768), (129, 65536),
                                   (65, 65537), (31, 100000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_shapes_oracle_and_parity(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(hash(shape) % 2**31)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    w = (1 + 0.5 * torch.randn(shape[-1], device="cuda", generator=g)).to(dtype)
    dy = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    (ty, tdx, tdw), (jy, jdx, jdw) = _run_both(x, w, dy)
    xn, wn, dyn = to_numpy(x), to_numpy(w), to_numpy(dy)
    R.check(to_numpy(ty), R.rms_norm_fwd(xn, wn, EPS), "fwd")
    dx_ref, dw_ref, dw_tol = R.rms_norm_bwd(xn, wn, dyn, EPS)
    R.check(to_numpy(tdx), dx_ref, "dx")
    R.check(to_numpy(tdw), dw_ref, "dw", dw_tol)
    for a, b in ((jy, ty), (jdx, tdx), (jdw, tdw)):
        assert same_bits(a, b)


@pytest.mark.parametrize("shape", [(16_777_300, 128), (32_800, 65_536), (32_800, 65_537)])
def test_row_offsets_past_2_31_elements(shape):
    """The last rows start past 2**31 elements: int32 offsets would wrap and read the wrong memory."""
    rows, n = shape
    assert rows * n > 2**31
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (1 + 0.5 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    y = torch_api.rms_norm(x, w, EPS)
    tail = slice(rows - 3, rows)
    R.check(to_numpy(y[tail]), R.rms_norm_fwd(to_numpy(x[tail]), to_numpy(w), EPS), "fwd")
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    dx, _ = torch.ops.xkern.rms_norm_bwd(dy, x, w, EPS)
    dx_ref = R.rms_norm_bwd(to_numpy(x[tail]), to_numpy(w), to_numpy(dy[tail]), EPS)[0]
    R.check(to_numpy(dx[tail]), dx_ref, "dx")


@pytest.mark.parametrize("tokens", [8192, 16384])
@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gathers_full_size(tokens, hidden, dtype):
    """The gathers at training sizes (T x top-8 rows, 8 ranks x 8 local experts, alignment 16): indices
    against the numpy oracle; forward and both backwards bit for bit against torch's own index ops and
    across front ends."""
    experts, ranks, align = 8, 8, 16
    g = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    group = torch.randint(0, experts * ranks, (tokens * 8,), device="cuda", generator=g)
    counts = torch.bincount(group, minlength=experts * ranks).to(torch.int32)
    n_rows = tokens * 8
    max_len = n_rows + experts * align
    idx, _, _ = torch_api.generate_permute_indices(counts, experts, ranks, max_len, align)
    ref_idx = R.generate_permute_indices(to_numpy(counts), experts, ranks, max_len, align)[0]
    assert np.array_equal(to_numpy(idx), ref_idx)
    x = torch.randn(n_rows, hidden, device="cuda", dtype=dtype, generator=g).requires_grad_()
    y = torch_api.permute_rows(x, idx)
    safe = idx.clamp(min=0).long()
    expected = torch.where((idx >= 0)[:, None], x.detach()[safe], 0)
    assert same_bits(y, expected)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    inv = torch_api.inverse_permutation(idx, n_rows)
    assert same_bits(dx, dy[inv.long()])
    back = torch_api.unpermute_rows(y.detach(), idx, n_rows)
    assert same_bits(back, x.detach())
    jidx = jnp.asarray(to_numpy(idx))
    jy = jax.jit(jax_api.permute_rows)(jnp.asarray(to_numpy(x.detach())), jidx)
    assert same_bits(jy, y)
    jback = jax.jit(jax_api.unpermute_rows, static_argnums=2)(jy, jidx, n_rows)
    assert same_bits(jback, back)
