"""Flax NNX: `RMSNorm`, a drop-in for `flax.nnx.RMSNorm` that computes through `jax_api.rms_norm` (and
`jax_api.add_rms_norm` for `norm(x, residual=r)`), and `replace_rms_norm(model)`, which turns every
`flax.nnx.RMSNorm` of an existing model whose math xkern computes into it, in place.

Needs flax (`pip install -e ".[flax]"`); `import jax_api` does not import this module.

flax.nnx.RMSNorm's math (flax/nnx/nn/normalization.py): x and scale are promoted to one dtype D
(`promote_dtype((x, scale), dtype=dtype)`: `dtype` when given, else their promotion), the mean of squares is
taken in float32 (at least), and `y = x * (rsqrt(var + epsilon) * scale)` in float32 is rounded once to D.
xkern computes the same expression with the same single rounding: OLMo-2's variant `(scale * normed).astype(D)`
for a 16-bit D, Llama's `scale * normed` for float32 (the two are one rounding of one product there).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as flax_dtypes

from jax_api.add_rms_norm import add_rms_norm
from jax_api.rms_norm import rms_norm
from xkern.launch import FLOATS


def _axes(axes) -> tuple:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _float_name(dtype) -> str:
    """The dtype jax computes in (float64 is float32 unless x64 is on), as a name."""
    return jax.dtypes.canonicalize_dtype(jnp.dtype(dtype)).name


def unsupported_reason(norm: nnx.RMSNorm) -> str | None:
    """Why xkern does not compute the math of `norm` (a flax.nnx.RMSNorm's configuration); None where it does.
    What only a call can tell (a non-negative axis is the input's last, the input's dtype) RMSNorm checks then."""
    red, feat = _axes(norm.reduction_axes), _axes(norm.feature_axes)
    if len(red) != 1 or (red[0] < 0 and red[0] != -1):
        return f"reduction_axes={norm.reduction_axes!r}: xkern normalizes over one axis, the last"
    if feat != red:
        return (f"feature_axes={norm.feature_axes!r} with reduction_axes={norm.reduction_axes!r}: xkern's scale runs "
                "along the normalized axis")
    if norm.axis_name is not None or norm.axis_index_groups is not None:
        return (f"axis_name={norm.axis_name!r}: statistics pooled across devices (pmean); xkern normalizes each "
                "row where it is (under jit, sharded arrays partition themselves)")
    if norm.dtype is not None and _float_name(norm.dtype) not in FLOATS:
        return f"dtype={jnp.dtype(norm.dtype).name}: xkern computes in float16, bfloat16 or float32"
    if norm.dtype is None and norm.use_scale and _float_name(norm.param_dtype) not in FLOATS:
        return f"param_dtype={jnp.dtype(norm.param_dtype).name} with dtype=None: xkern computes in float16, " \
               "bfloat16 or float32"
    return None


def _variant(dtype) -> str:
    # One rounding of scale * normed either way (float32 only: for a 16-bit D Llama's rounds normed first,
    # flax does not).
    return "llama" if jnp.dtype(dtype) == jnp.float32 else "olmo2"


class RMSNorm(nnx.RMSNorm):
    """flax.nnx.RMSNorm computed by xkern's kernels: a subclass with flax's constructor (the same arguments,
    parameter `scale`, initialisation and random-key use), so `nnx.state` of a flax model loads unchanged and
    `isinstance(m, nnx.RMSNorm)` holds.

    `__call__(x, mask=None, *, residual=None)`: `y` as flax's (module docstring), or with `residual`
    `(y, residual_out)`, residual_out = x + residual (jnp's dtype for the sum, rounded once) and y the norm of it,
    in one fused kernel (`jax_api.add_rms_norm`) where D holds x and residual exactly; otherwise the add is
    jnp's and the norm this module's. Differentiable (jit, grad, vmap, remat) as `jax_api.rms_norm`.

    Differs from flax in the rounding of its intermediates only (docs/ops.md, "Flax NNX"): `scale * (x * rstd)` in
    float32 against flax's `x * (rstd * scale)` (the output one rounding to D in both); the backward is xkern's
    joint kernel (dx rounded once; d(scale) per-row terms rounded to D, summed in FP32 in a fixed order).
    Refused with ValueError: normalizing over several axes or another than the last, feature_axes other than the
    reduced axis, axis_name / axis_index_groups (statistics across devices), a computation dtype D other than
    float16 / bfloat16 / float32 (float64 under x64), and a `mask`. use_fast_variance has no effect here (flax
    uses it only where it subtracts a mean; RMSNorm does not).
    """

    @functools.wraps(nnx.RMSNorm.__init__, assigned=())  # flax's signature for help() and inspect
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reason = unsupported_reason(self)
        if reason is not None:
            raise ValueError(f"xkern RMSNorm: {reason} (flax.nnx.RMSNorm computes it)")

    def _check_call(self, ndim: int, mask) -> None:
        if mask is not None:
            raise ValueError("mask: xkern's RMSNorm normalizes whole rows (a masked mean is flax.nnx.RMSNorm's)")
        (axis,) = _axes(self.reduction_axes)
        if axis >= 0 and axis != ndim - 1:
            raise ValueError(f"reduction_axes={self.reduction_axes!r} on an input of {ndim} dimensions: xkern "
                             "normalizes over the last axis only")

    def __call__(self, x, mask=None, *, residual=None):
        self._check_call(jnp.ndim(x), mask)
        if residual is not None:
            return self._add_norm(x, residual)
        scale = None if self.scale is None else self.scale[...]
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)  # flax's first step, as flax calls it
        if x.dtype.name not in FLOATS or (scale is not None and scale.dtype != x.dtype):
            raise ValueError(f"xkern RMSNorm computes in float16, bfloat16 or float32, got x in {x.dtype.name}"
                             f"{'' if scale is None else f' and scale in {scale.dtype.name}'} after promote_dtype")
        return rms_norm(x, scale, self.epsilon, variant=_variant(x.dtype))

    def _add_norm(self, x, residual):
        x, residual = jnp.asarray(x), jnp.asarray(residual)
        scale = None if self.scale is None else self.scale[...]
        h = jax.eval_shape(jnp.add, x, residual)  # the sum's shape and dtype, as `x + residual`
        d = jax.eval_shape(lambda h, s: self.promote_dtype((h, s), dtype=self.dtype)[0], h, scale).dtype
        # Fused where the kernel's inputs can be x and residual in D without rounding them: D holds both exactly
        # (then it holds their sum's dtype too), and scale in D is what flax's promote_dtype makes of it.
        if (self.promote_dtype is flax_dtypes.promote_dtype and x.shape == residual.shape == h.shape
                and d.name in FLOATS and h.dtype.name in FLOATS
                and jnp.promote_types(x.dtype, d) == d and jnp.promote_types(residual.dtype, d) == d):
            return add_rms_norm(x.astype(d), residual.astype(d), None if scale is None else scale.astype(d),
                                self.epsilon, variant=_variant(d), residual_dtype=h.dtype)
        h = x + residual
        return self(h), h


def replace_rms_norm(model: nnx.Module, *, strict: bool = False) -> int:
    """Turn every `flax.nnx.RMSNorm` in `model` (found with `nnx.iter_graph`, `model` itself included) whose
    math xkern computes into `RMSNorm`, in place: the same object, parameters and sharing, only its class
    changes. Returns how many it turned (0 on a second call). Subclasses of flax's RMSNorm are left as they are
    (their own `__call__`). A norm whose configuration xkern refuses (RMSNorm's docstring) is kept as flax's,
    with a warning naming its path and why; `strict=True` raises ValueError instead, before changing any.
    Checked at call time, as RMSNorm does: a mask, a non-negative reduction axis that is not the last, the
    input's dtype."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
    taken: dict[int, nnx.RMSNorm] = {}
    kept = []
    for path, node in nnx.iter_graph(model):
        if type(node) is not nnx.RMSNorm:
            continue
        reason = unsupported_reason(node)
        if reason is None:
            taken[id(node)] = node
        else:
            kept.append(f"{'.'.join(map(str, path)) or '(model)'}: {reason}")
    if kept:
        message = f"{len(kept)} flax.nnx.RMSNorm kept, their math is not xkern's: " + "; ".join(kept)
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=2)
    for node in taken.values():
        node.__class__ = RMSNorm
    return len(taken)
