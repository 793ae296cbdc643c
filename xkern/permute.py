"""Padded expert row gather for MoE: kernels, launch plans and the host-side permutation check.

Contract (torchtitan's `generate_permute_indices`): `counts[r * E + e]` tokens of local expert `e` come
from rank `r` (E = experts_per_rank); they arrive rank-major, so the source row of the k-th of them is
    row_start[r, e] + k,   row_start[r, e] = sum of counts before index r * E + e.
Each expert gets a block of the padded, expert-major buffer:
    m_sizes[e]   = roundup(max(sum_r counts[r, e], alignment), alignment)      (int32)
    m_offsets[e] = m_sizes[0] + ... + m_sizes[e]                               (int32, inclusive)
and inside its block, starting at m_offsets[e] - m_sizes[e], rows are ordered by rank, then by arrival.
`permuted_indices[s]` (int32, s < max_len) is the source row of slot s, or -1 at padding and past the last
block; rows whose slot would be >= max_len are dropped.

Kernels (plans are fixed, from shapes and element sizes only, so both front ends launch the same binaries):
  _gather_rows_kernel      out[i, :] = src[idx[i], :], a zero row where idx[i] is -1 (or out of range):
                           permute_rows and unpermute_rows's backward.
  _scatter_inverse_kernel  raw[idx[i]] = i for valid slots, into an uninitialised buffer;
  _settle_inverse_kernel   inv[r] = raw[r] if idx[raw[r]] == r else -1: rows no slot names (dropped past
                           max_len) get -1 without a pre-fill, which a JAX kernel output cannot have
                           (inverse_permutation);
  _gather_settled_rows_kernel  out[r, :] = y[raw[r], :] if idx[raw[r]] == r, else a zero row: unpermute_rows
                           and permute_rows's backward, two launches (scatter, gather) with the settle
                           folded into the gather.
  _inverse_search_kernel, and _gather_rows_kernel with BLOCK_S  the same two ops in one launch for up to
                           ONE_LAUNCH_SLOTS slots (`one_launch`): each program finds its rows' slots by
                           scanning all of idx (work rows x slots; saves a launch where the call is host-bound).
  _gather_token_rows_kernel  permute_rows with top_k: slot s reads token idx[s] // top_k (x keeps one row per
                           token; no [T * top_k, H] copy);
  _scatter_token_rows_kernel the same, token-major: each token row read once, written to its copies' slots
                           (after _scatter_inverse_kernel); padding slots zeroed by the programs after them.
                           Above ONE_LAUNCH_SLOTS slots (`permute_recipe`);
  _combine_rows_kernel     unpermute_rows with top_k or probs: out[t] = sum_j p[t, j] * y[slot of t * top_k + j]
                           in FP32, j in order, rounded once, slots through the raw scatter settled on the fly
                           (after _scatter_inverse_kernel: two launches); also permute_rows(top_k)'s backward;
  _combine_bwd_kernel      the weighted combine's backward, per slot: dy[s] = p * dout[t] and dprobs[r] =
                           sum_h y[s, h] * dout[t, h] (FP32) from one read of each row, no atomics;
  _combine_bwd_token_kernel  the same, token-major: each dout row read once (after _scatter_inverse_kernel).
                           Above ONE_LAUNCH_SLOTS slots (`combine_bwd_recipe`);
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

import dataclasses
import functools
import math

import numpy as np
import triton
import triton.language as tl

from xkern.launch import (
    FLOATS,
    INT32_MAX,
    ITEMSIZE,
    POINTER_TYPES,
    Buffer,
    Launch,
    Recipe,
    Step,
    cdiv,
    check_int,
    check_row_count,
    next_pow2,
    row_align,
)


@triton.jit
def _copy_rows(SRC, OUT, src, rows, row_mask, hit, n_cols, src_row_stride, BLOCK_H: tl.constexpr):
    # out[rows] = src rows `src` where `hit`, zero rows elsewhere (never a stray read)
    src_ptr = SRC + src[:, None] * src_row_stride
    out_ptr = OUT + rows.to(tl.int64)[:, None] * n_cols
    for start in range(0, n_cols, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = (cols < n_cols)[None, :]
        vals = tl.load(src_ptr + cols[None, :], mask=hit[:, None] & col_mask, other=0.0)
        tl.store(out_ptr + cols[None, :], vals, mask=row_mask[:, None] & col_mask)


@triton.jit
def _find_slots(IDX, rows, n_slots, n_rows, BLOCK_S: tl.constexpr):
    # The slot naming each of `rows` (the last, should several), -1 where none does: a scan of all of IDX,
    # BLOCK_S slots at a time. Work rows x slots, so only for small problems (`one_launch`), where it saves
    # the scatter's launch. In int32 (rows and slots fit it, check_gather_sizes): an index naming no row
    # (-1, out of range, or past int32 in an int64 IDX) becomes -1 before the compares.
    found = rows * 0 - 1
    for start in range(0, n_slots, BLOCK_S):
        slots = start + tl.arange(0, BLOCK_S)
        named = tl.load(IDX + slots, mask=slots < n_slots, other=-1)
        named = tl.where((named >= 0) & (named < n_rows), named, -1).to(tl.int32)
        hit = named[None, :] == rows[:, None]
        found = tl.maximum(found, tl.max(tl.where(hit, slots[None, :], -1), axis=1))
    return found


@triton.jit(do_not_specialize=["n_rows", "n_cols", "n_src_rows", "src_row_stride"])
def _gather_rows_kernel(
    SRC, IDX,
    n_rows, n_cols, n_src_rows, src_row_stride,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
):
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN  # the plan's alignment made visible: 16-byte accesses
    src_row_stride = src_row_stride // ROW_ALIGN * ROW_ALIGN
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    if BLOCK_S:  # unpermute_rows in one launch (`one_launch`): row r reads the slot naming it (SRC: a row per slot)
        src = _find_slots(IDX, rows, n_src_rows, n_rows, BLOCK_S).to(tl.int64)
    else:
        src = tl.load(IDX + rows, mask=row_mask, other=-1).to(tl.int64)
    # -1 is padding; an out-of-range index (possible only without validate=True) also gives a zero row.
    hit = (src >= 0) & (src < n_src_rows)
    _copy_rows(SRC, OUT, src, rows, row_mask, hit, n_cols, src_row_stride, BLOCK_H)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "n_src_rows", "src_row_stride"])
def _gather_settled_rows_kernel(
    SRC, RAW, IDX,
    n_rows, n_cols, n_src_rows, src_row_stride,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # unpermute's gather through RAW, `_scatter_inverse_kernel`'s output, settled on the fly (one launch
    # fewer than settling into an inverse first): row r reads slot RAW[r] only if IDX[that slot] == r, so
    # RAW's uninitialised entries (rows no slot names) give zero rows. SRC has one row per slot.
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    src_row_stride = src_row_stride // ROW_ALIGN * ROW_ALIGN
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    slot = tl.load(RAW + rows, mask=row_mask, other=-1).to(tl.int64)
    ok = row_mask & (slot >= 0) & (slot < n_src_rows)
    back = tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64)
    hit = ok & (back == rows.to(tl.int64))
    _copy_rows(SRC, OUT, slot, rows, row_mask, hit, n_cols, src_row_stride, BLOCK_H)


@triton.jit(do_not_specialize=["n_rows", "n_cols", "n_src_rows", "src_row_stride", "top_k"])
def _gather_token_rows_kernel(
    SRC, IDX,
    n_rows, n_cols, n_src_rows, src_row_stride, top_k,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # permute_rows(top_k): slot s holds routed copy r = idx[s] = t * top_k + j, read from token row t of SRC.
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    src_row_stride = src_row_stride // ROW_ALIGN * ROW_ALIGN
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    copy = tl.load(IDX + rows, mask=row_mask, other=-1).to(tl.int64)
    hit = (copy >= 0) & (copy < n_src_rows.to(tl.int64) * top_k)
    src = tl.where(hit, copy // top_k, 0)
    _copy_rows(SRC, OUT, src, rows, row_mask, hit, n_cols, src_row_stride, BLOCK_H)


@triton.jit
def _settled_slot(RAW, IDX, copy, tok_mask, n_slots):
    # The slot of each `copy` (RAW[copy], the raw scatter's) where IDX names the copy there, and that mask.
    slot = tl.load(RAW + copy, mask=tok_mask, other=-1).to(tl.int64)
    ok = tok_mask & (slot >= 0) & (slot < n_slots)
    return slot, ok & (tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64) == copy)


@triton.jit
def _zero_padding_rows(OUT, IDX, block, n_slots, n_copies, n_cols, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    # The token-major kernels' padding: zero rows of OUT at the slots of this block that name no copy.
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    copy = tl.load(IDX + slots, mask=slots < n_slots, other=0).to(tl.int64)
    pad = (slots < n_slots) & ((copy < 0) | (copy >= n_copies))
    out_ptr = OUT + slots.to(tl.int64)[:, None] * n_cols
    for start in range(0, n_cols, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        tl.store(out_ptr + cols[None, :], tl.zeros([BLOCK_M, BLOCK_H], OUT.dtype.element_ty),
                 mask=pad[:, None] & (cols < n_cols)[None, :])


@triton.jit(do_not_specialize=["n_tokens", "n_cols", "n_slots", "src_row_stride", "token_programs"])
def _scatter_token_rows_kernel(
    SRC, RAW, IDX,
    n_tokens, n_cols, n_slots, src_row_stride, token_programs,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr,
):
    # permute_rows(top_k) token-major (`permute_recipe`): the first `token_programs` programs read
    # BLOCK_M token rows once and write each to the slots of its TOP_K copies (RAW[copy], settled by IDX as in
    # the combine: a copy with no slot writes nothing), where the gather reads a token row once per copy; the
    # programs after them write the zero rows of the padding slots (IDX naming no copy).
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    src_row_stride = src_row_stride // ROW_ALIGN * ROW_ALIGN
    pid = tl.program_id(0)
    if pid < token_programs:
        tokens = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        tok_mask = tokens < n_tokens
        first = tokens.to(tl.int64) * TOP_K
        src_ptr = SRC + tokens.to(tl.int64)[:, None] * src_row_stride
        for start in range(0, n_cols, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_mask = (cols < n_cols)[None, :]
            vals = tl.load(src_ptr + cols[None, :], mask=tok_mask[:, None] & col_mask, other=0.0)
            for j in tl.static_range(TOP_K):
                # `_settled_slot` written out: a store through a call's result counts, in torch.compile's
                # access analysis, as a write to every pointer passed to the call (here RAW and IDX)
                copy = first + j
                slot = tl.load(RAW + copy, mask=tok_mask, other=-1).to(tl.int64)
                ok = tok_mask & (slot >= 0) & (slot < n_slots)
                hit = ok & (tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64) == copy)
                tl.store(OUT + slot[:, None] * n_cols + cols[None, :], vals, mask=hit[:, None] & col_mask)
    else:
        _zero_padding_rows(OUT, IDX, pid - token_programs, n_slots, n_tokens * TOP_K, n_cols,
                           BLOCK_M, BLOCK_H)


@triton.jit
def _combine_copy(SRC, RAW, IDX, PROBS, copy, tok_mask, n_src_rows, src_row_stride, cols, col_mask,
                  HAS_PROBS: tl.constexpr):
    # One routed copy's term of `_combine_rows_kernel`, FP32: p * SRC[its slot], 0 where it has none.
    slot, hit = _settled_slot(RAW, IDX, copy, tok_mask, n_src_rows)
    vals = tl.load(SRC + slot[:, None] * src_row_stride + cols[None, :], mask=hit[:, None] & col_mask,
                   other=0.0).to(tl.float32)
    if HAS_PROBS:
        vals = vals * tl.load(PROBS + copy, mask=hit, other=0.0).to(tl.float32)[:, None]
    return vals


@triton.jit(do_not_specialize=["n_tokens", "n_cols", "n_src_rows", "src_row_stride", "top_k"])
def _combine_rows_kernel(
    SRC, RAW, IDX, PROBS,
    n_tokens, n_cols, n_src_rows, src_row_stride, top_k,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, HAS_PROBS: tl.constexpr, TOP_K: tl.constexpr,
):
    # out[t] = sum_j p[t, j] * SRC[slot of copy t * top_k + j], FP32 in j order, one rounding. The slot is
    # RAW[copy] (`_scatter_inverse_kernel`'s output) if IDX names the copy there, as in
    # _gather_settled_rows_kernel: a dropped copy (no slot) adds 0. Without HAS_PROBS, p = 1 (PROBS unread).
    # TOP_K 0: a loop of top_k steps, each waiting on its slot, index and row loads; TOP_K = top_k: the loop
    # unrolled, every copy's loads free to be in flight together (the same sums, in the same order).
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    src_row_stride = src_row_stride // ROW_ALIGN * ROW_ALIGN
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_mask = tokens < n_tokens
    first = tokens.to(tl.int64) * top_k
    out_ptr = OUT + tokens.to(tl.int64)[:, None] * n_cols
    for start in range(0, n_cols, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = (cols < n_cols)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        if TOP_K == 0:  # more than MAX_UNROLL_K copies
            for j in range(top_k):  # the slot lookups are re-read per column chunk: cache hits, no [M, k] tile
                acc += _combine_copy(SRC, RAW, IDX, PROBS, first + j, tok_mask, n_src_rows, src_row_stride, cols,
                                     col_mask, HAS_PROBS)
        else:
            for j in tl.static_range(TOP_K):
                acc += _combine_copy(SRC, RAW, IDX, PROBS, first + j, tok_mask, n_src_rows, src_row_stride, cols,
                                     col_mask, HAS_PROBS)
        tl.store(out_ptr + cols[None, :], acc.to(OUT.dtype.element_ty), mask=tok_mask[:, None] & col_mask)


@triton.jit(do_not_specialize=["n_slots", "n_cols", "num_rows", "dout_row_stride", "y_row_stride", "top_k"])
def _combine_bwd_kernel(
    DOUT, Y, IDX, PROBS,
    n_slots, n_cols, num_rows, dout_row_stride, y_row_stride, top_k,
    DY, DPROBS,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Slot s holds copy r = IDX[s] of token t = r // top_k: DY[s] = p[r] * DOUT[t] (a zero row at padding),
    # DPROBS[r] = sum_h Y[s, h] * DOUT[t, h] in FP32. Each copy has one slot, so the DPROBS stores never meet
    # (no atomics); DPROBS arrives zero-filled, which leaves 0 for dropped copies.
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    dout_row_stride = dout_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_mask = slots < n_slots
    copy = tl.load(IDX + slots, mask=slot_mask, other=-1).to(tl.int64)
    hit = (copy >= 0) & (copy < num_rows)
    token = tl.where(hit, copy // top_k, 0)
    p = tl.load(PROBS + copy, mask=hit, other=0.0).to(tl.float32)
    dout_ptr = DOUT + token[:, None] * dout_row_stride
    y_ptr = Y + slots.to(tl.int64)[:, None] * y_row_stride
    dy_ptr = DY + slots.to(tl.int64)[:, None] * n_cols
    dot = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n_cols, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = (cols < n_cols)[None, :]
        d = tl.load(dout_ptr + cols[None, :], mask=hit[:, None] & col_mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + cols[None, :], mask=hit[:, None] & col_mask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + cols[None, :], (d * p[:, None]).to(DY.dtype.element_ty), mask=slot_mask[:, None] & col_mask)
        dot += tl.sum(y * d, axis=1)
    tl.store(DPROBS + copy, dot.to(DPROBS.dtype.element_ty), mask=hit)


@triton.jit(do_not_specialize=["n_tokens", "n_cols", "n_slots", "dout_row_stride", "y_row_stride",
                               "token_programs"])
def _combine_bwd_token_kernel(
    DOUT, Y, RAW, IDX, PROBS,
    n_tokens, n_cols, n_slots, dout_row_stride, y_row_stride, token_programs,
    DY, DPROBS,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
):
    # `_combine_bwd_kernel` token-major (`combine_bwd_recipe`): the first `token_programs` programs
    # read BLOCK_M rows of DOUT once and, for each of their TOP_K copies with a slot (RAW settled by IDX), write
    # DY[slot] = p * DOUT[t] and sum DPROBS[copy] = sum_h Y[slot, h] * DOUT[t, h] in FP32, chunk by chunk as
    # the slot-major kernel does; the programs after them write the zero rows of the padding slots. DPROBS
    # arrives zero-filled (dropped copies).
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    dout_row_stride = dout_row_stride // ROW_ALIGN * ROW_ALIGN
    y_row_stride = y_row_stride // ROW_ALIGN * ROW_ALIGN
    pid = tl.program_id(0)
    if pid < token_programs:
        tokens = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        tok_mask = tokens < n_tokens
        first = tokens.to(tl.int64) * TOP_K
        ks = tl.arange(0, K_PAD)[None, :]
        dots = tl.zeros([BLOCK_M, K_PAD], tl.float32)
        dout_ptr = DOUT + tokens.to(tl.int64)[:, None] * dout_row_stride
        for start in range(0, n_cols, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            col_mask = (cols < n_cols)[None, :]
            d = tl.load(dout_ptr + cols[None, :], mask=tok_mask[:, None] & col_mask, other=0.0).to(tl.float32)
            for j in tl.static_range(TOP_K):  # `_settled_slot` written out, as in _scatter_token_rows_kernel
                copy = first + j
                slot = tl.load(RAW + copy, mask=tok_mask, other=-1).to(tl.int64)
                ok = tok_mask & (slot >= 0) & (slot < n_slots)
                hit = ok & (tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64) == copy)
                p = tl.load(PROBS + copy, mask=hit, other=0.0).to(tl.float32)
                y = tl.load(Y + slot[:, None] * y_row_stride + cols[None, :], mask=hit[:, None] & col_mask,
                            other=0.0).to(tl.float32)
                tl.store(DY + slot[:, None] * n_cols + cols[None, :], (d * p[:, None]).to(DY.dtype.element_ty),
                         mask=hit[:, None] & col_mask)
                dots = tl.where(ks == j, dots + tl.sum(y * d, axis=1)[:, None], dots)
        for j in tl.static_range(TOP_K):  # the call's result only masks the store here
            _, hit = _settled_slot(RAW, IDX, first + j, tok_mask, n_slots)
            dot = tl.sum(tl.where(ks == j, dots, 0.0), axis=1)
            tl.store(DPROBS + first + j, dot.to(DPROBS.dtype.element_ty), mask=hit)
    else:
        _zero_padding_rows(DY, IDX, pid - token_programs, n_slots, n_tokens * TOP_K, n_cols,
                           BLOCK_M, BLOCK_H)


@triton.jit
def _scatter_inverse_kernel(IDX, n_slots, n_rows, RAW, BLOCK: tl.constexpr):
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = slots < n_slots
    rows = tl.load(IDX + slots, mask=in_bounds, other=-1).to(tl.int64)
    ok = in_bounds & (rows >= 0) & (rows < n_rows)
    tl.store(RAW + rows, slots.to(RAW.dtype.element_ty), mask=ok)


@triton.jit
def _settle_inverse_kernel(IDX, RAW, n_slots, n_rows, INV, BLOCK: tl.constexpr):
    # RAW is uninitialised where no slot named the row: keep a value only if it points back at the row.
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = rows < n_rows
    slot = tl.load(RAW + rows, mask=in_bounds, other=-1).to(tl.int64)
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


# ---------------------------------------------------------------------------------------------------
# Launch plans: fixed (no autotuning), from shapes and the element size only.

ROW_CHUNK_BYTES = 2048  # columns per inner-loop step: 1024 bf16, 512 fp32 (7168 = 7 x 1024, no tail)
TILE_BYTES = 16384      # bytes per loop step: 8 rows x 1024 bf16; 8 warps move 4 16-byte vectors a thread
MAX_BLOCK_M = 1024      # rows per program for very narrow rows
INDEX_BLOCK = 1024      # slots (or rows) per program of the index kernels
ONE_LAUNCH_SLOTS = 4096 # `one_launch`: at most this many slots, the index ops in one launch
SEARCH_PAIRS = 16       # (row, slot) pairs each thread compares per step of the search kernels' scan
SEARCH_ROWS = 64        # rows per program of the search kernels (each program scans every slot)


def one_launch(n_slots: int) -> bool:
    """The index ops' regime rule: up to ONE_LAUNCH_SLOTS slots (decode steps, small batches: host-bound
    calls) inverse_permutation and unpermute_rows take one launch whose programs each scan every slot, and
    generate_permute_indices one program for its tables and its slots; above it (device-bound) the scatter
    then the settle or the settled gather, and the tables then the parallel fill: two launches each."""
    return n_slots <= ONE_LAUNCH_SLOTS


def plan_gather_rows(n_rows: int, n_cols: int, elem_size: int, src_row_stride: int | None = None,
                     settled: bool = False, search: bool = False) -> Launch:
    """`out[i, :] = src[idx[i], :]` for `n_rows` output rows of `n_cols` elements of `elem_size` bytes.

    Arrays `(src, idx, out)`, or with `settled` `(src, raw, idx, out)` (unpermute's gather through the raw
    scatter); with `search` `(src, idx, out)` is unpermute's whole gather, `out[r] = src[slot naming r]`
    (`one_launch`); scalars `n_rows, n_cols, n_src_rows, src_row_stride`; out is contiguous [n_rows, n_cols],
    src's last dim contiguous (its row stride defaults to n_cols)."""
    align = row_align(n_cols, n_cols if src_row_stride is None else src_row_stride)
    block_m, block_h, num_warps = _row_tile(n_cols, elem_size)
    constexprs = {"ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_H": block_h}
    if settled:
        return Launch(_gather_settled_rows_kernel, (max(1, cdiv(n_rows, block_m)),), num_warps, constexprs)
    if search:  # fewer rows per program (each scans every slot), at least 4 warps for the scan
        block_m, num_warps = min(block_m, SEARCH_ROWS), max(num_warps, 4)
    constexprs.update(BLOCK_M=block_m, BLOCK_S=_search_block(block_m, num_warps) if search else 0)
    return Launch(_gather_rows_kernel, (max(1, cdiv(n_rows, block_m)),), num_warps, constexprs)


