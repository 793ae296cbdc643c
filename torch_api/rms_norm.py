"""RMSNorm for PyTorch: `rms_norm` and the `xkern::rms_norm_*` ops behind it (the `RMSNorm` module, which
also takes a residual, is in `torch_api/add_rms_norm.py`).

Eager calls on plain CUDA tensors launch the kernels directly (an `Executor` cached per call signature,
autograd through `_RMSNormFunction`, forward-mode AD through its `jvp`). Everything else — torch.compile,
export, DTensor and other tensor subclasses, dispatch modes — goes through the registered
`torch.library.triton_op`s, which Inductor lowers to direct kernel launches in its generated code. Both
paths execute the same recipe from `xkern.rms_norm`. Math and rounding: `xkern/rms_norm/kernels.py`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from torch_api._launch import (
    DIRECT,
    REGISTERED,
    TRANSFORM,
    Executor,
    aligned,
    aligned_weight,
    cached,
    check_device,
    check_tensor,
    dtype_name,
    dtype_or_none,
    eager,
    fast_apply,
    flat_weight,
    forward_mode,
    functorch_active,
    needs_autograd,
    readable,
    register_op,
    rows_layout,
    rows_view,
    run_recipe,
    signature,
)
from xkern.launch import check_float
from xkern.rms_norm import check_rms_norm, check_variant, rms_norm_bwd_recipe, rms_norm_fwd_recipe


def _check(x, weight, eps, variant) -> str:
    """The core's rules for one call; returns the kernel variant ("none" without a weight)."""
    check_tensor("x", x)
    if weight is not None:
        check_tensor("weight", weight)
    _, variant = check_rms_norm(dtype_name(x.dtype), tuple(x.shape),
                                None if weight is None else dtype_name(weight.dtype),
                                None if weight is None else tuple(weight.shape), eps, variant)
    check_device("x", x)
    if weight is not None:
        check_device("weight", weight, like=x)
    return variant


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile, export, DTensor, fake tensors.


# `variant` is check_variant's ("none" without a weight: `weight` is then None).
@register_op("xkern::rms_norm_fwd")
def rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, variant: str = "llama") -> torch.Tensor:
    x2 = rows_view(x)
    # int(): the plan depends on the shape, so a compiled graph specializes on it (guards, no symbols).
    recipe = rms_norm_fwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype), dtype_or_none(weight),
                                 int(x2.stride(0)), variant)
    (y,) = run_recipe(recipe, x.device, x=x2, w=flat_weight(weight))
    return y.view(x.shape)


@register_op("xkern::rms_norm_bwd")
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                 eps: float, variant: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """dx, and dw (of shape [0] without a weight: an op returns no None)."""
    x2, dy2 = rows_view(x), rows_view(dy)
    recipe = rms_norm_bwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype), dtype_or_none(weight),
                                 int(x2.stride(0)), int(dy2.stride(0)), variant=variant)
    dx, dw = run_recipe(recipe, x.device, x=x2, w=flat_weight(weight), dy=dy2)
    return dx.view(x.shape), dw.view(-1)


def _setup_context(ctx, inputs, output):
    x, weight, eps, variant = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.variant = eps, variant


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.xkern.rms_norm_bwd(dy, x, weight, ctx.eps, ctx.variant)
    return dx, None if weight is None else dw, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager: executors cached per call signature (`torch_api._launch.cached`: checked once, on a miss).


# Per call, on a hit: the tensors are read in place when the signature says they can be (`rows_layout`, a
# contiguous weight: the key holds their strides) and their addresses are 16-byte aligned (one check for all
# of them), else through `readable` and `aligned_weight`, which copy.


