"""jax_api.nnx: the drop-in for flax.nnx.RMSNorm and replace_rms_norm. Each result is judged against the FP64
oracle of flax's math (`scale * x * rstd`, one rounding: the "olmo2" expression of xkern/reference.py) and must
be as close to it as flax's own, within a ULP (|xkern - ref| <= 2 |flax - ref| + atol), besides the contract's
ULP thresholds. CPU: Triton's interpreter, tiny shapes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import rand

from jax_api import nnx as xn
from xkern import reference as R

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-6
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """The models' Linear layers in full FP32 on a GPU too (TF32 there by default would turn a norm's last-bit
    difference into a TF32 rounding of the next layer's input)."""
    with jax.default_matmul_precision("highest"):
        yield


def _np(a) -> np.ndarray:
    return np.asarray(a)


def _ulp(ref64: np.ndarray, dtype) -> np.ndarray:
    """One ULP of `dtype` at each |ref|."""
    return np.abs(ref64) * 2.0 ** -ml_dtypes.finfo(R.np_dtype(jnp.dtype(dtype).name)).nmant


def _as_close_as_flax(got, flax, ref64, atol, what: str) -> None:
    err_got = np.abs(_np(got).astype(np.float64) - ref64)
    err_flax = np.abs(_np(flax).astype(np.float64) - ref64)
    bad = err_got > 2 * err_flax + atol
    assert not bad.any(), f"{what}: {bad.sum()} elements, worst {err_got[bad].max()} vs flax {err_flax[bad].max()}"


def _norm_pair(n: int, **kwargs):
    """flax's RMSNorm and xkern's, built alike (a random scale, so that it matters)."""
    kwargs.setdefault("scale_init", nnx.initializers.normal(0.5))
    return (nnx.RMSNorm(n, epsilon=EPS, rngs=nnx.Rngs(3), **kwargs),
            xn.RMSNorm(n, epsilon=EPS, rngs=nnx.Rngs(3), **kwargs))


def _scale(m):
    return None if m.scale is None else m.scale[...]


# x's dtype, param_dtype, dtype: the promoted computation dtype D is 16-bit (OLMo-2's kernel) or float32 (Llama's)
CASES = [("bfloat16", BF16, None), ("float16", F16, None), ("float32", F32, None), ("bfloat16", F32, None),
         ("float32", F32, BF16)]


@pytest.mark.parametrize("x_dtype,param_dtype,dtype", CASES)
@pytest.mark.parametrize("use_scale", [True, False])
def test_forward_matches_flax_within_contract(x_dtype, param_dtype, dtype, use_scale):
    flax_norm, xk_norm = _norm_pair(24, param_dtype=param_dtype, dtype=dtype, use_scale=use_scale)
    x = jnp.asarray(rand(np.random.default_rng(0), (3, 5, 24), x_dtype))
    want, got = flax_norm(x), xk_norm(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    d = want.dtype  # flax's D: x and scale are promoted to it before the statistics
    xd = _np(x.astype(d))
    scale = _scale(xk_norm)
    ref = R.rms_norm_fwd(xd, None if scale is None else _np(scale.astype(d)), EPS, "olmo2")
    R.check(_np(got), ref, "fwd")
    R.check(_np(want), ref, "fwd")  # the oracle is flax's math: flax meets it too
    # float32: rstd, normed and the product each round in FP32 (in another order than flax's): 2 ULPs
    _as_close_as_flax(got, want, ref, _ulp(ref, d) * (2 if d == F32 else 1), "y")
    if d != F32:  # one rounding of (nearly) the same FP32 value: flax's bits but for rare ties
        assert np.mean(_np(got).view(np.uint16) == _np(want).view(np.uint16)) >= 0.99


def _loss(m, x, dy):
    return jnp.sum(m(x).astype(F32) * dy)


@pytest.mark.parametrize("x_dtype,param_dtype", [("bfloat16", BF16), ("float16", F16), ("float32", F32)])
def test_gradient_matches_flax_within_contract(x_dtype, param_dtype):
    flax_norm, xk_norm = _norm_pair(32, param_dtype=param_dtype)
    rng = np.random.default_rng(1)
    x, dy = jnp.asarray(rand(rng, (6, 32), x_dtype)), jnp.asarray(rand(rng, (6, 32), "float32"))
    grad = nnx.grad(_loss, argnums=(0, 1))
    (g_flax, dx_flax), (g_xk, dx_xk) = grad(flax_norm, x, dy), grad(xk_norm, x, dy)
    dw_flax, dw_xk = g_flax["scale"][...], g_xk["scale"][...]
    assert dx_xk.dtype == dx_flax.dtype == x.dtype and dw_xk.dtype == dw_flax.dtype == param_dtype
    w = _np(_scale(xk_norm))
    dy_d = _np(dy.astype(x.dtype))  # y's cotangent in D (the loss upcasts y)
    dx_ref, dw_ref, dw_tol = R.rms_norm_bwd(_np(x), w, dy_d, EPS, xn._variant(x.dtype))
    R.check(_np(dx_xk), dx_ref, "dx")
    R.check(_np(dw_xk), dw_ref, "dw", abs_ok=dw_tol)
    _as_close_as_flax(dx_xk, dx_flax, dx_ref, _ulp(dx_ref, x.dtype) + 1e-7, "dx")
    _as_close_as_flax(dw_xk, dw_flax, dw_ref, _ulp(dw_ref, param_dtype) + dw_tol, "dscale")


class _Block(nnx.Module):
    """A norm between two layers: the layer after it is initialised from the same random stream."""

    def __init__(self, norm_cls, rngs, **norm_kwargs):
        self.inp = nnx.Linear(8, 16, rngs=rngs)
        self.norm = norm_cls(16, rngs=rngs, **norm_kwargs)
        self.out = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(self.inp(x)))


