"""Instance patching: an instance-level `forward` (and `extra_repr`) on each norm module of a model already
built. Nothing is added to the state dict; pickling stores the module unpatched; `copy.deepcopy` keeps the
patch, bound to the copy."""

from __future__ import annotations

import copy

import torch

from torch_api.hf.classes import class_forward
from torch_api.hf.fuse import fuse_residual_norms
from torch_api.hf.gated import replace_gated_norms
from torch_api.hf.norm_forward import xkern_norm_forward
from torch_api.hf.originals import is_unset, original_forward
from torch_api.hf.probe import NormMath, norm_math


class _Forward:
    """The patched forward of one module; eps and weight read per call."""

    def __init__(self, module: torch.nn.Module, math: NormMath):
        self.module, self.math = module, math

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = xkern_norm_forward(self.module, hidden_states, self.math)
        return original_forward(type(self.module))(self.module, hidden_states) if out is None else out

    def __reduce__(self):
        # Pickle as `getattr(module, "forward")`: evaluated on load before the module's state is restored,
        # it yields the class's own forward, so the loaded model is eager (and loads without xkern).
        return getattr, (self.module, "forward")

    def __deepcopy__(self, memo):
        return _Forward(copy.deepcopy(self.module, memo), self.math)


class _ExtraRepr:
    """The patched `extra_repr` of one module: the class's, then `xkern=<variant>`."""

    def __init__(self, module: torch.nn.Module, math: NormMath):
        self.module, self.math = module, math

    def __call__(self) -> str:
        base = type(self.module).extra_repr(self.module)
        return f"{base}, xkern={self.math.variant}" if base else f"xkern={self.math.variant}"

    def __reduce__(self):
        return getattr, (self.module, "extra_repr")

    def __deepcopy__(self, memo):
        return _ExtraRepr(copy.deepcopy(self.module, memo), self.math)


def _is_unpatched(m: torch.nn.Module) -> bool:
    return getattr(type(m), "forward", None) is not class_forward and is_unset(m, "forward")


def replace_rms_norm(model: torch.nn.Module, *, fuse_residual: bool = False, experts: bool = False) -> int:
    """Route the forward of every module of `model` whose class computes one of the math xkern computes
    (`norm_math`) through `torch_api.rms_norm`; returns how many modules were patched (0 on a second call,
    and for modules whose class `patch_hf_classes` patched). Opt-in: `fuse_residual` also
    `fuse_residual_norms(model)` (its layers are not counted); `experts=True` also routes the model's MoE
    experts modules through xkern's dispatch and weighted combine (`torch_api.hf_moe.use_xkern_experts`)."""
    if fuse_residual:
        fuse_residual_norms(model)
    if experts:
        from torch_api.hf_moe import use_xkern_experts

        use_xkern_experts(model)
    n = 0
    for m in model.modules():
        math = norm_math(type(m))
        if math is not None and _is_unpatched(m):
            m.forward = _Forward(m, math)
            if is_unset(m, "extra_repr"):
                m.extra_repr = _ExtraRepr(m, math)
            n += 1
    return n + replace_gated_norms(model)  # the gated norms (forward(hidden_states, gate))
