"""Fused residual add + RMSNorm (`add_rms_norm`), both front ends, against the FP64 oracle.

Widths cover each kernel the plans take: 128 (tile kernels), 1000 (forward tile of one row, backward tile),
5120 (forward 5 x 1024 split row, backward tile), 16384 (row kernels), 24000 (forward in 6 blocks, backward
row kernel in 6 x 4096), 20000 with an fp32 residual (stats + column backward). Outputs of the kernels are
NaN-poisoned first (every element must be written). CPU cost is kept low: few rows, the wide widths once each
(torch and JAX launch the same binaries: tests/test_launch_parity.py).
"""

from __future__ import annotations

import pickle
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import DEVICE, TORCH_DTYPES, graph_ops, rand, same_bits, to_numpy, to_torch

import jax_api
import torch_api
import torch_api._launch as tl_launch
from xkern import reference as R
from xkern.add_rms_norm import add_rms_norm_bwd_recipe, add_rms_norm_fwd_recipe
from xkern.rms_norm import rms_norm_bwd_recipe

EPS = 1e-6


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _inputs(key, rows, width, x_dtype, r_dtype, variant="llama"):
    rng = _rng(*key)
    x = rand(rng, (rows, width), x_dtype)
    r = rand(rng, (rows, width), r_dtype)
    w = None if variant == "none" else rand(rng, (width,), x_dtype, scale=0.5,
                                             offset=0.0 if variant == "gemma" else 1.0)
    return rng, x, r, w


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer a recipe allocates starts as NaN: unwritten elements show. Calls take the registered ops
    (`run_recipe`), not the eager direct launches (whose results the other tests compare bit for bit)."""
    module = sys.modules["torch_api.add_rms_norm"]
    monkeypatch.setattr(module, "direct", lambda *a: False)
    monkeypatch.setattr(module, "traced", lambda *a: True)
    alloc = tl_launch._alloc

    def nan_alloc(buffer, device):
        t = alloc(buffer, device)
        if buffer.fill is None and t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(tl_launch, "_alloc", nan_alloc)


def _math(variant):
    return "llama" if variant == "none" else variant


def _check_against_oracle(x, r, w, res_dtype, variant, y, res, dy, dres, dx, dr, dw):
    y64, res_ref = R.add_rms_norm_fwd(x, r, w, EPS, _math(variant), res_dtype)
    assert same_bits(to_numpy(res), res_ref), "residual_out is not (x + r) rounded once"
    R.check(to_numpy(y), y64, "fwd")
    dsum64, dw64, dw_tol = R.add_rms_norm_bwd(res_ref, w, dy, dres, EPS, _math(variant), x_dtype=x.dtype)
    # eager autograd: d(sum) rounded to residual_out's dtype, then converted to each input's
    dsum = dsum64.astype(res_ref.dtype).astype(np.float64)
    tol = None if dres is None else R.add_rms_norm_dsum_tol(res_ref, w, dy, EPS, _math(variant), x_dtype=x.dtype)
    R.check(to_numpy(dx), dsum, "dx", tol)
    R.check(to_numpy(dr), dsum, "dx", tol)
    if w is not None:
        R.check(to_numpy(dw), dw64, "dw", dw_tol)


def _torch_run(x, r, w, dy, dres, variant, residual_dtype=None):
    tx, tr = to_torch(x).requires_grad_(), to_torch(r).requires_grad_()
    tw = None if w is None else to_torch(w).requires_grad_()
    y, res = torch_api.add_rms_norm(tx, tr, tw, EPS, variant=_math(variant), residual_dtype=residual_dtype)
    torch.autograd.backward([y, res] if dres is not None else [y],
                            [to_torch(dy), to_torch(dres)] if dres is not None else [to_torch(dy)])
    return y, res, tx.grad, tr.grad, None if w is None else tw.grad


CASES = [  # rows, width, x, residual, residual_dtype, variant, with residual_out's gradient
    (33, 128, "bfloat16", "bfloat16", None, "llama", True),
    (33, 128, "float16", "float32", None, "gemma", True),
    (140, 8192, "bfloat16", "bfloat16", None, "llama", True),  # 132 programs: some take two tiles (prefetch)
    (533, 2048, "bfloat16", "bfloat16", None, "llama", True),  # 2-row tiles: 267 programs, the last tile half
    (5, 2600, "bfloat16", "bfloat16", None, "gemma", True),  # three blocks of 1024, 2-row tiles
    (3, 1000, "float32", "float32", None, "olmo2", False),
    (2, 1000, "bfloat16", "bfloat16", None, "none", True),
    (2, 5120, "bfloat16", "float32", None, "llama", False),
    (1, 16384, "bfloat16", "bfloat16", "float32", "llama", True),
    (1, 20000, "bfloat16", "float32", None, "llama", True),
    (2, 24000, "bfloat16", "bfloat16", None, "gemma", True),
]


@pytest.mark.parametrize("rows,width,x_dtype,r_dtype,residual_dtype,variant,with_dres", CASES)
def test_torch_matches_oracle(poisoned, rows, width, x_dtype, r_dtype, residual_dtype, variant, with_dres):
    rng, x, r, w = _inputs(("torch", width, x_dtype, r_dtype, variant), rows, width, x_dtype, r_dtype, variant)
    res_dtype = residual_dtype or str(R.promote(x.dtype, r.dtype))
    y_dtype = R.out_dtype(x.dtype, None if w is None else w.dtype, _math(variant))
    dy = rand(rng, (rows, width), str(y_dtype))
    dres = rand(rng, (rows, width), res_dtype) if with_dres else None
    y, res, dx, dr, dw = _torch_run(x, r, w, dy, dres, variant,
                                    None if residual_dtype is None else TORCH_DTYPES[residual_dtype])
    assert dx.dtype == TORCH_DTYPES[x_dtype] and dr.dtype == TORCH_DTYPES[r_dtype]
    assert res.dtype == TORCH_DTYPES[res_dtype]
    _check_against_oracle(x, r, w, res_dtype, variant, y, res, dy, dres, dx, dr, dw)


def test_dsum_allowance_is_one_flip_of_the_norms_dx():
    """The norm's dx at (1, 882) of the 5 x 2600 gemma case lies 2**-24 of itself above a bf16 tie: fp32
    rounds it either way, and dres cancels the sum to 1/16 of it, so the neighbouring rounding is 16 ULPs of
    d(sum) (as compiled on an H100). The allowance takes that flip there and nothing beyond it."""
    rng, x, r, w = _inputs(("torch", 2600, "bfloat16", "bfloat16", "gemma"), 5, 2600, "bfloat16", "bfloat16", "gemma")
    dy, dres = rand(rng, (5, 2600), "bfloat16"), rand(rng, (5, 2600), "bfloat16")
    _, s = R.add_rms_norm_fwd(x, r, w, EPS, "gemma")
    dsum = R.add_rms_norm_bwd(s, w, dy, dres, EPS, "gemma", x_dtype=x.dtype)[0].astype(s.dtype)
    tol = R.add_rms_norm_dsum_tol(s, w, dy, EPS, "gemma", x_dtype=x.dtype)
    assert 0 < np.count_nonzero(tol) <= 10 and tol[1, 882] == 2.0 ** -7
    flipped = dsum.astype(np.float64)
    flipped[1, 882] -= tol[1, 882]  # the norm's dx rounded down instead of up
    R.check(flipped.astype(s.dtype), dsum.astype(np.float64), "dx", tol)
    with pytest.raises(AssertionError, match="max_ulp"):
        R.check(flipped.astype(s.dtype), dsum.astype(np.float64), "dx")
    flipped[1, 882] -= tol[1, 882]  # two flips' worth: no rounding makes that
    with pytest.raises(AssertionError, match="max_ulp"):
        R.check(flipped.astype(s.dtype), dsum.astype(np.float64), "dx", tol)


@pytest.mark.parametrize("rows,width", [(9, 128), (2, 5120)])
def test_equal_dtypes_are_bitwise_rms_norm_of_the_sum(rows, width):
    """Hugging Face's layer: residual = x + residual; y = norm(residual); and its gradients."""
    rng, x, r, w = _inputs(("hf", width), rows, width, "bfloat16", "bfloat16")
    dy, dres = rand(rng, (rows, width), "bfloat16"), rand(rng, (rows, width), "bfloat16")
    tx, tr, tw = (to_torch(a).requires_grad_() for a in (x, r, w))
    y, res = torch_api.add_rms_norm(tx, tr, tw, EPS)
    torch.autograd.backward([y, res], [to_torch(dy), to_torch(dres)])
    ex, er, ew = (to_torch(a).requires_grad_() for a in (x, r, w))
    e_res = ex + er
    e_y = torch_api.rms_norm(e_res, ew, EPS)
    torch.autograd.backward([e_y, e_res], [to_torch(dy), to_torch(dres)])
    for a, b in ((y, e_y), (res, e_res), (tx.grad, ex.grad), (tr.grad, er.grad), (tw.grad, ew.grad)):
        assert same_bits(to_numpy(a), to_numpy(b))


