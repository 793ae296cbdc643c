"""Padded expert row gather for MoE in PyTorch: `generate_permute_indices`, `permute_rows`,
`inverse_permutation`, `unpermute_rows`, and the `xkern::*` ops behind them.

The ops are registered with `torch.library` (fake implementations included) so `torch.compile(
fullgraph=True)` traces them. The backward of `permute_rows` is `unpermute_rows` and vice versa (a gather
through the inverse permutation, never a scatter-add), so gradients of any order are these same ops.
Contract and kernels: see `xkern/permute.py`.
"""

from __future__ import annotations

import torch

from torch_api._launch import check_device, launch
from xkern.permute import (
    check_counts,
    check_gather_sizes,
    check_int,
    check_layout,
    check_permutation,
    plan_gather_rows,
    plan_generate_indices,
    plan_inverse,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INDEX = (torch.int32, torch.int64)


def _gather(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = x[idx[i]] (zero row at -1) into the contiguous `out` [len(idx), H]."""
    if out.numel() == 0:
        return out
    if x.shape[0] == 0:  # zero tokens: every valid slot is padding
        return out.zero_()
    if x.stride(1) != 1 and x.shape[1] > 1:  # rows need a contiguous last dim; any row stride is fine
        x = x.contiguous()
    idx = idx.contiguous()
    plan = plan_gather_rows(out.shape[0], out.shape[1], x.element_size(), x.stride(0))
    launch(plan, x, idx, out, n_rows=out.shape[0], n_cols=out.shape[1], n_src_rows=x.shape[0],
           src_row_stride=x.stride(0))
    return out


def _inverse(idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    inv = torch.empty(num_rows, dtype=idx.dtype, device=idx.device)
    if num_rows == 0:
        return inv
    if idx.shape[0] == 0:
        return inv.fill_(-1)
    scatter, settle = plan_inverse(idx.shape[0], num_rows)
    idx = idx.contiguous()
    raw = torch.empty_like(inv)
    launch(scatter, idx, raw, n_slots=idx.shape[0], n_rows=num_rows)
    launch(settle, idx, raw, inv, n_slots=idx.shape[0], n_rows=num_rows)
    return inv


@torch.library.custom_op("xkern::generate_permute_indices", mutates_args=())
def _generate_op(counts: torch.Tensor, experts_per_rank: int, num_ranks: int, max_len: int,
                 alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = counts.device
    counts = counts.contiguous()
    out = torch.empty(max_len, dtype=torch.int32, device=dev)
    m_sizes = torch.empty(experts_per_rank, dtype=torch.int32, device=dev)
    m_offsets = torch.empty(experts_per_rank, dtype=torch.int32, device=dev)
    row_start = torch.empty(counts.shape[0], dtype=torch.int32, device=dev)
    rank_begin = torch.empty(counts.shape[0], dtype=torch.int32, device=dev)
    sizes, fill = plan_generate_indices(experts_per_rank, num_ranks, max_len)
    launch(sizes, counts, m_sizes, m_offsets, row_start, rank_begin, n_experts=experts_per_rank,
           n_ranks=num_ranks, alignment=alignment)
    if max_len:
        launch(fill, counts, m_sizes, m_offsets, row_start, rank_begin, out, max_len=max_len,
               n_experts=experts_per_rank, n_ranks=num_ranks)
    return out, m_sizes, m_offsets


@_generate_op.register_fake
def _(counts, experts_per_rank, num_ranks, max_len, alignment):
    return (counts.new_empty(max_len, dtype=torch.int32), counts.new_empty(experts_per_rank, dtype=torch.int32),
            counts.new_empty(experts_per_rank, dtype=torch.int32))


@torch.library.custom_op("xkern::permute_rows", mutates_args=())
def _permute_op(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _gather(x, idx, torch.empty((idx.shape[0], x.shape[1]), dtype=x.dtype, device=x.device))


@_permute_op.register_fake
def _(x, idx):
    return x.new_empty((idx.shape[0], x.shape[1]))


@torch.library.custom_op("xkern::inverse_permutation", mutates_args=())
def _inverse_op(idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    return _inverse(idx, num_rows)


@_inverse_op.register_fake
def _(idx, num_rows):
    return idx.new_empty(num_rows)


@torch.library.custom_op("xkern::unpermute_rows", mutates_args=())
def _unpermute_op(y: torch.Tensor, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = torch.empty((num_rows, y.shape[1]), dtype=y.dtype, device=y.device)
    return _gather(y, _inverse(idx, num_rows), out)


@_unpermute_op.register_fake
def _(y, idx, num_rows):
    return y.new_empty((num_rows, y.shape[1]))


def _save_idx(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.num_rows = inputs[0].shape[0]


def _permute_backward(ctx, dout):
    (idx,) = ctx.saved_tensors
    return torch.ops.xkern.unpermute_rows(dout, idx, ctx.num_rows), None


def _unpermute_backward(ctx, dout):
    (idx,) = ctx.saved_tensors
    return torch.ops.xkern.permute_rows(dout, idx), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_save_idx)
_unpermute_op.register_autograd(_unpermute_backward, setup_context=_save_idx)


# ---------------------------------------------------------------------------------------------------
# Public functions: argument checks, then the ops.


def _check_rows(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, hidden], got shape {list(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    check_device(name, x)


def _check_index(name: str, idx, like: torch.Tensor | None = None) -> None:
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _INDEX:
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(idx.shape)}")
    check_device(name, idx, like=like)


def generate_permute_indices(tokens_per_expert_group: torch.Tensor, experts_per_rank: int, num_ranks: int,
                             max_len: int, alignment: int, validate: bool = False,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's padded, expert-major layout, computed on the device (no host sync).

    tokens_per_expert_group: [num_ranks * experts_per_rank] int32/int64, rank-major (`r * E + e`); rows
    arrive in that order. Returns `(permuted_indices [max_len] int32, m_sizes [E] int32, m_offsets [E]
    int32)`: m_sizes[e] = roundup(max(sum_r counts[r, e], alignment), alignment), m_offsets its inclusive
    cumsum, permuted_indices[s] the source row of slot s (rank, then arrival order inside an expert's
    block) or -1 at padding / past the last block. Rows whose slot is >= max_len are dropped; with
    `validate=True` (one host sync) that, or a negative count, is a ValueError. alignment must be >= 1.
    """
    counts = tokens_per_expert_group
    _check_index("tokens_per_expert_group", counts)
    experts_per_rank, num_ranks, max_len, alignment = check_layout(counts.shape[0], experts_per_rank, num_ranks,
                                                                   max_len, alignment)
    if validate:
        check_counts(counts.detach().cpu().numpy(), experts_per_rank, alignment, max_len)
    return torch.ops.xkern.generate_permute_indices(counts, experts_per_rank, num_ranks, max_len, alignment)


def permute_rows(x: torch.Tensor, permuted_indices: torch.Tensor, validate: bool = False) -> torch.Tensor:
    """`out[i] = x[permuted_indices[i]]`, a zero row where the index is -1: [len(permuted_indices), H].

    x: [num_rows, H] float16/bfloat16/float32 (any row stride; the last dim is read in place when
    contiguous). permuted_indices: int32/int64, -1 or a row of x. Differentiable in x: dx = dout gathered
    through the inverse permutation (`unpermute_rows`). `validate=True` (host sync) checks the valid
    entries are a one-to-one map onto 0..num_rows-1; without it an out-of-range entry reads a zero row.
    """
    _check_rows("x", x)
    _check_index("permuted_indices", permuted_indices, like=x)
    check_gather_sizes(permuted_indices.shape[0])
    if validate:
        check_permutation(permuted_indices.detach().cpu().numpy(), x.shape[0])
    return torch.ops.xkern.permute_rows(x, permuted_indices)


def inverse_permutation(permuted_indices: torch.Tensor, num_rows: int, validate: bool = False) -> torch.Tensor:
    """`inv[permuted_indices[i]] = i` for valid slots, -1 for rows no slot names: [num_rows], the
    index dtype. With duplicates (validate=False) one of the slots wins."""
    _check_index("permuted_indices", permuted_indices)
    num_rows = check_int("num_rows", num_rows)
    check_gather_sizes(permuted_indices.shape[0], num_rows)
    if validate:
        check_permutation(permuted_indices.detach().cpu().numpy(), num_rows)
    return torch.ops.xkern.inverse_permutation(permuted_indices, num_rows)


def unpermute_rows(y: torch.Tensor, permuted_indices: torch.Tensor, num_rows: int,
                   validate: bool = False) -> torch.Tensor:
    """`out[r] = y[inv[r]]` with `inv = inverse_permutation(permuted_indices, num_rows)`: [num_rows, H],
    a zero row for rows no slot names; padding rows of y are never read. Differentiable in y: dy =
    permute_rows(dout, permuted_indices) (zero at padding). `validate=True` as in `permute_rows`."""
    _check_rows("y", y)
    _check_index("permuted_indices", permuted_indices, like=y)
    num_rows = check_int("num_rows", num_rows)
    if permuted_indices.shape[0] != y.shape[0]:
        raise ValueError(f"y must have one row per slot of permuted_indices ({permuted_indices.shape[0]}), "
                         f"got {y.shape[0]}")
    check_gather_sizes(permuted_indices.shape[0], num_rows)
    if validate:
        check_permutation(permuted_indices.detach().cpu().numpy(), num_rows)
    return torch.ops.xkern.unpermute_rows(y, permuted_indices, num_rows)
