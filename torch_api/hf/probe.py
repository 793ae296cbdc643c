"""Which norm classes xkern takes: decided by probing each class's forward, not by its name.

A class named like NORM_NAME is built with the probe width as its one argument and run on a small random
input in bf16, fp16, fp32, and bf16 with an fp32 weight; it is taken when it gives bit for bit one of the
expressions of VARIANTS (`expected_output`) with eps read from one of EPS_ATTRS. The answer is cached per
class (`norm_math`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re

import torch

from torch_api.hf.originals import original_forward
from torch_api.rms_norm import reference_math

NORM_NAME = re.compile(r"(?i)(rms_?norm|l2_?norm)")  # class names that are probed
VARIANTS = ("llama", "gemma", "olmo2", "none")       # the math xkern computes (see torch_api.hf's docstring)
EPS_ATTRS = ("variance_epsilon", "eps")
NONE_EPS = float(torch.finfo(torch.float32).eps)  # eps None: torch.nn.RMSNorm's, for every input dtype


@dataclasses.dataclass(frozen=True)
class NormMath:
    """What a class computes: one of VARIANTS, with eps read from the attribute `eps_attr`; `eps_none`: where
    that attribute is None, eps is FP32's machine epsilon (torch.nn.RMSNorm's default: the epsilon of the dtype
    it computes in, fp32 for every input dtype)."""

    variant: str
    eps_attr: str
    eps_none: bool = False


_PROBE_WIDTH = 64
_PROBE_EPS = 2.0 ** -8  # large enough to move every output (x is scaled to a mean square of ~4e-3)
_PROBE_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
                 (torch.bfloat16, torch.float32))


# The eager expression of each variant: what a class must give bit for bit.
expected_output = reference_math


def _construct(cls: type, args: tuple = (_PROBE_WIDTH,)) -> torch.nn.Module | None:
    """An instance built with the width as its one required argument (`hidden_size`, `dim`, ...), or none.
    `args`: the required arguments it may take, in order (the gated norms': the width, then a group size)."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind in positional]
    if len(required) > len(args) or any(p.default is p.empty and p.kind == p.KEYWORD_ONLY for p in params):
        return None
    try:
        with torch.device("cpu"):
            return cls(*args[:len(required)])
    except Exception:  # constructors that want a config, say: not a plain norm
        return None


def _takes_hidden_states_only(forward) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _probe(cls: type) -> NormMath | None:
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return None
    forward = original_forward(cls)  # a class patched here is probed as it was
    if not _takes_hidden_states_only(forward):
        return None
    module = _construct(cls)
    if module is None or list(module.buffers()) or list(module.children()):
        return None
    params = dict(module.named_parameters())
    has_weight = params.keys() == {"weight"} and tuple(params["weight"].shape) == (_PROBE_WIDTH,)
    if params and not has_weight:
        return None
    eps_attrs = [a for a in EPS_ATTRS if hasattr(module, a) and (getattr(module, a) is None or
                                                                 isinstance(getattr(module, a), float))]
    gen = torch.Generator().manual_seed(19)
    x64 = torch.randn(3, _PROBE_WIDTH, generator=gen, dtype=torch.float64) * 0.0625
    w64 = 1.0 + 0.5 * torch.randn(_PROBE_WIDTH, generator=gen, dtype=torch.float64)
    candidates = ("llama", "gemma", "olmo2") if has_weight else ("none",)
    for eps_attr in eps_attrs:
        matching = set(candidates)
        for x_dtype, w_dtype in _PROBE_DTYPES:
            x, w = x64.to(x_dtype), w64.to(w_dtype)
            for a in eps_attrs:  # the other attribute gets another value: the one read must be this one
                setattr(module, a, _PROBE_EPS if a == eps_attr else 0.5)
            out = _output(module, forward, x, w if has_weight else None)
            if out is None:
                return None
            matching = {v for v in matching if _same_bits(out, expected_output(x, w, _PROBE_EPS, v))}
            if not matching:
                break
        if len(matching) == 1:
            variant = matching.pop()
            return NormMath(variant, eps_attr, _eps_none(module, forward, eps_attr, variant, x64, w64, has_weight))
    return None


def _eps_none(module, forward, eps_attr, variant, x64, w64, has_weight) -> bool:
    """Whether `module` with eps None computes `variant` with FP32's machine epsilon (NONE_EPS)."""
    setattr(module, eps_attr, None)
    for x_dtype, w_dtype in _PROBE_DTYPES:
        x, w = x64.to(x_dtype) * 0.01, w64.to(w_dtype)  # small rows: the epsilon moves every output
        if not _same_bits(_output(module, forward, x, w if has_weight else None),
                          expected_output(x, w, NONE_EPS, variant)):
            return False
    return True


def _output(module, forward, x, w):
    """The class's forward on x, with the weight w (None: none), or None where it raises."""
    if w is not None:
        module.weight = torch.nn.Parameter(w, requires_grad=False)
    try:
        with torch.no_grad():
            return forward(module, x)
    except Exception:
        return None


def _same_bits(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)))


PROBED: dict[type, NormMath | None] = {}  # class -> its math (None: left alone), once `norm_math` asked


@torch.compiler.assume_constant_result
def norm_math(cls: type) -> NormMath | None:
    """The math of norm class `cls` (probed once, cached), or None when xkern does not compute it.
    Under torch.compile the answer is a constant of the graph (the probe runs eagerly, once)."""
    if cls not in PROBED:
        PROBED[cls] = _probe(cls) if NORM_NAME.search(cls.__name__) else None
    return PROBED[cls]


def hf_norm_classes(*model_types: str) -> list[type]:
    """The norm classes (named like NORM_NAME) defined in `transformers.models.<name>.modeling_*` for each
    name of `model_types` (the package names: "llama", "qwen3", "gemma3", "llama4", ...), or for every
    installed model when none is given (that imports every modeling module: ~20 s on a CPU)."""
    return modeling_classes(model_types, NORM_NAME)


def modeling_classes(model_types, name_pattern) -> list[type]:
    """The nn.Module classes named like `name_pattern` defined in the modeling modules of `model_types`."""
    import transformers.models as models

    names = model_types or [m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg]
    found = {}
    for name in names:
        try:
            package = importlib.import_module(f"transformers.models.{name}")
        except ImportError:
            if model_types:
                raise ValueError(f"model_types: no transformers model type {name!r}") from None
            continue
        for sub in pkgutil.iter_modules(package.__path__):
            if not sub.name.startswith("modeling_") or sub.name.endswith(("_tf", "_flax")):
                continue
            try:
                module = importlib.import_module(f"{package.__name__}.{sub.name}")
            except Exception:  # a model needing an optional dependency that is not installed
                continue
            for obj in vars(module).values():
                if (isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
                        and name_pattern.search(obj.__name__)):
                    found[obj] = None
    return list(found)
