"""The permute ops' index kernels (the contract: `xkern.permute`; their plans: `plans.py`).

  _scatter_inverse_kernel  slot_of[idx[i]] = i for valid slots, into an uninitialised buffer: the slot naming
                           each row, garbage for rows no slot names (every reader checks idx[slot_of[r]] == r);
  _verify_inverse_kernel   inv[r] = slot_of[r] if idx[slot_of[r]] == r else -1: rows no slot names (dropped past
                           max_len) get -1 without a pre-fill, which a JAX kernel output cannot have
                           (inverse_permutation);
  _inverse_search_kernel   the same in one launch for up to ONE_LAUNCH_SLOTS slots (`one_launch`): each
                           program finds its rows' slots by scanning all of idx;
  _expert_sizes_kernel     one program: m_sizes, m_offsets and the per-(rank, expert) tables;
  _fill_indices_kernel     one thread per slot: binary searches over m_offsets, then over the ranks.
  _generate_one_kernel     both in one program over every slot, up to ONE_LAUNCH_SLOTS slots (`one_launch`).
  _route_count_kernel, _route_tables_kernel, _route_fill_kernel  topk_permute_indices: the same layout from
                           the copies' expert ids, no sort (copies of an expert in copy order): per chunk of
                           ROUTE_CHUNK copies the counts per expert and each copy's rank in its chunk; one
                           program's tables (m_sizes, m_offsets, each chunk's first slot per expert); then each
                           chunk's copies scattered to their slots beside one program per expert writing -1 at
                           its padding and its share of the slots past the last block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from xkern.permute.kernels import _find_slots


@triton.jit
def _scatter_inverse_kernel(IDX, n_slots, n_rows, SLOT_OF, BLOCK: tl.constexpr):
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = slots < n_slots
    rows = tl.load(IDX + slots, mask=in_bounds, other=-1).to(tl.int64)
    ok = in_bounds & (rows >= 0) & (rows < n_rows)
    tl.store(SLOT_OF + rows, slots.to(SLOT_OF.dtype.element_ty), mask=ok)


@triton.jit
def _verify_inverse_kernel(IDX, SLOT_OF, n_slots, n_rows, INV, BLOCK: tl.constexpr):
    # SLOT_OF is uninitialised where no slot named the row: keep a value only if it points back at the row.
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = rows < n_rows
    slot = tl.load(SLOT_OF + rows, mask=in_bounds, other=-1).to(tl.int64)
    ok = in_bounds & (slot >= 0) & (slot < n_slots)
    back = tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64)
    ok = ok & (back == rows.to(tl.int64))
    tl.store(INV + rows, tl.where(ok, slot, -1).to(INV.dtype.element_ty), mask=in_bounds)


@triton.jit
def _inverse_search_kernel(IDX, n_slots, n_rows, INV, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    found = _find_slots(IDX, rows, n_slots, n_rows, BLOCK_S)
    tl.store(INV + rows, found.to(INV.dtype.element_ty), mask=rows < n_rows)


@triton.jit
def _expert_tables(COUNTS, n_experts, n_ranks, alignment, M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN,
                   BLOCK_E: tl.constexpr):
    # ROW_START[r, e]: source row of the first token of (r, e). RANK_BEGIN[r, e]: where rank r's tokens
    # start inside expert e's block (ranks before r, summed). Both [n_ranks, n_experts] int32.
    e = tl.arange(0, BLOCK_E)
    e_mask = e < n_experts
    base = tl.zeros([BLOCK_E], tl.int64)   # tokens of all earlier ranks (the same in every lane)
    total = tl.zeros([BLOCK_E], tl.int64)  # tokens of expert e from earlier ranks
    for r in range(n_ranks):
        at = r * n_experts + e
        c = tl.load(COUNTS + at, mask=e_mask, other=0).to(tl.int64)
        tl.store(ROW_START + at, (base + tl.cumsum(c, axis=0) - c).to(tl.int32), mask=e_mask)
        tl.store(RANK_BEGIN + at, total.to(tl.int32), mask=e_mask)
        total += c
        base += tl.sum(c, axis=0)
    size = tl.maximum(total, alignment)
    size = tl.where(e_mask, (size + alignment - 1) // alignment * alignment, 0)
    tl.store(M_SIZES + e, size.to(tl.int32), mask=e_mask)
    tl.store(M_OFFSETS + e, tl.cumsum(size, axis=0).to(tl.int32), mask=e_mask)


@triton.jit
def _expert_sizes_kernel(
    COUNTS,
    n_experts, n_ranks, alignment,
    M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN,
    BLOCK_E: tl.constexpr,
):
    _expert_tables(COUNTS, n_experts, n_ranks, alignment, M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN, BLOCK_E)


@triton.jit
def _fill_slots(slots, COUNTS, M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN, max_len, n_experts, n_ranks, OUT,
                BLOCK_S: tl.constexpr, STEPS_E: tl.constexpr, STEPS_R: tl.constexpr):
    # Expert of the slot: how many m_offsets are <= slot (n_experts past the last block). Upper-bound
    # binary search; STEPS_E = bit_length(n_experts) halvings always reach lo == hi.
    lo = tl.zeros([BLOCK_S], tl.int32)
    hi = tl.zeros([BLOCK_S], tl.int32) + n_experts
    for _ in range(STEPS_E):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(M_OFFSETS + mid, mask=active, other=0) <= slots
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    has_expert = lo < n_experts
    e = tl.minimum(lo, n_experts - 1)
    local = slots - tl.load(M_OFFSETS + e) + tl.load(M_SIZES + e)  # position inside the expert's block
    # Rank: the last r with RANK_BEGIN[r, e] <= local (ranks with no tokens share a begin; the last wins).
    lo = tl.zeros([BLOCK_S], tl.int32)
    hi = tl.zeros([BLOCK_S], tl.int32) + n_ranks
    for _ in range(STEPS_R):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(RANK_BEGIN + mid * n_experts + e, mask=active, other=0) <= local
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    at = tl.maximum(lo - 1, 0) * n_experts + e
    within = local - tl.load(RANK_BEGIN + at)
    valid = has_expert & (within < tl.load(COUNTS + at).to(tl.int32))
    src = tl.load(ROW_START + at) + within
    tl.store(OUT + slots, tl.where(valid, src, -1), mask=slots < max_len)


@triton.jit
def _fill_indices_kernel(
    COUNTS, M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN,
    max_len, n_experts, n_ranks,
    OUT,
    BLOCK_S: tl.constexpr, STEPS_E: tl.constexpr, STEPS_R: tl.constexpr,
):
    _fill_slots(tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S), COUNTS, M_SIZES, M_OFFSETS, ROW_START,
                RANK_BEGIN, max_len, n_experts, n_ranks, OUT, BLOCK_S, STEPS_E, STEPS_R)


@triton.jit
def _generate_one_kernel(
    COUNTS,
    n_experts, n_ranks, alignment, max_len,
    M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN, OUT,
    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, STEPS_E: tl.constexpr, STEPS_R: tl.constexpr,
):
    # Both passes in one program, for up to ONE_LAUNCH_SLOTS slots (all of them in one block): the tables,
    # a barrier (every thread of the program then sees them in global memory), the slots.
    _expert_tables(COUNTS, n_experts, n_ranks, alignment, M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN, BLOCK_E)
    tl.debug_barrier()
    _fill_slots(tl.arange(0, BLOCK_S), COUNTS, M_SIZES, M_OFFSETS, ROW_START, RANK_BEGIN, max_len, n_experts,
                n_ranks, OUT, BLOCK_S, STEPS_E, STEPS_R)


@triton.jit
def _route_count_kernel(
    IDS,
    n_copies, n_experts,
    COUNTS, RANK,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # One chunk of copies: how many go to each expert (COUNTS[chunk, e]), and each copy's rank among the
    # chunk's earlier copies of its expert (RANK), from one-hot tiles of SUB copies x BLOCK_E experts and
    # their running sum down the copies. An id outside [0, n_experts) matches no stored lane.
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    seen = tl.zeros([BLOCK_E], tl.int32)  # the chunk's copies so far, per expert
    for s in range(0, CHUNK, SUB):
        i = c * CHUNK + s + tl.arange(0, SUB)
        ids = tl.load(IDS + i, mask=i < n_copies, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit + seen[None, :]
        tl.store(RANK + i, tl.sum(before * hit, axis=1), mask=i < n_copies)
        seen += tl.sum(hit, axis=0)
    tl.store(COUNTS + c * n_experts + experts, seen, mask=experts < n_experts)


@triton.jit
def _route_tables_kernel(
    COUNTS,
    n_chunks, n_experts, alignment,
    M_SIZES, M_OFFSETS, TOTALS, BASE,
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # One program: each expert's total and padded block (m_sizes, m_offsets as generate_permute_indices
    # makes them), then BASE[chunk, e], the slot of the chunk's first copy of expert e: the block's start
    # plus the copies of e in earlier chunks. Tiles of ROWS chunks x BLOCK_E experts.
    e = tl.arange(0, BLOCK_E)
    e_mask = e < n_experts
    total = tl.zeros([BLOCK_E], tl.int32)
    for r0 in range(0, n_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        tile = tl.load(COUNTS + r[:, None] * n_experts + e[None, :], mask=(r[:, None] < n_chunks) & e_mask[None, :],
                       other=0)
        total += tl.sum(tile, axis=0)
    size = tl.maximum(total, alignment)
    size = tl.where(e_mask, (size + alignment - 1) // alignment * alignment, 0)
    end = tl.cumsum(size, axis=0)
    tl.store(M_SIZES + e, size, mask=e_mask)
    tl.store(M_OFFSETS + e, end, mask=e_mask)
    tl.store(TOTALS + e, total, mask=e_mask)
    base = end - size
    for r0 in range(0, n_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        at = r[:, None] * n_experts + e[None, :]
        m = (r[:, None] < n_chunks) & e_mask[None, :]
        tile = tl.load(COUNTS + at, mask=m, other=0)
        tl.store(BASE + at, base[None, :] + tl.cumsum(tile, axis=0) - tile, mask=m)
        base += tl.sum(tile, axis=0)


@triton.jit
def _route_fill_kernel(
    IDS, RANK, BASE, M_SIZES, M_OFFSETS, TOTALS,
    n_copies, n_chunks, n_experts, max_len,
    OUT,
    CHUNK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Every slot written once, by one of two kinds of program: the first n_chunks each write their chunk's
    # copies to their slots (BASE + RANK; a copy whose slot is >= max_len is dropped); then one program per
    # expert writes -1 over its block's padding (past its copies) and over its share of the slots past the
    # last block.
    p = tl.program_id(0)
    if p < n_chunks:
        i = p * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(IDS + i, mask=i < n_copies, other=-1)
        ok = (i < n_copies) & (ids >= 0) & (ids < n_experts)
        e = tl.where(ok, ids, 0).to(tl.int32)
        slot = tl.load(BASE + p * n_experts + e, mask=ok, other=0) + tl.load(RANK + i, mask=ok, other=0)
        tl.store(OUT + slot, i, mask=ok & (slot < max_len))
    else:  # (names of their own: a name bound in both branches must have one type)
        expert = p - n_chunks
        end = tl.load(M_OFFSETS + expert)
        pad_end = tl.minimum(end, max_len)
        last = tl.load(M_OFFSETS + n_experts - 1)
        share = tl.cdiv(tl.maximum(max_len - last, 0), n_experts)
        tail_end = tl.minimum(last + (expert + 1) * share, max_len)
        minus_one = tl.full([BLOCK_S], -1, tl.int32)
        for s0 in range(end - tl.load(M_SIZES + expert) + tl.load(TOTALS + expert), pad_end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            tl.store(OUT + s, minus_one, mask=s < pad_end)
        for s0 in range(last + expert * share, tail_end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            tl.store(OUT + s, minus_one, mask=s < tail_end)
