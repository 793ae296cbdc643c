"""RMSNorm for PyTorch: `rms_norm`, the `RMSNorm` module, and the `xkern::rms_norm_*` ops behind them.

Eager calls on plain CUDA tensors launch the kernels directly (an `Executor` cached per call signature,
autograd through `_RMSNormFunction`, forward-mode AD through its `jvp`). Everything else — torch.compile,
export, DTensor and other tensor subclasses, dispatch modes — goes through the registered
`torch.library.triton_op`s, which Inductor lowers to direct kernel launches in its generated code. Both
paths execute the same recipe from `xkern/rms_norm.py`. Math and rounding: see there.
"""

from __future__ import annotations

import torch

from torch_api._launch import (
    Executor,
    check_device,
    check_tensor,
    dtype_name,
    eager,
    fast_apply,
    functorch_active,
    needs_autograd,
    register_op,
    rows_view,
    run_recipe,
)
from xkern.rms_norm import check_rms_norm, rms_norm_bwd_recipe, rms_norm_fwd_recipe


def _check(x, weight, eps) -> None:
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_rms_norm(dtype_name(x.dtype), tuple(x.shape), dtype_name(weight.dtype), tuple(weight.shape), eps)
    check_device("x", x)
    check_device("weight", weight, like=x)


def _flat_weight(weight: torch.Tensor) -> torch.Tensor:
    # Kernels read the weight as contiguous: one copy for strided or expanded weights.
    return weight if weight.stride(0) == 1 or weight.shape[0] <= 1 else weight.contiguous()


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile, export, DTensor, fake tensors.


@register_op("xkern::rms_norm_fwd")
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = rows_view(x)
    # int(): the plan depends on the shape, so a compiled graph specializes on it (guards, no symbols).
    recipe = rms_norm_fwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype),
                                 dtype_name(weight.dtype), int(x2.stride(0)))
    (y,) = run_recipe(recipe, x.device, x=x2, w=_flat_weight(weight))
    return y.view(x.shape)


