"""RMSNorm for PyTorch: `rms_norm`, the `RMSNorm` module, and the `xkern::rms_norm_*` ops behind them.

Eager calls on plain CUDA tensors launch the kernels directly (an `Executor` cached per call signature,
autograd through `_RMSNormFunction`, forward-mode AD through its `jvp`). Everything else — torch.compile,
export, DTensor and other tensor subclasses, dispatch modes — goes through the registered
`torch.library.triton_op`s, which Inductor lowers to direct kernel launches in its generated code. Both
paths execute the same recipe from `xkern/rms_norm.py`. Math and rounding: see there.
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
    fast_apply,
    forward_mode,
    functorch_active,
    needs_autograd,
    register_op,
    rows_view,
    run_recipe,
)
from xkern.launch import check_float, row_align
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


def _flat_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    # Kernels read the weight as contiguous: one copy for strided or expanded weights.
    return weight if weight is None or weight.stride(0) == 1 or weight.shape[0] <= 1 else weight.contiguous()


def _aligned_weight(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The weight as the eager path reads it: contiguous and 16-byte aligned (see `_in_place`)."""
    if weight is None:
        return None
    weight = _flat_weight(weight)
    return weight if weight.data_ptr() & 15 == 0 else weight.clone()


def _w_dtype(weight) -> str | None:
    return None if weight is None else dtype_name(weight.dtype)


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile, export, DTensor, fake tensors.


# `variant` is check_variant's ("none" without a weight: `weight` is then None).
@register_op("xkern::rms_norm_fwd")
def rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, variant: str = "llama") -> torch.Tensor:
    x2 = rows_view(x)
    # int(): the plan depends on the shape, so a compiled graph specializes on it (guards, no symbols).
    recipe = rms_norm_fwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype), _w_dtype(weight),
                                 int(x2.stride(0)), variant)
    (y,) = run_recipe(recipe, x.device, x=x2, w=_flat_weight(weight))
    return y.view(x.shape)


@register_op("xkern::rms_norm_bwd")
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                 eps: float, variant: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """dx, and dw (of shape [0] without a weight: an op returns no None)."""
    x2, dy2 = rows_view(x), rows_view(dy)
    recipe = rms_norm_bwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype), _w_dtype(weight),
                                 int(x2.stride(0)), int(dy2.stride(0)), variant=variant)
    dx, dw = run_recipe(recipe, x.device, x=x2, w=_flat_weight(weight), dy=dy2)
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
# Eager: executors cached per call signature (validated once, on the first call of each).


def _rows(t: torch.Tensor) -> tuple[bool, int]:
    """Whether the eager path copies `t` (contiguous) rather than reading it in place, and the row stride it
    then reads. In place: rows that collapse to one row stride with the alignment of a contiguous array's
    (JAX's layout: another ROW_ALIGN would compile another binary, with other sum orders)."""
    t2 = rows_view(t)
    n_cols = t.shape[-1]
    copy = t.numel() > 0 and (t2.data_ptr() != t.data_ptr() or row_align(n_cols, t2.stride(0)) != row_align(n_cols))
    return copy, n_cols if copy else t2.stride(0)


def _in_place(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """`t` as the kernels read it: a contiguous copy, or t itself at a 16-byte-aligned address (as JAX's
    buffers always are; Triton compiles misaligned pointers to another binary), else an aligned copy with
    t's strides."""
    if copy:
        return t.contiguous() if t.data_ptr() & 15 == 0 else t.clone(memory_format=torch.contiguous_format)
    if t.data_ptr() & 15 == 0:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class _Forward:
    def __init__(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str):
        variant = _check(x, weight, eps, variant)
        self.copy_x, x_row_stride = _rows(x)
        self.flat_w = weight is None or _flat_weight(weight) is weight
        recipe = rms_norm_fwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], float(eps), dtype_name(x.dtype),
                                     _w_dtype(weight), x_row_stride, variant)
        self.run = Executor(recipe, ("x", "w"), {"y": x.shape})

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if self.copy_x or x.data_ptr() & 15:
            x = _in_place(x, self.copy_x)
        if weight is not None and (not self.flat_w or weight.data_ptr() & 15):
            weight = _aligned_weight(weight)
        return self.run(x, weight)[0]


