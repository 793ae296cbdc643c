"""Padded expert row gather for MoE in PyTorch: `generate_permute_indices`, `topk_permute_indices`,
`permute_rows`, `inverse_permutation`, `unpermute_rows`, and the `xkern::*` ops behind them.

Eager calls on plain tensors launch the recipes directly (executors cached per call signature,
`torch_api._launch.cached`, the arguments checked on a miss; autograd through `_Permute` and `_Unpermute`).
Everything else (torch.compile, export, DTensor) goes through the registered ops, fake implementations
included, with the same autograd. The backward of `permute_rows` is `unpermute_rows` and vice versa (a gather
through the inverse permutation, never a scatter-add), so gradients of any order are these same ops. Which
form of unpermute_rows runs (the gather, the copy-sum, the weighted combine) is the core's
`unpermute_recipe`'s choice. Contract and kernels: see `xkern/permute/`.
"""

from __future__ import annotations

import torch

from torch_api._launch import (
    Executor,
    cached,
    check_device,
    check_tensor,
    direct_or_batched,
    dtype_name,
    dtype_or_none,
    forward_mode,
    functorch_active,
    loop_vmap,
    raw_apply,
    register_op,
    run_recipe,
    signature,
    traced,
)
from xkern.launch import check_int
from xkern.permute import (
    check_counts,
    check_expert_ids,
    check_index,
    check_layout,
    check_permutation,
    check_route,
    check_rows,
    check_top_k,
    check_unpermute,
    combine_bwd_recipe,
    generate_recipe,
    inverse_recipe,
    layout_ints,
    permute_recipe,
    route_ints,
    route_recipe,
    unpermute_recipe,
)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # Rows need a contiguous last dim; any row stride is fine.
    return x.contiguous() if x.stride(1) != 1 and x.shape[1] > 1 else x


# int(): the plans depend on the shapes, so a compiled graph specializes on them. `x`, `y`, `dout`: as `_rows`
# gives them.
def _permute_recipe(x, idx, top_k: int = 1):
    return permute_recipe(int(idx.shape[0]), int(x.shape[1]), int(x.shape[0]), dtype_name(x.dtype), int(x.stride(0)),
                          top_k, dtype_name(idx.dtype))


def _unpermute_recipe(y, idx, num_rows: int, top_k: int = 1, probs=None):
    return unpermute_recipe(int(idx.shape[0]), int(y.shape[1]), num_rows, dtype_name(y.dtype), int(y.stride(0)),
                            dtype_name(idx.dtype), top_k, dtype_or_none(probs))


def _combine_grads_recipe(dout, y, idx, probs, num_rows, top_k):
    return combine_bwd_recipe(int(idx.shape[0]), int(y.shape[1]), num_rows, dtype_name(y.dtype), int(dout.stride(0)),
                              int(y.stride(0)), top_k, dtype_name(probs.dtype), dtype_name(idx.dtype))


# ---------------------------------------------------------------------------------------------------
# Argument checks: the core's rules on each call of the registered ops, on a cache miss in eager.


def _check_rows(name: str, x) -> None:
    check_tensor(name, x)
    check_rows(name, dtype_name(x.dtype), tuple(x.shape))
    check_device(name, x)


def _check_index(name: str, idx, like: torch.Tensor | None = None) -> None:
    check_tensor(name, idx)
    check_index(name, dtype_name(idx.dtype), tuple(idx.shape))
    check_device(name, idx, like=like)


def _check_route(ids, num_experts: int, max_len: int | None, alignment: int) -> tuple[int, int, int, int]:
    check_device("expert_ids", ids)
    return check_route(dtype_name(ids.dtype), tuple(ids.shape), num_experts, max_len, alignment)


def _check_permute(x, idx) -> None:
    _check_rows("x", x)
    _check_index("permuted_indices", idx, like=x)


