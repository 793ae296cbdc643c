"""MoE dispatch from token rows and the weighted top-k combine: `permute_rows(x, idx, top_k=k)` and
`unpermute_rows(y, idx, T * k, top_k=k, probs=p)`, both front ends, against the FP64 oracle (CPU: Triton's
interpreter). Routed copy r = t * k + j is token t's j-th expert; layouts have padding, dropped copies and
empty experts.

The gather is bitwise (it moves rows); the combine and the gradients sum in FP32 and round once, so they
are held to `reference.combine_tolerance`; torch and JAX must agree bit for bit everywhere.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import DEVICE, rand, same_bits, to_numpy, to_torch

import jax_api
import torch_api
from xkern import reference as R
from xkern.permute import plan_combine, plan_combine_bwd, plan_gather_token_rows, plan_scatter_inverse
from xkern.testing import launch


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _routing(key, tokens: int, top_k: int, experts: int, alignment: int = 4, drop: bool = True) -> np.ndarray:
    """Expert-major padded slots of the T * k routed copies (token t picks k distinct experts; the last
    expert is never picked: an empty block), -1 at padding; with `drop`, every 3rd copy of each expert is
    dropped (capacity), leaving its slot as padding."""
    rng = _rng("routing", *key)
    ids = np.stack([rng.permutation(experts - 1)[:top_k] for _ in range(tokens)]).reshape(-1)
    slots = []
    for e in range(experts):
        block = [int(r) for r in np.flatnonzero(ids == e)]
        if drop:
            block = [-1 if i % 3 == 2 else r for i, r in enumerate(block)]
        block += [-1] * (-len(block) % alignment or (alignment if not block else 0))
        slots += block
    return np.array(slots, np.int64)


def _check(got, ref64, mag64, n_terms: int, dtype: str, what: str) -> None:
    """`got` (in `dtype`) within `combine_tolerance` of the float64 truth `ref64`; `mag64` = the sum of the
    terms' magnitudes."""
    got = to_numpy(got)
    assert got.shape == ref64.shape and got.dtype == R.np_dtype(dtype), what
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"{what}: not finite"
    err, tol = np.abs(got - ref64), R.combine_tolerance(mag64, n_terms, dtype)
    assert (err <= tol).all(), f"{what}: max err {err.max()}, {int((err > tol).sum())} elements past tolerance"


def _torch_run(x, y, probs, dout_c, dout_p, idx, top_k):
    """permute(top_k) forward and backward, combine forward and backward: [p, dx, out, dy, dprobs]."""
    tidx = to_torch(idx)
    tx = to_torch(x).requires_grad_()
    perm = torch_api.permute_rows(tx, tidx, top_k=top_k)
    perm.backward(to_torch(dout_p))
    n = x.shape[0] * top_k
    ty = to_torch(y).requires_grad_()
    tp = None if probs is None else to_torch(probs).requires_grad_()
    out = torch_api.unpermute_rows(ty, tidx, n, top_k=top_k, probs=tp)
    out.backward(to_torch(dout_c))
    return [perm, tx.grad, out, ty.grad, None if tp is None else tp.grad]


def _jax_run(x, y, probs, dout_c, dout_p, idx, top_k):
    jidx = jnp.asarray(idx)
    n = x.shape[0] * top_k

    def f(x, y, probs):
        return (jax_api.permute_rows(x, jidx, top_k=top_k),
                jax_api.unpermute_rows(y, jidx, n, top_k=top_k, probs=probs))

    args = (jnp.asarray(x), jnp.asarray(y), None if probs is None else jnp.asarray(probs))
    (perm, out), vjp = jax.vjp(jax.jit(f), *args)
    dx, dy, dprobs = jax.jit(vjp)((jnp.asarray(dout_p), jnp.asarray(dout_c)))
    return [perm, dx, out, dy, dprobs]


CASES = [  # (top_k, y dtype, probs dtype or None, hidden, index dtype)
    (1, "float32", "float32", 24, "int32"),
    (1, "bfloat16", None, 40, "int64"),
    (2, "bfloat16", "float32", 40, "int64"),
    (2, "float16", None, 33, "int32"),
    (2, "float32", "bfloat16", 24, "int32"),
    (8, "bfloat16", "bfloat16", 40, "int32"),
    (8, "bfloat16", "float32", 1100, "int64"),
    (8, "float32", None, 24, "int32"),
    (10, "bfloat16", "float32", 40, "int32"),  # more copies than the combine unrolls (MAX_UNROLL_K)
]


