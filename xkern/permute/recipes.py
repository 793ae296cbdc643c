"""The permute ops' contract, shared by both front ends: the argument rules, the launch recipes (the plans'
launches with their named inputs, the buffers they allocate and the runtime scalars), and the host-side checks
of validate=True."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from xkern.launch import (
    FLOATS,
    INT32_MAX,
    ITEMSIZE,
    Buffer,
    Recipe,
    Step,
    check_int,
    check_row_count,
)
from xkern.permute.plans import (
    MAX_ROUTE_EXPERTS,
    one_launch,
    plan_combine,
    plan_combine_bwd,
    plan_combine_bwd_token,
    plan_gather_rows,
    plan_gather_token_rows,
    plan_generate_indices,
    plan_inverse,
    plan_route_indices,
    plan_scatter_inverse,
    plan_scatter_token_rows,
)

INDEX_DTYPES = ("int32", "int64")


def check_rows(name: str, dtype: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 2:
        raise ValueError(f"{name} must be 2-D [rows, hidden], got shape {list(shape)}")
    if dtype not in FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype}")


def check_index(name: str, dtype: str, shape: tuple[int, ...], two_d: bool = False) -> None:
    """An int32/int64 index array, 1-D (or, `two_d`, 2-D too: expert ids [num_tokens, top_k])."""
    if dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {dtype}")
    if len(shape) not in ((1, 2) if two_d else (1,)):
        raise ValueError(f"{name} must be {'1-D or 2-D' if two_d else '1-D'}, got shape {list(shape)}")


def check_unpermute(y_shape: tuple[int, ...], idx_shape: tuple[int, ...], num_rows: int | None = None, top_k=1,
                    probs_dtype: str | None = None, probs_shape: tuple[int, ...] | None = None) -> int:
    """y has one row per slot; with `num_rows`, the combine's top_k (a divisor of it) and probs (dtype name and
    shape, or None) too. Returns top_k as an int."""
    if idx_shape[0] != y_shape[0]:
        raise ValueError(f"y must have one row per slot of permuted_indices ({idx_shape[0]}), got {y_shape[0]}")
    if num_rows is None:
        return check_top_k(top_k)
    top_k = check_top_k(top_k, num_rows)
    if probs_dtype is not None:
        check_probs(probs_dtype, probs_shape, num_rows, top_k)
    return top_k


def layout_ints(experts_per_rank, num_ranks, max_len, alignment) -> tuple[int, int, int, int]:
    """generate_permute_indices' integer arguments as Python ints (`check_int`: the front ends' door)."""
    return (check_int("experts_per_rank", experts_per_rank, 1), check_int("num_ranks", num_ranks, 1),
            check_int("max_len", max_len), check_int("alignment", alignment, 1))


def check_top_k(top_k, num_rows: int | None = None) -> int:
    """top_k as an int >= 1; with `num_rows` (unpermute_rows' routed copies), a multiple of it."""
    top_k = check_int("top_k", top_k, 1)
    if num_rows is not None and num_rows % top_k:
        raise ValueError(f"num_rows must be a multiple of top_k={top_k} (num_tokens * top_k routed copies), "
                         f"got {num_rows}")
    return top_k


def check_probs(dtype: str, shape: tuple[int, ...], num_rows: int, top_k: int) -> None:
    """probs: [num_rows // top_k, top_k], a float dtype (the routing weights of each token's copies)."""
    if dtype not in FLOATS:
        raise TypeError(f"probs must be float16, bfloat16 or float32, got {dtype}")
    if tuple(shape) != (num_rows // top_k, top_k):
        raise ValueError(f"probs must be [num_rows // top_k, top_k] = [{num_rows // top_k}, {top_k}], got "
                         f"{list(shape)}")


def check_layout(n_counts: int, experts_per_rank, num_ranks, max_len, alignment) -> tuple[int, int, int, int]:
    """generate_permute_indices' arguments, as ints. m_sizes, m_offsets and permuted_indices are int32 and
    the kernels number slots in int32: every expert gets at least one block of `alignment` slots, so
    `experts_per_rank * alignment` must fit int32 (else m_offsets would wrap), and max_len must fit the
    slot numbering. (What the counts add up to is only known on the device: `check_counts`.)"""
    experts_per_rank, num_ranks, max_len, alignment = layout_ints(experts_per_rank, num_ranks, max_len, alignment)
    if n_counts != experts_per_rank * num_ranks:
        raise ValueError(f"tokens_per_expert_group must have experts_per_rank * num_ranks = "
                         f"{experts_per_rank * num_ranks} entries, got {n_counts}")
    check_row_count("max_len", max_len, "slots")
    if experts_per_rank * alignment > INT32_MAX:
        raise ValueError(f"alignment={alignment} is too large: experts_per_rank * alignment = "
                         f"{experts_per_rank * alignment} slots (at least one aligned block per expert) must fit "
                         f"the int32 m_offsets (<= {INT32_MAX})")
    return experts_per_rank, num_ranks, max_len, alignment


def check_gather_sizes(n_slots: int, num_rows: int | None = None) -> None:
    """The gathers and the inverse number slots (len(permuted_indices)) and rows in int32 lanes."""
    check_row_count("permuted_indices", n_slots, "slots")
    if num_rows is not None:
        check_row_count("num_rows", num_rows)


def _gather_steps(src: str, idx: str, out: str, n_out: int, n_cols: int, n_src_rows: int, dtype: str,
                  src_row_stride: int, slot_of: str | None = None, search: bool = False) -> tuple[Step, ...]:
    """The gather into `out`; with `slot_of`, through that scatter of `idx` (unpermute: verified in the gather);
    with `search`, unpermute's one-launch form."""
    if n_out * n_cols == 0 or n_src_rows == 0:  # nothing to read: every row is a zero row
        return (Step(None, (), (Buffer(out, (n_out, n_cols), dtype, fill=0),)),)
    plan = plan_gather_rows(n_out, n_cols, ITEMSIZE[dtype], src_row_stride, through_scatter=slot_of is not None,
                            search=search)
    return (Step(plan, (src, idx) if slot_of is None else (src, slot_of, idx), (Buffer(out, (n_out, n_cols), dtype),),
                 dict(n_rows=n_out, n_cols=n_cols, n_src_rows=n_src_rows, src_row_stride=src_row_stride)),)


def _scatter_step(idx: str, n_slots: int, num_rows: int, index_dtype: str) -> Step:
    return Step(plan_scatter_inverse(n_slots), (idx,), (Buffer("slot_of", (num_rows,), index_dtype),),
                dict(n_slots=n_slots, n_rows=num_rows))


def _inverse_steps(idx: str, inv: str, n_slots: int, num_rows: int, index_dtype: str) -> tuple[Step, ...]:
    if num_rows == 0 or n_slots == 0:  # no slot names any row
        return (Step(None, (), (Buffer(inv, (num_rows,), index_dtype, fill=-1),)),)
    *scatter, last = plan_inverse(n_slots, num_rows)
    out = (Buffer(inv, (num_rows,), index_dtype),)
    scalars = dict(n_slots=n_slots, n_rows=num_rows)
    if not scatter:  # the search: one launch
        return (Step(last, (idx,), out, scalars),)
    return (_scatter_step(idx, n_slots, num_rows, index_dtype), Step(last, (idx, "slot_of"), out, scalars))


@functools.lru_cache(maxsize=4096, typed=True)
def permute_recipe(n_slots: int, n_cols: int, n_src_rows: int, dtype: str, src_row_stride: int,
                   top_k: int = 1, index_dtype: str = "int32", token_major: bool | None = None) -> Recipe:
    """Inputs x [n_src_rows, n_cols] (last dim contiguous, rows `src_row_stride` apart) and idx [n_slots] of
    `index_dtype`; result out [n_slots, n_cols] contiguous. With top_k > 1, x holds one row per token and idx
    names routed copies (slot s reads row idx[s] // top_k): up to ONE_LAUNCH_SLOTS slots one gather launch
    (host-bound calls), above it token-major (the same result: the inverse scatter of idx, then
    `_scatter_token_rows_kernel`, which reads each token row once where the gather reads it once per copy);
    `token_major` True or False forces a form (a caller timing both forms)."""
    check_gather_sizes(n_slots)
    if top_k == 1:
        return Recipe(_gather_steps("x", "idx", "out", n_slots, n_cols, n_src_rows, dtype, src_row_stride), ("out",))
    check_row_count("x", n_src_rows * top_k, "routed copies (rows x top_k)")
    if n_slots * n_cols == 0 or n_src_rows == 0:
        return Recipe((Step(None, (), (Buffer("out", (n_slots, n_cols), dtype, fill=0),)),), ("out",))
    if (not one_launch(n_slots)) if token_major is None else token_major:
        return _permute_token_major(n_slots, n_cols, n_src_rows, dtype, src_row_stride, top_k, index_dtype)
    plan = plan_gather_token_rows(n_slots, n_cols, ITEMSIZE[dtype], src_row_stride)
    return Recipe((Step(plan, ("x", "idx"), (Buffer("out", (n_slots, n_cols), dtype),),
                        dict(n_rows=n_slots, n_cols=n_cols, n_src_rows=n_src_rows, src_row_stride=src_row_stride,
                             top_k=top_k)),), ("out",))


def _permute_token_major(n_slots: int, n_cols: int, n_src_rows: int, dtype: str, src_row_stride: int, top_k: int,
                         index_dtype: str) -> Recipe:
    check_gather_sizes(n_slots, n_src_rows * top_k)
    plan, token_programs = plan_scatter_token_rows(n_src_rows, n_slots, n_cols, ITEMSIZE[dtype], src_row_stride,
                                                   top_k)
    rows = Step(plan, ("x", "slot_of", "idx"), (Buffer("out", (n_slots, n_cols), dtype),),
                dict(n_tokens=n_src_rows, n_cols=n_cols, n_slots=n_slots, src_row_stride=src_row_stride,
                     token_programs=token_programs))
    return Recipe((_scatter_step("idx", n_slots, n_src_rows * top_k, index_dtype), rows), ("out",))


@functools.lru_cache(maxsize=4096, typed=True)
def inverse_recipe(n_slots: int, num_rows: int, index_dtype: str) -> Recipe:
    """Input idx [n_slots]; result inv [num_rows] of idx's dtype."""
    check_gather_sizes(n_slots, num_rows)
    return Recipe(_inverse_steps("idx", "inv", n_slots, num_rows, index_dtype), ("inv",))


@functools.lru_cache(maxsize=4096, typed=True)
def unpermute_recipe(n_slots: int, n_cols: int, num_rows: int, dtype: str, src_row_stride: int,
                     index_dtype: str, top_k: int = 1, probs_dtype: str | None = None) -> Recipe:
    """Every form of unpermute_rows, chosen here and nowhere else (the front ends call this one entry):

    - top_k == 1, no probs: the gather. Inputs y [n_slots, n_cols] (as x of `permute_recipe`) and idx
      [n_slots]; result out [num_rows, n_cols]: the inverse scatter of the inverse permutation, then the gather
      through it (verified there); or, when `one_launch(n_slots)`, one launch.
    - top_k > 1, no probs (probs_dtype None): the copy-sum, out [num_rows // top_k, n_cols], each token's
      top_k copies summed in FP32.
    - probs (probs_dtype given, input probs [num_rows], flat): the weighted combine, out [num_rows // top_k,
      n_cols]. Both: the inverse scatter, then `_combine_rows_kernel`.
    The backward: `permute_recipe(..., top_k)` without probs (dy only), `combine_bwd_recipe` with them."""
    check_gather_sizes(n_slots, num_rows)
    if top_k > 1 or probs_dtype is not None:
        return _combine_recipe(n_slots, n_cols, num_rows, dtype, src_row_stride, index_dtype, top_k, probs_dtype)
    if one_launch(n_slots):
        return Recipe(_gather_steps("y", "idx", "out", num_rows, n_cols, n_slots, dtype, src_row_stride,
                                    search=True), ("out",))
    gather = _gather_steps("y", "idx", "out", num_rows, n_cols, n_slots, dtype, src_row_stride, slot_of="slot_of")
    if gather[0].launch is None:  # nothing to read: zero rows, no scatter
        return Recipe(gather, ("out",))
    return Recipe((_scatter_step("idx", n_slots, num_rows, index_dtype), *gather), ("out",))


def _combine_recipe(n_slots: int, n_cols: int, num_rows: int, dtype: str, src_row_stride: int, index_dtype: str,
                    top_k: int, probs_dtype: str | None) -> Recipe:
    n_tokens = num_rows // top_k
    out = Buffer("out", (n_tokens, n_cols), dtype)
    if n_tokens * n_cols == 0 or n_slots == 0:  # nothing to read: zero rows
        return Recipe((Step(None, (), (dataclasses.replace(out, fill=0),)),), ("out",))
    plan = plan_combine(n_tokens, n_cols, ITEMSIZE[dtype], src_row_stride, probs_dtype is not None, top_k)
    combine = Step(plan, ("y", "slot_of", "idx", "idx" if probs_dtype is None else "probs"), (out,),
                   dict(n_tokens=n_tokens, n_cols=n_cols, n_src_rows=n_slots, src_row_stride=src_row_stride,
                        top_k=top_k))
    return Recipe((_scatter_step("idx", n_slots, num_rows, index_dtype), combine), ("out",))


@functools.lru_cache(maxsize=4096, typed=True)
def combine_bwd_recipe(n_slots: int, n_cols: int, num_rows: int, dtype: str, dout_row_stride: int,
                       y_row_stride: int, top_k: int, probs_dtype: str, index_dtype: str = "int32",
                       token_major: bool | None = None) -> Recipe:
    """The weighted combine's backward. Inputs dout [num_rows // top_k, n_cols], y [n_slots, n_cols] (rows
    `*_row_stride` apart, last dim contiguous), idx [n_slots] of `index_dtype`, probs [num_rows] (flat);
    results dy [n_slots, n_cols] (y's dtype: p * dout[t] rounded once, zero rows at padding) and dprobs
    [num_rows] (probs' dtype: sum_h y[slot, h] * dout[t, h] in FP32, zero for dropped copies). Up to
    ONE_LAUNCH_SLOTS slots (or top_k 1) one slot-major launch, above it token-major (bitwise the same results:
    the inverse scatter of idx, then `_combine_bwd_token_kernel`, which reads each dout row once where the
    slot-major kernel reads it once per copy); `token_major` True or False forces a form."""
    check_gather_sizes(n_slots, num_rows)
    dy = Buffer("dy", (n_slots, n_cols), dtype)
    dprobs = Buffer("dprobs", (num_rows,), probs_dtype, fill=0)
    if n_slots * n_cols == 0 or num_rows == 0:  # no copy has a slot with anything to read
        return Recipe((Step(None, (), (dataclasses.replace(dy, fill=0), dprobs)),), ("dy", "dprobs"))
    if (top_k > 1 and not one_launch(n_slots)) if token_major is None else token_major:
        return _combine_bwd_token_major(n_slots, n_cols, num_rows, dtype, dout_row_stride, y_row_stride, top_k,
                                        probs_dtype, index_dtype)
    plan = plan_combine_bwd(n_slots, n_cols, ITEMSIZE[dtype], dout_row_stride, y_row_stride)
    return Recipe((Step(plan, ("dout", "y", "idx", "probs"), (dy, dprobs),
                        dict(n_slots=n_slots, n_cols=n_cols, num_rows=num_rows, dout_row_stride=dout_row_stride,
                             y_row_stride=y_row_stride, top_k=top_k)),), ("dy", "dprobs"))


def _combine_bwd_token_major(n_slots: int, n_cols: int, num_rows: int, dtype: str, dout_row_stride: int,
                             y_row_stride: int, top_k: int, probs_dtype: str, index_dtype: str) -> Recipe:
    n_tokens = num_rows // top_k
    plan, token_programs = plan_combine_bwd_token(n_tokens, n_slots, n_cols, ITEMSIZE[dtype], dout_row_stride,
                                                  y_row_stride, top_k)
    grads = Step(plan, ("dout", "y", "slot_of", "idx", "probs"),
                 (Buffer("dy", (n_slots, n_cols), dtype), Buffer("dprobs", (num_rows,), probs_dtype, fill=0)),
                 dict(n_tokens=n_tokens, n_cols=n_cols, n_slots=n_slots, dout_row_stride=dout_row_stride,
                      y_row_stride=y_row_stride, token_programs=token_programs))
    return Recipe((_scatter_step("idx", n_slots, num_rows, index_dtype), grads), ("dy", "dprobs"))


@functools.lru_cache(maxsize=1024, typed=True)
def generate_recipe(experts_per_rank: int, num_ranks: int, max_len: int, alignment: int) -> Recipe:
    """Input counts [num_ranks * experts_per_rank]; results permuted_indices [max_len], m_sizes and
    m_offsets [experts_per_rank], all int32."""
    launches = plan_generate_indices(experts_per_rank, num_ranks, max_len)
    per_expert = (experts_per_rank,)
    table = (experts_per_rank * num_ranks,)
    tables = (Buffer("m_sizes", per_expert, "int32"), Buffer("m_offsets", per_expert, "int32"),
              Buffer("row_start", table, "int32"), Buffer("rank_begin", table, "int32"))
    scalars = dict(n_experts=experts_per_rank, n_ranks=num_ranks, alignment=alignment)
    idx = Buffer("idx", (max_len,), "int32")
    results = ("idx", "m_sizes", "m_offsets")
    if len(launches) == 1:  # one program: the tables, then the slots
        return Recipe((Step(launches[0], ("counts",), (*tables, idx), dict(scalars, max_len=max_len)),), results)
    sizes, fill = launches
    steps = [Step(sizes, ("counts",), tables, scalars)]
    if max_len:
        steps.append(Step(fill, ("counts", *(b.name for b in tables)), (idx,),
                          dict(max_len=max_len, n_experts=experts_per_rank, n_ranks=num_ranks)))
    else:
        steps.append(Step(None, (), (idx,)))
    return Recipe(tuple(steps), results)


def route_ints(num_experts, max_len, alignment) -> tuple[int, int | None, int]:
    """topk_permute_indices' scalars as Python ints (`check_int`: the front ends' door); max_len may be None."""
    return (check_int("num_experts", num_experts, 1), None if max_len is None else check_int("max_len", max_len),
            check_int("alignment", alignment, 1))


def check_route(ids_dtype: str, ids_shape: tuple[int, ...], num_experts, max_len,
                alignment) -> tuple[int, int, int, int]:
    """topk_permute_indices' arguments: expert ids [num_tokens, top_k] (or [num_copies]), int32/int64; returns
    (n_copies, num_experts, max_len, alignment) as ints, max_len None meaning every copy's slot (n_copies +
    num_experts * alignment, the most the padded layout can take)."""
    check_index("expert_ids", ids_dtype, ids_shape, two_d=True)
    n_copies = math.prod(ids_shape)
    num_experts, max_len, alignment = route_ints(num_experts, max_len, alignment)
    if num_experts > MAX_ROUTE_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_ROUTE_EXPERTS} (a row of every expert's counts is one tile of "
                         f"the routing kernels), got {num_experts}")
    bound = n_copies + num_experts * alignment
    max_len = bound if max_len is None else max_len
    check_row_count("expert_ids", n_copies, "copies")
    if bound > INT32_MAX:
        raise ValueError(f"{n_copies} copies over num_experts={num_experts} with alignment={alignment} can pad to "
                         f"{bound} slots; m_offsets are int32 (<= {INT32_MAX})")
    check_row_count("max_len", max_len, "slots")
    return n_copies, num_experts, max_len, alignment


@functools.lru_cache(maxsize=1024, typed=True)
def route_recipe(n_copies: int, num_experts: int, max_len: int, alignment: int) -> Recipe:
    """Input ids [n_copies] (int32/int64); results permuted_indices [max_len], m_sizes and m_offsets
    [num_experts], all int32: generate_permute_indices' layout for the copies' expert counts (one rank), each
    slot naming its copy (t * top_k + j), copies of one expert in copy order. No sort: per-chunk counts and
    ranks, then the tables, then every slot (`plan_route_indices`)."""
    count, tables, fill = plan_route_indices(n_copies, num_experts, max_len)
    n_chunks = count.grid[0]
    per_expert = (num_experts,)
    chunked = (n_chunks, num_experts)
    ranks = (Buffer("counts", chunked, "int32"), Buffer("rank", (max(1, n_copies),), "int32"))
    table = tuple(Buffer(name, per_expert, "int32") for name in ("m_sizes", "m_offsets", "totals"))
    steps = [Step(count, ("ids",), ranks, dict(n_copies=n_copies, n_experts=num_experts)),
             Step(tables, ("counts",), (*table, Buffer("base", chunked, "int32")),
                  dict(n_chunks=n_chunks, n_experts=num_experts, alignment=alignment))]
    idx = Buffer("idx", (max_len,), "int32")
    if max_len:
        steps.append(Step(fill, ("ids", "rank", "base", "m_sizes", "m_offsets", "totals"), (idx,),
                          dict(n_copies=n_copies, n_chunks=n_chunks, n_experts=num_experts, max_len=max_len)))
    else:
        steps.append(Step(None, (), (idx,)))
    return Recipe(tuple(steps), ("idx", "m_sizes", "m_offsets"))


def check_expert_ids(ids: np.ndarray, num_experts: int, max_len: int, alignment: int) -> None:
    """validate=True for topk_permute_indices: every id names an expert, and every copy gets a slot < max_len."""
    ids = np.asarray(ids).astype(np.int64).reshape(-1)
    bad = np.flatnonzero((ids < 0) | (ids >= num_experts))
    if bad.size:
        raise ValueError(f"expert_ids (flattened) [{int(bad[0])}] = {int(ids[bad[0]])} is not an expert: ids must "
                         f"be in [0, {num_experts})")
    check_counts(np.bincount(ids, minlength=num_experts), num_experts, alignment, max_len)


# Host-side checks (validate=True), shared by both front ends.


def check_permutation(idx: np.ndarray, num_rows: int, name: str = "permuted_indices", complete: bool = True) -> None:
    """Raise ValueError unless the entries of `idx` other than -1 map one-to-one onto 0..num_rows-1,
    naming the first out-of-range, duplicate or missing index. `complete=False` (the top_k forms, whose
    dropped copies name no slot) lets rows go unnamed."""
    idx = np.asarray(idx).astype(np.int64).reshape(-1)
    bad = np.flatnonzero((idx < -1) | (idx >= num_rows))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(idx[i])} is out of range: entries must be -1 or in "
                         f"[0, {num_rows}) (num_rows={num_rows})")
    slots = np.flatnonzero(idx >= 0)
    rows = idx[slots]
    order = np.argsort(rows, kind="stable")
    dup = np.flatnonzero(rows[order][1:] == rows[order][:-1])
    if dup.size:
        first, second = sorted(int(slots[order[j]]) for j in (dup[0], dup[0] + 1))
        raise ValueError(f"{name} names row {int(rows[order][dup[0]])} twice: at slots {first} and {second}")
    if complete and rows.size != num_rows:
        seen = np.zeros(num_rows, bool)
        seen[rows] = True
        missing = int(np.flatnonzero(~seen)[0])
        raise ValueError(f"{name} never names row {missing}: {num_rows - rows.size} of {num_rows} rows are "
                         f"missing (dropped past max_len?)")


