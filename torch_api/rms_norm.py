"""RMSNorm for PyTorch: `rms_norm`, the `RMSNorm` module, and the `xkern::rms_norm_*` ops behind them.

One autograd.Function, `RMSNormFunction`, holds the rules: setup_context and backward (also the registered
op's autograd), jvp, vmap. A call takes one of three routes (`torch_api._launch`): traced (torch.compile,
export, DTensor and other tensor subclasses, dispatch modes) -> the registered `torch.library.triton_op`,
which Inductor lowers to direct kernel launches in its generated code; needing autograd -> the Function,
whose forward launches the cached eager executor; else the executor alone. All execute the same recipe
from `xkern.rms_norm`. Math and rounding: `xkern/rms_norm/kernels.py`.
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
    functorch_active,
    loop_vmap,
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
from xkern.launch import check_float, check_int
from xkern.rms_norm import check_rms_norm, check_variant, out_dtype_name, rms_norm_bwd_recipe, rms_norm_fwd_recipe


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


def _fwd_fake(x, weight, eps, variant="llama"):
    y_dtype = out_dtype_name(dtype_name(x.dtype), dtype_or_none(weight), variant)
    return x.new_empty(x.shape, dtype=DTYPES[y_dtype])


def _bwd_fake(dy, x, weight, eps, variant="llama"):
    return x.new_empty(x.shape), x.new_empty((0,)) if weight is None else weight.new_empty(weight.shape)


# `variant` is check_variant's ("none" without a weight: `weight` is then None). A traced call keeps the row
# count symbolic (`rows_recipe`, `register_op`).
@register_op("xkern::rms_norm_fwd", _fwd_fake, symbolic_rows=True)
def rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, variant: str = "llama") -> torch.Tensor:
    x2 = rows_view(x)
    recipe = rows_recipe(rms_norm_fwd_recipe, x2.shape[0], int(x.shape[-1]), eps, dtype_name(x.dtype),
                         dtype_or_none(weight), int(x2.stride(0)), variant)
    (y,) = run_recipe(recipe, x.device, x=x2, w=flat_weight(weight))
    return y.view(x.shape)


@register_op("xkern::rms_norm_bwd", _bwd_fake, symbolic_rows=True)
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                 eps: float, variant: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """dx, and dw (of shape [0] without a weight: an op returns no None)."""
    x2, dy2 = rows_view(x), rows_view(dy)
    recipe = rows_recipe(rms_norm_bwd_recipe, x2.shape[0], int(x.shape[-1]), eps, dtype_name(x.dtype),
                         dtype_or_none(weight), int(x2.stride(0)), int(dy2.stride(0)), variant=variant)
    dx, dw = run_recipe(recipe, x.device, x=x2, w=flat_weight(weight), dy=dy2)
    return dx.view(x.shape), dw.view(-1)


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


def _backward_math(eps, variant):
    """(dy, x[, w]) -> the backward of reference_math (dx, and dw with a weight): differentiable, batchable."""
    math_fn = _math(eps, variant)

    def backward(dy, *primals):
        _, vjp = torch.func.vjp(math_fn, *primals)
        return vjp(dy)

    return backward


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm's autograd, for the eager calls and (setup_context, backward) the registered op's.

    backward: the joint kernel (the registered op where traced, else the eager executor); where the backward
    must itself be differentiable or batched (create_graph, torch.func, is_grads_batched), the eager math's
    derivatives in torch ops. jvp: the eager expression's tangent. vmap: more rows, or one call per example
    for a batched weight."""

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
        if differentiable_backward():
            dx, *dw = _backward_math(ctx.eps, ctx.variant)(dy, *(t for t in (x, weight) if t is not None))
            dw = dw[0] if dw else None
        elif traced(dy):  # (x and weight are of the forward's kind, as its output and so dy are)
            variant = "none" if weight is None else ctx.variant  # the op's (the eager Function's is unchecked)
            dx, dw = torch.ops.xkern.rms_norm_bwd(dy, x, weight, ctx.eps, variant)
        else:  # (the op's variant is "none" without a weight, the eager Function's the caller's)
            dx, dw = _backward_direct(dy, x, weight, ctx.eps, "llama" if weight is None else ctx.variant)
        return dx, None if weight is None else dw, None, None

    @staticmethod
    def jvp(ctx, tx, tw, *_):
        x, weight = ctx.saved_tensors
        return _tangent(x, weight, ctx.eps, ctx.variant, tx, tw)

    @staticmethod
    def vmap(info, in_dims, x, weight, eps, variant):
        x_dim, w_dim = in_dims[0], in_dims[1]
        if w_dim is not None:
            return loop_vmap(RMSNormFunction.apply, info, in_dims, x, weight, eps, variant)
        xs = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
        return RMSNormFunction.apply(xs, weight, eps, variant), 0


rms_norm_fwd.register_autograd(RMSNormFunction.backward, setup_context=RMSNormFunction.setup_context)
_apply = raw_apply(RMSNormFunction)


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
    if direct(x, weight):
        return _forward(x, weight, eps, variant)
    if traced(x, weight):
        variant = _check(x, weight, eps, variant)
        return torch.ops.xkern.rms_norm_fwd(x, weight, eps, variant)
    return (RMSNormFunction.apply if functorch_active() else _apply)(x, weight, eps, variant)


class RMSNorm(torch.nn.Module):
    """Drop-in Hugging Face-style RMSNorm module: `weight` and `eps` (also `variance_epsilon`, HF's name),
    forward = `rms_norm`, or `add_rms_norm` when given a residual.

    hidden_size: the normalized (last) dim, an int >= 0. variant: as `rms_norm`'s; `reset_parameters()` sets
    the weight to ones, or zeros for "gemma" (whose scale is `1 + w`), so a fresh module is the identity
    scale (after meta-device init, `to_empty()` then `reset_parameters()`). weight=False: no weight parameter
    (`normed.to(x.dtype)`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, *, variant: str = "llama",
                 weight: bool = True):
        super().__init__()
        self.hidden_size = check_int("hidden_size", hidden_size)
        check_variant(variant, weight)
        self.variant = variant
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype)) if weight else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(0.0 if self.variant == "gemma" else 1.0)

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    @eps.setter
    def eps(self, value: float) -> None:
        value = check_float("eps", value)
        if not 0 <= value < math.inf:
            raise ValueError(f"eps must be >= 0 and finite, got {value}")
        self.variance_epsilon = value

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`rms_norm(x)`; with a residual, `add_rms_norm(x, residual)`: (y, residual_out)."""
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon, variant=self.variant)
        from torch_api.add_rms_norm import add_rms_norm  # (it imports this module)

        return add_rms_norm(x, residual, self.weight, self.variance_epsilon, variant=self.variant)

    def extra_repr(self) -> str:
        shape = f"{tuple(self.weight.shape)}, " if self.weight is not None else f"({self.hidden_size},), no weight, "
        return f"{shape}eps={self.variance_epsilon}" + (f", variant={self.variant}" if self.variant != "llama" else "")
