"""torch.compile: `rms_norm(a + b)` with xkern's norm rewritten to the fused `add_rms_norm`.

Inductor fuses a residual add into its own norm kernels, but xkern's norm is an opaque op to it (and on the
GPU a `triton_op` whose kernels it launches as they are): the add would stay a kernel of its own, both ways.
`fuse_add_rms_norm(graph)` rewrites Dynamo's graph (Torch IR, before autograd) so that

    s = a + b ; y = xkern::rms_norm_fwd(s, w, eps, variant)      (s may have other users)
 -> y, s = xkern::add_rms_norm_fwd(a, b, w, eps, variant, dtype)

and AOT autograd then differentiates the fused op through its own joint backward (one kernel reads dy, the
gradient of s, s and w). Taken only where a and b have one float dtype and one shape (then the fused op is
bit for bit the pair: see xkern/add_rms_norm.py). `enable_compile_fusion()` installs it as Inductor's
`pre_grad_custom_pass`; nothing is installed on import.
"""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import torch

from torch_api._launch import dtype_name

_ADDS = (operator.add, torch.add, torch.ops.aten.add.Tensor)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _val(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def _norm_args(node) -> tuple | None:
    """(x, weight, eps, variant) of an xkern::rms_norm_fwd call node, or None."""
    op = torch.ops.xkern.rms_norm_fwd
    if node.op != "call_function" or node.target not in (op, op.default):
        return None
    names = ("x", "weight", "eps", "variant")
    args = {"variant": "llama", **dict(zip(names, node.args)), **node.kwargs}
    return tuple(args[n] for n in names) if args.keys() == set(names) else None


def _add_operands(node) -> tuple | None:
    """(a, b) of `a + b` (two tensors, no alpha), or None."""
    if not isinstance(node, torch.fx.Node) or node.kwargs:
        return None
    if node.op == "call_function" and node.target in _ADDS or node.op == "call_method" and node.target == "add":
        if len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args):
            return node.args
    return None


def fuse_add_rms_norm(graph: torch.fx.Graph) -> int:
    """Rewrite every `xkern::rms_norm_fwd(a + b, ...)` of `graph` to `xkern::add_rms_norm_fwd`; returns how many."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    fused = 0
    for node in list(graph.nodes):
        args = _norm_args(node)
        operands = None if args is None else _add_operands(args[0])
        if operands is None:
            continue
        x, weight, eps, variant = args
        add, (a, b) = x, operands
        va, vb, vs = _val(a), _val(b), _val(add)
        if not all(isinstance(v, torch.Tensor) for v in (va, vb, vs)) or va.dtype not in _FLOATS or \
                not va.dtype == vb.dtype == vs.dtype or not va.shape == vb.shape == vs.shape:
            continue
        if isinstance(weight, torch.fx.Node) and order[weight] > order[add]:
            continue  # the fused call takes add's place: its weight must exist there
        with graph.inserting_before(add):
            call = graph.call_function(torch.ops.xkern.add_rms_norm_fwd.default,
                                       (a, b, weight, eps, variant, dtype_name(va.dtype)))
            y = graph.call_function(operator.getitem, (call, 0))
            s = graph.call_function(operator.getitem, (call, 1))
        for new, old in ((y, node), (s, add)):
            new.meta.update({k: v for k, v in old.meta.items() if k in ("example_value", "val", "stack_trace")})
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        add.replace_all_uses_with(s)
        graph.erase_node(add)
        fused += 1
    return fused


def _custom_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FuseAddRMSNorm(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fuse_add_rms_norm(graph)

        def uuid(self) -> bytes:  # Inductor's cache key: this file's contents
            return hashlib.sha256(Path(__file__).read_bytes()).digest()

    # Inductor pickles its config into the FX graph cache key: the class must be found by name in this module
    # (a local class made every compile print "Failed to pickle cache key" and skip the cache).
    FuseAddRMSNorm.__qualname__ = "FuseAddRMSNorm"
    globals()["FuseAddRMSNorm"] = FuseAddRMSNorm
    return FuseAddRMSNorm()


_PASS = None


def enable_compile_fusion() -> None:
    """Install `fuse_add_rms_norm` as an Inductor pre-grad custom pass (kept beside any pass already set).
    Idempotent. Affects graphs compiled afterwards (call `torch._dynamo.reset()` for earlier ones)."""
    import torch._inductor.config as config

    global _PASS
    if _PASS is None:
        _PASS = _custom_pass()
    current = config.pre_grad_custom_pass
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    if not any(p is _PASS for p in passes):
        config.pre_grad_custom_pass = _PASS if not passes else [*passes, _PASS]
