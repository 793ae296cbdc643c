"""JAX front end of xkern: custom_vjp functions over the same Triton kernels and launch plans."""

from jax_api.rms_norm import rms_norm

__all__ = ["rms_norm"]
