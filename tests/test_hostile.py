"""Inputs a hostile user tries: each once gave a wrong answer, an out-of-bounds read or an error that did
not name the argument. Results are judged by the FP64 oracle (xkern/reference.py) or by
eager PyTorch; torch_api and jax_api must agree bit for bit where both take the input.

Shapes are tiny (the interpreter costs ~8 ms a program). The weight layouts below also run under
compute-sanitizer on the GPU (tests/gpu_sanitize.py).
"""

from __future__ import annotations

import os
import zlib
from datetime import timedelta

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import DEVICE, TORCH_DTYPES, rand, same_bits, to_numpy, to_torch
from jax.sharding import PartitionSpec as P

import jax_api
import torch_api
from xkern import reference as R
from xkern.rms_norm import plan_rms_norm_bwd, plan_rms_norm_fwd

EPS = 1e-5


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _hf(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm's expression, eager."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _check_fwd_bwd(y, dx, dw, x, w, dy, eps):
    """y, dx, dw (any framework) against the oracle, in the promoted output dtype."""
    y, dx, dw = to_numpy(y), to_numpy(dx), to_numpy(dw)
    assert y.dtype == R.promote(x.dtype, w.dtype), (y.dtype, x.dtype, w.dtype)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    R.check(y, R.rms_norm_fwd(x, w, eps), "fwd", R.rms_norm_fwd_tol(x, w, eps))
    dx_ref, dw_ref, dw_tol = R.rms_norm_bwd(x, w, dy, eps)
    R.check(dx, dx_ref, "dx")
    R.check(dw, dw_ref, "dw", dw_tol)


# ---------------------------------------------------------------------------------------------------
# A weight that is not contiguous (strided, expanded from one element) in every op that takes one.


@pytest.mark.parametrize("layout", ["strided", "expanded", "module"])
def test_weight_of_any_layout_matches_the_contiguous_weight(layout):
    rng = _rng(1, layout)
    n = 24
    x = rand(rng, (5, n), "float32")
    dy = rand(rng, (5, n), "float32")
    tx = to_torch(x).requires_grad_()
    if layout == "expanded":  # one stored element read as n: the kernels must not read n elements
        base = torch.tensor([1.5], device=DEVICE, requires_grad=True)
        tw = base.expand(n)
        leaf = base
    else:
        big = to_torch(rand(rng, (2 * n,), "float32", 0.5, 1.0)).requires_grad_()
        tw = big[::2]
        leaf = big
    if layout == "module":
        norm = torch_api.RMSNorm(n, EPS, device=DEVICE)
        norm.weight = torch.nn.Parameter(tw.detach())  # a Parameter over a strided view
        leaf = norm.weight
        y = norm(tx)
    else:
        y = torch_api.rms_norm(tx, tw, EPS)
    y.backward(to_torch(dy))
    w = to_numpy(tw.detach().contiguous())
    dw_ref = R.rms_norm_bwd(x, w, dy, EPS)[1]
    R.check(to_numpy(y), R.rms_norm_fwd(x, w, EPS), "fwd")
    R.check(to_numpy(tx.grad), R.rms_norm_bwd(x, w, dy, EPS)[0], "dx")
    got_dw = to_numpy(leaf.grad)
    want_dw = dw_ref.sum(keepdims=True) if layout == "expanded" else dw_ref
    if layout == "strided":  # the gradient lands on every other element of `big`, zero between
        assert np.all(got_dw[1::2] == 0)
        got_dw = got_dw[::2]
    np.testing.assert_allclose(got_dw, want_dw, rtol=1e-5, atol=1e-6)
    # JAX arrays have no strides: the same weights, sliced and broadcast, give the same bits as torch.
    jw = jnp.asarray(to_numpy(leaf.detach()))
    jw = jnp.broadcast_to(jw, (n,)) if layout == "expanded" else (jw[::2] if layout == "strided" else jw)
    assert same_bits(jax_api.rms_norm(jnp.asarray(x), jw, EPS), y)


# ---------------------------------------------------------------------------------------------------
# Forward-mode AD: torch.func.jvp and torch.autograd.forward_ad (and jvp of grad: Hessian-vector products).


def _jvp_both_ways(f, primals, tangents):
    out, tangent = torch.func.jvp(f, primals, tangents)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual_out = f(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents)))
        dual_tangent = fwAD.unpack_dual(dual_out).tangent
    assert dual_tangent is not None, "forward_ad gave no tangent"
    return out, tangent, dual_tangent


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_hvp", "permute_rows", "unpermute_rows"])
def test_forward_mode_ad_matches_the_oracle(op):
    rng = _rng(2, op)
    if op.startswith("rms_norm"):
        x, tx = (to_torch(rand(rng, (3, 16), "float32")) for _ in range(2))
        w, tw = (to_torch(rand(rng, (16,), "float32", 0.5, 1.0)) for _ in range(2))
        if op == "rms_norm":
            _, got, got_dual = _jvp_both_ways(lambda x, w: torch_api.rms_norm(x, w, EPS), (x, w), (tx, tw))
            _, want = torch.func.jvp(lambda x, w: _hf(x, w, EPS), (x, w), (tx, tw))
            for t in (got, got_dual):
                torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-5)
        else:  # Hessian-vector product: jvp of the gradient (forward mode through the backward)
            dy = to_torch(rand(rng, (3, 16), "float32"))

            def grad_of(norm):
                return torch.func.grad(lambda x, w: (norm(x, w, EPS) * dy).sum(), argnums=(0, 1))

            got = torch.func.jvp(grad_of(torch_api.rms_norm), (x, w), (tx, tw))[1]
            want = torch.func.jvp(grad_of(_hf), (x, w), (tx, tw))[1]
            for g, e in zip(got, want):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert want[0].abs().max() > 0 if isinstance(want, tuple) else want.abs().max() > 0
        return
    # The gathers: the jvp is the same gather of the tangent, bit for bit.
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEVICE)
    idx, _, _ = torch_api.generate_permute_indices(counts, 2, 2, 12, 4)
    x, tx = (to_torch(rand(rng, (6, 5), "bfloat16")) for _ in range(2))
    if op == "permute_rows":
        f, primal, tangent = (lambda a: torch_api.permute_rows(a, idx)), x, tx
    else:
        f, primal, tangent = (lambda a: torch_api.unpermute_rows(a, idx, 6)), torch_api.permute_rows(x, idx), \
            torch_api.permute_rows(tx, idx)
    _, got, got_dual = _jvp_both_ways(f, (primal,), (tangent,))
    want = f(tangent)
    assert same_bits(got, want) and same_bits(got_dual, want)


