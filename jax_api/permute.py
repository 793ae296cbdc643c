"""Padded expert row gather for MoE in JAX: `generate_permute_indices`, `topk_permute_indices`,
`permute_rows`, `inverse_permutation`, `unpermute_rows`; usable under jit and grad of any order.

`permute_rows` and `unpermute_rows` are linear in their rows, each transposed by the other (a gather
through the inverse permutation, never a scatter-add; jax_api/_linear.py); the weighted combine is bilinear in
(y, probs). So jvp, vjp, vmap and every order run the kernels. The index array is an integer input: its
tangent is float0. Contract and kernels: see `xkern/permute/`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_api import sharding
from jax_api._launch import check_array, concrete, execute, map_batched, vary_like
from jax_api._linear import bilinear_jvp, linear
from xkern import permute as contract
from xkern.launch import check_int


def _gather(x, idx, n_out: int):
    """out[i] = x[idx[i]] (zero row at -1), [n_out, H]; under vmap see `_gather_op`."""
    return _gather_op(n_out)(x, idx)


@functools.cache
def _gather_op(n_out: int):
    @jax.custom_batching.custom_vmap
    def op(x, idx):
        return sharding.gather_rows(_gather_kernel)(x, idx)

    @op.def_vmap
    def _(axis_size, in_batched, x, idx):
        if in_batched[1]:  # per-example indices: one launch per example
            return map_batched(op, axis_size, in_batched, x, idx), True
        # One index for the whole batch: the examples' rows side by side, one gather of B*H columns.
        b, n, h = x.shape
        out = op(jnp.moveaxis(x, 0, 1).reshape(n, b * h), idx)
        return jnp.moveaxis(out.reshape(n_out, b, h), 1, 0), True

    return op


def _gather_kernel(x, idx):
    recipe = contract.permute_recipe(idx.shape[0], x.shape[1], x.shape[0], x.dtype.name, x.shape[1])
    (out,) = execute(recipe, x=x, idx=idx)
    return out


def _inverse(idx, num_rows: int, like):
    """inv [num_rows]; under jit split like the rows of `like` ([num_rows, 1], values not read)."""
    return _inverse_op(num_rows)(idx, like)


def _rows_like(x):
    """x's first column [rows, 1], split like x's rows: an operand that only tells the partitioner how to split
    an output's rows (XLA drops the sharding of a [rows, 0] array)."""
    return sharding.rows_like(x)


def _zero_rows(n_rows: int, dtype):
    """Zeros [n_rows, 1] with no sharding of their own: the row-shape operand of an output whose rows follow no
    input (the partitioner then splits them like the output's users; `_rows_like` is the one that follows x)."""
    return jnp.zeros((n_rows, 1), dtype)


@functools.cache
def _inverse_op(num_rows: int):
    kernel = sharding.inverse_rows(_inverse_kernel, num_rows)

    @jax.custom_batching.custom_vmap
    def op(idx, like):
        return kernel(idx, like)

    @op.def_vmap
    def _(axis_size, in_batched, idx, like):
        if in_batched[0]:  # per-example indices: one launch per example
            return map_batched(op, axis_size, in_batched, idx, like), True
        return op(idx, like[0] if in_batched[1] else like), False  # one inverse: like's values are not read

    return op


def _inverse_kernel(idx, num_rows: int, like):
    (inv,) = execute(contract.inverse_recipe(idx.shape[0], num_rows, idx.dtype.name), idx=idx)
    return inv


# Outputs of kernel calls carry no shard_map varying axes: `vary_like` gives them those of the input.
# A gather is linear in its rows: each is a `linear` call (jax_api/_linear.py) whose transpose is the other
# gather, so forward mode, jax.grad and every order run these kernels. `rows` ([rows, 1], x's first column,
# no derivative) tells the partitioner how to split the transpose's rows.


def _gather_slots(idx, rows, x):
    return [vary_like(_gather(x, idx, idx.shape[0]), x)]


def _gather_rows(num_rows: int):
    return lambda idx, rows, y: [vary_like(_gather(y, _inverse(idx, num_rows, rows), num_rows), y)]


def _permute(num_rows, x, idx):
    rows = jax.lax.stop_gradient(_rows_like(x))
    return linear(_gather_slots, _gather_rows(num_rows), (idx, rows), (x,))[0]


def _unpermute(num_rows, y, idx, rows):
    return linear(_gather_rows(num_rows), _gather_slots, (idx, jax.lax.stop_gradient(rows)), (y,))[0]


# The top_k / weighted forms (permute from token rows, combine with probs). Each kernel call is a
# custom_vmap (one launch per example under vmap); each one's transpose is another of these same functions, so
# derivatives of any order are too.


