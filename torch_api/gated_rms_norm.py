"""Gated RMSNorm for PyTorch: `gated_rms_norm`, the `GatedRMSNorm` module, and the `xkern::gated_rms_norm_*`
ops behind them. Math, rounding points and kernels: `xkern/gated_rms_norm/kernels.py`.

Eager calls on plain tensors launch a cached `Executor` (autograd through `_GatedRMSNormFunction`, forward-mode
AD through its `jvp`). Everything else (torch.compile, export, tensor subclasses, dispatch modes) goes through
the two `torch.library.custom_op`s, whose fake implementations give symbolic sizes, so a compiled graph takes
them whole (`fullgraph=True`) and with dynamic shapes; the forward op's autograd is its backward op.
"""

from __future__ import annotations

import math

import torch

from torch_api._launch import (
    DTYPES,
    Executor,
    aligned,
    aligned_weight,
    cached,
    check_device,
    check_tensor,
    direct,
    dtype_name,
    flat_weight,
    forward_mode,
    readable,
    rows_layout,
    signature,
    traced,
)
from xkern.gated_rms_norm import check_gated_rms_norm, gated_rms_norm_bwd_recipe, gated_rms_norm_fwd_recipe
from xkern.gated_rms_norm import out_dtype_name as _out_dtype_name
from xkern.launch import check_float


def _check(x, gate, weight, eps, group_size, norm_before_gate, activation, rounding) -> int:
    """The core's rules for one call; returns the group size."""
    for name, t in (("x", x), ("gate", gate), ("weight", weight)):
        check_tensor(name, t)
    _, group_size = check_gated_rms_norm(dtype_name(x.dtype), tuple(x.shape), dtype_name(gate.dtype),
                                         tuple(gate.shape), dtype_name(weight.dtype), tuple(weight.shape), eps,
                                         group_size, norm_before_gate, activation, rounding)
    check_device("x", x)
    check_device("gate", gate, like=x)
    check_device("weight", weight, like=x)
    return group_size


def _y_dtype(x, weight, norm_before_gate, rounding) -> torch.dtype:
    return DTYPES[_out_dtype_name(dtype_name(x.dtype), dtype_name(weight.dtype), norm_before_gate, rounding)]


# ---------------------------------------------------------------------------------------------------
# Eager executors, cached per call signature (`torch_api._launch.cached`: checked once, on a miss). Strided
# rows (a head-major view) are read in place where `rows_layout` allows, else copied.


class _Forward:
    def __init__(self, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding):
        group_size = _check(x, gate, weight, eps, group_size, norm_before_gate, activation, rounding)
        (self.copy_x, x_stride), (self.copy_z, z_stride) = rows_layout(x), rows_layout(gate)
        recipe = gated_rms_norm_fwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], group_size, eps,
                                           dtype_name(x.dtype), dtype_name(weight.dtype), x_stride, z_stride,
                                           norm_before_gate, activation, rounding)
        self.run = Executor(recipe, ("x", "z", "w"), {"y": x.shape})
        self.in_place = not self.copy_x and not self.copy_z and flat_weight(weight) is weight

    def __call__(self, x, gate, weight):
        if self.in_place and aligned(x, gate, weight):
            return self.run.run(x, gate, weight)[0]
        return self.run.run(readable(x, self.copy_x), readable(gate, self.copy_z), aligned_weight(weight))[0]


class _Backward:
    def __init__(self, dy, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding):
        group_size = _check(x, gate, weight, eps, group_size, norm_before_gate, activation, rounding)
        if dy.shape != x.shape or dy.dtype != _y_dtype(x, weight, norm_before_gate, rounding):
            raise ValueError(f"dy must have y's shape {list(x.shape)} and dtype, got {list(dy.shape)} {dy.dtype}")
        layouts = [rows_layout(t) for t in (x, gate, dy)]
        self.copies = [c for c, _ in layouts]
        recipe = gated_rms_norm_bwd_recipe(math.prod(x.shape[:-1]), x.shape[-1], group_size, eps,
                                           dtype_name(x.dtype), dtype_name(weight.dtype), *[s for _, s in layouts],
                                           norm_before_gate=norm_before_gate, activation=activation,
                                           rounding=rounding)
        self.run = Executor(recipe, ("x", "z", "w", "dy"), {"dx": x.shape, "dz": x.shape, "dw": weight.shape})
        self.in_place = not any(self.copies) and flat_weight(weight) is weight

    def __call__(self, dy, x, gate, weight):
        if self.in_place and aligned(dy, x, gate, weight):
            return self.run.run(x, gate, weight, dy)
        cx, cz, cdy = self.copies
        return self.run.run(readable(x, cx), readable(gate, cz), aligned_weight(weight), readable(dy, cdy))