# ---------------------------------------------------------------------------------------------------
# Every float weight dtype eager accepts, with eager's promotion: out = promote(x, w), the normalized
# value rounded to x's dtype before the product.

_PAIRS = [(x, w) for x in ("bfloat16", "float16", "float32") for w in ("bfloat16", "float16", "float32") if x != w]


@pytest.mark.parametrize("x_dtype,w_dtype", _PAIRS)
def test_every_float_weight_dtype_promotes_as_eager(x_dtype, w_dtype):
    rng = _rng(3, x_dtype, w_dtype)
    shape = (4, 40)
    x = rand(rng, shape, x_dtype)
    w = rand(rng, (shape[-1],), w_dtype, 0.5, 1.0)
    out_dtype = torch.promote_types(TORCH_DTYPES[x_dtype], TORCH_DTYPES[w_dtype])
    tx, tw = to_torch(x).requires_grad_(), to_torch(w).requires_grad_()
    y = torch_api.rms_norm(tx, tw, EPS)
    assert y.dtype == out_dtype == _hf(tx, tw, EPS).dtype
    dy = rand(rng, shape, str(R.promote(x.dtype, w.dtype)))
    y.backward(to_torch(dy))
    _check_fwd_bwd(y, tx.grad, tw.grad, x, w, dy, EPS)
    # the module takes the same pairs (a bf16 RMSNorm over fp32 activations, HF's mixed precision)
    norm = torch_api.RMSNorm(shape[-1], EPS, device=DEVICE, dtype=TORCH_DTYPES[w_dtype])
    with torch.no_grad():
        norm.weight.copy_(to_torch(w))
    assert same_bits(norm(to_torch(x)), y)
    jy, vjp = jax.vjp(lambda a, b: jax_api.rms_norm(a, b, EPS), jnp.asarray(x), jnp.asarray(w))
    jdx, jdw = vjp(jnp.asarray(dy))
    assert same_bits(jy, y) and same_bits(jdx, tx.grad) and same_bits(jdw, tw.grad)


def test_float64_weight_is_refused_by_name():
    # The kernels compute in fp32: a float64 weight (eager would multiply in float64) is a clear error.
    x, w = torch.ones(2, 8, device=DEVICE) + 0.5, torch.ones(8, device=DEVICE, dtype=torch.float64)
    with pytest.raises(TypeError, match="weight must be float16, bfloat16 or float32, got float64"):
        torch_api.rms_norm(x, w, EPS)
    with pytest.raises(TypeError, match="weight must be float16, bfloat16 or float32"):
        jax_api.rms_norm(jnp.ones((2, 8)), np.ones(8, np.float64), EPS)


