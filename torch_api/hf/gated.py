"""Hugging Face's gated RMSNorms (`forward(hidden_states, gate)`: Qwen3-Next, Kimi Linear, Mamba2, Nemotron-H,
Falcon-H1, ...) through `torch_api.gated_rms_norm`, chosen by their math as the one-input norms are.

A class named like NORM_NAME whose forward takes (hidden_states, gate) is built with the probe width (and, if
its constructor wants a second argument, the group size), given groups through its `group_size` or `n_groups`
attribute where it has one, and run in bf16, fp16, fp32, and bf16 with an fp32 weight on a random input and
gate; it is taken when it gives bit for bit one of the forms of `reference_math` (norm before or after the
gate, silu or sigmoid, Llama's or fp32 rounding), with eps read from one of EPS_ATTRS. A class with a bool
`norm_before_gate` attribute (Falcon-H1) is probed with it either way and then read per call. A call with
gate None, or what the kernels do not take, runs the class's own forward.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools

import torch

from torch_api.gated_rms_norm import gated_rms_norm, reference_math
from torch_api.hf.norm_forward import kernels_take
from torch_api.hf.originals import SAVED, is_unset, original_forward
from torch_api.hf.probe import _PROBE_WIDTH as _WIDTH
from torch_api.hf.probe import EPS_ATTRS, NORM_NAME, _construct, _same_bits
from xkern.gated_rms_norm import ACTIVATIONS, ROUNDINGS


@dataclasses.dataclass(frozen=True)
class GatedNormMath:
    """What a gated class computes: `norm_before_gate` (None: the instance's attribute of that name),
    `activation`, `rounding`, eps from `eps_attr`, groups from `group_attr` ("group_size": columns,
    "n_groups": how many; None: the whole row)."""

    norm_before_gate: bool | None
    activation: str
    rounding: str
    eps_attr: str
    group_attr: str | None
    activation_attr: str | None = None  # the class's `activation` attribute when probed: a call with another
                                        # value runs the class's own forward

    @property
    def variant(self) -> str:  # how `extra_repr` and the HF test's counts name it
        order = "attr" if self.norm_before_gate is None else ("norm-gate" if self.norm_before_gate else "gate-norm")
        return f"gated:{order}:{self.activation}:{self.rounding}"


_GROUPS = 4
_EPS = 2.0 ** -8
_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
           (torch.bfloat16, torch.float32))
_FORMS = list(itertools.product((True, False), ACTIVATIONS, ROUNDINGS))


def _takes_gate(forward) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 2 and all(p.kind in positional for p in params)


def _group_attr(module) -> str | None:
    for attr in ("group_size", "n_groups"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return attr
    return None


def group_size(module, math: GatedNormMath, width: int) -> int:
    if math.group_attr == "group_size":
        return module.group_size
    return width // module.n_groups if math.group_attr == "n_groups" else width


def _matching(module, forward, eps_attr, eps_attrs, group_attr, order) -> set:
    """The forms (of _FORMS, with the order `order` where not None) that `forward` gives bit for bit."""
    gen = torch.Generator().manual_seed(29)
    x64 = torch.randn(3, _WIDTH, generator=gen, dtype=torch.float64)
    z64 = 2.0 * torch.randn(3, _WIDTH, generator=gen, dtype=torch.float64)
    w64 = 1.0 + 0.5 * torch.randn(_WIDTH, generator=gen, dtype=torch.float64)
    if group_attr is not None:
        setattr(module, group_attr, _WIDTH // _GROUPS if group_attr == "group_size" else _GROUPS)
    size = _WIDTH // _GROUPS if group_attr is not None else None
    matching = {f for f in _FORMS if order is None or f[0] == order}
    for x_dtype, w_dtype in _DTYPES:
        x, z, w = x64.to(x_dtype), z64.to(x_dtype), w64.to(w_dtype)
        for a in eps_attrs:  # the other attribute gets another value: the one read must be this one
            setattr(module, a, _EPS if a == eps_attr else 0.5)
        module.weight = torch.nn.Parameter(w, requires_grad=False)
        try:
            with torch.no_grad():
                out = forward(module, x, z)
        except Exception:
            return set()
        matching = {f for f in matching if _same_bits(out, reference_math(x, z, w, _EPS, size, *f))}
        if not matching:
            break
    return matching


def _probe(cls: type) -> GatedNormMath | None:
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return None
    forward = original_forward(cls)
    if not _takes_gate(forward):
        return None
    module = _construct(cls, (_WIDTH, _WIDTH // _GROUPS))  # Mamba2's takes the group size second
    if module is None or list(module.buffers()) or list(module.children()):
        return None
    params = dict(module.named_parameters())
    if params.keys() != {"weight"} or tuple(params["weight"].shape) != (_WIDTH,):
        return None
    eps_attrs = [a for a in EPS_ATTRS if isinstance(getattr(module, a, None), float)]
    group_attr = _group_attr(module)
    activation = getattr(module, "activation", None)
    activation = activation if isinstance(activation, str) else None
    order_attr = isinstance(getattr(module, "norm_before_gate", None), bool)
    for eps_attr in eps_attrs:
        if order_attr:  # probed either way; the order is then read per call
            found = []
            for order in (True, False):
                module.norm_before_gate = order
                found.append({f[1:] for f in _matching(module, forward, eps_attr, eps_attrs, group_attr, order)})
            both = found[0] & found[1]
            if len(both) == 1:
                return GatedNormMath(None, *both.pop(), eps_attr, group_attr, activation)
            continue
        matching = _matching(module, forward, eps_attr, eps_attrs, group_attr, None)
        if len(matching) == 1:
            return GatedNormMath(*matching.pop(), eps_attr, group_attr, activation)
    return None


PROBED: dict[type, GatedNormMath | None] = {}


@torch.compiler.assume_constant_result
def gated_norm_math(cls: type) -> GatedNormMath | None:
    """The math of gated norm class `cls` (probed once, cached), or None when xkern does not compute it."""
    if cls not in PROBED:
        PROBED[cls] = _probe(cls) if NORM_NAME.search(cls.__name__) else None
    return PROBED[cls]


def gated_norm_forward(module, hidden_states, gate, math: GatedNormMath) -> torch.Tensor | None:
    """`module`'s output through xkern, or None (gate None, or inputs the kernels do not take)."""
    weight = module.weight
    if math.activation_attr is not None and getattr(module, "activation", None) != math.activation_attr:
        return None
    if gate is not None and gate.dtype != hidden_states.dtype and hidden_states.dtype == torch.float32:
        gate = gate.float()  # exact, and what `act(gate.float())` reads (Mamba2's fp32 scan output, bf16 gate)
    if gate is None or gate.dtype != hidden_states.dtype or gate.shape != hidden_states.shape or \
            not kernels_take(hidden_states, weight) or hidden_states.dim() == 0:
        return None
    width = hidden_states.shape[-1]
    size = group_size(module, math, width)
    if not size or width % size:
        return None
    order = module.norm_before_gate if math.norm_before_gate is None else math.norm_before_gate
    return gated_rms_norm(hidden_states, gate, weight, getattr(module, math.eps_attr), group_size=size,
                          norm_before_gate=bool(order), activation=math.activation, rounding=math.rounding)


# ---------------------------------------------------------------------------------------------------
# Class and instance patching (called by patch_hf_classes and replace_rms_norm), and the `kernels` layer.


class XkernRMSNormGated(torch.nn.Module):
    """The `kernels` layer for the hub name "RMSNormGated" (Qwen3-Next's and Kimi Linear's classes carry it):
    stateless, bound by `kernelize` to the module it replaces, whose class's math (`gated_norm_math`) picks
    the form; a class whose math xkern does not compute keeps its own forward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        math = gated_norm_math(type(self))
        out = None if math is None else gated_norm_forward(self, hidden_states, gate, math)
        return original_forward(type(self))(self, hidden_states, gate) if out is None else out


def gated_class_forward(self, hidden_states, gate=None):
    math = PROBED.get(type(self))
    out = None if math is None else gated_norm_forward(self, hidden_states, gate, math)
    return original_forward(type(self))(self, hidden_states, gate) if out is None else out


def patch_gated_classes(classes) -> list[type]:
    """Patch the gated classes among `classes` whose math xkern computes (SAVED keeps their forward)."""
    maths = {cls: gated_norm_math(cls) for cls in classes}
    patched = []
    for cls, math in maths.items():
        if math is None or cls in SAVED:
            continue
        SAVED[cls] = {"forward": cls.__dict__.get("forward")}
        cls.forward = gated_class_forward
        patched.append(cls)
    return patched


class _GatedForward:
    """The patched forward of one gated module (instance patching); pickles and deep-copies as `_Forward`."""

    def __init__(self, module, math: GatedNormMath):
        self.module, self.math = module, math

    def __call__(self, hidden_states, gate=None):
        out = gated_norm_forward(self.module, hidden_states, gate, self.math)
        return original_forward(type(self.module))(self.module, hidden_states, gate) if out is None else out

    def __reduce__(self):
        return getattr, (self.module, "forward")

    def __deepcopy__(self, memo):
        return _GatedForward(copy.deepcopy(self.module, memo), self.math)


def replace_gated_norms(model: torch.nn.Module) -> int:
    """Instance-patch every gated norm module of `model` whose class xkern computes; returns how many."""
    n = 0
    for m in model.modules():
        math = gated_norm_math(type(m))
        if math is not None and getattr(type(m), "forward", None) is not gated_class_forward and is_unset(m, "forward"):
            m.forward = _GatedForward(m, math)
            n += 1
    return n
