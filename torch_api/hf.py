"""Opt-in patching of Hugging Face RMSNorm modules whose math is the Llama expression.

`replace_rms_norm(model)` sets an instance-level `forward` on each exact instance of the listed classes
(subclasses, other math such as Gemma's `1 + w`, OLMo-2/3 or GPT-OSS, and modules whose forward is already
set on the instance are left alone). Nothing is added to the state dict. Pickling (`torch.save(model)`)
stores the module unpatched, so a loaded model is eager until patched again; `copy.deepcopy` keeps the
patch, bound to the copy (its own weight and eps).
"""

from __future__ import annotations

import copy
import importlib

import torch

from torch_api.rms_norm import rms_norm

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# (transformers.models.<module>, class): the RMSNorms computing `w * (x.f32 * rsqrt(mean(x.f32**2) + eps))
# .to(x.dtype)` with `weight` and `variance_epsilon` attributes.
_LLAMA_MATH = (
    ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
    ("qwen2", "Qwen2RMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3", "Qwen3RMSNorm"),
    ("qwen3_moe", "Qwen3MoeRMSNorm"), ("phi3", "Phi3RMSNorm"), ("deepseek_v2", "DeepseekV2RMSNorm"),
    ("deepseek_v3", "DeepseekV3RMSNorm"),
)


def _classes() -> tuple[type, ...]:
    """The listed classes that the installed transformers has (imported lazily; none without it)."""
    found = []
    for mod, name in _LLAMA_MATH:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), name)
        except (ImportError, AttributeError):
            continue
        found.append(cls)
    return tuple(found)


class _Forward:
    """The patched forward of one module: `rms_norm(x, weight, variance_epsilon)`, eps read per call."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        m = self.module
        if hidden_states.dtype not in _FLOATS or m.weight.dtype not in _FLOATS:
            return type(m).forward(m, hidden_states)  # dtype pair the kernel does not take: eager
        return rms_norm(hidden_states, m.weight, m.variance_epsilon)

    def __reduce__(self):
        # Pickle as `getattr(module, "forward")`: evaluated on load before the module's state is restored,
        # it yields the class's own forward, so the loaded model is eager (and loads without xkern).
        return getattr, (self.module, "forward")

    def __deepcopy__(self, memo):
        return _Forward(copy.deepcopy(self.module, memo))


def _is_unpatched(m: torch.nn.Module) -> bool:
    f = m.__dict__.get("forward")
    if f is None:
        return True
    # What a pickled patch loads as: the class's forward bound to the module itself.
    return getattr(f, "__func__", None) is type(m).forward and getattr(f, "__self__", None) is m


def replace_rms_norm(model: torch.nn.Module) -> int:
    """Route the forward of every exact instance of a Llama-math Hugging Face RMSNorm in `model` through
    `torch_api.rms_norm`; returns how many modules were patched (0 on a second call)."""
    classes = _classes()
    n = 0
    for m in model.modules():
        if type(m) in classes and _is_unpatched(m):
            m.forward = _Forward(m)
            n += 1
    return n