# ---------------------------------------------------------------------------------------------------
# Width 0: an empty [..., 0] result, as eager and jax_api give, and empty gradients.


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_width_zero_gives_empty_results_and_gradients(dtype):
    x = torch.empty(4, 0, dtype=TORCH_DTYPES[dtype], device=DEVICE).requires_grad_()
    w = torch.empty(0, dtype=TORCH_DTYPES[dtype], device=DEVICE).requires_grad_()
    want = _hf(x, w, EPS)
    for y in (torch_api.rms_norm(x, w, EPS), torch_api.RMSNorm(0, EPS, device=DEVICE,
                                                                dtype=TORCH_DTYPES[dtype])(x)):
        assert y.shape == want.shape == (4, 0) and y.dtype == want.dtype
    y = torch_api.rms_norm(x, w, EPS)
    y.sum().backward()
    assert x.grad.shape == (4, 0) and w.grad.shape == (0,)
    jx, jw = jnp.zeros((4, 0), dtype), jnp.zeros((0,), dtype)
    jy = jax_api.rms_norm(jx, jw, EPS)
    jdx, jdw = jax.grad(lambda a, b: jax_api.rms_norm(a, b, EPS).astype(jnp.float32).sum(), (0, 1))(jx, jw)
    assert jy.shape == (4, 0) and jdx.shape == (4, 0) and jdw.shape == (0,)


# ---------------------------------------------------------------------------------------------------
# eps of the wrong type: a TypeError that names eps.


# 0-d tensors and arrays too (`float()` would take them), and bools
@pytest.mark.parametrize("eps", ["1e-6", None, [1e-6], torch.tensor(1e-6), np.array(1e-6), jnp.array(1e-6),
                                 np.bool_(False), False], ids=repr)
def test_eps_of_wrong_type_raises_type_error_naming_eps(eps):
    x = torch.ones(2, 8, device=DEVICE) + 0.5
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(TypeError, match="eps"):
        torch_api.rms_norm(x, w, eps)
    with pytest.raises(TypeError, match="eps"):
        torch_api.RMSNorm(8, eps, device=DEVICE)(x)
    with pytest.raises(TypeError, match="eps"):
        jax_api.rms_norm(jnp.asarray(to_numpy(x)), jnp.asarray(to_numpy(w)), eps)


def test_eps_bool_after_a_cached_call_raises():
    """Eager calls check on the first call of a signature: eps=True (== 1, hashing alike) must not ride on
    a cached eps=1 call."""
    x = torch.ones(2, 8, device=DEVICE) + 0.5
    w = torch.ones(8, device=DEVICE)
    torch_api.rms_norm(x, w, 1)
    with pytest.raises(TypeError, match="eps"):
        torch_api.rms_norm(x, w, True)


def test_every_eager_op_checks_a_call_that_equals_a_cached_one():
    """One eager path for every torch op: executors cached per call signature, the arguments checked on a
    miss. A bad argument equal to a cached good one (True == 1, 2.0 == 2) must miss and be refused, every
    call."""
    x = torch.ones(4, 8, device=DEVICE) + 0.5
    w = torch.ones(8, device=DEVICE)
    torch_api.add_rms_norm(x, x, w, 1)
    idx = torch.tensor([1, 0, -1, 3, 2], dtype=torch.int32, device=DEVICE)
    y = torch.randn(5, 8, device=DEVICE)
    probs = torch.rand(2, 2, device=DEVICE)
    torch_api.permute_rows(x[:2], idx, top_k=2)
    torch_api.unpermute_rows(y, idx, 4, top_k=2, probs=probs)
    torch_api.inverse_permutation(idx, 4)
    for _ in range(2):
        with pytest.raises(TypeError, match="eps"):
            torch_api.add_rms_norm(x, x, w, True)
        with pytest.raises(TypeError, match="top_k"):
            torch_api.permute_rows(x[:2], idx, top_k=2.0)
        with pytest.raises(TypeError, match="top_k"):
            torch_api.unpermute_rows(y, idx, 4, top_k=2.0, probs=probs)
        with pytest.raises(TypeError, match="num_rows"):
            torch_api.inverse_permutation(idx, 4.0)
        with pytest.raises(ValueError, match="probs"):
            torch_api.unpermute_rows(y, idx, 4, top_k=2, probs=probs.T[:1])


# ---------------------------------------------------------------------------------------------------
# Index arithmetic that would overflow int32: an error naming the argument, never a wrapped layout.


