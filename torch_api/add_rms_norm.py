"""Fused residual add + RMSNorm for PyTorch: `add_rms_norm` and the `xkern::add_rms_norm_*` ops behind it (the
`RMSNorm` module, which takes a residual too, is in `torch_api/rms_norm.py`).

`y, residual_out = add_rms_norm(x, residual, w)` is Hugging Face's decoder-layer pair `residual_out = x +
residual; y = norm(residual_out)` in one kernel (one read of x and residual, one write of y and residual_out),
and its backward one kernel too (reads dy, residual_out's gradient, residual_out and w once each). Eager calls
on plain tensors launch the recipes directly (an executor per call signature, autograd through
`AddRMSNormFunction`, whose setup_context and backward are also the registered op's); everything else
(torch.compile, export, DTensor) goes through the registered `torch.library.triton_op`s. The recipes and the
rounding contract are in `xkern/add_rms_norm.py`.

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
    DTYPES,
    Executor,
    aligned,
    aligned_weight,
    cached,
    check_device,
    check_tensor,
    differentiable_backward,
    direct,
    dtype_name,
    dtype_or_none,
    flat_weight,
    forward_mode,
    raw_apply,
    readable,
    register_op,
    rows_layout,
    rows_recipe,
    rows_view,
    run_recipe,
    signature,
    traced,
)
from torch_api.rms_norm import reference_math, rms_norm
from xkern.add_rms_norm import add_rms_norm_bwd_recipe, add_rms_norm_fwd_recipe, check_add_rms_norm
from xkern.launch import check_float
from xkern.rms_norm import check_variant, out_dtype_name


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


def _fwd_fake(x, residual, weight, eps, variant, residual_dtype):
    y = x.new_empty(x.shape, dtype=DTYPES[out_dtype_name(dtype_name(x.dtype), dtype_or_none(weight), variant)])
    return y, x.new_empty(x.shape, dtype=DTYPES[residual_dtype])


def _bwd_fake(dy, dres, residual_out, weight, eps, variant, x_dtype):
    dw = residual_out.new_empty((0,)) if weight is None else weight.new_empty(weight.shape)
    return residual_out.new_empty(residual_out.shape), dw


@register_op("xkern::add_rms_norm_fwd", _fwd_fake, symbolic_rows=True)
def add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                     variant: str, residual_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out), both contiguous in x's shape."""
    x2, r2 = rows_view(x), rows_view(residual)
    recipe = rows_recipe(add_rms_norm_fwd_recipe, x2.shape[0], int(x.shape[-1]), eps, dtype_name(x.dtype),
                         dtype_name(residual.dtype), dtype_or_none(weight), residual_dtype, int(x2.stride(0)),
                         int(r2.stride(0)), variant)
    y, res = run_recipe(recipe, x.device, x=x2, r=r2, w=flat_weight(weight))
    return y.view(x.shape), res.view(x.shape)