class _Forward:
    """The forward's executor for one call signature, built (and the arguments checked) on a cache miss."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str):
        variant = _check(x, weight, eps, variant)
        self.copy_x, x_row_stride = rows_layout(x)
        recipe = rms_norm_fwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], float(eps), dtype_name(x.dtype),
                                     dtype_or_none(weight), x_row_stride, variant)
        self.run = Executor(recipe, ("x", "w"), {"y": x.shape})
        self.in_place = not self.copy_x and flat_weight(weight) is weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if self.in_place and aligned(x, weight):
            return self.run.run(x, weight)[0]
        return self.run.run(readable(x, self.copy_x), aligned_weight(weight))[0]


class _Backward:
    """The backward's executor for one call signature (dx, and dw or None)."""

    def __init__(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str):
        variant = check_variant(variant, weight is not None)
        (self.copy_x, x_row_stride), (self.copy_dy, dy_row_stride) = rows_layout(x), rows_layout(dy)
        self.weighted = weight is not None
        recipe = rms_norm_bwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], float(eps), dtype_name(x.dtype),
                                     dtype_or_none(weight), x_row_stride, dy_row_stride, variant=variant)
        self.run = Executor(recipe, ("x", "w", "dy"), {"dx": x.shape, "dw": (weight.shape if self.weighted else (0,))})
        self.in_place = not self.copy_x and not self.copy_dy and flat_weight(weight) is weight

    def __call__(self, dy, x, weight):
        if self.in_place and aligned(dy, x, weight):
            dx, dw = self.run.run(x, weight, dy)
        else:
            dx, dw = self.run.run(readable(x, self.copy_x), aligned_weight(weight), readable(dy, self.copy_dy))
        return dx, dw if self.weighted else None


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant="llama") -> torch.Tensor:
    # eps is a float here (rms_norm's check_float): the key's eps compares and hashes as the plan reads it.
    key = ("rms_norm_fwd", signature(x), signature(weight), eps, variant)
    return cached(key, _Forward, x, weight, eps, variant)(x, weight)


def _backward_direct(dy, x, weight, eps, variant):
    key = ("rms_norm_bwd", signature(dy), signature(x), signature(weight), eps, variant)
    return cached(key, _Backward, dy, x, weight, eps, variant)(dy, x, weight)


