"""The permute ops' row kernels (the contract: `xkern.permute`; their plans: `plans.py`).

  _gather_rows_kernel      out[i, :] = src[idx[i], :], a zero row where idx[i] is -1 (or out of range):
                           permute_rows and unpermute_rows's backward. With BLOCK_S, unpermute_rows in one
                           launch for up to ONE_LAUNCH_SLOTS slots (`one_launch`): each program finds its rows'
                           slots by scanning all of idx (work rows x slots; saves a launch where the call is
                           host-bound).
  _gather_verified_rows_kernel  out[r, :] = y[slot_of[r], :] if idx[slot_of[r]] == r, else a zero row: unpermute_rows
                           and permute_rows's backward, after `_scatter_inverse_kernel` (index_kernels.py):
                           two launches, the check folded into the gather.
  _gather_token_rows_kernel  permute_rows with top_k: slot s reads token idx[s] // top_k (x keeps one row per
                           token; no [T * top_k, H] copy);
  _scatter_token_rows_kernel the same, token-major: each token row read once, written to its copies' slots
                           (after _scatter_inverse_kernel); padding slots zeroed by the programs after them.
                           Above ONE_LAUNCH_SLOTS slots (`permute_recipe`);
  _combine_rows_kernel     unpermute_rows with top_k or probs: out[t] = sum_j p[t, j] * y[slot of t * top_k + j]
                           in FP32, j in order, rounded once, slots through the inverse scatter verified on the fly
                           (after _scatter_inverse_kernel: two launches); also permute_rows(top_k)'s backward;
  _combine_bwd_kernel      the weighted combine's backward, per slot: dy[s] = p * dout[t] and dprobs[r] =
                           sum_h y[s, h] * dout[t, h] (FP32) from one read of each row, no atomics;
  _combine_bwd_token_kernel  the same, token-major: each dout row read once (after _scatter_inverse_kernel).
                           Above ONE_LAUNCH_SLOTS slots (`combine_bwd_recipe`).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _gather_verified_rows_kernel(
    SRC, SLOT_OF, IDX,
    n_rows, n_cols, n_src_rows, src_row_stride,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # unpermute's gather through SLOT_OF, `_scatter_inverse_kernel`'s output, verified on the fly (one launch
    # fewer than verifying into an inverse first): row r reads slot SLOT_OF[r] only if IDX[that slot] == r, so
    # SLOT_OF's uninitialised entries (rows no slot names) give zero rows. SRC has one row per slot.
    n_cols = n_cols // ROW_ALIGN * ROW_ALIGN
    src_row_stride = src_row_stride // ROW_ALIGN * ROW_ALIGN
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    slot = tl.load(SLOT_OF + rows, mask=row_mask, other=-1).to(tl.int64)
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
def _verified_slot(SLOT_OF, IDX, copy, tok_mask, n_slots):
    # The slot of each `copy` (SLOT_OF[copy], the inverse scatter's) where IDX names the copy there, and that mask.
    slot = tl.load(SLOT_OF + copy, mask=tok_mask, other=-1).to(tl.int64)
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
    SRC, SLOT_OF, IDX,
    n_tokens, n_cols, n_slots, src_row_stride, token_programs,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr,
):
    # permute_rows(top_k) token-major (`permute_recipe`): the first `token_programs` programs read
    # BLOCK_M token rows once and write each to the slots of its TOP_K copies (SLOT_OF[copy], verified against IDX as in
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
                # `_verified_slot` written out: a store through a call's result counts, in torch.compile's
                # access analysis, as a write to every pointer passed to the call (here SLOT_OF and IDX)
                copy = first + j
                slot = tl.load(SLOT_OF + copy, mask=tok_mask, other=-1).to(tl.int64)
                ok = tok_mask & (slot >= 0) & (slot < n_slots)
                hit = ok & (tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64) == copy)
                tl.store(OUT + slot[:, None] * n_cols + cols[None, :], vals, mask=hit[:, None] & col_mask)
    else:
        _zero_padding_rows(OUT, IDX, pid - token_programs, n_slots, n_tokens * TOP_K, n_cols,
                           BLOCK_M, BLOCK_H)


@triton.jit
def _combine_copy(SRC, SLOT_OF, IDX, PROBS, copy, tok_mask, n_src_rows, src_row_stride, cols, col_mask,
                  HAS_PROBS: tl.constexpr):
    # One routed copy's term of `_combine_rows_kernel`, FP32: p * SRC[its slot], 0 where it has none.
    slot, hit = _verified_slot(SLOT_OF, IDX, copy, tok_mask, n_src_rows)
    vals = tl.load(SRC + slot[:, None] * src_row_stride + cols[None, :], mask=hit[:, None] & col_mask,
                   other=0.0).to(tl.float32)
    if HAS_PROBS:
        vals = vals * tl.load(PROBS + copy, mask=hit, other=0.0).to(tl.float32)[:, None]
    return vals


@triton.jit(do_not_specialize=["n_tokens", "n_cols", "n_src_rows", "src_row_stride", "top_k"])
def _combine_rows_kernel(
    SRC, SLOT_OF, IDX, PROBS,
    n_tokens, n_cols, n_src_rows, src_row_stride, top_k,
    OUT,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, HAS_PROBS: tl.constexpr, TOP_K: tl.constexpr,
):
    # out[t] = sum_j p[t, j] * SRC[slot of copy t * top_k + j], FP32 in j order, one rounding. The slot is
    # SLOT_OF[copy] (`_scatter_inverse_kernel`'s output) if IDX names the copy there, as in
    # _gather_verified_rows_kernel: a dropped copy (no slot) adds 0. Without HAS_PROBS, p = 1 (PROBS unread).
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
                acc += _combine_copy(SRC, SLOT_OF, IDX, PROBS, first + j, tok_mask, n_src_rows, src_row_stride, cols,
                                     col_mask, HAS_PROBS)
        else:
            for j in tl.static_range(TOP_K):
                acc += _combine_copy(SRC, SLOT_OF, IDX, PROBS, first + j, tok_mask, n_src_rows, src_row_stride, cols,
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
    DOUT, Y, SLOT_OF, IDX, PROBS,
    n_tokens, n_cols, n_slots, dout_row_stride, y_row_stride, token_programs,
    DY, DPROBS,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
):
    # `_combine_bwd_kernel` token-major (`combine_bwd_recipe`): the first `token_programs` programs
    # read BLOCK_M rows of DOUT once and, for each of their TOP_K copies with a slot (SLOT_OF verified against
    # IDX), write DY[slot] = p * DOUT[t] and sum DPROBS[copy] = sum_h Y[slot, h] * DOUT[t, h] in FP32, chunk by chunk as
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
            for j in tl.static_range(TOP_K):  # `_verified_slot` written out, as in _scatter_token_rows_kernel
                copy = first + j
                slot = tl.load(SLOT_OF + copy, mask=tok_mask, other=-1).to(tl.int64)
                ok = tok_mask & (slot >= 0) & (slot < n_slots)
                hit = ok & (tl.load(IDX + slot, mask=ok, other=-1).to(tl.int64) == copy)
                p = tl.load(PROBS + copy, mask=hit, other=0.0).to(tl.float32)
                y = tl.load(Y + slot[:, None] * y_row_stride + cols[None, :], mask=hit[:, None] & col_mask,
                            other=0.0).to(tl.float32)
                tl.store(DY + slot[:, None] * n_cols + cols[None, :], (d * p[:, None]).to(DY.dtype.element_ty),
                         mask=hit[:, None] & col_mask)
                dots = tl.where(ks == j, dots + tl.sum(y * d, axis=1)[:, None], dots)
        for j in tl.static_range(TOP_K):  # the call's result only masks the store here
            _, hit = _verified_slot(SLOT_OF, IDX, first + j, tok_mask, n_slots)
            dot = tl.sum(tl.where(ks == j, dots, 0.0), axis=1)
            tl.store(DPROBS + first + j, dot.to(DPROBS.dtype.element_ty), mask=hit)
    else:
        _zero_padding_rows(DY, IDX, pid - token_programs, n_slots, n_tokens * TOP_K, n_cols,
                           BLOCK_M, BLOCK_H)