class _Backward:
    def __init__(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str):
        variant = check_variant(variant, weight is not None)
        (self.copy_x, x_row_stride), (self.copy_dy, dy_row_stride) = _rows(x), _rows(dy)
        self.weighted = weight is not None
        self.flat_w = weight is None or _flat_weight(weight) is weight
        recipe = rms_norm_bwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], float(eps), dtype_name(x.dtype),
                                     _w_dtype(weight), x_row_stride, dy_row_stride, variant=variant)
        self.run = Executor(recipe, ("x", "w", "dy"), {"dx": x.shape, "dw": (weight.shape if self.weighted else (0,))})

    def __call__(self, dy, x, weight):
        if self.copy_x or x.data_ptr() & 15:
            x = _in_place(x, self.copy_x)
        if self.copy_dy or dy.data_ptr() & 15:
            dy = _in_place(dy, self.copy_dy)
        if weight is not None and (not self.flat_w or weight.data_ptr() & 15):
            weight = _aligned_weight(weight)
        dx, dw = self.run(x, weight, dy)
        return dx, dw if self.weighted else None


# Executors by call signature. The key holds everything the checks and the plan read (the weight's device,
# eps's type: a cached call skips the checks, and True == 1).
_FORWARDS: dict = {}
_BACKWARDS: dict = {}


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps, variant="llama") -> torch.Tensor:
    key = (x.shape, x.stride(), x.dtype, x.device, eps, type(eps), variant) if weight is None else \
        (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype, weight.device, eps,
         type(eps), variant)
    try:
        fwd = _FORWARDS.get(key)
    except TypeError:  # an unhashable eps or variant: the checks name it
        fwd = None
    if fwd is None:
        fwd = _FORWARDS[key] = _Forward(x, weight, eps, variant)
    return fwd(x, weight)


def _backward_direct(dy, x, weight, eps, variant):
    key = (x.shape, x.stride(), x.dtype, x.device, dy.stride(), dy.dtype, eps, variant) if weight is None else \
        (x.shape, x.stride(), x.dtype, x.device, dy.stride(), dy.dtype, weight.shape, weight.stride(), weight.dtype,
         eps, variant)
    bwd = _BACKWARDS.get(key)
    if bwd is None:
        bwd = _BACKWARDS[key] = _Backward(dy, x, weight, eps, variant)
    return bwd(dy, x, weight)


def reference_math(x: torch.Tensor, weight: torch.Tensor | None, eps: float, variant: str = "llama") -> torch.Tensor:
    """The variant's eager expression in torch ops, as Hugging Face's modules compute it (`normed` in fp32):
    llama `w * normed.to(x.dtype)`, gemma `(normed * (1 + w.float())).to(x.dtype)`, olmo2
    `(w * normed).to(x.dtype)`, no weight `normed.to(x.dtype)`. xkern's forward-mode tangents and second
    derivatives are this expression's (the kernels give the first derivatives)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None or variant == "none":
        return normed.to(x.dtype)
    if variant == "llama":
        return weight * normed.to(x.dtype)
    if variant == "gemma":
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed).to(x.dtype)


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
    if eager(x, weight):
        if not needs_autograd(x, weight):
            return _forward(x, weight, eps, variant)
        if not functorch_active():
            return _apply_rms_norm(x, weight, eps, variant)
        return _RMSNormFunction.apply(x, weight, eps, variant)
    variant = _check(x, weight, eps, variant)
    return torch.ops.xkern.rms_norm_fwd(x, weight, eps, variant)


class RMSNorm(torch.nn.Module):
    """Drop-in Hugging Face-style RMSNorm module: `weight` and `eps`, forward = `rms_norm`.

    variant: as `rms_norm`'s; the weight starts at ones, or zeros for "gemma" (whose scale is `1 + w`), so a
    fresh module is the identity scale. weight=False: no weight parameter (`normed.to(x.dtype)`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, *, variant: str = "llama",
                 weight: bool = True):
        super().__init__()
        self.variant = variant
        check_variant(variant, weight)
        init = torch.zeros if variant == "gemma" else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype)) if weight else None
        self.variance_epsilon = eps

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`rms_norm(x)`; with a residual, `add_rms_norm(x, residual)`: (y, residual_out)."""
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon, variant=self.variant)
        from torch_api.add_rms_norm import add_rms_norm  # (that module imports this one)

        return add_rms_norm(x, residual, self.weight, self.variance_epsilon, variant=self.variant)

    def extra_repr(self) -> str:
        shape = f"{tuple(self.weight.shape)}, " if self.weight is not None else "no weight, "
        return f"{shape}eps={self.variance_epsilon}" + (f", variant={self.variant}" if self.variant != "llama" else "")