def _per_example(body, n_out: int):
    @jax.custom_batching.custom_vmap
    def op(*args):
        return body(*args)

    op.def_vmap(lambda axis_size, in_batched, *args: (map_batched(op, axis_size, in_batched, *args),
                                                      True if n_out == 1 else (True,) * n_out))
    return op


@functools.cache
def _token_gather_op(top_k: int):
    return _per_example(sharding.gather_rows(functools.partial(_token_gather_kernel, top_k=top_k)), 1)


def _token_gather_kernel(x, idx, top_k: int):
    recipe = contract.permute_recipe(idx.shape[0], x.shape[1], x.shape[0], x.dtype.name, x.shape[1], top_k,
                                    idx.dtype.name)
    return execute(recipe, x=x, idx=idx)[0]


@functools.cache
def _combine_op(num_rows: int, top_k: int, weighted: bool):
    """(y, idx, probs) -> out; without `weighted`, `probs` is a [T, 1] array whose values are not read: it
    carries the tokens' sharding (under jit, the output is split like it)."""
    body = functools.partial(_combine_kernel, top_k=top_k, weighted=weighted)
    return _per_example(sharding.combine_rows(body, num_rows, top_k), 1)


def _combine_kernel(y, idx, num_rows: int, probs, *, top_k: int, weighted: bool):
    recipe = contract.unpermute_recipe(idx.shape[0], y.shape[1], num_rows, y.dtype.name, y.shape[1], idx.dtype.name,
                                       top_k, probs.dtype.name if weighted else None)
    return execute(recipe, y=y, idx=idx, **({"probs": probs.reshape(-1)} if weighted else {}))[0]


@functools.cache
def _combine_bwd_op(num_rows: int, top_k: int):
    body = functools.partial(_combine_bwd_kernel, num_rows=num_rows, top_k=top_k)
    return _per_example(sharding.combine_grads(body), 2)


def _combine_bwd_kernel(dout, y, idx, probs, dprobs_dtype=None, *, num_rows: int, top_k: int):
    """dy, and dprobs in `dprobs_dtype` (default probs')."""
    dprobs_dtype = probs.dtype if dprobs_dtype is None else jnp.dtype(dprobs_dtype)
    recipe = contract.combine_bwd_recipe(idx.shape[0], y.shape[1], num_rows, y.dtype.name, dout.shape[1], y.shape[1],
                                         top_k, dprobs_dtype.name, idx.dtype.name)
    dy, dprobs = execute(recipe, dout=dout, y=y, idx=idx, probs=probs.reshape(-1))
    return dy, dprobs.reshape(probs.shape)


def _token_gather(top_k: int):
    return lambda idx, tokens, x: [vary_like(_token_gather_op(top_k)(x, idx), x)]


def _copy_sum(num_rows: int, top_k: int):
    return lambda idx, tokens, y: [vary_like(_combine_op(num_rows, top_k, False)(y, idx, tokens), y)]


def _permute_tokens(top_k, num_tokens, x, idx):
    tokens = jax.lax.stop_gradient(_rows_like(x))  # dx split like x's rows
    return linear(_token_gather(top_k), _copy_sum(num_tokens * top_k, top_k), (idx, tokens), (x,))[0]


def _sum_copies(num_rows, top_k, y, idx, tokens):
    return linear(_copy_sum(num_rows, top_k), _token_gather(top_k), (idx, jax.lax.stop_gradient(tokens)), (y,))[0]


# The weighted combine C(y, probs) and its backward G(dout, y, probs) = (dy, dprobs) are bilinear: G's
# dy[s] = p[r] dout[t], dprobs[r] = <y[s], dout[t]>; C is transposed by G, and G (in dout; in (y, probs)) by
# C(a, p) + C(y, b) and G(dout, a, b), as `bilinear_jvp` takes them.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _combine_w(num_rows, top_k, y, probs, idx):
    return vary_like(_combine_op(num_rows, top_k, True)(y, idx, probs), y)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _combine_grads(num_rows, top_k, dout, y, probs, idx):
    dy, dprobs = _combine_bwd_op(num_rows, top_k)(dout, y, idx, probs)
    return vary_like(dy, y), vary_like(dprobs, probs)


def _combine_jvp(num_rows, top_k, primals, tangents):
    c, g = functools.partial(_combine_w, num_rows, top_k), functools.partial(_combine_grads, num_rows, top_k)
    return bilinear_jvp(c, lambda y, p, idx, ct: g(ct, y, p, idx), 1, 2)(primals, tangents)


def _combine_grads_jvp(num_rows, top_k, primals, tangents):
    c, g = functools.partial(_combine_w, num_rows, top_k), functools.partial(_combine_grads, num_rows, top_k)

    def transpose(dout, y, p, idx, a, b):
        return (c(a, p, idx) + c(y, b, idx), *g(dout, a, b, idx))

    return bilinear_jvp(g, transpose, 1, 3)(primals, tangents)