def test_residual_out_gradient_may_be_none_and_module():
    rng, x, r, w = _inputs(("none-grad",), 5, 128, "bfloat16", "bfloat16")
    norm = torch_api.RMSNorm(128, EPS, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(to_torch(w))
    tx, tr = to_torch(x).requires_grad_(), to_torch(r).requires_grad_()
    y, res = norm(tx, tr)
    y.float().sum().backward()  # residual_out unused: its gradient is None
    ex, er = to_torch(x).requires_grad_(), to_torch(r).requires_grad_()
    torch_api.rms_norm(ex + er, norm.weight.detach(), EPS).float().sum().backward()
    assert same_bits(to_numpy(tx.grad), to_numpy(ex.grad)) and same_bits(to_numpy(tr.grad), to_numpy(er.grad))
    assert isinstance(norm(tx), torch.Tensor)


@pytest.mark.parametrize("rows,x_dtype,r_dtype,width", [(9, "bfloat16", "bfloat16", 128),
                                                        (1, "bfloat16", "float32", 5120)])
def test_jax_bitwise_equals_torch(rows, x_dtype, r_dtype, width):
    rng, x, r, w = _inputs(("jax", x_dtype, r_dtype, width), rows, width, x_dtype, r_dtype)
    res_dtype = str(R.promote(x.dtype, r.dtype))
    dy, dres = rand(rng, (rows, width), x_dtype), rand(rng, (rows, width), res_dtype)
    t = _torch_run(x, r, w, dy, dres, "llama")
    (y, res), vjp = jax.vjp(jax.jit(lambda x, r, w: jax_api.add_rms_norm(x, r, w, EPS)),
                            jnp.asarray(x), jnp.asarray(r), jnp.asarray(w))
    dx, dr, dw = vjp((jnp.asarray(dy), jnp.asarray(dres)))
    for a, b in zip(t, (y, res, dx, dr, dw)):
        assert same_bits(to_numpy(a), np.asarray(b))


def test_jax_vmap_grad():
    rng, x, r, w = _inputs(("vmap",), 6, 128, "bfloat16", "bfloat16")
    x, r = x.reshape(2, 3, 128), r.reshape(2, 3, 128)

    def loss(x, r, w):
        y, res = jax_api.add_rms_norm(x, r, w, EPS)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(res.astype(jnp.float32))

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, None)))(x, r, w)
    for i in range(2):
        one = jax.grad(loss, argnums=(0, 1, 2))(x[i], r[i], w)
        for a, b in zip(grads, one):
            assert same_bits(np.asarray(a[i]), np.asarray(b))