@register_op("xkern::add_rms_norm_bwd", _bwd_fake, symbolic_rows=True)
def add_rms_norm_bwd(dy: torch.Tensor, dres: Optional[torch.Tensor], residual_out: torch.Tensor,
                     weight: Optional[torch.Tensor], eps: float, variant: str,
                     x_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """d(sum) in residual_out's dtype, and dw (of shape [0] without a weight). dres: residual_out's gradient
    (residual_out's dtype), or None."""
    s2, dy2 = rows_view(residual_out), rows_view(dy)
    inputs = dict(x=s2, w=flat_weight(weight), dy=dy2)
    if dres is not None:
        inputs["dres"] = rows_view(dres)
    recipe = rows_recipe(add_rms_norm_bwd_recipe, s2.shape[0], int(residual_out.shape[-1]), eps, x_dtype,
                         dtype_or_none(weight), dtype_name(residual_out.dtype), dres is not None, int(s2.stride(0)),
                         int(dy2.stride(0)), None if dres is None else int(inputs["dres"].stride(0)), variant=variant)
    dsum, dw = run_recipe(recipe, residual_out.device, **inputs)
    return dsum.view(residual_out.shape), dw.view(-1)


def _y(s: torch.Tensor, weight, eps: float, variant: str, x_dtype: torch.dtype) -> torch.Tensor:
    """y of the contract from residual_out `s`, differentiable: xkern's rms_norm where `normed` rounds to s's
    own dtype (the kernel's bits), else the eager expression with `normed` rounded to x's dtype."""
    if s.dtype == x_dtype:
        return rms_norm(s, weight, eps, variant="llama" if variant == "none" else variant)
    return reference_math(s, weight, eps, variant, normed_dtype=x_dtype)


def _composite(x, residual, weight, eps, variant, res_dtype: torch.dtype):
    """The contract in differentiable torch ops (forward-mode AD, torch.func)."""
    s = (x.float() + residual.float()).to(res_dtype)
    return _y(s, weight, eps, variant, x.dtype), s


# ---------------------------------------------------------------------------------------------------
# Eager on plain tensors: the recipes' launches straight from executors cached per call signature
# (`torch_api._launch.cached`: checked once, on a miss), as rms_norm's; rows read in place where their layout
# allows, else copied first.


class _Forward:
    """The forward's executor for one call signature, with the checked variant and residual_out's dtype."""

    def __init__(self, x, residual, weight, eps: float, variant, residual_dtype):
        self.res_name, self.variant = _check(x, residual, weight, eps, variant, residual_dtype)
        self.eps = eps
        (self.copy_x, x_row_stride), (self.copy_r, r_row_stride) = rows_layout(x), rows_layout(residual)
        recipe = add_rms_norm_fwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], eps, dtype_name(x.dtype),
                                         dtype_name(residual.dtype), dtype_or_none(weight), self.res_name,
                                         x_row_stride, r_row_stride, self.variant)
        self.run = Executor(recipe, ("x", "r", "w"), {"y": x.shape, "residual_out": x.shape})
        # On a hit, in place where the signature allows and the addresses are aligned (as rms_norm's _Forward)
        self.in_place = not self.copy_x and not self.copy_r and flat_weight(weight) is weight

    def __call__(self, x, residual, weight) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_place and aligned(x, residual, weight):
            y, res = self.run.run(x, residual, weight)
        else:
            y, res = self.run.run(readable(x, self.copy_x), readable(residual, self.copy_r), aligned_weight(weight))
        return y, res


class _Backward:
    """The backward's executor for one call signature: d(sum) in residual_out's dtype, and dw."""

    def __init__(self, dy, dres, res, weight, eps: float, variant: str, x_dtype: torch.dtype):
        variant = check_variant(variant, weight is not None)
        (self.copy_dy, dy_row_stride), (self.copy_dres, dres_row_stride) = rows_layout(dy), (
            (False, None) if dres is None else rows_layout(dres))
        recipe = add_rms_norm_bwd_recipe(math.prod(res.shape[:-1]), res.shape[-1], eps, dtype_name(x_dtype),
                                         dtype_or_none(weight), dtype_name(res.dtype), dres is not None,
                                         res.shape[-1], dy_row_stride, dres_row_stride, variant=variant)
        shapes = {"dx": res.shape, "dw": weight.shape if weight is not None else (0,)}
        self.run = Executor(recipe, ("x", "w", "dy", "dres"), shapes)
        self.in_place = not self.copy_dy and not self.copy_dres and flat_weight(weight) is weight

    def __call__(self, dy, dres, res, weight):
        if self.in_place and aligned(dy, dres, weight):
            dsum, dw = self.run.run(res, weight, dy, dres)
        else:
            dsum, dw = self.run.run(res, aligned_weight(weight), readable(dy, self.copy_dy),
                                    readable(dres, self.copy_dres))
        return dsum, dw


def _backward_direct(dy, dres, res, weight, eps, variant, x_dtype):
    # res: the forward's residual_out, contiguous and aligned (an executor's result)
    key = ("add_rms_norm_bwd", signature(dy), signature(dres), signature(res), signature(weight), eps, variant,
           x_dtype)
    return cached(key, _Backward, dy, dres, res, weight, eps, variant, x_dtype)(dy, dres, res, weight)


