"""DTensor sharding strategies for the `xkern::*` torch ops, so DTensor inputs run the kernels per shard.

Registered with `torch.distributed.tensor.experimental.register_sharding` on the ops (the eager fast path for
plain tensors bypasses them; tensor subclasses such as DTensor always dispatch through them). For each op,
the placements it accepts on one mesh dim (DTensor expands them over every mesh dim, and redistributes an
input whose placement is not among them, e.g. all-gathers it):

- rms_norm_fwd(x, w): all replicated, or x sharded on a row dim (any but the last: sequence parallel as
  torchtitan's `SequenceParallel` uses it) with w replicated; y sharded like x.
- rms_norm_bwd(dy, x, w): likewise; dw is `Partial()` (each rank's dw of its rows, in w's dtype), summed
  when DTensor reduces it (all-reduce: dw rounds once more than on one device, per rank, before the sum).
- add_rms_norm_fwd(x, residual, w) and add_rms_norm_bwd(dy, dres, residual_out, w): as rms_norm's, x and
  residual (dy, dres and residual_out) placed alike. A width-sharded x takes the width path below where it
  computes the math (Llama's, with a weight, residual_out in x's dtype): each rank adds its columns (FP32,
  one rounding: the fused kernel's sum bit for bit), then the width-sharded norm; backward, its dx plus
  d(residual_out), added in FP32 and rounded once more (as jax_api's path). Otherwise the width is gathered.
- permute_rows(x, idx): the hidden dim sharded (local), or the indices sharded with x replicated (each rank
  gathers its slots; a row-sharded x is all-gathered first: the indices are global).
- unpermute_rows(y, idx): the hidden dim sharded; otherwise replicated (y's rows all-gathered).
- inverse_permutation, generate_permute_indices: replicated (integer inputs, all-gathered if sharded).

A width-sharded x (Shard on the last dim: tensor parallel over the hidden dim) takes its own path, as in
jax_api/sharding.py: each rank sums its columns of each row, one fp32 all-reduce of those [rows] sums over
the mesh dims that split the width, then each rank finishes its columns (the width-sharded kernels,
xkern/rms_norm/width_sharded.py). x is never gathered; w and dw are sharded like the width; dw is summed in fp32
over the mesh dims that shard the rows (one all-reduce), then rounded once to w's dtype: the rounding of
jax_api's path. It is a DTensor op handler (`_custom_op_handlers`, which torch's own `loss_parallel` uses)
on rms_norm_fwd and rms_norm_bwd that hands every other placement to the strategies. It takes the Llama math
with a weight; the other variants (Gemma, OLMo2, no weight) go to the strategies, which gather the width
(as jax_api does for them).

Inside the ops' autograd, inputs move with `redistribute_local_tensor` rather than `DTensor.redistribute`
(an autograd.Function: on torch 2.11 it detaches its result in place there, which DTensor cannot run).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.experimental import register_sharding

import torch_api.add_rms_norm  # noqa: F401  (registers the xkern::* ops)
import torch_api.permute  # noqa: F401
import torch_api.rms_norm  # noqa: F401
from torch_api._launch import dtype_name, launch, rows_view
from xkern.add_rms_norm import add_width_sharded_ok
from xkern.rms_norm import plan_rms_norm_bwd_width_sharded, plan_rms_norm_fwd_width_sharded

_ops = torch.ops.xkern
R = Replicate()


@register_sharding(_ops.rms_norm_fwd.default)
def _rms_norm_fwd(x, weight, eps, variant="llama"):
    w = None if weight is None else R  # no weight: a None input has no placement
    rules = [([R], [R, w, None, None])]
    rules += [([Shard(d)], [Shard(d), w, None, None]) for d in range(x.ndim - 1)]
    return rules


@register_sharding(_ops.rms_norm_bwd.default)
def _rms_norm_bwd(dy, x, weight, eps, variant="llama"):
    w, dw = (None, R) if weight is None else (R, Partial())  # no weight: dw is an empty placeholder
    rules = [([R, R], [R, R, w, None, None])]
    rules += [([Shard(d), dw], [Shard(d), Shard(d), w, None, None]) for d in range(x.ndim - 1)]
    return rules


@register_sharding(_ops.add_rms_norm_fwd.default)
def _add_rms_norm_fwd(x, residual, weight, eps, variant, residual_dtype):
    # as rms_norm_fwd, x and residual placed alike (a width-sharded x: the handler below, or gathered here)
    w = None if weight is None else R
    rules = [([R, R], [R, R, w, None, None, None])]
    rules += [([Shard(d), Shard(d)], [Shard(d), Shard(d), w, None, None, None]) for d in range(x.ndim - 1)]
    return rules


@register_sharding(_ops.add_rms_norm_bwd.default)
def _add_rms_norm_bwd(dy, dres, residual_out, weight, eps, variant, x_dtype):
    w, dw = (None, R) if weight is None else (R, Partial())
    rules = [([R, R], [R, None if dres is None else R, R, w, None, None, None])]
    rules += [([Shard(d), dw], [Shard(d), None if dres is None else Shard(d), Shard(d), w, None, None, None])
              for d in range(residual_out.ndim - 1)]
    return rules


@register_sharding(_ops.permute_rows.default)
def _permute_rows(x, idx):
    return [([R], [R, R]), ([Shard(1)], [Shard(1), R]), ([Shard(0)], [R, Shard(0)])]


@register_sharding(_ops.unpermute_rows.default)
def _unpermute_rows(y, idx, num_rows):
    return [([R], [R, R, None]), ([Shard(1)], [Shard(1), R, None])]


@register_sharding(_ops.inverse_permutation.default)
def _inverse_permutation(idx, num_rows):
    return [([R], [R, None])]


@register_sharding(_ops.generate_permute_indices.default)
def _generate_permute_indices(counts, experts_per_rank, num_ranks, max_len, alignment):
    return [([R, R, R], [R, None, None, None, None])]


# ---------------------------------------------------------------------------------------------------
# Width-sharded RMSNorm


def _width_dims(x: DTensor) -> list[int]:
    """The mesh dims that split x's last dim."""
    return [i for i, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim % x.ndim == x.ndim - 1]