def _forward(x, gate, weight, eps, group_size, norm_before_gate, activation, rounding):
    key = ("gated_rms_norm_fwd", signature(x), signature(gate), signature(weight), eps, group_size,
           norm_before_gate, activation, rounding)
    return cached(key, _Forward, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding)(
        x, gate, weight)


def _backward(dy, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding):
    key = ("gated_rms_norm_bwd", signature(dy), signature(x), signature(gate), signature(weight), eps, group_size,
           norm_before_gate, activation, rounding)
    return cached(key, _Backward, dy, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding)(
        dy, x, gate, weight)


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile (fullgraph, dynamic shapes), export, tensor subclasses, fake tensors.


@torch.library.custom_op("xkern::gated_rms_norm_fwd", mutates_args=())
def gated_rms_norm_fwd(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                       norm_before_gate: bool, activation: str, rounding: str) -> torch.Tensor:
    return _forward(x, gate, weight, eps, group_size, norm_before_gate, activation, rounding)


@gated_rms_norm_fwd.register_fake
def _(x, gate, weight, eps, group_size, norm_before_gate, activation, rounding):
    return x.new_empty(x.shape, dtype=_y_dtype(x, weight, norm_before_gate, rounding))


@torch.library.custom_op("xkern::gated_rms_norm_bwd", mutates_args=())
def gated_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       group_size: int, norm_before_gate: bool, activation: str,
                       rounding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dz, dw = _backward(dy, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding)
    return dx, dz, dw


@gated_rms_norm_bwd.register_fake
def _(dy, x, gate, weight, eps, group_size, norm_before_gate, activation, rounding):
    return x.new_empty(x.shape), x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, gate, weight, *options = inputs
    ctx.save_for_backward(x, gate, weight)
    ctx.options = options


def _op_backward(ctx, dy):
    x, gate, weight = ctx.saved_tensors
    dx, dz, dw = torch.ops.xkern.gated_rms_norm_bwd(dy.contiguous(), x, gate, weight, *ctx.options)
    return dx, dz, dw, None, None, None, None, None