def test_torch_compile_fullgraph_and_forward_mode():
    rng, x, r, w = _inputs(("compile",), 4, 128, "bfloat16", "bfloat16")
    tx, tr, tw = to_torch(x), to_torch(r), to_torch(w)
    compiled = torch.compile(lambda x, r, w: torch_api.add_rms_norm(x, r, w, EPS), fullgraph=True, backend="eager")
    for a, b in zip(compiled(tx, tr, tw), torch_api.add_rms_norm(tx, tr, tw, EPS)):
        assert same_bits(to_numpy(a), to_numpy(b))
    # forward-mode AD: the composite (xkern's rms_norm of the sum), same primal bits
    tangent = to_torch(rand(rng, (4, 128), "bfloat16"))
    with torch.autograd.forward_ad.dual_level():
        y, res = torch_api.add_rms_norm(torch.autograd.forward_ad.make_dual(tx, tangent), tr, tw, EPS)
        assert torch.autograd.forward_ad.unpack_dual(y).tangent is not None
    assert same_bits(to_numpy(torch.autograd.forward_ad.unpack_dual(y).primal),
                     to_numpy(torch_api.add_rms_norm(tx, tr, tw, EPS)[0]))


def test_double_backward_matches_the_composite():
    rng, x, r, w = _inputs(("double",), 3, 64, "float32", "float32")

    def grad_norm(fn):
        tx, tr, tw = (to_torch(a).double().float().requires_grad_() for a in (x, r, w))
        y, res = fn(tx, tr, tw)
        (gx,) = torch.autograd.grad((y * y).sum() + res.sum(), tx, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), (tx, tr, tw))

    fused = grad_norm(lambda a, b, c: torch_api.add_rms_norm(a, b, c, EPS))
    eager = grad_norm(lambda a, b, c: (lambda s: (torch_api.rms_norm(s, c, EPS), s))(a + b))
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_inputs_name_residual():
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(TypeError, match="residual"):
        torch_api.add_rms_norm(x, np.zeros((2, 8)), w)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        torch_api.add_rms_norm(x, torch.randn(2, 4, device=DEVICE), w)
    with pytest.raises(TypeError, match="residual must be float16"):
        torch_api.add_rms_norm(x, torch.ones(2, 8, dtype=torch.int32, device=DEVICE), w)
    with pytest.raises(TypeError, match="residual_dtype"):
        torch_api.add_rms_norm(x, x, w, residual_dtype="float32")
    with pytest.raises(ValueError, match="residual must have x's shape"):
        jax_api.add_rms_norm(jnp.zeros((2, 8)), jnp.zeros((8,)), jnp.ones(8))


