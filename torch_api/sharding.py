"""DTensor sharding strategies for the `xkern::*` torch ops, so DTensor inputs run the kernels per shard.

Registered with `torch.distributed.tensor.experimental.register_sharding` on the ops (the eager fast path for
plain tensors bypasses them; tensor subclasses such as DTensor always dispatch through them). For each op,
the placements it accepts on one mesh dim (DTensor expands them over every mesh dim, and redistributes an
input whose placement is not among them, e.g. all-gathers it):

- rms_norm_fwd(x, w): all replicated, or x sharded on a row dim (any but the last: sequence parallel as
  torchtitan's `SequenceParallel` uses it) with w replicated; y sharded like x.
- rms_norm_bwd(dy, x, w): likewise; dw is `Partial()` (each rank's dw of its rows, in w's dtype), summed
  when DTensor reduces it (all-reduce: dw rounds once more than on one device, per rank, before the sum).
- permute_rows(x, idx): the hidden dim sharded (local), or the indices sharded with x replicated (each rank
  gathers its slots; a row-sharded x is all-gathered first: the indices are global).
- unpermute_rows(y, idx): the hidden dim sharded; otherwise replicated (y's rows all-gathered).
- inverse_permutation, generate_permute_indices: replicated (integer inputs, all-gathered if sharded).

A width-sharded x (Shard on the last dim) is not among rms_norm's placements: DTensor all-gathers the
width and each rank normalises whole rows.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import torch_api.permute  # noqa: F401  (registers the xkern::* ops)
import torch_api.rms_norm  # noqa: F401

_ops = torch.ops.xkern
R = Replicate()


@register_sharding(_ops.rms_norm_fwd.default)
def _rms_norm_fwd(x, weight, eps):
    rules = [([R], [R, R, None])]
    rules += [([Shard(d)], [Shard(d), R, None]) for d in range(x.ndim - 1)]
    return rules


@register_sharding(_ops.rms_norm_bwd.default)
def _rms_norm_bwd(dy, x, weight, eps):
    rules = [([R, R], [R, R, R, None])]
    rules += [([Shard(d), Partial()], [Shard(d), Shard(d), R, None]) for d in range(x.ndim - 1)]
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