def test_index_arithmetic_past_int32_raises_naming_the_argument():
    import xkern.launch

    MAX_ROWS = getattr(xkern.launch, "MAX_ROWS", 2**31 - 2**20)  # the kernels' int32 row numbering
    counts = np.array([3, 1, 0, 2], np.int32)
    for api, conv in ((torch_api, lambda a: to_torch(a)), (jax_api, jnp.asarray)):
        # every expert gets at least one aligned block: 4 * 2**30 slots would wrap m_offsets
        with pytest.raises(ValueError, match="alignment"):
            api.generate_permute_indices(conv(counts), 4, 1, 64, 2**30)
        with pytest.raises(ValueError, match="max_len"):
            api.generate_permute_indices(conv(counts), 4, 1, 2**31, 16)
        # counts summing past int32 (row numbers are int32): found with validate=True
        big = np.array([2**30, 2**30, 2**30, 1], np.int64)
        if api is jax_api and not jax.config.jax_enable_x64:
            big = big.astype(np.int32)[:1].repeat(4)  # int32: 4 * 2**30 rows
        with pytest.raises(ValueError, match="tokens_per_expert_group"):
            api.generate_permute_indices(conv(big), 4, 1, 2**31 - 2**21, 1, validate=True)
    # the small layout still works next to the limits (alignment 2**28: 4 blocks fit int32)
    idx, m_sizes, m_offsets = torch_api.generate_permute_indices(to_torch(counts), 4, 1, 16, 2**28)
    assert m_offsets.tolist() == [2**28, 2**29, 3 * 2**28, 2**30] and m_sizes.tolist() == [2**28] * 4
    assert idx.tolist() == [0, 1, 2] + [-1] * 13
    # rows and slots are numbered in int32 lanes: more is an error naming the argument (shapes only,
    # nothing allocated: the JAX calls are traced with eval_shape)
    too_many = jax.ShapeDtypeStruct((MAX_ROWS + 1,), jnp.int32)
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="permuted_indices"):
        jax.eval_shape(lambda i: jax_api.permute_rows(x, i), too_many)
    with pytest.raises(ValueError, match="num_rows"):
        jax.eval_shape(lambda i: jax_api.inverse_permutation(i, MAX_ROWS + 1), jax.ShapeDtypeStruct((4,), jnp.int32))
    with pytest.raises(ValueError, match="x has"):
        jax.eval_shape(lambda a: jax_api.rms_norm(a, jnp.ones(1, jnp.bfloat16)),
                       jax.ShapeDtypeStruct((MAX_ROWS + 1, 1), jnp.bfloat16))
    for plan in (plan_rms_norm_fwd, plan_rms_norm_bwd):
        with pytest.raises(ValueError, match="x has"):
            plan(2**31, 16, EPS)
        with pytest.raises(ValueError, match="x has .* columns"):
            plan(1, 2**31, EPS)
        plan(MAX_ROWS, 16, EPS)  # the largest count still plans


# ---------------------------------------------------------------------------------------------------
# EP dispatch bad input: ValueError/TypeError naming the argument (torch: a one-rank gloo group; JAX: a
# one-device shard_map).


@pytest.fixture
def gloo_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ep_dispatch_bad_input_raises_naming_the_argument(gloo_group):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7)) + 0.5
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    bad = [
        (ValueError, "topk_ids", dict(topk_ids=torch.tensor([[0, 1], [2, 4], [1, 0]]))),   # = num_experts
        (ValueError, "topk_ids", dict(topk_ids=torch.tensor([[0, 1], [2, -1], [1, 0]]))),  # negative
        (TypeError, "topk_ids", dict(topk_ids=ids.float() + 0.25)),                          # float ids
        (ValueError, "alignment", dict(alignment=0)),
        (TypeError, "alignment", dict(alignment=4.0)),
        (ValueError, "num_experts", dict(num_experts=0)),
    ]
    for exc, name, kwargs in bad:
        args = dict(x=x, topk_ids=ids, num_experts=4, alignment=4) | kwargs
        with pytest.raises(exc, match=name):
            torch_api.ep_dispatch(args.pop("x"), args.pop("topk_ids"), args.pop("num_experts"), **args)
    # and the good call next to them still routes every row (gloo moves CPU tensors: the interpreter's
    # kernels; on a GPU machine tests/test_ep.py runs its ranks under the interpreter)
    if os.environ.get("TRITON_INTERPRET") == "1":
        xp, m_sizes, _, handle = torch_api.ep_dispatch(x, ids, 4, alignment=4)
        assert m_sizes.tolist() == [4] * 4
        assert torch.equal(torch_api.ep_combine(xp, torch.ones(3, 2), handle), 2 * x)

    mesh = jax.make_mesh((1,), ("ep",))
    jx = jnp.asarray(x.numpy())

    def dispatch(ids, **kw):
        def shard(x, ids, w):
            xp, _, _, h = jax_api.ep_dispatch(x, ids, 4, "ep", 8, **kw)
            return jax_api.ep_combine(xp, w, h)  # identity experts
        f = jax.shard_map(shard, mesh=mesh, in_specs=(P(),) * 3, out_specs=P(), check_vma=False)
        return jax.jit(f)(jx, ids, jnp.ones((3, 2), jnp.float32))

    with pytest.raises(TypeError, match="topk_ids"):
        dispatch(jnp.asarray(ids.numpy()).astype(jnp.float32) + 0.25)
    with pytest.raises(ValueError, match="alignment"):
        dispatch(jnp.asarray(ids.numpy()), alignment=0)
    neg = jnp.asarray([[0, 1], [2, -1], [1, 5]], jnp.int32)
    # traced ids: out-of-range rows go nowhere (validate=True fails the computation naming topk_ids)
    keep = np.array([[1, 1], [1, 0], [1, 0]], np.float32)
    np.testing.assert_array_equal(np.asarray(dispatch(neg)), keep.sum(1, keepdims=True) * x.numpy())
    with pytest.raises(Exception, match="topk_ids must be expert ids"):
        jax.block_until_ready(dispatch(neg, validate=True))