def _bits(state) -> list:
    return [(p, _np(v).dtype, _np(v).tobytes()) for p, v in nnx.to_flat_state(state)]


@pytest.mark.parametrize("kwargs", [{}, {"use_scale": False}, {"param_dtype": BF16, "scale_init": nnx.initializers.
                                                                    normal(1.0)}])
def test_parameters_and_initialisation_identical(kwargs):
    flax_block = _Block(nnx.RMSNorm, nnx.Rngs(7), **kwargs)
    xk_block = _Block(xn.RMSNorm, nnx.Rngs(7), **kwargs)
    assert _bits(nnx.state(xk_block)) == _bits(nnx.state(flax_block))  # names, dtypes, values; the next layer too
    assert isinstance(xk_block.norm, nnx.RMSNorm)
    assert ("scale" in nnx.state(xk_block.norm)) == kwargs.get("use_scale", True)


def test_state_of_a_flax_model_loads_and_round_trips():
    flax_block = _Block(nnx.RMSNorm, nnx.Rngs(1), scale_init=nnx.initializers.normal(1.0))
    xk_block = _Block(xn.RMSNorm, nnx.Rngs(2))  # other values everywhere
    nnx.update(xk_block, nnx.state(flax_block))
    assert _bits(nnx.state(xk_block)) == _bits(nnx.state(flax_block))
    x = jnp.asarray(rand(np.random.default_rng(2), (4, 8), "float32"))
    np.testing.assert_allclose(_np(xk_block(x)), _np(flax_block(x)), rtol=1e-5, atol=1e-6)
    graphdef, state = nnx.split(xk_block)
    again = nnx.merge(graphdef, state)
    assert type(again.norm) is xn.RMSNorm and np.array_equal(_np(again(x)), _np(xk_block(x)))


class _Sub(nnx.RMSNorm):
    """A user's subclass: its own __call__, left alone."""


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.RMSNorm(16, rngs=rngs, scale_init=nnx.initializers.normal(1.0))
        self.layers = nnx.List([nnx.RMSNorm(16, rngs=rngs), nnx.RMSNorm(16, rngs=rngs, axis_name="batch")])
        self.shared = self.a  # one module, two places
        self.sub = _Sub(16, rngs=rngs)
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return self.layers[0](self.lin(self.a(x)))


