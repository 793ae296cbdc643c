"""The `kernels` package (Hugging Face's kernel hub): xkern as the layer for the hub names "RMSNorm" and
"RMSNormGated", from a local layer repository (`torch_api/kernels_layer/`: no download)."""

from __future__ import annotations

from pathlib import Path

import torch

from torch_api.hf.norm_forward import xkern_norm_forward
from torch_api.hf.originals import original_forward
from torch_api.hf.probe import norm_math


class XkernRMSNorm(torch.nn.Module):
    """The `kernels` layer for the hub name "RMSNorm". Stateless, as `kernels` requires: `kernelize` binds
    this forward to the module it replaces, whose class's math (`norm_math`) picks the variant; a class
    whose math xkern does not compute (a different rounding, extra inputs) keeps its own forward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        math = norm_math(type(self))
        out = None if math is None else xkern_norm_forward(self, hidden_states, math)
        return original_forward(type(self))(self, hidden_states) if out is None else out


# metadata.json + __init__.py exporting `layers`
LAYER_REPOSITORY = Path(__file__).parents[1] / "kernels_layer"


def kernels_layer_repository(layer_name: str = "RMSNorm"):
    """`kernels.LocalLayerRepository` of `XkernRMSNorm` (or of `layer_name`: "RMSNormGated", the gated norms'
    layer; no download: the repository ships with torch_api)."""
    from kernels import LocalLayerRepository

    return LocalLayerRepository(repo_path=LAYER_REPOSITORY, layer_name=layer_name)


def kernel_mapping(devices=("cuda", "cpu")) -> dict:
    """A mapping for `kernels.register_kernel_mapping` / `use_kernel_mapping`: "RMSNorm" and "RMSNormGated" ->
    xkern on `devices`, every mode (torch.compile and training included). CPU runs under TRITON_INTERPRET=1
    only."""
    return {name: {device: kernels_layer_repository(name) for device in devices}
            for name in ("RMSNorm", "RMSNormGated")}


def kernel_config():
    """`transformers.KernelConfig` for `from_pretrained(..., use_kernels=True, kernel_config=kernel_config())`
    on CUDA: only xkern's mapping is used (transformers' default maps "RMSNorm" to Liger's kernel)."""
    from transformers import KernelConfig

    return KernelConfig({name: f"{LAYER_REPOSITORY}:{name}" for name in ("RMSNorm", "RMSNormGated")},
                        use_local_kernel=True)