def check_counts(counts: np.ndarray, experts_per_rank: int, alignment: int, max_len: int) -> None:
    """validate=True for generate_permute_indices: counts >= 0, their row numbers and the padded layout
    fit int32 (permuted_indices, m_offsets), and every token gets a slot < max_len."""
    counts = np.asarray(counts).astype(np.int64).reshape(-1)
    neg = np.flatnonzero(counts < 0)
    if neg.size:
        raise ValueError(f"tokens_per_expert_group[{int(neg[0])}] = {int(counts[neg[0]])} is negative")
    # Python ints from here: int64 sums of hostile counts could wrap too.
    if sum(int(c) for c in counts) > INT32_MAX:
        raise ValueError(f"tokens_per_expert_group sums to {sum(int(c) for c in counts)} rows; row numbers are "
                         f"int32 (<= {INT32_MAX})")
    totals = counts.reshape(-1, experts_per_rank).sum(axis=0)
    sizes = -(-np.maximum(totals, alignment) // alignment) * alignment
    if int(sizes.sum()) > INT32_MAX:
        raise ValueError(f"tokens_per_expert_group with alignment={alignment} pads to {int(sizes.sum())} slots; "
                         f"m_offsets are int32 (<= {INT32_MAX})")
    ends = np.cumsum(sizes) - sizes + totals  # one past each expert's last real row
    over = np.flatnonzero(ends > max_len)
    if over.size:
        e = int(over[0])
        raise ValueError(f"max_len={max_len} is too small: expert {e}'s rows end at slot {int(ends[e])}, and "
                         f"rows past max_len would be dropped (all rows fit from max_len={int(ends.max())})")