def test_empty_and_recipes_cache():
    y, res = torch_api.add_rms_norm(*(torch.randn(s, device=DEVICE) for s in ((0, 8), (0, 8), (8,))))
    assert y.shape == res.shape == (0, 8)
    assert add_rms_norm_fwd_recipe(4, 128, EPS, "bfloat16", "bfloat16", "bfloat16", "bfloat16") is \
        add_rms_norm_fwd_recipe(4, 128, EPS, "bfloat16", "bfloat16", "bfloat16", "bfloat16")
    # no residual_out gradient and equal dtypes: exactly rms_norm's backward launches (4 rows: one program,
    # which writes dw itself; 4096 rows: dw partials and their reduction)
    for rows, kernels in ((4, ["_rms_norm_bwd_kernel"]), (4096, ["_rms_norm_bwd_kernel", "_dw_reduce_kernel"])):
        plain = add_rms_norm_bwd_recipe(rows, 128, EPS, "bfloat16", "bfloat16", "bfloat16", False)
        assert plain == rms_norm_bwd_recipe(rows, 128, EPS, "bfloat16", "bfloat16")
        assert [s.launch.kernel.fn.__name__ for s in plain.steps if s.launch] == kernels
    # residual_out's gradient, a third stream read: two rows a tile where RMSNorm's plan takes one
    for width, rows in ((2048, (1, 2)), (1000, (1, 2)), (3072, (1, 2)), (4096, (1, 1)), (128, (32, 32))):
        plain, fused = (add_rms_norm_bwd_recipe(4096, width, EPS, "bfloat16", "bfloat16", "bfloat16", d).steps[0]
                        for d in (False, True))
        assert (plain.launch.constexprs["BLOCK_M"], fused.launch.constexprs["BLOCK_M"]) == rows