class AddRMSNormFunction(torch.autograd.Function):
    """add_rms_norm's autograd, for the eager calls and (setup_context, backward) the registered op's. Forward-mode
    AD and torch.func take the composite (`add_rms_norm`), so this Function has no jvp or vmap."""

    @staticmethod
    def forward(x, residual, weight, eps, variant, residual_dtype):
        return _forward(x, residual, weight, eps, variant, residual_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, weight, eps, variant, _ = inputs
        ctx.save_for_backward(output[1], weight)
        ctx.eps, ctx.variant, ctx.x_dtype, ctx.r_dtype = eps, variant, x.dtype, residual.dtype
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dy, dres):
        res, weight = ctx.saved_tensors
        if dy is None and dres is None:
            return None, None, None, None, None, None
        variant = "none" if weight is None else ctx.variant  # the op's (the eager Function's is unchecked)
        if dy is None:  # y unused: d(sum) is residual_out's gradient alone
            dsum, dw = dres, None if weight is None else torch.zeros_like(weight)
        elif differentiable_backward():  # create_graph: a differentiable backward, through the composite
            dsum, dw = _composite_backward(dy, dres, res, weight, ctx.eps, variant, ctx.x_dtype)
        elif traced(dy, dres):  # (residual_out and weight are of the forward's kind, as its outputs are)
            dsum, dw = torch.ops.xkern.add_rms_norm_bwd(dy, dres, res, weight, ctx.eps, variant,
                                                        dtype_name(ctx.x_dtype))
        else:
            dsum, dw = _backward_direct(dy, dres, res, weight, ctx.eps, "llama" if weight is None else ctx.variant,
                                        ctx.x_dtype)
        dx = dsum if dsum.dtype == ctx.x_dtype else dsum.to(ctx.x_dtype)
        dr = dx if ctx.r_dtype == ctx.x_dtype else dsum.to(ctx.r_dtype)
        return dx, dr, None if weight is None else dw, None, None, None


def _composite_backward(dy, dres, res, weight, eps, variant, x_dtype):
    """(d(sum), dw) through `_y`'s autograd, itself differentiable (create_graph)."""
    with torch.enable_grad():
        s = res if res.requires_grad else res.detach().requires_grad_()
        y = _y(s, weight, eps, variant, x_dtype)
    wants = [t for t in (s, weight) if t is not None and t.requires_grad]
    grads = dict(zip(map(id, wants), torch.autograd.grad(y, wants, dy, create_graph=True, allow_unused=True)))
    dsum, dw = grads.get(id(s)), None if weight is None else grads.get(id(weight))
    dsum = torch.zeros_like(res) if dsum is None else dsum
    return (dsum if dres is None else dsum + dres), dw


add_rms_norm_fwd.register_autograd(AddRMSNormFunction.backward, setup_context=AddRMSNormFunction.setup_context)
_apply = raw_apply(AddRMSNormFunction)


def _forward(x, residual, weight, eps: float, variant, residual_dtype):
    key = ("add_rms_norm_fwd", signature(x), signature(residual), signature(weight), eps, variant, residual_dtype)
    return cached(key, _Forward, x, residual, weight, eps, variant, residual_dtype)(x, residual, weight)


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
    eps = check_float("eps", eps)  # a float before any cache lookup (xkern.launch.check_int says why)
    if direct(x, residual, weight):
        return _forward(x, residual, weight, eps, variant, residual_dtype)
    if traced(x, residual, weight):
        res_name, variant = _check(x, residual, weight, eps, variant, residual_dtype)
        return torch.ops.xkern.add_rms_norm_fwd(x, residual, weight, eps, variant, res_name)
    if forward_mode():  # forward-mode AD or torch.func: the composite
        res_name, variant = _check(x, residual, weight, eps, variant, residual_dtype)
        return _composite(x, residual, weight, eps, variant, getattr(torch, res_name))
    return _apply(x, residual, weight, eps, variant, residual_dtype)
