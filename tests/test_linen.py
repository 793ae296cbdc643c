"""jax_api.linen.RMSNorm: the drop-in for flax.linen.RMSNorm. Its parameters are flax's (name, shape, dtype,
initialisation), its outputs flax's within a rounding of the output dtype (the same expression, one rounding;
intermediates associate differently), its errors name what it does not take, and the README's line runs.
CPU: Triton's interpreter, tiny shapes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from jax_api import linen as xlinen

ROOT = Path(__file__).resolve().parent.parent
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _pair(**kwargs):
    kwargs.setdefault("scale_init", nn.initializers.normal(0.5))  # a random scale, so that it matters
    return nn.RMSNorm(epsilon=1e-5, **kwargs), xlinen.RMSNorm(epsilon=1e-5, **kwargs)


def _oracle(x, scale, eps=1e-5) -> np.ndarray:
    """flax's math in float64: x * rsqrt(mean(x^2) + eps) * scale."""
    x64 = np.asarray(x, np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return y if scale is None else y * np.asarray(scale, np.float64)


def _as_close_as_flax(got, flax, ref64) -> None:
    """|xkern - ref| <= 2 |flax - ref| + 4 ULPs of the output dtype at |ref|: each rounds its intermediates (the
    statistic's sum, rsqrt, two products), xkern's rsqrt approximate on the GPU (up to 2 ULP; 3 of 96 fp32
    elements took more than one ULP past flax's error on the H100), and flax's own error may be 0 at an
    element."""
    ulp = 4 * np.abs(ref64) * 2.0 ** -jnp.finfo(got.dtype).nmant
    err, err_flax = (np.abs(np.asarray(a, np.float64) - ref64) for a in (got, flax))
    bad = err > 2 * err_flax + ulp
    assert not bad.any(), f"{bad.sum()} elements, worst {err[bad].max()} vs flax {err_flax[bad].max()}"


# (x dtype, param_dtype, dtype): flax's default (float32 scale) on 16-bit x, all 16-bit, a 16-bit output of float32
# math, a float32 output of 16-bit inputs
CASES = [(F32, F32, None), (BF16, F32, None), (BF16, BF16, None),
         *(pytest.param(*c, marks=pytest.mark.slow) for c in ((F16, F16, None), (F32, F32, BF16), (F16, F16, F32)))]


@pytest.mark.parametrize("x_dtype,param_dtype,dtype", CASES)
def test_matches_flax_linen(x_dtype, param_dtype, dtype):
    ref, mine = _pair(param_dtype=param_dtype, dtype=dtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 16)), x_dtype)
    params = ref.init(jax.random.key(0), x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), mine.init(jax.random.key(0), x)) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), mine.init(jax.random.key(0), x),
                                            params)))  # the same initialisation: a checkpoint loads unchanged
    want, got = ref.apply(params, x), mine.apply(params, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    _as_close_as_flax(got, want, _oracle(x, params["params"]["scale"]))
    # gradients in x and scale: flax's within a few ULPs of their dtype (sums of a few roundings)
    loss = lambda m: lambda p, x: jnp.sum(jnp.sin(m.apply(p, x).astype(F32)))  # noqa: E731
    g_want, g_got = jax.grad(loss(ref), (0, 1))(params, x), jax.grad(loss(mine), (0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        scale = np.abs(np.asarray(b, np.float64)).max()
        assert np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() <= \
            8 * scale * 2.0 ** -jnp.finfo(a.dtype).nmant


def test_without_scale_and_in_a_model_under_jit_and_jvp():
    class Block(nn.Module):
        norm: type

        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(self.norm(use_scale=False)(x)) + self.norm(name="out")(x)

    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 16)), F32)
    params = Block(nn.RMSNorm).init(jax.random.key(0), x)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params,
                                     Block(xlinen.RMSNorm).init(jax.random.key(0), x)))
    f_ref, f = (jax.jit(lambda p, x, m=m: Block(m).apply(p, x)) for m in (nn.RMSNorm, xlinen.RMSNorm))
    np.testing.assert_allclose(np.asarray(f(params, x)), np.asarray(f_ref(params, x)), rtol=2e-6, atol=1e-6)
    t, t_ref = (jax.jvp(lambda x, g=g: g(params, x), (x,), (x,))[1] for g in (f, f_ref))
    np.testing.assert_allclose(np.asarray(t), np.asarray(t_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(reduction_axes=(-2, -1)), "reduction_axes"),
    (dict(reduction_axes=-2, feature_axes=-2), "reduction_axes"),
    (dict(feature_axes=-2), "feature_axes"),
    (dict(axis_name="batch"), "axis_name"),
    (dict(force_float32_reductions=False), "force_float32_reductions"),
])
def test_refuses_what_it_does_not_compute(kwargs, match):
    with pytest.raises(ValueError, match=match):
        xlinen.RMSNorm(**kwargs)


def test_call_time_errors():
    x = jnp.ones((2, 8), F32)
    norm = xlinen.RMSNorm()
    params = norm.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="mask"):
        norm.apply(params, x, mask=jnp.ones((2, 8), bool))
    with pytest.raises(ValueError, match="reduction_axes"):
        xlinen.RMSNorm(reduction_axes=0, feature_axes=0).init(jax.random.key(0), jnp.ones((8, 2), F32))


def test_readme_linen_line():
    text = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("y_linen = xlinen.RMSNorm()")]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 64)), F32)
    ns = {"xlinen": xlinen, "jnp": jnp, "x": x}
    exec(line, ns)
    want = nn.RMSNorm().apply({"params": {"scale": jnp.ones(64)}}, x)
    _as_close_as_flax(ns["y_linen"], want, _oracle(x, None))
