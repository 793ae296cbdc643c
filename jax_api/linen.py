"""Flax linen: `RMSNorm`, a drop-in for `flax.linen.RMSNorm` that computes through `jax_api.rms_norm`.

Needs flax (`pip install -e ".[flax]"`); `import jax_api` does not import this module.

    from jax_api.linen import RMSNorm        # in place of flax.linen.RMSNorm
    y = RMSNorm(epsilon=1e-6).apply(params, x)

flax.linen.RMSNorm's math (flax/linen/normalization.py): the mean of squares in float32, then
`y = x * (rsqrt(var + epsilon) * scale)` in float32 (x, and scale in param_dtype, promoted to it), rounded once
to D = `dtype`, or with dtype None the promotion of x's and scale's dtypes. xkern computes the same expression
with the same single rounding in C = the promotion of x, scale and D: the inputs cast to C exactly, then
OLMo-2's variant `(scale * normed).astype(C)` for a 16-bit C, Llama's `scale * normed` for float32 (one rounding
of one product either way), then to D (a rounding only where C is float32 and D 16-bit: flax's one rounding).
So a bfloat16 x with the default float32 param_dtype is normalized in float32 (the cast of x is exact), as flax
does.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from jax_api.nnx import unsupported_reason
from jax_api.rms_norm import rms_norm
from xkern.launch import FLOATS


class RMSNorm(nn.RMSNorm):
    """flax.linen.RMSNorm computed by xkern's kernels: a subclass with flax's fields (epsilon, dtype, param_dtype,
    use_scale, scale_init, reduction_axes, feature_axes, ...), the parameter `scale` [features] made by
    `scale_init` in param_dtype as flax makes it, so a flax checkpoint's params apply unchanged and
    `isinstance(m, flax.linen.RMSNorm)` holds.

    Args (flax's): epsilon; dtype (the output's, default the promotion of x's and scale's); param_dtype;
    use_scale; scale_init. Refused with ValueError when the module is built: reduction_axes other than the last
    axis alone, feature_axes other than the reduced axis, axis_name / axis_index_groups (statistics across
    devices), force_float32_reductions=False (xkern's statistics are float32), a computation dtype other than
    float16 / bfloat16 / float32; at call time a `mask` and a non-negative reduction axis that is not the
    input's last. use_fast_variance has no effect (flax uses it only where it subtracts a mean).

    Example:
        >>> norm = RMSNorm(epsilon=1e-6)
        >>> params = norm.init(jax.random.key(0), x)       # {"params": {"scale": ones [x.shape[-1]]}}
        >>> y = norm.apply(params, x)                       # flax.linen.RMSNorm's y, to its last bit or so

    Differs from flax in the rounding of its intermediates only: `scale * (x * rstd)` in float32 against flax's
    `x * (rstd * scale)`; the backward is xkern's kernel (docs/ops.md, "Flax NNX", says the same for NNX).
    """

    def __post_init__(self):
        super().__post_init__()
        reason = unsupported_reason(self)
        if reason is None and not self.force_float32_reductions:
            reason = "force_float32_reductions=False: xkern's statistics are always float32"
        if reason is not None:
            raise ValueError(f"xkern RMSNorm: {reason} (flax.linen.RMSNorm computes it)")

    @nn.compact
    def __call__(self, x, *, mask=None):
        if mask is not None:
            raise ValueError("mask: xkern's RMSNorm normalizes whole rows (a masked mean is flax.linen.RMSNorm's)")
        x = jnp.asarray(x)
        axis = self.reduction_axes if isinstance(self.reduction_axes, int) else tuple(self.reduction_axes)[0]
        if axis >= 0 and axis != x.ndim - 1:
            raise ValueError(f"reduction_axes={self.reduction_axes!r} on an input of {x.ndim} dimensions: xkern "
                             "normalizes over the last axis only")
        scale = None
        if self.use_scale:  # flax's parameter: name, shape (a list, as flax passes it), dtype and init
            scale = self.param("scale", self.scale_init, [x.shape[-1]], self.param_dtype)
        args = (x,) if scale is None else (x, scale)
        out = jnp.dtype(self.dtype) if self.dtype is not None else jnp.result_type(*args)
        compute = jnp.promote_types(jnp.result_type(*args), out)
        if compute.name not in FLOATS:
            raise ValueError(f"xkern RMSNorm computes in float16, bfloat16 or float32, got {compute.name} from x "
                             f"in {x.dtype.name}{'' if scale is None else f', scale in {scale.dtype.name}'} and "
                             f"dtype={self.dtype}")
        variant = "llama" if compute == jnp.float32 else "olmo2"
        y = rms_norm(x.astype(compute), None if scale is None else scale.astype(compute), self.epsilon,
                     variant=variant)
        return y.astype(out)