def test_compile_rewrites_norm_of_a_sum_to_the_fused_op():
    """Dynamo's graph of `rms_norm(x + r)` (and the sum used again, as in a decoder layer) through
    `fuse_add_rms_norm`, then AOT autograd: the fused op in the forward graph, its backward op in the backward
    graph, no separate add or norm; values and gradients bit for bit the eager pair's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from torch_api.compile_fusion import enable_compile_fusion, fuse_add_rms_norm

    graphs, rewrites = [], []

    def keep(gm, _):
        graphs.append(gm.graph)
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        rewrites.append(fuse_add_rms_norm(gm.graph))
        gm.recompile()
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    def block(x, r, w):
        s = r + x
        return torch_api.rms_norm(s, w, EPS) * 2, s

    rng, x, r, w = _inputs(("compile-fusion",), 9, 128, "bfloat16", "bfloat16")
    dy, ds = rand(rng, (9, 128), "bfloat16"), rand(rng, (9, 128), "bfloat16")
    outs = []
    for fn in (torch.compile(block, backend=backend, fullgraph=True), block):
        tx, tr, tw = (to_torch(a).requires_grad_() for a in (x, r, w))
        y, s = fn(tx, tr, tw)
        torch.autograd.backward([y, s], [to_torch(dy), to_torch(ds)])
        outs.append((y, s, tx.grad, tr.grad, tw.grad))
    assert rewrites == [1]
    targets = [set(graph_ops(g)) for g in graphs]
    assert "xkern.add_rms_norm_fwd.default" in targets[0] and "xkern.rms_norm_fwd.default" not in targets[0]
    assert "xkern.add_rms_norm_bwd.default" in targets[1] and "xkern.rms_norm_bwd.default" not in targets[1]
    assert not any("aten.add" in t for t in targets[0])
    for a, b in zip(*outs):
        assert same_bits(to_numpy(a), to_numpy(b))
    with torch._inductor.config.patch(pre_grad_custom_pass=None):
        enable_compile_fusion()
        enable_compile_fusion()  # idempotent
        passes = torch._inductor.config.pre_grad_custom_pass
        assert passes is not None and not isinstance(passes, (list, tuple))
        assert pickle.loads(pickle.dumps(passes)).uuid() == passes.uuid()  # Inductor's cache key pickles it


def test_torch_func_strided_and_zero_width():
    """torch.func (vmap, grad) through the composite: bitwise the direct calls; strided views read as their
    contiguous copies; width 0."""
    rng, x, r, w = _inputs(("func",), 12, 64, "bfloat16", "bfloat16")
    x, r, w = to_torch(x).view(3, 4, 64), to_torch(r).view(3, 4, 64), to_torch(w)
    vm = torch.func.vmap(lambda x, r: torch_api.add_rms_norm(x, r, w, EPS)[0])(x, r)
    assert same_bits(to_numpy(vm), to_numpy(torch.stack([torch_api.add_rms_norm(x[i], r[i], w, EPS)[0]
                                                         for i in range(3)])))
    gx = torch.func.grad(lambda x: torch_api.add_rms_norm(x, r, w, EPS)[0].float().sum())(x)
    xs = x.clone().requires_grad_()
    torch_api.add_rms_norm(xs, r, w, EPS)[0].float().sum().backward()
    assert same_bits(to_numpy(gx), to_numpy(xs.grad))
    big = torch.cat([x, r], -1)
    got = torch_api.add_rms_norm(big[..., ::2], big[..., 64:], w, EPS)
    want = torch_api.add_rms_norm(big[..., ::2].contiguous(), big[..., 64:].contiguous(), w, EPS)
    assert all(same_bits(to_numpy(a), to_numpy(b)) for a, b in zip(got, want))
    z, zr, zw = (torch.randn(*shape, device=DEVICE).requires_grad_() for shape in ((2, 0), (2, 0), (0,)))
    y, s = torch_api.add_rms_norm(z, zr, zw)
    (y.sum() + s.sum()).backward()
    assert y.shape == s.shape == z.grad.shape == zr.grad.shape == (2, 0) and zw.grad.shape == (0,)


def test_opcheck():
    """torch.library.opcheck of the registered ops: schema, fake implementation, autograd registration."""
    rng, x, r, w = _inputs(("opcheck",), 4, 64, "bfloat16", "float32")
    x, r, w = to_torch(x), to_torch(r), to_torch(w)
    torch.library.opcheck(torch.ops.xkern.add_rms_norm_fwd.default,
                          (x.requires_grad_(), r.requires_grad_(), w.requires_grad_(), EPS, "llama", "float32"))
    torch.library.opcheck(torch.ops.xkern.add_rms_norm_fwd.default, (x.detach(), r.detach(), None, EPS, "none",
                                                                      "float32"))
    res = (x.detach().float() + r.detach()).contiguous()
    dy = torch.randn_like(x.detach())
    torch.library.opcheck(torch.ops.xkern.add_rms_norm_bwd.default, (dy, torch.randn_like(res), res, w.detach(), EPS,
                                                                      "llama", "bfloat16"))
    torch.library.opcheck(torch.ops.xkern.add_rms_norm_bwd.default, (dy, None, res, w.detach(), EPS, "llama",
                                                                      "bfloat16"))
