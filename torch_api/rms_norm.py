"""RMSNorm for PyTorch: `rms_norm`, the `RMSNorm` module, and the `xkern::rms_norm_*` ops behind them.

The ops are registered with `torch.library` (fake implementations included) so `torch.compile(
fullgraph=True)` traces them; autograd is attached with `register_autograd`. Math and rounding: see
`xkern/rms_norm.py`.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_api._launch import check_device, launch, rows_view
from xkern.rms_norm import check_variant, out_dtype_name, plan_rms_norm_bwd, plan_rms_norm_fwd

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None, variant: str) -> torch.dtype:
    name = out_dtype_name(str(x.dtype)[6:], None if weight is None else str(weight.dtype)[6:], variant)
    return getattr(torch, name)


def _no_dw(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,))  # the op's dw without a weight (a custom op returns no None)


# `variant` is check_variant's ("none" without a weight; `weight` is then None).
@torch.library.custom_op("xkern::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, variant: str = "llama") -> torch.Tensor:
    n_cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight, variant), device=x.device)
    x2 = rows_view("x", x)
    if x2.numel() == 0:
        return y
    w = x2 if weight is None else weight  # "none" does not read w
    plan = plan_rms_norm_fwd(x2.shape[0], n_cols, eps, (x2.stride(0), n_cols),
                             max(x.element_size(), w.element_size()), variant)
    launch(plan, x2, w, y, n_rows=x2.shape[0], n_cols=n_cols, x_row_stride=x2.stride(0), y_row_stride=n_cols)
    return y


@rms_norm_fwd.register_fake
def _(x, weight, eps, variant="llama"):
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight, variant))


@torch.library.custom_op("xkern::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                 eps: float, variant: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, dy2 = rows_view("x", x), rows_view("dy", dy)
    n_rows = x2.shape[0]
    if x2.numel() == 0:
        return dx, _no_dw(x) if weight is None else torch.zeros_like(weight)
    plan = plan_rms_norm_bwd(n_rows, n_cols, eps, (x2.stride(0), dy2.stride(0), n_cols), variant=variant)
    scalars = dict(n_rows=n_rows, n_cols=n_cols, x_row_stride=x2.stride(0), dy_row_stride=dy2.stride(0),
                   dx_row_stride=n_cols)
    inputs = [x2, x2 if weight is None else weight, dy2]
    if plan.stats is not None:
        stats = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)
        launch(plan.stats, *inputs, stats, **scalars)
        inputs.append(stats)
    partial = torch.empty((plan.n_partials, n_cols), dtype=torch.float32, device=x.device)
    launch(plan.bwd, *inputs, dx, partial, **scalars)
    if plan.reduce is None:
        return dx, _no_dw(x)
    dw = torch.empty_like(weight)
    launch(plan.reduce, partial, dw, n_partials=plan.n_partials, n_cols=n_cols)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, x, weight, eps, variant="llama"):
    # dx is contiguous whatever x's layout (as the real op makes it); empty_like would copy x's strides
    return x.new_empty(x.shape), _no_dw(x) if weight is None else torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, eps, variant = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.variant = eps, variant


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.xkern.rms_norm_bwd(dy, x, weight, ctx.eps, ctx.variant)
    return dx, None if weight is None else dw, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
             variant: str = "llama") -> torch.Tensor:
    """Hugging Face Llama RMSNorm over the last dim: `w * (x.float() * rsqrt(mean(x.float()**2) + eps))
    .to(x.dtype)`, fp32 statistics, differentiable in `x` and `weight`.

    x: [..., N], float16 / bfloat16 / float32, any N >= 1, CUDA (or CPU under TRITON_INTERPRET=1).
    weight: [N], x's dtype or float32; the output dtype follows eager promotion of the two. None: no weight,
    `normed.to(x.dtype)` (Llama4's L2 norm).
    variant: the math around `normed = x.float() * rsqrt(...)`: "llama" (above), "gemma"
    `(normed * (1 + w.float())).to(x.dtype)`, "olmo2" `(w * normed).to(x.dtype)` (output dtype x's).
    """
    variant = check_variant(variant, weight is not None)
    if not isinstance(x, torch.Tensor) or not isinstance(weight, (torch.Tensor, type(None))):
        raise TypeError(f"x and weight must be torch.Tensors, got {type(x).__name__} and {type(weight).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight is not None and weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"weight must have x's dtype ({x.dtype}) or float32, got {weight.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., N], got a scalar")
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    check_device("x", x)
    if weight is not None:
        check_device("weight", weight, like=x)
    return torch.ops.xkern.rms_norm_fwd(x, weight, float(eps), variant)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, variant=self.variant)

    def extra_repr(self) -> str:
        shape = f"{tuple(self.weight.shape)}, " if self.weight is not None else "no weight, "
        return f"{shape}eps={self.variance_epsilon}" + (f", variant={self.variant}" if self.variant != "llama" else "")