@pytest.mark.parametrize("top_k,dtype,probs_dtype,hidden,index", CASES)
def test_topk_ops_match_oracle_and_torch_equals_jax(top_k, dtype, probs_dtype, hidden, index):
    tokens = 7
    idx = _routing((top_k, dtype, hidden), tokens, top_k, top_k + 2).astype(index)
    n, slots = tokens * top_k, len(idx)
    assert (idx == -1).any() and len(np.setdiff1d(np.arange(n), idx)) > 0  # padding and dropped copies
    rng = _rng("values", top_k, dtype, probs_dtype, hidden)
    x, y = rand(rng, (tokens, hidden), dtype), rand(rng, (slots, hidden), dtype)
    dout_c, dout_p = rand(rng, (tokens, hidden), dtype), rand(rng, (slots, hidden), dtype)
    probs = None if probs_dtype is None else rand(rng, (tokens, top_k), probs_dtype)
    got_t = _torch_run(x, y, probs, dout_c, dout_p, idx, top_k)
    with jax.enable_x64(index == "int64"):
        got_j = _jax_run(x, y, probs, dout_c, dout_p, idx, top_k)
    for name, t, j in zip(("permute", "permute dx", "combine", "combine dy", "dprobs"), got_t, got_j, strict=True):
        assert (t is None) == (j is None), name
        assert t is None or same_bits(t, j), f"torch and jax differ: {name}"
    perm, dx, out, dy, dprobs = got_t
    assert same_bits(perm, R.permute_token_rows(x, idx, top_k))
    absx = lambda a: np.abs(np.asarray(a, np.float64))  # noqa: E731
    _check(dx, R.combine_rows(dout_p, idx, n, top_k), R.combine_rows(absx(dout_p), idx, n, top_k), top_k, dtype,
           "permute dx")
    p_abs = None if probs is None else absx(probs)
    _check(out, R.combine_rows(y, idx, n, top_k, probs), R.combine_rows(absx(y), idx, n, top_k, p_abs), top_k,
           dtype, "combine")
    ref_dy, ref_dp = R.combine_rows_bwd(dout_c, y, idx, n, top_k, probs)
    mag_dy, mag_dp = R.combine_rows_bwd(absx(dout_c), absx(y), idx, n, top_k, p_abs)
    _check(dy, ref_dy, mag_dy, 1, dtype, "combine dy")
    if probs is not None:
        assert to_numpy(dprobs).dtype == probs.dtype
        _check(dprobs, ref_dp, mag_dp, hidden, probs_dtype, "dprobs")
        dropped = np.setdiff1d(np.arange(n), idx)
        assert np.all(to_numpy(dprobs).reshape(-1)[dropped].astype(np.float32) == 0)
    if top_k == 1 and probs is None:  # today's op, bit for bit
        assert same_bits(out, R.unpermute_rows(y, idx, n))