@contextlib.contextmanager
def _strategies_only(op):
    """Dispatch `op` through its sharding strategies (this module's handler set aside)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        yield
    finally:
        handlers[op] = handler


def _dtensor(local: torch.Tensor, mesh, placements, shape) -> DTensor:
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def _local_inputs(x: DTensor, tensors, width: list[int]):
    """x's placements as the kernels take them, w's, and the local blocks: x's rows, and the other tensors
    laid out like x ("x") or like the width ("w": w's slice of it, replicated elsewhere)."""
    # x: Partial is summed first; rows may stay sharded. w: sharded like the width, replicated elsewhere.
    x_places = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    w_places = tuple(Shard(0) if i in width else Replicate() for i in range(x.device_mesh.ndim))
    out = [_local(x, x_places)] + [_local(t, x_places if places == "x" else w_places) for t, places in tensors]
    return x_places, out, w_places


def _local(t: DTensor, placements: tuple) -> torch.Tensor:
    """t's local block under `placements`, moved without autograd (see the module's docstring)."""
    if t.placements == placements:
        return t._local_tensor
    target = DTensorSpec(t.device_mesh, placements, tensor_meta=t._spec.tensor_meta)
    return redistribute_local_tensor(t._local_tensor, t._spec, target)


def _all_reduce(t: torch.Tensor, mesh, dims: list[int]) -> torch.Tensor:
    for d in dims:
        dist.all_reduce(t, group=mesh.get_group(d))
    return t


def _width_path(x, weight, variant_args, kwargs) -> list[int]:
    """The mesh dims that split x's width when the width-sharded kernels take the call; otherwise [] and
    the strategies take it (gathering the width). The ops' `variant` is check_variant's ("none" without a
    weight), "llama" when left out."""
    variant = variant_args[0] if variant_args else kwargs.get("variant", "llama")
    # Llama's math only here (jax_api's width-sharded path takes every variant; DTensor's others gather)
    return _width_dims(x) if variant == "llama" and weight is not None else []


def _rms_norm_fwd_handler(op_call, args, kwargs):
    x, weight, eps, *variant = args
    width = _width_path(x, weight, variant, kwargs)
    if not width:
        with _strategies_only(op_call):
            return op_call(*args, **kwargs)
    x_places, (xl, wl), _ = _local_inputs(x, [(weight, "w")], width)
    n_cols = xl.shape[-1]
    x2 = rows_view(xl)
    n_rows = x2.shape[0]
    y = torch.empty(xl.shape, dtype=xl.dtype if wl.dtype == xl.dtype else torch.float32, device=xl.device)
    if x2.numel():
        sums, norm = plan_rms_norm_fwd_width_sharded(n_rows, n_cols, eps, (x2.stride(0), n_cols))
        scalars = dict(n_rows=n_rows, n_cols=n_cols, n_total=x.shape[-1], x_row_stride=x2.stride(0),
                       y_row_stride=n_cols)
        sum_sq = torch.empty(n_rows, dtype=torch.float32, device=xl.device)
        launch(sums, x2, sum_sq, **scalars)
        launch(norm, x2, wl, _all_reduce(sum_sq, x.device_mesh, width), y, **scalars)
    return _dtensor(y, x.device_mesh, x_places, x.shape)


def _rms_norm_bwd_handler(op_call, args, kwargs):
    dy, x, weight, eps, *variant = args
    width = _width_path(x, weight, variant, kwargs)
    if not width:
        with _strategies_only(op_call):
            return op_call(*args, **kwargs)
    x_places, (xl, dyl, wl), w_places = _local_inputs(x, [(dy, "x"), (weight, "w")], width)
    mesh, n_cols = x.device_mesh, xl.shape[-1]
    x2, dy2 = rows_view(xl), rows_view(dyl)
    n_rows = x2.shape[0]
    dx = torch.empty(xl.shape, dtype=xl.dtype, device=xl.device)
    dw = torch.zeros(n_cols, dtype=torch.float32, device=xl.device)
    if x2.numel():
        plan = plan_rms_norm_bwd_width_sharded(n_rows, n_cols, eps, (x2.stride(0), dy2.stride(0), n_cols))
        scalars = dict(n_rows=n_rows, n_cols=n_cols, n_total=x.shape[-1], x_row_stride=x2.stride(0),
                       dy_row_stride=dy2.stride(0), dx_row_stride=n_cols)
        sums = torch.empty((n_rows, 2), dtype=torch.float32, device=xl.device)
        stats = torch.empty_like(sums)
        launch(plan.sums, x2, wl, dy2, sums, **scalars)
        launch(plan.finish, _all_reduce(sums, mesh, width), stats, **scalars)
        partial = torch.empty((plan.n_partials, n_cols), dtype=torch.float32, device=xl.device)
        launch(plan.bwd, x2, wl, dy2, stats, dx, partial, **scalars)
        launch(plan.reduce, partial, dw, n_partials=plan.n_partials, n_cols=n_cols)
    # dw of this rank's rows, in fp32, summed over the mesh dims that shard the rows, then w's dtype once
    # (as jax_api's width-sharded path)
    rows = [i for i, p in enumerate(x_places) if isinstance(p, Shard) and i not in width]
    dw = _all_reduce(dw, mesh, rows).to(wl.dtype)
    return (_dtensor(dx, mesh, x_places, x.shape), _dtensor(dw, mesh, w_places, weight.shape))


def _add_rms_norm_fwd_handler(op_call, args, kwargs):
    x, residual, weight, eps, variant, residual_dtype = args
    width = _width_dims(x) if add_width_sharded_ok(variant, dtype_name(x.dtype), residual_dtype) else []
    if not width:
        with _strategies_only(op_call):
            return op_call(*args, **kwargs)
    x_places, (xl, rl), _ = _local_inputs(x, [(residual, "x")], width)
    s = _dtensor((xl.float() + rl.float()).to(getattr(torch, residual_dtype)), x.device_mesh, x_places, x.shape)
    return _rms_norm_fwd_handler(_ops.rms_norm_fwd.default, (s, weight, eps, "llama"), {}), s


def _add_rms_norm_bwd_handler(op_call, args, kwargs):
    dy, dres, residual_out, weight, eps, variant, x_dtype = args
    width = _width_dims(residual_out) if add_width_sharded_ok(variant, x_dtype, dtype_name(residual_out.dtype)) \
        else []
    if not width:
        with _strategies_only(op_call):
            return op_call(*args, **kwargs)
    dx, dw = _rms_norm_bwd_handler(_ops.rms_norm_bwd.default, (dy, residual_out, weight, eps, "llama"), {})
    if dres is None:
        return dx, dw
    dsum = (dx._local_tensor.float() + _local(dres, dx.placements).float()).to(dx.dtype)
    return _dtensor(dsum, dx.device_mesh, dx.placements, dx.shape), dw


DTensor._op_dispatcher._custom_op_handlers.update({_ops.rms_norm_fwd.default: _rms_norm_fwd_handler,
                                                    _ops.rms_norm_bwd.default: _rms_norm_bwd_handler,
                                                    _ops.add_rms_norm_fwd.default: _add_rms_norm_fwd_handler,
                                                    _ops.add_rms_norm_bwd.default: _add_rms_norm_bwd_handler})
