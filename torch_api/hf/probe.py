"""Which norm classes xkern takes: decided by probing each class's forward, not by its name.

A class named like NORM_NAME is built with the probe width (`_construct`) and run on a small random input in
bf16, fp16, fp32, and bf16 with an fp32 weight; it is taken when it gives bit for bit one of the expressions
of VARIANTS (`expected_output`) with eps read from one of EPS_ATTRS: in all four, or (a class that rounds
somewhere else in some dtypes: Idefics rounds to the weight's dtype, MuseSpark's centered norm adds 1 to the
weight in its own dtype) in some of them, one at least with a half-precision input, for those dtype pairs
only. Buffers are filled with random values first: a class is taken only where its output does not read
them (FalconMamba's weightless norm keeps an unused dummy weight). The answer is cached per class
(`norm_math`).
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
    it computes in, fp32 for every input dtype). `dtypes`: the (input dtype, weight dtype) pairs where it
    does (weight dtype None without a weight); None: every pair."""

    variant: str
    eps_attr: str
    eps_none: bool = False
    dtypes: frozenset | None = None

    def takes(self, x_dtype: torch.dtype, w_dtype: torch.dtype | None) -> bool:
        return self.dtypes is None or (x_dtype, w_dtype) in self.dtypes


_PROBE_WIDTH = 64
_PROBE_EPS = 2.0 ** -8  # large enough to move every output (x is scaled to a mean square of ~4e-3)
_PROBE_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
                 (torch.bfloat16, torch.float32))


# The eager expression of each variant: what a class must give bit for bit.
expected_output = reference_math


_EPS_PARAMS = ("eps", "epsilon", "variance_epsilon")


def _construct(cls: type, args: tuple = (_PROBE_WIDTH,)) -> torch.nn.Module | None:
    """An instance built with the width as its one required argument (`hidden_size`, `dim`, ...), or none.
    `args`: the required arguments it may take, in order (the gated norms': the width, then a group size).
    A required eps (`ErgoRMSNorm(hidden_size, eps)`) gets 1e-6; a first argument that defaults to None
    (`MuseSparkRMSNorm(hidden_size=None)`) gets the width."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.default is p.empty and p.kind == p.KEYWORD_ONLY for p in params):
        return None
    required = [p for p in params if p.default is p.empty and p.kind in positional]
    given, rest = [], list(args)
    for p in required:
        if p.name in _EPS_PARAMS:
            given.append(1e-6)
        elif rest:
            given.append(rest.pop(0))
        else:
            return None
    if not required and params and params[0].kind in positional and params[0].default is None:
        given = list(args[:1])
    try:
        with torch.device("cpu"):
            return cls(*given)
    except Exception:  # constructors that want a config, say: not a plain norm
        return None


def _randomize_buffers(module: torch.nn.Module) -> bool:
    """Fill every buffer with random values (False where one is not floating point): a class whose output
    still matches does not read them."""
    gen = torch.Generator().manual_seed(23)
    for b in module.buffers():
        if not b.is_floating_point():
            return False
        b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float64).to(b.dtype))
    return True


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
    if module is None or list(module.children()) or not _randomize_buffers(module):
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
        pairs = {v: set() for v in candidates}  # variant -> the probe's dtype pairs where the class gives it
        for x_dtype, w_dtype in _PROBE_DTYPES:
            x, w = x64.to(x_dtype), w64.to(w_dtype)
            for a in eps_attrs:  # the other attribute gets another value: the one read must be this one
                setattr(module, a, _PROBE_EPS if a == eps_attr else 0.5)
            out = _output(module, forward, x, w if has_weight else None)
            if out is None:
                return None
            for v in candidates:
                if _same_bits(out, expected_output(x, w, _PROBE_EPS, v)):
                    pairs[v].add((x_dtype, w_dtype if has_weight else None))
        probed = {(xd, wd if has_weight else None) for xd, wd in _PROBE_DTYPES}
        everywhere = [v for v in candidates if pairs[v] == probed]
        if len(everywhere) == 1:
            variant, dtypes = everywhere[0], None
        else:  # in some dtypes only: the one variant that matches most, where a rounding tells them apart
            most = max(len(p) for p in pairs.values())
            best = [v for v in candidates if len(pairs[v]) == most]
            if len(best) != 1 or not any(xd != torch.float32 for xd, _ in pairs[best[0]]):
                continue
            variant, dtypes = best[0], frozenset(pairs[best[0]])
        eps_none = _eps_none(module, forward, eps_attr, variant, x64, w64, has_weight, dtypes)
        return NormMath(variant, eps_attr, eps_none, dtypes)
    return None


def _eps_none(module, forward, eps_attr, variant, x64, w64, has_weight, dtypes) -> bool:
    """Whether `module` with eps None computes `variant` with FP32's machine epsilon (NONE_EPS)."""
    setattr(module, eps_attr, None)
    for x_dtype, w_dtype in _PROBE_DTYPES:
        if dtypes is not None and (x_dtype, w_dtype if has_weight else None) not in dtypes:
            continue
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