@register_op("xkern::rms_norm_bwd")
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2, dy2 = rows_view(x), rows_view(dy)
    recipe = rms_norm_bwd_recipe(int(x2.shape[0]), int(x.shape[-1]), eps, dtype_name(x.dtype),
                                 dtype_name(weight.dtype), int(x2.stride(0)), int(dy2.stride(0)))
    dx, dw = run_recipe(recipe, x.device, x=x2, w=_flat_weight(weight), dy=dy2)
    return dx.view(x.shape), dw.view(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.xkern.rms_norm_bwd(dy, x, weight, ctx.eps)
    return dx, dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager: executors cached per call signature (validated once, on the first call of each).


class _Forward:
    def __init__(self, x: torch.Tensor, weight: torch.Tensor, eps: float):
        _check(x, weight, eps)
        x2 = rows_view(x)
        self.copy_x = x2.data_ptr() != x.data_ptr() and x.numel() > 0  # not viewable as rows: one copy
        recipe = rms_norm_fwd_recipe(x2.shape[0], x.shape[-1], float(eps), dtype_name(x.dtype),
                                     dtype_name(weight.dtype), x2.stride(0))
        self.run = Executor(recipe, ("x", "w"), {"y": x.shape})

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.run(x.contiguous() if self.copy_x else x, _flat_weight(weight))[0]


class _Backward:
    def __init__(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
        x2, dy2 = rows_view(x), rows_view(dy)
        self.copy_x = x2.data_ptr() != x.data_ptr() and x.numel() > 0
        self.copy_dy = dy2.data_ptr() != dy.data_ptr() and dy.numel() > 0
        recipe = rms_norm_bwd_recipe(x2.shape[0], x.shape[-1], float(eps), dtype_name(x.dtype),
                                     dtype_name(weight.dtype), x2.stride(0), dy2.stride(0))
        self.run = Executor(recipe, ("x", "w", "dy"), {"dx": x.shape, "dw": weight.shape})

    def __call__(self, dy, x, weight):
        return tuple(self.run(x.contiguous() if self.copy_x else x, _flat_weight(weight),
                              dy.contiguous() if self.copy_dy else dy))


_FORWARDS: dict = {}
_BACKWARDS: dict = {}


def _forward(x: torch.Tensor, weight: torch.Tensor, eps) -> torch.Tensor:
    key = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype, weight.device, eps)
    try:
        fwd = _FORWARDS.get(key)
    except TypeError:  # an unhashable eps: the checks name it
        fwd = None
    if fwd is None:
        fwd = _FORWARDS[key] = _Forward(x, weight, eps)
    return fwd(x, weight)


def _backward_direct(dy, x, weight, eps):
    key = (x.shape, x.stride(), x.dtype, dy.stride(), dy.dtype, weight.stride(), weight.dtype, x.device, eps)
    bwd = _BACKWARDS.get(key)
    if bwd is None:
        bwd = _BACKWARDS[key] = _Backward(dy, x, weight, eps)
    return bwd(dy, x, weight)


def _jvp_math(x, weight, eps, tx, tw):
    """Forward-mode tangent of `w * (x.f32 * rstd).to(x.dtype)` (closed form, fp32, rounded as eager rounds
    the primal: the normalised tangent to x's dtype, the result to the output dtype)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    ty = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if tx is not None:
        txf = tx.float()
        tn = rstd * (txf - n * (n * txf).mean(-1, keepdim=True))
        ty = ty + weight.float() * tn.to(x.dtype).float()
    if tw is not None:
        ty = ty + tw.float() * n.to(x.dtype).float()
    return ty.to(out_dtype)


class _RMSNormFunction(torch.autograd.Function):
    """Eager autograd over the direct launches: backward is the joint kernel, jvp the closed form, vmap
    more rows (or one call per example for a batched weight)."""

    @staticmethod
    def forward(x, weight, eps):
        return _forward(x, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.save_for_forward(x, weight)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if needs_autograd(dy, x, weight):  # create_graph or torch.func: a differentiable node
            dx, dw = _RMSNormBackward.apply(dy, x, weight, ctx.eps)
        else:
            dx, dw = _backward_direct(dy, x, weight, ctx.eps)
        return dx, dw, None

    @staticmethod
    def jvp(ctx, tx, tw, _):
        x, weight = ctx.saved_tensors
        return _jvp_math(x, weight, ctx.eps, tx, tw)

    @staticmethod
    def vmap(info, in_dims, x, weight, eps):
        x_dim, w_dim = in_dims[0], in_dims[1]
        if w_dim is None:
            x = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
            return _RMSNormFunction.apply(x, weight, eps), 0
        weight = weight.movedim(w_dim, 0)
        xs = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
        return torch.stack([_RMSNormFunction.apply(a, b, eps) for a, b in zip(xs, weight)]), 0


# autograd.Function.apply binds default arguments with inspect.signature on every call (a third of the
# eager step's host time); without a functorch transform the C++ apply it wraps does the same work.
_apply_rms_norm = fast_apply(_RMSNormFunction)


class _RMSNormBackward(torch.autograd.Function):
    """The joint backward as a graph node (create_graph, torch.func). Its own derivatives (double backward,
    jvp of grad: Hessian-vector products) are taken through `_backward_math`, the same formula in torch
    ops."""

    @staticmethod
    def forward(dy, x, weight, eps):
        return _backward_direct(dy, x, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        dy, x, weight, eps = inputs
        ctx.save_for_backward(dy, x, weight)
        ctx.save_for_forward(dy, x, weight)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, ddx, ddw):
        dy, x, weight = ctx.saved_tensors
        _, vjp = torch.func.vjp(lambda *a: _backward_math(*a, ctx.eps), dy, x, weight)
        return (*vjp((ddx, ddw)), None)

    @staticmethod
    def jvp(ctx, tdy, tx, tw, _):
        primals = ctx.saved_tensors
        tangents = [torch.zeros_like(p) if t is None else t for p, t in zip(primals, (tdy, tx, tw))]
        return torch.func.jvp(lambda *a: _backward_math(*a, ctx.eps), primals, tuple(tangents))[1]


def _backward_math(dy, x, weight, eps):
    """The joint backward in torch ops, with the kernel's rounding points (differentiable)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    g = (dy.float() * weight.float()).to(x.dtype).float()
    dx = (rstd * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
    dw = (dy.float() * n.to(x.dtype).float()).to(dy.dtype).float().reshape(-1, x.shape[-1]).sum(0)
    return dx, dw.to(weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face Llama RMSNorm over the last dim: `w * (x.float() * rsqrt(mean(x.float()**2) + eps))
    .to(x.dtype)`, fp32 statistics, differentiable in `x` and `weight` (backward, forward-mode AD, vmap).

    x: [..., N], float16 / bfloat16 / float32, any N >= 0 and any layout, CUDA (or CPU under
    TRITON_INTERPRET=1). weight: [N], float16 / bfloat16 / float32, any stride; the output dtype is
    eager's promotion of the two (float32 when they differ).
    """
    if eager(x, weight):
        if not needs_autograd(x, weight):
            return _forward(x, weight, eps)
        if not functorch_active():
            return _apply_rms_norm(x, weight, eps)
        return _RMSNormFunction.apply(x, weight, eps)
    _check(x, weight, eps)
    return torch.ops.xkern.rms_norm_fwd(x, weight, float(eps))


class RMSNorm(torch.nn.Module):
    """Drop-in Llama-style RMSNorm module: `weight` (ones at init) and `eps`, forward = `rms_norm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, xkern"