gated_rms_norm_fwd.register_autograd(_op_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Eager autograd: the joint backward kernel; forward-mode AD in closed form.


def _tangent(x, gate, weight, tx, tz, tw, eps, group_size, norm_before_gate, activation, rounding):
    """The forward-mode tangent of y in fp32 (the primal's intermediate roundings not applied), rounded once
    to y's dtype; None tangents are zeros."""
    xf, zf, w = x.float(), gate.float(), weight.float()
    tx, tz, tw = (torch.zeros_like(p, dtype=torch.float32) if t is None else t.float()
                  for p, t in ((x, tx), (gate, tz), (weight, tw)))
    s = torch.sigmoid(zf)
    a, da = (s, s * (1 - s)) if activation == "sigmoid" else (zf * s, s * (1 + zf * (1 - s)))
    ta = da * tz
    h, th = (xf, tx) if norm_before_gate else (xf * a, tx * a + xf * ta)
    shape = (*h.shape[:-1], h.shape[-1] // group_size, group_size)
    hg, thg = h.reshape(shape), th.reshape(shape)
    rstd = torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    n = hg * rstd
    tn = (rstd * (thg - n * (n * thg).mean(-1, keepdim=True))).reshape(h.shape)
    n = n.reshape(h.shape)
    p, tp = w * n, tw * n + w * tn
    ty = tp * a + p * ta if norm_before_gate else tp
    return ty.to(_y_dtype(x, weight, norm_before_gate, rounding))


def reference_math(x, gate, weight, eps, group_size=None, norm_before_gate=True, activation="silu",
                   rounding="llama") -> torch.Tensor:
    """The eager expression of each form in torch ops, as Hugging Face's classes compute it (what the HF probe
    compares a class with, bit for bit): a = act(gate.float()); h = x.float(), or x.float() * a with the gate
    first; normed over groups of `group_size`; p = w * normed.to(x.dtype) ("llama") or w.float() * normed
    ("fp32"); y = (p * a).to(x.dtype) with the gate after, else p ("llama") or p.to(x.dtype) ("fp32")."""
    a = torch.sigmoid(gate.float()) if activation == "sigmoid" else torch.nn.functional.silu(gate.float())
    h = x.float() if norm_before_gate else x.float() * a
    size = group_size or h.shape[-1]
    hg = h.view(*h.shape[:-1], h.shape[-1] // size, size)
    n = (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    p = weight * n.to(x.dtype) if rounding == "llama" else weight.float() * n
    if norm_before_gate:
        return (p * a).to(x.dtype)
    return p if rounding == "llama" else p.to(x.dtype)


class _GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(x, gate, weight, *options):
        return _forward(x, gate, weight, *options)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gate, weight, *options = inputs
        ctx.save_for_backward(x, gate, weight)
        if forward_mode():
            ctx.save_for_forward(x, gate, weight)
        ctx.options = options

    @staticmethod
    @torch.autograd.function.once_differentiable  # second derivatives: not provided (a clear error, not zeros)
    def backward(ctx, dy):
        x, gate, weight = ctx.saved_tensors
        dx, dz, dw = _backward(dy, x, gate, weight, *ctx.options)
        return dx, dz, dw, None, None, None, None, None

    @staticmethod
    def jvp(ctx, tx, tz, tw, *_):
        x, gate, weight = ctx.saved_tensors
        return _tangent(x, gate, weight, tx, tz, tw, *ctx.options)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   group_size: int | None = None, norm_before_gate: bool = True, activation: str = "silu",
                   rounding: str = "llama") -> torch.Tensor:
    """Gated RMSNorm of the hybrid models, bit for bit their Hugging Face forward; differentiable in x, gate
    and weight (one joint backward kernel; forward-mode AD).

    Args:
      x: hidden states [..., N], float16 / bfloat16 / float32, any layout (rows of a head-major view are read
        in place), CUDA (or CPU under TRITON_INTERPRET=1).
      gate: z, x's shape and dtype.
      weight: [N], float16 / bfloat16 / float32.
      eps: added to the mean square.
      group_size: the norm runs over groups of this many columns (it must divide N); None: the whole row.
      norm_before_gate: True `y = (p * act(z.float())).to(x.dtype)`, p = w * normed (Qwen3-Next, Kimi
        Linear); False: normed of `x.float() * act(z.float())`, y = p (Mamba2, Nemotron-H).
      activation: "silu" or "sigmoid".
      rounding: "llama" p = w * normed.to(x.dtype) (in promote(w, x)); "fp32" p = w.float() * normed.

    y's dtype is x's, but promote(x, weight) with norm_before_gate=False and "llama" rounding.
    `xkern.gated_rms_norm.FAMILIES` names the Hugging Face classes' settings.

    Example: `gated_rms_norm(core_attn_out, z, norm.weight, 1e-6)` for Qwen3NextRMSNormGated.
    """
    eps = check_float("eps", eps)
    options = (eps, group_size, norm_before_gate, activation, rounding)
    if direct(x, gate, weight):
        return _forward(x, gate, weight, *options)
    if traced(x, gate, weight):
        group_size = _check(x, gate, weight, *options)
        return torch.ops.xkern.gated_rms_norm_fwd(x, gate, weight, eps, group_size, norm_before_gate, activation,
                                                  rounding)
    return _GatedRMSNormFunction.apply(x, gate, weight, *options)


class GatedRMSNorm(torch.nn.Module):
    """`gated_rms_norm` as a module with parameter `weight` [hidden_size] (ones), the name Hugging Face's
    gated norms use, so their state dicts load unchanged. `forward(hidden_states, gate)`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, group_size: int | None = None,
                 norm_before_gate: bool = True, activation: str = "silu", rounding: str = "llama",
                 device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.activation, self.rounding = activation, rounding

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate, activation=self.activation,
                              rounding=self.rounding)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, activation={self.activation}, rounding={self.rounding}")


# ---------------------------------------------------------------------------------------------------
# DTensor: rows sharded (any dim but the last: tokens, heads) stay local; y, dx and dz sharded like x, dw
# `Partial()` (each rank's dw of its rows, in w's dtype, summed when DTensor reduces it). A sharded width
# (the norm's groups) is gathered.

if torch.distributed.is_available():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    _SCALARS = [None] * 5  # eps, group_size, norm_before_gate, activation, rounding

    @register_sharding(torch.ops.xkern.gated_rms_norm_fwd.default)
    def _fwd_sharding(x, gate, weight, *options):
        rep = Replicate()
        rules = [([rep], [rep, rep, rep, *_SCALARS])]
        return rules + [([Shard(d)], [Shard(d), Shard(d), rep, *_SCALARS]) for d in range(x.ndim - 1)]

    @register_sharding(torch.ops.xkern.gated_rms_norm_bwd.default)
    def _bwd_sharding(dy, x, gate, weight, *options):
        rep = Replicate()
        rules = [([rep, rep, rep], [rep, rep, rep, rep, *_SCALARS])]
        return rules + [([Shard(d), Shard(d), Partial()], [Shard(d), Shard(d), Shard(d), rep, *_SCALARS])
                        for d in range(x.ndim - 1)]