def test_replace_rms_norm_counts_keeps_parameters_and_reports_the_rest():
    model = _Model(nnx.Rngs(0))
    x = jnp.asarray(rand(np.random.default_rng(3), (5, 16), "float32"))
    before, scale = model(x), model.a.scale
    with pytest.raises(ValueError, match=r"layers\.1: axis_name='batch'"):
        xn.replace_rms_norm(model, strict=True)
    assert type(model.a) is nnx.RMSNorm  # strict: nothing changed
    with pytest.warns(UserWarning, match=r"1 flax.nnx.RMSNorm kept.*layers\.1: axis_name='batch'"):
        assert xn.replace_rms_norm(model) == 2  # a (shared: once) and layers[0]
    assert type(model.a) is xn.RMSNorm and model.shared is model.a and model.a.scale is scale
    assert type(model.layers[0]) is xn.RMSNorm and type(model.layers[1]) is nnx.RMSNorm and type(model.sub) is _Sub
    np.testing.assert_allclose(_np(model(x)), _np(before), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings(record=True):
        assert xn.replace_rms_norm(model) == 0  # a second call: nothing left to take
    norm = nnx.RMSNorm(16, rngs=nnx.Rngs(0))
    assert xn.replace_rms_norm(norm) == 1 and type(norm) is xn.RMSNorm  # the model itself
    with pytest.raises(TypeError, match="flax.nnx.Module"):
        xn.replace_rms_norm({"norm": norm})


@pytest.mark.parametrize("kwargs,match", [
    ({"reduction_axes": (-2, -1)}, "reduction_axes=.* one axis, the last"),
    ({"reduction_axes": -2, "feature_axes": -2}, "reduction_axes=-2"),
    ({"feature_axes": -2}, "feature_axes=-2 with reduction_axes=-1"),
    ({"axis_name": "batch"}, "axis_name='batch'"),
    ({"axis_index_groups": [[0, 1]]}, "axis_name=None"),
    ({"dtype": jnp.int32}, "dtype=int32"),
    ({"param_dtype": jnp.int8}, "param_dtype=int8"),
])
def test_refused_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        xn.RMSNorm(16, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(ValueError, match=match):  # the same reason from replace_rms_norm
        xn.replace_rms_norm(nnx.RMSNorm(16, rngs=nnx.Rngs(0), **kwargs), strict=True)


def test_call_time_errors_and_the_last_axis_by_number():
    x = jnp.asarray(rand(np.random.default_rng(4), (2, 3, 16), "float32"))
    norm = xn.RMSNorm(16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mask"):
        norm(x, mask=jnp.ones(x.shape, bool))
    with pytest.raises(ValueError, match="shape"):
        norm(x[..., :8])  # num_features 16
    with pytest.raises(ValueError, match="last axis only"):
        xn.RMSNorm(16, rngs=nnx.Rngs(0), reduction_axes=1, feature_axes=1)(x)
    flax_norm, xk_norm = _norm_pair(16, reduction_axes=2, feature_axes=2)  # the last of 3: accepted
    np.testing.assert_allclose(_np(xk_norm(x)), _np(flax_norm(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("x_dtype,r_dtype,param_dtype,dtype,fused", [
    ("bfloat16", "bfloat16", BF16, None, True),    # D bf16: the whole block in 16 bits
    ("bfloat16", "float32", F32, None, True),      # a float32 residual stream
    ("bfloat16", "bfloat16", F32, None, True),     # bf16 sum, f32 norm
    ("float32", "float32", F32, BF16, False),      # D narrower than x: jnp's add, then the norm
])
def test_fused_residual_add(monkeypatch, x_dtype, r_dtype, param_dtype, dtype, fused):
    calls, fused_op = [], xn.add_rms_norm
    monkeypatch.setattr(xn, "add_rms_norm", lambda *a, **k: calls.append(1) or fused_op(*a, **k))
    flax_norm, xk_norm = _norm_pair(24, param_dtype=param_dtype, dtype=dtype)
    rng = np.random.default_rng(5)
    x, r = jnp.asarray(rand(rng, (4, 24), x_dtype)), jnp.asarray(rand(rng, (4, 24), r_dtype))
    y, h = xk_norm(x, residual=r)
    want_h = x + r
    want_y = flax_norm(want_h)
    assert bool(calls) == fused
    assert h.dtype == want_h.dtype and y.dtype == want_y.dtype
    assert np.array_equal(_np(h), _np(want_h))  # both the exact sum, rounded once
    d = want_y.dtype
    ref = R.rms_norm_fwd(_np(want_h.astype(d)), _np(_scale(xk_norm).astype(d)), EPS, "olmo2")
    R.check(_np(y), ref, "fwd")
    _as_close_as_flax(y, want_y, ref, _ulp(ref, d), "y")

    def loss(m, x, r, fuse):
        y, h = m(x, residual=r) if fuse else (m(x + r), x + r)
        return jnp.sum(jnp.sin(y.astype(F32))) + jnp.sum(jnp.cos(h.astype(F32)))

    grad = nnx.grad(loss, argnums=(0, 1, 2))
    for got, want in zip(jax.tree.leaves(grad(xk_norm, x, r, True)), jax.tree.leaves(grad(flax_norm, x, r, False))):
        assert got.dtype == want.dtype
        # 8 ULPs of the gradients' scale, in the narrower of their dtype and D (where the backward computes)
        tol = 8 * 2.0 ** -min(ml_dtypes.finfo(R.np_dtype(t.name)).nmant for t in (got.dtype, jnp.dtype(d)))
        np.testing.assert_allclose(_np(got).astype(np.float64), _np(want).astype(np.float64), rtol=tol,
                                   atol=tol * float(np.abs(_np(want).astype(np.float64)).max()))


def test_jit_grad_and_a_train_step():
    flax_block = _Block(nnx.RMSNorm, nnx.Rngs(4), scale_init=nnx.initializers.normal(1.0))
    xk_block = _Block(nnx.RMSNorm, nnx.Rngs(4), scale_init=nnx.initializers.normal(1.0))
    flax_opt, xk_opt = (nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (flax_block, xk_block))
    assert xn.replace_rms_norm(xk_block) == 1  # after the optimizer was built: its state still fits
    rng = np.random.default_rng(6)
    x, y = jnp.asarray(rand(rng, (4, 8), "float32")), jnp.asarray(rand(rng, (4, 8), "float32"))

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    for _ in range(2):
        np.testing.assert_allclose(float(step(xk_block, xk_opt, x, y)), float(step(flax_block, flax_opt, x, y)),
                                   rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(xk_block)), nnx.to_flat_state(nnx.state(flax_block))):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-5, atol=1e-6, err_msg=str(path))
    # jax.jit over the functional split: the norm gives eager's bits (the same kernels); the block's linear
    # layers may round differently once XLA fuses them (on a GPU), so the block is compared within fp32.
    graphdef, state = nnx.split(xk_block)
    f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    np.testing.assert_allclose(_np(f(state, x)), _np(xk_block(x)), rtol=1e-5, atol=1e-6)
    h = xk_block.inp(x)
    norm_graph, norm_state = nnx.split(xk_block.norm)
    g = jax.jit(lambda s, h: nnx.merge(norm_graph, s)(h))
    assert np.array_equal(_np(g(norm_state, h)), _np(xk_block.norm(h)))


def _readme_nnx_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- section: ecosystem -->(.*?)<!-- /section: ecosystem -->", text, re.S).group(1)
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "from flax import nnx" in b]
    return block


def test_readme_nnx_block_trains_as_flax_does():
    ns: dict = {}
    exec(_readme_nnx_block(), ns)  # the README's example, as written
    assert ns["n"] == 2 and type(ns["model"].norm) is xn.RMSNorm
    flax_model = ns["MLP"](64, nnx.Rngs(0))  # the same model without replace_rms_norm
    optimizer = nnx.Optimizer(flax_model, optax.adamw(1e-2), wrt=nnx.Param)
    want = [float(ns["step"](flax_model, optimizer, ns["x"], ns["y"])) for _ in range(3)]
    assert want[-1] < want[0]  # it trains
    np.testing.assert_allclose(ns["losses"], want, rtol=1e-5)  # float32: the contract's 1e-5 of the value


def test_import_jax_api_needs_no_flax():
    code = "import sys, jax_api; assert not [m for m in sys.modules if m.split('.')[0] in ('flax', 'optax')]; " \
           "assert 'jax_api.nnx' not in sys.modules; print('ok')"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
