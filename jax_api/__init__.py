"""JAX front end of xkern: custom_jvp functions over the same Triton kernels and launch plans, whose tangents the
backward kernels transpose (jax_api/_linear.py): every JAX transformation (docs/transformations.md)."""

from jax_api._ptxas import use_triton_ptxas
from jax_api.add_rms_norm import add_rms_norm
from jax_api.ep import ep_combine, ep_dispatch
from jax_api.gated_rms_norm import gated_rms_norm
from jax_api.grouped_mm import grouped_mm
from jax_api.permute import (
    generate_permute_indices,
    inverse_permutation,
    permute_rows,
    topk_permute_indices,
    unpermute_rows,
)
from jax_api.rms_norm import rms_norm, rms_norm_tp

__all__ = [
    "add_rms_norm",
    "ep_combine",
    "ep_dispatch",
    "gated_rms_norm",
    "generate_permute_indices",
    "grouped_mm",
    "inverse_permutation",
    "permute_rows",
    "rms_norm",
    "rms_norm_tp",
    "topk_permute_indices",
    "unpermute_rows",
    "use_triton_ptxas",
]
