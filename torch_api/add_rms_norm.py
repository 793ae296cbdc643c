"""Fused residual add + RMSNorm for PyTorch: `add_rms_norm` and the `xkern::add_rms_norm_*` ops behind it.

`y, residual_out = add_rms_norm(x, residual, w)` is Hugging Face's decoder-layer pair `residual_out = x +
residual; y = norm(residual_out)` in one kernel (one read of x and residual, one write of y and residual_out),
and its backward one kernel too (reads dy, residual_out's gradient, residual_out and w once each). Eager calls
on plain tensors launch the recipes directly (an `Executor` per call signature, autograd through
`_AddRMSNormFunction`); everything else (torch.compile, export, DTensor) goes through the registered
`torch.library.triton_op`s. The recipes and the rounding contract are in `xkern/rms_norm.py` (search "Fused
residual add").

Autodiff: reverse mode through the joint backward kernel, with None for an unused gradient of either output.
Forward-mode AD and torch.func transforms (jvp, vmap, grad) take the composite expression, as do second
derivatives (create_graph): the sum in torch ops, then xkern's `rms_norm` (equal dtypes: the same bits) or
the eager expression (x's dtype differs from residual_out's).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from torch_api._launch import (
    Executor,
    check_device,
    check_tensor,
    dtype_name,
    eager,
    forward_mode,
    functorch_active,
    needs_autograd,
    register_op,
    rows_view,
    run_recipe,
)
from torch_api.rms_norm import _aligned_weight, _flat_weight, _w_dtype, rms_norm
from xkern.add_rms_norm import add_rms_norm_bwd_recipe, add_rms_norm_fwd_recipe, check_add_rms_norm


def _check(x, residual, weight, eps, variant, residual_dtype) -> tuple[str, str]:
    """The core's rules for one call; returns residual_out's dtype name and the kernel variant."""
    check_tensor("x", x)
    check_tensor("residual", residual)
    if weight is not None:
        check_tensor("weight", weight)
    if residual_dtype is not None and not isinstance(residual_dtype, torch.dtype):
        raise TypeError(f"residual_dtype must be a torch.dtype or None, got {type(residual_dtype).__name__}")
    _, res_dtype, variant = check_add_rms_norm(
        dtype_name(x.dtype), tuple(x.shape), dtype_name(residual.dtype), tuple(residual.shape),
        None if weight is None else dtype_name(weight.dtype), None if weight is None else tuple(weight.shape), eps,
        variant, None if residual_dtype is None else dtype_name(residual_dtype))
    check_device("x", x)
    check_device("residual", residual, like=x)
    if weight is not None:
        check_device("weight", weight, like=x)
    return res_dtype, variant


# ---------------------------------------------------------------------------------------------------
# Registered ops. `variant` is check_variant's ("none" without a weight); dtypes by name.


@register_op("xkern::add_rms_norm_fwd")
def add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                     variant: str, residual_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out), both contiguous in x's shape."""
    x2, r2 = rows_view(x), rows_view(residual)
    recipe = add_rms_norm_fwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype),
                                     dtype_name(residual.dtype), _w_dtype(weight), residual_dtype, int(x2.stride(0)),
                                     int(r2.stride(0)), variant)
    y, res = run_recipe(recipe, x.device, x=x2, r=r2, w=_flat_weight(weight))
    return y.view(x.shape), res.view(x.shape)


@register_op("xkern::add_rms_norm_bwd")
def add_rms_norm_bwd(dy: torch.Tensor, dres: Optional[torch.Tensor], residual_out: torch.Tensor,
                     weight: Optional[torch.Tensor], eps: float, variant: str,
                     x_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """d(sum) in residual_out's dtype, and dw (of shape [0] without a weight). dres: residual_out's gradient
    (residual_out's dtype), or None."""
    s2, dy2 = rows_view(residual_out), rows_view(dy)
    inputs = dict(x=s2, w=_flat_weight(weight), dy=dy2)
    if dres is not None:
        inputs["dres"] = rows_view(dres)
    recipe = add_rms_norm_bwd_recipe(int(s2.shape[0]), int(residual_out.shape[-1]), eps, x_dtype, _w_dtype(weight),
                                     dtype_name(residual_out.dtype), dres is not None, int(s2.stride(0)),
                                     int(dy2.stride(0)), None if dres is None else int(inputs["dres"].stride(0)),
                                     variant=variant)
    dsum, dw = run_recipe(recipe, residual_out.device, **inputs)
    return dsum.view(residual_out.shape), dw.view(-1)


def _norm_math(s: torch.Tensor, weight, eps: float, variant: str, x_dtype: torch.dtype) -> torch.Tensor:
    """y of the contract from residual_out `s`, differentiable: xkern's rms_norm where `normed` rounds to s's
    own dtype, else the eager expression with `normed` rounded to x's dtype."""
    if s.dtype == x_dtype:
        return rms_norm(s, weight, eps, variant="llama" if variant == "none" else variant)
    sf = s.float()
    normed = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(x_dtype)
    if variant == "llama":
        return weight * normed.to(x_dtype)
    if variant == "gemma":
        return (normed * (1.0 + weight.float())).to(x_dtype)
    return (weight * normed).to(x_dtype)


def _composite(x, residual, weight, eps, variant, res_dtype: torch.dtype):
    """The contract in differentiable torch ops (forward-mode AD, torch.func)."""
    s = (x.float() + residual.float()).to(res_dtype)
    return _norm_math(s, weight, eps, variant, x.dtype), s


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, variant, _ = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.variant, ctx.x_dtype, ctx.r_dtype = eps, variant, x.dtype, residual.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dres):
    res, weight = ctx.saved_tensors
    if dy is None and dres is None:
        return None, None, None, None, None, None
    if dy is None:  # y unused: d(sum) is residual_out's gradient alone
        dsum, dw = dres, None if weight is None else torch.zeros_like(weight)
    elif torch.is_grad_enabled():  # create_graph: a differentiable backward, through the composite
        with torch.enable_grad():
            s = res if res.requires_grad else res.detach().requires_grad_()
            y = _norm_math(s, weight, ctx.eps, ctx.variant, ctx.x_dtype)
        wants = [t for t in (s, weight) if t is not None and t.requires_grad]
        grads = dict(zip(map(id, wants), torch.autograd.grad(y, wants, dy, create_graph=True, allow_unused=True)))
        dsum, dw = grads.get(id(s)), None if weight is None else grads.get(id(weight))
        dsum = torch.zeros_like(res) if dsum is None else dsum
        dsum = dsum if dres is None else dsum + dres
    elif getattr(ctx, "direct", False):
        dsum, dw = _backward_direct(dy, dres, res, weight, ctx.eps, ctx.variant, ctx.x_dtype)
    else:
        dsum, dw = torch.ops.xkern.add_rms_norm_bwd(dy, dres, res, weight, ctx.eps, ctx.variant,
                                                    dtype_name(ctx.x_dtype))
    dx = dsum if dsum.dtype == ctx.x_dtype else dsum.to(ctx.x_dtype)
    dr = dx if ctx.r_dtype == ctx.x_dtype else dsum.to(ctx.r_dtype)
    return dx, dr, None if weight is None else dw, None, None, None


