"""Padded expert row gather for MoE in PyTorch: `generate_permute_indices`, `permute_rows`,
`inverse_permutation`, `unpermute_rows`, and the `xkern::*` ops behind them.

The ops are registered with `torch.library` (fake implementations included) so `torch.compile(
fullgraph=True)` traces them. The backward of `permute_rows` is `unpermute_rows` and vice versa (a gather
through the inverse permutation, never a scatter-add), so gradients of any order are these same ops.
Contract and kernels: see `xkern/permute.py`.
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
    forward_mode,
    functorch_active,
    needs_autograd,
    register_op,
    run_recipe,
)
from xkern.launch import check_int
from xkern.permute import (
    check_counts,
    check_index,
    check_layout,
    check_permutation,
    check_probs,
    check_rows,
    check_top_k,
    check_unpermute,
    combine_bwd_recipe,
    generate_recipe,
    inverse_recipe,
    layout_ints,
    permute_recipe,
    unpermute_recipe,
)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # Rows need a contiguous last dim; any row stride is fine.
    return x.contiguous() if x.stride(1) != 1 and x.shape[1] > 1 else x


# int(): the plans depend on the shapes, so a compiled graph specializes on them.
def _permute_recipe(x, idx):
    return permute_recipe(int(idx.shape[0]), int(x.shape[1]), int(x.shape[0]), dtype_name(x.dtype), int(x.stride(0)))


def _unpermute_recipe(y, idx, num_rows):
    return unpermute_recipe(int(idx.shape[0]), int(y.shape[1]), num_rows, dtype_name(y.dtype), int(y.stride(0)),
                            dtype_name(idx.dtype))


# ---------------------------------------------------------------------------------------------------
# Registered ops: torch.compile, export, DTensor, fake tensors.


@register_op("xkern::generate_permute_indices")
def _generate_op(counts: torch.Tensor, experts_per_rank: int, num_ranks: int, max_len: int,
                 alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recipe = generate_recipe(experts_per_rank, num_ranks, max_len, alignment)
    idx, m_sizes, m_offsets = run_recipe(recipe, counts.device, counts=counts.contiguous())
    return idx, m_sizes, m_offsets


@register_op("xkern::permute_rows")
def _permute_op(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    x = _rows(x)
    (out,) = run_recipe(_permute_recipe(x, idx), x.device, x=x, idx=idx.contiguous())
    return out


@register_op("xkern::inverse_permutation")
def _inverse_op(idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    (inv,) = run_recipe(inverse_recipe(int(idx.shape[0]), num_rows, dtype_name(idx.dtype)), idx.device,
                        idx=idx.contiguous())
    return inv


@register_op("xkern::unpermute_rows")
def _unpermute_op(y: torch.Tensor, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    y = _rows(y)
    (out,) = run_recipe(_unpermute_recipe(y, idx, num_rows), y.device, y=y, idx=idx.contiguous())
    return out


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


# The top_k / weighted forms: permute from token rows, combine with probs. Their autograd is registered on
# the ops and, for eager calls, the same functions in autograd.Functions with forward mode; gradients of
# any order are these same ops.


def _token_rows_recipe(x, idx, top_k):
    return permute_recipe(int(idx.shape[0]), int(x.shape[1]), int(x.shape[0]), dtype_name(x.dtype), int(x.stride(0)),
                          top_k)


def _combine_recipe(y, idx, num_rows, top_k, probs):
    return unpermute_recipe(int(idx.shape[0]), int(y.shape[1]), num_rows, dtype_name(y.dtype), int(y.stride(0)),
                            dtype_name(idx.dtype), top_k, None if probs is None else dtype_name(probs.dtype))


def _combine_grads_recipe(dout, y, idx, probs, num_rows, top_k):
    return combine_bwd_recipe(int(idx.shape[0]), int(y.shape[1]), num_rows, dtype_name(y.dtype), int(dout.stride(0)),
                              int(y.stride(0)), top_k, dtype_name(probs.dtype))


@register_op("xkern::permute_token_rows")
def _permute_token_op(x: torch.Tensor, idx: torch.Tensor, top_k: int) -> torch.Tensor:
    x = _rows(x)
    (out,) = run_recipe(_token_rows_recipe(x, idx, top_k), x.device, x=x, idx=idx.contiguous())
    return out


@register_op("xkern::combine_rows")
def _combine_op(y: torch.Tensor, idx: torch.Tensor, num_rows: int, top_k: int,
                probs: torch.Tensor | None) -> torch.Tensor:
    y = _rows(y)
    inputs = dict(y=y, idx=idx.contiguous()) if probs is None else dict(y=y, idx=idx.contiguous(),
                                                                         probs=probs.contiguous())
    (out,) = run_recipe(_combine_recipe(y, idx, num_rows, top_k, probs), y.device, **inputs)
    return out


@register_op("xkern::combine_rows_bwd")
def _combine_bwd_op(dout: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor, num_rows: int,
                    top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    dout, y = _rows(dout), _rows(y)
    dy, dprobs = run_recipe(_combine_grads_recipe(dout, y, idx, probs, num_rows, top_k), y.device, dout=dout, y=y,
                            idx=idx.contiguous(), probs=probs.contiguous())
    return dy, dprobs.view(probs.shape)


# Eager (plain tensors, not compiling): the same recipes through cached Executors (no op dispatch).
def _layout(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _executor(key, make) -> Executor:
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = _EXECUTORS[key] = make()
    return ex


def _token_rows_eager(x, idx, top_k):
    x, idx = _rows(x), idx.contiguous()
    ex = _executor(("token_rows", _layout(x), _layout(idx), top_k),
                   lambda: Executor(_token_rows_recipe(x, idx, top_k), ("x", "idx")))
    return ex(x, idx)[0]


def _combine_eager(y, idx, num_rows, top_k, probs):
    y, idx = _rows(y), idx.contiguous()
    inputs = (y, idx) if probs is None else (y, idx, probs.contiguous())
    names = ("y", "idx", "probs")[:len(inputs)]
    ex = _executor(("combine", _layout(y), _layout(idx), num_rows, top_k, _layout(probs)),
                   lambda: Executor(_combine_recipe(y, idx, num_rows, top_k, probs), names))
    return ex(*inputs)[0]


def _combine_grads_eager(dout, y, idx, probs, num_rows, top_k):
    dout, y, idx, probs = _rows(dout), _rows(y), idx.contiguous(), probs.contiguous()
    ex = _executor(("combine_grads", _layout(dout), _layout(y), _layout(idx), _layout(probs), num_rows, top_k),
                   lambda: Executor(_combine_grads_recipe(dout, y, idx, probs, num_rows, top_k),
                                    ("dout", "y", "idx", "probs"), shapes={"dprobs": tuple(probs.shape)}))
    return tuple(ex(dout, y, idx, probs))


def _save(ctx, tensors, **attrs):
    ctx.save_for_backward(*tensors)
    if forward_mode():
        ctx.save_for_forward(*tensors)
    ctx.__dict__.update(attrs)


def _save_token_rows(ctx, inputs, output):
    x, idx, top_k = inputs
    _save(ctx, (idx,), num_rows=x.shape[0] * top_k, top_k=top_k)


def _permute_token_backward(ctx, dout):
    (idx,) = ctx.saved_tensors
    return _combine(dout, idx, ctx.num_rows, ctx.top_k, None), None, None


def _permute_token_jvp(ctx, tx, _, __):
    (idx,) = ctx.saved_tensors
    return _permute_tokens(tx, idx, ctx.top_k)


def _save_combine(ctx, inputs, output):
    y, idx, num_rows, top_k, probs = inputs
    _save(ctx, (y if probs is not None else None, idx, probs), num_rows=num_rows, top_k=top_k)


def _combine_backward(ctx, dout):
    y, idx, probs = ctx.saved_tensors
    if probs is None:  # p = 1: each slot gets its token's gradient
        return _permute_tokens(dout, idx, ctx.top_k), None, None, None, None
    dy, dprobs = _combine_grads(dout, y, idx, probs, ctx.num_rows, ctx.top_k)
    return dy, None, None, None, dprobs


def _combine_jvp(ctx, ty, _, __, ___, tprobs):
    # linear in y and in p: d out = combine(ty, p) + combine(y, tp)
    y, idx, probs = ctx.saved_tensors
    parts = [] if ty is None else [_combine(ty, idx, ctx.num_rows, ctx.top_k, probs)]
    if tprobs is not None:
        parts.append(_combine(y, idx, ctx.num_rows, ctx.top_k, tprobs))
    return sum(parts[1:], parts[0])


def _save_combine_bwd(ctx, inputs, output):
    dout, y, idx, probs, num_rows, top_k = inputs
    _save(ctx, (dout, y, idx, probs), num_rows=num_rows, top_k=top_k)


def _combine_bwd_backward(ctx, g_dy, g_dprobs):
    # (dy, dprobs) = F(dout, y, p) = (p[r] dout[t], <y[s], dout[t]>) is bilinear in dout and (y, p): so
    # d/d dout = combine(g_dy, p) + combine(y, g_dprobs), and F(dout, g_dy, g_dprobs) = (d/dy, d/dp).
    dout, y, idx, probs = ctx.saved_tensors
    n, k = ctx.num_rows, ctx.top_k
    g_dy = torch.zeros_like(y) if g_dy is None else g_dy
    g_dprobs = torch.zeros_like(probs) if g_dprobs is None else g_dprobs
    ddout = _combine(g_dy, idx, n, k, probs) + _combine(y, idx, n, k, g_dprobs)
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


_permute_token_op.register_autograd(_permute_token_backward, setup_context=_save_token_rows)
_combine_op.register_autograd(_combine_backward, setup_context=_save_combine)
_combine_bwd_op.register_autograd(_combine_bwd_backward, setup_context=_save_combine_bwd)


def _function(name: str, op, setup_context, backward, jvp) -> type[torch.autograd.Function]:
    """The eager form of a registered op: the same autograd, plus forward mode (`jvp`)."""
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(lambda *args: op(*args)), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp)})


_PermuteTokens = _function("_PermuteTokens", _token_rows_eager, _save_token_rows, _permute_token_backward,
                           _permute_token_jvp)
_Combine = _function("_Combine", _combine_eager, _save_combine, _combine_backward, _combine_jvp)
_CombineGrads = _function("_CombineGrads", _combine_grads_eager, _save_combine_bwd, _combine_bwd_backward,
                          _combine_bwd_jvp)


# Eager calls take the Executors, through the Functions where autograd is needed (forward mode too);
# compiled and traced code, the ops (whose registered autograd is the same).
def _permute_tokens(x, idx, top_k):
    if not eager(x, idx):
        return torch.ops.xkern.permute_token_rows(x, idx, top_k)
    return _PermuteTokens.apply(x, idx, top_k) if needs_autograd(x) else _token_rows_eager(x, idx, top_k)


def _combine(y, idx, num_rows, top_k, probs):
    if not (eager(y, idx) and eager(idx, probs)):
        return torch.ops.xkern.combine_rows(y, idx, num_rows, top_k, probs)
    if needs_autograd(y, probs):
        return _Combine.apply(y, idx, num_rows, top_k, probs)
    return _combine_eager(y, idx, num_rows, top_k, probs)


def _combine_grads(dout, y, idx, probs, num_rows, top_k):
    if not (eager(dout, y) and eager(idx, probs)):
        return torch.ops.xkern.combine_rows_bwd(dout, y, idx, probs, num_rows, top_k)
    if needs_autograd(dout, y, probs):
        return _CombineGrads.apply(dout, y, idx, probs, num_rows, top_k)
    return _combine_grads_eager(dout, y, idx, probs, num_rows, top_k)


# ---------------------------------------------------------------------------------------------------
# Eager: executors cached per call signature; autograd Functions whose backward (and jvp) is a gather.

_EXECUTORS: dict = {}


def _cached(key, make) -> Executor:
    """The executor cached under `key`, else `make()` (which checks the arguments first) cached there."""
    try:
        ex = _EXECUTORS.get(key)
    except TypeError:  # an unhashable argument: make() names it
        ex = None
    if ex is None:
        ex = _EXECUTORS[key] = make()
    return ex


def _generate_executor(counts, experts_per_rank, num_ranks, max_len, alignment) -> Executor:
    _check_index("tokens_per_expert_group", counts)
    layout = check_layout(counts.shape[0], experts_per_rank, num_ranks, max_len, alignment)
    return Executor(generate_recipe(*layout), ("counts",))


def _inverse_executor(idx, num_rows) -> Executor:
    _check_index("permuted_indices", idx)
    check_int("num_rows", num_rows)
    return Executor(inverse_recipe(idx.shape[0], num_rows, dtype_name(idx.dtype)), ("idx",))


def _permute_eager(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    key = ("permute", x.shape, x.stride(), x.dtype, x.device, idx.shape, idx.dtype, idx.device)
    ex = _EXECUTORS.get(key)
    if ex is None:  # first call of this signature: the checks, then the recipe
        _check_rows("x", x)
        _check_index("permuted_indices", idx, like=x)
        ex = _EXECUTORS[key] = Executor(_permute_recipe(_rows(x), idx), ("x", "idx"))
    return ex(_rows(x), idx.contiguous())[0]


def _unpermute_eager(y: torch.Tensor, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    key = ("unpermute", y.shape, y.stride(), y.dtype, y.device, idx.shape, idx.dtype, idx.device, num_rows)
    ex = _EXECUTORS.get(key)
    if ex is None:
        _check_unpermute(y, idx, num_rows)
        ex = _EXECUTORS[key] = Executor(_unpermute_recipe(_rows(y), idx, num_rows), ("y", "idx"))
    return ex(_rows(y), idx.contiguous())[0]


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(x, idx):
        return _permute_eager(x, idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        if forward_mode():
            ctx.save_for_forward(inputs[1])
        ctx.num_rows = inputs[0].shape[0]

    @staticmethod
    def backward(ctx, dout):
        (idx,) = ctx.saved_tensors
        return _unpermute(dout, idx, ctx.num_rows), None

    @staticmethod
    def jvp(ctx, tx, _):
        (idx,) = ctx.saved_tensors
        return _permute(tx, idx)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(y, idx, num_rows):
        return _unpermute_eager(y, idx, num_rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        if forward_mode():
            ctx.save_for_forward(inputs[1])
        ctx.num_rows = inputs[2]

    @staticmethod
    def backward(ctx, dout):
        (idx,) = ctx.saved_tensors
        return _permute(dout, idx), None, None

    @staticmethod
    def jvp(ctx, ty, _, __):
        (idx,) = ctx.saved_tensors
        return _unpermute(ty, idx, ctx.num_rows)


_apply_permute, _apply_unpermute = fast_apply(_Permute), fast_apply(_Unpermute)


def _permute(x, idx):
    if not eager(x, idx):
        _check_rows("x", x)
        _check_index("permuted_indices", idx, like=x)
        return torch.ops.xkern.permute_rows(x, idx)
    if not needs_autograd(x):
        return _permute_eager(x, idx)
    return _Permute.apply(x, idx) if functorch_active() else _apply_permute(x, idx)


def _unpermute(y, idx, num_rows):
    if not eager(y, idx):
        _check_unpermute(y, idx, num_rows)
        return torch.ops.xkern.unpermute_rows(y, idx, num_rows)
    if not needs_autograd(y):
        return _unpermute_eager(y, idx, num_rows)
    return _Unpermute.apply(y, idx, num_rows) if functorch_active() else _apply_unpermute(y, idx, num_rows)


# ---------------------------------------------------------------------------------------------------
# Public functions: the core's argument checks, then the ops.


def _check_rows(name: str, x) -> None:
    check_tensor(name, x)
    check_rows(name, dtype_name(x.dtype), tuple(x.shape))
    check_device(name, x)


def _check_index(name: str, idx, like: torch.Tensor | None = None) -> None:
    check_tensor(name, idx)
    check_index(name, dtype_name(idx.dtype), tuple(idx.shape))
    check_device(name, idx, like=like)


def _check_unpermute(y, idx, num_rows) -> None:
    _check_rows("y", y)
    _check_index("permuted_indices", idx, like=y)
    check_int("num_rows", num_rows)
    check_unpermute(tuple(y.shape), tuple(idx.shape))


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
    # Scalars as Python ints before any cache lookup (np.int64(8) == 8: see xkern.launch.check_int).
    experts_per_rank, num_ranks, max_len, alignment = layout_ints(experts_per_rank, num_ranks, max_len, alignment)
    if validate:
        _check_index("tokens_per_expert_group", counts)
        e, _, m, a = check_layout(counts.shape[0], experts_per_rank, num_ranks, max_len, alignment)
        check_counts(counts.detach().cpu().numpy(), e, a, m)
    if eager(counts):  # checked on the first call of each signature
        key = ("generate", counts.shape, counts.dtype, counts.device, experts_per_rank, num_ranks, max_len, alignment)
        ex = _cached(key, lambda: _generate_executor(counts, experts_per_rank, num_ranks, max_len, alignment))
        return tuple(ex(counts.contiguous()))
    _check_index("tokens_per_expert_group", counts)
    experts_per_rank, num_ranks, max_len, alignment = check_layout(counts.shape[0], experts_per_rank, num_ranks,
                                                                   max_len, alignment)
    return torch.ops.xkern.generate_permute_indices(counts, experts_per_rank, num_ranks, max_len, alignment)


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
        if top_k != 1:
            return _permute_token_rows(x, permuted_indices, validate, top_k)
    if validate:
        _check_rows("x", x)
        _check_index("permuted_indices", permuted_indices, like=x)
        check_permutation(permuted_indices.detach().cpu().numpy(), x.shape[0])
    return _permute(x, permuted_indices)


def inverse_permutation(permuted_indices: torch.Tensor, num_rows: int, validate: bool = False) -> torch.Tensor:
    """`inv[permuted_indices[i]] = i` for valid slots, -1 for rows no slot names: [num_rows], the
    index dtype. With duplicates (validate=False) one of the slots wins."""
    idx = permuted_indices
    num_rows = check_int("num_rows", num_rows)  # an int before any cache lookup
    if validate:
        _check_index("permuted_indices", idx)
        check_permutation(idx.detach().cpu().numpy(), num_rows)
    if eager(idx):  # checked on the first call of each signature
        key = ("inverse", idx.shape, idx.dtype, idx.device, num_rows)
        return _cached(key, lambda: _inverse_executor(idx, num_rows))(idx.contiguous())[0]
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
    num_rows = check_int("num_rows", num_rows)  # an int before any cache lookup
    if top_k != 1 or type(top_k) is not int or probs is not None:
        top_k = check_top_k(top_k)
        if top_k != 1 or probs is not None:
            return _combine_rows(y, permuted_indices, num_rows, validate, top_k, probs)
    if validate:
        _check_unpermute(y, permuted_indices, num_rows)
        check_permutation(permuted_indices.detach().cpu().numpy(), num_rows)
    return _unpermute(y, permuted_indices, num_rows)


def _permute_token_rows(x, idx, validate: bool, top_k: int) -> torch.Tensor:
    _check_rows("x", x)
    _check_index("permuted_indices", idx, like=x)
    if validate:
        check_permutation(idx.detach().cpu().numpy(), x.shape[0] * top_k, complete=False)
    return _permute_tokens(x, idx, top_k)


def _combine_rows(y, idx, num_rows, validate: bool, top_k: int, probs) -> torch.Tensor:
    _check_unpermute(y, idx, num_rows)
    check_top_k(top_k, num_rows)
    if probs is not None:
        check_tensor("probs", probs)
        check_probs(dtype_name(probs.dtype), tuple(probs.shape), num_rows, top_k)
        check_device("probs", probs, like=y)
    if validate:
        check_permutation(idx.detach().cpu().numpy(), num_rows, complete=False)
    return _combine(y, idx, num_rows, top_k, probs)