# ---------------------------------------------------------------------------------------------------
# The CPU path meets the GPU's contract on subnormals: exact bf16 -> fp32 conversion in the interpreter,
# and no flush to zero on JAX's callback threads. torch and JAX agree bit for bit, and match the oracle.


def _subnormal_rows(dtype: str) -> np.ndarray:
    """Every positive subnormal of a 16-bit dtype (and their negatives), or a spread of fp32 ones, in rows."""
    if dtype == "float32":
        mags = np.geomspace(1.5e-45, 1.1e-38, 256).astype(np.float32)
    else:
        bits = np.arange(1, 1 << (ml_dtypes.finfo(R.np_dtype(dtype)).nmant), dtype=np.uint16)
        mags = bits.view(R.np_dtype(dtype))
    signs = np.where(_rng(8, dtype).random(mags.size) < 0.5, -1, 1).astype(mags.dtype)
    vals = (mags * signs).astype(R.np_dtype(dtype))
    return vals[: vals.size // 8 * 8].reshape(8, -1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_subnormal_rows_on_cpu_keep_the_gpu_contract(dtype):
    x = _subnormal_rows(dtype)
    rng = _rng(8, "w", dtype)
    w = rand(rng, (x.shape[-1],), dtype, 0.5, 1.0)
    dy = rand(rng, x.shape, dtype)
    tx, tw = to_torch(x).requires_grad_(), to_torch(w).requires_grad_()
    ty = torch_api.rms_norm(tx, tw, EPS)
    ty.backward(to_torch(dy))
    jy, vjp = jax.vjp(lambda a, b: jax_api.rms_norm(a, b, EPS), jnp.asarray(x), jnp.asarray(w))
    jdx, jdw = vjp(jnp.asarray(dy))
    assert np.all(to_numpy(ty).astype(np.float64) != 0), "a subnormal row flushed to zero"
    _check_fwd_bwd(ty, tx.grad, tw.grad, x, w, dy, EPS)
    assert same_bits(jy, ty) and same_bits(jdx, tx.grad) and same_bits(jdw, tw.grad)
    # the gathers copy subnormal rows bit for bit in both front ends
    idx = np.array([3, -1, 0, 7, 1, 2, 6, 5, 4, -1], np.int32)
    want = R.permute_rows(x, idx)
    assert same_bits(torch_api.permute_rows(to_torch(x), to_torch(idx)), want)
    assert same_bits(jax_api.permute_rows(jnp.asarray(x), jnp.asarray(idx)), want)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's own conversion")
def test_interpreter_bf16_to_fp32_is_exact():
    import triton
    import triton.language as tl

    @triton.jit
    def widen(X, Y, N: tl.constexpr):
        cols = tl.arange(0, N)
        tl.store(Y + cols, tl.load(X + cols).to(tl.float32))

    bits = np.arange(1 << 16, dtype=np.uint16)  # every bf16: zeros, subnormals, normals, inf, NaN payloads
    x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    y = torch.empty(bits.size, dtype=torch.float32)
    torch_api._launch.launch  # noqa: B018 (importing torch_api patches the interpreter)
    widen[(1,)](x, y, N=bits.size)
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(y.numpy().view(np.uint32), want.view(np.uint32))
