"""Expert-parallel dispatch/combine for MoE in JAX, for use inside `jax.shard_map`, around the xkern ops.

    def step(x, topk_ids, topk_weights):                  # per shard, inside shard_map over axis "ep"
        xp, m_sizes, m_offsets, handle = ep_dispatch(x, topk_ids, num_experts, "ep", capacity)
        yp = experts(xp, m_sizes, m_offsets)
        return ep_combine(yp, topk_weights, handle)

Same layout as torch_api.ep (rank r owns experts [r * E_local, (r + 1) * E_local); blocks from
`generate_permute_indices`), but with static shapes: each shard sends a fixed `capacity` rows to every
rank through `jax.lax.all_to_all` (tiled), so no host sync at all; the exchanged per-expert counts
travel in a second all_to_all and say which received rows are real. Rows past `capacity` for one
destination rank are dropped (they contribute zero to the combined output, and get zero gradient).
`ragged_all_to_all` would avoid the padding, but XLA's CPU backend does not implement it, and the
fixed-capacity form also runs on GPUs. Differentiable in x and the routing weights, forward and reverse, under
shard_map's default check_vma=True: all_to_all transposes to the reverse all_to_all, the permutes and the
combine are linear gathers whose transposes are each other (jax_api/permute.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax_api.permute import generate_permute_indices, permute_rows, unpermute_rows
from xkern.ep import check_dispatch, check_topk_range
from xkern.launch import FLOATS, check_int, check_row_count


@dataclass(frozen=True)
class EPHandle:
    """What `ep_combine` needs (use it inside the same shard_map'ed function as the dispatch)."""

    permuted_indices: jax.Array  # [max_len]: received-buffer row of each padded slot, -1 at padding
    send_indices: jax.Array      # [world * capacity]: (t*K + k) of each sent row, -1 at padding
    axis_name: str


def ep_dispatch(x, topk_ids, num_experts: int, axis_name: str, capacity: int, alignment: int = 16,
                max_len: int | None = None, validate: bool = False):
    """Send each token's rows to the ranks owning its top-k experts; lay them out expert-major, padded.

    x: [T, H] per shard; topk_ids: [T, K] integer global expert ids in [0, num_experts). capacity: rows
    sent to each rank (T * K never drops). Returns `(xp [max_len, H], m_sizes [E_local], m_offsets
    [E_local], handle)`, blocks as in `generate_permute_indices`, zero rows at padding and past the last
    block. max_len defaults to the bound world * capacity + E_local * alignment, which every layout fits.
    Ids are traced here (inside shard_map), so a Python error cannot depend on them: a row whose id is
    outside [0, num_experts) goes to no expert (dropped, like a row past capacity), and `validate=True`
    adds a host callback that fails the computation with xkern.ep's ValueError message naming topk_ids.
    """
    world = jax.lax.axis_size(axis_name)
    num_experts, alignment = check_dispatch(
        tuple(x.shape), tuple(topk_ids.shape), str(topk_ids.dtype), jnp.issubdtype(topk_ids.dtype, jnp.integer),
        num_experts, world, alignment)
    capacity = check_int("capacity", capacity)
    check_row_count("capacity", world * capacity, "rows to send (world * capacity)")
    e_local = num_experts // world
    num_tokens, top_k = topk_ids.shape
    max_len = world * capacity + e_local * alignment if max_len is None else check_int("max_len", max_len)

    ids = topk_ids.reshape(-1)
    if validate and ids.size:
        jax.debug.callback(lambda lo, hi: check_topk_range(int(lo), int(hi), num_experts), ids.min(), ids.max())
    # An out-of-range id goes to no rank: num_experts sorts after every real id and is no expert's count.
    flat = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # destination rank, expert, then (t, k)
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1, mode="drop").reshape(world, e_local)
    wanted = counts.sum(1)  # rows for each destination rank before capacity
    start = jnp.cumsum(wanted) - wanted
    # Keep the first `capacity` rows per destination; clip the per-expert counts to what is sent.
    before = jnp.cumsum(counts, axis=1) - counts
    counts = jnp.clip(capacity - before, 0, counts)
    per_rank = counts.sum(1)
    j = jnp.arange(capacity)
    pos = (start[:, None] + j[None, :]).reshape(-1)
    send_idx = jnp.where((j[None, :] < per_rank[:, None]).reshape(-1),
                         order[jnp.clip(pos, 0, max(num_tokens * top_k - 1, 0))], -1).astype(jnp.int32)

    # [world * capacity, H] straight from the token rows (slot s reads token send_idx[s] // top_k), zero rows
    # past each rank's count
    send = permute_rows(x, send_idx, top_k=top_k)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # block s: from rank s
    recv_counts = jax.lax.all_to_all(counts.reshape(-1), axis_name, 0, 0, tiled=True)  # [s * E_local + e]

    # The layout indexes rows as if they arrived densely; map them to the fixed-capacity blocks.
    dense, m_sizes, m_offsets = generate_permute_indices(recv_counts, e_local, world, max_len, alignment)
    recv_per_rank = recv_counts.reshape(world, e_local).sum(1)
    dense_start = jnp.cumsum(recv_per_rank) - recv_per_rank
    src = jnp.clip(jnp.searchsorted(dense_start, dense, side="right") - 1, 0, world - 1)
    idx = jnp.where(dense >= 0, src * capacity + dense - dense_start[src], -1).astype(jnp.int32)
    xp = permute_rows(recv, idx)
    return xp, m_sizes, m_offsets, EPHandle(idx, send_idx, axis_name)


def ep_combine(expert_out, topk_weights, handle: EPHandle):
    """`out[t] = sum_k w[t, k] * expert_out[slot of (t, k)]` (zero for dropped rows): [T, H'],
    summed in FP32 and rounded once (the weighted top-k combine of `unpermute_rows`)."""
    num_tokens, top_k = topk_weights.shape
    recv = unpermute_rows(expert_out, handle.permuted_indices, handle.send_indices.shape[0])
    back = jax.lax.all_to_all(recv, handle.axis_name, 0, 0, tiled=True)
    weights = topk_weights if topk_weights.dtype.name in FLOATS else topk_weights.astype(jnp.float32)
    return unpermute_rows(back, handle.send_indices, num_tokens * top_k, top_k=top_k, probs=weights)