def reference_math(x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str = "llama",
                   normed_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The variant's eager expression in torch ops, as Hugging Face's modules compute it (`normed` in fp32,
    rounded to `normed_dtype`, default x's dtype): llama `w * normed.to(dt)`, gemma `(normed * (1 +
    w.float())).to(dt)`, olmo2 `(w * normed).to(dt)`, no weight `normed.to(dt)`. xkern's forward-mode tangents
    and second derivatives are this expression's (the kernels give the first derivatives); with
    `normed_dtype`, the fused add's y from a residual_out `x` of another dtype than its input's."""
    dt = x.dtype if normed_dtype is None else normed_dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None or variant == "none":
        return normed.to(dt)
    if variant == "llama":
        return weight * normed.to(dt)
    if variant == "gemma":
        return (normed * (1.0 + weight.float())).to(dt)
    return (weight * normed).to(dt)


def _tangent(x, weight, eps, variant, tx, tw):
    """Forward-mode tangent of reference_math in closed form (no nested AD: forward_ad levels do not nest),
    in fp32, rounded where the primal rounds: `normed`'s tangent to x's dtype for llama, the result once."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    tn = torch.zeros_like(n) if tx is None else rstd * (tx.float() - n * (n * tx.float()).mean(-1, keepdim=True))
    if weight is None or variant == "none":
        return tn.to(x.dtype)
    w, tw = weight.float(), (torch.zeros_like(weight) if tw is None else tw).float()
    if variant == "llama":
        ty = tw * n.to(x.dtype).float() + w * tn.to(x.dtype).float()
        return ty.to(torch.promote_types(x.dtype, weight.dtype))
    if variant == "gemma":
        return (tn * (1.0 + w) + n * tw).to(x.dtype)
    return (tw * n + w * tn).to(x.dtype)


def _math(eps, variant):
    """reference_math as a function of the differentiable arguments (x, or x and w)."""
    return lambda x, w=None: reference_math(x, w, eps, variant)


def _present(*pairs):
    """The (primal, tangent) pairs whose primal is a tensor, with zero tangents for None."""
    primals = tuple(p for p, _ in pairs if p is not None)
    tangents = tuple(torch.zeros_like(p) if t is None else t for p, t in pairs if p is not None)
    return primals, tangents


class _RMSNormFunction(torch.autograd.Function):
    """Eager autograd over the direct launches: backward is the joint kernel, jvp the eager expression's,
    vmap more rows (or one call per example for a batched weight)."""

    @staticmethod
    def forward(x, weight, eps, variant):
        return _forward(x, weight, eps, variant)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, eps, variant = inputs
        ctx.save_for_backward(x, weight)
        if forward_mode():
            ctx.save_for_forward(x, weight)
        ctx.eps, ctx.variant = eps, variant

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if needs_autograd(dy, x, weight):  # create_graph or torch.func
            dx, dw = _RMSNormBackward.apply(dy, x, weight, ctx.eps, ctx.variant)
        else:
            dx, dw = _backward_direct(dy, x, weight, ctx.eps, ctx.variant)
        return dx, dw, None, None

    @staticmethod
    def jvp(ctx, tx, tw, *_):
        x, weight = ctx.saved_tensors
        return _tangent(x, weight, ctx.eps, ctx.variant, tx, tw)

    @staticmethod
    def vmap(info, in_dims, x, weight, eps, variant):
        x_dim, w_dim = in_dims[0], in_dims[1]
        xs = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
        if w_dim is None:
            return _RMSNormFunction.apply(xs, weight, eps, variant), 0
        weight = weight.movedim(w_dim, 0)
        return torch.stack([_RMSNormFunction.apply(a, b, eps, variant) for a, b in zip(xs, weight)]), 0


# autograd.Function.apply binds default arguments with inspect.signature on every call (a third of the
# eager step's host time); without a functorch transform the C++ apply it wraps does the same work.
_apply_rms_norm = fast_apply(_RMSNormFunction)


class _RMSNormBackward(torch.autograd.Function):
    """The joint backward as a graph node (create_graph, torch.func). Its own derivatives (double backward,
    jvp of grad: Hessian-vector products) are taken through `reference_math`'s backward."""

    @staticmethod
    def forward(dy, x, weight, eps, variant):
        return _backward_direct(dy, x, weight, eps, variant)

    @staticmethod
    def setup_context(ctx, inputs, output):
        dy, x, weight, eps, variant = inputs
        ctx.save_for_backward(dy, x, weight)
        if forward_mode():
            ctx.save_for_forward(dy, x, weight)
        ctx.eps, ctx.variant = eps, variant

    @staticmethod
    def backward(ctx, ddx, ddw):
        dy, x, weight = ctx.saved_tensors
        primals, cotangents = _present((dy, None), (x, None), (weight, None))[0], (ddx, ddw)
        _, vjp = torch.func.vjp(_backward_math(ctx.eps, ctx.variant), *primals)
        grads = vjp(tuple(c for c in cotangents if c is not None) if weight is None else cotangents)
        return (*grads, *([None] if weight is None else []), None, None)

    @staticmethod
    def jvp(ctx, tdy, tx, tw, *_):
        dy, x, weight = ctx.saved_tensors
        out = torch.func.jvp(_backward_math(ctx.eps, ctx.variant), *_present((dy, tdy), (x, tx), (weight, tw)))[1]
        return out if weight is not None else (out[0], None)


def _backward_math(eps, variant):
    """(dy, x[, w]) -> the backward of reference_math (dx, and dw with a weight): differentiable."""
    math_fn = _math(eps, variant)

    def backward(dy, *primals):
        _, vjp = torch.func.vjp(math_fn, *primals)
        return vjp(dy)

    return backward


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
             variant: str = "llama") -> torch.Tensor:
    """Hugging Face Llama RMSNorm over the last dim: `w * (x.float() * rsqrt(mean(x.float()**2) + eps))
    .to(x.dtype)`, fp32 statistics, differentiable in `x` and `weight` (backward, forward-mode AD, vmap,
    second derivatives).

    x: [..., N], float16 / bfloat16 / float32, any N >= 0 and any layout, CUDA (or CPU under
    TRITON_INTERPRET=1). weight: [N], float16 / bfloat16 / float32, any stride; the output dtype is
    eager's promotion of the two (float32 when they differ). None: no weight, `normed.to(x.dtype)`
    (Llama4's L2 norm). variant: the math around `normed = x.float() * rsqrt(...)`: "llama" (above),
    "gemma" `(normed * (1 + w.float())).to(x.dtype)`, "olmo2" `(w * normed).to(x.dtype)` (both x's dtype).
    """
    eps = check_float("eps", eps)  # a float before any cache lookup (xkern.launch.check_int says why)
    how = eager(x, weight)
    if how == DIRECT:
        return _forward(x, weight, eps, variant)
    if how == REGISTERED:
        variant = _check(x, weight, eps, variant)
        return torch.ops.xkern.rms_norm_fwd(x, weight, eps, variant)
    if how == TRANSFORM and functorch_active():
        return _RMSNormFunction.apply(x, weight, eps, variant)
    return _apply_rms_norm(x, weight, eps, variant)