def _row_tile(n_cols: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps) of the row kernels: TILE_BYTES per loop step, ROW_CHUNK_BYTES per row."""
    block_h = min(next_pow2(n_cols), ROW_CHUNK_BYTES // elem_size)
    block_m = min(MAX_BLOCK_M, TILE_BYTES // (block_h * elem_size))
    return block_m, block_h, max(1, min(8, block_m * block_h * elem_size // 2048))


# The token-major kernels (the weighted combine and the copy-sum, permute_rows(top_k) and the combine's backward
# above ONE_LAUNCH_SLOTS) and the slot-major combine backward: TOKEN_ROWS rows of TOKEN_STEP_BYTES per step, 4
# warps (one 16-byte access a thread), the copies' loop unrolled up to MAX_UNROLL_K copies. At the Qwen3-MoE
# size (16384 tokens, top 8, hidden 2048 bf16; H100, 2026-12-06, L2 flushed, `tools.moe_probe`): the combine
# 211.8 us against 229.2 at the row tile (8 x 1024, 8 warps, a loop over the copies), the combine backward
# token-major 415.7 against 647.5 at the row tile, permute_rows(top_k) token-major 233.2 against 243.2 (0.86,
# 0.91 and 0.86 of the copy ceiling). The backward's dprobs sum its FP32 terms in BLOCK_H chunks: one tile for
# both of its forms keeps them bitwise equal.
TOKEN_ROWS = 4
TOKEN_STEP_BYTES = 512
MAX_UNROLL_K = 8


def _token_tile(n_cols: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps) of the token-major kernels, the combines and the combine backward."""
    return TOKEN_ROWS, min(next_pow2(n_cols), TOKEN_STEP_BYTES // elem_size), 4


def plan_gather_token_rows(n_rows: int, n_cols: int, elem_size: int, src_row_stride: int) -> Launch:
    """permute_rows(top_k > 1): arrays `(src, idx, out)`, scalars `n_rows, n_cols, n_src_rows, src_row_stride,
    top_k`; the tile of `plan_gather_rows`."""
    block_m, block_h, num_warps = _row_tile(n_cols, elem_size)
    return Launch(_gather_token_rows_kernel, (max(1, cdiv(n_rows, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, src_row_stride), "BLOCK_M": block_m, "BLOCK_H": block_h})


def plan_combine(n_tokens: int, n_cols: int, elem_size: int, src_row_stride: int, has_probs: bool,
                 top_k: int) -> Launch:
    """The weighted combine: arrays `(src, raw, idx, probs, out)` (probs: idx again without probs), scalars
    `n_tokens, n_cols, n_src_rows, src_row_stride, top_k`; BLOCK_M tokens per program, each summing its
    top_k slot rows chunk by chunk into an FP32 tile (`_token_tile`), the copies unrolled (TOP_K) up to
    MAX_UNROLL_K of them."""
    block_m, block_h, num_warps = _token_tile(n_cols, elem_size)
    return Launch(_combine_rows_kernel, (max(1, cdiv(n_tokens, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, src_row_stride), "BLOCK_M": block_m, "BLOCK_H": block_h,
                   "HAS_PROBS": has_probs, "TOP_K": top_k if top_k <= MAX_UNROLL_K else 0})


def plan_combine_bwd(n_slots: int, n_cols: int, elem_size: int, dout_row_stride: int, y_row_stride: int) -> Launch:
    """The weighted combine's backward: arrays `(dout, y, idx, probs, dy, dprobs)`, scalars `n_slots, n_cols,
    num_rows, dout_row_stride, y_row_stride, top_k`; BLOCK_M slots per program, the token-major form's tile."""
    block_m, block_h, num_warps = _token_tile(n_cols, elem_size)
    return Launch(_combine_bwd_kernel, (max(1, cdiv(n_slots, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, dout_row_stride, y_row_stride), "BLOCK_M": block_m,
                   "BLOCK_H": block_h})


def _search_block(rows: int, num_warps: int) -> int:
    """Slots per step of a search kernel's scan: SEARCH_PAIRS (row, slot) compares per thread."""
    return min(1024, max(1, SEARCH_PAIRS * 32 * num_warps // rows))


def plan_inverse(n_slots: int, n_rows: int) -> tuple[Launch, ...]:
    """Scatter `raw[idx[i]] = i` over `n_slots` slots, then settle `inv` over `n_rows` rows; or, when
    `one_launch(n_slots)`, the one search launch.

    Arrays and scalars: scatter `(idx, raw)`, settle `(idx, raw, inv)`, search `(idx, inv)`, all with
    `n_slots, n_rows`."""
    if one_launch(n_slots):
        return (Launch(_inverse_search_kernel, (max(1, cdiv(n_rows, SEARCH_ROWS)),), 4,
                       {"BLOCK": SEARCH_ROWS, "BLOCK_S": _search_block(SEARCH_ROWS, 4)}),)
    return plan_scatter_inverse(n_slots), \
        Launch(_settle_inverse_kernel, (max(1, cdiv(n_rows, INDEX_BLOCK)),), 4, {"BLOCK": INDEX_BLOCK})


def plan_scatter_inverse(n_slots: int) -> Launch:
    return Launch(_scatter_inverse_kernel, (max(1, cdiv(n_slots, INDEX_BLOCK)),), 4, {"BLOCK": INDEX_BLOCK})


def plan_generate_indices(experts_per_rank: int, num_ranks: int, max_len: int) -> tuple[Launch, ...]:
    """The one-program size/offset pass and the per-slot fill; or, when `one_launch(max_len)`, both in one
    program over every slot.

    Arrays: sizes `(counts, m_sizes, m_offsets, row_start, rank_begin)` with `n_experts, n_ranks,
    alignment`; fill `(counts, m_sizes, m_offsets, row_start, rank_begin, out)` with `max_len, n_experts,
    n_ranks`; the one launch `(counts, m_sizes, m_offsets, row_start, rank_begin, out)` with all four.
    row_start and rank_begin are int32 scratch of num_ranks * experts_per_rank elements."""
    block_e = next_pow2(experts_per_rank)
    steps = {"STEPS_E": experts_per_rank.bit_length(), "STEPS_R": num_ranks.bit_length()}
    if 0 < max_len and one_launch(max_len):
        block_s = next_pow2(max_len)
        return (Launch(_generate_one_kernel, (1,), max(4, min(16, block_s // 256)),
                       {"BLOCK_E": block_e, "BLOCK_S": block_s, **steps}),)
    sizes = Launch(_expert_sizes_kernel, (1,), max(1, min(8, block_e // 256)), {"BLOCK_E": block_e})
    fill = Launch(_fill_indices_kernel, (max(1, cdiv(max_len, INDEX_BLOCK)),), 4, {"BLOCK_S": INDEX_BLOCK, **steps})
    return sizes, fill


ROUTE_CHUNK = 1024    # copies per program of the routing kernels (tables of n_copies / ROUTE_CHUNK x E)
ROUTE_TILE = 16384    # elements of the routing kernels' one-hot and table tiles
MAX_ROUTE_EXPERTS = 16384  # a row of every expert's counts is one tile of the routing kernels


def plan_route_indices(n_copies: int, n_experts: int, max_len: int) -> tuple[Launch, Launch, Launch]:
    """topk_permute_indices: the per-chunk counts and ranks, the one-program tables, the fill.

    Arrays: count `(ids, counts, rank)` with `n_copies, n_experts`; tables `(counts, m_sizes, m_offsets,
    totals, base)` with `n_chunks, n_experts, alignment`; fill `(ids, rank, base, m_sizes, m_offsets, totals,
    out)` with `n_copies, n_chunks, n_experts, max_len`. counts and base are int32 [n_chunks, n_experts],
    rank int32 [n_copies], totals int32 [n_experts]; n_chunks = the count launch's grid."""
    block_e = next_pow2(n_experts)
    n_chunks = max(1, cdiv(n_copies, ROUTE_CHUNK))
    sub = max(1, min(64, ROUTE_TILE // block_e))
    count = Launch(_route_count_kernel, (n_chunks,), 8, {"CHUNK": ROUTE_CHUNK, "SUB": sub, "BLOCK_E": block_e})
    tables = Launch(_route_tables_kernel, (1,), 8, {"ROWS": max(1, ROUTE_TILE // 2 // block_e), "BLOCK_E": block_e})
    fill = Launch(_route_fill_kernel, (n_chunks + n_experts,), 4, {"CHUNK": ROUTE_CHUNK, "BLOCK_S": 256})
    return count, tables, fill


def compile_variants() -> list[tuple[Launch, dict]]:
    """Every (kernel, constexprs) the plans can choose, with a triton 3.6 `ASTSource` signature
    (constexpr parameters are listed as "constexpr"; their values are `launch.constexprs`):
    `triton.compile(ASTSource(l.kernel, sig, l.constexprs), target=..., options={"num_warps": l.num_warps})`.
    The generate-indices kernels are listed for a few expert/rank counts (their constexprs depend on them)."""
    variants = []
    ptr = {2: ("*bf16", "*fp16"), 4: ("*fp32",)}
    for elem_size, dtypes in ptr.items():
        seen = set()
        for log_cols in range(0, 16):
            plan = plan_gather_rows(1024, 1 << log_cols, elem_size)
            key = tuple(plan.constexprs.values())
            if key in seen:
                continue
            seen.add(key)
            settled = plan_gather_rows(1024, 1 << log_cols, elem_size, settled=True)
            search = plan_gather_rows(1024, 1 << log_cols, elem_size, search=True)
            for dtype in dtypes:
                for index in ("*i32", "*i64"):
                    sig = {"SRC": dtype, "IDX": index, "OUT": dtype, "n_rows": "i32", "n_cols": "i32",
                           "n_src_rows": "i32", "src_row_stride": "i64", "BLOCK_M": "constexpr",
                           "BLOCK_H": "constexpr"}
                    variants.append((plan, sig))
                    variants.append((settled, {**sig, "RAW": index}))
                    variants.append((search, {**sig, "BLOCK_S": "constexpr"}))
    dtype_of = {ptr: name for name, ptr in POINTER_TYPES.items()}
    for elem_size, dtypes in ptr.items():  # the top_k forms: the narrowest, a middle and the chunked tiles
        for n_cols in (1, 16, 128, 1000, 7168):
            token = plan_gather_token_rows(1024, n_cols, elem_size, n_cols)
            bwd = plan_combine_bwd(1024, n_cols, elem_size, n_cols, n_cols)
            # the copies' loop unrolled (top_k 1 and 8: the narrowest and widest unroll) or not (top_k 9)
            top_ks = (1, MAX_UNROLL_K, MAX_UNROLL_K + 1) if n_cols in (1, 128, 7168) else (MAX_UNROLL_K,)
            for dtype in dtypes:
                for index in ("*i32", "*i64"):
                    rows = {"IDX": index, "n_cols": "i32", "src_row_stride": "i64"}
                    variants.append((token, {"SRC": dtype, "OUT": dtype, **rows}))
                    for probs in (None, "*fp32", "*bf16"):
                        for top_k in top_ks:
                            combine = plan_combine(1024, n_cols, elem_size, n_cols, probs is not None, top_k)
                            variants.append((combine, {"SRC": dtype, "OUT": dtype, "RAW": index,
                                                       "PROBS": probs or index, **rows}))
                        # dprobs in probs' dtype; and in fp32 for 16-bit probs (jax_api's combine backward with
                        # the hidden dim sharded sums the shards' dprobs in fp32 before rounding once)
                        for dprobs in {probs: None, "*fp32": None} if probs else ():
                            ptrs = {"DOUT": dtype, "Y": dtype, "DY": dtype, "IDX": index, "PROBS": probs,
                                    "DPROBS": dprobs}
                            variants.append((bwd, ptrs))
                            if n_cols in (1, 128, 7168):
                                for top_k in (2, MAX_UNROLL_K):
                                    steps = combine_bwd_recipe(1024, n_cols, 1024, dtype_of[dtype], n_cols, n_cols,
                                                               top_k, dtype_of[probs], token_major=True).steps
                                    variants.append((steps[-1].launch, {**ptrs, "RAW": index}))
                    if n_cols in (1, 128, 7168):
                        for top_k in (2, MAX_UNROLL_K):
                            steps = permute_recipe(1024, n_cols, 1024, dtype_of[dtype], n_cols, top_k,
                                                   token_major=True).steps
                            variants.append((steps[-1].launch, {"SRC": dtype, "RAW": index, "OUT": dtype, **rows}))
    for index in ("*i32", "*i64"):
        scatter, settle = plan_inverse(ONE_LAUNCH_SLOTS + 1, 4096)
        (search,) = plan_inverse(ONE_LAUNCH_SLOTS, 4096)
        variants.append((scatter, {"IDX": index, "RAW": index, "n_slots": "i32", "n_rows": "i32",
                                   "BLOCK": "constexpr"}))
        variants.append((settle, {"IDX": index, "RAW": index, "INV": index, "n_slots": "i32", "n_rows": "i32",
                                  "BLOCK": "constexpr"}))
        variants.append((search, {"IDX": index, "INV": index, "n_slots": "i32", "n_rows": "i32",
                                  "BLOCK": "constexpr", "BLOCK_S": "constexpr"}))
    tables = {"M_SIZES": "*i32", "M_OFFSETS": "*i32", "ROW_START": "*i32", "RANK_BEGIN": "*i32"}
    for experts, ranks in ((1, 1), (8, 1), (4, 64), (32, 8), (256, 1)):
        sizes, fill = plan_generate_indices(experts, ranks, 65536)
        for max_len in (1, 100, ONE_LAUNCH_SLOTS):
            (one,) = plan_generate_indices(experts, ranks, max_len)
            for counts in ("*i32", "*i64"):
                variants.append((one, {"COUNTS": counts, **tables, "OUT": "*i32", "n_experts": "i32",
                                       "n_ranks": "i32", "alignment": "i32", "max_len": "i32",
                                       "BLOCK_E": "constexpr", "BLOCK_S": "constexpr", "STEPS_E": "constexpr",
                                       "STEPS_R": "constexpr"}))
        for counts in ("*i32", "*i64"):
            variants.append((sizes, {"COUNTS": counts, "M_SIZES": "*i32", "M_OFFSETS": "*i32",
                                     "ROW_START": "*i32", "RANK_BEGIN": "*i32", "n_experts": "i32",
                                     "n_ranks": "i32", "alignment": "i32", "BLOCK_E": "constexpr"}))
            variants.append((fill, {"COUNTS": counts, "M_SIZES": "*i32", "M_OFFSETS": "*i32",
                                    "ROW_START": "*i32", "RANK_BEGIN": "*i32", "OUT": "*i32", "max_len": "i32",
                                    "n_experts": "i32", "n_ranks": "i32", "BLOCK_S": "constexpr",
                                    "STEPS_E": "constexpr", "STEPS_R": "constexpr"}))
    for experts in (1, 8, 128, 256, 1000, MAX_ROUTE_EXPERTS):
        count, tables, fill = plan_route_indices(65536, experts, 65536 + 16 * experts)
        for ids in ("*i32", "*i64"):
            variants.append((count, {"IDS": ids, "n_copies": "i32", "n_experts": "i32", "COUNTS": "*i32",
                                     "RANK": "*i32", "CHUNK": "constexpr", "SUB": "constexpr", "BLOCK_E": "constexpr"}))
            variants.append((fill, {"IDS": ids, "RANK": "*i32", "BASE": "*i32", "M_SIZES": "*i32",
                                    "M_OFFSETS": "*i32", "TOTALS": "*i32", "n_copies": "i32", "n_chunks": "i32",
                                    "n_experts": "i32", "max_len": "i32", "OUT": "*i32", "CHUNK": "constexpr",
                                    "BLOCK_S": "constexpr"}))
        variants.append((tables, {"COUNTS": "*i32", "n_chunks": "i32", "n_experts": "i32", "alignment": "i32",
                                  "M_SIZES": "*i32", "M_OFFSETS": "*i32", "TOTALS": "*i32", "BASE": "*i32",
                                  "ROWS": "constexpr", "BLOCK_E": "constexpr"}))
    return variants


# ---------------------------------------------------------------------------------------------------
# The ops' contract, shared by both front ends: argument rules, then the launch recipes.

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
                  src_row_stride: int, raw: str | None = None, search: bool = False) -> tuple[Step, ...]:
    """The gather into `out`; with `raw`, through that scatter of `idx` (unpermute: settled in the gather);
    with `search`, unpermute's one-launch form."""
    if n_out * n_cols == 0 or n_src_rows == 0:  # nothing to read: every row is a zero row
        return (Step(None, (), (Buffer(out, (n_out, n_cols), dtype, fill=0),)),)
    plan = plan_gather_rows(n_out, n_cols, ITEMSIZE[dtype], src_row_stride, settled=raw is not None, search=search)
    return (Step(plan, (src, idx) if raw is None else (src, raw, idx), (Buffer(out, (n_out, n_cols), dtype),),
                 dict(n_rows=n_out, n_cols=n_cols, n_src_rows=n_src_rows, src_row_stride=src_row_stride)),)


def _scatter_step(idx: str, n_slots: int, num_rows: int, index_dtype: str) -> Step:
    return Step(plan_scatter_inverse(n_slots), (idx,), (Buffer("raw", (num_rows,), index_dtype),),
                dict(n_slots=n_slots, n_rows=num_rows))


def _inverse_steps(idx: str, inv: str, n_slots: int, num_rows: int, index_dtype: str) -> tuple[Step, ...]:
    if num_rows == 0 or n_slots == 0:  # no slot names any row
        return (Step(None, (), (Buffer(inv, (num_rows,), index_dtype, fill=-1),)),)
    *scatter, last = plan_inverse(n_slots, num_rows)
    out = (Buffer(inv, (num_rows,), index_dtype),)
    scalars = dict(n_slots=n_slots, n_rows=num_rows)
    if not scatter:  # the search: one launch
        return (Step(last, (idx,), out, scalars),)
    return (_scatter_step(idx, n_slots, num_rows, index_dtype), Step(last, (idx, "raw"), out, scalars))


@functools.lru_cache(maxsize=4096, typed=True)
def permute_recipe(n_slots: int, n_cols: int, n_src_rows: int, dtype: str, src_row_stride: int,
                   top_k: int = 1, index_dtype: str = "int32", token_major: bool | None = None) -> Recipe:
    """Inputs x [n_src_rows, n_cols] (last dim contiguous, rows `src_row_stride` apart) and idx [n_slots] of
    `index_dtype`; result out [n_slots, n_cols] contiguous. With top_k > 1, x holds one row per token and idx
    names routed copies (slot s reads row idx[s] // top_k): up to ONE_LAUNCH_SLOTS slots one gather launch
    (host-bound calls), above it token-major (the same result: the raw scatter of idx, then
    `_scatter_token_rows_kernel`, which reads each token row once where the gather reads it once per copy);
    `token_major` True or False forces a form (`tools.moe_probe` times both)."""
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
    block_m, block_h, num_warps = _token_tile(n_cols, ITEMSIZE[dtype])
    token_programs = cdiv(n_src_rows, block_m)
    plan = Launch(_scatter_token_rows_kernel, (max(1, token_programs + cdiv(n_slots, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, src_row_stride), "BLOCK_M": block_m, "BLOCK_H": block_h,
                   "TOP_K": top_k})
    rows = Step(plan, ("x", "raw", "idx"), (Buffer("out", (n_slots, n_cols), dtype),),
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
      [n_slots]; result out [num_rows, n_cols]: the raw scatter of the inverse permutation, then the gather
      through it (settled there); or, when `one_launch(n_slots)`, one launch.
    - top_k > 1, no probs (probs_dtype None): the copy-sum, out [num_rows // top_k, n_cols], each token's
      top_k copies summed in FP32.
    - probs (probs_dtype given, input probs [num_rows], flat): the weighted combine, out [num_rows // top_k,
      n_cols]. Both: the raw scatter, then `_combine_rows_kernel`.
    The backward: `permute_recipe(..., top_k)` without probs (dy only), `combine_bwd_recipe` with them."""
    check_gather_sizes(n_slots, num_rows)
    if top_k > 1 or probs_dtype is not None:
        return _combine_recipe(n_slots, n_cols, num_rows, dtype, src_row_stride, index_dtype, top_k, probs_dtype)
    if one_launch(n_slots):
        return Recipe(_gather_steps("y", "idx", "out", num_rows, n_cols, n_slots, dtype, src_row_stride,
                                    search=True), ("out",))
    gather = _gather_steps("y", "idx", "out", num_rows, n_cols, n_slots, dtype, src_row_stride, raw="raw")
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
    combine = Step(plan, ("y", "raw", "idx", "idx" if probs_dtype is None else "probs"), (out,),
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
    the raw scatter of idx, then `_combine_bwd_token_kernel`, which reads each dout row once where the
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
    block_m, block_h, num_warps = _token_tile(n_cols, ITEMSIZE[dtype])
    token_programs = cdiv(n_tokens, block_m)
    plan = Launch(_combine_bwd_token_kernel, (max(1, token_programs + cdiv(n_slots, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, dout_row_stride, y_row_stride), "BLOCK_M": block_m,
                   "BLOCK_H": block_h, "TOP_K": top_k, "K_PAD": next_pow2(top_k)})
    grads = Step(plan, ("dout", "y", "raw", "idx", "probs"),
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


# ---------------------------------------------------------------------------------------------------
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
