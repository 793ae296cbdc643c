"""Decoder layers: the residual add before `post_attention_layernorm` fused into that norm (opt-in).

A class is taken when its forward is, statement for statement, the Llama decoder layer (`_LAYER_STATEMENTS`,
any arguments to the attention call): its math is then `residual + attention output`, the norm of that sum,
the MLP, the second add, which `add_rms_norm` computes bit for bit where the norm's math is one xkern
computes. The forward is rebuilt from the class's own source through its AST, with statements 4-6 replaced
by one call (`_FUSED_STATEMENT`).
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
import textwrap
import warnings

import torch

from torch_api.hf.norm_forward import kernels_take
from torch_api.hf.originals import is_unset, original_forward
from torch_api.hf.probe import norm_math

DECODER_LAYER_NAME = re.compile(r"DecoderLayer$")  # the layer classes `patch_hf_classes(fuse_residual=True)` reads

_LAYER_STATEMENTS = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    None,  # the attention call: `hidden_states[, _] = self.self_attn(...)`
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)
_FUSED_STATEMENT = "hidden_states, residual = _xkern_add_norm(self.post_attention_layernorm, hidden_states, residual)"
_LAYER_FORWARDS: dict = {}


def _is_attention_call(stmt) -> bool:
    call = getattr(stmt, "value", None)
    func = getattr(call, "func", None)
    return (isinstance(stmt, ast.Assign) and isinstance(call, ast.Call) and isinstance(func, ast.Attribute)
            and func.attr == "self_attn" and isinstance(func.value, ast.Name) and func.value.id == "self")


_WARNED: set = set()  # the reasons `_add_norm` has warned about (once each)


def _add_norm(norm: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor):
    """(norm(residual + hidden_states), residual + hidden_states): through `add_rms_norm` where xkern computes
    the norm's math on these inputs, else as the layer computed them (with a warning, once per reason, where
    only the dtypes or shapes stand in the way)."""
    math = norm_math(type(norm))
    weight = None if math is None or math.variant == "none" else norm.weight
    if math is not None and kernels_take(hidden_states, weight) and kernels_take(residual, weight):
        # The layer's norm rounds `normed` to the sum's dtype (eager promotion), the fused op to x's: x is the
        # operand of the sum's dtype (mixed under autocast: an fp32 residual stream, a bf16 attention output).
        summed = torch.promote_types(hidden_states.dtype, residual.dtype)
        x, r = (residual, hidden_states) if residual.dtype == summed else (hidden_states, residual)
        reason = ("their shapes differ" if hidden_states.shape != residual.shape else
                  None if x.dtype == summed else f"neither {hidden_states.dtype} nor {residual.dtype} is their sum's")
        if reason is None:
            from torch_api.add_rms_norm import add_rms_norm

            return add_rms_norm(x, r, weight, getattr(norm, math.eps_attr),
                                variant="llama" if math.variant == "none" else math.variant)
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(f"xkern: the residual add before {type(norm).__name__} runs unfused (the layer's add, "
                          f"then its norm): {reason}", stacklevel=2)
    summed = residual + hidden_states
    return norm(summed), summed


def fused_layer_forward(cls: type):
    """The forward of decoder layer class `cls` with the add before `post_attention_layernorm` fused into it,
    or None when `cls`'s forward is not the Llama decoder layer's (cached per class)."""
    if cls in _LAYER_FORWARDS:
        return _LAYER_FORWARDS[cls]
    fused = None
    try:
        forward = original_forward(cls)
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (TypeError, OSError, SyntaxError):
        tree = None
    fn = tree.body[0] if tree is not None and tree.body else None
    if isinstance(fn, ast.FunctionDef):
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) == len(_LAYER_STATEMENTS) and all(
                _is_attention_call(s) if p is None else ast.dump(s) == ast.dump(ast.parse(p).body[0])
                for s, p in zip(body, _LAYER_STATEMENTS)):
            fn.body = body[:3] + ast.parse(_FUSED_STATEMENT).body + body[6:]
            # `_xkern_add_norm` a closure variable, not a global: torch.compile reads an inlined function's
            # globals from its module (transformers'), which has no such name.
            make = ast.parse("def _xkern_make(_xkern_add_norm):\n    pass").body[0]
            make.body = [fn, ast.Return(ast.Name(fn.name, ast.Load()))]
            tree.body = [make]
            namespace = dict(inspect.unwrap(forward).__globals__)
            exec(compile(ast.fix_missing_locations(tree), f"<xkern fused {cls.__name__}.forward>", "exec"),
                 namespace)  # noqa: S102 - the class's own source, one call substituted
            fused = namespace["_xkern_make"](_add_norm)
    _LAYER_FORWARDS[cls] = fused
    return fused


class _LayerForward:
    """The fused forward of one decoder layer (pickled as the class's own forward, as instance patching's)."""

    def __init__(self, module: torch.nn.Module, fn):
        self.module, self.fn = module, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

    def __reduce__(self):
        return getattr, (self.module, "forward")

    def __deepcopy__(self, memo):
        return _LayerForward(copy.deepcopy(self.module, memo), self.fn)


def fuse_residual_norms(model: torch.nn.Module) -> int:
    """Opt-in: in every decoder layer of `model` whose class is the Llama decoder layer (`fused_layer_forward`)
    and whose `post_attention_layernorm` computes math xkern computes (`norm_math`), fuse the residual add
    before that norm into it (`add_rms_norm`: one kernel each way, the same bits as the layer's add and norm).
    Returns how many layers were patched (0 on a second call). Other modules are left alone."""
    n = 0
    for m in model.modules():
        norm = getattr(m, "post_attention_layernorm", None)
        if not isinstance(norm, torch.nn.Module) or norm_math(type(norm)) is None or not is_unset(m, "forward"):
            continue
        fn = fused_layer_forward(type(m))
        if fn is not None and type(m).forward is not fn:  # (not already through its class)
            m.forward = _LayerForward(m, fn)
            n += 1
    return n
