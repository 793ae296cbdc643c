"""A norm module's output through xkern: the forward that instance, class and `kernels` patching share."""

from __future__ import annotations

import torch

from torch_api._launch import INTERPRET
from torch_api.hf.probe import NONE_EPS, NormMath, norm_math
from torch_api.rms_norm import rms_norm

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def kernels_take(hidden_states: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the kernels take these: float16, bfloat16 or float32, on CUDA (or the CPU under
    TRITON_INTERPRET=1: class patching reaches every model, a CPU one without Triton's interpreter too)."""
    return (hidden_states.dtype in FLOATS and (weight is None or weight.dtype in FLOATS)
            and (hidden_states.is_cuda or INTERPRET and hidden_states.device.type == "cpu"))


@torch.compiler.assume_constant_result  # a constant of the graph (Dynamo cannot guard on the math's dtype set)
def _dtypes_taken(cls: type, x_dtype: torch.dtype, w_dtype: torch.dtype | None) -> bool:
    """Whether `cls`'s math holds for these dtypes (`NormMath.dtypes`)."""
    math = norm_math(cls)
    return math is None or math.takes(x_dtype, w_dtype)


def xkern_norm_forward(module: torch.nn.Module, hidden_states: torch.Tensor, math: NormMath) -> torch.Tensor | None:
    """`module`'s output through xkern, or None for what the kernels do not take (`kernels_take`), an instance
    that normalizes more than the last dim (torch.nn.RMSNorm([2, 8])), an eps the probe did not read, or dtypes
    where the class's math is another (`NormMath.dtypes`): the caller runs the class's forward."""
    if math.variant != "none" and not hasattr(module, "weight"):
        return None  # an instance built without its weight attribute (MuseSpark's `with_scale=False`)
    weight = None if math.variant == "none" else module.weight  # None: torch.nn.RMSNorm without affine
    if not kernels_take(hidden_states, weight):
        return None
    if not _dtypes_taken(type(module), hidden_states.dtype, None if weight is None else weight.dtype):
        return None
    width = hidden_states.shape[-1] if hidden_states.dim() else None
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and tuple(shape) != (width,) or weight is not None and tuple(weight.shape) != (width,):
        return None
    eps = getattr(module, math.eps_attr)
    if eps is None:
        if not math.eps_none:
            return None
        eps = NONE_EPS
    if math.variant in ("llama", "none"):
        return rms_norm(hidden_states, weight, eps)
    return rms_norm(hidden_states, weight, eps, variant=math.variant)