def _check_unpermute(y, idx, num_rows: int, top_k: int = 1, probs=None) -> None:
    _check_rows("y", y)
    _check_index("permuted_indices", idx, like=y)
    if probs is not None:
        check_tensor("probs", probs)
    check_unpermute(tuple(y.shape), tuple(idx.shape), num_rows, top_k, dtype_or_none(probs),
                    None if probs is None else tuple(probs.shape))
    if probs is not None:
        check_device("probs", probs, like=y)


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile, export, DTensor, fake tensors. permute_rows and unpermute_rows (top_k 1, no
# probs) have DTensor rules (torch_api/sharding.py); the top_k forms are ops of their own.


def _index_tables(t: torch.Tensor, max_len: int, n_experts: int):
    """(permuted_indices [max_len], m_sizes [E], m_offsets [E]), int32, unwritten: the index ops' fake results."""
    return tuple(t.new_empty((n,), dtype=torch.int32) for n in (max_len, n_experts, n_experts))


@register_op("xkern::generate_permute_indices",
             lambda counts, experts_per_rank, num_ranks, max_len, alignment: _index_tables(counts, max_len,
                                                                                             experts_per_rank))
def _generate_op(counts: torch.Tensor, experts_per_rank: int, num_ranks: int, max_len: int,
                 alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recipe = generate_recipe(experts_per_rank, num_ranks, max_len, alignment)
    idx, m_sizes, m_offsets = run_recipe(recipe, counts.device, counts=counts.contiguous())
    return idx, m_sizes, m_offsets


@register_op("xkern::topk_permute_indices",
             lambda ids, num_experts, max_len, alignment: _index_tables(ids, max_len, num_experts))
def _route_op(ids: torch.Tensor, num_experts: int, max_len: int,
              alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recipe = route_recipe(int(ids.numel()), num_experts, max_len, alignment)
    idx, m_sizes, m_offsets = run_recipe(recipe, ids.device, ids=ids.contiguous().reshape(-1))
    return idx, m_sizes, m_offsets


@register_op("xkern::inverse_permutation", lambda idx, num_rows: idx.new_empty((num_rows,)))
def _inverse_op(idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    (inv,) = run_recipe(inverse_recipe(int(idx.shape[0]), num_rows, dtype_name(idx.dtype)), idx.device,
                        idx=idx.contiguous())
    return inv


def _run_permute(x, idx, top_k):
    x = _rows(x)
    (out,) = run_recipe(_permute_recipe(x, idx, top_k), x.device, x=x, idx=idx.contiguous())
    return out


def _run_unpermute(y, idx, num_rows, top_k, probs):
    y = _rows(y)
    inputs = dict(y=y, idx=idx.contiguous()) if probs is None else dict(y=y, idx=idx.contiguous(),
                                                                         probs=probs.contiguous())
    (out,) = run_recipe(_unpermute_recipe(y, idx, num_rows, top_k, probs), y.device, **inputs)
    return out


def _rows_fake(n_rows, like: torch.Tensor):
    return like.new_empty((n_rows, like.shape[1]))


@register_op("xkern::permute_rows", lambda x, idx: _rows_fake(idx.shape[0], x))
def _permute_op(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _run_permute(x, idx, 1)


@register_op("xkern::permute_token_rows", lambda x, idx, top_k: _rows_fake(idx.shape[0], x))
def _permute_token_op(x: torch.Tensor, idx: torch.Tensor, top_k: int) -> torch.Tensor:
    return _run_permute(x, idx, top_k)


@register_op("xkern::unpermute_rows", lambda y, idx, num_rows: _rows_fake(num_rows, y))
def _unpermute_op(y: torch.Tensor, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    return _run_unpermute(y, idx, num_rows, 1, None)


@register_op("xkern::combine_rows", lambda y, idx, num_rows, top_k, probs: _rows_fake(num_rows // top_k, y))
def _combine_op(y: torch.Tensor, idx: torch.Tensor, num_rows: int, top_k: int,
                probs: torch.Tensor | None) -> torch.Tensor:
    return _run_unpermute(y, idx, num_rows, top_k, probs)


@register_op("xkern::combine_rows_bwd",
             lambda dout, y, idx, probs, num_rows, top_k: (y.new_empty(y.shape), probs.new_empty(probs.shape)))
def _combine_bwd_op(dout: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor, num_rows: int,
                    top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    dout, y = _rows(dout), _rows(y)
    dy, dprobs = run_recipe(_combine_grads_recipe(dout, y, idx, probs, num_rows, top_k), y.device, dout=dout, y=y,
                            idx=idx.contiguous(), probs=probs.contiguous())
    return dy, dprobs.view(probs.shape)


# ---------------------------------------------------------------------------------------------------
# Autograd, one set of rules for the registered ops and the eager Functions (which add forward mode):
# permute's backward is unpermute (the gather, or the copy-sum with top_k) and vice versa without probs; with
# probs, the combine's backward kernel. Both bilinear forms' derivatives are these same ops.


def _save(ctx, tensors, num_rows: int, top_k: int):
    ctx.save_for_backward(*tensors)
    if forward_mode():
        ctx.save_for_forward(*tensors)
    ctx.num_rows, ctx.top_k = num_rows, top_k


def _save_permute(ctx, inputs, output):
    x, idx = inputs[:2]
    top_k = inputs[2] if len(inputs) > 2 else 1
    _save(ctx, (idx,), x.shape[0] * top_k, top_k)


def _permute_backward(ctx, dout):
    (idx,) = ctx.saved_tensors
    return _unpermute(dout, idx, ctx.num_rows, ctx.top_k, None), *(None,) * ctx.n_args


def _permute_jvp(ctx, tx, *_):
    (idx,) = ctx.saved_tensors
    return _permute(tx, idx, ctx.top_k)


def _save_unpermute(ctx, inputs, output):
    y, idx, num_rows, *rest = inputs
    top_k, probs = rest if rest else (1, None)
    _save(ctx, (y if probs is not None else None, idx, probs), num_rows, top_k)


def _unpermute_backward(ctx, dout):
    y, idx, probs = ctx.saved_tensors
    if probs is None:  # p = 1: each slot gets its token's (or its row's) gradient
        return _permute(dout, idx, ctx.top_k), *(None,) * ctx.n_args
    dy, dprobs = _combine_grads(dout, y, idx, probs, ctx.num_rows, ctx.top_k)
    return dy, None, None, None, dprobs


def _unpermute_jvp(ctx, ty, _, __, ___=None, tprobs=None):
    # linear in y and in p: d out = unpermute(ty, p) + unpermute(y, tp)
    y, idx, probs = ctx.saved_tensors
    parts = [] if ty is None else [_unpermute(ty, idx, ctx.num_rows, ctx.top_k, probs)]
    if tprobs is not None:
        parts.append(_unpermute(y, idx, ctx.num_rows, ctx.top_k, tprobs))
    return sum(parts[1:], parts[0])


def _save_combine_bwd(ctx, inputs, output):
    dout, y, idx, probs, num_rows, top_k = inputs
    _save(ctx, (dout, y, idx, probs), num_rows, top_k)


def _combine_bwd_backward(ctx, g_dy, g_dprobs):
    # (dy, dprobs) = F(dout, y, p) = (p[r] dout[t], <y[s], dout[t]>) is bilinear in dout and (y, p): so
    # d/d dout = combine(g_dy, p) + combine(y, g_dprobs), and F(dout, g_dy, g_dprobs) = (d/dy, d/dp).
    dout, y, idx, probs = ctx.saved_tensors
    n, k = ctx.num_rows, ctx.top_k
    g_dy = torch.zeros_like(y) if g_dy is None else g_dy
    g_dprobs = torch.zeros_like(probs) if g_dprobs is None else g_dprobs
    ddout = _unpermute(g_dy, idx, n, k, probs) + _unpermute(y, idx, n, k, g_dprobs)
    gy, gprobs = _combine_grads(dout, g_dy, idx, g_dprobs, n, k)
    return ddout, gy, None, gprobs, None, None


def _combine_bwd_jvp(ctx, tdout, ty, _, tprobs, __, ___):
    # bilinear: d F = F(tdout, y, p) + F(dout, ty, tp)
    dout, y, idx, probs = ctx.saved_tensors
    n, k = ctx.num_rows, ctx.top_k
    zero = torch.zeros_like
    a = _combine_grads(zero(dout) if tdout is None else tdout, y, idx, probs, n, k)
    b = _combine_grads(dout, zero(y) if ty is None else ty, idx, zero(probs) if tprobs is None else tprobs, n, k)
    return a[0] + b[0], a[1] + b[1]


def _setup(save, n_args: int):
    """`save`, recording how many non-differentiable arguments follow the first (the backward's Nones)."""
    def setup_context(ctx, inputs, output):
        save(ctx, inputs, output)
        ctx.n_args = n_args
    return setup_context


_permute_op.register_autograd(_permute_backward, setup_context=_setup(_save_permute, 1))
_permute_token_op.register_autograd(_permute_backward, setup_context=_setup(_save_permute, 2))
_unpermute_op.register_autograd(_unpermute_backward, setup_context=_setup(_save_unpermute, 2))
_combine_op.register_autograd(_unpermute_backward, setup_context=_setup(_save_unpermute, 4))
_combine_bwd_op.register_autograd(_combine_bwd_backward, setup_context=_save_combine_bwd)


# ---------------------------------------------------------------------------------------------------
# Eager: executors cached per call signature (`torch_api._launch.cached`: checked once, on a miss).


def _generate_executor(counts, experts_per_rank, num_ranks, max_len, alignment) -> Executor:
    _check_index("tokens_per_expert_group", counts)
    layout = check_layout(counts.shape[0], experts_per_rank, num_ranks, max_len, alignment)
    return Executor(generate_recipe(*layout), ("counts",))


def _route_executor(ids, num_experts, max_len, alignment) -> Executor:
    return Executor(route_recipe(*_check_route(ids, num_experts, max_len, alignment)), ("ids",))


def _inverse_executor(idx, num_rows) -> Executor:
    _check_index("permuted_indices", idx)
    return Executor(inverse_recipe(idx.shape[0], num_rows, dtype_name(idx.dtype)), ("idx",))


# An executor per call signature, checked on a miss; `in_place`: whether the signature's tensors are read as
# they are (the key holds their strides), else through `_rows` and contiguous copies.


def _permute_executor(x, idx, top_k) -> Executor:
    _check_permute(x, idx)
    ex = Executor(_permute_recipe(_rows(x), idx, top_k), ("x", "idx"))
    ex.in_place = _rows(x) is x and idx.is_contiguous()
    return ex


def _unpermute_executor(y, idx, num_rows, top_k, probs) -> Executor:
    _check_unpermute(y, idx, num_rows, top_k, probs)
    ex = Executor(_unpermute_recipe(_rows(y), idx, num_rows, top_k, probs), ("y", "idx", "probs"))
    ex.in_place = _rows(y) is y and idx.is_contiguous() and (probs is None or probs.is_contiguous())
    return ex


def _combine_grads_executor(dout, y, idx, probs, num_rows, top_k) -> Executor:
    ex = Executor(_combine_grads_recipe(_rows(dout), _rows(y), idx, probs, num_rows, top_k),
                  ("dout", "y", "idx", "probs"), shapes={"dprobs": tuple(probs.shape)})
    ex.in_place = _rows(dout) is dout and _rows(y) is y and idx.is_contiguous() and probs.is_contiguous()
    return ex


def _permute_eager(x, idx, top_k):
    ex = cached(("permute", signature(x), signature(idx), top_k), _permute_executor, x, idx, top_k)
    return (ex.run(x, idx) if ex.in_place else ex.run(_rows(x), idx.contiguous()))[0]


def _unpermute_eager(y, idx, num_rows, top_k, probs):
    ex = cached(("unpermute", signature(y), signature(idx), num_rows, top_k, signature(probs)), _unpermute_executor,
                y, idx, num_rows, top_k, probs)
    if ex.in_place:
        return ex.run(y, idx, probs)[0]
    return ex.run(_rows(y), idx.contiguous(), None if probs is None else probs.contiguous())[0]


def _combine_grads_eager(dout, y, idx, probs, num_rows, top_k):
    key = ("combine_bwd", signature(dout), signature(y), signature(idx), signature(probs), num_rows, top_k)
    ex = cached(key, _combine_grads_executor, dout, y, idx, probs, num_rows, top_k)
    if ex.in_place:
        return tuple(ex.run(dout, y, idx, probs))
    return tuple(ex.run(_rows(dout), _rows(y), idx.contiguous(), probs.contiguous()))


def _rows_vmap(apply_fn, info, in_dims, rows, idx, *rest):
    """vmap of a row gather (permute, unpermute, combine) over its rows alone: the examples side by side in
    the hidden dim ([B, N, H] -> [N, B * H]), one call; per example where the index or probs are batched."""
    if in_dims[0] is None or any(d is not None for d in in_dims[1:]):
        return loop_vmap(apply_fn, info, in_dims, rows, idx, *rest)
    b = rows.movedim(in_dims[0], 1)
    out = apply_fn(b.reshape(b.shape[0], -1), idx, *rest)
    return out.view(out.shape[0], info.batch_size, -1), 1


class _Permute(torch.autograd.Function):
    forward = staticmethod(_permute_eager)
    setup_context = staticmethod(_setup(_save_permute, 2))
    backward = staticmethod(_permute_backward)
    jvp = staticmethod(_permute_jvp)

    @staticmethod
    def vmap(info, in_dims, x, idx, top_k):
        return _rows_vmap(_Permute.apply, info, in_dims, x, idx, top_k)


class _Unpermute(torch.autograd.Function):
    forward = staticmethod(_unpermute_eager)
    setup_context = staticmethod(_setup(_save_unpermute, 4))
    backward = staticmethod(_unpermute_backward)
    jvp = staticmethod(_unpermute_jvp)

    @staticmethod
    def vmap(info, in_dims, y, idx, num_rows, top_k, probs):
        return _rows_vmap(_Unpermute.apply, info, in_dims, y, idx, num_rows, top_k, probs)


class _CombineGrads(torch.autograd.Function):
    forward = staticmethod(_combine_grads_eager)
    setup_context = staticmethod(_save_combine_bwd)
    backward = staticmethod(_combine_bwd_backward)
    jvp = staticmethod(_combine_bwd_jvp)

    @staticmethod
    def vmap(info, in_dims, *args):
        return loop_vmap(_CombineGrads.apply, info, in_dims, *args)


# The C++ apply without the Python wrapper (`raw_apply`), where no functorch transform is active.
_apply_permute, _apply_unpermute, _apply_combine_grads = map(raw_apply, (_Permute, _Unpermute, _CombineGrads))


# Eager calls take the executors, through the Functions where autograd is needed (forward mode too);
# compiled and traced code, the ops (checked on every call: tracing is not the hot path).
def _permute(x, idx, top_k: int):
    if direct_or_batched(x, idx):
        return _permute_eager(x, idx, top_k)
    if traced(x, idx):
        _check_permute(x, idx)
        if top_k == 1:
            return torch.ops.xkern.permute_rows(x, idx)
        return torch.ops.xkern.permute_token_rows(x, idx, top_k)
    return (_Permute.apply if functorch_active() else _apply_permute)(x, idx, top_k)


def _unpermute(y, idx, num_rows: int, top_k: int, probs):
    if direct_or_batched(y, idx, probs):
        return _unpermute_eager(y, idx, num_rows, top_k, probs)
    if traced(y, idx, probs):
        _check_unpermute(y, idx, num_rows, top_k, probs)
        if top_k == 1 and probs is None:  # the op with a DTensor rule; the recipe is the same entry's
            return torch.ops.xkern.unpermute_rows(y, idx, num_rows)
        return torch.ops.xkern.combine_rows(y, idx, num_rows, top_k, probs)
    return (_Unpermute.apply if functorch_active() else _apply_unpermute)(y, idx, num_rows, top_k, probs)


def _combine_grads(dout, y, idx, probs, num_rows, top_k):
    if direct_or_batched(dout, y, idx, probs):
        return _combine_grads_eager(dout, y, idx, probs, num_rows, top_k)
    if traced(dout, y, idx, probs):
        return torch.ops.xkern.combine_rows_bwd(dout, y, idx, probs, num_rows, top_k)
    return (_CombineGrads.apply if functorch_active() else _apply_combine_grads)(dout, y, idx, probs, num_rows,
                                                                                top_k)


# ---------------------------------------------------------------------------------------------------
# Public functions: scalars as Python ints at the door (before any cache lookup: np.int64(8) == 8, see
# xkern.launch.check_int), the host-synced checks of validate=True, then the call paths above.


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
    experts_per_rank, num_ranks, max_len, alignment = layout_ints(experts_per_rank, num_ranks, max_len, alignment)
    if validate:
        _check_index("tokens_per_expert_group", counts)
        e, _, m, a = check_layout(counts.shape[0], experts_per_rank, num_ranks, max_len, alignment)
        check_counts(counts.detach().cpu().numpy(), e, a, m)
    if not traced(counts):
        key = ("generate", signature(counts), experts_per_rank, num_ranks, max_len, alignment)
        ex = cached(key, _generate_executor, counts, experts_per_rank, num_ranks, max_len, alignment)
        return tuple(ex.run(counts.contiguous()))
    _check_index("tokens_per_expert_group", counts)
    experts_per_rank, num_ranks, max_len, alignment = check_layout(counts.shape[0], experts_per_rank, num_ranks,
                                                                   max_len, alignment)
    return torch.ops.xkern.generate_permute_indices(counts, experts_per_rank, num_ranks, max_len, alignment)


def topk_permute_indices(expert_ids: torch.Tensor, num_experts: int, max_len: int | None = None,
                         alignment: int = 1, validate: bool = False,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padded, expert-major layout of top-k routing, from the router's expert ids, on the device (no sort,
    no host sync): what `argsort` of the ids, their counts and `generate_permute_indices(counts, num_experts,
    1, max_len, alignment)` give, in three small launches.

    expert_ids: [num_tokens, top_k] (or [num_copies]) int32/int64, copy `t * top_k + j` going to expert
    `expert_ids[t, j]`. Returns `(permuted_indices [max_len] int32, m_sizes [E] int32, m_offsets [E] int32)`:
    m_sizes and m_offsets as `generate_permute_indices` makes them from the counts, permuted_indices[s] the
    copy in slot s (an expert's copies in copy order) or -1 at padding: the index of `permute_rows(x,
    permuted_indices, top_k=top_k)` and `unpermute_rows(y, permuted_indices, num_tokens * top_k, top_k=top_k,
    probs=...)`. max_len defaults to num_copies + num_experts * alignment (room for every copy); copies whose
    slot is >= max_len, and ids outside [0, num_experts), get no slot; with `validate=True` (one host sync)
    either is a ValueError.
    """
    ids = expert_ids
    check_tensor("expert_ids", ids)
    num_experts, max_len, alignment = route_ints(num_experts, max_len, alignment)
    if validate:
        check_expert_ids(ids.detach().cpu().numpy(), *_check_route(ids, num_experts, max_len, alignment)[1:])
    if not traced(ids):
        key = ("route", signature(ids), num_experts, max_len, alignment)
        return tuple(cached(key, _route_executor, ids, num_experts, max_len, alignment).run(ids.contiguous()))
    _, num_experts, max_len, alignment = _check_route(ids, num_experts, max_len, alignment)
    return torch.ops.xkern.topk_permute_indices(ids, num_experts, max_len, alignment)


def permute_rows(x: torch.Tensor, permuted_indices: torch.Tensor, validate: bool = False, *,
                 top_k: int = 1) -> torch.Tensor:
    """`out[i] = x[permuted_indices[i]]`, a zero row where the index is -1: [len(permuted_indices), H].

    x: [num_rows, H] float16/bfloat16/float32 (any row stride; the last dim is read in place when
    contiguous). permuted_indices: int32/int64, -1 or a row of x. Differentiable in x: dx = dout gathered
    through the inverse permutation (`unpermute_rows`). `validate=True` (host sync) checks the valid
    entries are a one-to-one map onto 0..num_rows-1; without it an out-of-range entry reads a zero row.

    top_k > 1 (MoE dispatch from token rows): x holds one row per token, the indices name routed copies
    r = t * top_k + j in [0, num_rows * top_k), and slot i reads row permuted_indices[i] // top_k (no
    [T * top_k, H] copy is made). dx[t] sums its top_k slot gradients in FP32, rounded once
    (`unpermute_rows(dout, idx, T * top_k, top_k=top_k)`). With top_k, `validate=True` checks range and
    duplicates only: a dropped copy (capacity) names no slot.
    """
    if top_k != 1 or type(top_k) is not int:  # the plain call pays one compare
        top_k = check_top_k(top_k)
    if validate:
        _check_permute(x, permuted_indices)
        check_permutation(permuted_indices.detach().cpu().numpy(), x.shape[0] * top_k, complete=top_k == 1)
    return _permute(x, permuted_indices, top_k)


def inverse_permutation(permuted_indices: torch.Tensor, num_rows: int, validate: bool = False) -> torch.Tensor:
    """`inv[permuted_indices[i]] = i` for valid slots, -1 for rows no slot names: [num_rows], the
    index dtype. With duplicates (validate=False) one of the slots wins."""
    idx = permuted_indices
    num_rows = check_int("num_rows", num_rows)
    if validate:
        _check_index("permuted_indices", idx)
        check_permutation(idx.detach().cpu().numpy(), num_rows)
    if not traced(idx):
        return cached(("inverse", signature(idx), num_rows), _inverse_executor, idx, num_rows).run(idx.contiguous())[0]
    _check_index("permuted_indices", idx)
    return torch.ops.xkern.inverse_permutation(permuted_indices, num_rows)


def unpermute_rows(y: torch.Tensor, permuted_indices: torch.Tensor, num_rows: int, validate: bool = False, *,
                   top_k: int = 1, probs: torch.Tensor | None = None) -> torch.Tensor:
    """`out[r] = y[inv[r]]` with `inv = inverse_permutation(permuted_indices, num_rows)`: [num_rows, H],
    a zero row for rows no slot names; padding rows of y are never read. Differentiable in y: dy =
    permute_rows(dout, permuted_indices) (zero at padding). `validate=True` as in `permute_rows`.

    The MoE combine (top_k > 1 or probs): num_rows = T * top_k routed copies; the result is [T, H] with
    `out[t] = sum_j p[t, j] * y[slot of copy t * top_k + j]` (p = probs [T, top_k] float16/bfloat16/float32,
    or 1), accumulated in FP32 in j order and rounded once to y's dtype; dropped copies add 0. Gradients:
    dy[slot] = p[t, j] * dout[t] rounded to y's dtype, dprobs[t, j] = sum_h y[slot, h] * dout[t, h] in FP32,
    in probs' dtype (0 for dropped copies); one kernel, no atomics. `validate=True` allows dropped copies."""
    num_rows = check_int("num_rows", num_rows)
    if top_k != 1 or type(top_k) is not int:  # the plain call pays one compare
        top_k = check_top_k(top_k)
    if validate:  # the top_k forms allow dropped copies (rows no slot names)
        _check_unpermute(y, permuted_indices, num_rows, top_k, probs)
        check_permutation(permuted_indices.detach().cpu().numpy(), num_rows, complete=top_k == 1 and probs is None)
    return _unpermute(y, permuted_indices, num_rows, top_k, probs)