_combine_w.defjvp(_combine_jvp)
_combine_grads.defjvp(_combine_grads_jvp)


def _combine(num_rows, top_k, y, idx, probs):
    return _combine_w(num_rows, top_k, y, probs, idx)


# ---------------------------------------------------------------------------------------------------
# Public functions: argument checks, then the kernels.


def _check_rows(name: str, x) -> None:
    check_array(name, x)
    contract.check_rows(name, x.dtype.name, tuple(x.shape))


def _check_index(name: str, idx, like=None) -> None:
    check_array(name, idx)
    contract.check_index(name, idx.dtype.name, tuple(idx.shape))
    if like is not None:
        devices = [_devices(a) for a in (idx, like)]
        if None not in devices and devices[0] != devices[1]:
            raise ValueError(f"{name} must be on {devices[1]} like the other inputs, got {devices[0]}")


def _devices(a):
    try:
        return a.devices()
    except Exception:  # tracers and numpy arrays have no committed device
        return None



def generate_permute_indices(tokens_per_expert_group, experts_per_rank: int, num_ranks: int, max_len: int,
                             alignment: int, validate: bool = False):
    """torchtitan's padded, expert-major layout, computed on the device (no host sync).

    tokens_per_expert_group: [num_ranks * experts_per_rank] int32/int64, rank-major (`r * E + e`); rows
    arrive in that order. Returns `(permuted_indices [max_len] int32, m_sizes [E] int32, m_offsets [E]
    int32)`: m_sizes[e] = roundup(max(sum_r counts[r, e], alignment), alignment), m_offsets its inclusive
    cumsum, permuted_indices[s] the source row of slot s (rank, then arrival order inside an expert's
    block) or -1 at padding / past the last block. Rows whose slot is >= max_len are dropped; with
    `validate=True` (concrete counts only) that, or a negative count, is a ValueError. alignment >= 1.
    """
    counts = tokens_per_expert_group
    _check_index("tokens_per_expert_group", counts)
    experts_per_rank, num_ranks, max_len, alignment = contract.check_layout(
        counts.shape[0], experts_per_rank, num_ranks, max_len, alignment)
    if validate:
        contract.check_counts(concrete("tokens_per_expert_group", counts), experts_per_rank, alignment, max_len)
    outs = _generate_op(experts_per_rank, num_ranks, max_len, alignment)(counts)
    return tuple(vary_like(o, counts) for o in outs)


@functools.cache
def _generate_op(experts_per_rank: int, num_ranks: int, max_len: int, alignment: int):
    kernels = sharding.replicated(lambda c: _generate_kernels(c, experts_per_rank, num_ranks, max_len, alignment),
                                  1, (1,), (1, 1, 1))

    @jax.custom_batching.custom_vmap
    def op(counts):
        return tuple(kernels(counts))

    op.def_vmap(lambda axis_size, in_batched, counts: (map_batched(op, axis_size, in_batched, counts),
                                                         (True, True, True)))
    return op


def _generate_kernels(counts, experts_per_rank: int, num_ranks: int, max_len: int, alignment: int):
    return tuple(execute(contract.generate_recipe(experts_per_rank, num_ranks, max_len, alignment), counts=counts))


def topk_permute_indices(expert_ids, num_experts: int, max_len: int | None = None, alignment: int = 1,
                         validate: bool = False):
    """`(permuted_indices [max_len], m_sizes [E], m_offsets [E])`, int32: the padded expert-major layout of the
    copies `t * top_k + j` of expert_ids ([num_tokens, top_k] or [num_copies], int32/int64), made on the device
    without a sort, the same as a stable argsort of the ids, their counts and `generate_permute_indices(counts,
    num_experts, 1, max_len, alignment)` (docs/ops.md). Slot s names its copy, -1 at padding: the index
    `permute_rows(x, idx, top_k=top_k)` and the weighted combine take. max_len (default: num_copies +
    num_experts * alignment) drops the copies past it, as ids outside [0, num_experts) are dropped;
    `validate=True` (concrete ids) raises on either. Sharded jit: the ids all-gathered, the op replicated.
    """
    ids = expert_ids
    check_array("expert_ids", ids)
    n_copies, num_experts, max_len, alignment = contract.check_route(ids.dtype.name, tuple(ids.shape), num_experts,
                                                                     max_len, alignment)
    if validate:
        contract.check_expert_ids(concrete("expert_ids", ids), num_experts, max_len, alignment)
    outs = _route_op(n_copies, num_experts, max_len, alignment)(ids.reshape(-1))
    return tuple(vary_like(o, ids) for o in outs)


