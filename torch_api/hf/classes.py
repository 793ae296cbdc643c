"""Class patching: the classes' `forward` and `extra_repr` replaced before a model is built, so that every
model built afterwards (`from_pretrained`, `from_config`, direct construction) runs its norms through xkern;
`unpatch_hf_classes()` restores them."""

from __future__ import annotations

import torch

from torch_api.hf.fuse import DECODER_LAYER_NAME, fused_layer_forward
from torch_api.hf.gated import patch_gated_classes
from torch_api.hf.norm_forward import xkern_norm_forward
from torch_api.hf.originals import SAVED, original_forward
from torch_api.hf.probe import PROBED, hf_norm_classes, modeling_classes, norm_math


def class_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The `forward` of a patched norm class."""
    math = PROBED.get(type(self))  # a subclass that was not probed runs its class's original forward
    out = None if math is None else xkern_norm_forward(self, hidden_states, math)
    return original_forward(type(self))(self, hidden_states) if out is None else out


def _class_extra_repr(self) -> str:
    cls = next(c for c in type(self).__mro__ if c in SAVED)
    saved = SAVED[cls]["extra_repr"]
    base = saved(self) if saved is not None else super(cls, self).extra_repr()
    math = PROBED.get(type(self))
    return ", ".join(s for s in (base, None if math is None else f"xkern={math.variant}") if s)


def patch_hf_classes(*model_types: str, fuse_residual: bool = False, experts: bool = False) -> list[type]:
    """Patch the classes of `hf_norm_classes(*model_types)` whose math xkern computes, so that every model
    built afterwards (`from_pretrained`, `from_config`, direct construction) runs its norms through xkern.
    Idempotent; returns the classes this call patched. `unpatch_hf_classes()` undoes it. Opt-in:
    `fuse_residual` also patches the decoder layer classes of those models that are the Llama layer
    (`fused_layer_forward`: the add before `post_attention_layernorm` fused into it); `experts=True` also
    registers "xkern" as a transformers experts implementation, which a model then takes with
    `from_pretrained(..., experts_implementation="xkern")` (or `use_xkern_experts(model)` after building)."""
    if experts:
        from torch_api.hf_moe import register_xkern_experts

        register_xkern_experts()
    patched = []
    if fuse_residual:
        for cls in modeling_classes(model_types, DECODER_LAYER_NAME):
            fn = fused_layer_forward(cls)
            if fn is not None and cls not in SAVED:
                SAVED[cls] = {"forward": cls.__dict__.get("forward")}
                cls.forward = fn
                patched.append(cls)
    classes = hf_norm_classes(*model_types)
    maths = {cls: norm_math(cls) for cls in classes}  # probe all before patching any (subclasses inherit)
    for cls, math in maths.items():
        if math is None or cls in SAVED:
            continue
        SAVED[cls] = {"forward": cls.__dict__.get("forward"), "extra_repr": cls.__dict__.get("extra_repr")}
        cls.forward = class_forward
        cls.extra_repr = _class_extra_repr
        patched.append(cls)
    return patched + patch_gated_classes(classes)  # the gated norms (forward(hidden_states, gate))


def unpatch_hf_classes() -> list[type]:
    """Restore every class `patch_hf_classes` patched; returns them."""
    restored = list(SAVED)
    for cls, saved in SAVED.items():
        for name, value in saved.items():
            delattr(cls, name)
            if value is not None:
                setattr(cls, name, value)
    SAVED.clear()
    return restored