def test_every_output_element_is_written():
    """The new kernels on NaN-poisoned outputs (dprobs arrives zero-filled, as its recipe allocates it; the
    inverse's scratch holds garbage)."""
    tokens, top_k, hidden = 5, 3, 40
    idx_np = _routing(("poison",), tokens, top_k, 6).astype(np.int32)
    n, slots = tokens * top_k, len(idx_np)
    idx = to_torch(idx_np)
    rng = _rng("poison")
    x, y, d = (rand(rng, shape, "bfloat16") for shape in ((tokens, hidden), (slots, hidden), (tokens, hidden)))
    probs = rand(rng, (tokens, top_k), "float32")
    out = torch.full((slots, hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch(plan_gather_token_rows(slots, hidden, 2, hidden), to_torch(x), idx, out, n_rows=slots, n_cols=hidden,
           n_src_rows=tokens, src_row_stride=hidden, top_k=top_k)
    assert same_bits(out, R.permute_token_rows(x, idx_np, top_k))
    for garbage in (-1, 0, 3):
        raw = torch.full((n,), garbage, dtype=torch.int32, device=DEVICE)
        launch(plan_scatter_inverse(slots), idx, raw, n_slots=slots, n_rows=n)
        comb = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        launch(plan_combine(tokens, hidden, 2, hidden, True, top_k), to_torch(y), raw, idx, to_torch(probs), comb,
               n_tokens=tokens, n_cols=hidden, n_src_rows=slots, src_row_stride=hidden, top_k=top_k)
        assert same_bits(comb, torch_api.unpermute_rows(to_torch(y), idx, n, top_k=top_k, probs=to_torch(probs)))
    dy = torch.full((slots, hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dprobs = torch.zeros((n,), dtype=torch.float32, device=DEVICE)
    launch(plan_combine_bwd(slots, hidden, 2, hidden, hidden), to_torch(d), to_torch(y), idx, to_torch(probs), dy,
           dprobs, n_slots=slots, n_cols=hidden, num_rows=n, dout_row_stride=hidden, y_row_stride=hidden, top_k=top_k)
    assert not torch.isnan(dy).any() and torch.all(dy[to_torch(idx_np < 0)] == 0)
    ref_dp = R.combine_rows_bwd(d, y, idx_np, n, top_k, probs)[1].reshape(-1)
    assert np.allclose(to_numpy(dprobs), ref_dp, rtol=1e-5, atol=1e-5)


def _ref_combine(y, idx, n, k, probs):
    """The combine in plain torch (float64 inputs give the float64 truth of any derivative order)."""
    idx = idx.to(y.device)
    valid = idx >= 0
    rows = y[valid] * probs.reshape(-1)[idx[valid]][:, None]
    return torch.zeros(n // k, y.shape[1], dtype=y.dtype, device=y.device).index_add(0, idx[valid] // k, rows)


def test_double_backward_against_float64_autograd():
    """d/d(y, p) of <grad_y L, c> + <grad_p L, e> with L = <combine(y, p), w>: the backward's own backward
    (the combine and its gradient kernel again); torch and JAX bit for bit, both near float64 autograd."""
    tokens, top_k, hidden = 6, 2, 24
    idx_np = _routing(("double",), tokens, top_k, 5)
    n = tokens * top_k
    rng = _rng("double")
    y, w, c = (rand(rng, s, "float32") for s in ((len(idx_np), hidden), (tokens, hidden), (len(idx_np), hidden)))
    p, e = rand(rng, (tokens, top_k), "float32"), rand(rng, (tokens, top_k), "float32")

    def torch_second(combine, dtype):
        cast = lambda a: to_torch(a).to(dtype)  # noqa: E731
        ty, tp, tw = cast(y).requires_grad_(), cast(p).requires_grad_(), cast(w).requires_grad_()
        loss = (combine(ty, tp) * tw).sum()
        gy, gp, gw = torch.autograd.grad(loss, (ty, tp, tw), create_graph=True)
        second = (gy * cast(c)).sum() + (gp * cast(e)).sum()
        return torch.autograd.grad(second, (ty, tp, tw))

    tidx = to_torch(idx_np)
    got = torch_second(lambda y, p: torch_api.unpermute_rows(y, tidx, n, top_k=top_k, probs=p), torch.float32)
    want = torch_second(lambda y, p: _ref_combine(y, tidx.cpu(), n, top_k, p), torch.float64)
    for g, r, name in zip(got, want, ("y", "p", "w"), strict=True):
        assert torch.allclose(g.double().cpu(), r.cpu(), rtol=1e-5, atol=1e-5), name

    jidx = jnp.asarray(idx_np.astype(np.int32))

    def jax_second(y, p, w):
        def loss(y, p, w):
            return jnp.sum(jax_api.unpermute_rows(y, jidx, n, top_k=top_k, probs=p) * w)

        gy, gp, _ = jax.grad(loss, argnums=(0, 1, 2))(y, p, w)
        return jnp.sum(gy * jnp.asarray(c)) + jnp.sum(gp * jnp.asarray(e))

    got_j = jax.jit(jax.grad(jax_second, argnums=(0, 1, 2)))(jnp.asarray(y), jnp.asarray(p), jnp.asarray(w))
    for g, j, name in zip(got, got_j, ("y", "p", "w"), strict=True):
        assert same_bits(g, j), name


def test_jax_vmap_per_example_indices():
    tokens, top_k, hidden = 4, 2, 16
    idx = np.stack([_routing(("vmap", b), tokens, top_k, 4, drop=False)[:12] for b in range(2)]).astype(np.int32)
    rng = _rng("vmap")
    y, x = rand(rng, (2, 12, hidden), "float32"), rand(rng, (2, tokens, hidden), "float32")
    p = rand(rng, (2, tokens, top_k), "float32")

    def f(x, y, i, p):
        return (jax_api.permute_rows(x, i, top_k=top_k),
                jax_api.unpermute_rows(y, i, tokens * top_k, top_k=top_k, probs=p))

    got = jax.vmap(f)(jnp.asarray(x), jnp.asarray(y), jnp.asarray(idx), jnp.asarray(p))
    for b in range(2):
        want = f(jnp.asarray(x[b]), jnp.asarray(y[b]), jnp.asarray(idx[b]), jnp.asarray(p[b]))
        assert all(same_bits(g[b], w) for g, w in zip(got, want, strict=True))


def test_torch_compile_fullgraph_moe_step():
    tokens, top_k, hidden = 6, 2, 16
    idx_np = _routing(("compile",), tokens, top_k, 5)
    tidx = to_torch(idx_np.astype(np.int32))
    rng = _rng("compile")
    x = to_torch(rand(rng, (tokens, hidden), "float32"))
    w = to_torch(rand(rng, (len(idx_np), hidden), "float32"))
    p = to_torch(rand(rng, (tokens, top_k), "float32"))

    def f(x, p):
        h = torch_api.permute_rows(x, tidx, top_k=top_k) * w
        return torch_api.unpermute_rows(h, tidx, tokens * top_k, top_k=top_k, probs=p)

    args_c = [a.clone().requires_grad_() for a in (x, p)]
    args_e = [a.clone().requires_grad_() for a in (x, p)]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args_c)
    want = f(*args_e)
    assert same_bits(got, want)
    got.sum().backward()
    want.sum().backward()
    assert all(same_bits(a.grad, b.grad) for a, b in zip(args_c, args_e, strict=True))


def test_empty_and_zero_width():
    top_k = 2
    for tokens, hidden in ((0, 8), (3, 0)):
        idx = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
        idx[:tokens * top_k] = torch.arange(tokens * top_k, dtype=torch.int32, device=DEVICE)
        x = torch.ones(tokens, hidden, device=DEVICE, requires_grad=True)
        assert torch_api.permute_rows(x, idx, top_k=2).shape == (6, hidden)
        y = torch.ones(6, hidden, device=DEVICE, requires_grad=True)
        p = torch.ones(tokens, top_k, device=DEVICE, requires_grad=True)
        out = torch_api.unpermute_rows(y, idx, tokens * top_k, top_k=top_k, probs=p)
        assert out.shape == (tokens, hidden)
        out.sum().backward()
        assert torch.count_nonzero(y.grad) == 0 and torch.count_nonzero(p.grad) == 0

        def loss(y, p, jidx, n):
            return jax_api.unpermute_rows(y, jidx, n, top_k=top_k, probs=p).sum()

        grads = jax.grad(loss, argnums=(0, 1))(jnp.ones((6, hidden)), jnp.ones((tokens, top_k)),
                                               jnp.asarray(to_numpy(idx)), tokens * top_k)
        assert not any(np.any(np.asarray(g)) for g in grads)


def _bad_topk_calls(api, x, y, idx, probs):
    return [
        (ValueError, "top_k must be >= 1", lambda: api.permute_rows(x, idx, top_k=0)),
        (TypeError, "top_k must be an int", lambda: api.permute_rows(x, idx, top_k=2.0)),
        (ValueError, "top_k must be >= 1", lambda: api.unpermute_rows(y, idx, 8, top_k=-1)),
        (ValueError, "num_rows must be a multiple of top_k=3", lambda: api.unpermute_rows(y, idx, 8, top_k=3)),
        (ValueError, r"probs must be \[num_rows // top_k, top_k\] = \[4, 2\], got \[2, 4\]",
         lambda: api.unpermute_rows(y, idx, 8, top_k=2, probs=probs.reshape(2, 4))),
        (TypeError, "probs must be float16, bfloat16 or float32",
         lambda: api.unpermute_rows(y, idx, 8, top_k=2, probs=idx[:8].reshape(4, 2))),
    ]


def test_bad_arguments_raise_clear_errors():
    x, y = torch.ones(4, 3, device=DEVICE), torch.ones(9, 3, device=DEVICE)
    idx = torch.tensor([0, 1, -1, 3, 2, 5, 4, 7, 6], dtype=torch.int32, device=DEVICE)
    probs = torch.ones(4, 2, device=DEVICE)
    calls = _bad_topk_calls(torch_api, x, y, idx, probs)
    calls += _bad_topk_calls(jax_api, *(jnp.asarray(to_numpy(t)) for t in (x, y, idx, probs)))
    for exc, message, fn in calls:
        with pytest.raises(exc, match=message):
            fn()
    bad = torch.tensor([0, 1, -1, 3, 2, 5, 4, 8, 6], dtype=torch.int32, device=DEVICE)  # 8: past T * top_k
    for fn in (lambda: torch_api.permute_rows(x, bad, validate=True, top_k=2),
               lambda: torch_api.unpermute_rows(y, bad, 8, validate=True, top_k=2, probs=probs),
               lambda: jax_api.permute_rows(jnp.ones((4, 3)), jnp.asarray(to_numpy(bad)), validate=True, top_k=2)):
        with pytest.raises(ValueError, match=r"permuted_indices\[7\] = 8 is out of range"):
            fn()
    dropped = torch.tensor([0, 1, -1, 3, -1, 5, 4, 7, 6], dtype=torch.int32, device=DEVICE)  # copy 2 dropped
    torch_api.permute_rows(x, dropped, validate=True, top_k=2)
    torch_api.unpermute_rows(y, dropped, 8, validate=True, top_k=2, probs=probs)
    jax_api.unpermute_rows(jnp.ones((9, 3)), jnp.asarray(to_numpy(dropped)), 8, validate=True, top_k=2)
    with pytest.raises(ValueError, match="never names row 2"):  # the plain op still wants every row
        torch_api.unpermute_rows(y, dropped, 8, validate=True)
    with pytest.raises(ValueError, match="probs must be on"):
        torch_api.unpermute_rows(y, idx, 8, top_k=2, probs=probs.to("meta"))


def test_moe_layer_benchmark_paths_agree():
    """benchmarks/moe_layer.py's step at its smoke size: xkern's path and the peers' give the same layer
    (outputs and every gradient, to bf16 rounding), and xkern's is the same bits run to run."""
    from benchmarks import moe_layer

    size = moe_layer.SMOKE_SIZE
    inp = moe_layer.torch_inputs(size, DEVICE)
    steps = {name: moe_layer.torch_step(moe_layer.TORCH_PATHS[name], inp, size["top_k"], size["experts"], whole=True)
             for name in ("xkern", "torchtitan", "plain")}
    for name in ("torchtitan", "plain"):
        for got, want in zip(steps["xkern"], steps[name], strict=True):
            scale = want.float().abs().max()
            assert (got.float() - want.float()).abs().max() <= 2e-2 * scale, name
    again = moe_layer.torch_step(moe_layer.xkern_path, inp, size["top_k"], size["experts"], whole=True)
    assert all(moe_layer.same_bits(a, b) for a, b in zip(again, steps["xkern"], strict=True))


def test_torch_forward_mode_and_hvp():
    """jvp of the top_k gather and of the weighted combine (linear in y and in p), and a Hessian-vector
    product through the combine's backward (forward mode over reverse), against float64 autograd."""
    tokens, top_k, hidden = 5, 2, 16
    idx_np = _routing(("jvp",), tokens, top_k, 4)
    n, tidx = tokens * top_k, to_torch(idx_np)
    rng = _rng("jvp")
    x, tx = (to_torch(rand(rng, (tokens, hidden), "float32")) for _ in range(2))
    y, ty = (to_torch(rand(rng, (len(idx_np), hidden), "float32")) for _ in range(2))
    p, tp = (to_torch(rand(rng, (tokens, top_k), "float32")) for _ in range(2))
    _, got = torch.func.jvp(lambda x: torch_api.permute_rows(x, tidx, top_k=top_k), (x,), (tx,))
    assert same_bits(got, torch_api.permute_rows(tx, tidx, top_k=top_k))

    def combine(y, p):
        return torch_api.unpermute_rows(y, tidx, n, top_k=top_k, probs=p)

    def ref(y, p):
        return _ref_combine(y, tidx.cpu(), n, top_k, p)

    _, got = torch.func.jvp(combine, (y, p), (ty, tp))
    _, want = torch.func.jvp(ref, (y.double().cpu(), p.double().cpu()), (ty.double().cpu(), tp.double().cpu()))
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    w = to_torch(rand(rng, (tokens, hidden), "float32"))

    def hvp(f, cast):
        grad = torch.func.grad(lambda y, p: (f(y, p) * cast(w)).sum(), argnums=(0, 1))
        return torch.func.jvp(grad, (cast(y), cast(p)), (cast(ty), cast(tp)))[1]

    got = hvp(combine, lambda t: t)
    want = hvp(ref, lambda t: t.double().cpu())
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double().cpu(), r, rtol=1e-5, atol=1e-5)


def test_opcheck_topk_ops():
    idx = torch.tensor([3, -1, 0, 5, 1, 2, 4, -1, 7], dtype=torch.int32, device=DEVICE)  # copy 6 dropped
    g = torch.Generator().manual_seed(0)
    x, y, d = (torch.randn(*s, generator=g).to(DEVICE).requires_grad_() for s in ((4, 8), (9, 8), (4, 8)))
    p = torch.rand(4, 2, generator=g).to(DEVICE).requires_grad_()
    torch.library.opcheck(torch.ops.xkern.permute_token_rows.default, (x, idx, 2))
    torch.library.opcheck(torch.ops.xkern.combine_rows.default, (y, idx, 8, 2, p))
    torch.library.opcheck(torch.ops.xkern.combine_rows.default, (y, idx, 8, 2, None))
    torch.library.opcheck(torch.ops.xkern.combine_rows_bwd.default, (d, y, idx, p, 8, 2))


def test_indices_naming_no_copy_are_dropped():
    """Without validate=True an index naming no routed copy (below -1, >= T * top_k, past int32 in int64)
    names nothing: a zero row in the dispatch, nothing added in the combine, no gradient anywhere."""
    tokens, top_k, hidden = 3, 2, 8
    idx = np.array([0, 2**40, 1, -5, 2, 6, 3, 4, 5], np.int64)  # 2**40, -5 and 6 (= T * top_k) name nothing
    rng = _rng("naming-no-copy")
    x, y = rand(rng, (tokens, hidden), "float32"), rand(rng, (len(idx), hidden), "float32")
    p = rand(rng, (tokens, top_k), "float32")
    clean = np.where((idx >= 0) & (idx < tokens * top_k), idx, -1)
    tx, ty, tp = (to_torch(a).requires_grad_() for a in (x, y, p))
    perm = torch_api.permute_rows(tx, to_torch(idx), top_k=top_k)
    out = torch_api.unpermute_rows(ty, to_torch(idx), tokens * top_k, top_k=top_k, probs=tp)
    assert same_bits(perm, R.permute_token_rows(x, clean, top_k))
    (out.sum() + perm.sum()).backward()
    ref = R.combine_rows(y, clean, tokens * top_k, top_k, p)
    assert np.allclose(to_numpy(out), ref, rtol=1e-6, atol=1e-6)
    ref_dy, ref_dp = R.combine_rows_bwd(np.ones((tokens, hidden)), y, clean, tokens * top_k, top_k, p)
    assert np.allclose(to_numpy(ty.grad), ref_dy, rtol=1e-6, atol=1e-6)
    assert np.allclose(to_numpy(tp.grad), ref_dp, rtol=1e-5, atol=1e-5)
    with jax.enable_x64(True):
        jout = jax_api.unpermute_rows(jnp.asarray(y), jnp.asarray(idx), tokens * top_k, top_k=top_k,
                                      probs=jnp.asarray(p))
        assert same_bits(jout, out)


@pytest.mark.parametrize("top_k, weighted", [(1, False), (2, False), (2, True), (1, True)],
                         ids=["gather", "copy-sum", "combine", "combine-k1"])
def test_each_unpermute_form_is_the_core_recipe(monkeypatch, top_k, weighted):
    """Which form of unpermute_rows runs is `xkern.permute.unpermute_recipe`'s choice alone: an eager call
    launches that recipe's kernels and nothing else, with the registered op's bits, and the backward is
    permute_rows(top_k) without probs or the combine's backward kernel with them."""
    from torch_api import _launch
    from xkern.permute import combine_bwd_recipe, permute_recipe, unpermute_recipe

    tokens, h = 3, 8
    idx = to_torch(_routing(("form", top_k), tokens, top_k, 3, drop=False).astype(np.int32))
    rng = _rng("form", top_k, weighted)
    y = to_torch(rand(rng, (idx.shape[0], h), "float32")).requires_grad_()
    probs = to_torch(rand(rng, (tokens, top_k), "float32")).requires_grad_() if weighted else None
    dout = to_torch(rand(rng, (tokens if top_k > 1 or weighted else tokens * top_k, h), "float32"))
    launched = []
    real = _launch._Launcher.__call__

    def launch(self, arrays, device):
        launched.append(self.plan.kernel)
        return real(self, arrays, device)

    monkeypatch.setattr(_launch._Launcher, "__call__", launch)
    out = torch_api.unpermute_rows(y, idx, tokens * top_k, top_k=top_k, probs=probs)
    n_slots = int(idx.shape[0])
    fwd = unpermute_recipe(n_slots, h, tokens * top_k, "float32", h, "int32", top_k,
                           "float32" if weighted else None)
    bwd = combine_bwd_recipe(n_slots, h, tokens * top_k, "float32", h, h, top_k, "float32") if weighted else \
        permute_recipe(n_slots, h, out.shape[0], "float32", h, top_k)
    grads = torch.autograd.grad(out, (y, probs) if weighted else (y,), dout)
    assert launched == [s.launch.kernel for r in (fwd, bwd) for s in r.steps if s.launch is not None]
    monkeypatch.undo()
    if top_k == 1 and not weighted:
        want = torch.ops.xkern.unpermute_rows(y.detach(), idx, tokens)
    else:
        want = torch.ops.xkern.combine_rows(y.detach(), idx, tokens * top_k, top_k,
                                            None if probs is None else probs.detach())
    assert same_bits(out, want)
    want_dy = torch.ops.xkern.combine_rows_bwd(dout, y.detach(), idx, probs.detach(), tokens * top_k, top_k)[0] \
        if weighted else torch_api.permute_rows(dout, idx, top_k=top_k)
    assert same_bits(grads[0], want_dy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_token_major_dispatch_is_the_gather(dtype):
    """permute_rows(top_k) token-major (`permute_recipe(..., token_major=True)`: each token row read once,
    written to its copies' slots; padding slots zeroed by programs of their own) gives the gather's result bit
    for bit: padding, dropped copies and an empty expert, output poisoned first so that every slot must be
    written."""
    from torch_api._launch import launch as launch_plan
    from torch_api._launch import run_recipe
    from xkern.launch import Recipe
    from xkern.permute import permute_recipe

    tokens, top_k, hidden = 13, 3, 40
    idx = to_torch(_routing(("token-major", dtype), tokens, top_k, experts=6).astype(np.int32))
    x = to_torch(rand(_rng("token-major values", dtype), (tokens, hidden), dtype))
    want = torch_api.permute_rows(x, idx, top_k=top_k)
    recipe = permute_recipe(idx.numel(), hidden, tokens, dtype, hidden, top_k, "int32", token_major=True)
    scatter, rows = recipe.steps
    (raw,) = run_recipe(Recipe((scatter,), ("slot_of",)), DEVICE, idx=idx)
    out = torch.full((idx.numel(), hidden), float("nan"), dtype=x.dtype, device=DEVICE)
    launch_plan(rows.launch, x, raw, idx, out, **rows.scalars)
    assert same_bits(out, want)
    assert (idx < 0).any() and not out[idx < 0].any()  # zero rows at padding


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_token_major_combine_backward_is_the_slot_major_one(dtype):
    """The combine backward token-major (`combine_bwd_recipe(..., token_major=True)`: each dout row read once)
    gives the slot-major form's dy and dprobs bit for bit (the same tile sums each row in the same chunks):
    padding slots zeroed, dropped copies' dprobs 0, dy poisoned first so that every slot must be written."""
    from torch_api._launch import launch as launch_plan
    from torch_api._launch import run_recipe
    from xkern.launch import Recipe
    from xkern.permute import combine_bwd_recipe

    tokens, top_k, hidden = 13, 3, 40
    idx = to_torch(_routing(("token-major bwd", dtype), tokens, top_k, experts=6).astype(np.int32))
    rng = _rng("token-major bwd values", dtype)
    dout, y = to_torch(rand(rng, (tokens, hidden), dtype)), to_torch(rand(rng, (idx.numel(), hidden), dtype))
    probs = to_torch(rand(rng, (tokens * top_k,), dtype))
    args = (idx.numel(), hidden, tokens * top_k, dtype, hidden, hidden, top_k, dtype)
    want = run_recipe(combine_bwd_recipe(*args, "int32", token_major=False), DEVICE, dout=dout, y=y, idx=idx,
                      probs=probs)
    scatter, grads = combine_bwd_recipe(*args, "int32", token_major=True).steps
    (raw,) = run_recipe(Recipe((scatter,), ("slot_of",)), DEVICE, idx=idx)
    dy = torch.full((idx.numel(), hidden), float("nan"), dtype=dout.dtype, device=DEVICE)
    dprobs = torch.zeros(tokens * top_k, dtype=probs.dtype, device=DEVICE)
    launch_plan(grads.launch, dout, y, raw, idx, probs, dy, dprobs, **grads.scalars)
    assert same_bits(dy, want[0]) and same_bits(dprobs, want[1])
    assert not dy[idx < 0].any() and (dprobs != 0).sum() == (idx >= 0).sum()  # padding zero; a dprob per slot


def test_token_major_regime_is_bitwise_the_one_launch_regime(monkeypatch):
    """Above ONE_LAUNCH_SLOTS slots permute_rows(top_k) and the weighted combine's backward run token-major
    (`permute_recipe`, `combine_bwd_recipe`): through both front ends, forward and backward, bit for bit the
    one-launch regime's results (the threshold lowered here, so that small shapes cross it)."""
    from torch_api._launch import executor_cache
    from xkern import permute
    from xkern.permute import plans as permute_plans

    tokens, top_k, hidden = 11, 4, 72
    idx = _routing(("regime",), tokens, top_k, experts=5).astype(np.int32)
    rng = _rng("regime")
    x, y = rand(rng, (tokens, hidden), "bfloat16"), rand(rng, (len(idx), hidden), "bfloat16")
    probs = rand(rng, (tokens, top_k), "float32")
    dout_c, dout_p = rand(rng, (tokens, hidden), "bfloat16"), rand(rng, (len(idx), hidden), "bfloat16")
    args = (x, y, probs, dout_c, dout_p, idx, top_k)

    def kernels():
        fwd = permute.permute_recipe(len(idx), hidden, tokens, "bfloat16", hidden, top_k, "int32")
        bwd = permute.combine_bwd_recipe(len(idx), hidden, tokens * top_k, "bfloat16", hidden, hidden, top_k, "float32")
        return {s.launch.kernel.__name__ for r in (fwd, bwd) for s in r.steps}

    results = []
    for threshold in (permute_plans.ONE_LAUNCH_SLOTS, 8):
        monkeypatch.setattr(permute_plans, "ONE_LAUNCH_SLOTS", threshold)
        permute.permute_recipe.cache_clear()
        permute.combine_bwd_recipe.cache_clear()
        token_major = {"_scatter_token_rows_kernel", "_combine_bwd_token_kernel"}
        assert (token_major <= kernels()) == (threshold == 8), kernels()
        with executor_cache():
            results.append((_torch_run(*args), _jax_run(*args)))
    permute.permute_recipe.cache_clear()
    permute.combine_bwd_recipe.cache_clear()
    (t1, j1), (t2, j2) = results
    for a, b, c, d in zip(t1, t2, j1, j2, strict=True):
        assert same_bits(a, b) and same_bits(c, d) and same_bits(a, to_torch(np.asarray(c)))
