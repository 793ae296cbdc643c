"""Expert-parallel dispatch/combine for MoE over `torch.distributed`, around the xkern permute ops.

    xp, m_sizes, m_offsets, handle = ep_dispatch(x, topk_ids, num_experts, group)
    yp = grouped_gemm(xp, m_sizes, m_offsets)          # the user's experts, one aligned block per expert
    out = ep_combine(yp, topk_weights, handle)         # out[t] = sum_k w[t, k] * yp[row of (t, k)]

Experts are sharded contiguously: rank r of the group owns experts [r * E_local, (r + 1) * E_local).
Dispatch: the T*K (token, k) assignments are sorted by destination expert (a stable argsort, so
destination rank-major, then expert, then (t, k) order), the per-expert counts go out with one
`all_to_all_single`, the rows follow with another, and the received rows (source rank-major, then
expert) are laid out expert-major and padded with `generate_permute_indices` + `permute_rows`. Combine
runs the same steps backwards with `unpermute_rows` and the reverse all-to-all, the last of them the
weighted top-k combine (`unpermute_rows(..., top_k=K, probs=topk_weights)`, FP32).

Host syncs: one per dispatch, the `.tolist()` of the sent and received counts, because the row
all-to-all needs its split sizes on the host (and the padded buffer its length). Combine has none.
Differentiable end to end in x, topk_weights and the expert outputs: the row all-to-all is an autograd
Function whose backward is the reverse all-to-all; the permutes' backwards are the xkern gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_api.permute import generate_permute_indices, permute_rows, unpermute_rows
from xkern.ep import check_dispatch, check_topk_range


@dataclass
class EPHandle:
    """What `ep_combine` needs to undo a dispatch."""

    permuted_indices: torch.Tensor  # [max_len]: received row of each padded slot, -1 at padding
    order: torch.Tensor             # [T*K]: (t*K + k) of each sent row, in send order
    send_splits: list[int]          # rows sent to each rank of the group
    recv_splits: list[int]          # rows received from each rank
    num_tokens: int
    top_k: int
    group: object = None


_PROBS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _AllToAllRows(torch.autograd.Function):
    """Rows of x (split by in_splits) to the ranks of the group; the backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def ep_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, group=None, alignment: int = 16,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle]:
    """Send each token's rows to the ranks owning its top-k experts; lay them out expert-major, padded.

    x: [T, H] float16/bfloat16/float32 (T may be 0). topk_ids: [T, K] integer global expert ids in
    [0, num_experts); num_experts must be a multiple of the group size. Returns `(xp, m_sizes, m_offsets,
    handle)`: xp [max_len, H], one block per local expert of m_sizes[e] = roundup(max(n_e, alignment),
    alignment) rows (n_e = rows received for it, ordered by source rank, then (t, k)), zero rows at
    padding; m_offsets the inclusive cumsum (both int32, the layout of `generate_permute_indices`).
    One host sync (the counts' `.tolist()`), which the row all-to-all's split sizes need. Ids outside
    [0, num_experts) on any rank: every rank raises ValueError (the ids' range travels with the counts, so
    no rank is left waiting in the row all-to-all).
    """
    world = dist.get_world_size(group)
    ids_integer = not (topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool)
    num_experts, alignment = check_dispatch(tuple(x.shape), tuple(topk_ids.shape), str(topk_ids.dtype), ids_integer,
                                            num_experts, world, alignment)
    experts_local = num_experts // world
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    # Stable: within an expert, rows keep (t, k) order, so the layout is deterministic.
    order = torch.argsort(flat, stable=True)
    # Per destination rank: its experts' counts, then this rank's smallest and largest id (checked after the
    # sync; the clamp only keeps bincount defined until then).
    id_range = torch.stack([flat.min(), flat.max()]) if flat.numel() else flat.new_tensor([0, -1])
    send_counts = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts)
    send_table = torch.cat([send_counts.view(world, experts_local), id_range.expand(world, 2)], 1)
    recv_table = torch.empty_like(send_table)
    dist.all_to_all_single(recv_table, send_table, group=group)  # row r: from rank r
    recv_counts = recv_table[:, :experts_local].reshape(-1)  # recv[r * E_local + e]: from rank r
    # The one host sync: split sizes (and the padded length) must be known on the host.
    host = torch.cat([send_table, recv_table]).tolist()
    send_host, recv_table_host = host[:world], host[world:]
    rank = dist.get_rank(group)
    for r, row in enumerate(recv_table_host):
        check_topk_range(row[-2], row[-1], num_experts, "" if r == rank else f" (on rank {r} of the group)")
    send_splits = [sum(row[:experts_local]) for row in send_host]
    recv_host = [c for row in recv_table_host for c in row[:experts_local]]
    recv_splits = [sum(row[:experts_local]) for row in recv_table_host]
    per_expert = [sum(recv_host[r * experts_local + e] for r in range(world)) for e in range(experts_local)]
    max_len = sum(-(-max(n, alignment) // alignment) * alignment for n in per_expert)

    # Straight from the token rows: send slot s reads token order[s] // top_k (no [T * K, H] copy); the
    # backward sums each token's K row gradients in FP32.
    send = permute_rows(x, order, top_k=top_k)
    recv = _AllToAllRows.apply(send, recv_splits, send_splits, group)
    idx, m_sizes, m_offsets = generate_permute_indices(recv_counts, experts_local, world, max_len, alignment)
    xp = permute_rows(recv, idx)
    handle = EPHandle(idx, order, send_splits, recv_splits, num_tokens, top_k, group)
    return xp, m_sizes, m_offsets, handle


def ep_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, handle: EPHandle) -> torch.Tensor:
    """Return expert outputs to their tokens: `out[t] = sum_k w[t, k] * expert_out[slot of (t, k)]`.

    expert_out: [max_len, H'] in the layout `ep_dispatch` returned (padding rows are never read).
    topk_weights: [T, K] (float64 is taken as float32). Returns [T, H'] in expert_out's dtype, summed in
    FP32 and rounded once. No host sync.
    """
    h = handle
    if topk_weights.shape != (h.num_tokens, h.top_k):
        raise ValueError(f"topk_weights must be [{h.num_tokens}, {h.top_k}], got {list(topk_weights.shape)}")
    recv = unpermute_rows(expert_out, h.permuted_indices, sum(h.recv_splits))
    back = _AllToAllRows.apply(recv, h.send_splits, h.recv_splits, h.group)
    # The weighted combine: FP32 sum of the K weighted rows in k order, rounded once; the weights'
    # gradient comes from the same kernel family (no atomics).
    weights = topk_weights if topk_weights.dtype in _PROBS_DTYPES else topk_weights.float()
    return unpermute_rows(back, h.order, h.num_tokens * h.top_k, top_k=h.top_k, probs=weights)
