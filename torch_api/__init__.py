"""PyTorch front end of xkern: autograd-aware ops registered with torch.library."""

import torch

from torch_api.add_rms_norm import add_rms_norm
from torch_api.compile_fusion import enable_compile_fusion
from torch_api.ep import EPHandle, ep_combine, ep_dispatch
from torch_api.gated_rms_norm import GatedRMSNorm, gated_rms_norm
from torch_api.grouped_mm import grouped_mm
from torch_api.hf import fuse_residual_norms, patch_hf_classes, replace_rms_norm, unpatch_hf_classes
from torch_api.hf_moe import register_xkern_experts, use_xkern_experts
from torch_api.permute import (
    generate_permute_indices,
    inverse_permutation,
    permute_rows,
    topk_permute_indices,
    unpermute_rows,
)
from torch_api.rms_norm import RMSNorm, rms_norm

if torch.distributed.is_available():
    import torch_api.sharding  # noqa: F401  (DTensor sharding strategies of the xkern ops)

__all__ = [
    "EPHandle",
    "GatedRMSNorm",
    "RMSNorm",
    "add_rms_norm",
    "enable_compile_fusion",
    "ep_combine",
    "ep_dispatch",
    "fuse_residual_norms",
    "gated_rms_norm",
    "generate_permute_indices",
    "grouped_mm",
    "inverse_permutation",
    "patch_hf_classes",
    "permute_rows",
    "register_xkern_experts",
    "replace_rms_norm",
    "rms_norm",
    "topk_permute_indices",
    "unpatch_hf_classes",
    "unpermute_rows",
    "use_xkern_experts",
]