add_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager on plain tensors: the recipes' launches straight from an `Executor` cached per call signature (the
# registered op's dispatch and Triton's launcher cost the host tens of µs per call). Inputs the kernels do
# not read in place (not contiguous, not 16-byte aligned) are copied first.

_FORWARDS: dict = {}
_BACKWARDS: dict = {}


def _direct_input(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.is_contiguous() and t.data_ptr() & 15 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _forward_direct(x, residual, weight, eps, variant, res_name):
    key = (x.shape, x.dtype, residual.dtype, x.device, None if weight is None else weight.dtype, eps, variant,
           res_name)
    run = _FORWARDS.get(key)
    if run is None:
        recipe = add_rms_norm_fwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], eps, dtype_name(x.dtype),
                                         dtype_name(residual.dtype), _w_dtype(weight), res_name, variant=variant)
        run = _FORWARDS[key] = Executor(recipe, ("x", "r", "w"), {"y": x.shape, "residual_out": x.shape})
    y, res = run(_direct_input(x), _direct_input(residual), _aligned_weight(weight))
    return y, res


def _backward_direct(dy, dres, res, weight, eps, variant, x_dtype):
    key = (res.shape, res.dtype, res.device, dy.dtype, dres is not None, None if weight is None else weight.dtype,
           eps, variant, x_dtype)
    run = _BACKWARDS.get(key)
    if run is None:
        recipe = add_rms_norm_bwd_recipe(math.prod(res.shape[:-1]), res.shape[-1], eps, dtype_name(x_dtype),
                                         _w_dtype(weight), dtype_name(res.dtype), dres is not None, variant=variant)
        shapes = {"dx": res.shape, "dw": weight.shape if weight is not None else (0,)}
        run = _BACKWARDS[key] = Executor(recipe, ("x", "w", "dy", "dres"), shapes)
    dsum, dw = run(res, _aligned_weight(weight), _direct_input(dy), _direct_input(dres))
    return dsum, dw


class _AddRMSNormFunction(torch.autograd.Function):
    """Eager autograd over the direct launches (plain tensors, no transform): the registered op's backward."""

    @staticmethod
    def forward(x, residual, weight, eps, variant, res_name):
        return _forward_direct(x, residual, weight, eps, variant, res_name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.direct = True

    backward = staticmethod(_backward)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                 variant: str = "llama", residual_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: `(y, residual_out)` with

        residual_out = (x.float() + residual.float()).to(residual_dtype)   (one rounding)
        y = rms_norm(residual_out, weight, eps, variant=variant), `normed` rounded to x's dtype

    residual_dtype: default eager's promotion of x's and residual's dtypes (then, with equal dtypes, y is bit
    for bit `rms_norm(x + residual)`); torch.float32 with 16-bit x keeps an FP32 residual stream. y's dtype
    is rms_norm's for x and weight. x, residual: [..., N] of one shape, float16 / bfloat16 / float32, any
    layout whose rows collapse to one stride (else a copy). Differentiable in x, residual and weight; the
    backward returns one gradient, d(residual_out), for x and residual (the same tensor when their dtypes
    match, else converted to each)."""
    res_name, variant = _check(x, residual, weight, eps, variant, residual_dtype)
    if not torch.compiler.is_compiling() and (forward_mode() or functorch_active()):
        return _composite(x, residual, weight, float(eps), variant, getattr(torch, res_name))
    if eager(x, residual) and (weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter)):
        if needs_autograd(x, residual, weight):
            return _AddRMSNormFunction.apply(x, residual, weight, float(eps), variant, res_name)
        return _forward_direct(x, residual, weight, float(eps), variant, res_name)
    return torch.ops.xkern.add_rms_norm_fwd(x, residual, weight, float(eps), variant, res_name)