@functools.cache
def _route_op(n_copies: int, num_experts: int, max_len: int, alignment: int):
    kernels = sharding.replicated(
        lambda ids: tuple(execute(contract.route_recipe(n_copies, num_experts, max_len, alignment), ids=ids)),
        1, (1,), (1, 1, 1))

    @jax.custom_batching.custom_vmap
    def op(ids):
        return tuple(kernels(ids))

    op.def_vmap(lambda axis_size, in_batched, ids: (map_batched(op, axis_size, in_batched, ids), (True, True, True)))
    return op


def permute_rows(x, permuted_indices, validate: bool = False, *, top_k: int = 1):
    """`out[i] = x[permuted_indices[i]]`, a zero row where the index is -1: [len(permuted_indices), H].

    x: [num_rows, H] float16/bfloat16/float32. permuted_indices: int32/int64, -1 or a row of x.
    Differentiable in x (forward and reverse, any order): dx = dout gathered through the inverse permutation
    (`unpermute_rows`). `validate=True` (concrete indices only) checks the valid entries are a
    one-to-one map onto 0..num_rows-1; without it an out-of-range entry reads a zero row.

    top_k > 1 (MoE dispatch from token rows): x holds one row per token, the indices name routed copies
    r = t * top_k + j, and slot i reads row permuted_indices[i] // top_k (no [T * top_k, H] copy). dx[t]
    sums its top_k slot gradients in FP32, rounded once. With top_k, `validate=True` allows dropped copies.
    """
    _check_rows("x", x)
    _check_index("permuted_indices", permuted_indices, like=x)
    top_k = contract.check_top_k(top_k)
    if validate:
        contract.check_permutation(concrete("permuted_indices", permuted_indices), x.shape[0] * top_k,
                                   complete=top_k == 1)
    if top_k > 1:
        return _permute_tokens(top_k, x.shape[0], x, permuted_indices)
    return _permute(x.shape[0], x, permuted_indices)


def inverse_permutation(permuted_indices, num_rows: int, validate: bool = False):
    """`inv[permuted_indices[i]] = i` for valid slots, -1 for rows no slot names: [num_rows], the
    index dtype. With duplicates (validate=False) one of the slots wins."""
    _check_index("permuted_indices", permuted_indices)
    num_rows = check_int("num_rows", num_rows)
    if validate:
        contract.check_permutation(concrete("permuted_indices", permuted_indices), num_rows)
    inv = _inverse(permuted_indices, num_rows, _zero_rows(num_rows, permuted_indices.dtype))
    return vary_like(inv, permuted_indices)


def unpermute_rows(y, permuted_indices, num_rows: int, validate: bool = False, *, top_k: int = 1, probs=None):
    """`out[r] = y[inv[r]]` with `inv = inverse_permutation(permuted_indices, num_rows)`: [num_rows, H],
    a zero row for rows no slot names; padding rows of y are never read. Differentiable in y
    (forward and reverse, any order): dy = permute_rows(dout, permuted_indices) (zero at padding).

    The MoE combine (top_k > 1 or probs): num_rows = T * top_k routed copies; the result is [T, H] with
    `out[t] = sum_j p[t, j] * y[slot of copy t * top_k + j]` (p = probs [T, top_k], or 1), in FP32, j in
    order, rounded once to y's dtype; dropped copies add 0. dy[slot] = p[t, j] * dout[t] in y's dtype,
    dprobs[t, j] = sum_h y[slot, h] * dout[t, h] in FP32, in probs' dtype (as torch_api.unpermute_rows)."""
    _check_rows("y", y)
    _check_index("permuted_indices", permuted_indices, like=y)
    num_rows = check_int("num_rows", num_rows)
    if probs is not None:
        check_array("probs", probs)
    top_k = contract.check_unpermute(tuple(y.shape), tuple(permuted_indices.shape), num_rows, top_k,
                                     None if probs is None else probs.dtype.name,
                                     None if probs is None else tuple(probs.shape))
    if validate:  # the top_k forms allow dropped copies (rows no slot names)
        contract.check_permutation(concrete("permuted_indices", permuted_indices), num_rows,
                                   complete=top_k == 1 and probs is None)
    # The forward's kernels are the core's choice (`unpermute_recipe`, in `_combine_kernel`); what differs
    # here is the autodiff glue: the combine's backward also gives dprobs, the copy-sum's is the dispatch.
    # The plain form runs as inverse + gather: its rows then partition like any gather (jax_api/sharding.py).
    if probs is not None:  # inside shard_map both vary alike (each one's gradient then has its type)
        return _combine(num_rows, top_k, vary_like(y, probs), permuted_indices, vary_like(probs, y))
    if top_k > 1:
        return _sum_copies(num_rows, top_k, y, permuted_indices, _zero_rows(num_rows // top_k, y.dtype))
    return _unpermute(num_rows, y, permuted_indices, _zero_rows(num_rows, y.dtype))
